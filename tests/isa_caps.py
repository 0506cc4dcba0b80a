"""Runs a command with the host CPU's instruction set capped, as a machine without AVX512
(issue 25): XLA's CPU code generation held to AVX2, numpy's AVX512 dispatch targets disabled,
numba compiling for a generic x86-64.

    .venv/bin/python tests/isa_caps.py .venv/bin/python -m pytest -q tests   # make test-isa-capped

The suite passes the same under the caps: its references do not depend on the instructions
the host has (tests/test_isa_independence.py checks the emulator's own results bit for bit).
"""

from __future__ import annotations

import os
import sys


def caps() -> dict[str, str]:
    """The caps as environment variables: numpy's AVX512 dispatch targets (whatever this numpy
    calls them: X86_V4, AVX512_ICL, AVX512_SPR in numpy 2.4; AVX512F, AVX512_SKX, ... before),
    numba's generic CPU, XLA's AVX2."""
    from numpy._core._multiarray_umath import __cpu_dispatch__

    avx512 = [d for d in __cpu_dispatch__ if d == "X86_V4" or d.startswith("AVX512")]
    return {"NPY_DISABLE_CPU_FEATURES": " ".join(avx512), "NUMBA_CPU_NAME": "generic",
            "XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: isa_caps.py COMMAND [ARG ...]")
    env = {**os.environ, **caps()}
    print("isa_caps: " + " ".join(f"{k}={v!r}" for k, v in caps().items()), file=sys.stderr,
          flush=True)
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])
