"""Per-call overhead of the `IpuExecute` op (no device server: a do-nothing Python handler).

Where the time goes::

    tf.function call -> IpuExecute kernel -> ctypes trampoline -> handler.execute (no-op here)

Compares, per call: an empty `tf.function` (the floor every Keras step pays), the op run
eagerly (through the checked wrapper and the raw generated wrapper), the op inside a
`tf.function`, and `tf.py_function` inside a `tf.function` for reference. With ``--big`` also
a 600 KB float32 input copied into a 600 KB output by the handler (zero-copy views).

Run::

    .venv/bin/python bench/bench_ops.py [--calls 500] [--repeats 5] [--big]

Environment: TF_CPP_MIN_LOG_LEVEL defaults to 2 here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

OPS_PYTHON = Path(__file__).resolve().parents[1] / "ops" / "python"


def load_tf_ipu_ops():
    """Imports tf_ipu_ops: installed if it is, else the in-tree `ops/python` by path."""
    if importlib.util.find_spec("tf_ipu_ops") is None:
        spec = importlib.util.spec_from_file_location(
            "tf_ipu_ops", OPS_PYTHON / "__init__.py", submodule_search_locations=[str(OPS_PYTHON)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["tf_ipu_ops"] = module
        spec.loader.exec_module(module)
    import tf_ipu_ops

    return tf_ipu_ops


class NoOpHandler:
    """Registers anything; execute leaves outputs as allocated (or copies, if asked)."""

    def __init__(self, copy: bool = False) -> None:
        self.copy = copy
        self.calls = 0

    def register_program(self, program: bytes, signature: str) -> int:
        return 0

    def execute(self, program_id: int, inputs: list[np.ndarray], outputs: list[np.ndarray]):
        self.calls += 1
        if self.copy:
            for x, y in zip(inputs, outputs, strict=True):
                np.copyto(y, x)


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    """Returns (min, median) microseconds per call of ``fn`` over ``repeats`` runs."""
    for _ in range(max(20, calls // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return min(samples), statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints one line per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    parser.add_argument("--big", action="store_true", help="also time a 600 KB input/output")
    args = parser.parse_args(argv)

    ops = load_tf_ipu_ops()
    handler = NoOpHandler()
    ops.set_device_handler(handler)

    def cases_for(x: tf.Tensor) -> dict[str, Callable[[], object]]:
        shape = x.shape.as_list()

        def op(t):
            return ops.ipu_execute([t], [tf.float32], [shape], b"bench", "{}")[0]

        @tf.function
        def empty(t):
            return t

        @tf.function
        def with_op(t):
            return op(t)

        @tf.function
        def with_py_function(t):
            return tf.py_function(lambda v: v, [t], tf.float32)

        raw = ops.op_module.ipu_execute
        return {
            "empty tf.function": lambda: empty(x),
            "eager tf.identity (reference)": lambda: tf.identity(x),
            "IpuExecute eager (ipu_execute wrapper)": lambda: op(x),
            "IpuExecute eager (raw op wrapper)": lambda: raw(
                inputs=[x],
                Tout=[tf.float32],
                output_shapes=[shape],
                program=b"bench",
                signature="{}",
            ),  # fmt: skip
            "tf.function with IpuExecute": lambda: with_op(x),
            "tf.function with tf.py_function": lambda: with_py_function(x),
        }

    sizes = [("16 B", tf.ones([4]))]
    if args.big:
        sizes.append(("600 KB", tf.ones([150_000])))
    print(f"TF {tf.__version__}, {os.cpu_count()} CPUs, {args.calls} calls x {args.repeats} runs")
    for label, x in sizes:
        handler.copy = label != "16 B"
        print(f"\ninput/output {label} float32 (handler {'copies' if handler.copy else 'no-op'})")
        results = {
            name: per_call_us(fn, args.calls, args.repeats) for name, fn in cases_for(x).items()
        }
        floor = results["empty tf.function"][1]
        for name, (best, median) in results.items():
            print(f"  {name:42s} min {best:7.1f} us  median {median:7.1f} us  "
                  f"(+{median - floor:6.1f} us vs empty tf.function)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
