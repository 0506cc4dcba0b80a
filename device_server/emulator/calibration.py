"""The tile model's calibration: fitted figures and the held-out error of each operation class.

    bench/calibration/measurements.jsonl   published measurements, each with its source
      -> bench/calibration/fit.py          fits the op-level figures (FITTED) on op-level
                                           points, leave-one-source-out errors per class
                                           (CLASS_ERRORS); fits the end-to-end cycle scales
                                           (E2E) on the one-host MLPerf runs, benchmark held
                                           out; writes calibration.json (``--write``)
      -> calibration.json                  the data file beside this module (shipped with
                                           the package): nothing here is typed by hand
      -> arch.py                           the presets hold FITTED's figures and E2E's scales
      -> tiles/planner.py                  every plan's supersteps scaled by class
                                           (apply_cycle_scales); tiles/cycles.py the host link
      -> tiles/report.py                   every estimate names the expected error of the
                                           classes that dominate its cycles (expected_error)

``python -m tf_ipu.estimate --calibration`` prints the data file (``table``);
docs/tile_model.md, "Calibration".
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CLASS_ERRORS", "CYCLE_SCALES", "DATA_FILE", "E2E", "E2E_CLASSES", "FITTED",
           "OP_CLASSES", "apply_cycle_scales", "class_of_opcode", "describe", "expected_error",
           "load", "scale_name", "table"]

#: The operation classes of the calibration table (bench/calibration/README.md).
OP_CLASSES = ("matmul", "conv", "elementwise", "reduction", "stream", "exchange", "sync",
              "host_link", "ipu_link", "collective")
#: The classes an end-to-end cycle scale exists for (one figure each, ``<class>_cycle_scale``
#: of arch.Target): those no op-level source covers and the model can scale. Not ipu_link:
#: a pipeline's transfers between IPUs are costed in tiles/pipeline.py, which no scale reaches.
E2E_CLASSES = ("elementwise", "conv", "reduction", "exchange", "sync", "host_link", "collective")

#: The data file fit.py writes (``python bench/calibration/fit.py --write``).
DATA_FILE = Path(__file__).with_name("calibration.json")


def scale_name(cls: str) -> str:
    """The arch.Target figure scaling the cycles of class ``cls``."""
    return f"{cls}_cycle_scale"


def load(path: Path = DATA_FILE) -> dict[str, Any]:
    """The data file: ``op_level`` {figures, class_errors} and ``e2e`` {figures, adopted,
    why, bounds, fitted, held_out, ...} (bench/calibration/fit.py writes it)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("schema") != 1:
        raise RuntimeError(f"{path}: calibration data of schema {data.get('schema')!r}, not 1")
    return data


_DATA = load()
#: The op-level fitted figures (fit.py's FIGURES).
FITTED: dict[str, float] = dict(_DATA["op_level"]["figures"])
#: Per class: calibrated or not (with why), leave-one-source-out typical and worst error.
CLASS_ERRORS: dict[str, dict[str, Any]] = dict(_DATA["op_level"]["class_errors"])
#: The end-to-end fit's record (fit.py ``--e2e``): what the presets hold and why.
E2E: dict[str, Any] = dict(_DATA["e2e"])
#: ``<class>_cycle_scale`` -> the factor the presets hold (1.0: not fitted or not adopted).
CYCLE_SCALES: dict[str, float] = {scale_name(c): float(E2E.get("figures", {}).get(scale_name(c), 1.0))
                                  for c in E2E_CLASSES}

# The estimate's cycles by the kind of work, as the calibration's classes name them.
_OPCODE_CLASS = {"dot": "matmul", "convolution": "conv", "reduce": "reduction",
                 "reduce-window": "reduction", "select-and-scatter": "reduction",
                 "tf_ipu_all_reduce": "collective", "all-reduce": "collective"}


def class_of_opcode(opcode: str) -> str:
    """The calibration class of an instruction's work (anything else: element-wise)."""
    return _OPCODE_CLASS.get(opcode, "elementwise")


def expected_error(shares: dict[str, float], min_share: float = 0.1) -> list[dict[str, Any]]:
    """Per class taking at least ``min_share`` of an estimate's cycles (largest first): its
    share, and its held-out error (``typical``: exp(mean |ln(estimated / measured)|),
    ``worst``) or ``None`` where the class is uncalibrated (fewer than 3 held-out points from
    2 sources), with why."""
    out = []
    for cls, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        if share < min_share:
            continue
        err = CLASS_ERRORS.get(cls, {})
        calibrated = bool(err.get("calibrated"))
        out.append({"class": cls, "share": round(float(share), 4),
                    "typical": err.get("typical") if calibrated else None,
                    "worst": err.get("worst") if calibrated else None,
                    "why": err.get("why", "no published measurement of this class in "
                                          "bench/calibration")})
    return out


