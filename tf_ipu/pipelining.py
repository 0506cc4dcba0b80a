"""Pipelining: a model split into stages, each on an IPU of its replica (Graphcore's Keras API).

    with keras.ipu.PipelineStage(0): x = Dense(8)(inputs)      stage of a layer or of a call
    model.set_pipeline_stage_assignment([0, 0, 1, 1])           ... or per layer / per call
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=16,
                                 device_mapping=[0, 1], pipeline_schedule=Interleaved)
      fit ──> one device program per replica, every instruction tagged with its stage:
              forward ops in the stage's name scope ("tf_ipu_stage_<s>"), their gradients
              under it too (TF names them after the forward op), a variable's update in the
              stage of the layer that owns it  ──> IR attribute ``pipeline_stage``
      which call is in which stage: tf_ipu/pipeline_stages.py (re-exported here)
      subclassed models: the stages of the PipelineStage scopes entered in call(), read from
              its latest run (every model call records its own layer calls: _Frame ->
              _Trace); fit/evaluate/predict run call() (Keras's build) before counting
              steps per replica, so a replica spans the pipeline's IPUs
      device server: runs it (a pipeline computes what its micro-batches run one after the
              other with gradient accumulation compute); the tile model sizes each stage on
              its IPU with the schedule (docs/tile_model.md)

Per-stage Poplar options (``PipelineStageOptions``, forward and backward passes apart, and
the weight update): their ``availableMemoryProportion`` reaches the tile model as
``stage_memory_proportions`` entries of the plan (``[phase, stage, kind, proportion]``), then
``CompileOptions.stage_memory_proportions`` (``device_server/emulator/tiles/proportions.py``).

A replica spans ``ipus_per_replica`` IPUs: the highest IPU of ``device_mapping`` (stage i on
IPU i by default) plus one, rounded up to a power of two as Graphcore rounds; replicas =
attached IPUs // ipus_per_replica. Pipelined training accumulates gradients over
``gradient_accumulation_steps_per_replica`` micro-batches per weight update (required, as on
Graphcore), reduced as ``gradient_accumulation_reduction_method`` says.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from tf_ipu import notices
from tf_ipu.pipeline_stages import (  # noqa: F401  (re-exported: tf_ipu.pipelining's names)
    _ASSIGNMENT_ATTR,
    _LAYER_STAGE_ATTR,
    _NODE_STAGES_ATTR,
    _OPTIONS_ATTR,
    _RESET_ATTR,
    _TRACE_ATTR,
    STAGE_SCOPE,
    FunctionalLayerPipelineStageAssignment,
    FunctionalNestedModelPipelineStageAssignment,
    ModelLayerPipelineStageAssignment,
    NestedModelPipelineStageAssignment,
    Path,
    PipelineStage,
    SequentialLayerPipelineStageAssignment,
    SequentialNestedModelPipelineStageAssignment,
    _assignments,
    _call_stage,
    _flat,
    _is_model,
    _is_sequential,
    _is_subclassed,
    _layer_calls,
    _leaves,
    _models,
    _no_stages_reason,
    _scoped_stage,
    _stage_in,
    _state,
    _table,
    _Trace,
    _trace,
    _unreadable,
    current_stage,
    get_pipeline_stage_assignment,
    print_pipeline_stage_assignment_summary,
    reset_pipeline_stage_assignment,
    set_pipeline_stage_assignment,
    stages_of,
)


class PipelineSchedule(enum.Enum):
    """The order in which a pipeline runs its stages' forward and backward passes
    (Graphcore's ``ipu.ops.pipelining_ops.PipelineSchedule``): Grouped keeps more
    activations live and is usually faster; Interleaved runs each backward pass as soon as
    it can (less memory); Sequential runs one micro-batch through all stages at a time."""

    Grouped = 0
    Interleaved = 1
    Sequential = 2


class RecomputationMode(enum.Enum):
    """How a pipelined model's backward pass recomputes its stages' forward activations when
    ``IPUConfig.allow_recompute`` is set (Graphcore's names and rules):

    - ``RecomputeThenBackpropagate``: a stage's whole forward runs again from its input
      before its backward (Grouped and Interleaved schedules); recomputation checkpoints
      have no effect;
    - ``RecomputeAndBackpropagateInterleaved``: recomputation restarts from the latest
      recomputation checkpoint (``recomputation_checkpoint``), which is stashed with the
      stage's input (Grouped and Sequential schedules);
    - ``Auto``: the first for Grouped and Interleaved, the second for Sequential.

    The tile model charges it (docs/tile_model.md, "Pipelines"); results never change."""

    Auto = 0
    RecomputeThenBackpropagate = 1
    RecomputeAndBackpropagateInterleaved = 2


def resolved_recomputation_mode(schedule: PipelineSchedule, mode: RecomputationMode
                                ) -> RecomputationMode:
    """``mode`` for ``schedule`` (``Auto`` resolved, as Graphcore resolves it)."""
    if mode is RecomputationMode.Auto:
        return (RecomputationMode.RecomputeAndBackpropagateInterleaved
                if schedule is PipelineSchedule.Sequential
                else RecomputationMode.RecomputeThenBackpropagate)
    return mode


def checkpoints_apply(schedule: PipelineSchedule, mode: RecomputationMode) -> bool:
    """Whether recomputation checkpoints shape the recomputation of this schedule and mode."""
    return (resolved_recomputation_mode(schedule, mode)
            is RecomputationMode.RecomputeAndBackpropagateInterleaved)


#: The name scope of a recomputation checkpoint's op; the IR marks its instruction
#: (``recomputation_checkpoint``, docs/ir.md) in pipelined programs.
CHECKPOINT_SCOPE = "tf_ipu_recomputation_checkpoint"


def recomputation_checkpoint(tensors: Any, name: str | None = None) -> Any:
    """Graphcore's ``ipu.pipelining_ops.recomputation_checkpoint``: returns ``tensors`` (a
    tensor or a structure of them) unchanged, marked as recomputation checkpoints. In a
    pipelined model trained with recomputation in the ``RecomputeAndBackpropagateInterleaved``
    mode (explicit, or ``Auto`` with the Sequential schedule), each marked value is stashed
    with its stage's input and the backward recomputes from the latest checkpoint instead of
    from the stage's input: more memory per micro-batch in flight, fewer cycles recomputed.
    Anywhere else (another mode, no recomputation, not pipelined) it is the identity, as on
    Graphcore's IPUs. Gradients pass through it unchanged.

    Example:
        >>> y = ipu.pipelining_ops.recomputation_checkpoint(x)          # doctest: +SKIP
    """
    flat = tf.nest.flatten(tensors, expand_composites=True)
    out = []
    with tf.name_scope(CHECKPOINT_SCOPE):
        for x in flat:
            x = tf.convert_to_tensor(x)
            shape = x.shape.as_list() if x.shape.is_fully_defined() else tf.shape(x)
            # A reshape to its own shape: the identity, and an instruction of its own in
            # XLA's HLO (tf.identity is none), which carries the op's name into the IR.
            out.append(tf.reshape(x, shape, name=name or "checkpoint"))
    return tf.nest.pack_sequence_as(tensors, out, expand_composites=True)


# -- options -------------------------------------------------------------------------------


class PipelineStageOptions:
    """Graphcore's ``ipu.pipelining_ops.PipelineStageOptions``: PopLibs options for the
    convolutions, matmuls and slices of one pass of one pipeline stage. Give
    ``set_pipelining_options`` one per stage as ``forward_propagation_stages_poplar_options``
    and ``backward_propagation_stages_poplar_options``, and one as
    ``weight_update_poplar_options``. They are set over ``IPUConfig.matmuls`` /
    ``convolutions.poplar_options`` option by option, as Graphcore's TensorFlow does for each
    instruction of that pass (a recomputed forward takes the forward's).

    ``availableMemoryProportion`` sizes that pass's matmul and convolution plans in the tile
    model (docs/tile_model.md, "availableMemoryProportion"); the other options are checked
    (PopLibs' names) and do not change the estimate. Nothing changes what the program computes.

    Example (Graphcore's TF2 BERT, a proportion per IPU taken by each stage's IPU):
        >>> options = [PipelineStageOptions(matmul_options={                  # doctest: +SKIP
        ...     "availableMemoryProportion": str(amp[ipu])}) for ipu in device_mapping]
        >>> model.set_pipelining_options(gradient_accumulation_steps_per_replica=16,
        ...     device_mapping=device_mapping, forward_propagation_stages_poplar_options=options,
        ...     backward_propagation_stages_poplar_options=options)
    """

    def __init__(self, convolution_options: dict[str, Any] | None = None,
                 matmul_options: dict[str, Any] | None = None,
                 slice_options: dict[str, Any] | None = None) -> None:
        given = {"convolution_options": convolution_options, "matmul_options": matmul_options,
                 "slice_options": slice_options}
        for name, value in given.items():
            value = value or {}
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise TypeError(f"PipelineStageOptions.{name} must be a dict of PopLibs option "
                                f"names (str) to values. Received: {name}={given[name]!r}")
            given[name] = dict(value)
        self.convolution_options: dict[str, Any] = given["convolution_options"]
        self.matmul_options: dict[str, Any] = given["matmul_options"]
        self.slice_options: dict[str, Any] = given["slice_options"]

    def __repr__(self) -> str:
        return (f"PipelineStageOptions(convolution_options={self.convolution_options!r}, "
                f"matmul_options={self.matmul_options!r}, slice_options={self.slice_options!r})")

    def memory_proportions(self, where: str) -> dict[str, float]:
        """"matmul" / "convolution" -> the availableMemoryProportion these options set, their
        option names and values checked (``where`` names them in a ValueError)."""
        from tf_ipu import config

        out = {}
        for kind, options, known, poplibs in (
                ("matmul", self.matmul_options, config._MATMUL_POPLAR, "matMul"),
                ("convolution", self.convolution_options, config._CONV_POPLAR, "convolution")):
            checked = config._check_poplar_options(f"{where}.{kind}_options", options, known,
                                                   poplibs)
            if "availableMemoryProportion" in checked:
                out[kind] = config._memory_proportion(
                    f"{where}.{kind}_options['availableMemoryProportion']",
                    checked["availableMemoryProportion"])
        config._check_poplar_options(f"{where}.slice_options", self.slice_options)
        return out

    def unmodelled(self) -> list[str]:
        """The options given that the tile model does not read."""
        return ([f"matmul_options['{k}']" for k in self.matmul_options
                 if k != "availableMemoryProportion"]
                + [f"convolution_options['{k}']" for k in self.convolution_options
                   if k != "availableMemoryProportion"]
                + [f"slice_options['{k}']" for k in self.slice_options])


#: set_pipelining_options' per-pass Poplar options: the pass each one's proportions size.
_STAGE_OPTIONS = {"forward_propagation_stages_poplar_options": "forward",
                  "backward_propagation_stages_poplar_options": "backward",
                  "weight_update_poplar_options": "update"}


def _check_stage_options(what: str, name: str, value: Any) -> list[Any] | None:
    """``value`` of the pipelining option ``name``: a list of PipelineStageOptions (the
    stages' options) or, for ``weight_update_poplar_options``, one; their options checked.
    TypeError for another type, ValueError naming the stage and the option for a bad value."""
    if value is None:
        return None
    if name == "weight_update_poplar_options":
        if not isinstance(value, PipelineStageOptions):
            raise TypeError(f"{what}: weight_update_poplar_options must be a "
                            f"PipelineStageOptions. Received: {value!r}")
        value.memory_proportions(f"{what}: weight_update_poplar_options")
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what}: {name} must be a list of PipelineStageOptions, one per "
                        f"pipeline stage. Received: {value!r}")
    for k, item in enumerate(value):
        if not isinstance(item, PipelineStageOptions):
            raise TypeError(f"{what}: {name}[{k}] (pipeline stage {k}) must be a "
                            f"PipelineStageOptions. Received: {item!r}")
        item.memory_proportions(f"{what}: {name}[{k}] (pipeline stage {k})")
    return list(value)


def stage_memory_proportions(kwargs: dict[str, Any], stages: int, what: str,
                             training: bool = True) -> list[list[Any]]:
    """The availableMemoryProportion entries ``[phase, stage, kind, proportion]`` that the
    per-pass Poplar options in ``kwargs`` (``set_pipelining_options``' names) set for a
    pipeline of ``stages`` stages (``CompileOptions.stage_memory_proportions``). ValueError
    when a list does not give one PipelineStageOptions per stage (Graphcore's rule), naming
    it; ``training`` False: the backward and weight-update options are not read (Graphcore
    reads them only with an optimizer)."""
    entries: list[list[Any]] = []
    unmodelled: list[str] = []
    for name, phase in _STAGE_OPTIONS.items():
        if not training and phase != "forward":
            continue
        given = _check_stage_options(what, name, kwargs.get(name))
        if given is None:
            continue
        if phase != "update" and len(given) != stages:
            raise ValueError(f"{what}: {name} has {len(given)} PipelineStageOptions for "
                             f"{stages} pipeline stages: give one per stage (the same number "
                             f"as the computational stages, Graphcore's rule).")
        for k, item in enumerate(given):
            where = (f"{what}: {name}" if phase == "update"
                     else f"{what}: {name}[{k}] (pipeline stage {k})")
            for kind, value in item.memory_proportions(where).items():
                entries.append([phase, k, kind, value])
            unmodelled += [f"{name}[{k}].{o}" if phase != "update" else f"{name}.{o}"
                           for o in item.unmodelled()]
    if unmodelled:
        notices.once(f"{what}(stage options {sorted(set(unmodelled))})",
                     f"{', '.join(sorted(set(unmodelled))[:4])}"
                     f"{' ...' if len(set(unmodelled)) > 4 else ''}: accepted; the tile model "
                     f"plans a stage's products with its availableMemoryProportion only (the "
                     f"program's options apply otherwise), and results do not change.")
    return entries


_KNOWN_KWARGS = {"pipeline_schedule", "recomputation_mode", "offload_weight_update_variables",
                 "replicated_optimizer_state_sharding", "forward_propagation_stages_poplar_options",
                 "backward_propagation_stages_poplar_options",
                 "weight_update_poplar_options", "offload_activations",
                 "offload_gradient_accumulation_buffers", "replicated_weight_sharding",
                 "offload_weights", "reduction_method", "name"}
# Options the tile model sizes (where the optimizer state lives), with what they accept.
_MODELLED = {"offload_weight_update_variables": "True, False or None (automatic)",
             "replicated_optimizer_state_sharding": "True or False"}
_EXPLICIT = {"gradient_accumulation_count": "gradient_accumulation_steps_per_replica",
             "device_mapping": "device_mapping", "accumulate_outfeed": "accumulate_outfeed"}
_AUTOMATIC = ("computational_stages", "repeat_count", "inputs", "infeed_queue", "outfeed_queue",
              "optimizer_function")


def set_pipelining_options(self: Any, gradient_accumulation_steps_per_replica: int | None = None,
                           device_mapping: Sequence[int] | None = None,
                           accumulate_outfeed: bool | None = None,
                           gradient_accumulation_reduction_method: Any = "sum",
                           **pipelining_kwargs: Any) -> None:
    """Graphcore's ``model.set_pipelining_options``.

    Args:
        gradient_accumulation_steps_per_replica: micro-batches per weight update (required
            to train a pipelined model); ``steps_per_execution`` must be a multiple of it.
        device_mapping: the IPU (within a replica) of each stage; default: stage i on IPU i.
            Several stages may share an IPU.
        accumulate_outfeed: accepted (results come back with each call here).
        gradient_accumulation_reduction_method: 'sum' (Graphcore's default), 'mean',
            'running_mean'.
        **pipelining_kwargs: ``pipeline_schedule`` (``PipelineSchedule``, default Grouped),
            ``recomputation_mode`` (``RecomputationMode``; recomputation needs
            ``IPUConfig.allow_recompute``), ``offload_weight_update_variables``,
            ``replicated_optimizer_state_sharding``,
            ``forward_propagation_stages_poplar_options`` and
            ``backward_propagation_stages_poplar_options`` (one ``PipelineStageOptions`` per
            stage: its ``availableMemoryProportion`` plans that pass's matmuls and
            convolutions), ``weight_update_poplar_options`` (one) and Graphcore's other
            pipeline op options, which size the program (the tile model) and do not change
            results.

    Raises:
        TypeError: stage Poplar options that are not PipelineStageOptions (a list of them).
        ValueError: an invalid option (a stage's availableMemoryProportion outside [0, 1]
            names the option, the stage and the value; a list of stage options not one per
            stage is refused when the stages are counted, at the first fit/evaluate/predict or
            estimate); or stages that cannot be read from a subclassed
            model's ``call()`` that has already run (a PipelineStage scope inside the call of
            a layer that is not a model). A model whose ``call()`` has not run yet is
            checked at the first ``fit``/``evaluate``/``predict`` (once Keras's build has
            run it), which also refuses a model with these options and no stage at all
            (``plan``): a pipelined model never trains unpipelined silently.
    """
    from tf_ipu import accumulation

    problems = _unreadable(self)
    if problems:  # a subclassed model's call() has run: its stages are known now
        raise ValueError(f"set_pipelining_options: the pipeline stages of {self.name} cannot "
                         f"be read: " + "; ".join(problems) + ".")
    steps = gradient_accumulation_steps_per_replica
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"set_pipelining_options: gradient_accumulation_steps_per_replica must "
                         f"be a positive int. Received: {steps!r}")
    if device_mapping is not None:
        if not isinstance(device_mapping, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in device_mapping):
            raise ValueError(f"set_pipelining_options: device_mapping must be a list of IPU "
                             f"indices (ints >= 0), one per stage. Received: {device_mapping!r}")
    for explicit, alternative in _EXPLICIT.items():
        if explicit in pipelining_kwargs:
            raise ValueError(f"set_pipelining_options: found `{explicit}` in pipelining_kwargs; "
                             f"set the `{alternative}` argument instead.")
    for automatic in _AUTOMATIC:
        if automatic in pipelining_kwargs:
            raise ValueError(f"set_pipelining_options: `{automatic}` is set by Keras; do not "
                             f"pass it.")
    schedule = pipelining_kwargs.pop("pipeline_schedule", PipelineSchedule.Grouped)
    if not isinstance(schedule, PipelineSchedule):
        names = {s.name.lower(): s for s in PipelineSchedule}
        if isinstance(schedule, str) and schedule.lower() in names:
            schedule = names[schedule.lower()]
        else:
            raise ValueError(f"set_pipelining_options: pipeline_schedule must be a "
                             f"PipelineSchedule (Grouped, Interleaved, Sequential). Received: "
                             f"{schedule!r}")
    recomputation = pipelining_kwargs.pop("recomputation_mode", RecomputationMode.Auto)
    if not isinstance(recomputation, RecomputationMode):
        raise ValueError(f"set_pipelining_options: recomputation_mode must be a "
                         f"RecomputationMode. Received: {recomputation!r}")
    unsupported = {RecomputationMode.RecomputeThenBackpropagate: PipelineSchedule.Sequential,
                   RecomputationMode.RecomputeAndBackpropagateInterleaved:
                       PipelineSchedule.Interleaved}
    if unsupported.get(recomputation) is schedule:
        works = [s.name for s in PipelineSchedule if s is not schedule]
        raise ValueError(f"set_pipelining_options: the {schedule.name} pipeline schedule does "
                         f"not support recomputation_mode={recomputation.name} (Graphcore's "
                         f"rule); use the {' or '.join(works)} schedule, or "
                         f"RecomputationMode.Auto.")
    for name, value in pipelining_kwargs.items():
        if name not in _KNOWN_KWARGS:
            raise ValueError(f"set_pipelining_options: unknown pipelining option {name!r}.")
        if name in _STAGE_OPTIONS:  # PipelineStageOptions: checked now, counted in plan()
            _check_stage_options("set_pipelining_options", name, value)
            continue
        if name in _MODELLED:
            if value is not None and not isinstance(value, bool) or (
                    value is None and name == "replicated_optimizer_state_sharding"):
                raise ValueError(f"set_pipelining_options: {name} must be "
                                 f"{_MODELLED[name]}. Received: {value!r}")
            continue  # sized by the tile model (docs/tile_model.md, "Pipelines")
        notices.once(f"set_pipelining_options({name})",
                     f"{name}={value!r} is accepted and does not change what the program "
                     f"computes; the estimate does not model it yet.")
    if accumulate_outfeed:
        notices.once("set_pipelining_options(accumulate_outfeed)",
                     "accumulate_outfeed=True has no effect here: each device call's results "
                     "come back with its reply.")
    options = {
        "gradient_accumulation_steps_per_replica": steps,
        "device_mapping": list(device_mapping) if device_mapping is not None else None,
        "gradient_accumulation_reduction_method": accumulation._method_name(
            gradient_accumulation_reduction_method),
        "pipeline_schedule": schedule,
        "recomputation_mode": recomputation,
        "kwargs": dict(pipelining_kwargs),
    }
    object.__setattr__(self, _OPTIONS_ATTR, options)
    if steps is not None:
        accumulation.set_gradient_accumulation_options(
            self, gradient_accumulation_steps_per_replica=steps,
            gradient_accumulation_reduction_method=gradient_accumulation_reduction_method)


def pipelining_options(model: Any) -> dict[str, Any]:
    return getattr(model, _OPTIONS_ATTR, {})


def plan(model: Any, steps_per_execution: int) -> dict[str, Any] | None:
    """The pipeline of ``model`` (None: not pipelined), checked: stages, their IPUs, the IPUs a
    replica spans, the schedule, micro-batches per update. Raises ValueError naming the
    numbers and the fix; also when ``set_pipelining_options`` was called and the model has
    no stage (unless ``reset_pipeline_stage_assignment`` made it unpipelined), or when a
    subclassed model's stages cannot be read from its ``call()``."""
    name = getattr(model, "name", "model")
    problems = _unreadable(model)
    if problems:
        raise ValueError(f"{name}: its pipeline stages cannot be read: "
                         + "; ".join(problems) + ".")
    stages = stages_of(model)
    if not stages:
        if pipelining_options(model) and not getattr(model, _RESET_ATTR, False):
            raise ValueError(
                f"{name}: set_pipelining_options was called, but the model has no pipeline "
                f"stage: {_no_stages_reason(model)}. It would otherwise run unpipelined "
                f"(as data-parallel replicas over the IPUs); to accumulate gradients without "
                f"a pipeline, call set_gradient_accumulation_options instead.")
        return None
    count = max(stages.values()) + 1
    missing = sorted(set(range(count)) - set(stages.values()))
    if missing:
        raise ValueError(f"{name}: pipeline stages {missing} have no layer (stages are "
                         f"0 .. {count - 1}); renumber the stages without gaps.")
    calls = _flat(model)
    unassigned = [layer.name for _, layer, stage in calls if stage is None]
    if unassigned:
        raise ValueError(f"{name}: layers {unassigned} have no pipeline stage; a pipelined "
                         f"model needs one for every layer (set_pipeline_stage_assignment, or "
                         f"a PipelineStage scope around each).")
    options = pipelining_options(model)
    mapping = options.get("device_mapping") or list(range(count))
    if len(mapping) != count:
        raise ValueError(f"{name}: device_mapping {mapping} names {len(mapping)} IPUs for "
                         f"{count} pipeline stages: give one IPU per stage, e.g. "
                         f"device_mapping={list(range(count))}.")
    # A layer's weights live on one IPU: all its calls' stages must map there.
    by_layer: dict[int, set[int]] = {}
    layers = {id(layer): layer for _, layer, _ in calls}
    for path, stage in stages.items():
        by_layer.setdefault(path[-1][0], set()).add(stage)
    for layer_id, layer_stages in by_layer.items():
        ipus = {mapping[s] for s in layer_stages}
        if len(ipus) > 1 and getattr(layers[layer_id], "weights", None):
            raise ValueError(
                f"{name}: layer {layers[layer_id].name!r} is called in stages "
                f"{sorted(layer_stages)}, mapped to IPUs {sorted(ipus)}; its weights live on "
                f"one IPU: map those stages to one IPU (device_mapping) or call it in one stage.")
    accumulation_steps = options.get("gradient_accumulation_steps_per_replica")
    ipus = max(mapping) + 1
    return {
        "stages": count,
        "stage_ipus": list(mapping),
        "ipus_per_replica": 2 ** int(math.ceil(math.log2(ipus))) if ipus > 1 else 1,
        "schedule": options.get("pipeline_schedule", PipelineSchedule.Grouped).name.lower(),
        "micro_batches": int(accumulation_steps or 1),
        "accumulation_set": accumulation_steps is not None,
        "recomputation_mode": options.get("recomputation_mode", RecomputationMode.Auto).name,
        # Recomputation checkpoints count (the IR marks them) in the mode that honours them.
        "recomputation_checkpoints": checkpoints_apply(
            options.get("pipeline_schedule", PipelineSchedule.Grouped),
            options.get("recomputation_mode", RecomputationMode.Auto)),
        "steps_per_execution": steps_per_execution,
        # Where the optimizer state lives (the tile model): None is Graphcore's automatic choice.
        "offload": options.get("kwargs", {}).get("offload_weight_update_variables"),
        "sharding": bool(options.get("kwargs", {}).get("replicated_optimizer_state_sharding", False)),
        # PipelineStageOptions' availableMemoryProportion per stage and pass (the tile model).
        "stage_memory_proportions": stage_memory_proportions(
            options.get("kwargs", {}), count, f"{name}.set_pipelining_options"),
    }


def check_training(model: Any, pipeline: dict[str, Any]) -> None:
    """A pipelined model trains with gradient accumulation (Graphcore's rule), over a
    multiple of its micro-batches per device call."""
    name = getattr(model, "name", "model")
    if not pipeline["accumulation_set"]:
        raise ValueError(
            f"{name} is pipelined ({pipeline['stages']} stages), and pipelined models train "
            f"with gradient accumulation: call model.set_pipelining_options("
            f"gradient_accumulation_steps_per_replica=N), N micro-batches per weight update "
            f"(e.g. N = {2 * pipeline['stages']}, and steps_per_execution a multiple of N).")


# -- tagging ops while a program is lowered ------------------------------------------------------


class _Tagging:
    """What the lowering of one pipelined model's program needs on this thread."""

    def __init__(self, model: Any, stages: dict[Path, int]) -> None:
        self.model = model
        self.stages = stages
        # The model (or nested model) calls being traced: each one's path and its layers'
        # calls so far (a nested model's layers count their calls afresh in each of its calls).
        self.frames: list[tuple[Path, dict[int, int]]] = [((), {})]
        self.nested = {path[:n] for path in stages for n in range(1, len(path))}
        self.var_stage: dict[int, int] = {}
        for _, layer, stage in _flat(model):
            if stage is None:
                continue
            for w in getattr(layer, "weights", []):
                self.var_stage.setdefault(id(getattr(w, "value", w)), stage)


def tagging(model: Any, stages: dict[Path, int]) -> Any:
    """A block in which the traced program of ``model`` tags its ops with their stages."""
    import contextlib

    traced = any(_trace(m) is not None for m in _models(model))
    if traced:  # traced again since the plan (training=True, for the program): still valid?
        try:
            plan(model, 1)
        except ValueError as e:
            raise ValueError(
                f"{str(e).rstrip('.')}; found as its call() was traced for the device "
                f"program, with training=True (the pipeline was planned from Keras's build, "
                f"training=False): a pipelined model's call() must make its layer calls in "
                f"stages in both.") from None
    flat = _flat(model) if traced else []
    before = [(path, stage) for path, _, stage in flat] if traced else None
    names = {id(layer): layer.name for _, layer, _ in flat}

    @contextlib.contextmanager
    def block() -> Iterator[None]:
        previous = getattr(_state, "tagging", None)
        _state.tagging = _Tagging(model, stages)
        try:
            yield
        finally:
            _state.tagging = previous
        if before is not None:
            _check_retrace(model, before, names)

    return block()


def _check_retrace(model: Any, before: list[tuple[Path, int | None]],
                   names: dict[int, str]) -> None:
    """A subclassed model's ``call()`` traced again for the program (with ``training=True``;
    Keras's build traced it with ``training=False``) may make other layer calls (a layer
    called only in training) as long as the pipeline stays the one planned: every call in a
    stage, the same stages. Otherwise ValueError naming the first call that differs."""
    problems = _unreadable(model)
    after = [(path, stage) for path, _, stage in _flat(model)]
    if not problems and after == before:
        return
    name = getattr(model, "name", "model")
    if problems:
        raise ValueError(f"{name}: its pipeline stages cannot be read: " + "; ".join(problems)
                         + ".")
    count = max((s for _, s in before if s is not None), default=-1) + 1
    try:
        now = plan(model, 1)
        why = "" if now is not None and now["stages"] == count else (
            f"it has {now['stages'] if now else 0} stages, not {count}")
    except ValueError as e:
        why = str(e)
    if not why:
        return
    names = {**names, **{id(layer): layer.name for _, layer, _ in _flat(model)}}

    def show(entry: tuple[Path, int | None] | None) -> str:
        if entry is None:
            return "no call"
        path, stage = entry
        layer_id, index = path[-1]
        return f"{names.get(layer_id, '?')} (call {index}) in stage {stage}"

    k = next((k for k, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
             min(len(before), len(after)))
    raise ValueError(
        f"{name}: tracing its call() for the device program made other layer calls in "
        f"pipeline stages than the trace its pipeline was planned from (Keras's build, "
        f"training=False): layer call {k} is {show(after[k] if k < len(after) else None)}, "
        f"was {show(before[k] if k < len(before) else None)}; then {why}")


def _layer_call_scope(layer: Any) -> tuple[Any, bool]:
    """The name scope of this call of ``layer`` while a pipelined program is traced (or
    None), and whether the call is of a nested model whose layers have their own stages (its
    frame is pushed: pop it after the call). The model's own call restarts the count of each
    layer's calls."""
    tag = getattr(_state, "tagging", None)
    if tag is None:
        return None, False
    if layer is tag.model:
        tag.frames[:] = [((), {})]
        return None, False
    prefix, calls = tag.frames[-1]
    index = calls.get(id(layer), 0)
    calls[id(layer)] = index + 1
    path = prefix + ((id(layer), index),)
    first = prefix + ((id(layer), 0),)
    if path not in tag.stages and path not in tag.nested and (first in tag.stages
                                                              or first in tag.nested):
        path = prefix + ((id(layer), 0),)  # called more often than the model's graph says
    if path in tag.nested:
        tag.frames.append((path, {}))
        return None, True
    stage = tag.stages.get(path)
    if stage is None:
        return None, False
    return tf.name_scope(f"{STAGE_SCOPE}{stage}"), False


def variable_scope(var: Any) -> Any:
    """The name scope of an update of ``var`` (a tf.Variable) while a pipelined program is
    traced: the stage of the layer that owns it (an optimizer's accumulator, that of its
    variable), or None."""
    tag = getattr(_state, "tagging", None)
    if tag is None:
        return None
    stage = tag.var_stage.get(id(var))
    if stage is None:
        optimizer = getattr(tag.model, "optimizer", None)
        accumulators = getattr(optimizer, "_accumulated_gradients", None) or []
        trainable = getattr(optimizer, "_trainable_variables", None) or []
        for acc, v in zip(accumulators, trainable, strict=False):
            if id(getattr(acc, "value", acc)) == id(var):
                stage = tag.var_stage.get(id(getattr(v, "value", v)))
                break
    if stage is None:
        return None
    return tf.name_scope(f"{STAGE_SCOPE}{stage}")


class _Frame:
    """One running call of a model (any kind), while its layer calls are recorded: the calls
    it makes itself (not those made inside a layer's own call), each with the stage of the
    PipelineStage scope entered in this frame around it. Kept for subclassed models
    (``_Trace``)."""

    __slots__ = ("model", "counts", "calls", "leaf", "problems")

    def __init__(self, model: Any) -> None:
        self.model = model
        self.counts: dict[int, int] = {}
        self.calls: list[tuple[Any, int, int | None]] = []
        self.leaf: Any = None  # the (non-model) layer whose call is running in this frame
        self.problems: list[str] = []


def _trace_before_counting(iterator: Any) -> None:
    """Runs (symbolically, as Keras's build does) the ``call()`` of the subclassed model
    that ``fit``/``evaluate`` is starting, when it has pipelining options and its ``call()``
    has not run: its stages, so the IPUs a replica spans, must be known before Keras's epoch
    iterator counts the steps per replica. Anything that fails here fails again, named, in
    Keras's build or in ``plan``."""
    import keras
    from keras.src import backend, tree
    from keras.src.trainers import data_adapters

    from tf_ipu import replication
    from tf_ipu.strategy import IPUStrategy

    strategy = getattr(iterator, "_distribute_strategy", None)
    current = replication.current_call()
    model = current[1] if current else None
    if (not isinstance(strategy, IPUStrategy) or model is None or not _is_subclassed(model)
            or _trace(model) is not None or not pipelining_options(model)):
        return
    try:
        spec = iterator._distributed_dataset.element_spec
        x, _, _ = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(spec)
        x = tree.map_structure(
            lambda v: None if v is None else keras.KerasTensor(
                v.shape, backend.standardize_dtype(v.dtype)), x)
        with strategy.scope():
            backend.compute_output_spec(model, x, training=False)
    except Exception:  # noqa: BLE001 - Keras's own build reports it
        return


def install() -> None:
    """Hooks Keras's layers: construction and symbolic calls in a PipelineStage scope record
    their stage; every model call records its layer calls and the stages of the scopes
    entered in it (a subclassed model keeps them: ``_Trace``); calls while a pipelined
    program is traced open their stage's name scope. Hooks Keras's epoch iterator so that a
    subclassed model's stages are known before it counts steps per replica."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.layers.layer import Layer
    from keras.src.models.model import Model

    if getattr(Layer, "_tf_ipu_pipelining", False):
        return
    original_new = Layer.__new__
    original_call = Layer.__call__

    # __new__, not __init__: Keras reads each layer class's __init__ signature (its config).
    def new(cls: Any, *args: Any, **kwargs: Any) -> Any:
        obj = original_new(cls, *args, **kwargs)
        stage = current_stage()
        if stage is not None:
            object.__setattr__(obj, _LAYER_STAGE_ATTR, stage)
        return obj

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        stage = current_stage()
        frames = getattr(_state, "frames", None)
        if frames is None:
            frames = _state.frames = []
        top = frames[-1] if frames else None
        if top is not None and top.leaf is None:  # a call the running model makes itself
            index = top.counts.get(id(self), 0)
            top.counts[id(self)] = index + 1
            owned = stage if getattr(_state, "scope_frame", None) is top else None
            top.calls.append((self, index, owned))
        frame = _Frame(self) if isinstance(self, Model) else None
        leaf = frame is None and top is not None and top.leaf is None
        if frame is not None:
            frames.append(frame)
        elif leaf:
            top.leaf = self
        scope, pushed = _layer_call_scope(self)
        before = len(getattr(self, "_inbound_nodes", []) or [])
        try:
            if scope is None:
                out = original_call(self, *args, **kwargs)
            else:
                with scope:
                    out = original_call(self, *args, **kwargs)
        finally:
            if pushed:
                _state.tagging.frames.pop()
            if frame is not None:
                frames.pop()
            elif leaf:
                top.leaf = None
        if frame is not None and _is_subclassed(self):
            object.__setattr__(self, _TRACE_ATTR, _Trace(frame.calls, frame.problems))
        if stage is not None:
            after = len(getattr(self, "_inbound_nodes", []) or [])
            if after > before:  # a symbolic call made a node: its stage
                stages = dict(getattr(self, _NODE_STAGES_ATTR, {}))
                stages[after - 1] = stage
                object.__setattr__(self, _NODE_STAGES_ATTR, stages)
        return out

    call.__wrapped__ = original_call  # type: ignore[attr-defined]
    Layer.__new__ = staticmethod(new)
    Layer.__call__ = call
    Layer._tf_ipu_pipelining = True

    # A model built by its first call runs call() once more to build (Keras's default
    # build): those layer calls go to a frame of their own, not the call's.
    original_maybe_build = Layer._maybe_build

    def maybe_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        frames = getattr(_state, "frames", None)
        if not frames or frames[-1].model is not self:
            return original_maybe_build(self, *args, **kwargs)
        frames.append(_Frame(self))
        try:
            return original_maybe_build(self, *args, **kwargs)
        finally:
            frames.pop()

    maybe_build.__wrapped__ = original_maybe_build  # type: ignore[attr-defined]
    Layer._maybe_build = maybe_build

    # Innermost hook of the epoch iterator's __init__ (installed before the replicas'
    # counting, tf_ipu.replication.install_epoch_iterator, which then reads the plan).
    iterator_init = tf_trainer.TFEpochIterator.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        iterator_init(self, *args, **kwargs)
        _trace_before_counting(self)

    tf_trainer.TFEpochIterator.__init__ = init


__all__ = ["CHECKPOINT_SCOPE", "FunctionalLayerPipelineStageAssignment",
           "FunctionalNestedModelPipelineStageAssignment", "ModelLayerPipelineStageAssignment",
           "NestedModelPipelineStageAssignment", "Path", "PipelineSchedule", "PipelineStage",
           "PipelineStageOptions",
           "RecomputationMode", "STAGE_SCOPE", "SequentialLayerPipelineStageAssignment",
           "SequentialNestedModelPipelineStageAssignment", "check_training", "checkpoints_apply",
           "current_stage", "recomputation_checkpoint", "resolved_recomputation_mode",
           "get_pipeline_stage_assignment", "install", "pipelining_options", "plan",
           "print_pipeline_stage_assignment_summary", "reset_pipeline_stage_assignment",
           "set_pipeline_stage_assignment", "set_pipelining_options", "stage_memory_proportions",
           "stages_of", "tagging",
           "variable_scope"]
