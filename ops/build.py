"""Builds the op library (`IpuExecute`) with TensorFlow's own compile and link flags.

Compiles every ``ops/cc/**/*.cc`` into one shared object with g++ (or ``$CXX``), printing the
command, and fails loudly (non-zero exit, the compiler's output) if anything goes wrong. The
``.so`` is written next to its final path and moved into place, so a process loading the old
library never sees a half-written file.

Used by ``make ops`` and by ``setup.py``'s ``build_py``::

    python ops/build.py --out ops/python/_ipu_ops.so
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

OPS_DIR = Path(__file__).resolve().parent
# Run as a script, this file puts ops/ first on sys.path, where ops/python/ would shadow the
# top-level `python` package TensorFlow imports (`from python.runfiles import ...`) with
# tf_ipu_ops, which then imports TensorFlow half-initialized. Never have ops/ on sys.path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != OPS_DIR]
REPO_ROOT = OPS_DIR.parent
BASE_FLAGS = ["-O2", "-fPIC", "-shared", "-std=c++17", "-Wno-deprecated-declarations"]


def sources() -> list[Path]:
    """Returns the C++ sources of the op library, sorted.

    Returns:
        Every ``*.cc`` under ``ops/cc``.

    Example:
        >>> [p.name for p in sources()]  # doctest: +SKIP
        ['ipu_execute_kernel.cc', 'ipu_ops.cc']
    """
    return sorted((OPS_DIR / "cc").rglob("*.cc"))


def tf_flags() -> tuple[list[str], list[str]]:
    """Returns TensorFlow's (compile flags, link flags) for custom ops."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Keep the build log readable.
    import tensorflow as tf  # Imported here: ~4 s, only needed to build.

    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def command(out: Path, cxx: str | None = None) -> list[str]:
    """Returns the compiler command that builds the library into ``out``.

    Args:
        out: path of the shared object to write.
        cxx: compiler to use; defaults to ``$CXX`` or ``g++``.

    Returns:
        The argv of the compile-and-link command.
    """
    srcs = sources()
    if not srcs:
        raise SystemExit(f"ops/build.py: no C++ sources found under {OPS_DIR / 'cc'}")
    compile_flags, link_flags = tf_flags()
    cxx = cxx or os.environ.get("CXX", "g++")
    # Eigen's headers trip g++ 12's -Winterference-size on every file: noise, not our code.
    quiet = [] if "clang" in Path(cxx).name else ["-Wno-interference-size"]
    return [
        cxx,
        *BASE_FLAGS,
        *quiet,
        *compile_flags,
        f"-I{REPO_ROOT}",
        *[str(s) for s in srcs],
        "-o",
        str(out),
        *link_flags,
    ]


def build(out: Path, cxx: str | None = None) -> Path:
    """Builds the op library into ``out``.

    Args:
        out: path of the shared object to write (its directory is created).
        cxx: compiler to use; defaults to ``$CXX`` or ``g++``.

    Returns:
        ``out``, resolved.

    Raises:
        SystemExit: if the compiler is missing or fails (its output is already printed).

    Example:
        >>> build(Path("ops/python/_ipu_ops.so"))  # doctest: +SKIP
    """
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    argv = command(tmp, cxx)
    print(shlex.join(argv), flush=True)
    start = time.monotonic()
    try:
        result = subprocess.run(argv, cwd=REPO_ROOT)
    except FileNotFoundError as e:
        raise SystemExit(f"ops/build.py: compiler not found: {argv[0]} ({e})") from e
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(
            f"ops/build.py: FAILED to build {out} (compiler exit status {result.returncode})"
        )
    os.replace(tmp, out)
    print(f"ops/build.py: built {out} in {time.monotonic() - start:.1f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python ops/build.py --out PATH``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=OPS_DIR / "python" / "_ipu_ops.so",
        help="shared object to write (default: ops/python/_ipu_ops.so)",
    )
    parser.add_argument("--cxx", default=None, help="C++ compiler (default: $CXX or g++)")
    args = parser.parse_args(argv)
    build(args.out, args.cxx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
