"""Verdicts against the hardware: the tile model's fit verdict for every case Graphcore published
in ``bench/fit_cases.json`` (issue 24, point 4), beside Graphcore's own verdict.

    bench/fit_cases.json (committed before any estimate; never edited to suit a result)
        |  per case: the model built with the options its source sets, as far as Keras and
        |  tf_ipu can express them (micro-batch, training or inference, precision, replicas and
        |  system, pipeline stages and their IPUs, recomputation and its checkpoints,
        |  availableMemoryProportion, gradient accumulation, optimizer-state offload)
        v
    tf_ipu.estimate (full size, estimates only: nothing executes)
        -> peak tile bytes, verdict (fits: peak <= the tile's SRAM; within the declared 5%
           margin; out of memory), published verdict, right or wrong, seconds to estimate,
           and what the case sets that could not be expressed (with its size where computable)

Models: ResNet-50 (``bench.bench_mlperf._resnet50`` for the TF1/TF2 MLPerf-style pipelines,
``keras.applications.ResNet50`` otherwise), BERT (``bench.bench_mlperf._bert`` for the MLPerf
rounds, ``tf_ipu.models.bert`` otherwise), ResNeXt-50 (``tf_ipu.models.resnext``),
EfficientNet-B0 (``keras.applications``) and the recomputation tutorial's split LSTM
(``tf_ipu.models.recompute_lstm``, as ``bench/fit_cases.md`` mirrors it), U-Net, ViT, GPT-2 and
EfficientNet-GN (``tf_ipu.models.unet``, ``vit``, ``gpt2``, ``efficientnet_gn``) and the Poplar
tutorial's two matmuls (three variables in a Keras layer). A case the project cannot build
would be listed as "not built" with the reason (``NOT_BUILT``).

Scoring: fits and out-of-memory cases are scored separately (right / built, of all published);
a controlled pair (the tutorial's 7 / 0 checkpoints, the tech note's 0.35 / 0.8) counts only
if both halves are right. Cases are not tuned: wrong verdicts are reported as they come.

    .venv/bin/python bench/run.py --only fit_cases [--quick]
    .venv/bin/python bench/bench_fit_cases.py [--quick] [--only CASE_ID ...]
    FIT_CASES=bert-large .venv/bin/python bench/run.py --only fit_cases --results /tmp/x
                                                     (cases whose id is or contains one given)

The cases are estimated side by side in worker processes (``estimate_cases``, bench/parallel.py:
``BENCH_JOBS``, default one per CPU and 6 GB available; ``BENCH_JOBS=1``: in this process),
with the same rows in the same order. The default run estimates every buildable case; on a 2-core machine that is over the part's
8-minute budget because of the seven BERT-Large pipelines (about a minute each), so ``--quick``
leaves those out (``SLOW``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fit_cases.json")

#: The fields every case in fit_cases.json has (bench/fit_cases.md, "File layout").
REQUIRED_FIELDS = ("id", "group", "repository", "path", "commit", "sources", "model", "framework",
                   "training", "micro_batch", "precision", "ipus_per_replica", "replicas",
                   "pipeline", "recomputation", "gradient_accumulation",
                   "available_memory_proportion", "optimizer", "offload", "ipu", "other_options",
                   "published_verdict", "where", "provenance", "only_options_set_by_source",
                   "notes")
VERDICTS = ("fits", "out_of_memory")

#: Controlled pairs: each counts only if both halves are right.
PAIRS = (
    ("tutorial-tf2-recompute-lstm-2048-7ckpt", "tutorial-tf2-recompute-lstm-2048-0ckpt"),
    ("technote-available-memory-resnext50-bs20-amp0.35",
     "technote-available-memory-resnext50-bs20-amp0.8"),
)

#: Cases the project cannot build, with the reason (listed in the table, never dropped).
NOT_BUILT: dict[str, str] = {}  # every published case has a builder now (the last 8 since
# the U-Net, ViT, GPT-2, EfficientNet-GN and Poplar-matmul builders)

#: Cases that take longest to estimate (BERT-Large pipelines, each about a minute or more on
#: 2 shared cores); ``--quick`` leaves them out.
SLOW = (
    "mlperf-v1.0-bert-large-pod16", "mlperf-v1.1-bert-large-pod16",
    "mlperf-v2.0-bert-large-bow-pod16", "examples-tf2-bert-large-pretrain-seq384-pod16",
    "examples-poptorch-bert-large-pretrain-seq512-pod16",
    "examples-tf2-bert-large-pretrain-seq128-pod16",
    "examples-poptorch-bert-large-pretrain-seq128-pod16",
    "examples-poptorch-efficientnet-b4-g16-gn-train-pod16",  # ~880 layers: 507 s at load 15
)

_SYSTEM16 = {"ipu2": "pod16", "bow": "bow-pod16"}
_TILES = {"ipu1": 1216, "ipu2": 1472, "bow": 1472}
_HALF_PARTIALS = "half partials (partialsType half for convolutions and matmuls)"


def _half_partials(case: dict[str, Any]) -> bool:
    """Whether the case's configuration sets partialsType half (its products then hold and
    exchange FP16 partial sums: ``tf_ipu.estimate(partials_type="half")``)."""
    return str(case["precision"].get("partials", "")).startswith("half")


def load_cases(path: str = CASES_PATH) -> list[dict[str, Any]]:
    """The cases of ``bench/fit_cases.json``, in file order."""
    with open(path) as f:
        return json.load(f)["cases"]


# -- what a case builds to -----------------------------------------------------------------


@dataclass
class Plan:
    """A case made concrete: the model, ``tf_ipu.estimate``'s arguments, the precision policy
    it was built under, what was expressed and what could not be."""

    model: Any
    batch: int
    training: bool
    options: dict[str, Any]
    policy: str = "float32"
    expressed: list[str] = field(default_factory=list)
    unexpressed: list[str] = field(default_factory=list)
    # What the estimate records while it runs (a context manager yielding what it found), and
    # the notes made from the estimate and that afterwards (sizes of what was not expressed).
    capture: Callable[[], Any] | None = None
    after: Callable[[Any, Any], list[str]] | None = None
    # The bytes each unexpressible option would save on the fullest tile, from the estimate
    # and what it found ({"options": {name: bytes}}; scored by ``accounted_for``).
    accounting: Callable[[Any, Any], dict[str, Any]] | None = None


@contextlib.contextmanager
def _policy(name: str) -> Iterator[None]:
    """Keras' global dtype policy set to ``name`` within, restored after."""
    import keras

    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(old)


def _policy_of(case: dict[str, Any]) -> str:
    """"float16" when the case computes in FP16 (Graphcore's 16.16: FP16 weights too)."""
    return "float16" if str(case["precision"].get("compute", "")).startswith("fp16") else "float32"


def _keras_split(name: str) -> str:
    """A published ResNet split point as the Keras ResNet-50 layer it follows: TF1's 0-based
    ``b<stage>/<block>/relu`` and 1-based-block ``stage<s>/unit<u>/relu`` names, or a Keras
    name as given."""
    m = re.fullmatch(r"b(\d)/(\d+)/relu", name)
    if m:
        return f"conv{int(m.group(1)) + 1}_block{int(m.group(2)) + 1}_out"
    m = re.fullmatch(r"stage(\d)/unit(\d+)/relu", name)
    if m:
        return f"conv{int(m.group(1)) + 1}_block{int(m.group(2))}_out"
    return name


def _modes() -> tuple[Any, Any]:
    from tf_ipu.pipelining import PipelineSchedule, RecomputationMode

    return PipelineSchedule, RecomputationMode


