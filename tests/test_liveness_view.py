"""The HTML report's liveness view (docs/tile_model.md, "Memory per tile"): the fullest tile's
bytes at every program point of the entry computation (``memory.liveness_trace``,
``Estimate.liveness``), which must agree with the memory profile: its highest point is the
fullest tile's peak, and the tensors it names there are the profile's contributors.
"""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from device_server.disk_cache import decode_entry, encode_entry
from device_server.emulator import get_target
from device_server.emulator.tiles import Estimate, estimate_module
from device_server.emulator.tiles.memory import liveness_trace, profile_memory
from device_server.emulator.tiles.pipeline import phases
from device_server.emulator.tiles.planner import plan_module
from device_server.emulator.tiles.recompute import Recomputation
from tests.test_pipeline_estimate import _lowered, _staged

IPU2 = get_target("ipu2")
_LIVE = ("activations", "temporaries")


@pytest.fixture(scope="module")
def tf():
    import tensorflow as tf

    return tf


@pytest.fixture(scope="module")
def step(tf):
    """A Keras MLP's training step (3 Dense layers of 256 and a head, batch 32, SGD)."""
    return _lowered(tf, 3, 256, 32, "liveness_mlp")


@pytest.fixture(scope="module")
def est(step) -> Estimate:
    module, kinds = step
    return estimate_module(module, None, IPU2, param_kinds=kinds)


def _peak_of(lv: dict) -> list:
    return next(p for p in lv["points"] if p[0] == lv["peak"]["position"])


def test_the_trace_peaks_at_the_fullest_tile_s_peak(est: Estimate) -> None:
    lv = est.liveness
    assert lv["tile"] == est.peak_tile and lv["ipu"] == 0 and lv["order"] == est.memory_order
    bytes_ = [p[1] for p in lv["points"]]
    assert max(bytes_) == lv["peak"]["bytes"] == est.peak_tile_bytes
    assert _peak_of(lv)[1] == est.peak_tile_bytes
    # Every step holds the tile's always-live bytes; the rest is what is live at the step.
    always = sum(est.memory[c][est.peak_tile] for c in ("variables", "inputs", "constants",
                                                        "code and vertex state", "exchange code"))
    assert abs(lv["always_live_bytes"] - always) <= 5 and min(bytes_) >= lv["always_live_bytes"] - 1
    assert lv["peak"]["bytes"] - lv["always_live_bytes"] == pytest.approx(
        lv["peak"]["not_always_live_bytes"], abs=1)
    # One point per step (a small program), in order, the end last; forward, then backward.
    assert lv["bucket"] == 1 and [p[0] for p in lv["points"]] == list(range(lv["positions"]))
    assert lv["points"][-1][2] == "(end)"
    assert lv["phase_starts"]["F"] == 0 < lv["phase_starts"]["B"]
    assert any(p[4].startswith("d0") for p in lv["points"])  # Keras layers named
    assert lv["peak"]["phase"] in ("F", "B", "U") and lv["extra_bytes"] == 0 and lv["notes"] == []


def test_the_tensors_at_the_peak_are_the_profile_s_contributors(est: Estimate) -> None:
    top = est.liveness["top"]
    live = [c for c in est.contributors if c["kind"] in _LIVE]
    assert top and live
    n = min(len(top), len(live))
    assert top[:n] == live[:n]
    assert sum(c["bytes"] for c in top) <= est.liveness["peak"]["not_always_live_bytes"] + 1


@pytest.mark.parametrize("order", ["scheduled", "hlo"])
def test_every_tile_s_trace_peaks_at_its_own_peak(step, order: str) -> None:
    """On any tile, in either order, with recomputation or not: max == the profile's
    figure for that tile, down-sampled or not."""
    module, kinds = step
    plan = plan_module(module, IPU2, None, param_kinds=kinds)
    rec = Recomputation("cheap", phases(module))
    for recompute in (None, rec):
        prof = profile_memory(plan, order=order, recompute=recompute)
        rng = np.random.default_rng(0)
        for tile in [prof.peak_tile, 0, *rng.integers(0, IPU2.tiles_per_ipu, 3)]:
            full = liveness_trace(plan, prof, int(tile))
            assert max(p[1] for p in full.points) == full.peak_bytes == int(np.ceil(prof.total[tile]))
            few = liveness_trace(plan, prof, int(tile), max_points=17)
            assert len(few.points) <= 17 and few.bucket > 1
            assert max(p[1] for p in few.points) == full.peak_bytes
            assert any(p[0] == full.peak_position for p in few.points)  # the peak is kept


