"""Graphcore's MLPerf Training runs on a 16-IPU pod, estimated: training throughput and time
to train beside the measured runs (bench/calibration: mlperf-train-v1.0, v1.1, v2.0).

    measured  (result logs: median training throughput of each run, its time to train)
        |                                         estimated (tf_ipu.estimate, the
        |   per configuration: ratio estimated /   submission's own configuration)
        +-- measured, typical exp(mean |ln r|) and worst over the configurations

The runs are the end-to-end calibration data of bench/calibration/README.md (split 4): per run
the estimate's cycles are split by class (bench/calibration/e2e.py), and the end-to-end fit's
held-out table (fit beside the single-constant baseline) is printed from these estimates; the
cycle scales are fitted and written by ``python bench/calibration/fit.py --e2e --write``, which
re-runs these estimates and refreshes bench/results/mlperf_breakdowns.json. Estimated are the closed-division ResNet-50 and BERT runs on
the systems the project models with one host: IPU-POD16 (GC200) and Bow Pod16 (larger pods
span hosts and gateways). Each is estimated with the configuration its submission states
(configs.yml / configs/*.json in mlcommons/training_results_v*; paths below):

    ResNet-50 v1.5: 16 replicas of one IPU, FP16 with FP16 partials, 8-bit images decoded on
        the IPU (eight_bit_io), micro-batch and accumulation from the log (global batch /
        (16 x accumulation)); SGD with momentum for the update (v1.1 and v2.0 used LARS,
        whose per-layer norms add little to the update).
    BERT-Large phase 2, sequence 512, packed rows (about 2 sequences each), LAMB, FP16:
        v1.0 / v1.1 IPU-POD16: 4 replicas x a 4-IPU pipeline, layers [3, 7, 7, 7] (the
        embedding on IPU 0), 2 rows x 192 micro-batches, optimizer state offloaded and
        sharded over the replicas, recomputation;
        v2.0 Bow Pod16: 2 replicas x an 8-IPU pipeline (the embedding alone on IPU 0, the
        attention and feed-forward halves placed as att_ffn_placement says), 3 rows x 256
        micro-batches, optimizer state sharded over the replicas (the submission keeps it on
        chip; here it is offloaded only where an IPU would not fit otherwise); recomputation.
    Not modelled: the masked-LM head over 76 tokens (a 2-class head instead: under 1% of
    the FLOPs), packing's attention mask, FP8 activation checkpoints (v2.0), the host's
    data loading; time to train counts training only (the logs' evaluations are excluded).

    .venv/bin/python bench/run.py --only mlperf
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.calibration import e2e  # noqa: E402
from bench.calibration.mlperf_logs import IMAGENET_TRAIN, SEQUENCES_PER_ROW  # noqa: E402

_CONFIGURATION = {"ResNet-50": "resnet50", "BERT-Large": "bert-large"}

_RESNET_CFG = "Graphcore/benchmarks/resnet/implementations/tensorflow/configs.yml"
#: BERT configurations: (round, chip, replicas, pipeline stages, rows per micro-batch,
#: micro-batches per update, offload (None: where an IPU needs it), its configuration file)
_BERT = (
    ("v1.0", "ipu2", 4, "4-IPU [3, 7, 7, 7]", 2, 192, True,
     "Graphcore/benchmarks/bert/implementations/popart/configs/mk2/pod16-closed.json"),
    ("v1.1", "ipu2", 4, "4-IPU [3, 7, 7, 7]", 2, 192, True,
     "Graphcore/benchmarks/bert/implementations/popart/configs/mk2/pod16-closed.json"),
    ("v2.0", "bow", 2, "8-IPU att_ffn_placement", 3, 256, None,
     "Graphcore/benchmarks/bert/implementations/popart/configs/pod16-closed.json"),
)
_FRAMEWORK = {"resnet": "TensorFlow", "bert": "PopART"}  # the configurations stated here
_POD16 = {"ipu2": ("pod16", ("IPU-POD16",)), "bow": ("bow-pod16", ("Bow Pod16", "Bow-Pod16"))}


@functools.cache
def _table() -> tuple[Any, ...]:
    from bench.calibration.table import load_measurements

    return tuple(load_measurements())


def _measured(benchmark: str, version: str, systems: tuple[str, ...]) -> dict[str, Any]:
    rows = [m for m in _table() if m.source == f"mlperf-train-{version}"
            and m.usable and m.op_class == "e2e_training" and m.params.get("benchmark") == benchmark
            and m.params.get("division") == "closed" and m.params.get("system") in systems
            and str(m.params.get("framework", "")).startswith(_FRAMEWORK[benchmark])]
    tput = [m for m in rows if m.metric == "items_per_s"]
    ttt = [m for m in rows if m.metric == "seconds"]
    if not tput or not ttt:
        raise RuntimeError(f"no measured {benchmark} {version} run on {systems} in the table")
    size = "epochs_at_stop" if benchmark == "resnet" else "train_samples_at_stop"
    return {"throughput": statistics.median(m.value for m in tput),
            "time_to_train_s": statistics.median(m.value for m in ttt),
            "trained": statistics.median(m.params[size] for m in ttt),
            "accumulation": statistics.mode(m.params["gradient_accumulation_steps"] for m in tput),
            "micro_batch": statistics.mode(m.params.get("micro_batch_per_replica") for m in tput),
            "runs": len(ttt)}


class _Shares:
    """What ``tiles.report.class_shares`` gave each estimate planned while capturing: by the
    Estimate's id, and the weight update's and gradient accumulation's own programs."""

    def __init__(self) -> None:
        self.by_id: dict[int, dict[str, float]] = {}
        self.programs: dict[str, dict[str, float]] = {}


