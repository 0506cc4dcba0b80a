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

from device_server.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
