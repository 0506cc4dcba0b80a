"""Automatic loss scaling (ALS): Graphcore's ``keras.ipu.optimizers.ALSOptimizer`` and
``ALSGradientAccumulationOptimizer``, for Keras 3 optimizers.

One training step with ``ALSOptimizer(inner)``; LSF is the loss scaling factor::

    loss --x LSF--> scaled loss --backprop--> scaled gradients g
                                                   |
    apply(g):  hist += [n(|g| < edge), n(|g| >= edge or NaN)]      float16 g only, scaled by
               inner.apply(g / LSF)                                (1 - lpf_alpha)
               every update period (counter n > 0, n % update_frequency == 0; or
               update_frequency == 1):
                   ratio = hist[1] / (hist[0] + hist[1])            (NaN without float16 g)
                   new = LSF * increase_factor   if not ratio > ratio_threshold
                         LSF / increase_factor   otherwise
                   LSF = new unless new is not finite, >= max_loss_scaling_factor or < 1
                   hist = 0; n = 0
               else: n += 1

The state is four optimizer variables, created with the optimizer: ``gradient_histogram``
(float32 [2]), ``lsf_update_counter`` (int32), ``loss_scaling_factor`` and
``prev_loss_scaling_factor`` (float32). A step is TensorFlow ops only (no Python side effects),
so it is traced into Keras's train function and lowered to the device program under
``IPUStrategy`` as it runs on the CPU.

``ALSGradientAccumulationOptimizer(als, num_mini_batches)`` sums (or averages) the unscaled
gradients of ``num_mini_batches`` calls and applies them at the last; every call's gradients
go into the histogram, and the update counter and the LSF move once per weight update. So do
they when the wrapped optimizer accumulates itself (Keras's ``gradient_accumulation_steps``).

Both are ``keras.optimizers.LossScaleOptimizer``s, so that ``compile`` of a ``mixed_float16``
model does not wrap them in Keras's own dynamic loss scaling: the scaling is theirs. Keras's
``fit`` multiplies the loss by ``optimizer.scale_loss`` and hands the scaled gradients to
``apply_gradients``; a custom loop does the same (``tape.gradient(opt.scale_loss(loss), v)``,
or Graphcore's ``opt.get_gradients(loss, v)`` inside a ``tf.function``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src.utils import tracking

from tf_ipu import notices

_LossScaleOptimizer = keras.optimizers.LossScaleOptimizer
_Optimizer = keras.optimizers.Optimizer

#: Graphcore's defaults (SDK 3.1-3.4).
DEFAULTS: dict[str, Any] = {
    "initial_loss_scaling_factor": 1,
    "update_frequency": 8,
    "increase_factor": 2,
    "max_loss_scaling_factor": 32768,
    "accumulate_statistics_over_update_period": True,
    "ratio_threshold": 10e-6,
    "captured_grads_only": False,
    "lpf_alpha": 0.0,
    "histogram_bin_edge": 2**13,
}

#: Gradient accumulation reductions: what each mini-batch's gradient adds to the accumulator.
REDUCTIONS = ("SUM", "MEAN", "RUNNING_MEAN")

CapturedGrads = Mapping[Any, Any] | Sequence[Any] | None


def _is_power_of_two(value: Any) -> bool:
    """1, 2, 4, ... (an int, or a float with an integral power-of-two value)."""
    if isinstance(value, bool):
        return False
    try:
        f = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(f) and f >= 1 and math.frexp(f)[0] == 0.5


def _check_hyperparameters(h: dict[str, Any]) -> None:
    """Graphcore's checks (and their messages' first words), plus ranges Graphcore left open."""
    freq = h["update_frequency"]
    if isinstance(freq, bool) or not isinstance(freq, int) or freq <= 0:
        raise ValueError(f"update_frequency must be nonzero and positive (an int); got {freq!r}")
    for name in ("increase_factor", "max_loss_scaling_factor", "initial_loss_scaling_factor"):
        if not _is_power_of_two(h[name]):
            raise ValueError(f"{name} must be a power of two (1, 2, 4, ...); got {h[name]!r}")
    initial, inc, top = (float(h[k]) for k in ("initial_loss_scaling_factor", "increase_factor",
                                               "max_loss_scaling_factor"))
    if initial >= top:
        raise ValueError(f"initial_loss_scaling_factor must be less than "
                         f"max_loss_scaling_factor ({initial:g} >= {top:g})")
    if initial * inc >= top:
        raise ValueError(f"initial_loss_scaling_factor x increase_factor must be less than "
                         f"max_loss_scaling_factor ({initial:g} x {inc:g} >= {top:g})")
    ratio = h["ratio_threshold"]
    if not 0.0 < float(ratio) < 1.0:
        raise ValueError(f"ratio_threshold must be greater than zero and less than one; "
                         f"got {ratio!r}")
    alpha = h["lpf_alpha"]
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"lpf_alpha must be in [0, 1]; got {alpha!r}")
    edge = h["histogram_bin_edge"]
    if not (math.isfinite(float(edge)) and float(edge) > 0):
        raise ValueError(f"histogram_bin_edge must be a positive number; got {edge!r}")


def _flatten_captured(captured_grads: CapturedGrads) -> list[Any]:
    """The tensors of ``captured_grads``: Graphcore's dict of tag -> tensor or list of
    tensors (``GradientCaptureTape.captured_gradients``), or a list of tensors."""
    if not captured_grads:
        return []
    values: Iterable[Any] = (captured_grads.values() if isinstance(captured_grads, Mapping)
                             else captured_grads)
    out: list[Any] = []
    for v in values:
        out.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


def _dense_values(g: Any) -> tf.Tensor:
    return g.values if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)


def _state_getter(name: str) -> Any:
    def get(self: Any) -> tf.Tensor:
        return tf.convert_to_tensor(getattr(self, name))

    return get


class _ScaledLossAPI:
    """Graphcore's (Keras 2) entry points on top of ``scale_loss`` and ``apply_gradients``."""

    def get_scaled_loss(self, loss: Any) -> tf.Tensor:
        """Graphcore's name of ``scale_loss``: ``loss`` times the current LSF."""
        return self.scale_loss(loss)  # type: ignore[attr-defined]

    def get_gradients(self, loss: Any, params: Iterable[Any]) -> list[Any]:
        """The gradients of ``loss`` times the LSF (Keras 2's ``get_gradients``, which
        Graphcore's examples call); pass them, scaled, to ``apply_gradients``. Needs a graph
        (inside a ``tf.function``); eagerly, use a ``tf.GradientTape`` on ``scale_loss(loss)``."""
        if tf.executing_eagerly():
            raise RuntimeError(
                "get_gradients(loss, params) computes gradients in a graph: call it inside a "
                "tf.function, or eagerly take tape.gradient(optimizer.scale_loss(loss), params) "
                "of a tf.GradientTape that recorded the loss")
        params = list(params)
        handles = [p.value if isinstance(p, keras.Variable) else p for p in params]
        return tf.gradients(self.scale_loss(loss), handles)  # type: ignore[attr-defined]

    def minimize(self, loss: Any, var_list: Iterable[Any], tape: tf.GradientTape | None = None
                 ) -> Any:
        """Keras 2's ``minimize``: scales ``loss`` (a tensor recorded by ``tape``, or a
        callable), takes the gradients and applies them."""
        var_list = list(var_list)
        if callable(loss):
            tape = tape if tape is not None else tf.GradientTape()
            with tape:
                loss = loss()
        if tape is None:
            grads = self.get_gradients(loss, var_list)
        else:
            with tape:
                scaled = self.scale_loss(loss)  # type: ignore[attr-defined]
            grads = tape.gradient(scaled, var_list)
        return self.apply_gradients(zip(grads, var_list, strict=True))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]],
                        captured_grads: CapturedGrads = None) -> Any:
        """Applies (scaled) gradients; ``captured_grads`` (Graphcore's argument: a dict of
        tag -> tensor or list of tensors, or a list) are counted in the histogram too."""
        pairs = list(grads_and_vars)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        self.apply(grads, variables, captured_grads=captured_grads)  # type: ignore[attr-defined]
        return self.iterations  # type: ignore[attr-defined]

    def _resolve(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None
                 ) -> tuple[list[Any], list[Any]]:
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(f"{type(self).__name__}.apply without trainable_variables needs "
                                 "a built optimizer: call optimizer.build(variables) first")
            trainable_variables = list(self._trainable_variables)
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                self.build(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"{len(grads)} gradients for {len(trainable_variables)} variables")
        return grads, trainable_variables

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any
                        ) -> Any:
        raise ValueError(f"{type(self).__name__} updates its variables in place "
                         "(the TensorFlow backend's apply); stateless_apply is not supported.")


