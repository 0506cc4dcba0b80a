"""The host network between instances: Open MPI through mpi4py, buffer calls only.

    instance 0 ──┐                      ┌── instance 0
    instance 1 ──┼─ Iallreduce / Ibcast ┼── instance 1     (numpy buffers, no pickling:
    instance k ──┘   / Iallgather       └── instance k      the uppercase mpi4py calls)

Every collective is started non-blocking and waited for by polling with short sleeps, so an
instance waiting for the others sleeps instead of spinning (a blocking MPI call polls its
progress engine at full speed; here many processes share few cores). MPI is initialised on
first use only, and only under a multi-instance run: outside one, every collective returns
its input (one instance).
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import Any

import numpy as np

from tf_ipu.distributed import identity

#: Polling of a pending collective: first sleep, growth factor, longest sleep (seconds).
_POLL_FIRST, _POLL_GROWTH, _POLL_MAX = 0.0002, 1.5, 0.005
_lock = threading.Lock()
_comm: Any = None

OPS = ("sum", "mean", "max", "min")


def comm() -> Any:
    """The instances' communicator (``MPI.COMM_WORLD``), MPI initialised on first call.

    Raises:
        RuntimeError: not under a multi-instance run, or MPI's world does not match the
            run's instances.
    """
    global _comm
    with _lock:
        if _comm is not None:
            return _comm
        if not identity.isPopdistEnvSet():
            raise RuntimeError("No tf-ipu-run here: start the program with tf-ipu-run "
                               "(or poprun) to have instances to talk to.")
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        instances, index = identity.getNumInstances(), identity.getInstanceIndex()
        if world.Get_size() != instances or world.Get_rank() != index:
            raise RuntimeError(
                f"MPI sees rank {world.Get_rank()} of {world.Get_size()} but the run says "
                f"instance {index} of {instances}: start the program with tf-ipu-run, one "
                f"MPI rank per instance.")
        _comm = world
        return _comm


def active() -> bool:
    """Whether collectives reach other instances (a run of more than one instance)."""
    return identity.is_multi_instance()


def _wait(request: Any) -> None:
    delay = _POLL_FIRST
    while not request.Test():
        time.sleep(delay)
        delay = min(delay * _POLL_GROWTH, _POLL_MAX)


def _mpi_op(op: str) -> Any:
    from mpi4py import MPI

    if op not in OPS:
        raise ValueError(f"A reduction across instances is one of {', '.join(OPS)}. "
                         f"Received: {op!r}")
    return {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


def _contiguous(value: Any) -> np.ndarray:
    a = np.asarray(value, order="C")
    if a.dtype == object:
        raise TypeError(f"Only numeric arrays cross between instances. Received dtype {a.dtype}.")
    return np.ascontiguousarray(a) if a.ndim else a.copy()


def allreduce(value: Any, op: str = "sum", purpose: str = "allreduce") -> np.ndarray:
    """``value`` (an array, the same shape and dtype on every instance) reduced over the
    instances: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``. ``purpose`` names the call in
    the error raised when the instances are not all making it."""
    a = _contiguous(value)
    _mpi_op(op)  # checks op even with one instance
    if not active():
        return a
    c = comm()
    out = np.empty_like(a)
    _check_same(c, a, purpose)
    _wait(c.Iallreduce(a, out, op=_mpi_op(op)))
    if op == "mean":
        out = out / c.Get_size()
        return out.astype(a.dtype) if a.dtype.kind == "f" else out
    return out


def broadcast(value: Any, root: int = 0, purpose: str = "broadcast") -> np.ndarray:
    """Instance ``root``'s ``value`` on every instance (each passes an array of the same
    shape and dtype; a mismatch is an error naming both)."""
    a = _contiguous(value)
    if not active():
        return a
    c = comm()
    if not 0 <= root < c.Get_size():
        raise ValueError(f"root_rank must be an instance index in [0, {c.Get_size()}). "
                         f"Received: {root}")
    _check_same(c, a, purpose)
    _wait(c.Ibcast(a, root=root))
    return a


def allgather(value: Any, purpose: str = "allgather") -> np.ndarray:
    """Every instance's ``value`` concatenated along dimension 0, in instance order (the
    first dimension may differ between instances; the others and the dtype may not)."""
    a = _contiguous(value)
    if a.ndim == 0:
        a = a.reshape(1)
    if not active():
        return a
    c = comm()
    _check_same(c, a[:0] if a.ndim else a, purpose)  # all but dimension 0
    counts = np.empty(c.Get_size(), np.int64)
    _wait(c.Iallgather(np.array([a.shape[0]], np.int64), counts))
    row = int(np.prod(a.shape[1:], dtype=np.int64))
    out = np.empty((int(counts.sum()), *a.shape[1:]), a.dtype)
    sizes = [int(n) * row for n in counts]
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
    from mpi4py.util.dtlib import from_numpy_dtype

    dtype = from_numpy_dtype(a.dtype)
    _wait(c.Iallgatherv(a, [out, sizes, displs, dtype]))
    return out


def barrier() -> None:
    """Waits until every instance got here (sleeping, not spinning)."""
    if active():
        _wait(comm().Ibarrier())


def _signature(a: np.ndarray, purpose: str) -> np.ndarray:
    """The call's purpose (a checksum), ``a``'s dtype code, rank and dims as int64s (fixed
    length, so the instances can compare them in one call)."""
    sig = np.full(11, -1, np.int64)
    sig[0] = zlib.crc32(purpose.encode())
    sig[1] = np.dtype(a.dtype).num
    sig[2] = a.ndim
    dims = list(a.shape)[:8]
    sig[3:3 + len(dims)] = dims
    return sig


def _check_same(c: Any, a: np.ndarray, purpose: str) -> None:
    """Raises on every instance unless all are making the same call (``purpose``) with
    arrays of one dtype and shape (a mismatched collective would corrupt data or hang)."""
    mine = _signature(a, purpose)
    both = np.concatenate([mine, -mine])
    out = np.empty_like(both)
    _wait(c.Iallreduce(both, out, op=_mpi_op("max")))  # one call: the max and the min
    hi, lo = out[:mine.size], -out[mine.size:]
    if lo[0] != hi[0]:
        raise RuntimeError(
            f"Instance {c.Get_rank()} is at a collective call ({purpose}) that not every "
            f"instance is making: every instance must make the same calls in the same order. "
            f"In Keras: every instance must run the same number of steps (shard the data "
            f"evenly, e.g. dataset.shard(popdist.getNumInstances(), "
            f"popdist.getInstanceIndex()) batched with drop_remainder=True, or pass "
            f"steps_per_epoch / steps).")
    if not np.array_equal(lo, hi):
        raise ValueError(
            f"{purpose} across instances needs the same dtype and shape on every instance; "
            f"instance {c.Get_rank()} has {a.dtype}{list(a.shape)}, and the instances "
            f"disagree (dtype codes {lo[1]}..{hi[1]}, ranks {lo[2]}..{hi[2]}).")


__all__ = ["OPS", "active", "allgather", "allreduce", "barrier", "broadcast", "comm"]