def describe(rows: list[dict[str, Any]]) -> str:
    """One line for a report: the dominant classes with their expected errors."""
    parts = []
    for r in rows:
        if r["typical"] is None:
            parts.append(f"{r['class']} {r['share']:.0%} of the cycles: uncalibrated ({r['why']})")
        else:
            parts.append(f"{r['class']} {r['share']:.0%} of the cycles: typically within "
                         f"{r['typical']:.2f}x, worst {r['worst']:.2f}x (held out)")
    return "expected error: " + "; ".join(parts) if parts else ""


def apply_cycle_scales(entry: Any, target: Any, collectives: Iterable[dict[str, Any]] = ()) -> None:
    """Scales every superstep of a planned computation (``tiles.plan.CompPlan``, its loops'
    and calls' bodies included) by the target's end-to-end cycle scales, in place: compute by
    the class of its opcode (``class_of_opcode``: conv, reduction, element-wise; a matrix
    product's compute is the op-level fit's, not scaled), exchange, sync, and the links between
    IPUs (all-reduces and replica syncs: ``collective``, as ``tiles.report.class_shares``
    counts them); ``collectives`` (the plan's records of its all-reduces) likewise. The host
    link's scale is applied where host transfers are costed (``tiles.cycles.host_seconds``).
    Every scale 1.0 (the default): nothing changes."""
    scale = {c: float(getattr(target, scale_name(c), 1.0)) for c in E2E_CLASSES}
    if all(v == 1.0 for c, v in scale.items() if c != "host_link"):
        return
    seen: set[int] = set()
    pending = [entry]
    while pending:
        comp = pending.pop()
        for step in comp.steps:
            if id(step) in seen:
                continue
            seen.add(id(step))
            step.compute *= scale.get(class_of_opcode(str(step.opcode)), 1.0)
            step.exchange *= scale["exchange"]
            step.sync *= scale["sync"]
            step.link *= scale["collective"]
            pending.extend(step.children)
    for rec in collectives:
        for key in ("cycles", "seconds"):
            if key in rec:
                rec[key] *= scale["collective"]


def table(data: dict[str, Any] | None = None) -> str:
    """The calibration as the data file holds it (``python -m tf_ipu.estimate
    --calibration``): the op-level figures and per-class held-out errors, then the end-to-end
    fit: its figures, whether it is adopted, and its held-out errors beside the baseline's."""
    d = _DATA if data is None else data
    out = ["Tile model calibration (device_server/emulator/calibration.json, written by "
           "bench/calibration/fit.py --write)", "op-level fitted figures:"]
    out += [f"  {k} = {v}" for k, v in d["op_level"]["figures"].items()]
    out.append("per class, held-out error (leave one source out) exp(mean |ln(estimated / "
               "measured)|) and worst:")
    for cls, e in d["op_level"]["class_errors"].items():
        if e.get("calibrated"):
            out.append(f"  {cls:<12} typical {e['typical']:.2f}x, worst {e['worst']:.2f}x over "
                       f"{e['held_out_points']} held-out points ({', '.join(e['sources'])})")
        else:
            out.append(f"  {cls:<12} uncalibrated: {e.get('why', '')}")
    e2e = d.get("e2e", {})
    out.append(f"end to end ({e2e.get('source', '-')}):")
    out.append(f"  {'adopted' if e2e.get('adopted') else 'NOT adopted'}: {e2e.get('why', '')}")
    out.append("  cycle scales the presets hold: " + ", ".join(
        f"{k} = {v:g}" for k, v in e2e.get("figures", {}).items()))
    if e2e.get("fitted"):
        out.append("  fitted on all the runs: " + ", ".join(
            f"{k} = {v:g} (bounds {e2e['bounds'][k][0]:g}-{e2e['bounds'][k][1]:g})"
            for k, v in e2e["fitted"].items()))
    held = e2e.get("held_out")
    if held:
        out.append("  held out (the benchmark left out of each fold's fit), throughput "
                   "estimated / measured:")
        out.append(f"    {'run':<26} {'configuration':<18} {'unfitted':>9} {'fit':>7} {'baseline':>9}")
        for r in held["runs"]:
            out.append(f"    {r['run']:<26} {r['configuration']:<18} {r['unfitted']:>9.3f} "
                       f"{r['fit']:>7.3f} {r['baseline']:>9.3f}")
        for what in ("fit", "baseline", "unfitted"):
            e = held[what]
            out.append(f"    {what:<9} typical {e['typical']:.3f}x, worst {e['worst']:.3f}x")
        out.append("    per class (runs weighted by the class's share of their cycles; worst over "
                   "runs where it holds >= 10%): fit | baseline")
        def worst(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f}x"

        for cls, e in held["classes"].items():
            f, b = e["fit"], e["baseline"]
            out.append(f"      {cls:<12} share {e['share']:.0%}: typical {f['typical']:.3f}x, worst "
                       f"{worst(f['worst'])} | typical {b['typical']:.3f}x, worst {worst(b['worst'])}")
    return "\n".join(out)