@keras.saving.register_keras_serializable(package="keras.ipu")
class ALSOptimizer(_ScaledLossAPI, _LossScaleOptimizer):
    """Automatic loss scaling around a Keras optimizer (Graphcore's ``ALSOptimizer``).

    Args:
        opt: the ``keras.optimizers.Optimizer`` that updates the weights, with the gradients
            divided by the loss scaling factor (LSF).
        initial_loss_scaling_factor: the first LSF; a power of two.
        update_frequency: the LSF update period, in calls of ``apply_gradients``: the LSF can
            change at the call whose counter ``n`` (calls since the last change, from 0) is a
            positive multiple of it, so first at call ``update_frequency + 1`` and then every
            ``update_frequency + 1`` calls; every call if 1.
        increase_factor: the LSF is multiplied or divided by it; a power of two.
        max_loss_scaling_factor: the LSF stays below it (a power of two); it never goes below 1.
        accumulate_statistics_over_update_period: count the gradients of every call (True) or
            only those of the call where the LSF is updated (False).
        ratio_threshold: the LSF decreases when more than this fraction of the counted
            float16 gradient values are at or above ``histogram_bin_edge``; in (0, 1).
        captured_grads_only: count only ``captured_grads`` (of ``apply_gradients``), not the
            weights' gradients.
        lpf_alpha: Graphcore's low-pass filter, ``h = alpha h + (1 - alpha)(h + counts)``,
            i.e. each call's counts are weighted by ``1 - alpha``; in [0, 1].
        histogram_bin_edge: the magnitude from which a float16 gradient counts as overflowing.
        name: the optimizer's name.
    """

    def __init__(self, opt: keras.optimizers.Optimizer,
                 initial_loss_scaling_factor: float = DEFAULTS["initial_loss_scaling_factor"],
                 update_frequency: int = DEFAULTS["update_frequency"],
                 increase_factor: float = DEFAULTS["increase_factor"],
                 max_loss_scaling_factor: float = DEFAULTS["max_loss_scaling_factor"],
                 accumulate_statistics_over_update_period: bool =
                 DEFAULTS["accumulate_statistics_over_update_period"],
                 ratio_threshold: float = DEFAULTS["ratio_threshold"],
                 captured_grads_only: bool = DEFAULTS["captured_grads_only"],
                 lpf_alpha: float = DEFAULTS["lpf_alpha"],
                 histogram_bin_edge: float = DEFAULTS["histogram_bin_edge"],
                 name: str = "ALSOptimizer") -> None:
        if not isinstance(opt, _Optimizer):
            raise TypeError(f"ALSOptimizer wraps a keras.optimizers.Optimizer; got {opt!r}")
        if isinstance(opt, _LossScaleOptimizer):
            raise ValueError(f"ALSOptimizer scales the loss itself: wrap the optimizer inside "
                             f"{type(opt).__name__} instead")
        hyper = {
            "initial_loss_scaling_factor": initial_loss_scaling_factor,
            "update_frequency": update_frequency,
            "increase_factor": increase_factor,
            "max_loss_scaling_factor": max_loss_scaling_factor,
            "accumulate_statistics_over_update_period": accumulate_statistics_over_update_period,
            "ratio_threshold": ratio_threshold,
            "captured_grads_only": captured_grads_only,
            "lpf_alpha": lpf_alpha,
            "histogram_bin_edge": histogram_bin_edge,
        }
        _check_hyperparameters(hyper)
        # Not LossScaleOptimizer.__init__: its dynamic scale and step counter are not ours.
        _Optimizer.__init__(self, learning_rate=0.0, name=name)
        self.inner_optimizer = opt
        opt.loss_scale_factor = None  # the inner optimizer must not unscale a second time
        self._hyper = hyper
        self._hist = self.add_variable((2,), "zeros", "float32", name="gradient_histogram")
        self._n = self.add_variable((), "zeros", "int32", name="lsf_update_counter")
        initial = keras.initializers.Constant(float(initial_loss_scaling_factor))
        self._lsf = self.add_variable((), initial, "float32", name="loss_scaling_factor")
        self._prev_lsf = self.add_variable((), initial, "float32",
                                           name="prev_loss_scaling_factor")

    # -- Keras's optimizer interface -----------------------------------------------------

    def build(self, var_list: list[Any]) -> None:
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        _Optimizer.build(self, var_list)

    def scale_loss(self, loss: Any) -> tf.Tensor:
        """``loss`` times the current LSF (what Keras's train step differentiates)."""
        loss = tf.convert_to_tensor(loss)
        return loss * tf.cast(tf.convert_to_tensor(self._lsf), loss.dtype)

    @tf.autograph.experimental.do_not_convert  # explicit tf.cond / tf.where; Python ifs stay
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None,
              captured_grads: CapturedGrads = None) -> None:
        """One step: counts the scaled gradients, applies them divided by the LSF, moves the
        update counter and, when an update is due, the LSF."""
        grads, trainable_variables = self._resolve(grads, trainable_variables)
        if not grads:
            return
        counts = self._collect(grads, captured_grads)
        unscaled = self._unscale(grads)
        self._advance(counts, end_of_step=self._inner_update_step())
        self.inner_optimizer.apply(unscaled, trainable_variables)

    def _inner_update_step(self) -> bool | tf.Tensor:
        """True, or, when the inner optimizer accumulates (Keras's
        ``gradient_accumulation_steps``, which ``set_gradient_accumulation_options`` sets),
        whether this call updates the weights: the counter counts weight updates."""
        steps = getattr(self.inner_optimizer, "gradient_accumulation_steps", None)
        if not steps or steps == 1:
            return True
        calls = tf.convert_to_tensor(self.inner_optimizer._iterations)
        return tf.equal(tf.math.floormod(calls + 1, steps), 0)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                **self._hyper}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> ALSOptimizer:
        config = dict(config)
        inner = _inner_from_config(config, "inner_optimizer", custom_objects)
        return cls(inner, **config)

    # -- the algorithm -------------------------------------------------------------------

    def _due(self) -> tf.Tensor:
        """Whether this step (of the update counter's value now) may change the LSF."""
        freq = self._hyper["update_frequency"]
        if freq == 1:
            return tf.constant(True)
        n = tf.convert_to_tensor(self._n)
        return tf.logical_and(n > 0, tf.equal(tf.math.floormod(n, freq), 0))

    def _collect(self, grads: Sequence[Any], captured_grads: CapturedGrads) -> tf.Tensor:
        """This step's histogram counts [below the edge, at or above it (or NaN)] of its
        float16 gradients (the weights' unless ``captured_grads_only``, and the captured)."""
        tensors = [] if self._hyper["captured_grads_only"] else list(grads)
        tensors += _flatten_captured(captured_grads)
        half = [_dense_values(g) for g in tensors
                if g is not None and _dense_values(g).dtype == tf.float16]
        if not half:
            return tf.zeros([2], tf.float32)
        edge = tf.constant(float(self._hyper["histogram_bin_edge"]), tf.float32)

        def count() -> tf.Tensor:
            total = tf.constant(0.0, tf.float32)
            over = tf.constant(0.0, tf.float32)
            for g in half:
                magnitude = tf.abs(tf.cast(tf.reshape(g, [-1]), tf.float32))
                over_here = tf.logical_not(magnitude < edge)  # NaN counts as overflow
                over += tf.cast(tf.reduce_sum(tf.cast(over_here, tf.int32)), tf.float32)
                total += tf.cast(tf.size(magnitude), tf.float32)
            return tf.stack([total - over, over])

        if self._hyper["accumulate_statistics_over_update_period"]:
            return count()
        return tf.cond(self._due(), count, lambda: tf.zeros([2], tf.float32))

    def _unscale(self, grads: Sequence[Any]) -> list[Any]:
        """The gradients divided by the LSF they were scaled with (float16 and bfloat16 in
        float32, then rounded back: the same values for any LSF, even one above 65504)."""
        lsf = tf.convert_to_tensor(self._lsf)

        def divide(g: tf.Tensor) -> tf.Tensor:
            if g.dtype in (tf.float16, tf.bfloat16):
                return tf.cast(tf.cast(g, tf.float32) / lsf, g.dtype)
            return g / tf.cast(lsf, g.dtype)

        out: list[Any] = []
        for g in grads:
            if g is None:
                out.append(None)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(divide(g.values), g.indices, g.dense_shape))
            else:
                out.append(divide(tf.convert_to_tensor(g)))
        return out

    def _advance(self, counts: tf.Tensor, end_of_step: bool | tf.Tensor) -> None:
        """Adds ``counts`` to the histogram; at the end of a weight update step
        (``end_of_step``: True, or a boolean tensor) moves the counter and, if due, the LSF."""
        alpha = float(self._hyper["lpf_alpha"])
        hist = tf.convert_to_tensor(self._hist)
        hist = hist + (counts if alpha == 0.0 else (1.0 - alpha) * counts)
        if end_of_step is False:
            self._hist.assign(hist)
            return
        due = self._due()
        if end_of_step is not True:
            due = tf.logical_and(due, end_of_step)
        lsf = tf.convert_to_tensor(self._lsf)
        prev = tf.convert_to_tensor(self._prev_lsf)
        n = tf.convert_to_tensor(self._n)
        ratio = hist[1] / (hist[0] + hist[1])  # NaN with no counts: not > threshold
        grow = tf.logical_not(ratio > float(self._hyper["ratio_threshold"]))
        factor = tf.constant(float(self._hyper["increase_factor"]), tf.float32)
        candidate = tf.where(grow, lsf * factor, lsf / factor)
        valid = tf.logical_and(
            tf.math.is_finite(candidate),
            tf.logical_and(candidate < float(self._hyper["max_loss_scaling_factor"]),
                           candidate >= 1.0))
        new_lsf = tf.where(tf.logical_and(due, valid), candidate, lsf)
        stepped = tf.where(due, tf.zeros_like(n), n + 1)
        if end_of_step is not True:
            stepped = tf.where(end_of_step, stepped, n)
        self._prev_lsf.assign(tf.where(tf.not_equal(new_lsf, lsf), lsf, prev))
        self._lsf.assign(new_lsf)
        self._hist.assign(tf.where(due, tf.zeros_like(hist), hist))
        self._n.assign(stepped)

    def reset(self) -> None:
        """Back to the initial LSF, an empty histogram and a zero counter (as Graphcore's,
        the previous LSF is kept)."""
        self._hist.assign(tf.zeros([2], tf.float32))
        self._n.assign(0)
        self._lsf.assign(float(self._hyper["initial_loss_scaling_factor"]))

    def get_name(self) -> str:
        return self.name

    # -- Graphcore's properties ------------------------------------------------------------

    histogram = property(_state_getter("_hist"), doc="The gradient histogram: [ok, overflow].")
    loss_scaling_factor = property(_state_getter("_lsf"), doc="The current LSF (float32).")
    previous_loss_scaling_factor = property(_state_getter("_prev_lsf"),
                                            doc="The LSF before its last change.")
    update_counter = property(_state_getter("_n"),
                              doc="Steps since the last LSF update (int32).")

    @property
    def normalized_histogram(self) -> tf.Tensor:
        h = self.histogram
        return h / tf.reduce_sum(h)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _READ_ONLY:
            raise ValueError(f"{name} is a read only property.")
        super().__setattr__(name, value)

    @property
    def decrease_factor(self) -> float:
        return 1.0 / float(self._hyper["increase_factor"])

    @property
    def update_frequency(self) -> int:
        return self._hyper["update_frequency"]

    @property
    def increase_factor(self) -> float:
        return self._hyper["increase_factor"]

    @property
    def initial_loss_scaling_factor(self) -> float:
        return self._hyper["initial_loss_scaling_factor"]

    @property
    def max_loss_scaling_factor(self) -> float:
        return self._hyper["max_loss_scaling_factor"]

    @property
    def accumulate_statistics_over_update_period(self) -> bool:
        return self._hyper["accumulate_statistics_over_update_period"]

    @property
    def ratio_threshold(self) -> float:
        return self._hyper["ratio_threshold"]

    @property
    def captured_grads_only(self) -> bool:
        return self._hyper["captured_grads_only"]

    @property
    def lpf_alpha(self) -> float:
        return self._hyper["lpf_alpha"]

    @property
    def histogram_bin_edge(self) -> float:
        return self._hyper["histogram_bin_edge"]

    @property
    def supports_captured_grads(self) -> bool:
        return True


