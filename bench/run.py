"""Benchmarks (`make bench`): ratios measured side by side in one run, warm.

    python bench/run.py [--only NAME ...] [--quick]

Each benchmark prints one line per configuration. Absolute times on shared machines drift;
the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import bench_keras_step, bench_server  # noqa: E402

BENCHES = {
    "keras_step": bench_keras_step.main,
    "estimate": lambda quick: __import__("bench.bench_estimate", fromlist=["main"]).main(quick),
    "server": bench_server.main,
    "emulator": lambda quick: __import__("bench.bench_emulator", fromlist=["main"]).main(quick),
    "conv": lambda quick: __import__("bench.bench_conv", fromlist=["main"]).main(quick),
    "models": lambda quick: __import__("bench.bench_models", fromlist=["main"]).main(quick),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHES), default=None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    for name in args.only or BENCHES:
        print(f"== {name}")
        BENCHES[name](quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