def _strategy_scope(model: Any) -> Any:
    strategy = getattr(model, "_distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _stage_by_splits(model: Any, splits: Sequence[str]) -> list[int]:
    """A stage per layer call: the stage ends after each layer named in ``splits``."""
    stages, stage = [], 0
    for a in model.get_pipeline_stage_assignment():
        stages.append(stage)
        stage += a.layer.name in splits
    return stages


def _pipeline(model: Any, stages: list[int], mapping: list[int], accumulation: int,
              schedule: Any, mode: Any = None, **kwargs: Any) -> None:
    """Sets ``stages`` and the pipelining options on ``model``."""
    _, modes = _modes()
    with _strategy_scope(model):
        model.set_pipeline_stage_assignment(stages)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=accumulation,
                                     device_mapping=mapping, pipeline_schedule=schedule,
                                     recomputation_mode=mode or modes.Auto, **kwargs)


def _checkpointed(model: Any, after: Callable[[str], bool]) -> Any:
    """``model`` (functional) with a ``RecomputationCheckpoint`` on the output of every layer
    whose name ``after`` accepts; the layers (and weights) are shared, the model uncompiled."""
    import keras
    from ipu_tensorflow_addons.keras.layers import RecomputationCheckpoint

    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        out = layer(*args, **kwargs)
        if after(layer.name):
            return RecomputationCheckpoint(name=f"{layer.name}_checkpoint")(out)
        return out

    with _strategy_scope(model):
        return keras.models.clone_model(model, clone_function=lambda layer: layer,
                                        call_function=call)


def _amp(case: dict[str, Any], plan_notes: list[str],
         stage_ipus: Sequence[int] | None = None) -> Any:
    """``available_memory_proportion=`` for the case: one value for both kinds of product, a
    dict per kind, or None (PopLibs' default). A value per IPU (or per stage) that differs
    between IPUs is given per stage when the case is pipelined (``stage_ipus``: each stage's
    IPU): a list, stage s taking its IPU's value (per stage: its own), as Graphcore's TF2 BERT
    builds its ``PipelineStageOptions`` (``ipu_utils.get_poplar_options_per_pipeline_stage``,
    the list indexed by each stage's IPU) for the forward and backward passes. Without
    ``stage_ipus`` the largest is applied to every IPU, and that is named in ``plan_notes``."""
    amp = case.get("available_memory_proportion")
    if not isinstance(amp, dict):
        return None
    per_kind = {}
    for key, kind in (("convolutions", "convolution"), ("matmuls", "matmul")):
        if isinstance(amp.get(key), (int, float)):
            per_kind[kind] = float(amp[key])
    for key in ("all", "IPU0"):
        if isinstance(amp.get(key), (int, float)):
            return float(amp[key])
    for key, kind in (("per_ipu", "matmul"), ("matmul_per_ipu", "matmul"),
                      ("per_stage", None)):
        values = amp.get(key)
        if isinstance(values, list) and values:
            if len(set(values)) > 1 and stage_ipus is not None:
                by_stage = values if kind is None else [values[ipu] for ipu in stage_ipus]
                if len(by_stage) != len(stage_ipus):
                    raise ValueError(f"{case['id']}: {len(by_stage)} availableMemoryProportion "
                                     f"values for {len(stage_ipus)} stages")
                return [{**per_kind, **({"matmul": float(v), "convolution": float(v)}
                                        if kind is None else {kind: float(v)})}
                        for v in by_stage]
            top = max(float(v) for v in values)
            if len(set(values)) > 1:
                plan_notes.append(f"availableMemoryProportion per IPU {values} (one value per "
                                  f"kind here: the largest, {top}, on every IPU)")
            if kind is None:
                return top
            per_kind[kind] = top
    if not per_kind:
        return None
    if set(per_kind) == {"convolution", "matmul"} and len(set(per_kind.values())) == 1:
        return per_kind["convolution"]
    return per_kind


def _describe(plan: Plan, case: dict[str, Any]) -> str:
    """One line: what the estimate was asked (from its arguments and the model's pipeline)."""
    from tf_ipu import pipelining

    o = plan.options
    parts = [f"{'train' if plan.training else 'infer'} {plan.policy} mb {plan.batch}",
             f"{o.get('ipu_version')}"]
    if o.get("replicas", 1) > 1:
        parts.append(f"x{o['replicas']} replicas" + (f" ({o['system']})" if o.get("system") else ""))
    if o.get("tiles_per_ipu"):
        parts.append(f"{o['tiles_per_ipu']} tiles")
    pipe = pipelining.plan(plan.model, 1)
    if pipe is not None:
        opts = pipelining.pipelining_options(plan.model)
        parts.append(f"{pipe['stages']} stages on IPUs {pipe['stage_ipus']} {pipe['schedule']} "
                     f"{opts.get('recomputation_mode').name}, {pipe['micro_batches']} micro-batches")
        if pipe.get("offload") is not None or pipe.get("sharding"):
            parts.append(f"offload {pipe.get('offload')} sharding {pipe.get('sharding')}")
    elif o.get("gradient_accumulation_steps_per_replica", 1) > 1:
        parts.append(f"{o['gradient_accumulation_steps_per_replica']} micro-batches")
    if o.get("recomputation"):
        parts.append("recomputation")
    amp = o.get("available_memory_proportion")
    if isinstance(amp, list):  # per stage (its IPU's value), forward and backward
        parts.append("AMP per stage " + ", ".join(
            "/".join(f"{v:g}" for v in a.values()) if isinstance(a, dict) else f"{a}"
            for a in amp))
    elif amp is not None:
        parts.append(f"AMP {amp}")
    return ", ".join(parts)


# -- builders ------------------------------------------------------------------------------


def _resnet_plain(eight_bit: bool) -> Any:
    """keras.applications ResNet-50 (weights None) without a pipeline; with ``eight_bit`` its
    images arrive as uint8 and are scaled on the IPU (eight_bit_io); under a float16 policy
    its batch norms keep FP16 activations in FP16 (``tf_ipu.models.HalfBatchNormalization``)."""
    import keras

    import tf_ipu
    from tf_ipu.models import half_batch_norm

    with tf_ipu.IPUStrategy().scope():
        if not eight_bit:
            model = keras.applications.ResNet50(weights=None)
        else:
            images = keras.Input((224, 224, 3), dtype="uint8", name="images")
            x = keras.layers.Rescaling(1 / 255.0)(images)
            net = keras.applications.ResNet50(weights=None, input_tensor=x)
            model = keras.Model(images, net.output, name="resnet50_8bit")
        if keras.mixed_precision.global_policy().compute_dtype == "float16":
            model = half_batch_norm(model)  # Graphcore's fused batch norm on FP16 activations
        return model


def _compile_sgd(model: Any, momentum: float) -> None:
    import keras

    with _strategy_scope(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=momentum),
                      loss="sparse_categorical_crossentropy")


