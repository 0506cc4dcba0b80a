"""``ipu_tensorflow_addons.keras.optimizers.SGDIpuOptimizer``: gradient descent with momentum whose
accumulator may have a dtype of its own, as Graphcore defines it.

    momentum 0:  var <- var - lr x g                        (in the variable's dtype)
    momentum m:  in c = optimizer_compute_precisions[0]:
                 a' = m a - lr g                            (stored as momentum_accum_dtype)
                 var <- var + cast(a', var.dtype)            nesterov: cast(m a' - lr g, ...)

Keras's SGD step (and a ``keras.optimizers.SGD``); only the accumulator's dtype and the
compute dtype are Graphcore's.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_ipu.graphcore.addons.keras.optimizers.ipu_optimizer_base import (
    DTypeLike,
    IpuOptimizerBase,
    as_dtype,
    dtype_name,
    register,
    value_of,
)


@register
class SGDIpuOptimizer(keras.optimizers.SGD, IpuOptimizerBase):
    """SGD (with momentum, optionally Nesterov's) whose momentum accumulator may have a
    dtype of its own, computed in ``optimizer_compute_precisions[0]``.

    Args:
        learning_rate, momentum, nesterov: as Keras's SGD (``momentum`` may be an int).
        name: the optimizer's name ("SGD").
        momentum_accum_dtype: dtype of the accumulator (None: each variable's).
        optimizer_compute_precisions: ``(dtype,)``, the momentum update's compute dtype.
        **kwargs: Keras 3's optimizer arguments, Keras 2's ``lr`` and ``decay``, and
            ``outline_apply_gradients`` (no effect).

    Example:
        >>> from ipu_tensorflow_addons.keras.optimizers import SGDIpuOptimizer
        >>> opt = SGDIpuOptimizer(0.01, momentum=0.9, momentum_accum_dtype="float16")
    """

    def __init__(self, learning_rate: Any = 0.01, momentum: float = 0.0,
                 nesterov: bool = False, name: str = "SGD",
                 momentum_accum_dtype: DTypeLike = None, **kwargs: Any) -> None:
        if isinstance(momentum, int) and not isinstance(momentum, bool):
            momentum = float(momentum)  # Keras 3 insists on a float
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov,
                         name=name, **kwargs)
        self.momentum_accum_dtype = as_dtype(momentum_accum_dtype)

    def get_slot_dtype(self, var: Any, slot_name: str) -> tf.DType | None:
        """momentum_accum_dtype."""
        return self.momentum_accum_dtype

    def build(self, variables: list[Any]) -> None:
        """The momentum accumulators (none without momentum), in their dtype."""
        if self.built:
            return
        keras.optimizers.Optimizer.build(self, variables)  # the base build, not SGD's slots
        self.momentums = []
        if self.momentum != 0:
            self.momentums = [self.add_slot(v, "momentum") for v in variables]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        """One SGD step of ``variable`` (the module docstring's formulas)."""
        if self.momentum == 0:
            lr = tf.cast(learning_rate, variable.dtype)
            g = tf.cast(tf.convert_to_tensor(gradient), variable.dtype)
            self.assign(variable, variable - lr * g)
            return
        c = self.compute_dtype(0)
        accum = self.momentums[self._get_variable_index(variable)]
        g = tf.cast(tf.convert_to_tensor(gradient), c)
        lr = tf.cast(learning_rate, c)
        mom = tf.cast(value_of(self.momentum), c)
        next_accum = tf.cast(accum, c) * mom - lr * g
        delta = next_accum * mom - lr * g if self.nesterov else next_accum
        self.assign(variable, variable + tf.cast(delta, variable.dtype))
        self.assign(accum, tf.cast(next_accum, accum.dtype))

    def get_config(self) -> dict[str, Any]:
        """Keras's SGD config plus the accumulator dtype and compute precisions."""
        config = super().get_config()
        config["momentum_accum_dtype"] = dtype_name(self.momentum_accum_dtype)
        return config


__all__ = ["SGDIpuOptimizer"]
