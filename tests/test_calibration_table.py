"""The calibration table (bench/calibration, issue 15) loads and follows its schema."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.calibration import table


@pytest.fixture(scope="module")
def measurements() -> list[table.Measurement]:
    return table.load_measurements()


@pytest.fixture(scope="module")
def sources() -> dict[str, table.Source]:
    return table.load_sources()


def test_table_loads(measurements):
    assert len(measurements) > 0
    assert all(isinstance(m, table.Measurement) for m in measurements)


def test_ids_unique(measurements):
    dup = [k for k, n in Counter(m.id for m in measurements).items() if n > 1]
    assert not dup


def test_every_row_source_exists(measurements, sources):
    table.check_table(measurements, sources)
    assert {m.source for m in measurements} <= set(sources)


def test_op_class_allowed(measurements):
    assert {m.op_class for m in measurements} <= table.OP_CLASSES


def test_excluded_rows_have_reason(measurements):
    for m in measurements:
        assert isinstance(m.excluded, str)
        if m.value is None:
            assert m.excluded.strip(), m.id
    # a reason, not a flag
    assert all(len(m.excluded.strip()) >= 10 for m in measurements if m.is_excluded)


def test_every_source_has_read_status(sources):
    for s in sources.values():
        assert s.read in {"full", "partial", "abstract"}, s.key
        assert s.read_where, s.key


def test_plot_values_carry_uncertainty(measurements):
    for m in measurements:
        if m.how == "plot" and "label" not in m.where.lower():
            assert m.uncertainty > 0, m.id


def test_validation_sources_never_in_op_level_folds(measurements, sources):
    validation = {k for k, s in sources.items() if s.role != "op_level"}
    for oc in table.OP_LEVEL_CLASSES:
        assert not set(table.loso_folds(measurements, oc)) & validation


def test_malformed_rows_rejected(tmp_path):
    good = dict(id="x", source="louw2021", chip="GC2", op_class="stream", params={},
                metric="gbytes_per_s", value=1.0, uncertainty=0.0, how="table", where="T1",
                excluded="", notes="")
    for bad in (dict(good, op_class="bogus"), dict(good, value=None), dict(good, chip="H100"),
                dict(good, how="plot", where="Fig. 1")):
        p = tmp_path / "m.jsonl"
        p.write_text(json.dumps(bad) + "\n")
        with pytest.raises(table.TableError):
            table.load_measurements(p)
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(table.TableError):
        table.load_measurements(p)


# ---- MLPerf training throughput rows (bench/calibration/mlperf_logs.py) and the
# configurations bench/bench_mlperf.py estimates them with

def test_mlperf_throughput_rows_match_their_runs(measurements):
    by_id = {m.id: m for m in measurements}
    rows = [m for m in measurements if m.source.startswith("mlperf-train-") and m.metric == "items_per_s"]
    assert len(rows) >= 200
    for m in rows:
        run = by_id[m.id.removesuffix("-throughput")]  # the run's time-to-train row
        assert run.metric == "seconds" and run.params["system"] == m.params["system"]
        assert m.value > 0 and bool(m.excluded) == bool(run.excluded)
        p = m.params
        if p["benchmark"] == "resnet":  # one IPU per replica: the log's batch splits exactly
            assert p["replicas"] == p["n_devices"]
            assert p["micro_batch_per_replica"] * p["replicas"] * p["gradient_accumulation_steps"] \
                == p["global_batch_size"]
            # training alone is faster than the whole run: epochs x images / time-to-train
            assert m.value > run.params["epochs_at_stop"] * 1_281_167 / run.value
        elif p["benchmark"] == "bert":
            assert m.value > run.params["train_samples_at_stop"] / run.value


def test_mlperf_log_throughputs_from_events():
    from bench.calibration import mlperf_logs as ml

    def ev(key, t, **meta):
        return {"key": key, "time_ms": t, "metadata": meta}
    # ResNet: epochs of 10 s, 10 s and 20 s -> median 10 s per epoch
    log = [ev("epoch_start", 0, epoch_num=1), ev("epoch_stop", 10_000, epoch_num=1),
           ev("epoch_start", 10_000, epoch_num=2), ev("epoch_stop", 20_000, epoch_num=2),
           ev("epoch_start", 20_000, epoch_num=3), ev("epoch_stop", 40_000, epoch_num=3)]
    rate, n = ml.resnet_throughput(log)
    assert n == 3 and rate == pytest.approx(1_281_167 / 10)
    # BERT: blocks of 1,000 samples in 2 s, then 2,000 more in 2 s (samples from the evals)
    log = [ev("block_start", 0), ev("block_stop", 2_000), {"key": "eval_accuracy", "time_ms": 2_100,
           "metadata": {"epoch_num": 1_000}}, ev("block_start", 3_000), ev("block_stop", 5_000),
           {"key": "eval_accuracy", "time_ms": 5_100, "metadata": {"epoch_num": 3_000}}]
    rate, n = ml.bert_throughput(log)
    assert n == 2 and rate == pytest.approx((500 + 1_000) / 2)


def test_mlperf_bert_stage_placements():
    from bench.bench_mlperf import _bert_stages

    names = ["token_embedding", "position_embedding", "embedding_norm"]
    for i in range(24):
        names += [f"layer_{i}_attention", f"layer_{i}_attention_norm", f"layer_{i}_intermediate",
                  f"layer_{i}_output", f"layer_{i}_output_norm"]
    names += ["get_item", "pooler", "classifier"]

    def blocks(stages: list[int], suffix: str) -> Counter:
        return Counter(s for n, s in zip(names, stages, strict=True) if n.endswith(suffix))

    # v1.0: layers_per_ipu, stage = IPU, the heads in a fifth stage on IPU 0.
    four = _bert_stages(names, "4-IPU [3, 7, 7, 7]")
    assert four[:3] == [0, 0, 0] and four[-3:] == [4, 4, 4] and four == sorted(four)
    assert [blocks(four, "_attention")[s] for s in range(4)] == [3, 7, 7, 7]
    # v1.1: the embedding alone in stage 0, half-layers, the last blocks and heads in stage 4.
    v11 = "4-IPU att_ffn_placement [[1, [7, 6]], [2, [6, 7]], [3, [7, 6]], [0, [4, 5]]]"
    five = _bert_stages(names, v11)
    assert five[:3] == [0, 0, 0] and five[3] == 1 and five[-3:] == [4, 4, 4] and five == sorted(five)
    assert [blocks(five, "_attention")[s] for s in range(1, 5)] == [7, 6, 7, 4]
    assert [blocks(five, "_intermediate")[s] for s in range(1, 5)] == [6, 7, 6, 5]
    # v2.0: 9 stages, layer 23's feed-forward block and the heads in stage 8 (IPU 0).
    eight = _bert_stages(names, "8-IPU att_ffn_placement")
    assert eight[:3] == [0, 0, 0] and eight == sorted(eight) and max(eight) == 8
    assert [blocks(eight, "_attention")[s] for s in range(1, 9)] == [3, 4, 3, 3, 4, 3, 4, 0]
    assert [blocks(eight, "_intermediate")[s] for s in range(1, 9)] == [3, 3, 3, 4, 3, 4, 3, 1]


def test_mlperf_bert_checkpoints_and_ipus():
    """The submissions' checkpoint rules (bert_model.py) and device mappings."""
    from bench.bench_mlperf import _BERT, _bert_checkpoints, _bert_layout

    v10, v11, v20 = (r.placement for r in _BERT)
    # v1.0: every layer's output but the last on each IPU.
    assert _bert_checkpoints(v10) == {(i, "ffn") for i in range(23) if i not in (2, 9, 16)}
    assert _bert_layout(v10).ipus == [0, 1, 2, 3, 0]
    # v1.1: attention outputs in the last stage (layers 20-23); every feed-forward output but
    # layer 12's (the last on IPU 2, layer 13's attention on IPU 3).
    assert _bert_checkpoints(v11) == ({(i, "attention") for i in range(20, 24)}
                                      | {(i, "ffn") for i in range(24) if i != 12})
    assert _bert_layout(v11).ipus == [0, 1, 2, 3, 0]
    # v2.0: no attention block in the last stage; feed-forward outputs but layers 2, 12 and 19.
    assert _bert_checkpoints(v20) == {(i, "ffn") for i in range(24) if i not in (2, 12, 19)}
    assert _bert_layout(v20).ipus == [0, 1, 2, 3, 4, 5, 6, 7, 0]
