"""``tensorflow.python.ipu.ops.cross_replica_ops`` (also ``ipu.cross_replica_ops``): Graphcore's
collectives across the replicas of a replicated program.

    R = 4 replicas, x = x0 x1 x2 x3 (replica r holds x_r)
    cross_replica_sum(x)                        every replica: x0 + x1 + x2 + x3
    cross_replica_mean(x)                       every replica: (x0 + x1 + x2 + x3) / 4
    cross_replica_sum(x, replica_group_size=2)  replicas 0, 1: x0 + x1   replicas 2, 3: x2 + x3
    assume_equal_across_replicas(t)             t (a tensor or a structure), unchanged

Inside a device program of R > 1 replicas (``strategy.run`` or a Keras step under an
``IPUStrategy`` attached to R IPUs) each is one ``tf_ipu_all_reduce`` of the emulator
(tf_ipu.strategy.all_reduce), summed in replica order. A group size k < R places each
replica's value in its group's row of an ``[R / k, ...]`` tensor (zeros elsewhere), all-reduces
that and takes the replica's own row (``tf_ipu_replica_id``): the values are the groups' sums,
but the estimate charges R / k times the bytes of Graphcore's grouped all-reduce. Anywhere else
(the host, a Keras model being built, one replica) a program is one replica, so the sum and
mean are the value itself. A group size that does not divide R raises ``ValueError`` when the
program is lowered, as Graphcore's compilation fails. ``assume_equal_across_replicas`` tells
Poplar a value is the same on every replica (so a conditional on it is not divergent control
flow); the emulator has no such check to calm, so it returns copies of its inputs.
The sum and mean are differentiable: a replica's gradient is the same reduction (over its
group) of the replicas' upstream gradients, as Graphcore's gradient of its cross-replica sum.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_ipu import strategy as _strategy


def _replicas_being_lowered() -> int | None:
    """Replicas of the device program being lowered on this thread; None on the host."""
    if _strategy._lowering_depth() <= 0:
        return None
    return _strategy._lowering_replicas()


def _group_size(replicas: int, replica_group_size: int | None, what: str) -> int:
    if replica_group_size is None:
        return replicas
    if isinstance(replica_group_size, bool) or not isinstance(replica_group_size, int) \
            or replica_group_size <= 0:
        raise ValueError(f"{what}: replica_group_size must be a positive int or None; got "
                         f"{replica_group_size!r}")
    if replicas % replica_group_size:
        raise ValueError(f"{what}: replica_group_size={replica_group_size} does not divide the "
                         f"program's {replicas} replicas into groups (the number of replicas "
                         f"must be a multiple of the group size).")
    return replica_group_size


def _reduce(x: Any, replica_group_size: int | None, op: str, name: str) -> tf.Tensor:
    """The reduction, differentiable: the gradient of each replica's input is the same
    reduction of the upstream gradients (the loss is the sum of every replica's)."""
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        return _reduce_values(x, replica_group_size, op, name)

    @tf.custom_gradient
    def reduce(value: tf.Tensor) -> Any:
        def grad(upstream: tf.Tensor) -> tf.Tensor:
            return _reduce_values(tf.convert_to_tensor(upstream), replica_group_size, op,
                                  f"{name}_grad")

        return _reduce_values(value, replica_group_size, op, name), grad

    return reduce(x)


def _reduce_values(x: tf.Tensor, replica_group_size: int | None, op: str,
                   name: str) -> tf.Tensor:
    with tf.name_scope(name):
        replicas = _replicas_being_lowered()
        if replicas is None:  # the host: one replica
            if replica_group_size is not None:  # checked; it divides R when lowered
                _group_size(replica_group_size, replica_group_size, name)
            return tf.identity(x)
        k = _group_size(replicas, replica_group_size, name)
        if k == 1:
            return tf.identity(x)
        if k == replicas:
            (out,) = _strategy.all_reduce([x], op)
            return out
        groups = replicas // k
        group = _strategy.replica_id() // k
        mine = tf.reshape(tf.equal(tf.range(groups), group), [groups] + [1] * x.shape.rank)
        placed = tf.where(mine, x[tf.newaxis], tf.zeros_like(x)[tf.newaxis])
        (summed,) = _strategy.all_reduce([placed], "sum")
        total = tf.gather(summed, group)
        if op == "sum":
            return total
        if x.dtype.is_integer:  # the emulator's mean of integers: truncated, as numpy casts
            return tf.cast(tf.math.truediv(total, k), x.dtype)
        return total / tf.cast(k, x.dtype)


def cross_replica_sum(x: Any, replica_group_size: int | None = None,
                      name: str | None = None) -> tf.Tensor:
    """``x`` summed across the replicas (of its group of ``replica_group_size`` consecutive
    replicas, if given): every replica of a group gets the same sum.

    Args:
        x: this replica's tensor.
        replica_group_size: None (one group of all replicas) or k dividing the number of
            replicas R: groups {0 .. k-1}, {k .. 2k-1}, ...
        name: optional name scope.

    Example:
        >>> def step(it):
        ...     return ipu.cross_replica_ops.cross_replica_sum(next(it))  # doctest: +SKIP
    """
    return _reduce(x, replica_group_size, "sum", name or "cross_replica_sum")


def cross_replica_mean(x: Any, replica_group_size: int | None = None,
                       name: str | None = None) -> tf.Tensor:
    """``x`` averaged across the replicas (of its group, as in :func:`cross_replica_sum`).
    Integer tensors: the sum divided and truncated toward zero."""
    return _reduce(x, replica_group_size, "mean", name or "cross_replica_mean")


def assume_equal_across_replicas(tensors: Any, inplace: bool = False) -> Any:
    """``tensors`` (a tensor or a nested structure of them, composites included) marked as
    equal on every replica: copies of the same values, in the same structure. ``inplace``
    (Graphcore's choice between a copy and marking in place) changes no value.

    Example:
        >>> flag = assume_equal_across_replicas(flag)  # doctest: +SKIP
        >>> tf.cond(flag > 0, fn_with_a_cross_replica_sum, other_fn)  # doctest: +SKIP
    """
    flat = tf.nest.flatten(tensors, expand_composites=True)
    with tf.name_scope("assume_equal_across_replicas"):
        out = [tf.identity(t) for t in flat]
    return tf.nest.pack_sequence_as(tensors, out, expand_composites=True)


__all__ = ["assume_equal_across_replicas", "cross_replica_mean", "cross_replica_sum"]
