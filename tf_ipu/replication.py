"""Replication on the host side: batches out to the replicas, their results back.

    dataset batches  b0 b1 b2 b3 b4 b5 ...            (R = 2 replicas, N = 2 steps a call)
    one device call  stacked [b0 b1 b2 b3]  ──>  replica 0 steps: b0 b2   replica 1: b1 b3
                     (step i of replica r takes batch i*R + r: Graphcore's round-robin)
    results          logs [R, ...]  ──reduce (set_replication_options)──>  History, evaluate
                     predictions [R, N, batch, ...] ──> [N*R*batch, ...] in dataset order

Graphcore's semantics (SDK 3.x IPUStrategy and Keras extensions), which ported code expects:
``strategy.num_replicas_in_sync`` is 1; ``batch_size`` is per replica; ``steps_per_execution``
counts steps per replica; an epoch's batches and ``steps_per_epoch`` are global and shared out
among the replicas (a remainder of fewer than R batches is dropped, with a warning); the
optimizer sums the replicas' gradients (so the update is R times one replica's; divide the
learning rate by R to train as one IPU at batch R x batch_size); a metric's value is the last
replica's unless ``model.set_replication_options(replicated_metric_reduction_method=...)``
says otherwise; host reads of a variable see replica 0's copy and host writes reach all.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Any

import tensorflow as tf

from tf_ipu import notices

_log = logging.getLogger("tf_ipu")
_METHOD_ATTR = "_tf_ipu_replicated_metric_reduction"


class ReplicatedMetricReductionMethod(enum.Enum):
    """How the replicas' values of a metric (and the loss) become one: Graphcore's names.

    NONE: the last replica's value (the default); LIST: every replica's, a list; SUM / MEAN:
    their sum / mean."""

    NONE = 1
    LIST = 2
    SUM = 3
    MEAN = 4


def _method(value: Any) -> ReplicatedMetricReductionMethod:
    if isinstance(value, ReplicatedMetricReductionMethod):
        return value
    if isinstance(value, str) and value.upper() in ReplicatedMetricReductionMethod.__members__:
        return ReplicatedMetricReductionMethod[value.upper()]
    names = ", ".join(repr(m.name) for m in ReplicatedMetricReductionMethod)
    raise ValueError(f"set_replication_options: replicated_metric_reduction_method must be a "
                     f"ReplicatedMetricReductionMethod or one of {names}. Received: {value!r}")


def set_replication_options(self: Any, replicated_metric_reduction_method: Any = "NONE") -> None:
    """Graphcore's ``model.set_replication_options``: how the replicas' metric and loss
    values are reduced for ``fit``'s History and callbacks and for ``evaluate``
    (``ReplicatedMetricReductionMethod``; default NONE: the last replica's).

    Example:
        >>> model.set_replication_options(replicated_metric_reduction_method="MEAN")  # doctest: +SKIP
    """
    object.__setattr__(self, _METHOD_ATTR, _method(replicated_metric_reduction_method))


def metric_reduction(model: Any) -> ReplicatedMetricReductionMethod:
    return getattr(model, _METHOD_ATTR, ReplicatedMetricReductionMethod.NONE)


def reduce_logs(model: Any, logs: Any) -> Any:
    """Logs of a replicated device call (every leaf ``[R, ...]``) as the model's reduction
    method says."""
    method = metric_reduction(model)
    object.__setattr__(model, "_tf_ipu_replicated_logs", True)

    def one(t: tf.Tensor) -> Any:
        if method is ReplicatedMetricReductionMethod.NONE:
            return t[-1]
        if method is ReplicatedMetricReductionMethod.LIST:
            return list(tf.unstack(t))
        if method is ReplicatedMetricReductionMethod.SUM:
            return tf.reduce_sum(t, axis=0)
        return tf.reduce_mean(tf.cast(t, tf.float32) if t.dtype.is_integer else t, axis=0)

    return tf.nest.map_structure(one, logs)


def predictions_in_order(t: tf.Tensor, batches: int) -> tf.Tensor:
    """One output of a replicated predict call, ``[R, steps, batch, ...]`` (replica r's step i
    predicted batch i*R + r), as the ``batches`` batches' rows in dataset order."""
    t = tf.transpose(t, [1, 0, *range(2, t.shape.rank)])          # [steps, R, batch, ...]
    t = tf.reshape(t, [-1, *t.shape[2:]])[:batches]                # [batches, batch, ...]
    return tf.reshape(t, [-1, *t.shape[2:]])


def usable_batches(sizes: list[int], replicas: int, what: str) -> int:
    """How many of a call's pulled batches (their sizes, in order) the replicas can take:
    whole groups of R batches of one size, up to the first group that is not (an epoch's
    last, smaller batch, or the remainder of fewer than R batches), which is dropped with
    a warning naming the samples."""
    usable = 0
    while usable + replicas <= len(sizes) and len(set(sizes[usable:usable + replicas])) == 1:
        usable += replicas
    if usable < len(sizes):
        dropped = sizes[usable:]
        notices.once(
            f"replication drops batches ({what})",
            f"{what}: {len(dropped)} batch(es) ({sum(dropped)} samples) at the end of the "
            f"data are dropped: {replicas} replicas take batches in groups of {replicas} of "
            f"one size (batch sizes left: {dropped}). Make the number of batches a multiple "
            f"of {replicas} and batch with drop_remainder=True to use every sample.")
    return usable


def steps_per_replica(batches: int | None, replicas: int) -> int | None:
    """Steps each replica runs for ``batches`` global batches (the remainder dropped)."""
    if batches is None:
        return None
    return batches // replicas


def per_call_steps(steps_per_execution: int, replicas: int, kind: str) -> int:
    """Steps each replica runs in one device call: ``steps_per_execution`` for fit and
    evaluate (Graphcore counts it per replica); for predict, whose calls Keras hands
    ``steps_per_execution`` batches, those batches shared out (rounded up)."""
    if kind == "predict":
        return max(1, math.ceil(steps_per_execution / replicas))
    return steps_per_execution


def replicas_for(model: Any) -> int:
    """Replicas of ``model``'s device programs: the IPUs attached over the IPUs one replica
    spans (1, or a pipeline's ``ipus_per_replica``), as Graphcore derives them; ValueError
    naming the numbers when the IPUs are not a multiple of a replica's."""
    from tf_ipu import pipelining

    ipus = model.distribute_strategy.replication_factor
    pipeline = pipelining.plan(model, 1)
    per = pipeline["ipus_per_replica"] if pipeline else 1
    if ipus % per:
        raise ValueError(
            f"{getattr(model, 'name', 'model')}: {ipus} IPU{' is' if ipus == 1 else 's are'} "
            f"attached, but the model's "
            f"pipeline of {pipeline['stages']} stages on IPUs {pipeline['stage_ipus']} needs "
            f"{per} IPUs per replica (a power of two): set IPUConfig.auto_select_ipus to a "
            f"multiple of {per} (e.g. {per} for one replica, {2 * per} for two).")
    return ipus // per


def install_epoch_iterator() -> None:
    """Makes Keras's epoch iterator count steps per replica in ``fit`` and ``evaluate``
    under a replicated IPUStrategy: an epoch of B batches is B // R steps (and a given
    ``steps_per_epoch`` / ``steps``, which counts batches, S // R), as Graphcore's data
    adapter divides them. ``predict`` keeps Keras's counting: each call shares its batches
    out among the replicas."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    cls = tf_trainer.TFEpochIterator
    if getattr(cls, "_tf_ipu_replicas", False):
        return
    original_init = cls.__init__
    original_reset = cls.reset

    def replicas_of(it: Any) -> int:
        from tf_ipu.strategy import IPUStrategy

        strategy = getattr(it, "_distribute_strategy", None)
        if not isinstance(strategy, IPUStrategy) or _predicting():
            return 1
        model = _current_model()
        return replicas_for(model) if model is not None else strategy.replication_factor

    def divide(it: Any) -> None:
        r = it._tf_ipu_replica_count
        if r <= 1:
            return
        if it._num_batches:
            if it._num_batches % r:
                notices.once(
                    f"{it._num_batches} batches shared out among {r} replicas:",
                    f"each runs {it._num_batches // r} steps and the remaining "
                    f"{it._num_batches % r} batch(es) are dropped.")
            it._num_batches = it._num_batches // r
        if it.steps_per_epoch:
            if it.steps_per_epoch < r:
                raise ValueError(
                    f"steps_per_epoch={it.steps_per_epoch} counts batches, shared out among "
                    f"{r} replicas: it must be at least {r} (one step per replica); use "
                    f"steps_per_epoch={r * max(1, it.steps_per_epoch)}.")
            it.steps_per_epoch = it.steps_per_epoch // r

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._tf_ipu_replica_count = replicas_of(self)
        divide(self)

    def reset(self: Any) -> None:
        original_reset(self)
        r = getattr(self, "_tf_ipu_replica_count", 1)
        if r > 1 and self._num_batches:
            self._num_batches = self._num_batches // r

    cls.__init__ = init
    cls.reset = reset
    cls._tf_ipu_replicas = True


def install_logs() -> None:
    """Makes ``fit``'s epoch logs (History) and ``evaluate``'s results those the replicas'
    values reduce to, as the device call returned them (Keras would read its metrics'
    variables on the host instead: replica 0's, which is not Graphcore's NONE)."""
    from keras.src.trainers.trainer import Trainer

    original = Trainer._get_metrics_result_or_logs
    if getattr(original, "_tf_ipu_replicas", False):
        return

    def metrics_result_or_logs(self: Any, logs: Any) -> Any:
        from tf_ipu.strategy import IPUStrategy

        strategy = getattr(self, "_distribute_strategy", None)
        if (isinstance(logs, dict) and isinstance(strategy, IPUStrategy)
                and getattr(self, "_tf_ipu_replicated_logs", False)):
            return {k: _plain(v) for k, v in logs.items()}
        return original(self, logs)

    metrics_result_or_logs._tf_ipu_replicas = True  # type: ignore[attr-defined]
    Trainer._get_metrics_result_or_logs = metrics_result_or_logs


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


#: What a replica adds, times its index, to a Keras seed it draws (install_replica_seeds); an
#: instance of a multi-instance run moves its seed states by its replica offset times it too.
REPLICA_SEED_STRIDE = 7919


def install_replica_seeds() -> None:
    """Gives each replica random numbers of its own: in a replicated device program, a seed
    drawn from a Keras ``SeedGenerator`` (Dropout's, the initializers') is offset by the
    replica's index. Every replica holds a copy of the generator's state (a variable), so
    without this all replicas would draw the same Dropout masks; Graphcore's replicas draw
    from hardware generators seeded apart."""
    from keras.src.random.seed_generator import SeedGenerator

    original = SeedGenerator.next
    if getattr(original, "_tf_ipu_replicas", False):
        return

    def next_seed(self: Any, ordered: bool = True) -> Any:
        from tf_ipu.strategy import _lowering_replicas, _lowering_world, replica_id

        value = original(self, ordered)
        if _lowering_replicas() <= 1 and not _lowering_world():
            return value
        offset = tf.cast(replica_id(), value.dtype) * tf.constant(REPLICA_SEED_STRIDE, value.dtype)
        return value + tf.stack([offset, tf.zeros([], value.dtype)])

    next_seed._tf_ipu_replicas = True  # type: ignore[attr-defined]
    next_seed.__doc__ = original.__doc__
    SeedGenerator.next = next_seed


_calls: list[tuple[str, Any]] = []  # (kind, model) of the fit/evaluate/predict running


def _predicting() -> bool:
    return bool(_calls) and _calls[-1][0] == "predict"


def _current_model() -> Any:
    return _calls[-1][1] if _calls else None


def current_call() -> tuple[str, Any] | None:
    """The innermost ``fit``/``evaluate``/``predict`` running: (its name, the model), or
    None outside them."""
    return _calls[-1] if _calls else None


def install_predict_marker() -> None:
    """Marks the span of ``model.fit``, ``evaluate`` and ``predict`` (the epoch iterator
    counts per replica of that model; predict's keeps Keras's counting)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    for kind in ("fit", "evaluate", "predict"):
        original = getattr(TensorFlowTrainer, kind)
        if getattr(original, "_tf_ipu_marked", False):
            continue

        def marked(self: Any, *args: Any, _kind: str = kind, _orig: Any = original,
                   **kwargs: Any) -> Any:
            _calls.append((_kind, self))
            try:
                return _orig(self, *args, **kwargs)
            finally:
                _calls.pop()

        marked.__doc__ = original.__doc__
        marked.__name__ = kind
        marked.__wrapped__ = original  # type: ignore[attr-defined]
        marked._tf_ipu_marked = True  # type: ignore[attr-defined]
        setattr(TensorFlowTrainer, kind, marked)


__all__ = ["ReplicatedMetricReductionMethod", "current_call", "install_epoch_iterator",
           "install_logs",
           "install_predict_marker", "install_replica_seeds",
           "metric_reduction", "per_call_steps", "predictions_in_order", "reduce_logs",
           "set_replication_options", "steps_per_replica", "usable_batches"]
