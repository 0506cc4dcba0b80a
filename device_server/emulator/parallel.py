"""Intra-op parallelism: big kernels split their work over a few host threads.

    program thread --run_parts(part, n)--+-- part(i), part(j), ...   on the calling thread
                                         +-- part(k), ...             on pool threads
                    (returns when every part is done; the first exception is raised)

numpy releases the GIL inside BLAS calls, array copies and ufunc loops, so parts that are
mostly such calls run side by side on the host's cores. The caller takes parts too and never
waits for a part nobody has started: when every core is busy with other sessions' work, a
kernel simply runs its parts itself, one after another (no deadlock when calls nest, no queue
behind other sessions).

Parts must write disjoint outputs, and a kernel cuts its work by the problem's size alone
(:func:`parts_for`), never by the thread count: a BLAS call's summation order can depend on
the shape it is handed (small-matrix kernels), so the same cut on 1 or 8 threads is what
makes a kernel's result independent of how many threads ran it.

The thread count is ``TF_IPU_EMULATOR_THREADS`` when set, else the CPUs this process may run
on; the device server's ``--emulator-threads`` sets it (:func:`set_threads`). BLAS itself stays
single-threaded in the server (see ``device_server/__main__.py``): its threads spin-wait, which
costs far more than it gains when sessions run side by side.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["matmul", "parts_for", "run_parts", "scratch", "set_threads", "split", "threads"]

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _default_threads() -> int:
    env = os.environ.get("TF_IPU_EMULATOR_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


_threads = _default_threads()


def threads() -> int:
    """How many threads (the caller included) a kernel may use."""
    return _threads


def set_threads(count: int) -> None:
    """Sets the thread count (at least 1); the pool is remade on its next use."""
    global _threads, _pool
    if int(count) < 1:
        raise ValueError(f"emulator threads must be at least 1, got {count}.")
    with _lock:
        _threads = int(count)
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=False)


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, _threads - 1), thread_name_prefix="emulator-part")
        return _pool


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` items cut into at most ``parts`` contiguous, non-empty ``(start, stop)``
    ranges of nearly equal size."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def run_parts(part: Callable[[int], None], count: int) -> None:
    """Calls ``part(i)`` for every ``i`` in ``range(count)`` on up to :func:`threads`
    threads and returns when all calls are done; raises the first exception a part raised
    (the remaining parts are then skipped)."""
    width = min(_threads, count)
    if width <= 1:
        for i in range(count):
            part(i)
        return
    claim = itertools.count().__next__  # atomic under the GIL
    failed: list[BaseException] = []
    errstate = np.geterr()  # numpy's error state is per thread: the parts run under the caller's

    def work() -> None:
        with np.errstate(**errstate):
            work_here()

    def work_here() -> None:
        while not failed:
            i = claim()
            if i >= count:
                return
            try:
                part(i)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                failed.append(e)
                return

    pool = _get_pool()
    try:
        futures = [pool.submit(work) for _ in range(width - 1)]
    except RuntimeError:  # the pool was shut down by set_threads: run here
        futures = []
    work_here()
    for f in futures:
        if not f.cancel():
            f.result()
    if failed:
        raise failed[0]


# Below this many multiply-adds per part, handing a part to another thread costs more than it saves.
MIN_PART_MACS = 1 << 21
# The most parts a product is cut into, whatever the thread count (8 keeps 2-8 cores busy).
MAX_PARTS = 8


def parts_for(macs: int) -> int:
    """How many parts a kernel of ``macs`` multiply-adds is cut into: a function of the work
    alone, so that the cut (and with it every result bit) is the same on any thread count."""
    return max(1, min(MAX_PARTS, int(macs) // MIN_PART_MACS))


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``np.matmul(a, b, out=out)`` for a 2-D or 3-D (batched) ``a`` and a 2-D or 3-D ``b``,
    cut into parts by batch, by rows of ``a`` or (few rows, a 2-D ``b``) by columns of
    ``b`` when the product is big enough."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = a.shape[0] if a.ndim == 3 else 1
    parts = parts_for(batch * m * k * n)
    if parts <= 1:
        return np.matmul(a, b, out=out)
    if out is None:
        shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, n)
        out = np.empty(shape, np.result_type(a.dtype, b.dtype))
    if b.ndim == 2 and batch * m <= 64 and batch * m < n and n >= 4 * parts:
        # Few rows (a small batch times a big weight): cut the columns of b, so that each
        # thread reads its own part of b instead of all of it (a, the smaller, is read by
        # every thread instead).
        ranges = split(n, parts)

        def by_columns(i: int) -> None:
            s, e = ranges[i]
            np.matmul(a, b[:, s:e], out=out[..., s:e])

        run_parts(by_columns, len(ranges))
    elif a.ndim == 3 and batch >= parts:
        ranges = split(batch, parts)
        b_batched = b.ndim == 3

        def by_batch(i: int) -> None:
            s, e = ranges[i]
            np.matmul(a[s:e], b[s:e] if b_batched else b, out=out[s:e])

        run_parts(by_batch, len(ranges))
    else:
        ranges = split(m, parts)

        def by_rows(i: int) -> None:
            s, e = ranges[i]
            np.matmul(a[..., s:e, :], b, out=out[..., s:e, :])

        run_parts(by_rows, len(ranges))
    return out


_scratch = threading.local()


def scratch(count: int, dtype: np.dtype) -> np.ndarray:
    """A 1-D array of ``count`` elements of ``dtype`` that belongs to this thread: reused by
    the next call on the same thread, so use it only until then (never return it)."""
    nbytes = count * np.dtype(dtype).itemsize
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1), np.uint8)
        _scratch.buf = buf
    return buf[:nbytes].view(dtype)
