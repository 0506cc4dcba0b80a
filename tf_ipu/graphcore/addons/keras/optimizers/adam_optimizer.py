"""``ipu_tensorflow_addons.keras.optimizers.AdamIpuOptimizer``: Adam with optimizer state of its
own dtypes, as Graphcore defines it.

    t = iterations + 1; in the compute dtype c = optimizer_compute_precisions[0]:
    m' = b1 m + (1 - b1) g            v' = b2 v + (1 - b2) g^2       (stored as m_dtype, v_dtype)
    m^ = m' / (1 - b1^t)              v^ = v' / (1 - b2^t)           (debiasing=False: m', v')
    amsgrad: v^ = max(vhat, v^)                                      (stored as vhat_dtype)
    var <- var - cast(lr x m^ / (sqrt(v^) + epsilon), var.dtype)

With ``debiasing=True`` this is Keras's Adam but for where epsilon sits (Keras adds it to
sqrt(v'), before the bias correction: epsilon x sqrt(1 - b2^t) here); amsgrad keeps the
maximum of the bias-corrected v (Keras's of v'). It is a ``keras.optimizers.Adam``.
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
class AdamIpuOptimizer(keras.optimizers.Adam, IpuOptimizerBase):
    """Adam (Kingma and Ba, 2014; AMSGrad: Reddi et al.) whose state m, v and vhat may have
    dtypes of their own, computed in ``optimizer_compute_precisions[0]``.

    Args:
        learning_rate, beta_1, beta_2, epsilon, amsgrad: as Keras's Adam.
        name: the optimizer's name ("Adam").
        m_dtype, v_dtype, vhat_dtype: dtypes of the state (None: each variable's).
        debiasing: correct m and v for their zero initialisation.
        optimizer_compute_precisions: ``(dtype,)``, the update's compute dtype (float32).
        **kwargs: Keras 3's optimizer arguments, Keras 2's ``lr`` and ``decay``, and
            ``outline_apply_gradients`` (no effect).

    Example:
        >>> from ipu_tensorflow_addons.keras.optimizers import AdamIpuOptimizer
        >>> opt = AdamIpuOptimizer(1e-3, m_dtype="float16", v_dtype="float32")
    """

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, name: str = "Adam",
                 m_dtype: DTypeLike = None, v_dtype: DTypeLike = None,
                 vhat_dtype: DTypeLike = None, debiasing: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, amsgrad=amsgrad, name=name, **kwargs)
        self.m_dtype = as_dtype(m_dtype)
        self.v_dtype = as_dtype(v_dtype)
        self.vhat_dtype = as_dtype(vhat_dtype)
        self.debiasing = bool(debiasing)

    def get_slot_dtype(self, var: Any, slot_name: str) -> tf.DType | None:
        """m_dtype, v_dtype or vhat_dtype."""
        return {"m": self.m_dtype, "v": self.v_dtype, "vhat": self.vhat_dtype}[slot_name]

    def build(self, var_list: list[Any]) -> None:
        """The slots m and v (and vhat with amsgrad) of every variable, in their dtypes."""
        if self.built:
            return
        keras.optimizers.Optimizer.build(self, var_list)  # the base build, not Adam's slots
        self._momentums = [self.add_slot(v, "m") for v in var_list]
        self._velocities = [self.add_slot(v, "v") for v in var_list]
        if self.amsgrad:
            self._velocity_hats = [self.add_slot(v, "vhat") for v in var_list]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        """One Adam step of ``variable`` (the module docstring's formulas)."""
        c = self.compute_dtype(0)
        i = self._get_variable_index(variable)
        m, v = self._momentums[i], self._velocities[i]
        next_m, next_v, m_hat, v_hat = self.adam_moments(gradient, m, v, c)
        if self.amsgrad:
            vhat = self._velocity_hats[i]
            v_hat = tf.maximum(tf.cast(vhat, c), v_hat)
            self.assign(vhat, tf.cast(v_hat, vhat.dtype))
        update = m_hat / (tf.sqrt(v_hat) + tf.cast(value_of(self.epsilon), c))
        step = tf.cast(learning_rate, c) * update
        self.assign(variable, variable - tf.cast(step, variable.dtype))
        self.assign(m, tf.cast(next_m, m.dtype))
        self.assign(v, tf.cast(next_v, v.dtype))

    def get_config(self) -> dict[str, Any]:
        """Keras's Adam config plus the state dtypes, debiasing and compute precisions."""
        config = super().get_config()
        config.update({"m_dtype": dtype_name(self.m_dtype), "v_dtype": dtype_name(self.v_dtype),
                       "vhat_dtype": dtype_name(self.vhat_dtype), "debiasing": self.debiasing})
        return config


__all__ = ["AdamIpuOptimizer"]
