"""The end-to-end calibration (bench/calibration/e2e.py, docs/tile_model.md "Calibration").

Replays the cached per-class breakdowns of the one-host MLPerf runs (no TensorFlow): the folds
hold out whole benchmarks and never split a configuration, no fit sets more figures than its
configurations, every figure stays within the bounds declared before fitting, and the data
file the package ships (device_server/emulator/calibration.json) holds what the fit gives.
The scales the model applies are the ones the replay assumes (a small program planned with
and without them).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.calibration import e2e, fit  # noqa: E402
from device_server.emulator import arch, calibration  # noqa: E402


@pytest.fixture(scope="module")
def runs() -> list[e2e.Run]:
    return e2e.load_runs()


@pytest.fixture(scope="module")
def result(runs: list[e2e.Run]) -> dict:
    return e2e.evaluate(runs)


def test_the_cache_holds_the_six_one_host_runs(runs: list[e2e.Run]) -> None:
    assert len(runs) == 6
    assert {r.benchmark for r in runs} == {"ResNet-50", "BERT-Large"}
    # v1.0 and v1.1 on one chip are one configuration: 4 in all
    assert e2e.configurations(runs) == {"resnet50/ipu2", "resnet50/bow", "bert-large/ipu2",
                                        "bert-large/bow"}
    for r in runs:
        assert r.measured > 0 and r.estimated > 0
        assert all(v >= 0 for v in r.cycles.values()) and sum(r.cycles.values()) > 0
        assert set(r.cycles) <= {*calibration.OP_CLASSES, e2e.UNSCALED}
        assert r.replay({}) == pytest.approx(r.estimated)


def test_folds_hold_out_whole_benchmarks_and_never_mix_a_configuration(runs: list[e2e.Run]) -> None:
    held = []
    for bench, train, test in e2e.folds(runs):
        assert {r.benchmark for r in test} == {bench}
        assert bench not in {r.benchmark for r in train}
        assert not e2e.configurations(train) & e2e.configurations(test)
        held += [r.run for r in test]
    assert sorted(held) == sorted(r.run for r in runs)  # each run held out exactly once


def test_no_fit_sets_more_figures_than_its_configurations_one_per_class(result: dict,
                                                                       runs: list[e2e.Run]) -> None:
    names = {calibration.scale_name(c) for c in e2e.CANDIDATES}
    for fold in result["folds"]:
        assert len(fold["figures"]) <= len(fold["training_configurations"])
        assert len(fold["figures"]) <= e2e.FIGURES_PER_FIT
        assert set(fold["figures"]) <= names
        assert len(fold["classes"]) == len(set(fold["classes"]))
    assert len(result["fitted"]) <= min(e2e.FIGURES_PER_FIT, len(e2e.configurations(runs)))
    assert set(result["fitted"]) <= names
    assert "matmul" not in e2e.CANDIDATES and "ipu_link" not in e2e.CANDIDATES


def test_every_figure_and_the_baseline_within_the_declared_bounds(result: dict) -> None:
    lo, hi = e2e.BOUNDS
    assert (lo, hi) == (0.5, 2.0)
    values = [*result["fitted"].values(), *(v for f in result["folds"] for v in f["figures"].values()),
              *(f["baseline"] for f in result["folds"])]
    assert values and all(lo <= v <= hi for v in values)


def test_adopted_only_if_it_beats_the_baseline_on_both(result: dict) -> None:
    fit_e, base = result["fit"], result["baseline"]
    assert result["adopted"] == (fit_e["typical"] < base["typical"] and fit_e["worst"] < base["worst"])
    for what in ("fit", "baseline", "unfitted"):
        logs = [abs(math.log(r[what])) for r in result["runs"]]
        assert result[what]["typical"] == pytest.approx(math.exp(sum(logs) / len(logs)), abs=1e-4)
        assert result[what]["worst"] == pytest.approx(math.exp(max(logs)), abs=1e-4)


def test_the_data_file_holds_what_the_fit_gives(result: dict) -> None:
    section = e2e.data_section(result, e2e.load_cache())
    assert fit.agrees(None, section) == [], "python bench/calibration/fit.py --e2e-only --write"
    data = calibration.load()
    applied = data["e2e"]["figures"]
    if data["e2e"]["adopted"]:
        assert {k: v for k, v in applied.items() if v != 1.0} == {
            k: v for k, v in data["e2e"]["fitted"].items() if v != 1.0}
    else:
        assert set(applied.values()) == {1.0}
    # the presets hold them, tagged fitted (with the runs) only where adopted
    for name, target in arch.PRESETS.items():
        for figure, value in applied.items():
            assert getattr(target, figure) == value
            kind, why = arch.provenance(name)[figure]
            fitted = data["e2e"]["adopted"] and figure in data["e2e"]["fitted"] and name != "ipu1"
            assert (kind == "fitted") == fitted, (name, figure)
            if fitted:
                assert "MLPerf" in why


def test_the_model_scales_each_class_as_the_replay_does() -> None:
    """A planned program with scales: its cycles are the unscaled estimate's per-class cycles
    times their scales (class_shares, as the breakdowns count them)."""
    from device_server.emulator.tiles import estimate_module

    p = fit._Program("mlp")
    x = p.add("parameter", [], np.float16, [512, 1024])
    w = p.add("parameter", [], np.float16, [1024, 1024])
    y = p.add("dot", [x, w], np.float16, [512, 1024], lhs_contracting_dimensions=[1],
              rhs_contracting_dimensions=[0], lhs_batch_dimensions=[], rhs_batch_dimensions=[])
    module = p.done(p.add("tanh", [p.add("add", [y, x], np.float16, [512, 1024])], np.float16,
                          [512, 1024]))
    base = fit.unscaled_target("bow")
    scales = {"elementwise": 0.6, "exchange": 1.7, "sync": 1.3, "host_link": 0.8}
    seen: dict[int, dict[str, float]] = {}
    from device_server.emulator.tiles import report

    original = report.class_shares

    def recording(est, ops):  # noqa: ANN001, ANN202
        out = original(est, ops)
        seen[id(est)] = out
        return out

    report.class_shares = recording
    try:
        ref = estimate_module(module, None, base)
    finally:
        report.class_shares = original
    shares = seen[id(ref)]
    assert sum(shares.values()) == pytest.approx(1.0)
    scaled = estimate_module(module, None, dataclasses.replace(
        base, **{calibration.scale_name(c): v for c, v in scales.items()}))
    want = sum(s * scales.get(c, 1.0) for c, s in shares.items()) * ref.cycles
    assert scaled.cycles == pytest.approx(want, rel=2e-3)
    assert scaled.host_cycles == pytest.approx(0.8 * ref.host_cycles, rel=2e-3)