#: Graphcore's read-only state properties: assigning one is a ValueError, as there.
_READ_ONLY = frozenset({"histogram", "normalized_histogram", "loss_scaling_factor",
                        "previous_loss_scaling_factor", "update_counter", "decrease_factor"})


def _inner_from_config(config: dict[str, Any], key: str, custom_objects: Any) -> Any:
    """The wrapped optimizer of a config: ours (``key``: a Keras serialization), or
    Graphcore's (``inner_optimizer_type``, a class, and ``inner_optimizer_config``)."""
    if key in config:
        return keras.saving.deserialize_keras_object(config.pop(key),
                                                     custom_objects=custom_objects)
    if "inner_optimizer_type" in config and "inner_optimizer_config" in config:
        inner_type = config.pop("inner_optimizer_type")
        inner_config = config.pop("inner_optimizer_config")
        if isinstance(inner_type, type):
            return inner_type.from_config(inner_config)
        return keras.optimizers.deserialize({"class_name": inner_type, "config": inner_config},
                                            custom_objects=custom_objects)
    raise ValueError(f"the config has no wrapped optimizer ({key!r}, or "
                     f"'inner_optimizer_type' and 'inner_optimizer_config')")


def _reduction_name(method: Any) -> str:
    """``reduction_method`` as one of ``REDUCTIONS``: Graphcore's enum (anything with that
    ``name``), its int value, or a string."""
    if isinstance(method, bool):
        raise ValueError(f"reduction_method must be one of {REDUCTIONS}; got {method!r}")
    if isinstance(method, int) and 0 <= method < len(REDUCTIONS):
        return REDUCTIONS[method]
    name = str(getattr(method, "name", method)).upper()
    name = name.rsplit(".", 1)[-1]
    if name not in REDUCTIONS:
        raise ValueError(f"reduction_method must be one of {REDUCTIONS}; got {method!r}")
    return name


