"""Collectives of tensors between the instances of a run, on the host (Graphcore's
``ipu.distributed.host_collective_ops``).

    t (a tensor on instance k) ──numpy──> mpi.allreduce / broadcast / allgather ──> tensor
    eagerly: directly;  in a tf.function: a tf.numpy_function (host only, not saveable)

They run on the host: inside a device program (strategy.run, a Keras step) they are refused
(cross-replica all-reduces there are ``ipu.cross_replica_ops``). Outside a run of several
instances each returns its input (one instance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tf_ipu.distributed import mpi


def _op_name(reduce_op: Any) -> str:
    if isinstance(reduce_op, tf.distribute.ReduceOp):
        return reduce_op.value.lower()
    if isinstance(reduce_op, str) and reduce_op.lower() in mpi.OPS:
        return reduce_op.lower()
    raise ValueError(f"reduce_op must be tf.distribute.ReduceOp.SUM or MEAN (or one of "
                     f"{', '.join(mpi.OPS)}). Received: {reduce_op!r}")


def _on_host(fn: Callable[[np.ndarray], np.ndarray], value: Any, what: str,
             keep_shape: bool = True) -> tf.Tensor:
    from tf_ipu.strategy import _lowering_depth

    if _lowering_depth() > 0:
        raise RuntimeError(
            f"host_collective_ops.{what} runs on the host between instances: call it outside "
            f"the device program (strategy.run / a Keras step); across the replicas of a "
            f"program use ipu.cross_replica_ops.")
    t = tf.convert_to_tensor(value)
    if tf.executing_eagerly():  # a MEAN of integers is truncated back to their dtype
        return tf.constant(np.asarray(fn(t.numpy())).astype(t.dtype.as_numpy_dtype), dtype=t.dtype)
    out = tf.numpy_function(lambda a: np.asarray(fn(a), dtype=a.dtype), [t], t.dtype,
                            stateful=True, name=f"host_{what}")
    out.set_shape(t.shape if keep_shape else [None, *t.shape[1:]])
    return out


def allreduce(value: Any, reduce_op: Any = tf.distribute.ReduceOp.SUM,
              tensor_name: str | None = None) -> tf.Tensor:
    """``value`` reduced over the instances (``ReduceOp.SUM`` or ``MEAN``); every instance
    passes a tensor of the same shape and dtype. ``tensor_name`` is Graphcore's, unused."""
    del tensor_name
    op = _op_name(reduce_op)
    return _on_host(lambda a: mpi.allreduce(a, op), value, "allreduce")


def all_reduce(value: Any, reduce_op: Any = tf.distribute.ReduceOp.SUM,
               tensor_name: str | None = None) -> tf.Tensor:
    """``allreduce`` by the name Graphcore's SDK 3.x gives it (its PopDistStrategy's host
    reductions call ``host_collective_ops.all_reduce``; earlier SDKs: ``allreduce``)."""
    return allreduce(value, reduce_op, tensor_name)


def broadcast(value: Any, root_rank: int = 0, tensor_name: str | None = None) -> tf.Tensor:
    """Instance ``root_rank``'s ``value`` on every instance (same shape and dtype on all)."""
    del tensor_name
    return _on_host(lambda a: mpi.broadcast(a, root_rank), value, "broadcast")


def allgather(value: Any, tensor_name: str | None = None) -> tf.Tensor:
    """Every instance's ``value`` concatenated along dimension 0, in instance order."""
    del tensor_name
    return _on_host(mpi.allgather, value, "allgather", keep_shape=False)


__all__ = ["all_reduce", "allgather", "allreduce", "broadcast"]
