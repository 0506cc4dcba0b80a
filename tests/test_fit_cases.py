"""bench/fit_cases.json and the scoring of bench/bench_fit_cases.py (issue 24, point 4): the
cases parse and carry their fields, every case is either built or listed as not built with a
reason, and the scoring (fits and out-of-memory apart; a controlled pair counts only if both
halves are right) on synthetic rows. No estimate runs here."""

from __future__ import annotations

from typing import Any

import pytest

from bench import bench_fit_cases as fc


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return fc.load_cases()


def test_cases_parse_with_every_required_field(cases: list[dict[str, Any]]) -> None:
    assert len(cases) >= 30
    ids = [c["id"] for c in cases]
    assert len(set(ids)) == len(ids), "case ids are unique"
    for c in cases:
        missing = [f for f in fc.REQUIRED_FIELDS if f not in c]
        assert not missing, (c["id"], missing)
        assert c["published_verdict"]["verdict"] in fc.VERDICTS, c["id"]
        assert c["only_options_set_by_source"] is True, c["id"]
        assert isinstance(c["training"], bool), c["id"]
        assert len(c["commit"]) == 40, c["id"]


def test_every_case_is_built_or_says_why(cases: list[dict[str, Any]]) -> None:
    ids = {c["id"] for c in cases}
    assert set(fc.NOT_BUILT) <= ids
    assert set(fc.SLOW) <= ids
    for a, b in fc.PAIRS:
        assert {a, b} <= ids
    for c in cases:
        assert (fc._builder(c) is None) == (c["id"] in fc.NOT_BUILT), c["id"]
        if c["id"] in fc.NOT_BUILT:
            assert fc.NOT_BUILT[c["id"]]


def test_published_split_names_translate_to_keras_layers() -> None:
    assert fc._keras_split("b1/0/relu") == "conv2_block1_out"
    assert fc._keras_split("b3/3/relu") == "conv4_block4_out"
    assert fc._keras_split("stage2/unit4/relu") == "conv3_block4_out"
    assert fc._keras_split("conv4_block2_out") == "conv4_block2_out"
    names = fc._poptorch_resnet_checkpoints(["add", "add_3", "add_15", "layer4/0/bn2",
                                             "layer4/0/downsample_0", "layer4/0/downsample/1",
                                             "avgpool", "fc"])
    assert names == {"conv2_block1_add", "conv3_block1_add", "conv5_block3_add",
                     "conv5_block1_2_bn", "conv5_block1_0_conv", "conv5_block1_0_bn",
                     "avg_pool", "predictions"}


def test_bert_placements_follow_the_published_layout(cases: list[dict[str, Any]]) -> None:
    from bench import bench_mlperf

    # The MLPerf rounds, in bench_mlperf's words: their stages land on the published IPUs.
    for c in cases:
        if c["group"] == "mlperf" and "bert" in c["id"]:
            placement = fc._mlperf_placement(c["pipeline"])
            assert bench_mlperf._bert_layout(placement).ipus == c["pipeline"]["device_mapping"]
    # Graphcore's examples: whole layers per stage, the embedding in stage 0, heads last.
    att, ffn, ipus = fc._block_stages([0, 4, 4, 4], 0, 12)
    assert ipus == [0, 1, 2, 3] and att == ffn and att[0] == 1 and att[11] == 3
    stages = fc._bert_layer_stages(["input_ids", "token_embedding", "layer_0_attention",
                                    "layer_4_output_checkpoint", "layer_11_output_norm",
                                    "pooler", "classifier"], att, ffn, head=4)
    assert stages == [0, 0, 1, 2, 3, 4, 4]
    with pytest.raises(ValueError):
        fc._block_stages([3, 7, 7], 0, 24)


def _row(cid: str, published: str, right: bool | None, built: bool = True) -> dict[str, Any]:
    return {"id": cid, "published": published, "built": built, "right": right if built else None}


def test_scoring_separates_fits_and_oom_and_counts_pairs_only_when_both_right() -> None:
    (t7, t0), (a35, a8) = fc.PAIRS
    rows = [
        _row("f1", "fits", True), _row("f2", "fits", False), _row("f3", "fits", None, built=False),
        _row("o1", "out_of_memory", True),
        _row(t7, "fits", True), _row(t0, "out_of_memory", False),   # a pair half wrong
        _row(a35, "fits", True), _row(a8, "out_of_memory", True),   # a pair both right
    ]
    s = fc.score(rows)
    assert s["fits"] == {"right": 2, "built": 4, "published": 5}      # f1 and a35 (not t7)
    assert s["out_of_memory"] == {"right": 2, "built": 3, "published": 3}  # o1 and a8
    assert [p["both_right"] for p in s["pairs"]] == [False, True]


def test_a_pair_with_a_half_not_built_does_not_count() -> None:
    (t7, t0), _ = fc.PAIRS
    s = fc.score([_row(t7, "fits", True), _row(t0, "out_of_memory", None, built=False)])
    assert s["fits"] == {"right": 0, "built": 1, "published": 1}
    assert s["out_of_memory"] == {"right": 0, "built": 0, "published": 1}
    assert not s["pairs"][0]["both_right"]


def test_table_has_one_line_per_case() -> None:
    rows = [dict(_row("a", "fits", True), peak_tile_bytes=600_000, capacity_bytes=638_976,
                 verdict="fits", seconds=1.0),
            dict(_row("b", "out_of_memory", None, built=False), verdict="not built")]
    lines = fc.table_lines(rows)
    assert len(lines) == 2 + len(rows)
    assert "600,000" in lines[2] and "94%" in lines[2] and "right" in lines[2]
    assert "not built" in lines[3]


def test_an_excess_the_unexpressible_options_account_for_in_bytes_is_not_wrong() -> None:
    """Issue 24's rule for MLPerf v2.0: over the tile, but the options the project cannot
    express save at least the excess on the fullest tile, in bytes: "accounted for"."""
    def over(saved: dict[str, int], over_bytes: int) -> dict[str, Any]:
        return dict(_row("v2", "fits", False), accounting={
            "options": saved, "saved_bytes": sum(saved.values()), "over_bytes": over_bytes})

    shown = over({"FP8 activation checkpoints": 38_484, "optimizer state sharded": 57_458}, 47_390)
    short = over({"FP8 activation checkpoints": 10_000}, 47_390)
    unsized = dict(_row("v3", "fits", False), accounting={"options": {}, "saved_bytes": 0,
                                                          "over_bytes": 1})
    assert fc.accounted_for(shown) and not fc.accounted_for(short)
    assert not fc.accounted_for(unsized) and not fc.accounted_for(_row("f", "fits", False))
    s = fc.score([shown, short])
    assert s["accounted_for"] == ["v2"] and s["fits"]["right"] == 0
    assert fc._mark(shown) == "acct." and fc._mark(short) == "WRONG"
