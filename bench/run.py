"""Benchmarks (`make bench`): ratios measured side by side in one run, warm.

    python bench/run.py [--only NAME ...] [--quick] [--results DIR]
    BENCH_JOBS=1 python bench/run.py ...     # estimates in this process, one after another

The parts whose estimates are independent (mlperf, mlperf_pods, fit_cases) make them in
worker processes side by side (bench/parallel.py: ``BENCH_JOBS``, else one per CPU, at most
one per 6 GB available), with the same rows in the same order. The whole sequence (no
``--only``) runs fuzz at its quick count (``SEQUENCE_QUICK``); ``--only fuzz`` runs the
million requests of the saved record. After each part: its seconds and the load average;
at the end, every part's seconds.

Each benchmark prints one line per configuration. Absolute times on shared machines drift;
the ratios are what to compare. What a benchmark prints (and the rows it returns, if any) is
saved as ``bench/results/<name>.json`` with the command, the date, the machine's load
average before and after, the CPU count and the git commit: docs/ and issue notes cite
those files, never figures typed by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import subprocess
import sys
import time

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
    "resident": lambda quick: __import__("bench.bench_resident", fromlist=["main"]).main(quick),
    "transport": lambda quick: __import__("bench.bench_transport", fromlist=["main"]).main(quick),
    "disk_cache": lambda quick: __import__("bench.bench_disk_cache", fromlist=["main"]).main(quick),
    "replication": lambda quick: __import__("bench.bench_replication", fromlist=["main"]).main(quick),
    "pipelining": lambda quick: __import__("bench.bench_pipelining", fromlist=["main"]).main(quick),
    "calibration": lambda quick: __import__("bench.bench_calibration", fromlist=["main"]).main(quick),
    "mlperf": lambda quick: __import__("bench.bench_mlperf", fromlist=["main"]).main(quick),
    "mlperf_pods": lambda quick: __import__("bench.bench_mlperf", fromlist=["pods_main"]).pods_main(quick),
    "onnx": lambda quick: __import__("bench.bench_onnx", fromlist=["main"]).main(quick),
    "fit_cases": lambda quick: __import__("bench.bench_fit_cases", fromlist=["main"]).main(quick),
    "fuzz": lambda quick: __import__("bench.bench_fuzz", fromlist=["main"]).main(quick),
    "distributed": lambda quick: __import__("bench.bench_distributed", fromlist=["main"]).main(quick),
}

#: Parts the whole sequence runs at their quick size, and where the full size is.
SEQUENCE_QUICK = {
    "fuzz": "100,000 requests, saved as fuzz-quick.json; the million-request record of issue 25 "
            "(fuzz.json, about 29 minutes): python bench/run.py --only fuzz",
}

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, out: io.TextIOBase) -> None:
        self.out = out
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.out.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(RESULTS), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_one(name: str, quick: bool, results: str | None, argv: list[str]) -> float:
    """Runs benchmark ``name``, printing as it goes, then its seconds and the load average;
    saves what it printed under ``results`` (None: not saved). Returns its seconds."""
    load_before = os.getloadavg()
    started = time.time()
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        rows = BENCHES[name](quick=quick)
    seconds = time.time() - started
    load_after = os.getloadavg()
    print(f"({name}: {seconds:.0f} s; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after, {os.cpu_count()} CPUs)", flush=True)
    if results is None:
        return seconds
    os.makedirs(results, exist_ok=True)
    record = {
        "benchmark": name,
        "command": " ".join(["python", "bench/run.py", *argv]),
        "date": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(
            timespec="seconds"),
        "seconds": round(seconds, 1),
        "quick": quick,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "commit": _commit(),
        "env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "TF_IPU_EMULATOR_THREADS",
                                             "TF_IPU_EMULATOR_JIT", "BENCH_JOBS")
                if k in os.environ},
        "output": tee.copy.getvalue().splitlines(),
        "rows": rows if isinstance(rows, list) else None,
    }
    path = os.path.join(results, f"{name}{'-quick' if quick else ''}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"(saved {os.path.relpath(path)})")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHES), default=None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--results", default=RESULTS,
                        help="where to save what each benchmark printed ('' : nowhere)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    took = {}
    for name in args.only or BENCHES:
        quick = args.quick or (args.only is None and name in SEQUENCE_QUICK)
        print(f"== {name}" + (f" (quick in the whole sequence: {SEQUENCE_QUICK[name]})"
                              if quick and not args.quick else ""), flush=True)
        took[name] = run_one(name, quick, args.results or None, argv)
    if len(took) > 1:
        print(f"== {sum(took.values()) / 60:.1f} minutes: " + ", ".join(
            f"{name} {s:.0f} s" for name, s in sorted(took.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
