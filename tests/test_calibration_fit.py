"""The tile model's calibration (device_server/emulator/calibration.json, bench/calibration/fit.py).

Every figure of every preset says whether it is published (with its source), fitted to
bench/calibration's measurements, or assumed; the fitted figures are what fit.py gets from the
table (the stream figure refitted here; the matrix-product figures checked to be the optimum
of fit.py's objective within their rounding: a full refit takes minutes, and ``make bench``'s
calibration part runs it and says whether calibration.json agrees); every estimate names the
expected error of the classes that dominate it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.calibration import fit  # noqa: E402
from device_server.emulator import arch, calibration  # noqa: E402


def test_every_figure_of_every_preset_is_published_fitted_or_assumed() -> None:
    for name, target in arch.PRESETS.items():
        tags = arch.provenance(name)
        figures = {f.name for f in dataclasses.fields(target)} - {"name", "product", "ipu_version"}
        assert set(tags) == figures, name
        for figure, (kind, why) in tags.items():
            assert kind in ("published", "fitted", "assumed"), (name, figure)
            assert len(why) > 10, (name, figure)  # a source, a fit's rows or a reason
        summary = arch.calibration_summary(name)
        assert sum(summary.values()) == len(figures)
    # What fit.py fits is what the presets measured call fitted (GC2's STREAM and products,
    # Bow's products); GC200, with no measurement of its own, assumes them.
    # The end-to-end scales (test_calibration_e2e.py) are fitted on GC200 and Bow runs where
    # the fit is adopted.
    e2e_fitted = set(calibration.E2E.get("fitted", {})) if calibration.E2E.get("adopted") else set()
    fitted = {f for p in ("ipu1", "bow") for f, (kind, _) in arch.provenance(p).items()
              if kind == "fitted"}
    assert fitted - e2e_fitted == {f.name for f in fit.FIGURES} == set(calibration.FITTED)
    assert arch.calibration_summary("ipu2")["fitted"] == len(e2e_fitted)
    for name, target in arch.PRESETS.items():
        for figure, value in {**calibration.FITTED, **calibration.CYCLE_SCALES}.items():
            assert getattr(target, figure) == value, (name, figure)


def test_the_fitted_figures_are_what_the_table_gives() -> None:
    rows, why = fit._comparable(fit.load_measurements())
    assert rows and all(m.usable for m in rows)
    assert all(w for w in why.values())
    stream = next(f for f in fit.FIGURES if f.name == "library_memory_efficiency")
    assert fit.fit_figure(stream, [m for m in rows if m.op_class == "stream"],
                          dict(calibration.FITTED)) == calibration.FITTED[stream.name]
    for fig in fit.FIGURES:
        if fig.op_class == "stream":
            continue
        value = calibration.FITTED[fig.name]
        at = fit.objective(fig, rows, dict(calibration.FITTED))
        for step in (0.99, 1.01):  # the rounding's neighbourhood, both sides
            assert at <= fit.objective(fig, rows, {**calibration.FITTED, fig.name: value * step}) + 1e-9, \
                (fig.name, step)


def test_points_fit_says_are_not_comparable_say_why() -> None:
    result_points = []
    rows = fit.load_measurements()
    _, why = fit._comparable(rows)
    for m in rows:
        if m.is_ipu and not m.excluded and m.id in why:
            result_points.append((m.id, why[m.id]))
    assert result_points, "every IPU row is compared: the filter did nothing"
    assert all(w.startswith("not modelled: ") for _, w in result_points)
    naive = next(w for i, w in result_points if i == "louw2021-stream-triad-fp32-naive")
    assert "not Poplar's library vertices" in naive


def test_a_class_is_calibrated_only_with_three_held_out_points_from_two_sources() -> None:
    for cls, e in calibration.CLASS_ERRORS.items():
        assert cls in calibration.OP_CLASSES
        if e["calibrated"]:
            assert e["held_out_points"] >= fit.MIN_HELD_OUT_POINTS
            assert len(e["sources"]) >= fit.MIN_HELD_OUT_SOURCES
            assert 1.0 <= e["typical"] <= e["worst"]
        else:
            assert e["why"]
    rows = calibration.expected_error({"matmul": 0.7, "elementwise": 0.25, "sync": 0.05})
    assert [r["class"] for r in rows] == ["matmul", "elementwise"]  # under 10%: left out
    line = calibration.describe(rows)
    assert line.startswith("expected error: matmul 70% of the cycles")


def test_every_estimate_names_the_expected_error_of_its_dominant_classes() -> None:
    from device_server.emulator.tiles import estimate_module

    t = arch.get_target("ipu2")
    p = fit._Program("dot")
    a = p.add("parameter", [], np.float16, [2048, 2048])
    b = p.add("parameter", [], np.float16, [2048, 2048])
    module = p.done(p.add("dot", [a, b], np.float16, [2048, 2048], lhs_contracting_dimensions=[1],
                          rhs_contracting_dimensions=[0], lhs_batch_dimensions=[],
                          rhs_batch_dimensions=[]))
    for instr in module.computations[0].instructions:
        if instr.opcode == "parameter":
            instr.source_type = "variable"  # resident: no host transfer
    module.aliases.add(output_index=0, parameter_number=0)  # the result stays there too
    est = estimate_module(module, None, t)
    classes = [r["class"] for r in est.expected_error]
    assert classes and classes[0] == "matmul"
    assert sum(r["share"] for r in est.expected_error) <= 1.0 + 1e-9
    assert any(n.startswith("expected error: matmul") for n in est.notes), est.notes
    assert est.to_dict()["expected_error"] == est.expected_error


@pytest.mark.parametrize("preset", ["ipu1", "ipu2", "bow"])
def test_the_fitted_stream_figure_is_what_a_triad_reaches(preset: str) -> None:
    """The STREAM triad the stream figure was fitted to: GC2 estimated within the fit's error
    of Louw & McIntosh-Smith's 7,261 GB/s (Poplar's primitives, FP32); and the efficiency is
    what makes an element-wise op slower than the read port alone allows."""
    t = fit.unscaled_target(preset)  # the op-level fit's model: no end-to-end scale
    gbs = fit._triad(t, np.float32) / 1e9
    port = t.memory_bytes_per_cycle_per_tile * t.tiles_per_ipu * t.clock_hz / 1e9
    assert gbs < 0.5 * port
    if preset == "ipu1":
        assert gbs == pytest.approx(7261, rel=0.1)
