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
    BERT-Large phase 2, sequence 512, packed rows (about 2 sequences each), LAMB, FP16,
    the heads in a final pipeline stage on IPU 0, recomputation (PopART's
    RecomputationType.Pipeline: RecomputeAndBackpropagateInterleaved, Grouped) from the
    submission's checkpoints (``_bert_checkpoints``), attention probabilities in FP16 as
    PopART's BERT keeps them (``bert_encoder(softmax_in_compute_dtype=True)``):
        v1.0 IPU-POD16: 4 replicas x a 4-IPU pipeline, layers_per_ipu [3, 7, 7, 7] (the
        embedding with IPU 0's layers), vocab 30400, every layer's output checkpointed but
        the last on each IPU, matmul availableMemoryProportion 0.20 (the config's per IPU
        [0.20, 0.20, 0.25, 0.25]: its fullest IPU's), 2 rows x 192 micro-batches, optimizer
        state offloaded and sharded over the replicas;
        v1.1 IPU-POD16: 4 replicas x a 4-IPU pipeline, att_ffn_placement [[1,[7,6]],
        [2,[6,7]],[3,[7,6]],[0,[4,5]]] (the embedding alone in stage 0 on IPU 0, the last
        blocks back on IPU 0 in stage 4), vocab 30912, availableMemoryProportion 0.23, 2 rows
        x 192, optimizer state offloaded and sharded;
        v2.0 Bow Pod16: 2 replicas x an 8-IPU pipeline of 9 stages (att_ffn_placement, layer
        23's feed-forward block with the heads in stage 8 on IPU 0), vocab 30912,
        availableMemoryProportion 0.3, 3 rows x 256, optimizer state on chip (the submission
        also shards it over the replicas, which Graphcore's TensorFlow does only for
        offloaded state: here it is whole on each replica).
    Not modelled: the masked-LM head over 76 tokens (a 2-class head instead: under 1% of
    the FLOPs), dropout, packing's attention mask, FP8 activation checkpoints (v2.0: the
    bytes they would save are printed beside its verdict), per-IPU availableMemoryProportion
    (v1.0), the host's data loading; time to train counts training only (the logs'
    evaluations are excluded).

    .venv/bin/python bench/run.py --only mlperf

Pod64 and larger (``pods_main``; ``--only mlperf_pods``, ``--quick``: ResNet-50 only): the
closed-division runs on IPU-POD64/128/256 and Bow Pod64/128/256 (never fitted), each at the
configuration its log states (ResNet-50: replicas = IPUs, micro-batch and accumulation from
the log; BERT: the IPUs, global batch and accumulation from the log, the round's Pod16
pipeline and options, replicas = IPUs / the pipeline's IPUs, micro-batch = global batch /
(2 x replicas x accumulation)), on the systems of device_server/protocol/hardware.py (GCL's
hierarchical all-reduce across Pod64s: docs/tile_model.md, "Pods"), and the speed-up from the round's
Pod16 run, estimated against measured (the issue's target: within 15%).

    .venv/bin/python bench/run.py --only mlperf_pods [--quick]
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.calibration import e2e  # noqa: E402
from bench.calibration.mlperf_logs import IMAGENET_TRAIN, SEQUENCES_PER_ROW  # noqa: E402

_CONFIGURATION = {"ResNet-50": "resnet50", "BERT-Large": "bert-large"}

_RESNET_CFG = "Graphcore/benchmarks/resnet/implementations/tensorflow/configs.yml"


class _BertRun(NamedTuple):
    """A BERT submission's configuration (bench/fit_cases.json, the three BERT MLPerf cases):
    only the options its configuration file and application code set."""

    version: str
    chip: str
    replicas: int
    placement: str          # the config's layers_per_ipu or att_ffn_placement, as written
    micro: int              # packed rows per micro-batch (batch_size)
    accumulation: int       # micro-batches per weight update (gradient_accumulation_factor)
    offload: bool | None    # optimizer state off chip (optimizer_state_offchip)
    sharding: bool          # replicated tensor sharding of the offloaded state
    vocab: int              # vocab_length
    amp: float              # availableMemoryProportion of the encoder matmuls (see _BERT_AMP)
    path: str               # the configuration file


_BERT_V1 = "Graphcore/benchmarks/bert/implementations/popart/configs/mk2/pod16-closed.json"
#: The rounds. v1.0 sets availableMemoryProportion per IPU, [0.20, 0.20, 0.25, 0.25]; the
#: estimate takes one for every matmul, so v1.0 uses that of its fullest IPU (IPU 1, 0.20:
#: bench/results/mlperf.json). v2.0 keeps its optimizer state on chip, sharded over its 2
#: replicas (RTS with TensorStorage.OnChip); Graphcore's TensorFlow shards only offloaded
#: state (``replicated_optimizer_state_sharding``), so here it is on chip and whole.
_BERT = (
    _BertRun("v1.0", "ipu2", 4, "4-IPU layers_per_ipu [3, 7, 7, 7]", 2, 192, True, True, 30400,
             0.20, _BERT_V1),
    _BertRun("v1.1", "ipu2", 4, "4-IPU att_ffn_placement [[1, [7, 6]], [2, [6, 7]], [3, [7, 6]], "
             "[0, [4, 5]]]", 2, 192, True, True, 30912, 0.23, _BERT_V1),
    _BertRun("v2.0", "bow", 2, "8-IPU att_ffn_placement [[1, [3, 3]], [2, [4, 3]], [3, [3, 3]], "
             "[4, [3, 4]], [5, [4, 3]], [6, [3, 4]], [7, [4, 3]], [0, [0, 1]]]", 3, 256, False,
             False, 30912, 0.3,
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
    Sequential schedule), the accumulation as the pipeline's. Under a float16 policy its batch
    norms keep the FP16 activations in FP16 (``tf_ipu.models.HalfBatchNormalization``), as the
    submissions' fused batch norm does."""
    import keras

    import tf_ipu
    from tf_ipu.models import half_batch_norm
    from tf_ipu.pipelining import PipelineSchedule

    with tf_ipu.IPUStrategy().scope():
        images = keras.Input((224, 224, 3), dtype="uint8", name="images")  # eight_bit_io
        x = keras.layers.Rescaling(1 / 255.0)(images)
        net = keras.applications.ResNet50(weights=None, input_tensor=x)
        model = keras.Model(images, net.output, name="resnet50_mlperf")
        if keras.mixed_precision.global_policy().compute_dtype == "float16":
            model = half_batch_norm(model)  # the submissions' fused batch norm on FP16 activations
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


#: v2.0's att_ffn_placement, for the name the bench gave it before it printed the list.
_V20_PLACEMENT = ("8-IPU att_ffn_placement [[1, [3, 3]], [2, [4, 3]], [3, [3, 3]], [4, [3, 4]], "
                  "[5, [4, 3]], [6, [3, 4]], [7, [4, 3]], [0, [0, 1]]]")


class _BertLayout(NamedTuple):
    """Where a submission puts BERT's blocks: the pipeline stage of each layer's attention and
    feed-forward block, and the IPU of each stage (its last stage holds the heads, on IPU 0)."""

    att: list[int]
    ffn: list[int]
    ipus: list[int]


def _bert_layout(placement: str, layers: int = 24) -> _BertLayout:
    """``placement`` as the submissions' bert_model.py reads it (bench/fit_cases.json):

    - ``layers_per_ipu [..]`` (v1.0, ``encoder_start_ipu`` 0): whole layers, IPU i's in stage
      i, the embedding with IPU 0's; the heads in a final stage on IPU 0;
    - ``att_ffn_placement [[ipu, [attention blocks, feed-forward blocks]], ..]`` (v1.1, v2.0,
      ``encoder_start_pipeline_stage`` 1): the embedding alone in stage 0 on IPU 0, entry p in
      stage 1 + p; the heads in the last entry's stage if it is on IPU 0, else in one more.

    The names the bench used before, ``4-IPU [3, 7, 7, 7]`` and ``8-IPU att_ffn_placement``,
    still mean v1.0's and v2.0's."""
    if "att_ffn_placement" in placement and "[" not in placement:
        placement = _V20_PLACEMENT
    spec = json.loads(placement[placement.index("["):])
    if "att_ffn_placement" in placement:
        att = [1 + p for p, (_, (a, _)) in enumerate(spec) for _ in range(a)]
        ffn = [1 + p for p, (_, (_, f)) in enumerate(spec) for _ in range(f)]
        ipus = [0] + [int(ipu) for ipu, _ in spec] + ([0] if spec[-1][0] != 0 else [])
    else:
        att = ffn = [ipu for ipu, n in enumerate(spec) for _ in range(n)]
        ipus = list(range(len(spec))) + [0]
    if len(att) != layers or len(ffn) != layers:
        raise ValueError(f"{placement}: places {len(att)} attention and {len(ffn)} feed-forward "
                         f"blocks, not {layers}")
    return _BertLayout(att, ffn, ipus)


def _bert_stages(names: list[str], placement: str) -> list[int]:
    """A stage for each layer call of tf_ipu.models.bert's classifier, as ``placement`` puts
    them (``_bert_layout``): a layer's attention block (its attention, residual add, norm and
    checkpoint) and its feed-forward block each in their stage, the embedding in stage 0, the
    pooler and classifier (the heads) in the last stage."""
    layout = _bert_layout(placement)
    stages = []
    for name in names:
        m = re.match(r"layer_(\d+)_(attention|intermediate|output)", name)
        if m:
            stages.append((layout.att if m.group(2) == "attention" else layout.ffn)[int(m.group(1))])
        elif name.startswith(("token_", "position_", "embedding")):
            stages.append(0)
        else:
            stages.append(len(layout.ipus) - 1)
    return stages


def _bert_checkpoints(placement: str) -> set[tuple[int, str]]:
    """The blocks whose outputs the submission checkpoints (``checkpointOutput``), as
    ``(layer, "attention" | "ffn")``: with ``layers_per_ipu`` (v1.0, ``should_checkpoint``,
    ``recompute_checkpoint_every_layer`` by default) every layer's output but the last on each
    IPU; with ``att_ffn_placement`` (v1.1, v2.0: ``should_checkpoint_att`` / ``_ffn``) the
    attention outputs in the last stage, and each feed-forward output unless it is the last
    on its IPU and the next attention is on another IPU (layer 23's always)."""
    layout = _bert_layout(placement)
    n, last = len(layout.att), len(layout.ipus) - 1
    if "att_ffn_placement" not in placement:
        return {(i, "ffn") for i in range(n - 1) if layout.ffn[i + 1] == layout.ffn[i]}
    att_ipu = [layout.ipus[s] for s in layout.att]
    ffn_ipu = [layout.ipus[s] for s in layout.ffn]
    marks = {(i, "attention") for i in range(n) if layout.att[i] == last}
    marks |= {(i, "ffn") for i in range(n) if i == n - 1 or ffn_ipu[i] == ffn_ipu[i + 1]
              or ffn_ipu[i] == att_ipu[i + 1]}
    return marks


def _bert(placement: str, micro_batches: int, offload: bool | None, *, vocab: int = 30400,
          sharding: bool = True, checkpoints: bool = False, fp16_softmax: bool = True) -> Any:
    """BERT-Large (24 layers, hidden 1024, 16 heads, sequence 512) as a submission defines it,
    where Keras expresses it: ``placement``'s stages (``_bert_stages``) and IPUs, LAMB, the
    optimizer state where ``offload`` and ``sharding`` put it; with ``checkpoints`` the
    submission's recomputation checkpoints (``_bert_checkpoints``; PopART's
    RecomputationType.Pipeline: Graphcore's RecomputeAndBackpropagateInterleaved, with the
    Grouped schedule), with ``fp16_softmax`` the attention probabilities in FP16 as PopART's
    BERT keeps them (``bert_encoder(softmax_in_compute_dtype=True)``). Dropout off; a 2-class
    head (module docstring)."""
    import keras

    import tf_ipu
    from tf_ipu.models.bert import bert_classifier, bert_encoder
    from tf_ipu.pipelining import RecomputationMode

    marks = _bert_checkpoints(placement) if checkpoints else None
    with tf_ipu.IPUStrategy().scope():
        model = bert_classifier(bert_encoder(layers=24, hidden=1024, heads=16, seq_len=512,
                                             vocab=vocab, dropout=0.0, checkpoints=marks,
                                             softmax_in_compute_dtype=fp16_softmax), classes=2)
        model.compile(optimizer=keras.optimizers.Lamb(2e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        names = [a.layer.name for a in model.get_pipeline_stage_assignment()]
        model.set_pipeline_stage_assignment(_bert_stages(names, placement))
        options: dict[str, Any] = {"offload_weight_update_variables": offload,
                                   "replicated_optimizer_state_sharding": sharding}
        if marks:
            options["recomputation_mode"] = RecomputationMode.RecomputeAndBackpropagateInterleaved
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=micro_batches,
                                     device_mapping=_bert_layout(placement).ipus, **options)
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
    from device_server.emulator import calibration

    # Estimate (a pipeline's, without steps) and TrainingEstimate both carry expected_error.
    expected = calibration.describe(est.expected_error)
    print(f"    {expected}")
    return {"benchmark": what, "round": version, "chip": chip, "configuration": config,
            "measured_throughput": measured["throughput"], "estimated_throughput": tput,
            "throughput_ratio": r_tput, "measured_time_to_train_s": measured["time_to_train_s"],
            "estimated_time_to_train_s": ttt, "time_to_train_ratio": r_ttt, "fits": est.fits,
            "peak_tile_bytes": est.peak_tile_bytes, "runs": measured["runs"],
            "expected_error": expected, "estimate_seconds": seconds,
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
                    system=system, recomputation=True, partials_type="half",  # enable_half_partials
                    available_memory_proportion={"convolution": _RESNET_CONV_AMP})
        est = planned[chip, micro, accumulation]
        ttt = IMAGENET_TRAIN * m["trained"] / est.throughput  # a pipeline's: all replicas' items
        config = (f"16 replicas x micro-batch {micro} x {accumulation} accumulated, "
                  f"{m['trained']:g} epochs ({_RESNET_CFG})")
        rows.append(_ratio_row("ResNet-50", version, chip, m, est.throughput, est, ttt, config,
                               time.perf_counter() - t0, captured[chip, micro, accumulation]))
    return rows


@contextlib.contextmanager
def _checkpoint_stash() -> Iterator[dict[str, list[Any]]]:
    """Records, for the pipelined estimate planned inside, per stage and tile: the bytes of
    its recomputation checkpoints alone (``"checkpoints"``: the tile model's input checkpoints,
    stage inputs and checkpoints, ``tiles.pipeline._stash``, less those it finds with the
    checkpoints unmarked, the stage inputs) and of its optimizer state (``"state"``,
    ``tiles.pipeline._optimizer_state``). Read-only: the estimate is unchanged."""
    from device_server.emulator.tiles import pipeline

    found: dict[str, list[Any]] = {}
    original, state_of = pipeline._stash, pipeline._optimizer_state

    def state(*args: Any, **kwargs: Any) -> Any:
        found["state"] = state_of(*args, **kwargs)
        return found["state"]

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        marked = pipeline._recomputation
        pipeline._recomputation = lambda *a, **k: (set(), {})
        try:
            inputs = original(*args, **kwargs)[1]
        finally:
            pipeline._recomputation = marked
        found["checkpoints"] = [both - alone for both, alone in zip(out[1], inputs, strict=True)]
        return out

    pipeline._stash, pipeline._optimizer_state = recording, state
    try:
        yield found
    finally:
        pipeline._stash, pipeline._optimizer_state = original, state_of


def _unexpressed(est: Any, found: dict[str, list[Any]], replicas: int) -> dict[str, int]:
    """What v2.0's two options Keras cannot express would save on the fullest IPU's fullest
    tile (``est.peak_tile`` of ``est.peak_ipu``):

    - ``fp8``: FP8 activation checkpoints (``activation_checkpoint_dtype FLOAT8``: each
      checkpoint not on the last pipeline stage cast to one byte an element): half of the
      FP16 checkpoints its recomputed stages stash for their micro-batches in flight;
    - ``sharding``: the optimizer state on chip sharded over the replicas (RTS with
      TensorStorage.OnChip; Graphcore's TensorFlow shards only offloaded state): all but
      1/replicas of the IPU's optimizer state on that tile."""
    ipu, tile = int(est.peak_ipu), int(est.peak_tile)
    last = len(est.stages) - 1
    mine = [s for s in est.stages if s["ipu"] == ipu]
    fp8 = sum((s["in_flight"] - 1) * float(found["checkpoints"][s["stage"]][tile]) / 2
              for s in mine if s["stage"] != last and s["recomputation"])
    state = sum(float(found["state"][s["stage"]][tile]) for s in mine) if "state" in found else 0.0
    return {"fp8": int(round(fp8)), "sharding": int(round(state * (1 - 1 / replicas)))}


def _bert_rows() -> list[dict[str, Any]]:
    import tf_ipu

    rows = []
    for run in _BERT:
        system, names = _POD16[run.chip]
        m = _measured("bert", run.version, names)
        t0 = time.perf_counter()
        model = _bert(run.placement, run.accumulation, run.offload, vocab=run.vocab,
                      sharding=run.sharding, checkpoints=True)
        with _capturing() as captured, _checkpoint_stash() as stashed:
            est = tf_ipu.estimate(model, run.micro, training=True, ipu_version=run.chip,
                                  replicas=run.replicas, system=system, recomputation=True,
                                  steps=1, available_memory_proportion={"matmul": run.amp},
                                  partials_type="half")  # enable_half_partials
        tput = est.throughput * SEQUENCES_PER_ROW  # rows/s -> sequences/s
        ttt = m["trained"] / tput
        config = (f"{run.replicas} replicas x a {run.placement} pipeline, {run.micro} packed "
                  f"rows x {run.accumulation} micro-batches, matmul availableMemoryProportion "
                  f"{run.amp:g}, optimizer state {'offloaded' if run.offload else 'on chip'}"
                  f"{', sharded' if run.sharding else ''}, checkpoints as submitted, FP16 "
                  f"attention probabilities, half partials, {m['trained']:,.0f} sequences ({run.path})")
        row = _ratio_row("BERT-Large", run.version, run.chip, m, tput, est, ttt, config,
                         time.perf_counter() - t0, captured)
        verdict = ("fits" if est.fits else "within the margin" if est.within_margin
                   else "does not fit")
        print(f"    peak tile {est.peak_tile_bytes:,} B (tile {est.peak_tile} of IPU "
              f"{est.peak_ipu}): {verdict} ({est.tile_bytes_limit:,} B a tile, margin "
              f"{est.margin_bytes:,} B)")
        row.update({"peak_ipu": int(est.peak_ipu), "peak_tile": int(est.peak_tile),
                    "within_margin": bool(est.within_margin), "margin_bytes": int(est.margin_bytes),
                    "verdict": verdict, "matmul_available_memory_proportion": run.amp})
        if run.version == "v2.0" and "checkpoints" in stashed:
            saved = _unexpressed(est, stashed, run.replicas)
            where = f"on tile {est.peak_tile} of IPU {est.peak_ipu}"
            notes = [f"not expressible: FP8 activation checkpoints, would save {saved['fp8']:,} B "
                     f"{where}",
                     f"not expressible: optimizer state sharded on chip over {run.replicas} "
                     f"replicas, would save {saved['sharding']:,} B {where}"]
            over = est.peak_tile_bytes - est.tile_bytes_limit
            for note in notes:
                print(f"    {note}")
            if over > 0:
                both = saved["fp8"] + saved["sharding"]
                print(f"    the excess is {over:,} B: FP8 checkpoints alone "
                      f"{'account' if saved['fp8'] >= over else 'do not account'} for it; with "
                      f"the sharding ({both:,} B) it is "
                      f"{'accounted for' if both >= over else 'not accounted for'}")
            row.update({"not_expressible": notes, "fp8_checkpoint_saving_bytes": saved["fp8"],
                        "on_chip_sharding_saving_bytes": saved["sharding"]})
        rows.append(row)
    return rows


# ---- the larger pods (``python bench/run.py --only mlperf_pods``) --------------------------------
#: Graphcore's closed-division runs on Pod64 and larger (measurements.jsonl; never fitted), each
#: with the Pod16 run of its round that its speed-up is measured from: (round, chip, system
#: here, the table's names of the system).
_POD_RUNS = {
    "resnet": (("v1.0", "ipu2", "pod64", ("IPU-POD64",)),
               ("v1.1", "ipu2", "pod64", ("IPU-POD64",)),
               ("v1.1", "ipu2", "pod128", ("IPU-POD128",)),
               ("v1.1", "ipu2", "pod256", ("IPU-POD256",)),
               ("v2.0", "bow", "bow-pod64", ("Bow Pod64", "Bow-Pod64")),
               ("v2.0", "bow", "bow-pod128", ("Bow Pod128", "Bow-Pod128")),
               ("v2.0", "bow", "bow-pod256", ("Bow Pod256", "Bow-Pod256"))),
    "bert": (("v1.0", "ipu2", "pod64", ("IPU-POD64",)),
             ("v1.1", "ipu2", "pod64", ("IPU-POD64",)),
             ("v1.1", "ipu2", "pod128", ("IPU-POD128",)),
             ("v2.0", "bow", "bow-pod64", ("Bow Pod64", "Bow-Pod64")),
             ("v2.0", "bow", "bow-pod128", ("Bow Pod128", "Bow-Pod128")),
             ("v2.0", "bow", "bow-pod256", ("Bow Pod256", "Bow-Pod256"))),
}
#: The issue's target for the estimated speed-up from Pod16 against the measured one.
SPEEDUP_TARGET = 0.15


def _measured_pod(benchmark: str, version: str, systems: tuple[str, ...]) -> dict[str, Any]:
    """``_measured`` plus what the log states of the run's size: IPUs, hosts, global batch."""
    m = _measured(benchmark, version, systems)
    rows = [r for r in _table() if r.source == f"mlperf-train-{version}" and r.usable
            and r.metric == "items_per_s" and r.params.get("benchmark") == benchmark
            and r.params.get("division") == "closed" and r.params.get("system") in systems
            and str(r.params.get("framework", "")).startswith(_FRAMEWORK[benchmark])]
    for key in ("n_devices", "n_hosts", "global_batch_size"):
        m[key] = statistics.mode(r.params[key] for r in rows)
    return m


def _speedup_row(what: str, version: str, system: str, base: dict[str, Any], pod: dict[str, Any],
                 est_base: Any, est_pod: Any, tput_base: float, tput_pod: float, config: str,
                 seconds: float) -> dict[str, Any]:
    measured = pod["throughput"] / base["throughput"]
    estimated = tput_pod / tput_base
    ratio = estimated / measured
    links = " and ".join(est_pod.all_reduce_links) or "no links"
    gw = (est_pod.all_reduce_gw_share if hasattr(est_pod, "all_reduce_gw_share")   # TrainingEstimate
          else est_pod.all_reduce_gw_cycles / est_pod.cycles if est_pod.cycles else 0.0)
    print(f"  {what} {version} {system}: {config}")
    print(f"    throughput measured {pod['throughput']:,.0f}/s (median of {pod['runs']} runs), "
          f"estimated {tput_pod:,.0f}/s; speed-up from the round's Pod16 measured "
          f"{measured:.2f}x, estimated {estimated:.2f}x: ratio {ratio:.3f} "
          f"({'within' if abs(ratio - 1) <= SPEEDUP_TARGET else 'outside'} the "
          f"{SPEEDUP_TARGET:.0%} target)   [{seconds:.0f} s to estimate]")
    print(f"    all-reduce {est_pod.all_reduce_share:.1%} of the time per weight update, over "
          f"{links}" + (f" ({gw:.1%} on the GW-Links)" if gw else "")
          + f"; Pod16: {est_base.all_reduce_share:.1%}")
    return {"benchmark": what, "round": version, "system": system, "configuration": config,
            "measured_throughput": pod["throughput"], "estimated_throughput": tput_pod,
            "measured_pod16_throughput": base["throughput"], "estimated_pod16_throughput": tput_base,
            "measured_speedup": measured, "estimated_speedup": estimated, "speedup_ratio": ratio,
            "within_target": abs(ratio - 1) <= SPEEDUP_TARGET, "runs": pod["runs"],
            "n_devices": pod["n_devices"], "n_hosts": pod["n_hosts"],
            "all_reduce_share": est_pod.all_reduce_share, "all_reduce_links": est_pod.all_reduce_links,
            "all_reduce_gw_share": gw, "pod16_all_reduce_share": est_base.all_reduce_share,
            "fits": est_pod.fits, "estimate_seconds": seconds}


def _resnet_pod_rows() -> list[dict[str, Any]]:
    """ResNet-50 on each larger pod and on its round's Pod16, each at the configuration its log
    states (replicas = IPUs, micro-batch = global batch / (IPUs x accumulation)); the model of
    an accumulation count is built once and its lowering reused across systems."""
    import tf_ipu
    from tf_ipu.estimate import _lowerings

    models: dict[int, Any] = {}
    planned: dict[tuple[Any, ...], Any] = {}

    def est(chip: str, system: str, replicas: int, micro: int, accumulation: int) -> Any:
        key = (chip, system, replicas, micro, accumulation)
        if key not in planned:
            if accumulation not in models:
                models[accumulation] = _resnet50(accumulation)
            planned[key] = tf_ipu.estimate(
                models[accumulation], micro, training=True, ipu_version=chip, replicas=replicas,
                system=system, recomputation=True, partials_type="half",
                available_memory_proportion={"convolution": _RESNET_CONV_AMP})
        return planned[key]

    rows = []
    with _lowerings():
        for version, chip, system, names in _POD_RUNS["resnet"]:
            base_system, base_names = _POD16[chip]
            base = _measured_pod("resnet", version, base_names)
            pod = _measured_pod("resnet", version, names)
            t0 = time.perf_counter()
            b = est(chip, base_system, int(base["n_devices"]), int(base["micro_batch"]),
                    int(base["accumulation"]))
            micro, accumulation, replicas = int(pod["micro_batch"]), int(pod["accumulation"]), int(pod["n_devices"])
            if replicas * micro * accumulation != pod["global_batch_size"]:
                raise RuntimeError(f"ResNet-50 {version} {system}: {replicas} x {micro} x {accumulation} "
                                   f"is not the log's global batch {pod['global_batch_size']}")
            e = est(chip, system, replicas, micro, accumulation)
            config = (f"{replicas} replicas x micro-batch {micro} x {accumulation} accumulated "
                      f"(global batch {pod['global_batch_size']:,}, {pod['n_hosts']} host(s)); "
                      f"Pod16: {base['n_devices']} x {int(base['micro_batch'])} x "
                      f"{int(base['accumulation'])}")
            rows.append(_speedup_row("ResNet-50", version, system, base, pod, b, e, b.throughput,
                                     e.throughput, config, time.perf_counter() - t0))
    return rows


def _bert_estimate(run: _BertRun, replicas: int, accumulation: int, system: str, micro: int) -> Any:
    """BERT-Large as ``run`` configures it (``_bert_rows``'s options), with ``replicas``,
    ``accumulation`` and ``micro`` packed rows per micro-batch on ``system``."""
    import tf_ipu

    model = _bert(run.placement, accumulation, run.offload, vocab=run.vocab,
                  sharding=run.sharding, checkpoints=True)
    return tf_ipu.estimate(model, micro, training=True, ipu_version=run.chip,
                           replicas=replicas, system=system, recomputation=True, steps=1,
                           available_memory_proportion={"matmul": run.amp}, partials_type="half")


def _bert_pod_rows() -> list[dict[str, Any]]:
    """BERT-Large on each larger pod and on its round's Pod16. The logs state the IPUs, the
    global batch and the accumulation; the pipeline (and its options) is the round's Pod16
    configuration (``_BERT``), so replicas = IPUs / the pipeline's IPUs and the micro-batch =
    global batch / (sequences per row x replicas x accumulation), which must be whole (v1.0 and
    v1.1: 1 packed row on Pod64/128, where Pod16 ran 2; v2.0: 3, as on Pod16)."""
    rows = []
    baselines: dict[str, tuple[Any, float]] = {}
    for version, chip, system, names in _POD_RUNS["bert"]:
        run = next(r for r in _BERT if r.version == version)
        base_system, base_names = _POD16[chip]
        base = _measured_pod("bert", version, base_names)
        pod = _measured_pod("bert", version, names)
        depth = len(set(_bert_layout(run.placement).ipus))
        accumulation, replicas = int(pod["accumulation"]), int(pod["n_devices"]) // depth
        micro, rest = divmod(int(pod["global_batch_size"]),
                             SEQUENCES_PER_ROW * replicas * accumulation)
        if rest or micro < 1 or replicas * depth != pod["n_devices"]:
            raise RuntimeError(f"BERT-Large {version} {system}: the log's {pod['n_devices']} IPUs, "
                               f"global batch {pod['global_batch_size']} and accumulation "
                               f"{accumulation} fit no whole micro-batch of {depth}-IPU replicas")
        t0 = time.perf_counter()
        if version not in baselines:
            b = _bert_estimate(run, run.replicas, run.accumulation, base_system, run.micro)
            baselines[version] = (b, b.throughput * SEQUENCES_PER_ROW)
        b, tput_base = baselines[version]
        e = _bert_estimate(run, replicas, accumulation, system, micro)
        config = (f"{replicas} replicas x a {depth}-IPU pipeline ({run.placement}), {micro} "
                  f"packed rows x {accumulation} micro-batches (global batch "
                  f"{pod['global_batch_size']:,} sequences, {pod['n_hosts']} host(s)); Pod16: "
                  f"{run.replicas} replicas x {run.accumulation}")
        rows.append(_speedup_row("BERT-Large", version, system, base, pod, b, e, tput_base,
                                 e.throughput * SEQUENCES_PER_ROW, config, time.perf_counter() - t0))
    return rows


def pods_main(quick: bool = False) -> list[dict[str, Any]]:
    """The larger pods' runs estimated beside the measured ones: the speed-up from Pod16 to
    each pod, estimated and measured (``--quick``: ResNet-50 only)."""
    import keras

    print("Graphcore's MLPerf Training closed-division runs on Pod64 and larger (never fitted), "
          "estimated at each log's configuration; the speed-up from the round's Pod16, estimated "
          f"against measured (target: within {SPEEDUP_TARGET:.0%})")
    keras.mixed_precision.set_global_policy("float16")
    try:
        rows = _resnet_pod_rows()
        if not quick:
            keras.mixed_precision.set_global_policy("float16")
            rows += _bert_pod_rows()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    logs = [abs(math.log(r["speedup_ratio"])) for r in rows]
    summary = {"typical": math.exp(sum(logs) / len(logs)), "worst": math.exp(max(logs)),
               "within_target": sum(r["within_target"] for r in rows), "points": len(rows)}
    print(f"  speed-up ratio (estimated / measured): typical {summary['typical']:.3f}x, worst "
          f"{summary['worst']:.3f}x; {summary['within_target']} of {summary['points']} within "
          f"{SPEEDUP_TARGET:.0%}")
    rows.append({"summary": summary})
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
    if "--pods" in sys.argv:
        pods_main("--quick" in sys.argv)
    else:
        main("--quick" in sys.argv)
