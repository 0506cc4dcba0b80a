"""``ipu_tensorflow_addons.keras``: only ``layers`` is here (Graphcore's ``optimizers`` and
``experimental`` are not)."""

from tf_ipu.graphcore.addons.keras import layers

__all__ = ["layers"]
