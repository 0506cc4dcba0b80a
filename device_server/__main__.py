"""``python -m device_server`` (and the ``device_server`` console script): see ``device_server.cli``.

Before numpy loads, BLAS is capped to one thread per process unless the environment says
otherwise (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS / MKL_NUM_THREADS): the server runs
sessions concurrently, each execute on its own thread, and on small machines BLAS threads
that spin-wait beside the host process cost 2-10x on convolutions (measured on 2 cores).
"""

import os
import sys

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def _one_malloc_arena() -> None:
    """glibc gives threads malloc arenas of their own. The server's threads allocate and
    free chunk-sized buffers (gRPC's, and the bytes of streamed chunks), and each arena
    kept some of them free: a 768 MiB chunked round trip peaked at the payload plus
    ~50-60 MiB, against ~25 MiB with one arena (bench/bench_transport.py, "chunked peak
    RSS"), at the same bandwidth (Python allocates under the GIL anyway).
    ``MALLOC_ARENA_MAX`` in the environment has the last word."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(-8, 1)  # M_ARENA_MAX


_one_malloc_arena()

from device_server.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
