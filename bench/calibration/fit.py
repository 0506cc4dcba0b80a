"""Fits the tile model's fitted figures to the calibration table and reports its errors.

    measurements.jsonl (table.py) --> per row: the tile model's estimate of the same operation
                                      (a small IR program planned on the row's preset)
        fitted figures (FIGURES)  <-- each fitted to the usable rows of its class, minimising
                                      mean |ln(estimated / measured)|
        held-out errors           <-- leave-one-source-out per class (README.md, declared
                                      before any fit): fitted without a source, estimated on it
    bench/results/mlperf_breakdowns.json (e2e.py) --> the end-to-end cycle scales, whole
                                      benchmarks held out, beside one constant on all cycles
    -> device_server/emulator/calibration.json (``--write``): the op-level figures and
       per-class errors, and the end-to-end fit (the data file the package ships and reads)

    python bench/calibration/fit.py                 the table: measured, estimated, ratio,
                                                    status; the end-to-end table (from the cache)
    python bench/calibration/fit.py --write         write calibration.json
    python bench/calibration/fit.py --check         exit 1 if calibration.json disagrees
    python bench/calibration/fit.py --e2e --write   first re-estimate the MLPerf runs (about
                                                    3 minutes), refresh the cache, re-estimate
                                                    once with the fitted scales (replay check)
    --e2e-only                                      the end-to-end part alone (the op-level
                                                    part of calibration.json kept; seconds)

The tile model costs the work of Poplar's library vertices (popops, poplin): a point measuring
hand-written assembly, unoptimised C++ vertices or a hardware port alone is reported and not
compared ("not modelled", with why), as is any point no predictor here covers. The op-level
figures are fitted on the presets without their end-to-end scales (those sit on top).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.calibration import e2e  # noqa: E402
from bench.calibration.table import Measurement, load_measurements  # noqa: E402
from device_server.emulator import arch, calibration  # noqa: E402
from device_server.emulator.tiles import plan_module  # noqa: E402
from device_server.protocol import dtypes, ir_pb2  # noqa: E402

DATA_FILE = calibration.DATA_FILE
_CHIP_PRESET = {"GC2": "ipu1", "GC200": "ipu2", "Bow": "bow"}
#: A class is calibrated with at least this many held-out points from this many sources.
MIN_HELD_OUT_POINTS, MIN_HELD_OUT_SOURCES = 3, 2
_DTYPES = {"float32": np.float32, "float16": np.float16}


# ------------------------------------------------------------------------------ programs


class _Program:
    """A one-computation IR program built by hand (the op a measurement times)."""

    def __init__(self, name: str) -> None:
        self.module = ir_pb2.Module(name=name, frontend="calibration")
        self.comp = self.module.computations.add(id=1, name=name)
        self.module.entry_computation_id = 1
        self.params = 0

    def add(self, opcode: str, operands: Sequence[int], dtype: Any, dims: Sequence[int],
            **attrs: Any) -> int:
        instr = self.comp.instructions.add(id=len(self.comp.instructions) + 1, opcode=opcode,
                                           operands=list(operands))
        instr.name = f"{opcode}.{instr.id}"
        instr.source_op = f"calibration/{opcode}"
        instr.shape.dtype = dtypes.from_numpy(np.dtype(dtype))
        instr.shape.dims.extend(int(d) for d in dims)
        if opcode == "parameter":
            instr.parameter_number = self.params
            self.params += 1
        for key, value in attrs.items():
            if isinstance(value, list):
                instr.attrs[key].ints.values.extend(int(v) for v in value)
            elif isinstance(value, np.ndarray):
                instr.attrs[key].literal.CopyFrom(_literal(value))
        return instr.id

    def done(self, root: int) -> ir_pb2.Module:
        self.comp.root_id = root
        return self.module


def _literal(a: np.ndarray) -> ir_pb2.Literal:
    lit = ir_pb2.Literal()
    lit.shape.dtype = dtypes.from_numpy(a.dtype)
    lit.shape.dims.extend(a.shape)
    lit.data = a.tobytes()
    return lit


def _seconds(module: ir_pb2.Module, target: arch.Target) -> float:
    """The device time of one call (host transfers left out: the measurements time the
    device's work on data already there): the plan's supersteps, as ``estimate_module``
    counts its ``device_cycles``, without the memory profile the fit does not need."""
    compute, exchange, sync, _ = plan_module(module, target).entry.totals()
    return math.ceil(compute + exchange + sync) / target.clock_hz


def _triad(target: arch.Target, dtype: Any) -> float:
    """STREAM triad a = b + s c over arrays of 8 Ki elements per tile: bytes moved (3 arrays,
    BabelSTREAM's count) per second."""
    n = target.tiles_per_ipu * 8192
    p = _Program("triad")
    b = p.add("parameter", [], dtype, [n])
    c = p.add("parameter", [], dtype, [n])
    s = p.add("constant", [], dtype, [], value=np.asarray(0.4, dtype=dtype))
    sb = p.add("broadcast", [s], dtype, [n], dimensions=[])
    module = p.done(p.add("add", [b, p.add("multiply", [sb, c], dtype, [n])], dtype, [n]))
    return 3 * n * np.dtype(dtype).itemsize / _seconds(module, target)


def _matmul_tflops(target: arch.Target, dtype: Any, m: int, k: int | None = None,
                   n: int | None = None) -> float:
    """TFLOP/s of [m, k] x [k, n] (square m^3 when k and n are not given)."""
    k = m if k is None else k
    n = m if n is None else n
    p = _Program("matmul")
    a = p.add("parameter", [], dtype, [m, k])
    b = p.add("parameter", [], dtype, [k, n])
    module = p.done(p.add("dot", [a, b], dtype, [m, n], lhs_contracting_dimensions=[1],
                          rhs_contracting_dimensions=[0], lhs_batch_dimensions=[],
                          rhs_batch_dimensions=[]))
    return 2 * m * k * n / _seconds(module, target) / 1e12


# Square products the matrix-product ceilings are read as the best of (Jia's "limit": the
# largest sizes; shapes not stated). 4096 is the largest square FP32 product a GC2 holds.
_CEILING_SIZES = (1024, 2048, 4096)


# ------------------------------------------------------------------------------ predictors


@dataclass(frozen=True)
class Prediction:
    value: float | None     # in the row's metric; None: not modelled
    why: str = ""           # why not modelled


Predictor = Callable[[Measurement, arch.Target], Prediction]


def _implementation(m: Measurement) -> str:
    return str(m.params.get("implementation", "") or "").lower()


def _stream(m: Measurement, t: arch.Target) -> Prediction:
    impl = _implementation(m)
    if "triad" not in str(m.params.get("kernel", "")).lower():
        return Prediction(None, "a read, write or latency microbenchmark of the memory port "
                                "alone; the tile model has one memory rate for library vertices")
    if "poplar" not in impl:
        return Prediction(None, f"{impl or 'its own vertices'}: not Poplar's library vertices")
    dtype = _DTYPES.get(str(m.params.get("dtype")))
    if dtype is None or m.metric != "gbytes_per_s":
        return Prediction(None, "dtype or metric the predictor does not cover")
    return Prediction(_triad(t, dtype) / 1e9)


def _matmul(m: Measurement, t: arch.Target) -> Prediction:
    dtype = _DTYPES.get(str(m.params.get("dtype")))
    if dtype is None or m.metric != "tflops":
        return Prediction(None, "dtype or metric the predictor does not cover")
    if m.params.get("method", "dense") != "dense" or m.params.get("density", 1.0) != 1.0:
        return Prediction(None, "a sparse product (the tile model has dense products only)")
    dims = [m.params.get(k) for k in ("m", "k", "n")]
    if all(isinstance(d, int) for d in dims):
        return Prediction(_matmul_tflops(t, dtype, *dims))
    # A ceiling without shapes: the best of the large square products.
    return Prediction(max(_matmul_tflops(t, dtype, n) for n in _CEILING_SIZES))


PREDICTORS: dict[str, Predictor] = {"stream": _stream, "matmul": _matmul}


# ------------------------------------------------------------------------------ figures


@dataclass(frozen=True)
class Figure:
    """A preset figure fitted to the rows of one class that ``applies`` selects."""

    name: str
    op_class: str
    applies: Callable[[Measurement], bool]
    low: float = 0.02
    high: float = 1.0


FIGURES = (
    Figure("library_memory_efficiency", "stream", lambda m: True),
    Figure("amp_fp16_efficiency", "matmul", lambda m: m.params.get("dtype") == "float16"),
    Figure("amp_fp32_efficiency", "matmul", lambda m: m.params.get("dtype") == "float32"),
    Figure("matmul_pass_overhead_cycles", "matmul", lambda m: True, low=1.0, high=20000.0),
)
#: Coordinate descent: each figure fitted with the others held, in FIGURES' order, this often.
ROUNDS = 3


#: The end-to-end scales left out of the op-level fit (1.0: the op-level points are fitted on
#: the model without them).
UNSCALED = {calibration.scale_name(c): 1.0 for c in calibration.E2E_CLASSES}


def unscaled_target(preset: str) -> arch.Target:
    """The preset without its end-to-end cycle scales."""
    return dataclasses.replace(arch.get_target(preset), **UNSCALED)


def _target(m: Measurement, figures: dict[str, float]) -> arch.Target:
    """The row's preset with ``figures`` (and no end-to-end scale)."""
    return dataclasses.replace(unscaled_target(_CHIP_PRESET[m.chip]), **figures)


def _error(rows: Sequence[Measurement], figures: dict[str, float]) -> float:
    errs = []
    for m in rows:
        p = PREDICTORS[m.op_class](m, _target(m, figures))
        errs.append(abs(math.log(p.value / m.value)))
    return float(np.mean(errs)) if errs else 0.0


# A coarse scan of ln(value), then golden section on the best bracket: ln(1/0.02) / 8 x 2 x
# 0.618^12 ~ 0.003, finer than the 3 decimals a figure is kept to.
_SCAN, _GOLDEN_STEPS = 9, 12


def objective(fig: Figure, rows: Sequence[Measurement], figures: dict[str, float]) -> float:
    """The mean |ln(estimated / measured)| of ``fig``'s rows with ``figures``."""
    return _error([m for m in rows if m.op_class == fig.op_class and fig.applies(m)], figures)


def fit_figure(fig: Figure, rows: Sequence[Measurement], start: dict[str, float]) -> float | None:
    """The value of ``fig`` minimising the rows' mean |ln(estimated / measured)| (golden
    section over ln(value) after a coarse scan), the other figures at ``start``; None
    without rows."""
    rows = [m for m in rows if fig.applies(m)]
    if not rows:
        return None

    def cost(x: float) -> float:
        return _error(rows, {**start, fig.name: math.exp(x)})

    lo, hi = math.log(fig.low), math.log(fig.high)
    grid = np.linspace(lo, hi, _SCAN)
    costs = [cost(x) for x in grid]
    i = int(np.argmin(costs))
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = cost(c), cost(d)
    for _ in range(_GOLDEN_STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = cost(d)
    value = math.exp((a + b) / 2)
    return round(value, 3) if fig.high <= 1.0 else round(value, 1)


#: Where every fit starts, and what a figure stays at when its rows cannot move it: the
#: uncalibrated model (the library at the memory port's rate, the AMP at its peak, no set-up
#: per pass). Never calibration.FITTED: a held-out fold would then start from values fitted
#: with the points it holds out.
PRIORS = {"library_memory_efficiency": 1.0, "amp_fp16_efficiency": 1.0,
          "amp_fp32_efficiency": 1.0, "matmul_pass_overhead_cycles": 0.0}


def fit_all(rows: Sequence[Measurement]) -> dict[str, float]:
    """Every fitted figure from ``rows``, starting from PRIORS (a figure with no rows keeps
    its prior)."""
    figures = dict(PRIORS)
    for _ in range(ROUNDS):
        for fig in FIGURES:
            got = fit_figure(fig, [m for m in rows if m.op_class == fig.op_class], figures)
            if got is not None:
                figures[fig.name] = got
    return figures


# ------------------------------------------------------------------------------ the report


@dataclass
class Point:
    m: Measurement
    estimated: float | None
    status: str             # "fitted", "held out", "not modelled: ...", "excluded: ..."
    held_out_estimate: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.estimated is None or not self.m.value:
            return None
        return self.estimated / self.m.value


def _comparable(rows: Sequence[Measurement]) -> tuple[list[Measurement], dict[str, str]]:
    """The usable op-level rows a predictor covers, and why each other row is left out."""
    keep, why = [], {}
    for m in rows:
        if m.excluded:
            why[m.id] = f"excluded: {m.excluded}"
        elif not m.is_ipu:
            why[m.id] = "reference (not an IPU)"
        elif m.value is None:
            why[m.id] = "no value"
        elif m.op_class not in PREDICTORS:
            why[m.id] = f"not modelled: no predictor for class {m.op_class}"
        else:
            p = PREDICTORS[m.op_class](m, unscaled_target(_CHIP_PRESET[m.chip]))
            if p.value is None:
                why[m.id] = f"not modelled: {p.why}"
            else:
                keep.append(m)
    return keep, why


def calibrate(rows: Sequence[Measurement] | None = None) -> dict[str, Any]:
    """The fit, each point's estimate and status, and the per-class held-out errors."""
    rows = list(load_measurements() if rows is None else rows)
    keep, why = _comparable(rows)
    figures = fit_all(keep)
    points: list[Point] = []
    held: dict[str, list[tuple[str, float]]] = {}   # class -> (source, |ln ratio|)
    sources_by_class: dict[str, set[str]] = {}
    for m in keep:
        sources_by_class.setdefault(m.op_class, set()).add(m.source)
    folds: dict[str, dict[str, float]] = {}  # held-out source -> the fit without it
    for m in rows:
        if m.id in why:
            points.append(Point(m, None, why[m.id]))
            continue
        est = PREDICTORS[m.op_class](m, _target(m, figures)).value
        point = Point(m, est, "fitted")
        if len(sources_by_class[m.op_class]) >= 2:  # leave its source out, fit, estimate
            if m.source not in folds:
                folds[m.source] = fit_all([r for r in keep if r.source != m.source])
            held_figures = folds[m.source]
            point.held_out_estimate = PREDICTORS[m.op_class](m, _target(m, held_figures)).value
            point.status = "held out"
            held.setdefault(m.op_class, []).append(
                (m.source, abs(math.log(point.held_out_estimate / m.value))))
        points.append(point)
    classes = {}
    for cls in calibration.OP_CLASSES:
        errs = held.get(cls, [])
        srcs = sorted({s for s, _ in errs})
        fitted_srcs = sorted(sources_by_class.get(cls, set()))
        calibrated = len(errs) >= MIN_HELD_OUT_POINTS and len(srcs) >= MIN_HELD_OUT_SOURCES
        entry: dict[str, Any] = {"calibrated": calibrated, "held_out_points": len(errs),
                                 "sources": fitted_srcs}
        if errs:
            entry["typical"] = round(math.exp(float(np.mean([e for _, e in errs]))), 3)
            entry["worst"] = round(math.exp(max(e for _, e in errs)), 3)
        if not calibrated:
            if not fitted_srcs:
                entry["why"] = "no published measurement of this class the tile model can be compared with"
            else:
                entry["why"] = (f"{len(errs)} held-out point(s) from {len(srcs)} source(s); "
                                f"comparable points from {', '.join(fitted_srcs)} only")
        classes[cls] = entry
    return {"figures": figures, "points": points, "classes": classes}


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.4g}"


def report(result: dict[str, Any], out: Any = sys.stdout, all_rows: bool = False) -> None:
    """Prints each IPU point (measured, estimated, ratio, status), the fitted figures and the
    per-class held-out errors."""
    print("calibration points (IPU rows; estimated with the fitted figures; held out: "
          "estimated by the fit without the row's source)", file=out)
    print(f"  {'id':<48} {'measured':>10} {'estimated':>10} {'ratio':>7} {'held-out':>9}  status",
          file=out)
    for p in result["points"]:
        if not all_rows and not p.m.is_ipu:
            continue
        held = (p.held_out_estimate / p.m.value) if p.held_out_estimate else None
        print(f"  {p.m.id:<48} {_fmt(p.m.value):>10} {_fmt(p.estimated):>10} {_fmt(p.ratio):>7} "
              f"{_fmt(held):>9}  {p.status}", file=out)
    print("fitted figures: " + ", ".join(f"{k} = {v}" for k, v in result["figures"].items()
                                         if k in {f.name for f in FIGURES}), file=out)
    print("per class, held-out error exp(mean |ln(estimated / measured)|) and worst:", file=out)
    for cls, e in result["classes"].items():
        if e["calibrated"]:
            print(f"  {cls:<12} typical {e['typical']:.2f}x, worst {e['worst']:.2f}x over "
                  f"{e['held_out_points']} held-out points ({', '.join(e['sources'])})", file=out)
        else:
            print(f"  {cls:<12} uncalibrated: {e['why']}", file=out)


# ------------------------------------------------------------------------------ calibration.json


def op_level_section(result: dict[str, Any]) -> dict[str, Any]:
    """calibration.json's "op_level" entry: the fitted figures and the per-class errors."""
    return {"figures": {f.name: result["figures"][f.name] for f in FIGURES},
            "class_errors": {cls: dict(e) for cls, e in result["classes"].items()}}


def e2e_result() -> dict[str, Any]:
    """The end-to-end fit replayed from the breakdown cache (no TensorFlow)."""
    return e2e.evaluate(e2e.load_runs())


def write(op_level: dict[str, Any], e2e_section: dict[str, Any], path: Path = DATA_FILE) -> None:
    """Writes the data file (schema 1)."""
    data = {"schema": 1,
            "written_by": "python bench/calibration/fit.py --write (do not edit by hand)",
            "op_level": op_level, "e2e": e2e_section}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def agrees(result: dict[str, Any] | None, e2e_section: dict[str, Any] | None = None,
           path: Path = DATA_FILE) -> list[str]:
    """What the data file holds that the fits do not give (empty: they agree). ``result``
    None: the op-level part is not compared; ``e2e_section`` None: nor the end-to-end one."""
    data = calibration.load(path)
    diffs = []
    if result is not None:
        want = op_level_section(result)
        for name, value in want["figures"].items():
            if data["op_level"]["figures"].get(name) != value:
                diffs.append(f"{name}: calibration.json {data['op_level']['figures'].get(name)}, "
                             f"fit {value}")
        if data["op_level"]["class_errors"] != want["class_errors"]:
            diffs.append("the per-class errors differ from the fit's")
    if e2e_section is not None:
        have = data.get("e2e", {})
        for key in ("figures", "fitted", "adopted", "folds", "held_out", "bounds"):
            if have.get(key) != e2e_section.get(key):
                diffs.append(f"e2e {key}: calibration.json {have.get(key)!r:.120}, fit "
                             f"{e2e_section.get(key)!r:.120}")
    return diffs


def verify(runs: list[e2e.Run], scales: dict[str, float]) -> dict[str, Any]:
    """Re-estimates the MLPerf runs with ``scales`` (figure -> value) in every preset, and
    compares each run's throughput with the replay's (e2e.Run.replay)."""
    from bench import bench_mlperf

    saved = dict(arch.PRESETS)
    try:
        for key, target in saved.items():
            arch.PRESETS[key] = dataclasses.replace(target, **scales)
        rows = bench_mlperf.estimate_rows()
    finally:
        arch.PRESETS.update(saved)
    again = {r.run: r for r in bench_mlperf.runs_of(rows)}
    by_class = {c: scales[calibration.scale_name(c)] for c in calibration.E2E_CLASSES
                if calibration.scale_name(c) in scales}
    out = []
    for r in runs:
        replayed = r.replay(by_class)
        est = again[r.run].estimated
        out.append({"run": r.run, "replayed": round(replayed, 2), "re_estimated": round(est, 2),
                    "ln_difference": round(math.log(replayed / est), 4)})
    worst = max(abs(x["ln_difference"]) for x in out)
    return {"scales": scales, "runs": out, "worst_ln_difference": worst,
            "accurate": worst <= e2e.REPLAY_TOLERANCE, "tolerance": e2e.REPLAY_TOLERANCE}


def refresh_e2e(check_replay: bool = True) -> None:
    """Re-estimates the MLPerf runs, refreshes the cache and (``check_replay``) re-estimates
    once with the scales fitted on all runs, recording how well the replay agrees."""
    from bench import bench_mlperf

    rows = bench_mlperf.estimate_rows()
    e2e.write_cache(rows)
    if check_replay:
        runs = e2e.load_runs()
        result = e2e.evaluate(runs)
        print(f"re-estimating with the scales fitted on all runs ({result['fitted']}) to check "
              "the replay")
        check = verify(runs, result["fitted"])
        for x in check["runs"]:
            print(f"  {x['run']:<18} replayed {x['replayed']:,.1f}/s, re-estimated "
                  f"{x['re_estimated']:,.1f}/s: ln difference {x['ln_difference']:+.4f}")
        e2e.write_cache(rows, replay_check=check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write calibration.json")
    parser.add_argument("--check", action="store_true", help="exit 1 if calibration.json disagrees")
    parser.add_argument("--all", action="store_true", help="list the comparison rows too")
    parser.add_argument("--e2e", action="store_true",
                        help="re-estimate the MLPerf runs first and refresh their cache")
    parser.add_argument("--no-replay-check", action="store_true",
                        help="with --e2e: skip re-estimating with the fitted scales")
    parser.add_argument("--e2e-only", action="store_true",
                        help="the end-to-end fit alone (calibration.json's op-level part kept)")
    args = parser.parse_args(argv)
    if args.e2e:
        refresh_e2e(not args.no_replay_check)
    result = None
    if not args.e2e_only:
        result = calibrate()
        report(result, all_rows=args.all)
    e2e_res = e2e_result()
    e2e.report(e2e_res)
    section = e2e.data_section(e2e_res, e2e.load_cache())
    if args.write:
        op_level = op_level_section(result) if result is not None else calibration.load()["op_level"]
        write(op_level, section)
        print(f"wrote {DATA_FILE.relative_to(ROOT)}")
    if args.check:
        diffs = agrees(result, section)
        for d in diffs:
            print("DIFFERS:", d)
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
