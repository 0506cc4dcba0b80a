"""Independent estimates of a bench part in worker processes (issues 24 and 27: the time
budget of ``make bench`` on a 2-core machine).

    parent (bench/run.py)                        workers (spawned, never forked: TensorFlow
        | calls [(module, function, args)]          is imported in the parent)
        | longest first (``cost``)        --->    import module; function(*args) with its
        | values yielded in the calls' order <---  printing captured; (value, printed text)
        v
    the part's own loop prints each call's text, in order, as its value arrives

A tile-model estimate and the TensorFlow lowering before it are single-threaded Python, so
one estimate uses one core; the estimates a part makes one after another (fit_cases' cases,
mlperf's runs, mlperf_pods' rounds) do not depend on each other and are deterministic, so
running them side by side gives the same rows in the same order, sooner.

Workers: ``BENCH_JOBS`` if set (1: today's in-process path, nothing spawned), else
``os.cpu_count()``; never more than one per ``GB_PER_WORKER`` GB of the machine's
``MemAvailable`` when the part starts (a BERT-Large estimate peaks at 3-5 GB), nor more than
there are calls. Each part prints how many it used and why.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

#: The environment variable that sets the worker count (1: in process).
ENV = "BENCH_JOBS"
#: Available memory each worker needs (a BERT-Large estimate peaks at 3-5 GB).
GB_PER_WORKER = 6

#: Each worker's thread pools: one thread each (unless set already), as TensorFlow's and the
#: BLAS libraries' pools otherwise take every core in every worker, and workers side by side
#: then ran each estimate 3 times slower than alone (bench/README.md, "Workers").
WORKER_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                  "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")

#: A call made in a worker: the module's import name, the function's name in it, its arguments.
Call = tuple[str, str, tuple[Any, ...]]


def mem_available_gb(meminfo: str = "/proc/meminfo") -> float | None:
    """The machine's MemAvailable in GB (None where /proc/meminfo does not say)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return None


def workers(calls: int, env: dict[str, str] | None = None,
            available_gb: float | None = None) -> tuple[int, str]:
    """How many workers for ``calls`` independent calls, and why (one line for the output).

    ``BENCH_JOBS`` (in ``env``, default ``os.environ``) if set, else the CPU count; capped at
    one per ``GB_PER_WORKER`` GB available (``available_gb``, default MemAvailable now) and at
    ``calls``. A value of ``BENCH_JOBS`` that is not a positive integer raises ValueError."""
    env = os.environ if env is None else env
    raw = env.get(ENV, "").strip()
    if raw:
        try:
            asked = int(raw)
        except ValueError:
            asked = 0
        if asked < 1:
            raise ValueError(f"{ENV}={raw!r}: expected a positive number of worker processes "
                             f"(1: estimate in this process)")
        why = [f"{ENV}={asked}"]
    else:
        asked = os.cpu_count() or 1
        why = [f"{asked} CPUs ({ENV} unset)"]
    n = asked
    if asked > 1:
        gb = mem_available_gb() if available_gb is None else available_gb
        if gb is not None:
            by_memory = max(1, int(gb // GB_PER_WORKER))
            why.append(f"{gb:.0f} GB available: at most {by_memory} at {GB_PER_WORKER} GB each")
            n = min(n, by_memory)
    if n > calls:
        why.append(f"{calls} call{'s' if calls != 1 else ''}")
        n = max(1, calls)
    return n, ", ".join(why)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` within (what processes started within inherit)."""
    os.environ.update(values)
    try:
        yield
    finally:
        for k in values:
            os.environ.pop(k, None)


def _init() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _call(module: str, function: str, args: tuple[Any, ...]) -> tuple[Any, str]:
    """In a worker: ``module.function(*args)`` and what it printed."""
    fn = getattr(importlib.import_module(module), function)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        value = fn(*args)
    return value, out.getvalue()


def run(calls: Sequence[Call], jobs: int, cost: Sequence[float] | None = None) -> Iterator[Any]:
    """Each call's value, in the calls' order. With ``jobs`` <= 1 (or one call) they run here,
    one after another, printing as they go; otherwise in ``jobs`` spawned workers, started
    longest first by ``cost`` (a guess per call: it orders, never changes a value), each
    call's printing shown, in the calls' order, when its value is yielded. A call that raises
    raises here, the calls not yet started cancelled."""
    if jobs <= 1 or len(calls) <= 1:
        for module, function, args in calls:
            yield getattr(importlib.import_module(module), function)(*args)
        return
    order = sorted(range(len(calls)), key=lambda i: -(cost[i] if cost else 0.0))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_init) as pool:
        futures: dict[int, Future[tuple[Any, str]]] = {}
        try:
            with _environment({k: "1" for k in WORKER_THREADS if k not in os.environ}):
                for i in order:   # the workers start here, with this environment
                    futures[i] = pool.submit(_call, *calls[i])
            for i in range(len(calls)):
                value, printed = futures[i].result()
                print(printed, end="", flush=True)
                yield value
        finally:
            for f in futures.values():
                f.cancel()