def _resnet_pipelined(case: dict[str, Any]) -> Plan:
    """The MLPerf-style ResNet-50 pipelines (TF1 and the TF2 port): bench_mlperf's builder,
    its stages set from the case's splits and device mapping."""
    from bench.bench_mlperf import _resnet50

    schedules, modes = _modes()
    pipe, notes = case["pipeline"], []
    accumulation = int(case["gradient_accumulation"])
    lars = "LARS" in str(case["optimizer"])
    model = _resnet50(accumulation, "lars" if lars else "momentum")
    splits = [_keras_split(s) for s in pipe["pipeline_splits"]]
    stages = _stage_by_splits(model, splits)
    count = max(stages) + 1
    mapping = pipe.get("device_mapping")
    mapping = list(mapping) if isinstance(mapping, list) else list(range(count))
    schedule = schedules[str(pipe.get("pipeline_schedule") or pipe.get("schedule")).split()[0]]
    offload = case.get("offload") or {}
    no_offload = offload.get("disable_variable_offloading") or \
        offload.get("optimizer-state-offloading") is False
    _pipeline(model, stages, mapping, accumulation, schedule,
              offload_weight_update_variables=False if no_offload else None)
    replicas = int(case["replicas"])
    options = {"ipu_version": case["ipu"], "replicas": replicas,
               "system": _SYSTEM16[case["ipu"]] if replicas * case["ipus_per_replica"] == 16 else None,
               "recomputation": bool(case["recomputation"]["enabled"]),
               "available_memory_proportion": _amp(case, notes)}
    target = (case.get("other_options") or {}).get("internal_exchange_optimisation_target") or \
        (case.get("other_options") or {}).get("internal-exchange-optimization-target")
    if target:
        notes.append(f"internal exchange optimisation target '{target}' (not modelled)")
    return Plan(model, int(case["micro_batch"]), True, options, "float16",
                expressed=["8-bit images (uint8 input)", f"splits -> {splits}"]
                + (["LARS (tf_ipu.optimizers.LARS: momentum, per-layer norms)"] if lars else []),
                unexpressed=notes)


def _resnet_flat(case: dict[str, Any]) -> Plan:
    """ResNet-50 without a pipeline: inference, TF1's single-IPU training, and PopTorch's
    replicated training with manual recomputation checkpoints (a one-stage pipeline here,
    Graphcore's TF2 way of checkpointing one IPU's program)."""
    schedules, modes = _modes()
    other = case.get("other_options") or {}
    eight_bit = bool(other.get("eight_bit_io") or other.get("eight-bit-transfer"))
    notes: list[str] = []
    model = _resnet_plain(eight_bit)
    options: dict[str, Any] = {"ipu_version": case["ipu"], "replicas": int(case["replicas"]),
                               "available_memory_proportion": _amp(case, notes)}
    io_tiles = other.get("num_io_tiles")
    if io_tiles:
        options["tiles_per_ipu"] = _TILES[case["ipu"]] - int(io_tiles)
    expressed = ["8-bit images (uint8 input)"] if eight_bit else []
    if io_tiles:
        expressed.append(f"{io_tiles} I/O tiles reserved (fewer compute tiles)")
    if case["training"]:
        recompute = case.get("recomputation") or {}
        checkpoints = recompute.get("checkpoints")
        if isinstance(checkpoints, list):  # PopTorch manual recomputation
            names = _poptorch_resnet_checkpoints(checkpoints)
            base = model
            model = _checkpointed(base, lambda n: n in names)
            _compile_sgd(model, 0.9)
            accumulation = int(case["gradient_accumulation"])
            _pipeline(model, [0] * len(model.get_pipeline_stage_assignment()), [0], accumulation,
                      schedules.Grouped, modes.RecomputeAndBackpropagateInterleaved,
                      offload_weight_update_variables=False)
            options["recomputation"] = True
            options["system"] = _SYSTEM16[case["ipu"]] if options["replicas"] == 16 else None
            expressed.append(f"{len(names)} recomputation checkpoints (a one-stage pipeline)")
        else:
            optimizer = str(case.get("optimizer"))
            momentum = 0.9 if "momentum" in optimizer else 0.0
            _compile_sgd(model, momentum)
            if "not set" in optimizer:
                notes.append("optimizer not recorded (application default): plain SGD here")
            options["recomputation"] = bool(recompute.get("enabled"))
    return Plan(model, int(case["micro_batch"]), bool(case["training"]), options,
                _policy_of(case), expressed=expressed, unexpressed=notes)


def _poptorch_resnet_checkpoints(published: Sequence[str]) -> set[str]:
    """PopTorch's traced names as Keras ResNet-50 layers: ``add``/``add_k`` the k-th residual
    add (0-based over the 16 bottlenecks), ``layer4/b/convN``/``bnN``/``downsample`` the
    conv5_x block's convolutions and batch norms, ``avgpool`` and ``fc``."""
    blocks = [(stage, b) for stage, count in zip((2, 3, 4, 5), (3, 4, 6, 3), strict=True)
              for b in range(1, count + 1)]
    out = set()
    for name in published:
        m = re.fullmatch(r"add(?:_(\d+))?", name)
        if m:
            stage, b = blocks[int(m.group(1) or 0)]
            out.add(f"conv{stage}_block{b}_add")
            continue
        m = re.fullmatch(r"layer4/(\d)/(conv|bn)(\d)", name)
        if m:
            out.add(f"conv5_block{int(m.group(1)) + 1}_{m.group(3)}_{m.group(2)}")
            continue
        m = re.fullmatch(r"layer4/(\d)/downsample[_/](\d)", name)
        if m:
            out.add(f"conv5_block{int(m.group(1)) + 1}_0_{'conv' if m.group(2) == '0' else 'bn'}")
            continue
        out.add({"avgpool": "avg_pool", "fc": "predictions"}[name])
    return out


def _efficientnet_b0(case: dict[str, Any]) -> Plan:
    """keras.applications EfficientNet-B0 inference at 224x224, 8-bit images, I/O tiles."""
    import keras

    import tf_ipu

    other = case.get("other_options") or {}
    with tf_ipu.IPUStrategy().scope():
        images = keras.Input((224, 224, 3), dtype="uint8", name="images")
        x = keras.layers.Rescaling(1.0)(images)  # the network's own preprocessing follows
        net = keras.applications.EfficientNetB0(weights=None, input_tensor=x)
        model = keras.Model(images, net.output, name="efficientnet_b0_8bit")
    options = {"ipu_version": case["ipu"], "replicas": int(case["replicas"]),
               "tiles_per_ipu": _TILES[case["ipu"]] - int(other.get("num_io_tiles", 0))}
    return Plan(model, int(case["micro_batch"]), False, options, _policy_of(case),
                expressed=["8-bit images (uint8 input)", f"{other.get('num_io_tiles')} I/O tiles"],
                unexpressed=[])


def _resnext(case: dict[str, Any]) -> Plan:
    """The tech note's ResNeXt-50 32x4d, FP32 inference, one availableMemoryProportion for
    convolutions and matmuls (setAvailableMemoryProportion({'IPU0': p}))."""
    from tf_ipu.models.resnext import resnext

    notes: list[str] = []
    model = resnext(depth=50, cardinality=32, width=4)
    options = {"ipu_version": case["ipu"], "available_memory_proportion": _amp(case, notes)}
    return Plan(model, int(case["micro_batch"]), False, options, "float32", unexpressed=notes)


def _lstm_tutorial(case: dict[str, Any]) -> Plan:
    """Graphcore's recomputation tutorial as bench/fit_cases.md mirrors it
    (``tf_ipu.models.recompute_lstm``): one PopnnLSTM over ``checkpoints + 1`` slices of the
    sequence (each slice starting from the previous one's state, which is checkpointed), stage 0
    on IPU 0; Dense(1) as stage 1 on IPU 0; Sequential, RecomputeAndBackpropagateInterleaved,
    4 micro-batches; SGD, mse; FP32."""
    import tensorflow as tf

    from tf_ipu.models.recompute_lstm import recompute_lstm

    other = case["other_options"]
    seq, units, features = int(other["sequence_length"]), int(other["lstm_units"]), \
        int(other["input_features"])
    found = re.search(r"(\d+) RecomputationCheckpoint|(\d+) checkpoint|checkpoints (\d+)",
                      json.dumps(case["recomputation"]["checkpoints"]))
    checkpoints = 0 if "none" in str(case["recomputation"]["checkpoints"]) else \
        int(next(g for g in found.groups() if g))
    model = recompute_lstm(seq, checkpoints, units=units, features=features,
                           gradient_accumulation=int(case["gradient_accumulation"]))
    options = {"ipu_version": case["ipu"], "recomputation": True,
               "label_spec": tf.TensorSpec([None, seq], tf.float32)}
    return Plan(model, int(case["micro_batch"]), True, options, "float32",
                expressed=[f"{checkpoints} RecomputationCheckpoint(s), PopnnLSTM -> keras LSTM "
                          "(its sequences laid out and its backward sized as PopLibs' kernel)"])