@keras.saving.register_keras_serializable(package="keras.ipu")
class ALSGradientAccumulationOptimizer(_ScaledLossAPI, _LossScaleOptimizer):
    """Gradient accumulation for an ``ALSOptimizer`` (Graphcore's
    ``ALSGradientAccumulationOptimizer``): the weights are updated every
    ``num_mini_batches`` calls, with the accumulated unscaled gradients.

    Args:
        als_optimizer: the ``ALSOptimizer`` (and, inside it, the optimizer) to step.
        num_mini_batches: calls per weight update; with 1, the constructor returns
            ``als_optimizer`` itself, as Graphcore's does.
        offload_weight_update_variables, replicated_optimizer_state_sharding: Graphcore's
            memory placement options; accepted, and warned once to have no effect here.
        dtype: the accumulators' dtype: None (each variable's), a dtype, or a callable of the
            variable returning one.
        reduction_method: ``"SUM"`` (Graphcore's default: the gradients are added up),
            ``"MEAN"`` (each divided by ``num_mini_batches``) or ``"RUNNING_MEAN"``; also
            Graphcore's ``GradientAccumulationReductionMethod`` values.
        name: the optimizer's name.

    Each call counts its scaled gradients in the ALS histogram; the ALS update counter and
    the LSF move at the last call of each weight update (so ``update_frequency`` counts
    weight updates).
    """

    def __new__(cls, als_optimizer: Any = None, num_mini_batches: int = 2, *args: Any,
                **kwargs: Any) -> Any:
        if num_mini_batches == 1 and isinstance(als_optimizer, ALSOptimizer):
            return als_optimizer
        return super().__new__(cls)

    def __init__(self, als_optimizer: ALSOptimizer, num_mini_batches: int,
                 offload_weight_update_variables: bool | None = None,
                 replicated_optimizer_state_sharding: bool = False,
                 dtype: Any = None, reduction_method: Any = "SUM",
                 name: str = "ALSGradientAccumulationOptimizer") -> None:
        if not isinstance(als_optimizer, ALSOptimizer):
            raise ValueError("ALSGradientAccumulationOptimizer can only be used with instances "
                             f"of ALSOptimizer; got {als_optimizer!r}")
        if isinstance(num_mini_batches, bool) or not isinstance(num_mini_batches, int) \
                or num_mini_batches < 1:
            raise ValueError(f"num_mini_batches must be >= 1 (an int); got {num_mini_batches!r}")
        if dtype is not None and not callable(dtype):
            dtype = tf.as_dtype(dtype).name
        self_name = "keras.ipu.optimizers.ALSGradientAccumulationOptimizer"
        for option, value, default in (
                ("offload_weight_update_variables", offload_weight_update_variables, None),
                ("replicated_optimizer_state_sharding", replicated_optimizer_state_sharding,
                 False)):
            if value != default:
                notices.once(f"{self_name}({option})",
                             "has no effect on the emulated IPU: it placed optimizer state in "
                             "Streaming Memory or across replicas, which this project does "
                             "not have.")
        _Optimizer.__init__(self, learning_rate=0.0, name=name)
        self.inner_optimizer = als_optimizer
        self._num_mini_batches = num_mini_batches
        self._offload_weight_update_variables = offload_weight_update_variables
        self._replicated_optimizer_state_sharding = replicated_optimizer_state_sharding
        self._accumulator_dtype = dtype
        self._reduction_method = _reduction_name(reduction_method)
        self._mini_batch = self.add_variable((), "zeros", "int32", name="mini_batch")

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: list[Any]) -> None:
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._accumulators = []
        for v in var_list:
            dtype = self._accumulator_dtype
            dtype = dtype(v) if callable(dtype) else (dtype or v.dtype)
            self._accumulators.append(self.add_variable(
                tuple(v.shape), "zeros", tf.as_dtype(dtype).name,
                name=f"{str(getattr(v, 'path', v.name)).replace('/', '_').replace(':', '_')}"
                     "_accumulator"))
        _Optimizer.build(self, var_list)

    def scale_loss(self, loss: Any) -> tf.Tensor:
        return self.als_optimizer.scale_loss(loss)

    @tf.autograph.experimental.do_not_convert  # explicit tf.cond / tf.where; Python ifs stay
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None,
              captured_grads: CapturedGrads = None) -> None:
        """One mini-batch: counts and unscales its gradients, accumulates them; at the last
        mini-batch applies the accumulated gradients and steps the ALS state."""
        grads, trainable_variables = self._resolve(grads, trainable_variables)
        if not grads:
            return
        als = self.als_optimizer
        n = self._num_mini_batches
        k = tf.convert_to_tensor(self._mini_batch)
        last = tf.equal(k, n - 1)
        counts = als._collect(grads, captured_grads)
        unscaled = als._unscale(grads)
        als._advance(counts, end_of_step=last)

        kf = tf.cast(k, tf.float32)
        accumulators = []  # (accumulator, its new value)
        totals = []
        for g, v in zip(unscaled, trainable_variables, strict=True):
            if g is None:
                totals.append(None)
                continue
            acc = self._accumulators[self._get_variable_index(v)]
            g = tf.cast(tf.convert_to_tensor(g), acc.dtype)
            a = tf.convert_to_tensor(acc)
            if self._reduction_method == "SUM":
                total = a + g
            elif self._reduction_method == "MEAN":
                total = a + g / tf.cast(n, acc.dtype)
            else:  # RUNNING_MEAN: the mean of the mini-batches so far
                total = (a * tf.cast(kf / (kf + 1.0), acc.dtype)
                         + g / tf.cast(kf + 1.0, acc.dtype))
            accumulators.append((acc, total))
            totals.append(total)

        def update() -> None:
            als.inner_optimizer.apply(totals, trainable_variables)
            for acc, _ in accumulators:
                acc.assign(tf.zeros_like(acc))

        def accumulate() -> None:
            for acc, total in accumulators:
                acc.assign(total)

        tf.cond(last, update, accumulate)
        self._mini_batch.assign(tf.where(last, tf.zeros_like(k), k + 1))

    def get_config(self) -> dict[str, Any]:
        if callable(self._accumulator_dtype):
            raise ValueError("an ALSGradientAccumulationOptimizer with a callable dtype has no "
                             "config: the callable cannot be serialized")
        return {"name": self.name,
                "als_optimizer": keras.saving.serialize_keras_object(self.als_optimizer),
                "num_mini_batches": self._num_mini_batches,
                "offload_weight_update_variables": self._offload_weight_update_variables,
                "replicated_optimizer_state_sharding": self._replicated_optimizer_state_sharding,
                "dtype": self._accumulator_dtype,
                "reduction_method": self._reduction_method}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        config = dict(config)
        inner = _inner_from_config(config, "als_optimizer", custom_objects)
        if not isinstance(inner, ALSOptimizer):
            raise ValueError("ALSGradientAccumulationOptimizer.from_config: the wrapped "
                             f"optimizer must be an ALSOptimizer; got {type(inner).__name__}")
        num = config.pop("num_mini_batches")
        return cls(inner, num, **config)

    # -- Graphcore's properties (those of the ALSOptimizer) ----------------------------------

    @property
    def als_optimizer(self) -> ALSOptimizer:
        return self.inner_optimizer

    @property
    def num_mini_batches(self) -> int:
        return self._num_mini_batches

    @property
    def reduction_method(self) -> str:
        return self._reduction_method

    def reset(self) -> None:
        self.als_optimizer.reset()

    def get_name(self) -> str:
        return self.name


def _delegate(name: str) -> property:
    return property(lambda self: getattr(self.als_optimizer, name),
                    doc=f"The ``ALSOptimizer``'s ``{name}``.")


for _name in ("histogram", "normalized_histogram", "loss_scaling_factor",
              "previous_loss_scaling_factor", "update_counter", "update_frequency",
              "increase_factor", "decrease_factor", "initial_loss_scaling_factor",
              "max_loss_scaling_factor", "accumulate_statistics_over_update_period",
              "ratio_threshold", "supports_captured_grads", "captured_grads_only", "lpf_alpha",
              "histogram_bin_edge"):
    setattr(ALSGradientAccumulationOptimizer, _name, _delegate(_name))
del _name

#: SDK 3.0's name of the accumulation wrapper (``keras.ipu`` and ``keras.ipu.optimizers``).
ALSOptimizerGradientAccumulationWrapper = ALSGradientAccumulationOptimizer

__all__ = ["DEFAULTS", "REDUCTIONS", "ALSGradientAccumulationOptimizer", "ALSOptimizer",
           "ALSOptimizerGradientAccumulationWrapper"]