@contextlib.contextmanager
def _capturing() -> Iterator[_Shares]:
    """Records the full class shares of every estimate planned inside (the report keeps only
    those of 10% and more)."""
    from device_server.emulator.tiles import report

    rec, original = _Shares(), report.class_shares

    def recording(est: Any, ops: Any) -> dict[str, float]:
        out = original(est, ops)
        rec.by_id[id(est)] = dict(out)
        for what in ("weight_update", "gradient_accumulation"):
            if what in str(est.program):
                rec.programs[what] = dict(out)
        return out

    report.class_shares = recording
    try:
        yield rec
    finally:
        report.class_shares = original


#: ResNet-50's pipeline splits in the submissions' configs.yml (all three rounds: the stage
#: ends after these blocks, Keras's names), its seven stages all on IPU 0 (bench/fit_cases.json).
_RESNET_SPLITS = ("conv2_block1_out", "conv2_block3_out", "conv3_block1_out", "conv3_block3_out",
                  "conv4_block1_out", "conv4_block4_out")
#: availableMemoryProportion of the convolutions (configs.yml; matmuls keep Poplar's default).
_RESNET_CONV_AMP = 0.15


def _resnet50(accumulation: int) -> Any:
    """ResNet-50 as the submissions ran it: 8-bit images decoded on the IPU, a pipeline of 7
    stages on one IPU (``pipeline: True``, ``shards: 1``, Sequential) with recomputation
    (``enable_recomputation``; Auto resolves to RecomputeAndBackpropagateInterleaved for the
    Sequential schedule), the accumulation as the pipeline's."""
    import keras

    import tf_ipu
    from tf_ipu.pipelining import PipelineSchedule

    with tf_ipu.IPUStrategy().scope():
        images = keras.Input((224, 224, 3), dtype="uint8", name="images")  # eight_bit_io
        x = keras.layers.Rescaling(1 / 255.0)(images)
        net = keras.applications.ResNet50(weights=None, input_tensor=x)
        model = keras.Model(images, net.output, name="resnet50_mlperf")
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
        stages, stage = [], 0
        for a in model.get_pipeline_stage_assignment():
            stages.append(stage)
            stage += a.layer.name in _RESNET_SPLITS
        model.set_pipeline_stage_assignment(stages)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=accumulation,
                                     device_mapping=[0] * (max(stages) + 1),
                                     pipeline_schedule=PipelineSchedule.Sequential)
    return model


