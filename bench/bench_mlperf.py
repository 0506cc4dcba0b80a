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
        (16 x accumulation)); the round's optimizer (``_RESNET_OPTIMIZER``): SGD with
        momentum (v1.0), LARS (v1.1, v2.0: ``tf_ipu.optimizers.LARS``, per-layer norms).
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

The runs (the ResNet-50 ones together, each BERT-Large one apart) and, below, the pods'
rounds are estimated side by side in worker processes (bench/parallel.py, ``BENCH_JOBS``;
``BENCH_JOBS=1``: in this process), with the same rows in the same order.

Pod64 and larger (``pods_main``; ``--only mlperf_pods``, ``--quick``: ResNet-50 only): the
closed-division runs on IPU-POD64/128/256 and Bow Pod64/128/256 (never fitted), each at the
configuration its log states (ResNet-50: replicas = IPUs, micro-batch and accumulation from
the log; BERT: each pod's own configuration file, ``_BERT_PODS``: 8-IPU pipelines, where the
Pod16 runs had 4 (v1.0, v1.1), the optimizer state on chip, the config's replicas,
batch_size and accumulation, checked against the log's IPUs, global batch and accumulation),
on the systems of device_server/protocol/hardware.py (GCL's hierarchical all-reduce across
Pod64s: docs/tile_model.md, "Pods"), and the speed-up from the round's Pod16 run, estimated
against measured (the issue's target: within 15%). A per-replica program is lowered and
planned once (``_plan_once``) and re-costed for each pod's replicas, system and
accumulation. Beside each run: the all-reduce's share, the throughput per IPU, what the
measured rate asked of the host servers' NICs (``System.host_feed``), and, per program run
at several accumulation counts, the time per weight update split into a micro-batch's and
an update's (``per_update_split``).

    .venv/bin/python bench/run.py --only mlperf_pods [--quick]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
import weakref
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
    amp_per_ipu: tuple[float, ...] = ()  # the config's per-IPU values, where they differ


_BERT_V1 = "Graphcore/benchmarks/bert/implementations/popart/configs/mk2/pod16-closed.json"
#: The rounds. v1.0 sets availableMemoryProportion per IPU, [0.20, 0.20, 0.25, 0.25]: each
#: pipeline stage's matmuls take the value of the stage's IPU (``_bert_amp``, a list per stage
#: for ``tf_ipu.estimate``; ``amp`` is IPU 1's, for the larger pods' rows). v2.0 keeps its optimizer state on chip, sharded over its 2
#: replicas (RTS with TensorStorage.OnChip); Graphcore's TensorFlow shards only offloaded
#: state (``replicated_optimizer_state_sharding``), so here it is on chip and whole.
_BERT = (
    _BertRun("v1.0", "ipu2", 4, "4-IPU layers_per_ipu [3, 7, 7, 7]", 2, 192, True, True, 30400,
             0.20, _BERT_V1, (0.20, 0.20, 0.25, 0.25)),
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
#: Each round's ResNet-50 optimizer (configs.yml): v1.0's ``mk2_resnet50_mlperf_pod*_bs20``
#: set ``optimiser: momentum``; v1.1's and v2.0's ``mk2_resnet50_mlperf_pod*_lars`` set
#: ``optimiser: LARS`` (momentum 0.9, lars_weight_decay 5e-5, train.py's eeta 0.001, epsilon 0,
#: skip list beta, gamma, bias).
_RESNET_OPTIMIZER = {"v1.0": "momentum", "v1.1": "lars", "v2.0": "lars"}


def _resnet_optimizer(name: str) -> Any:
    """The optimizer ``_RESNET_OPTIMIZER`` names (the learning rate: v1.1's Pod16 config's)."""
    import keras

    if name == "lars":
        from tf_ipu.optimizers import LARS

        return LARS(10.72, momentum=0.9, weight_decay=5e-5, eeta=0.001, epsilon=0.0)
    if name == "momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    raise ValueError(f"ResNet-50 optimizer {name!r}: expected one of {sorted(set(_RESNET_OPTIMIZER.values()))}")


def _resnet50(accumulation: int, optimizer: str = "momentum") -> Any:
    """ResNet-50 as the submissions ran it: 8-bit images decoded on the IPU, a pipeline of 7
    stages on one IPU (``pipeline: True``, ``shards: 1``, Sequential) with recomputation
    (``enable_recomputation``; Auto resolves to RecomputeAndBackpropagateInterleaved for the
    Sequential schedule), the accumulation as the pipeline's. Under a float16 policy its batch
    norms keep the FP16 activations in FP16 (``tf_ipu.models.HalfBatchNormalization``), as the
    submissions' fused batch norm does. ``optimizer``: the round's (``_RESNET_OPTIMIZER``)."""
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
        model.compile(optimizer=_resnet_optimizer(optimizer), loss="sparse_categorical_crossentropy")
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
      i, the embedding with IPU 0's; the heads in a final stage on IPU 0; with
      ``encoder_start_ipu 1`` appended (v1.0's Pod64 config) the embedding alone in stage 0 on
      IPU 0 and entry i's layers in stage 1 + i on IPU 1 + i (bert_model.py,
      ``init_device_placement``: a layer's IPU and stage are its offset plus
      encoder_start_ipu; the heads one stage after the last layer's, on IPU 0);
    - ``att_ffn_placement [[ipu, [attention blocks, feed-forward blocks]], ..]`` (v1.1, v2.0,
      ``encoder_start_pipeline_stage`` 1): the embedding alone in stage 0 on IPU 0, entry p in
      stage 1 + p; the heads in the last entry's stage if it is on IPU 0, else in one more.

    The names the bench used before, ``4-IPU [3, 7, 7, 7]`` and ``8-IPU att_ffn_placement``,
    still mean v1.0's and v2.0's."""
    if "att_ffn_placement" in placement and "[" not in placement:
        placement = _V20_PLACEMENT
    start = re.search(r"encoder_start_ipu (\d+)", placement)
    spec = json.loads(placement[placement.index("["):start.start() if start else None].rstrip(", "))
    if "att_ffn_placement" in placement:
        att = [1 + p for p, (_, (a, _)) in enumerate(spec) for _ in range(a)]
        ffn = [1 + p for p, (_, (_, f)) in enumerate(spec) for _ in range(f)]
        ipus = [0] + [int(ipu) for ipu, _ in spec] + ([0] if spec[-1][0] != 0 else [])
    elif start and int(start.group(1)) == 1:
        att = ffn = [1 + ipu for ipu, n in enumerate(spec) for _ in range(n)]
        ipus = list(range(len(spec) + 1)) + [0]
    elif start and int(start.group(1)) != 0:
        raise ValueError(f"{placement}: encoder_start_ipu {start.group(1)} is not modelled (0 or 1)")
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
    _BUILT[model] = repr(("bench_mlperf._bert", tuple(map(tuple, _bert_layout(placement))),
                          micro_batches, offload, vocab, sharding, sorted(marks or ()), fp16_softmax))
    return model


# ---- estimates shared within one process ------------------------------------------------------
#: ``make bench`` (bench/run.py) runs this bench, then bench_fit_cases, in one process, and the
#: verdict table's three MLPerf BERT cases are this bench's BERT runs: ``_bert`` with the same
#: arguments, estimated with the same options. Each is estimated once: the per-step Estimate
#: (what ``tf_ipu.estimate`` returns for a pipelined program without ``steps``; this bench's
#: TrainingEstimate wraps it unchanged) and the checkpoint stash recorded while planning it,
#: kept under ``shared_key``. Nothing is shared between different arguments or options; a
#: worker process (``bench.parallel``) returns its entry to the parent (``bert_row_task``),
#: which hands it to the worker estimating the fit case (``bench_fit_cases.estimate_cases``).
_BUILT: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
SHARED: dict[str, tuple[Any, dict[str, list[Any]]]] = {}


def shared_key(model: Any, batch_size: int, training: bool, options: dict[str, Any]) -> str | None:
    """What determines the estimate of ``model`` (a ``_bert`` model; None for any other): the
    builder's arguments, the batch size, training, the dtype policy and every estimate option
    (``steps`` aside: it only wraps the step's Estimate)."""
    import keras

    built = _BUILT.get(model)
    if built is None:
        return None
    kept = sorted((k, repr(v)) for k, v in options.items() if k != "steps" and v is not None)
    return repr((built, int(batch_size), bool(training),
                 keras.mixed_precision.global_policy().name, kept))


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
                    _resnet50(accumulation, _RESNET_OPTIMIZER[version]), micro, training=True,
                    ipu_version=chip, replicas=16,
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


def _bert_amp(run: _BertRun) -> Any:
    """``tf_ipu.estimate``'s ``available_memory_proportion`` for ``run``'s matmuls: one value,
    or, where the config sets one per IPU that differs, one per pipeline stage, the value of
    the stage's IPU (bert_model.py indexes the list by each layer's IPU; the heads' stage on
    IPU 0 takes IPU 0's), for its forward and backward passes."""
    if len(set(run.amp_per_ipu)) <= 1:
        return {"matmul": run.amp}
    return [{"matmul": run.amp_per_ipu[ipu]} for ipu in _bert_layout(run.placement).ipus]


def _bert_shape(run: Any) -> str:
    """A BERT-Large run's replicas, pipeline and micro-batches, as its config text opens."""
    return (f"{run.replicas} replicas x a {run.placement} pipeline, {run.micro} packed rows x "
            f"{run.accumulation} micro-batches")


def _amp_text(run: Any) -> str:
    """A run's matmul availableMemoryProportion as its config sets it (one, or one per IPU)."""
    return ("/".join(f"{a:g}" for a in run.amp_per_ipu) + " per IPU" if run.amp_per_ipu
            else f"{run.amp:g}")


def _bert_row(run: _BertRun) -> dict[str, Any]:
    """``run`` estimated and printed: its row; its estimate kept in ``SHARED``."""
    import tf_ipu

    system, names = _POD16[run.chip]
    m = _measured("bert", run.version, names)
    t0 = time.perf_counter()
    model = _bert(run.placement, run.accumulation, run.offload, vocab=run.vocab,
                  sharding=run.sharding, checkpoints=True)
    options = {"ipu_version": run.chip, "replicas": run.replicas, "system": system,
               "recomputation": True, "available_memory_proportion": _bert_amp(run),
               "partials_type": "half"}  # enable_half_partials
    with _capturing() as captured, _checkpoint_stash() as stashed:
        est = tf_ipu.estimate(model, run.micro, training=True, steps=1, **options)
    key = shared_key(model, run.micro, True, options)
    if key is not None:
        SHARED[key] = (getattr(est, "step", est), stashed)
    tput = est.throughput * SEQUENCES_PER_ROW  # rows/s -> sequences/s
    ttt = m["trained"] / tput
    amp_text = _amp_text(run)
    config = (f"{_bert_shape(run)}, matmul availableMemoryProportion {amp_text}, optimizer "
              f"state {'offloaded' if run.offload else 'on chip'}"
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
                "verdict": verdict, "matmul_available_memory_proportion":
                    list(run.amp_per_ipu) or run.amp})
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
    return row


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
}
#: The issue's target for the estimated speed-up from Pod16 against the measured one.
SPEEDUP_TARGET = 0.15


class _BertPodRun(NamedTuple):
    """A BERT submission on Pod64 or larger: its own configuration file (not the round's
    Pod16 one: every larger pod ran 8-IPU pipelines), only the options it sets."""

    version: str
    chip: str
    system: str             # here (hardware.py)
    names: tuple[str, ...]  # the table's names of the system
    replicas: int           # replication_factor
    placement: str          # layers_per_ipu (+ encoder_start_ipu) or att_ffn_placement
    micro: int              # batch_size (packed rows)
    accumulation: int       # gradient_accumulation_factor
    vocab: int              # vocab_length
    amp: float              # available_memory_proportion (IPU 1's)
    path: str               # the configuration file (its round's mlcommons repository)
    amp_per_ipu: tuple[float, ...] = ()  # the config's per-IPU values, where they differ


_BERT_POD_CFG = "Graphcore/benchmarks/bert/implementations/popart/configs/"
_V11_POD_PLACEMENT = ("8-IPU att_ffn_placement [[1, [2, 2]], [2, [3, 3]], [3, [4, 3]], [4, [3, 4]], "
                      "[5, [4, 3]], [6, [3, 4]], [7, [4, 3]], [0, [1, 2]]]")
_V11_POD_AMP = (0.20, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25)
_V20_POD_PLACEMENT = ("8-IPU att_ffn_placement [[1, [3, 3]], [2, [3, 3]], [3, [3, 3]], [4, [4, 3]], "
                      "[5, [3, 4]], [6, [4, 3]], [7, [3, 4]], [0, [1, 1]]]")
#: BERT-Large's closed-division runs on Pod64 and larger, each with its configuration file in
#: mlcommons/training_results_v1.0 (commit 8200377), v1.1 (f6f0443), v2.0 (482ba24). Every one
#: sets ``optimizer_state_offchip: false`` and ``replicated_tensor_sharding: true`` (on-chip
#: sharding, which Graphcore's TensorFlow does not do: the state is whole on each replica, as
#: for v2.0's Pod16 run) and ``enable_half_partials``. ``available_memory_proportion`` is per
#: IPU: v1.0 and v2.0 set 1 on all 8; v1.1 sets 0.20 on IPU 0 (embedding, heads and 1-2
#: layers) and 0.25 on the 7 others, each stage's matmuls taking their IPU's (``_bert_amp``).
#: replicas x micro x accumulation x 2 sequences a row is each log's global batch (checked).
_BERT_PODS = (
    _BertPodRun("v1.0", "ipu2", "pod64", ("IPU-POD64",), 8,
                "8-IPU layers_per_ipu [3, 3, 3, 3, 4, 4, 4], encoder_start_ipu 1", 2, 96, 30400,
                1.0, _BERT_POD_CFG + "mk2/pod64-closed.json"),
    _BertPodRun("v1.1", "ipu2", "pod64", ("IPU-POD64",), 8, _V11_POD_PLACEMENT, 2, 96, 30912,
                0.25, _BERT_POD_CFG + "mk2/pod64-closed.json", _V11_POD_AMP),
    _BertPodRun("v1.1", "ipu2", "pod128", ("IPU-POD128",), 16, _V11_POD_PLACEMENT, 2, 96, 30912,
                0.25, _BERT_POD_CFG + "mk2/pod128-closed.json", _V11_POD_AMP),
    _BertPodRun("v2.0", "bow", "bow-pod64", ("Bow Pod64", "Bow-Pod64"), 8, _V20_POD_PLACEMENT, 3,
                96, 30912, 1.0, _BERT_POD_CFG + "pod64-closed.json"),
    _BertPodRun("v2.0", "bow", "bow-pod128", ("Bow Pod128", "Bow-Pod128"), 16, _V20_POD_PLACEMENT,
                3, 64, 30912, 1.0, _BERT_POD_CFG + "pod128-closed.json"),
    _BertPodRun("v2.0", "bow", "bow-pod256", ("Bow Pod256", "Bow-Pod256"), 32, _V20_POD_PLACEMENT,
                3, 36, 30912, 1.0, _BERT_POD_CFG + "pod256-closed.json"),
)


@contextlib.contextmanager
def _plan_once() -> Iterator[dict[str, int]]:
    """Within it (and ``tf_ipu.estimate._lowerings``), a pipelined program is lowered once
    whatever its micro-batches per weight update (they are not in the module, only in its
    signature), and planned once whatever its replicas and system: each estimate re-costs
    only what they change (``pipeline.estimate_pipeline``: the per-update all-reduce over the
    new ring, host links, syncs, the timeline of its micro-batches). One thing stays from the
    first planning: each tile's all-reduce receive chunk (1/R of its share, memory only).
    Yields counts: ``plans`` made, ``reused``."""
    from device_server.emulator.tiles import report

    estimate_module = sys.modules["tf_ipu.estimate"]   # the package's name is the function
    counts = {"plans": 0, "reused": 0}
    kept: dict[tuple[Any, ...], Any] = {}
    plan_module, lowering_key = report.plan_module, estimate_module._lowering_key

    def key_without_micro_batches(model: Any, program: str, specs: Any, pipeline: Any) -> Any:
        if pipeline:
            pipeline = {k: v for k, v in pipeline.items() if k != "micro_batches"}
        return lowering_key(model, program, specs, pipeline)

    def planned(module: Any, target: Any, live: Any, **kw: Any) -> Any:
        rep = kw.get("replication")
        if kw.get("stages", 1) == 1 or live is not None or kw.get("mappings"):
            return plan_module(module, target, live, **kw)
        key = (id(module), repr(target), rep is not None and rep.replicated,
               tuple(sorted((k, repr(v)) for k, v in kw.items() if k != "replication")))
        if key not in kept:
            counts["plans"] += 1
            kept[key] = (module, plan_module(module, target, live, **kw))
            return kept[key][1]
        counts["reused"] += 1
        return dataclasses.replace(kept[key][1], replication=rep)

    report.plan_module, estimate_module._lowering_key = planned, key_without_micro_batches
    try:
        yield counts
    finally:
        report.plan_module, estimate_module._lowering_key = plan_module, lowering_key


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


def _all_reduce_shares(est: Any) -> tuple[float, float]:
    """The all-reduce's share of the time per weight update, and its GW-Links' part: a
    TrainingEstimate's (which reads a pipelined step's figures as one micro-batch's share of
    an update), or a step report's share of its call."""
    from tf_ipu.estimate import TrainingEstimate

    if isinstance(est, TrainingEstimate):
        return est.all_reduce_share, est.all_reduce_gw_share
    step = getattr(est, "step", est)
    if not step.cycles:
        return 0.0, 0.0
    return step.all_reduce_share, step.all_reduce_gw_cycles / step.cycles


def _speedup_row(what: str, version: str, system: str, base: dict[str, Any], pod: dict[str, Any],
                 est_base: Any, est_pod: Any, tput_base: float, tput_pod: float, config: str,
                 seconds: float) -> dict[str, Any]:
    measured = pod["throughput"] / base["throughput"]
    estimated = tput_pod / tput_base
    ratio = estimated / measured
    links = " and ".join(est_pod.all_reduce_links) or "no links"
    share, gw = _all_reduce_shares(est_pod)
    base_share = _all_reduce_shares(est_base)[0]
    print(f"  {what} {version} {system}: {config}")
    print(f"    throughput measured {pod['throughput']:,.0f}/s (median of {pod['runs']} runs), "
          f"estimated {tput_pod:,.0f}/s; speed-up from the round's Pod16 measured "
          f"{measured:.2f}x, estimated {estimated:.2f}x: ratio {ratio:.3f} "
          f"({'within' if abs(ratio - 1) <= SPEEDUP_TARGET else 'outside'} the "
          f"{SPEEDUP_TARGET:.0%} target)   [{seconds:.0f} s to estimate]")
    print(f"    all-reduce {share:.1%} of the time per weight update, over "
          f"{links}" + (f" ({gw:.1%} on the GW-Links)" if gw else "")
          + f"; Pod16: {base_share:.1%}")
    from device_server.protocol import hardware

    step = getattr(est_pod, "step", est_pod)   # a TrainingEstimate's Estimate
    per_item = step.host_bytes_in / max(1, step.items_per_call) * est_pod.throughput / tput_pod
    feeds = [hardware.get_system(name).host_feed(run["throughput"] * per_item, int(run["n_hosts"]))
             for name, run in ((system, pod), (_POD16[hardware.get_system(system).ipu_version][0], base))]
    if feeds[0]:
        print(f"    host data, measured runs ({per_item:,.0f} B an item): {feeds[0]}; Pod16: {feeds[1]}")
    per_ipu = (pod["throughput"] / pod["n_devices"], tput_pod / pod["n_devices"],
               base["throughput"] / base["n_devices"], tput_base / base["n_devices"])
    print(f"    per IPU: measured {per_ipu[0]:,.1f}/s (Pod16 {per_ipu[2]:,.1f}/s), estimated "
          f"{per_ipu[1]:,.1f}/s (Pod16 {per_ipu[3]:,.1f}/s); estimated / measured "
          f"{per_ipu[1] / per_ipu[0]:.3f} (Pod16 {per_ipu[3] / per_ipu[2]:.3f})")
    return {"benchmark": what, "round": version, "system": system, "configuration": config,
            "measured_throughput": pod["throughput"], "estimated_throughput": tput_pod,
            "measured_pod16_throughput": base["throughput"], "estimated_pod16_throughput": tput_base,
            "measured_speedup": measured, "estimated_speedup": estimated, "speedup_ratio": ratio,
            "within_target": abs(ratio - 1) <= SPEEDUP_TARGET, "runs": pod["runs"],
            "n_devices": pod["n_devices"], "n_hosts": pod["n_hosts"],
            "all_reduce_share": share, "all_reduce_links": est_pod.all_reduce_links,
            "all_reduce_gw_share": gw, "pod16_all_reduce_share": base_share,
            "fits": est_pod.fits, "estimate_seconds": seconds,
            "measured_per_ipu": per_ipu[0], "estimated_per_ipu": per_ipu[1],
            "measured_pod16_per_ipu": per_ipu[2], "estimated_pod16_per_ipu": per_ipu[3],
            "per_ipu_ratio": per_ipu[1] / per_ipu[0], "pod16_per_ipu_ratio": per_ipu[3] / per_ipu[2],
            "host_bytes_per_item": per_item, "host_feed": feeds[0], "pod16_host_feed": feeds[1]}


def _resnet_pod_rows() -> list[dict[str, Any]]:
    """ResNet-50 on each larger pod and on its round's Pod16, each at the configuration its log
    states (replicas = IPUs, micro-batch = global batch / (IPUs x accumulation)); one model,
    lowered once per micro-batch and planned once per chip (``_plan_once``)."""
    import tf_ipu
    from tf_ipu.estimate import _lowerings

    models: dict[str, Any] = {}
    planned: dict[tuple[Any, ...], Any] = {}

    def est(chip: str, system: str, replicas: int, micro: int, accumulation: int,
            optimizer: str) -> Any:
        key = (chip, system, replicas, micro, accumulation, optimizer)
        if key not in planned:
            if optimizer not in models:
                models[optimizer] = _resnet50(accumulation, optimizer)
            planned[key] = tf_ipu.estimate(
                _with_accumulation(models[optimizer], accumulation), micro, training=True,
                ipu_version=chip, replicas=replicas,
                system=system, recomputation=True, partials_type="half",
                available_memory_proportion={"convolution": _RESNET_CONV_AMP})
        return planned[key]

    rows = []
    with _lowerings(), _plan_once() as counts:
        for version, chip, system, names in _POD_RUNS["resnet"]:
            base_system, base_names = _POD16[chip]
            base = _measured_pod("resnet", version, base_names)
            pod = _measured_pod("resnet", version, names)
            t0 = time.perf_counter()
            b = est(chip, base_system, int(base["n_devices"]), int(base["micro_batch"]),
                    int(base["accumulation"]), _RESNET_OPTIMIZER[version])
            micro, accumulation, replicas = int(pod["micro_batch"]), int(pod["accumulation"]), int(pod["n_devices"])
            if replicas * micro * accumulation != pod["global_batch_size"]:
                raise RuntimeError(f"ResNet-50 {version} {system}: {replicas} x {micro} x {accumulation} "
                                   f"is not the log's global batch {pod['global_batch_size']}")
            e = est(chip, system, replicas, micro, accumulation, _RESNET_OPTIMIZER[version])
            config = (f"{replicas} replicas x micro-batch {micro} x {accumulation} accumulated "
                      f"(global batch {pod['global_batch_size']:,}, {pod['n_hosts']} host(s)); "
                      f"Pod16: {base['n_devices']} x {int(base['micro_batch'])} x "
                      f"{int(base['accumulation'])}")
            rows.append(_speedup_row("ResNet-50", version, system, base, pod, b, e, b.throughput,
                                     e.throughput, config, time.perf_counter() - t0))
            rows[-1].update(planned_once=dict(counts), sizes={
                "pod": [replicas, micro, accumulation, f"micro-batch {micro}"],
                "pod16": [int(base["n_devices"]), int(base["micro_batch"]), int(base["accumulation"]),
                          f"micro-batch {int(base['micro_batch'])}"]})
    return rows


def _with_accumulation(model: Any, accumulation: int) -> Any:
    """``model`` with ``accumulation`` micro-batches per weight update, its other pipelining
    options as they were (the same model: within ``_plan_once`` it is lowered and planned
    once whatever its accumulation)."""
    from tf_ipu import pipelining

    options = pipelining.pipelining_options(model)
    if options.get("gradient_accumulation_steps_per_replica") != accumulation:
        with model._distribute_strategy.scope():
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=accumulation,
                device_mapping=options["device_mapping"],
                gradient_accumulation_reduction_method=options["gradient_accumulation_reduction_method"],
                pipeline_schedule=options["pipeline_schedule"],
                recomputation_mode=options["recomputation_mode"], **options["kwargs"])
    return model


def _bert_pod_estimate(models: dict[tuple[Any, ...], Any], chip: str, placement: str, vocab: int,
                       offload: bool | None, sharding: bool, amp: Any, micro: int,
                       accumulation: int, replicas: int, system: str) -> Any:
    """BERT-Large with ``_bert_row``'s options (``placement``'s pipeline, the submission's
    checkpoints, FP16 attention probabilities, half partials; ``amp``: ``_bert_amp``'s), one
    model per program."""
    import tf_ipu

    key = (placement, vocab, offload, sharding)
    if key not in models:
        models[key] = _bert(placement, accumulation, offload, vocab=vocab, sharding=sharding,
                            checkpoints=True)
    model = _with_accumulation(models[key], accumulation)
    return tf_ipu.estimate(model, micro, training=True, ipu_version=chip, replicas=replicas,
                           system=system, recomputation=True, steps=1,
                           available_memory_proportion=amp, partials_type="half")


def _bert_pod_rows(version: str) -> list[dict[str, Any]]:
    """BERT-Large on each larger pod of round ``version`` (``_BERT_PODS``: each submission's
    own configuration) and on the round's Pod16 (``_BERT``); the logs' IPUs, global batch and
    accumulation are checked against the configurations. A program is planned once
    (``_plan_once``): v1.1's Pod64 and Pod128 share one, v2.0's three pods another (no two
    rounds share a model, so each round is estimated apart: ``pods_main``)."""
    from tf_ipu.estimate import _lowerings

    rows: list[dict[str, Any]] = []
    models: dict[tuple[Any, ...], Any] = {}
    baselines: dict[str, tuple[Any, float]] = {}
    with _lowerings(), _plan_once() as counts:
        for run in (r for r in _BERT_PODS if r.version == version):
            base_run = next(r for r in _BERT if r.version == run.version)
            base_system, base_names = _POD16[run.chip]
            base = _measured_pod("bert", run.version, base_names)
            pod = _measured_pod("bert", run.version, run.names)
            depth = len(set(_bert_layout(run.placement).ipus))
            stated = (run.replicas * depth, run.replicas * run.micro * run.accumulation * SEQUENCES_PER_ROW,
                      run.accumulation)
            if stated != (pod["n_devices"], pod["global_batch_size"], pod["accumulation"]):
                raise RuntimeError(
                    f"BERT-Large {run.version} {run.system}: {run.path} gives {stated[0]} IPUs, "
                    f"global batch {stated[1]} and accumulation {stated[2]}; the log states "
                    f"{pod['n_devices']}, {pod['global_batch_size']} and {pod['accumulation']}")
            t0 = time.perf_counter()
            if run.version not in baselines:
                b = _bert_pod_estimate(models, run.chip, base_run.placement, base_run.vocab,
                                       base_run.offload, base_run.sharding, _bert_amp(base_run),
                                       base_run.micro, base_run.accumulation, base_run.replicas,
                                       base_system)
                baselines[run.version] = (b, b.throughput * SEQUENCES_PER_ROW)
            b, tput_base = baselines[run.version]
            e = _bert_pod_estimate(models, run.chip, run.placement, run.vocab, False, False,
                                   _bert_amp(run), run.micro, run.accumulation, run.replicas,
                                   run.system)
            amp = _amp_text(run)
            config = (f"{_bert_shape(run)} (global batch {pod['global_batch_size']:,} sequences, "
                      f"{pod['n_hosts']} host(s)), matmul "
                      f"availableMemoryProportion {amp}, optimizer state on chip ({run.path}); "
                      f"Pod16: {base_run.replicas} replicas x {base_run.micro} x {base_run.accumulation}")
            row = _speedup_row("BERT-Large", run.version, run.system, base, pod, b, e, tput_base,
                               e.throughput * SEQUENCES_PER_ROW, config, time.perf_counter() - t0)
            row.update(planned_once=dict(counts), sizes={
                "pod": [run.replicas, run.micro * SEQUENCES_PER_ROW, run.accumulation,
                        f"{run.placement}, {run.micro} rows, amp {amp}"],
                "pod16": [base_run.replicas, base_run.micro * SEQUENCES_PER_ROW, base_run.accumulation,
                          f"{base_run.placement}, {base_run.micro} rows, amp {_bert_amp(base_run)}"]})
            rows.append(row)
    return rows


def per_update_split(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's time per weight update, T = items per micro-batch x N x replicas / throughput,
    measured and estimated, split as T = N x c + u (least squares) over the runs of one
    per-replica program (one benchmark, round and micro-batch) at two or more accumulation
    counts N: c, the time of a micro-batch, and u, what each weight update adds (update,
    all-reduce, syncs, host). A reading of the measurements, fitted to nothing: the speed-up
    from Pod16 (N = 6 to 10 for ResNet-50) to a larger pod (N = 2 to 4) depends on u / c."""
    points: dict[tuple[str, str, str], dict[str, tuple[int, float, float]]] = {}
    for r in rows:
        if "sizes" not in r:
            continue
        for which, measured, estimated in (("pod", "measured_throughput", "estimated_throughput"),
                                           ("pod16", "measured_pod16_throughput",
                                            "estimated_pod16_throughput")):
            replicas, items, n, program = r["sizes"][which]
            work = items * n * replicas
            group = points.setdefault((r["benchmark"], r["round"], program), {})
            group.setdefault(r["system"] if which == "pod" else which,
                             (n, work / r[measured], work / r[estimated]))
    out = []
    for (benchmark, version, program), by_system in points.items():
        ns = [n for n, _, _ in by_system.values()]
        if len(set(ns)) < 2:
            continue
        split = {}
        for k, what in enumerate(("measured", "estimated"), start=1):
            ts = [p[k] for p in by_system.values()]
            mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
            c = (sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts, strict=True))
                 / sum((n - mean_n) ** 2 for n in ns))
            split[what] = {"micro_batch_s": c, "per_update_s": mean_t - c * mean_n}
        out.append({"benchmark": benchmark, "round": version, "program": program,
                    "systems": list(by_system), "accumulation": ns, **split})
    return out


# ---- the runs estimated side by side (bench.parallel: BENCH_JOBS, the CPUs, the memory) ----------
_MODULE = "bench.bench_mlperf"   # the workers import this module by name


def _in_fp16(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` under Keras' float16 policy (the submissions' FP16), float32 after."""
    import keras

    keras.mixed_precision.set_global_policy("float16")
    try:
        return fn(*args)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def resnet_rows_task() -> list[dict[str, Any]]:
    """The three ResNet-50 Pod16 runs' rows (one call: they share plans)."""
    return _in_fp16(_resnet_rows)


def bert_row_task(index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``_BERT[index]``'s row and the ``SHARED`` entry its estimate made (a worker returns it
    to the parent, where bench_fit_cases looks for it)."""
    before = set(SHARED)
    row = _in_fp16(_bert_row, _BERT[index])
    return row, {k: v for k, v in SHARED.items() if k not in before}


def resnet_pod_rows_task() -> list[dict[str, Any]]:
    """The ResNet-50 pods' rows (one call: one model, planned once per chip)."""
    return _in_fp16(_resnet_pod_rows)


def bert_pod_rows_task(version: str) -> list[dict[str, Any]]:
    """Round ``version``'s BERT-Large pods' rows."""
    return _in_fp16(_bert_pod_rows, version)


def cumulative_plan_counts(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of groups each estimated within its own ``_plan_once``, their ``planned_once``
    counts as one ``_plan_once`` around all of them, one group after another, would have
    counted (the groups share no program: each adds its own plans and reuses)."""
    rows, plans, reused = [], 0, 0
    for group in groups:
        last = {"plans": 0, "reused": 0}
        for row in group:
            last = row["planned_once"]
            row["planned_once"] = {"plans": last["plans"] + plans,
                                   "reused": last["reused"] + reused}
            rows.append(row)
        plans, reused = plans + last["plans"], reused + last["reused"]
    return rows


def _side_by_side(calls: list[Any], cost: list[float]) -> list[Any]:
    """``bench.parallel.run`` of ``calls`` with the workers it can have, said in the output."""
    from bench import parallel

    jobs, why = parallel.workers(len(calls))
    print(f"  {len(calls)} independent estimate call{'s' if len(calls) > 1 else ''}, {jobs} worker process"
          f"{'es' if jobs > 1 else ' (in this process)'}: {why}", flush=True)
    return list(parallel.run(calls, jobs, cost))


def pods_main(quick: bool = False) -> list[dict[str, Any]]:
    """The larger pods' runs estimated beside the measured ones: the speed-up from Pod16 to
    each pod, estimated and measured (``--quick``: ResNet-50 only). The ResNet-50 runs and
    each round's BERT-Large runs are estimated side by side (``_side_by_side``)."""
    print("Graphcore's MLPerf Training closed-division runs on Pod64 and larger (never fitted), "
          "estimated at each log's configuration; the speed-up from the round's Pod16, estimated "
          f"against measured (target: within {SPEEDUP_TARGET:.0%})")
    versions = [] if quick else list(dict.fromkeys(r.version for r in _BERT_PODS))
    calls = [(_MODULE, "resnet_pod_rows_task", ())] + [
        (_MODULE, "bert_pod_rows_task", (v,)) for v in versions]
    # Longest first: a round's BERT estimates (its Pod16 and each pod) outweigh ResNet-50's.
    cost = [1.0] + [1.0 + sum(r.version == v for r in _BERT_PODS) for v in versions]
    groups = _side_by_side(calls, cost)
    rows = groups[0] + cumulative_plan_counts(groups[1:])
    splits = per_update_split(rows)
    if splits:
        print("  time per weight update split as N x (a micro-batch) + (what an update adds), "
              "over the runs of one per-replica program at several accumulation counts N:")
    for sp in splits:
        m, e = sp["measured"], sp["estimated"]
        print(f"    {sp['benchmark']} {sp['round']} ({sp['program']}; "
              + ", ".join(f"{s} N = {n}" for s, n in zip(sp["systems"], sp["accumulation"], strict=True))
              + f"): measured {m['micro_batch_s'] * 1e3:.2f} ms "
              f"a micro-batch + {m['per_update_s'] * 1e3:.2f} ms an update; estimated "
              f"{e['micro_batch_s'] * 1e3:.2f} ms + {e['per_update_s'] * 1e3:.2f} ms")
    logs = [abs(math.log(r["speedup_ratio"])) for r in rows]
    summary = {"typical": math.exp(sum(logs) / len(logs)), "worst": math.exp(max(logs)),
               "within_target": sum(r["within_target"] for r in rows), "points": len(rows)}
    print(f"  speed-up ratio (estimated / measured): typical {summary['typical']:.3f}x, worst "
          f"{summary['worst']:.3f}x; {summary['within_target']} of {summary['points']} within "
          f"{SPEEDUP_TARGET:.0%}")
    rows.append({"summary": summary, "per_update_split": splits})
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
    calls = [(_MODULE, "resnet_rows_task", ())] + (
        [] if quick else [(_MODULE, "bert_row_task", (i,)) for i in range(len(_BERT))])
    out = _side_by_side(calls, [1.0] + [2.0] * (len(calls) - 1))  # BERT-Large's first
    rows = list(out[0])
    for row, shared in out[1:]:
        SHARED.update(shared)   # here too when estimated in a worker
        rows.append(row)
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
