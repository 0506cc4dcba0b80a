"""``ipu_tensorflow_addons.keras.optimizers.LAMBIpuOptimizer``: LAMB (You et al., 2019, "Large
Batch Optimization for Deep Learning: Training BERT in 76 minutes"), as Graphcore defines it.

    t = iterations + 1; stage 1 in c1 = optimizer_compute_precisions[0]:
    m' = b1 m + (1 - b1) g            v' = b2 v + (1 - b2) g^2       (stored as m_dtype, v_dtype)
    m^ = m' / (1 - b1^t)              v^ = v' / (1 - b2^t)           (debiasing=False: m', v')
    u  = m^ / (sqrt(v^) + epsilon) + weight_decay_rate x var         (decay unless excluded)
    trust ratio r = ||var|| / ||u|| if ||var|| > 0 and ||u|| > 0, else 1    (L2 norms over the
        whole variable; ||var|| clipped to weight_norm_clip if given; r = 1 for a variable
        excluded from layer adaptation)
    stage 2 in c2 = optimizer_compute_precisions[1]:
    var <- var - cast(cast(lr x r, c2) x cast(u, c2), var.dtype)

``exclude_from_weight_decay`` and ``exclude_from_layer_adaptation`` are regular expressions
searched in the variable's path (``dense/kernel``: Keras 3's spelling of the names Graphcore
matched). Keras's own ``weight_decay`` argument (decoupled decay, applied before the step) is
Keras's and separate. It is a ``keras.optimizers.Lamb``; with ``weight_decay_rate=0`` and no
clip it computes Keras's Lamb step (Graphcore's epsilon default is 1e-6, Keras's 1e-7).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
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
class LAMBIpuOptimizer(keras.optimizers.Lamb, IpuOptimizerBase):
    """Layer-wise Adaptive Moments: Adam's step scaled per variable by the trust ratio
    ||var|| / ||update||, with state m and v of their own dtypes.

    Args:
        learning_rate, beta_1, beta_2, epsilon: as Adam's (epsilon 1e-6).
        weight_decay_rate: L2 decay added to the update before the trust ratio.
        exclude_from_weight_decay, exclude_from_layer_adaptation: lists of regular
            expressions; a variable whose path matches one gets no decay / a ratio of 1.
        name: the optimizer's name ("LAMB").
        debiasing: correct m and v for their zero initialisation.
        m_dtype, v_dtype: dtypes of the state (None: each variable's).
        weight_norm_clip: upper bound of ||var|| in the ratio (None: none).
        optimizer_compute_precisions: two dtypes: the update's, and the final
            lr x ratio x update's.
        **kwargs: Keras 3's optimizer arguments, Keras 2's ``lr`` and ``decay``, and
            ``outline_apply_gradients`` (no effect).

    Example:
        >>> from ipu_tensorflow_addons.keras.optimizers import LAMBIpuOptimizer
        >>> opt = LAMBIpuOptimizer(1e-3, weight_decay_rate=0.01,
        ...                        exclude_from_weight_decay=["bias", "normalization"])
    """

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-6, weight_decay_rate: float = 0.0,
                 exclude_from_weight_decay: Sequence[str] | None = None,
                 exclude_from_layer_adaptation: Sequence[str] | None = None,
                 name: str = "LAMB", debiasing: bool = True, m_dtype: DTypeLike = None,
                 v_dtype: DTypeLike = None, weight_norm_clip: float | None = None,
                 optimizer_compute_precisions: tuple[DTypeLike, ...] = (tf.float32, tf.float32),
                 **kwargs: Any) -> None:
        if not isinstance(optimizer_compute_precisions, (list, tuple)) or \
                len(optimizer_compute_precisions) != 2:
            raise ValueError(
                "LAMBIpuOptimizer: optimizer_compute_precisions must be two dtypes (the "
                "update's, and the final lr x trust ratio x update's); got "
                f"{optimizer_compute_precisions!r}")
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon or keras.config.epsilon(), name=name,
                         optimizer_compute_precisions=optimizer_compute_precisions, **kwargs)
        self.weight_decay_rate = weight_decay_rate
        self.exclude_from_layer_adaptation = list(exclude_from_layer_adaptation or []) or None
        # Keras 3's optimizers have a method exclude_from_weight_decay (for Keras's own
        # weight_decay): Graphcore's patterns live apart.
        self.weight_decay_exclusions = list(exclude_from_weight_decay or []) or None
        self.weight_norm_clip = weight_norm_clip
        self.m_dtype = as_dtype(m_dtype)
        self.v_dtype = as_dtype(v_dtype)
        self.debiasing = bool(debiasing)

    def get_slot_dtype(self, var: Any, slot_name: str) -> tf.DType | None:
        """m_dtype or v_dtype."""
        return {"m": self.m_dtype, "v": self.v_dtype}[slot_name]

    def build(self, var_list: list[Any]) -> None:
        """The slots m and v of every variable, in their dtypes."""
        if self.built:
            return
        keras.optimizers.Optimizer.build(self, var_list)  # the base build, not Lamb's slots
        self._momentums = [self.add_slot(v, "m") for v in var_list]
        self._velocities = [self.add_slot(v, "v") for v in var_list]

    @staticmethod
    def _get_variable_name(variable: Any) -> str:
        """The name the exclusion patterns are searched in: the variable's path."""
        name = getattr(variable, "path", None) or str(getattr(variable, "name", variable))
        return re.sub(r":\d+$", "", name)

    def _do_use_weight_decay(self, param_name: str) -> bool:
        """Whether ``param_name`` gets the L2 weight decay."""
        return not any(re.search(p, param_name) for p in self.weight_decay_exclusions or [])

    def _do_layer_adaptation(self, param_name: str) -> bool:
        """Whether ``param_name``'s step is scaled by the trust ratio."""
        return not any(re.search(p, param_name) for p in self.exclude_from_layer_adaptation or [])

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        """One LAMB step of ``variable`` (the module docstring's formulas)."""
        c1, c2 = self.compute_dtype(0), self.compute_dtype(1)
        name = self._get_variable_name(variable)
        i = self._get_variable_index(variable)
        m, v = self._momentums[i], self._velocities[i]
        next_m, next_v, m_hat, v_hat = self.adam_moments(gradient, m, v, c1)
        update = m_hat / (tf.sqrt(v_hat) + tf.cast(value_of(self.epsilon), c1))
        if self._do_use_weight_decay(name):
            update += tf.cast(variable, c1) * tf.cast(value_of(self.weight_decay_rate), c1)
        ratio = tf.constant(1.0, c1)
        if self._do_layer_adaptation(name):
            w_norm = tf.norm(tf.reshape(tf.cast(variable, c1), [-1]), ord=2)
            u_norm = tf.norm(tf.reshape(update, [-1]), ord=2)
            if self.weight_norm_clip is not None:
                w_norm = tf.minimum(w_norm, tf.cast(self.weight_norm_clip, c1))
            one = tf.ones_like(w_norm)
            ratio = tf.where(w_norm > 0, tf.where(u_norm > 0, w_norm / u_norm, one), one)
        scale = tf.cast(tf.cast(learning_rate, c1) * ratio, c2)
        step = scale * tf.cast(update, c2)
        self.assign(variable, variable - tf.cast(step, variable.dtype))
        self.assign(m, tf.cast(next_m, m.dtype))
        self.assign(v, tf.cast(next_v, v.dtype))

    def get_config(self) -> dict[str, Any]:
        """Keras's Lamb config plus Graphcore's arguments."""
        config = super().get_config()
        config.update({
            "weight_decay_rate": self.weight_decay_rate,
            "exclude_from_weight_decay": self.weight_decay_exclusions,
            "exclude_from_layer_adaptation": self.exclude_from_layer_adaptation,
            "debiasing": self.debiasing, "m_dtype": dtype_name(self.m_dtype),
            "v_dtype": dtype_name(self.v_dtype), "weight_norm_clip": self.weight_norm_clip})
        return config


__all__ = ["LAMBIpuOptimizer"]
