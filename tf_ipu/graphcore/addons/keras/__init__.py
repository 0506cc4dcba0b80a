"""``ipu_tensorflow_addons.keras``: Graphcore's IPU Keras ``layers`` and ``optimizers`` (its
``experimental`` is not here)."""

from tf_ipu.graphcore.addons.keras import layers, optimizers

__all__ = ["layers", "optimizers"]