def _bert_stages(names: list[str], placement: str) -> list[int]:
    """A stage for each layer call of tf_ipu.models.bert's classifier, as the submission places
    them: ``4-IPU [3, 7, 7, 7]`` (whole encoder layers) or ``8-IPU att_ffn_placement`` (v2.0:
    the embedding alone on stage 0, then per stage (attention blocks, feed-forward blocks):
    (3, 3), (4, 3), (3, 3), (3, 4), (4, 3), (3, 4), (4, 3); the submission's last feed-forward
    block, on IPU 0 with the embedding there, is on the last stage here)."""
    if placement.startswith("4-IPU"):
        bounds = [3, 10, 17, 24]
        att = ffn = [next(s for s, b in enumerate(bounds) if i < b) for i in range(24)]
    else:
        att, ffn = [], []
        for stage, (a, f) in enumerate(((3, 3), (4, 3), (3, 3), (3, 4), (4, 3), (3, 4), (4, 3)), 1):
            att += [stage] * a
            ffn += [stage] * f
        ffn.append(7)  # the 24th feed-forward block
    stages, last = [], 0
    for name in names:
        m = re.match(r"layer_(\d+)_(attention|intermediate|output)", name)
        if m:
            last = (att if m.group(2) == "attention" else ffn)[int(m.group(1))]
        elif not name.startswith(("token_", "position_", "embedding")):
            last = max(last, att[-1], ffn[-1])  # pooler and head: the last stage
        stages.append(last)
    return stages