# BERT ------------------------------------------------------------------------------------


def _block_stages(placement: Sequence[Any], start: int, layers: int) -> tuple[list[int], list[int],
                                                                               list[int]]:
    """Per encoder layer, the stage of its attention and of its feed-forward block, and each
    stage's IPU: ``placement`` is whole layers per stage from stage ``start`` (stage i on IPU
    i; the embedding in stage 0 on IPU 0). Raises ValueError if it does not place ``layers``."""
    att: list[int] = []
    ipus = list(range(start))
    for stage, count in enumerate(placement, start):
        att += [stage] * int(count)
        ipus.append(stage)
    if len(att) != layers:
        raise ValueError(f"placement {placement} places {len(att)} layers, not {layers}")
    return att, list(att), ipus


def _bert_layer_stages(names: Sequence[str], att: list[int], ffn: list[int], head: int) -> list[int]:
    """A stage per layer call of tf_ipu.models.bert's classifier (checkpoints included): the
    embedding in stage 0, each block in its own, the pooler and classifier in ``head``."""
    stages = []
    for name in names:
        m = re.match(r"layer_(\d+)_(attention|intermediate|output)", name)
        if m:
            stages.append((att if m.group(2) == "attention" else ffn)[int(m.group(1))])
        elif name.startswith(("token_", "position_", "embedding", "input")):
            stages.append(0)
        else:
            stages.append(head)
    return stages


def _mlm_note(case: dict[str, Any], vocab: int, micro: int) -> str:
    other = case.get("other_options") or {}
    masked = other.get("mask_tokens") or other.get("max_predictions_per_seq")
    logits = micro * int(masked) * vocab * 2
    return (f"masked-LM head over {masked} tokens (a 2-class head here): its FP16 logits alone "
            f"are {logits:,} B per micro-batch on the head's IPU")


def _mlperf_placement(pipe: dict[str, Any]) -> str:
    """The submission's placement in the words of bench_mlperf's ``_bert``."""
    if "att_ffn_placement" in pipe:
        return "att_ffn_placement " + json.dumps(pipe["att_ffn_placement"])
    return "layers_per_ipu " + json.dumps(pipe["layers_per_ipu"])


def _bert_mlperf(case: dict[str, Any]) -> Plan:
    """The MLPerf BERT-Large phase-2 rounds: bench_mlperf's builder as it builds each
    submission (sequence 512, the published placement and checkpoints, vocab, FP16 attention
    probabilities, LAMB, no dropout, a 2-class head), with the case's optimizer-state location
    and sharding; v2.0's unexpressible options sized on the fullest tile after the estimate."""
    from bench import bench_mlperf

    pipe, notes = case["pipeline"], []
    accumulation = int(case["gradient_accumulation"])
    offload = bool(case["offload"]["optimizer_state_offchip"])
    sharding = bool(case["offload"]["replicated_tensor_sharding"])
    vocab = int(re.search(r"vocab_length (\d+)", case["model"]).group(1))
    placement = _mlperf_placement(pipe)
    ipus = bench_mlperf._bert_layout(placement).ipus
    if ipus != pipe["device_mapping"]:
        raise ValueError(f"{case['id']}: stages on IPUs {ipus}, published {pipe['device_mapping']}")
    # tf_ipu shards only offloaded optimizer state: on-chip sharding (v2.0) is sized below.
    model = bench_mlperf._bert(placement, accumulation, offload, vocab=vocab,
                               sharding=sharding and offload, checkpoints=True)
    micro, replicas = int(case["micro_batch"]), int(case["replicas"])
    other = case.get("other_options") or {}
    notes += [_mlm_note(case, vocab, micro),
              f"packing's attention mask ({other.get('max_sequences_per_pack')} sequences per row)"]
    if other.get("embedding_serialization_vocab_steps"):
        notes.append(f"embedding serialized in {other['embedding_serialization_vocab_steps']} "
                     f"vocabulary steps")
    if "optimizer_state" in case["precision"]:
        notes.append(f"optimizer state {case['precision']['optimizer_state']} (the float16 "
                     f"policy's FP16 here)")
    options = {"ipu_version": case["ipu"], "replicas": replicas,
               "system": _SYSTEM16[case["ipu"]], "recomputation": True,
               "available_memory_proportion": _amp(case, notes, ipus)}
    capture, after, accounting = None, None, None
    if "activation_checkpoints" in case["precision"] or (sharding and not offload):
        capture = bench_mlperf._checkpoint_stash

        def accounting(est: Any, found: Any) -> dict[str, Any]:
            saved = bench_mlperf._unexpressed(est, found, replicas)
            options = {}
            if "activation_checkpoints" in case["precision"]:
                options["FP8 activation checkpoints"] = saved["fp8"]
            if sharding and not offload:
                options["optimizer state sharded on chip"] = saved["sharding"]
            return {"options": options}

        def after(est: Any, found: Any) -> list[str]:
            saved = bench_mlperf._unexpressed(est, found, replicas)
            step = getattr(est, "step", est)
            over = max(0, est.peak_tile_bytes - step.tile_bytes_limit)
            out = []
            if "activation_checkpoints" in case["precision"]:
                out.append(f"FP8 activation checkpoints (1 B/element): would save {saved['fp8']:,} B "
                           f"on the fullest tile (half its stashed FP16 checkpoints)")
            if sharding and not offload:
                out.append(f"optimizer state sharded on chip over the {replicas} replicas "
                           f"(tf_ipu shards only offloaded state): would save "
                           f"{saved['sharding']:,} B on the fullest tile")
            out.append(f"together {saved['fp8'] + saved['sharding']:,} B against {over:,} B over")
            return out

    return Plan(model, micro, True, options, "float16",
                expressed=[placement, f"stages on IPUs {ipus}", "the submission's checkpoints",
                           f"vocab {vocab}", "FP16 attention probabilities",
                           f"offload {offload}, sharding {sharding and offload}"],
                unexpressed=notes, capture=capture, after=after, accounting=accounting)


