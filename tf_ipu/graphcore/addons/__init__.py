"""Graphcore's IPU TensorFlow Addons (``ipu_tensorflow_addons``), mapped onto this project: ported
code keeps ``from ipu_tensorflow_addons.keras import layers``.

    import ipu_tensorflow_addons                 -> this package (``install()``)
      .keras.layers.Embedding, LSTM, GRU, ...    -> Keras 3 layers with Graphcore's arguments
        (tf_ipu/graphcore/addons/keras/layers/)   that lower to XLA: they run on CPU as Keras
                                                  and under tf_ipu.IPUStrategy on the device
      .keras.optimizers.AdamIpuOptimizer, ...    -> Keras 3 optimizers with Graphcore's state
        (tf_ipu/graphcore/addons/keras/optimizers/) dtypes and compute precisions

Graphcore's layers called PopLibs kernels (fused LSTM/GRU, poprand dropout, popnn group norm,
serialized matmuls). Here each is the Keras layer computing the same values (the LSTM and GRU
keep Keras's weight layout, which Graphcore's shared), and the arguments that only steered
PopLibs' planning are accepted, kept in the config and named once in a warning
(``tf_ipu.notices``). Layers Graphcore has and this package has not are absent, never
placeholders: see the table in docs/porting.md, "ipu_tensorflow_addons layers".
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tf_ipu.graphcore.addons import keras

PACKAGE = "ipu_tensorflow_addons"


def _modules() -> dict[str, ModuleType]:
    """Graphcore's module names and the modules of this package that stand for them."""
    here = sys.modules[__name__]
    names = {PACKAGE: here, f"{PACKAGE}.keras": keras, f"{PACKAGE}.keras.layers": keras.layers,
             f"{PACKAGE}.keras.optimizers": keras.optimizers}
    for name, module in keras.layers.MODULES.items():
        names[f"{PACKAGE}.keras.layers.{name}"] = module
    for name, module in keras.optimizers.MODULES.items():
        names[f"{PACKAGE}.keras.optimizers.{name}"] = module
    return names


def install() -> bool:
    """Makes ``import ipu_tensorflow_addons`` (and its ``keras.layers`` and
    ``keras.optimizers`` modules) resolve to this package. Returns False, changing nothing, if
    another ``ipu_tensorflow_addons`` is imported or installed (Graphcore's own wheel, with Graphcore's TensorFlow); True otherwise. Calling
    it again is harmless.

    Example:
        >>> from tf_ipu.graphcore import addons
        >>> addons.install()
        True
        >>> from ipu_tensorflow_addons.keras.layers import LSTM
    """
    here = sys.modules[__name__]
    current = sys.modules.get(PACKAGE)
    if current is not None and current is not here:
        return False
    if current is None:
        try:
            real = importlib.util.find_spec(PACKAGE)
        except (ImportError, ValueError):
            real = None
        if real is not None:
            return False
    for name, module in _modules().items():
        sys.modules[name] = module
    return True


__all__ = ["PACKAGE", "install", "keras"]