def _bert(placement: str, micro_batches: int, offload: bool | None) -> Any:
    import keras

    import tf_ipu
    from tf_ipu.models.bert import bert_classifier, bert_encoder

    with tf_ipu.IPUStrategy().scope():
        model = bert_classifier(bert_encoder(layers=24, hidden=1024, heads=16, seq_len=512,
                                             vocab=30400, dropout=0.0), classes=2)
        model.compile(optimizer=keras.optimizers.Lamb(2e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        names = [a.layer.name for a in model.get_pipeline_stage_assignment()]
        stages = _bert_stages(names, placement)
        model.set_pipeline_stage_assignment(stages)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=micro_batches,
                                     device_mapping=list(range(max(stages) + 1)),
                                     offload_weight_update_variables=offload,
                                     replicated_optimizer_state_sharding=True)
    return model


def _ratio_row(what: str, version: str, chip: str, measured: dict[str, Any], tput: float,
               est: Any, ttt: float, config: str, seconds: float, shares: _Shares) -> dict[str, Any]:
    r_tput = tput / measured["throughput"]
    r_ttt = ttt / measured["time_to_train_s"]
    print(f"  {what} {version} {chip}: {config}")
    print(f"    throughput measured {measured['throughput']:,.0f}/s (median of {measured['runs']} "
          f"runs), estimated {tput:,.0f}/s: ratio {r_tput:.3f}; "
          f"{'fits' if est.fits else 'DOES NOT FIT (peak tile ' + format(est.peak_tile_bytes, ',') + ' B)'}")
    print(f"    time to train measured {measured['time_to_train_s']:,.0f} s, estimated (training "
          f"only) {ttt:,.0f} s: ratio {r_ttt:.3f}   [{seconds:.0f} s to estimate]")
    print(f"    {est.expected_error_summary()}")
    return {"benchmark": what, "round": version, "chip": chip, "configuration": config,
            "measured_throughput": measured["throughput"], "estimated_throughput": tput,
            "throughput_ratio": r_tput, "measured_time_to_train_s": measured["time_to_train_s"],
            "estimated_time_to_train_s": ttt, "time_to_train_ratio": r_ttt, "fits": est.fits,
            "peak_tile_bytes": est.peak_tile_bytes, "runs": measured["runs"],
            "expected_error": est.expected_error_summary(), "estimate_seconds": seconds,
            "run": f"{what} {version}", "configuration_key": f"{_CONFIGURATION[what]}/{chip}",
            "cycles": e2e.breakdown(est, shares.by_id, shares.programs)}


def _resnet_rows() -> list[dict[str, Any]]:
    import tf_ipu

    rows, planned, captured = [], {}, {}
    for version, chip in (("v1.0", "ipu2"), ("v1.1", "ipu2"), ("v2.0", "bow")):
        system, names = _POD16[chip]
        m = _measured("resnet", version, names)
        micro, accumulation = int(m["micro_batch"]), int(m["accumulation"])
        t0 = time.perf_counter()
        if (chip, micro, accumulation) not in planned:
            with _capturing() as captured[chip, micro, accumulation]:
                planned[chip, micro, accumulation] = tf_ipu.estimate(
                    _resnet50(accumulation), micro, training=True, ipu_version=chip, replicas=16,
                    system=system, recomputation=True,
                    available_memory_proportion={"convolution": _RESNET_CONV_AMP})
        est = planned[chip, micro, accumulation]
        ttt = IMAGENET_TRAIN * m["trained"] / est.throughput  # a pipeline's: all replicas' items
        config = (f"16 replicas x micro-batch {micro} x {accumulation} accumulated, "
                  f"{m['trained']:g} epochs ({_RESNET_CFG})")
        rows.append(_ratio_row("ResNet-50", version, chip, m, est.throughput, est, ttt, config,
                               time.perf_counter() - t0, captured[chip, micro, accumulation]))
    return rows


def _bert_rows() -> list[dict[str, Any]]:
    import tf_ipu

    rows, cache, captured = [], {}, {}
    for version, chip, replicas, placement, micro, accumulation, offload, path in _BERT:
        system, names = _POD16[chip]
        m = _measured("bert", version, names)
        key = (chip, replicas, placement, micro, accumulation, offload)
        t0 = time.perf_counter()
        if key not in cache:  # v1.0 and v1.1 ran the same configuration
            model = _bert(placement, accumulation, offload)
            with _capturing() as captured[key]:
                cache[key] = tf_ipu.estimate(model, micro, training=True, ipu_version=chip,
                                             replicas=replicas, system=system,
                                             recomputation=True, steps=1)
        est = cache[key]
        tput = est.throughput * SEQUENCES_PER_ROW  # rows/s -> sequences/s
        ttt = m["trained"] / tput
        config = (f"{replicas} replicas x a {placement} pipeline, {micro} packed rows x "
                  f"{accumulation} micro-batches, {m['trained']:,.0f} sequences ({path})")
        rows.append(_ratio_row("BERT-Large", version, chip, m, tput, est, ttt, config,
                               time.perf_counter() - t0, captured[key]))
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for metric in ("throughput_ratio", "time_to_train_ratio"):
        logs = [abs(math.log(r[metric])) for r in rows]
        out[metric] = {"typical": math.exp(sum(logs) / len(logs)), "worst": math.exp(max(logs)),
                       "points": len(rows)}
    return out


def estimate_rows(quick: bool = False) -> list[dict[str, Any]]:
    """Each run estimated (printed as it goes): its row, with its cycles split by class."""
    import keras

    keras.mixed_precision.set_global_policy("float16")
    try:
        rows = _resnet_rows()
        if not quick:
            keras.mixed_precision.set_global_policy("float16")
            rows += _bert_rows()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return rows


def runs_of(rows: list[dict[str, Any]]) -> list[e2e.Run]:
    """The end-to-end fit's runs from ``estimate_rows``' rows."""
    return [e2e.Run(r["run"], r["benchmark"], r["configuration_key"], r["chip"],
                    r["measured_throughput"], r["estimated_throughput"], r["cycles"])
            for r in rows if "cycles" in r]


def main(quick: bool = False) -> list[dict[str, Any]]:
    print("Graphcore's MLPerf Training closed-division runs on 16-IPU pods, estimated with "
          "each submission's configuration (the one-host runs: end-to-end calibration data, "
          "bench/calibration/README.md split 4)")
    rows = estimate_rows(quick)
    s = _summary(rows)
    for metric, v in s.items():
        print(f"  {metric.replace('_', ' ')}: typical {v['typical']:.2f}x, worst {v['worst']:.2f}x "
              f"over {v['points']} configurations")
    runs = runs_of(rows)
    if len({r.benchmark for r in runs}) > 1:
        result = e2e.evaluate(runs)
        print("  from these estimates:")
        e2e.report(result)
        print("  " + e2e.cache_agreement(runs))
        rows.append({"e2e": {k: result[k] for k in ("folds", "runs", "fit", "baseline", "unfitted",
                                                    "classes", "fitted", "adopted", "why")}})
    rows.append({"summary": s})
    return rows


if __name__ == "__main__":
    main("--quick" in sys.argv)