def test_html_has_the_liveness_section_with_a_chart(est: Estimate, tmp_path) -> None:
    text = open(est.save_html(str(tmp_path / "r.html")), encoding="utf-8").read()
    root = ET.fromstring(text.split("\n", 1)[1])
    assert f"Liveness (tile {est.peak_tile})" in text
    body = text[text.index("Liveness (tile"):]
    section = body[:body.index("<h2>", 10)]
    assert section.count("<svg") == 1 and "<polygon" in section and "<circle" in section
    assert "Live at the peak" in section and "Steps around the peak" in section
    assert f"{est.peak_tile_bytes:,} B" in section
    assert root is not None and "<script" not in text


def test_to_dict_from_dict_and_the_disk_cache_keep_it(est: Estimate) -> None:
    back = Estimate.from_dict(json.loads(est.to_json()))
    assert back.liveness == est.liveness and back.liveness["points"]
    record = {"estimate": {**dataclasses.asdict(est), "assumptions": list(est.assumptions)}}
    key = "0" * 64
    again = Estimate.from_dict(decode_entry(encode_entry(key, record), key)["estimate"])
    assert again.liveness == est.liveness
    assert len(json.dumps(est.liveness)) < 60_000  # a small program: small
    # An estimate without one (the default) renders, saying so.
    assert Estimate.from_dict({**est.to_dict(), "liveness": {}}).liveness == {}
    from device_server.emulator.tiles.html import render_html

    assert "No liveness trace" in render_html({**est.to_dict(), "liveness": {}})


@pytest.fixture(scope="module")
def staged(step):
    module, kinds = step
    return _staged(module, {"d0": 0, "d1": 0, "d2": 1, "head": 1}), kinds


@pytest.mark.parametrize("kw", [
    {"micro_batches": 8},                                            # two IPUs, a stash
    {"micro_batches": 8, "recomputation": True},                     # checkpoints stashed
    {"micro_batches": 4, "stage_ipus": [0, 0], "ipus_per_replica": 1},  # both stages on one IPU
], ids=["two-ipus", "recomputation", "one-ipu"])
def test_a_pipeline_s_trace_is_its_fullest_ipu_s_with_the_stash(staged, kw) -> None:
    module, kinds = staged
    est = estimate_module(module, None, IPU2, param_kinds=kinds, pipeline_stages=2, **kw)
    lv = est.liveness
    assert (lv["tile"], lv["ipu"]) == (est.peak_tile, est.peak_ipu)
    assert max(p[1] for p in lv["points"]) == lv["peak"]["bytes"] == est.peak_tile_bytes
    row = next(d for d in est.ipus if d["ipu"] == est.peak_ipu)
    assert lv["stages"] == row["stages"]
    assert {p[5] for p in lv["points"][:-1]} == {0, 1}  # the stages of the points
    if lv["extra_bytes"]:
        assert any("stashed" in n for n in lv["notes"])
        assert min(p[1] for p in lv["points"]) >= lv["always_live_bytes"] + lv["extra_bytes"] - 1
    text = est._repr_html_()
    assert f"Liveness (tile {est.peak_tile}, IPU {est.peak_ipu})" in text
    ET.fromstring(text.split("\n", 1)[1])


def test_offloaded_optimizer_state_is_off_the_tile_during_the_steps(tf) -> None:
    """Both stages on one IPU (a stash), Adam's state offloaded: the trace counts the stash at
    every step and leaves the offloaded state out, and still peaks at the fullest tile's peak
    (or says the peak is the weight update's)."""
    module, kinds = _lowered(tf, 3, 256, 32, "liveness_adam", optimizer="adam")
    module = _staged(module, {"d0": 0, "d1": 0, "d2": 1, "head": 1})
    est = estimate_module(module, None, IPU2, param_kinds=kinds, pipeline_stages=2, micro_batches=4,
                          stage_ipus=[0, 0], ipus_per_replica=1, optimizer_state_offload="on")
    lv = est.liveness
    assert lv["extra_bytes"] > 0 and lv["offloaded_bytes"] > 0
    assert [n for n in lv["notes"] if "stashed" in n] and [n for n in lv["notes"] if "offloaded" in n]
    assert min(p[1] for p in lv["points"]) >= \
        lv["always_live_bytes"] - lv["offloaded_bytes"] + lv["extra_bytes"] - 1
    top = max(p[1] for p in lv["points"])
    assert top == est.peak_tile_bytes or (top < est.peak_tile_bytes
                                          and any("weight update" in n for n in lv["notes"]))
