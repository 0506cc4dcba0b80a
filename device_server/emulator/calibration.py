"""The tile model's calibration: fitted figures and the held-out error of each operation class.

    bench/calibration/measurements.jsonl   published measurements, each with its source
      -> bench/calibration/fit.py          fits FITTED on op-level points; leave-one-source-out
                                           errors per class (CLASS_ERRORS); rewrites this file
                                           (``--write``), and its test checks it still agrees
      -> arch.py                           the presets hold FITTED's figures
      -> tiles/report.py                   every estimate names the expected error of the
                                           classes that dominate its cycles (expected_error)

Nothing here is typed by hand: the two dicts below are written by
``python bench/calibration/fit.py --write`` (docs/tile_model.md, "Calibration").
"""

from __future__ import annotations

from typing import Any

__all__ = ["CLASS_ERRORS", "FITTED", "OP_CLASSES", "class_of_opcode", "expected_error"]

#: The operation classes of the calibration table (bench/calibration/README.md).
OP_CLASSES = ("matmul", "conv", "elementwise", "reduction", "stream", "exchange", "sync",
              "host_link", "ipu_link", "collective")

# ---- written by bench/calibration/fit.py --write (do not edit by hand) -----------------------
FITTED: dict[str, float] = {
    'library_memory_efficiency': 0.237,
    'amp_fp16_efficiency': 0.915,
    'amp_fp32_efficiency': 0.691,
    'matmul_pass_overhead_cycles': 2318.3,
}
CLASS_ERRORS: dict[str, dict[str, Any]] = {
    'matmul': {'calibrated': True, 'held_out_points': 82, 'sources': ['jia2019', 'popsparse2023'], 'typical': 1.266, 'worst': 2.132},
    'conv': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
    'elementwise': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
    'reduction': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
    'stream': {'calibrated': False, 'held_out_points': 0, 'sources': ['louw2021'], 'why': '0 held-out point(s) from 0 source(s); comparable points from louw2021 only'},
    'exchange': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
    'sync': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
    'host_link': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
    'ipu_link': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
    'collective': {'calibrated': False, 'held_out_points': 0, 'sources': [], 'why': 'no published measurement of this class the tile model can be compared with'},
}
# ---- end of what fit.py writes --------------------------------------------------------------

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
