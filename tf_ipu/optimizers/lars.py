"""``tf_ipu.optimizers.LARS``: layer-wise adaptive rate scaling (You, Gitman and Ginsburg,
"Large Batch Training of Convolutional Networks", arXiv:1708.03888) with momentum, as a Keras 3
optimizer, with the semantics of the MLPerf ResNet-50 reference (mlcommons/training,
``image_classification/tensorflow2/lars_optimizer.py``) and of Graphcore's ResNet-50
submissions to MLPerf Training v1.1 and v2.0 (mlcommons/training_results_v1.1 and v2.0,
``Graphcore/benchmarks/resnet/implementations/tensorflow/lars_optimizer.py``, used by their
``mk2_resnet50_mlperf_pod*_lars`` configurations). Per variable w with gradient g, learning
rate lr, each step:

    adapted (no ``skip_list`` string in the variable's path):
        trust  = eeta x |w| / (|g| + weight_decay x |w| + epsilon)   if |w| > 0 and |g| > 0
               = 1                                                    otherwise
        g      = g + weight_decay x w
        lr_w   = lr x trust
    skipped (e.g. batch norm's gamma and beta, biases): lr_w = lr, g unchanged
    m  <- momentum x m - lr_w x g
    w  <- w + m                          (nesterov: w + momentum x m - lr_w x g)

|.| is the L2 norm of the whole variable (one reduction over all its elements per variable and
per step, for w and for g). The norms are computed in float32 whatever the variable's dtype
(a float16 gradient's sum of squares can exceed float16's range); the rest in the variable's
dtype, as the reference does. ``epsilon`` is used as given: Graphcore's submissions pass 0.0 and
use it as 0.0; the TF2 reference replaces 0.0 by Keras's epsilon (1e-7). Graphcore's default
``skip_list`` (its ``--lars-skip-list``) is ("beta", "gamma", "bias"); the reference's example
is ("batch_normalization", "bias"), the same variables in TF1's names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
from keras import ops

__all__ = ["LARS"]

#: Graphcore's ``--lars-skip-list`` default (train.py of the v1.1 and v2.0 submissions).
DEFAULT_SKIP_LIST = ("beta", "gamma", "bias")


@keras.saving.register_keras_serializable(package="tf_ipu")
class LARS(keras.optimizers.Optimizer):
    """LARS with momentum (see the module docstring for the update).

    Args:
        learning_rate: the base learning rate (a float or a Keras schedule).
        momentum: the momentum coefficient, in [0, 1).
        weight_decay: LARS's weight decay (added to adapted variables' gradients, and in the
            trust ratio's denominator), >= 0. Not Keras's decoupled weight decay.
        eeta: the LARS coefficient (trust coefficient), > 0.
        epsilon: added to the trust ratio's denominator, >= 0.
        skip_list: substrings of variable paths (``variable.path``, e.g. "conv1_bn/gamma")
            whose variables are not adapted and get no weight decay.
        nesterov: Nesterov momentum.
        name: the optimizer's name.
        **kwargs: Keras 3's optimizer arguments (``clipnorm``, ``global_clipnorm``,
            ``gradient_accumulation_steps``, ...), but not ``weight_decay``'s decoupled form.

    Example:
        >>> opt = tf_ipu.optimizers.LARS(10.72, momentum=0.9, weight_decay=5e-5)
    """

    def __init__(self, learning_rate: Any = 0.1, momentum: float = 0.9,
                 weight_decay: float = 1e-4, eeta: float = 0.001, epsilon: float = 0.0,
                 skip_list: Iterable[str] | None = DEFAULT_SKIP_LIST, nesterov: bool = False,
                 name: str = "LARS", **kwargs: Any) -> None:
        for what, value, ok, need in (
                ("momentum", momentum, lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
                ("weight_decay", weight_decay, lambda v: v >= 0.0, ">= 0"),
                ("eeta", eeta, lambda v: v > 0.0, "> 0"),
                ("epsilon", epsilon, lambda v: v >= 0.0, ">= 0")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"LARS: {what}={value!r} must be a number {need}")
        if isinstance(skip_list, str):
            raise ValueError(f"LARS: skip_list={skip_list!r} must be a list of strings, not "
                             f"one string")
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = float(momentum)
        self.lars_weight_decay = float(weight_decay)
        self.eeta = float(eeta)
        self.epsilon = float(epsilon)
        self.skip_list = tuple(skip_list or ())
        self.nesterov = bool(nesterov)

    def adapted(self, variable: Any) -> bool:
        """True if ``variable`` gets LARS's trust ratio and weight decay (no ``skip_list``
        string in its path)."""
        path = str(getattr(variable, "path", None) or variable.name)
        return not any(s in path for s in self.skip_list)

    def build(self, variables: list[Any]) -> None:
        """One momentum slot per variable, in its dtype."""
        if self.built:
            return
        super().build(variables)
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in variables]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        """One LARS step of ``variable`` (the module docstring's formulas)."""
        dtype = variable.dtype
        g = ops.cast(gradient, dtype)
        lr = ops.cast(learning_rate, dtype)
        if self.adapted(variable):
            w32, g32 = ops.cast(variable, "float32"), ops.cast(g, "float32")
            w_norm = ops.sqrt(ops.sum(ops.square(w32)))
            g_norm = ops.sqrt(ops.sum(ops.square(g32)))
            ratio = self.eeta * w_norm / (g_norm + self.lars_weight_decay * w_norm + self.epsilon)
            trust = ops.where(ops.greater(w_norm, 0.0),
                              ops.where(ops.greater(g_norm, 0.0), ratio, 1.0), 1.0)
            g = g + ops.cast(self.lars_weight_decay, dtype) * variable
            lr = lr * ops.cast(trust, dtype)
        m = self.momentums[self._get_variable_index(variable)]
        mom = ops.cast(self.momentum, dtype)
        next_m = mom * m - lr * g
        self.assign(m, next_m)
        step = mom * next_m - lr * g if self.nesterov else next_m
        self.assign(variable, variable + step)

    def get_config(self) -> dict[str, Any]:
        """Keras's optimizer config with LARS's arguments (``weight_decay`` is LARS's)."""
        config = super().get_config()
        config.update({"momentum": self.momentum, "weight_decay": self.lars_weight_decay,
                       "eeta": self.eeta, "epsilon": self.epsilon,
                       "skip_list": list(self.skip_list), "nesterov": self.nesterov})
        return config