def _bert_examples(case: dict[str, Any]) -> Plan:
    """Graphcore's TF2 and PopTorch BERT pretraining configurations: tf_ipu.models.bert (FP16
    attention probabilities as their FP16 models keep them, no dropout, a 2-class head), LAMB,
    FP16, a checkpoint after every encoder layer, placed as published (the heads in a last
    stage on IPU 0), optimizer state where the application puts it."""
    import keras

    import tf_ipu
    from tf_ipu.models.bert import bert_classifier, bert_encoder

    schedules, modes = _modes()
    pipe, notes = case["pipeline"], []
    desc = case["model"]
    layers, hidden, heads = (int(x) for x in re.search(
        r"(\d+) layers x hidden (\d+), (\d+) heads", desc).groups())
    vocab = int(re.search(r"vocab (\d+)", desc).group(1))
    other = case["other_options"]
    seq = int(other.get("max_seq_length") or other.get("sequence_length"))
    if "pipeline_stages" in pipe:  # TF2: the stages' contents as published
        if pipe["pipeline_stages"][0][0] != "emb" or "heads" not in pipe["pipeline_stages"][-1]:
            raise ValueError(f"{case['id']}: not the embedding first and the heads last")
        per_stage = [sum(x == "hid" for x in s) for s in pipe["pipeline_stages"][:-1]]
        published = list(pipe["pipeline_device_mapping"])
    else:  # PopTorch layers_per_ipu: the embedding on IPU 0, the heads back there
        per_stage, published = list(pipe["layers_per_ipu"]), None
    att, ffn, ipus = _block_stages(per_stage, 0, layers)
    ipus.append(0)
    if published is not None and ipus != published:
        raise ValueError(f"{case['id']}: stages on IPUs {ipus}, published {published}")
    accumulation = int(case["gradient_accumulation"])
    offload = str(case["offload"].get("optimizer_state_offchip", "")).startswith("True")
    sharding = bool(case["offload"].get("replicated_tensor_sharding"))
    with tf_ipu.IPUStrategy().scope():
        model = bert_classifier(bert_encoder(layers=layers, hidden=hidden, heads=heads,
                                             seq_len=seq, vocab=vocab, dropout=0.0,
                                             softmax_in_compute_dtype=True,
                                             checkpoints="every_layer"), classes=2)
        model.compile(optimizer=keras.optimizers.Lamb(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    names = [a.layer.name for a in model.get_pipeline_stage_assignment()]
    _pipeline(model, _bert_layer_stages(names, att, ffn, len(ipus) - 1), ipus, accumulation,
              schedules.Grouped, modes.RecomputeAndBackpropagateInterleaved,
              offload_weight_update_variables=offload,
              replicated_optimizer_state_sharding=sharding)
    micro = int(case["micro_batch"])
    notes += [_mlm_note(case, vocab, micro)]
    if other.get("hidden_dropout_prob"):
        notes.append(f"hidden dropout {other['hidden_dropout_prob']} (its masks; the builder has "
                     "one rate for every dropout, 0 here since attention dropout is 0)")
    if other.get("embedding_serialization_factor"):
        notes.append(f"embedding serialization x{other['embedding_serialization_factor']}")
    options = {"ipu_version": case["ipu"], "replicas": int(case["replicas"]),
               "system": _SYSTEM16[case["ipu"]], "recomputation": True,
               "available_memory_proportion": _amp(case, notes, ipus)}
    return Plan(model, micro, True, options, "float16",
                expressed=[f"{layers}x{hidden} seq {seq} vocab {vocab}",
                           f"stages on IPUs {ipus}", "a checkpoint after every encoder layer",
                           "FP16 attention probabilities", f"offload {offload}, sharding {sharding}"],
                unexpressed=notes)


# U-Net, ViT, GPT-2, EfficientNet-GN and the Poplar tutorial's matmuls -------------------------


def _on_chip_sharding_note(replicas: int) -> tuple[Callable[[], Any], Callable[[Any, Any], list[str]]]:
    """``Plan.capture`` / ``Plan.after`` sizing replicated tensor sharding of on-chip optimizer
    state (PopTorch's ``useReplicatedTensorSharding`` with on-chip storage; tf_ipu shards only
    offloaded state) on the fullest tile, as for the MLPerf v2.0 BERT."""
    from bench import bench_mlperf

    def after(est: Any, found: Any) -> list[str]:
        saved = bench_mlperf._unexpressed(est, found, replicas)["sharding"]
        return [f"optimizer state sharded on chip over the {replicas} replicas (tf_ipu shards only "
                f"offloaded state): would save {saved:,} B on the fullest tile"]

    return bench_mlperf._checkpoint_stash, after


def _unet_case(case: dict[str, Any]) -> Plan:
    """Graphcore's TF2 U-Net (``tf_ipu.models.unet``: 572x572x1, central-crop skips, 2 classes,
    dropout 0.5, FP16 as ``set_floatx('float16')``): training as a 4-stage pipeline on 4 IPUs
    split as ``set_pipeline_stages`` splits it (Grouped, RecomputationMode.Auto, no offload,
    SGD momentum 0.99, the dice + cross-entropy loss), or inference on one IPU."""
    import keras

    import tf_ipu
    from tf_ipu.models.unet import dice_ce_loss, unet, unet_pipeline_stages

    schedules, modes = _modes()
    notes: list[str] = []
    training = bool(case["training"])
    with tf_ipu.IPUStrategy().scope():
        model = unet(dropout=0.5)
        if training:
            model.compile(optimizer=keras.optimizers.SGD(0.0024, momentum=0.99), loss=dice_ce_loss)
    # Training: 4 stages, stage i on IPU i (set_pipeline_stages; its options per stage).
    options: dict[str, Any] = {"ipu_version": case["ipu"], "replicas": int(case["replicas"]),
                               "available_memory_proportion": _amp(case, notes, [0, 1, 2, 3]
                                                                   if training else None)}
    expressed = ["572x572x1 U-Net, valid convolutions, central-crop skips (Cropping2D)",
                 "FP16 weights and activations (float16 policy)"]
    if training:
        stages = unet_pipeline_stages(model)
        _pipeline(model, stages, [0, 1, 2, 3], int(case["gradient_accumulation"]),
                  schedules.Grouped, modes.Auto, offload_weight_update_variables=False)
        options["recomputation"] = bool(case["recomputation"]["enabled"])
        expressed += ["4 stages split as set_pipeline_stages (crops forced to stages 0, 0, 1)",
                      "Grouped, RecomputationMode.Auto, allow_recompute",
                      "SGD momentum 0.99, dice + cross-entropy in FP32"]
        notes += ["static loss scale 128 (a scalar)",
                  "internal exchange optimisation target 'balanced' (not modelled)"]
    else:
        notes.append("4 copies of the program (mpirun --np 4), one IPU each: one is estimated")
    return Plan(model, int(case["micro_batch"]), training, options, "float16",
                expressed=expressed, unexpressed=notes)


def _vit_case(case: dict[str, Any]) -> Plan:
    """Graphcore's PopTorch ViT-B/16 fine-tuning (``tf_ipu.models.vit``): Hugging Face's
    ViTForImageClassification at 224x224, FP16 (attention softmax too), hidden dropout 0.1,
    one stage per IPU from ``layers_per_ipu``, a checkpoint after every encoder layer, SGD
    with momentum, optimizer state on chip."""
    import keras

    import tf_ipu
    from tf_ipu.models.vit import vit, vit_pipeline_stages

    schedules, modes = _modes()
    other, pipe, notes = case["other_options"], case["pipeline"], []
    replicas = int(case["replicas"])
    with tf_ipu.IPUStrategy().scope():
        model = vit(dropout=float(other["hidden_dropout_prob"]),
                    attention_dropout=float(other["attention_probs_dropout_prob"]),
                    checkpoints="every_layer")
        model.compile(optimizer=keras.optimizers.SGD(0.08, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    per_ipu = list(pipe["layers_per_ipu"])
    stages = vit_pipeline_stages(model, per_ipu)
    _pipeline(model, stages, list(range(len(per_ipu))), int(case["gradient_accumulation"]),
              schedules.Grouped, modes.RecomputeAndBackpropagateInterleaved,
              offload_weight_update_variables=False)
    options = {"ipu_version": case["ipu"], "replicas": replicas, "system": _SYSTEM16[case["ipu"]],
               "recomputation": True, "available_memory_proportion": _amp(case, notes)}
    notes += ["recompute_mid_layers [1, 4, 7, 10]: read only by the pre-training model "
              "(models/modules.py Block), not by the fine-tuned Hugging Face model: none here",
              "loss scaling 0.25, stochastic rounding (no memory)"]
    capture, after = _on_chip_sharding_note(replicas)
    return Plan(model, int(case["micro_batch"]), True, options, "float16",
                expressed=["ViT-B/16 224x224, 1000 classes", f"layers_per_ipu {per_ipu}, a stage "
                           "per IPU", "a checkpoint after every encoder layer",
                           "FP16 attention probabilities", "SGD momentum (FP16 first order)",
                           "hidden dropout 0.1"],
                unexpressed=notes, capture=capture, after=after)


#: GPT-2 sizes (``config/config.json``, ``config_medium.json`` of Graphcore's application).
_GPT2 = {"small": (12, 768, 12), "medium": (24, 1024, 16)}


def _gpt2_case(case: dict[str, Any]) -> Plan:
    """Graphcore's PopTorch GPT-2 (``tf_ipu.models.gpt2``, vocabulary 50272, FP16 with FP16
    attention probabilities, tied LM head): training pipelined with a stage per BeginBlock
    (``AutoStage.AutoIncrement``: wte, wpe, each decoder layer, the LM head; IPUs from
    ``layers_per_ipu``), consecutive blocks on one IPU merged into one stage as PopTorch
    merges them (``merge_consecutive_stages``), a checkpoint after every layer, the loss serialized over 128-token
    chunks in FP16, AdamW with its state offloaded and sharded; or inference
    (``ShardedExecution``: the same stages one after another, the Sequential schedule)."""
    import keras
    import tensorflow as tf

    import tf_ipu
    from tf_ipu.models.gpt2 import gpt2, gpt2_pipeline_stages, lm_loss, merge_consecutive_stages

    schedules, modes = _modes()
    other, pipe, notes = case["other_options"], case["pipeline"], []
    layers, hidden, heads = _GPT2["medium" if "medium" in case["id"] else "small"]
    seq, training, replicas = int(other["max_len"]), bool(case["training"]), int(case["replicas"])
    with tf_ipu.IPUStrategy().scope():
        model = gpt2(layers, hidden, heads, seq, vocab=50272,
                     checkpoints="every_layer" if training else None)
        if training:
            model.compile(optimizer=keras.optimizers.AdamW(1.5e-4),
                          loss=lm_loss(serialized_seq_len=128, dtype="float16"))
    stages, ipus = gpt2_pipeline_stages(model, pipe["layers_per_ipu"])
    if training:  # PipelinedExecution: one stage per change of IPU
        stages, ipus = merge_consecutive_stages(stages, ipus)
    offload = str(case["offload"].get("optimizer_state_offchip", "")).startswith("True")
    sharding = bool(case["offload"].get("replicated_tensor_sharding"))
    if training:
        _pipeline(model, stages, ipus, int(case["gradient_accumulation"]), schedules.Grouped,
                  modes.RecomputeAndBackpropagateInterleaved,
                  offload_weight_update_variables=offload,
                  replicated_optimizer_state_sharding=sharding and offload)
    else:
        _pipeline(model, stages, ipus, 1, schedules.Sequential)
    options = {"ipu_version": case["ipu"], "replicas": replicas,
               "system": _SYSTEM16[case["ipu"]] if replicas * case["ipus_per_replica"] == 16 else None,
               "recomputation": training, "available_memory_proportion": _amp(case, notes, ipus),
               "label_spec": tf.TensorSpec([None, seq], tf.int32)}
    logits = seq * 50272 * 2
    notes += [f"LM head serialized x{other['embedding_serialization_factor']} over its output "
              f"channels (one matmul here; the FP16 logits are {logits:,} B per micro-batch "
              f"on IPU 0 either way)"]
    if other.get("remap_logit"):
        notes.append("RemapCE custom op on each logit chunk (a layout change; not modelled)")
    expressed = [f"GPT-2 {layers}x{hidden}, {heads} heads, sequence {seq}, vocab 50272, tied LM head",
                 f"layers_per_ipu {pipe['layers_per_ipu']}: {max(stages) + 1} stages on IPUs {ipus}",
                 "FP16 attention probabilities"]
    if training:
        expressed += ["a checkpoint after every decoder layer", "dropout 0.1",
                      "loss serialized over 128-token chunks, in FP16",
                      f"AdamW, offload {offload}, sharding {sharding and offload}"]
    else:
        expressed.append("ShardedExecution as the Sequential schedule, one micro-batch")
    return Plan(model, int(case["micro_batch"]), training, options, "float16",
                expressed=expressed, unexpressed=notes)


def _efficientnet_gn_case(case: dict[str, Any]) -> Plan:
    """Graphcore's PopTorch EfficientNet-B4-G16-GN training (``tf_ipu.models.efficientnet_gn``,
    380x380, 8-bit images normalized on the IPU, FP16): two stages split at
    ``blocks/3/0/bn2``, checkpoints after the residual adds ``add_1`` and ``add_3``,
    RMSprop with momentum (state on chip)."""
    import keras

    import tf_ipu
    from tf_ipu.models.efficientnet_gn import efficientnet_gn

    schedules, modes = _modes()
    pipe, notes = case["pipeline"], []
    replicas = int(case["replicas"])
    checkpoints = [0 if c == "add" else int(c.split("_")[1]) for c in case["recomputation"]["checkpoints"]]
    split = pipe["pipeline_splits"][0]  # the first layer of stage 1 (PopTorch BeginBlock)
    m = re.fullmatch(r"blocks/(\d+)/(\d+)/(\w+)", split)
    first = f"blocks_{m.group(1)}_{m.group(2)}_{m.group(3)}"
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the application's ImageNet ones
    with tf_ipu.IPUStrategy().scope():
        scale = [keras.layers.Rescaling(1 / 255.0, name="to_unit"),
                 keras.layers.Normalization(mean=mean, variance=[s * s for s in std], name="normalize")]
        model = efficientnet_gn("b4", checkpoints=checkpoints, input_layers=scale,
                                input_dtype="uint8")
        model.compile(optimizer=keras.optimizers.RMSprop(0.1, rho=0.953125, momentum=0.9,
                                                         epsilon=1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    names = [a.layer.name for a in model.get_pipeline_stage_assignment()]
    stages = [int(i >= names.index(first)) for i in range(len(names))]
    _pipeline(model, stages, [0, 1], int(case["gradient_accumulation"]), schedules.Grouped,
              modes.RecomputeAndBackpropagateInterleaved, offload_weight_update_variables=False)
    options = {"ipu_version": case["ipu"], "replicas": replicas, "system": _SYSTEM16[case["ipu"]],
               "recomputation": True, "available_memory_proportion": _amp(case, notes)}
    notes += ["exchange memory target 'memory' (not modelled)",
              "mixup / cutmix on the IPU, label smoothing 0.1 (no large tensors)",
              "group norm: PopLibs' strided channel grouping (enable_fast_groupnorm) groups other "
              "channels than HalfGroupNormalization's contiguous groups (same sizes)"]
    capture, after = _on_chip_sharding_note(replicas)
    return Plan(model, int(case["micro_batch"]), True, options, "float16",
                expressed=["EfficientNet-B4 380x380, expand 4, group dim 16, GroupNorm(4)",
                           "group norms on FP16 activations with FP32 statistics (HalfGroupNormalization)",
                           "8-bit images (uint8 input), normalized on the IPU",
                           f"stage 1 from {first}", f"checkpoints after residual adds {checkpoints}",
                           "RMSprop with momentum (two slots), offload False"],
                unexpressed=notes, capture=capture, after=after)


def _poplar_tut4(case: dict[str, Any]) -> Plan:
    """The Poplar profiling tutorial's enlarged program as TensorFlow: three FP32 variables of
    its shapes (m1 [9000, 7500], m2 [7500, 300], m3 [300, 200]) and ``(m1 m2) m3``, inference
    on one IPU2 (the tutorial's profile shows a 1472-tile target), with the variables mapped
    as the C++ program maps them: ``variable_mapping="linear"`` (``poputil::mapTensorLinearly``;
    poplin then copies an operand into its matmul's layout where its rules say so,
    docs/tile_model.md "Memory per tile")."""
    import keras
    from keras import ops

    shapes = {"m1": (9000, 7500), "m2": (7500, 300), "m3": (300, 200)}

    class Tut4(keras.layers.Layer):
        """Three variables and two matmuls; the input (one number) only makes it a model."""

        def build(self, input_shape: Any) -> None:
            self.m = {k: self.add_weight(shape=s, initializer="zeros", name=k, dtype="float32")
                      for k, s in shapes.items()}

        def call(self, x: Any) -> Any:
            return ops.matmul(ops.matmul(self.m["m1"], self.m["m2"]), self.m["m3"])

        def compute_output_shape(self, input_shape: Any) -> tuple[int, int]:
            return (shapes["m1"][0], shapes["m3"][1])

    import tf_ipu

    with tf_ipu.IPUStrategy().scope():
        x = keras.Input((1,), name="unused")
        model = keras.Model(x, Tut4(name="tut4")(x), name="poplar_tut4")
    return Plan(model, 1, False, {"ipu_version": case["ipu"], "variable_mapping": "linear"}, "float32",
                expressed=["FP32 variables m1, m2, m3 of the tutorial's shapes", "m5 = (m1 m2) m3",
                           "variables mapped linearly (variable_mapping='linear')"],
                unexpressed=["memory gaps (reserved banks, which the tutorial says can push a "
                             "program out of memory) are not modelled"], capture=None)


def _builder(case: dict[str, Any]) -> Callable[[dict[str, Any]], Plan] | None:
    """The builder of a case (None: not built, NOT_BUILT says why)."""
    cid = case["id"]
    if cid in NOT_BUILT:
        return None
    if cid.startswith("tutorial-tf2-recompute-lstm"):
        return _lstm_tutorial
    if cid.startswith("technote-available-memory-resnext50"):
        return _resnext
    if "bert" in cid:
        return _bert_mlperf if case["group"] == "mlperf" else _bert_examples
    if "efficientnet-b0" in cid:
        return _efficientnet_b0
    if "unet" in cid:
        return _unet_case
    if "vit-b16" in cid:
        return _vit_case
    if "gpt2" in cid:
        return _gpt2_case
    if "efficientnet-b4-g16-gn" in cid:
        return _efficientnet_gn_case
    if cid == "documented-oom-poplar-tut4-matmul-9000x7500":
        return _poplar_tut4
    if "resnet50" in cid:
        pipe = case.get("pipeline") or {}
        return _resnet_pipelined if pipe.get("pipeline_splits") else _resnet_flat
    return None


# -- estimating and scoring ----------------------------------------------------------------


def _verdict(est: Any) -> str:
    if est.fits is None:
        return "unknown"
    if est.fits:
        return "fits"
    return "within margin" if est.within_margin else "out of memory"


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Builds and estimates one case: its row (never raises; an error is recorded)."""
    import tf_ipu  # noqa: F401  (imported before the builders run, as they expect)

    published = case["published_verdict"]["verdict"]
    row: dict[str, Any] = {"id": case["id"], "group": case["group"],
                           "framework": case["framework"], "published": published,
                           "built": False, "verdict": "not built", "right": None}
    build = _builder(case)
    if build is None:
        row["reason"] = NOT_BUILT.get(case["id"], "no builder")
        return row
    t0 = time.perf_counter()
    try:
        with _policy(_policy_of(case)):
            plan = build(case)
            row["build_seconds"] = round(time.perf_counter() - t0, 1)
            options = dict(plan.options)
            if plan.training and not _is_pipelined(plan.model):
                acc = case.get("gradient_accumulation")
                if isinstance(acc, int) and acc > 1:
                    options["gradient_accumulation_steps_per_replica"] = acc
            if _half_partials(case):
                options["partials_type"] = "half"
            options = {k: v for k, v in options.items() if v is not None}
            t1 = time.perf_counter()
            est, found, shared = _estimate(plan, options)
            if shared:
                row["estimated_by"] = ("bench_mlperf, earlier in this process (the same model "
                                       "and options)")
            row["seconds"] = round(time.perf_counter() - t1, 1)
        step = getattr(est, "step", est)
        capacity = int(step.tile_bytes_limit)
        unexpressed = list(plan.unexpressed) + (plan.after(est, found) if plan.after else [])
        if plan.accounting is not None:
            saved = plan.accounting(est, found)
            row["accounting"] = {
                "options": {k: int(v) for k, v in saved["options"].items()},
                "saved_bytes": int(sum(saved["options"].values())),
                "over_bytes": max(0, int(est.peak_tile_bytes) - int(step.tile_bytes_limit)),
                "peak_tile": int(est.peak_tile), "peak_ipu": int(getattr(step, "peak_ipu", 0))}
        row.update({
            "built": True, "configuration": _describe(Plan(plan.model, plan.batch, plan.training,
                                                           options, plan.policy), case),
            "expressed": plan.expressed + ([_HALF_PARTIALS] if _half_partials(case) else []),
            "unexpressed": unexpressed,
            "peak_tile_bytes": int(est.peak_tile_bytes), "capacity_bytes": capacity,
            "headroom_bytes": capacity - int(est.peak_tile_bytes),
            "margin_bytes": int(step.margin_bytes), "fits": est.fits,
            "within_margin": bool(est.within_margin), "verdict": _verdict(est),
            "peak_ipu": int(getattr(step, "peak_ipu", 0)), "peak_tile": int(est.peak_tile),
        })
        row["right"] = None if est.fits is None else (est.fits == (published == "fits"))
    except Exception as e:  # recorded in the table: a failure is a result too
        row.update({"verdict": "error", "error": f"{type(e).__name__}: {e}"[:500],
                    "traceback": traceback.format_exc().splitlines()[-6:],
                    "seconds": round(time.perf_counter() - t0, 1)})
    finally:
        _release()
    return row


def _estimate(plan: Plan, options: dict[str, Any]) -> tuple[Any, Any, bool]:
    """``tf_ipu.estimate`` of the plan (with its capture): the Estimate, what the capture
    recorded, and whether both come from bench_mlperf's run of the same model with the same
    options earlier in this process (``bench_mlperf.shared_key``: ``make bench`` runs that
    bench first, and its BERT runs are the MLPerf BERT cases here), which then is not
    estimated again."""
    import tf_ipu

    mlperf = sys.modules.get("bench.bench_mlperf")
    key = None
    if mlperf is not None and plan.capture in (None, mlperf._checkpoint_stash):
        key = mlperf.shared_key(plan.model, plan.batch, plan.training, options)
    if key is not None and key in mlperf.SHARED:
        est, stashed = mlperf.SHARED[key]
        return est, (stashed if plan.capture else None), True
    with plan.capture() if plan.capture else contextlib.nullcontext() as found:
        est = tf_ipu.estimate(plan.model, plan.batch, training=plan.training, **options)
    return est, found, False


def _is_pipelined(model: Any) -> bool:
    from tf_ipu import pipelining

    return bool(pipelining.stages_of(model))


def _release() -> None:
    """Drops Keras' global state between cases (their models are large)."""
    import keras

    keras.backend.clear_session()
    gc.collect()


def accounted_for(row: dict[str, Any]) -> bool:
    """A published fit the estimate puts over the SRAM, whose options the project cannot
    express are sized on its fullest tile (``accounting``: bytes per option) and together save
    at least the bytes it is over: the verdict names them and shows they account for the
    excess (issue 24's rule for MLPerf v2.0), so it is not scored wrong, nor right."""
    a = row.get("accounting") or {}
    return (row.get("published") == "fits" and row.get("built") and row.get("right") is False
            and bool(a.get("options")) and 0 < int(a.get("over_bytes", 0))
            <= int(a.get("saved_bytes", 0)))


def score(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fits and out-of-memory cases scored separately: per published verdict, the cases right,
    built and published. A case of a controlled pair (PAIRS) counts as right only if both
    halves are right (a half not built or unknown makes both wrong). Cases whose excess the
    unexpressible options account for, in bytes (``accounted_for``), are listed apart
    (``accounted_for``), not as right."""
    right = {r["id"]: r.get("right") is True for r in rows}
    pairs = []
    for a, b in PAIRS:
        both = right.get(a, False) and right.get(b, False)
        for cid in (a, b):
            if cid in right:
                right[cid] = both
        pairs.append({"cases": [a, b], "both_right": both})
    out: dict[str, Any] = {}
    for verdict in VERDICTS:
        published = [r for r in rows if r["published"] == verdict]
        built = [r for r in published if r.get("built")]
        out[verdict] = {"right": sum(right[r["id"]] for r in built), "built": len(built),
                        "published": len(published)}
    out["pairs"] = pairs
    out["accounted_for"] = [r["id"] for r in rows if accounted_for(r)]
    return out


def _mark(row: dict[str, Any]) -> str:
    if accounted_for(row):
        return "acct."
    return {True: "right", False: "WRONG", None: "-"}[row.get("right")]


def table_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The verdict table as text, one line per case."""
    head = (f"  {'case':<54} {'peak tile B':>12} {'of tile':>8} {'verdict':<14} "
            f"{'published':<14} {'':<6} {'build s':>8} {'est. s':>7}")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        if r.get("built"):
            share = f"{r['peak_tile_bytes'] / r['capacity_bytes']:.0%}"
            lines.append(f"  {r['id']:<54} {r['peak_tile_bytes']:>12,} {share:>8} "
                         f"{r['verdict']:<14} {r['published']:<14} {_mark(r):<6} "
                         f"{r.get('build_seconds', 0):>8.1f} {r.get('seconds', 0):>7.1f}")
        else:
            lines.append(f"  {r['id']:<54} {'':>12} {'':>8} {r['verdict']:<14} "
                         f"{r['published']:<14} {_mark(r):<6} {'':>8} {'':>7}")
    return lines


def score_lines(s: dict[str, Any]) -> list[str]:
    lines = []
    for verdict in VERDICTS:
        v = s[verdict]
        lines.append(f"  {verdict}: {v['right']} right of {v['built']} built "
                     f"({v['published']} published)")
    for cid in s.get("accounted_for", []):
        lines.append(f"  accounted for (not right, not wrong): {cid}: over the tile by no more "
                     f"than its unexpressible options would save, in bytes")
    for p in s["pairs"]:
        lines.append(f"  pair {p['cases'][0]} / {p['cases'][1]}: "
                     f"{'both right' if p['both_right'] else 'not both right'}")
    return lines


def run_case_with(case: dict[str, Any],
                  shared: dict[str, tuple[Any, dict[str, list[Any]]]]) -> dict[str, Any]:
    """``run_case`` in a worker process, given the estimates bench_mlperf made earlier in the
    parent (``bench_mlperf.SHARED``): a case they cover is not estimated again."""
    if shared:
        from bench import bench_mlperf

        bench_mlperf.SHARED.update(shared)
    return run_case(case)


def _previous_seconds(results: str = os.path.join(os.path.dirname(CASES_PATH), "results")
                      ) -> dict[str, tuple[float, float]]:
    """Each case's seconds to build and to estimate in the saved runs (bench/results/
    fit_cases*.json, the latest run of each case), to start the longest first."""
    saved = []
    for name in os.listdir(results) if os.path.isdir(results) else []:
        if name.startswith("fit_cases") and name.endswith(".json"):
            try:
                with open(os.path.join(results, name)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            saved.append((str(record.get("date", "")), record.get("rows") or []))
    out = {}
    for _, rows in sorted(saved, key=lambda s: s[0]):
        out.update({r["id"]: (float(r.get("build_seconds") or 0), float(r.get("seconds") or 0))
                    for r in rows if isinstance(r, dict) and "id" in r})
    return out


def estimate_cases(cases: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each case's row (``run_case``), in the cases' order: in this process, or in worker
    processes side by side (``bench.parallel``: ``BENCH_JOBS``, the CPUs and the memory
    available). A worker is given bench_mlperf's estimates made earlier in this process for
    the cases built by ``_bert_mlperf`` (``make bench`` runs mlperf first): those cases are
    still estimated only once."""
    from bench import parallel

    jobs, why = parallel.workers(len(cases))
    print(f"  {jobs} worker process{'es' if jobs > 1 else ' (in this process)'}: {why}")
    if jobs <= 1:
        for case in cases:
            yield run_case(case)
        return
    mlperf = sys.modules.get("bench.bench_mlperf")
    shared = dict(mlperf.SHARED) if mlperf is not None else {}
    before = _previous_seconds()
    given = [shared if _builder(case) is _bert_mlperf else {} for case in cases]
    calls = [(__name__ if __name__ != "__main__" else "bench.bench_fit_cases", "run_case_with",
              (case, mine)) for case, mine in zip(cases, given, strict=True)]
    cost = [sum(before.get(case["id"], (0.0, 0.0))[:1 if mine else 2])  # shared: built only
            for case, mine in zip(cases, given, strict=True)]
    yield from parallel.run(calls, jobs, cost)


def main(quick: bool = False, only: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Estimates every case (``quick``: not the SLOW ones), prints the table and the scores;
    returns the rows, then a summary row."""
    cases = load_cases()
    # FIT_CASES=a,b (ids, or parts of ids) selects cases under bench/run.py too.
    only = list(only or []) + [p for p in os.environ.get("FIT_CASES", "").split(",") if p]
    if only:
        cases = [c for c in cases if any(p == c["id"] or p in c["id"] for p in only)]
    elif quick:
        cases = [c for c in cases if c["id"] not in SLOW]
    print(f"Verdicts against the hardware: {len(cases)} published cases "
          f"({'quick: without ' + str(len(SLOW)) + ' slow ones' if quick and not only else 'all'}"
          f"), bench/fit_cases.json; fits = peak tile <= its SRAM")
    t0 = time.perf_counter()
    rows = []
    for row in estimate_cases(cases):
        rows.append(row)
        detail = (f"{row['peak_tile_bytes']:,} B of {row['capacity_bytes']:,}" if row.get("built")
                  else row.get("reason") or row.get("error", ""))
        print(f"  {row['id']}: {row['verdict']} (published {row['published']}, {_mark(row)}) "
              f"{detail} [{row.get('seconds', 0)} s]", flush=True)
    print()
    for line in table_lines(rows):
        print(line)
    print()
    print("  Not expressed, per case:")
    for r in rows:
        if r.get("built") and r.get("unexpressed"):
            print(f"  - {r['id']}: " + "; ".join(r["unexpressed"]))
        elif r.get("error"):
            print(f"  - {r['id']}: ERROR {r['error']}")
    s = score(rows)
    print()
    for line in score_lines(s):
        print(line)
    wall = time.perf_counter() - t0
    slowest = sorted((r for r in rows if r.get("built")), key=lambda r: -r.get("seconds", 0))[:5]
    print(f"  {wall:.0f} s in all; slowest: "
          + ", ".join(f"{r['id']} {r.get('seconds', 0):.0f} s" for r in slowest))
    rows.append({"summary": {**s, "seconds": round(wall, 1), "quick": quick,
                             "cases": [c["id"] for c in cases]}})
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    results = None
    if "--results" in args:  # --results DIR: the rows also go to DIR/fit_cases.json
        at = args.index("--results")
        results, args = args[at + 1], args[:at] + args[at + 2:]
    only = args[args.index("--only") + 1:] if "--only" in args else None
    out = main("--quick" in args, only)
    if results:
        os.makedirs(results, exist_ok=True)
        with open(os.path.join(results, "fit_cases.json"), "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "rows": out}, f, indent=1)
