"""Sizing a Keras model for an IPU without running it: latency, throughput, memory per tile.

    model (Keras) --lower_function--> IR module --tile model (device_server.emulator.tiles)-->
      Estimate: .latency_s .throughput .cycles .peak_tile_bytes .fits .to_json() .save_html()

Everything happens in this process: the model's step is lowered to IR (as ``IPUStrategy`` would
lower it) and planned onto the tiles of the chosen preset, without executing it, without a
device server and without ``configure_ipu_system``. Nothing is trained: the model's weights and
optimizer state are left as they were.

    report = tf_ipu.estimate(model, batch_size=8, ipu_version="bow")
    report.latency_s, report.throughput, report.fits
    report.save_html("resnet50_bow.html")
    sweep = tf_ipu.estimate_sweep(model, [1, 2, 4, 8, 16, 32])   # latency/throughput vs batch

From the command line (``keras.applications`` models are built with ``weights=None``)::

    python -m tf_ipu.estimate --model resnet50 --batch-size 8 --ipu-version bow --html out.html

Data parallelism: ``replicas=R`` (``--replicas R``) runs R copies of the step at once on a
system's IPUs (``system="bow2000"``, ``--system``; default: R plain IPUs of the version).
``batch_size`` is then per replica, ``throughput`` counts all replicas' items, and a training
step pays the all-reduce of its gradients over the IPU-Links (the one the program contains,
else one of the trainable variables' bytes per step, which the report notes).

    tf_ipu.estimate(model, 8, training=True, ipu_version="bow", replicas=4, system="bow2000")

Gradient accumulation and time to train (``TrainingEstimate``): with
``gradient_accumulation_steps_per_replica=N`` (``--gradient-accumulation N``) the step is
planned as above, as one micro-batch, and the weight update (the gradients' all-reduce and
the optimizer's update, sized on its own) happens once every N micro-batches; each
micro-batch adds its gradients into accumulators instead. ``dataset_size`` with ``epochs``,
or ``steps`` (weight updates), gives the time to train with that configuration.

    t = tf_ipu.estimate(model, 4, training=True, ipu_version="bow", replicas=16,
                        system="bow-pod16", gradient_accumulation_steps_per_replica=16,
                        dataset_size=1_281_167, epochs=90)
    t.throughput, t.all_reduce_share, t.effective_batch, t.time_to_train_s, t.step
    print(t.time_to_train_summary())

    per micro-batch  = step - all-reduce - update + accumulate      (compute, host, syncs)
    per weight update = N x per micro-batch + all-reduce + update
    time to train    = weight updates x per weight update

A pipelined model (set_pipeline_stage_assignment or PipelineStage scopes) is sized stage by
stage on its IPUs (docs/tile_model.md, "Pipelines"): its step holds its N micro-batches and
its update, so its time to train is weight updates x that step. Every estimate names the
expected error of the operation classes that dominate it (docs/tile_model.md, "Calibration").
The largest micro-batch that fits (``max_batch_size``): powers of two up to a cap, then
bisection, with the options given, and a table of it for recomputation off and on and for
availableMemoryProportion 0.1 .. 0.6 (``--max-batch-size``)::

    m = tf_ipu.max_batch_size(model, training=True, ipu_version="bow")
    m.batch_size, m.cell(recomputation=False, available_memory_proportion=0.3)
    print(m.table_text()); m.save_html("max_batch.html")

Verdicts: ``fits`` means the fullest tile is at most its SRAM; a tile over it by at most the
tile model's margin (``MEMORY_MARGIN``, 5%) is ``within_margin`` (compile runs it, with a
warning). A failure of the tile model raises ``TileModelError`` naming the instruction.
Not ready yet: models whose inputs have no static shape apart from the batch dimension.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# ``python -m tf_ipu.estimate`` runs this module after the package imported it (for
# ``tf_ipu.estimate``); runpy warns about that, harmlessly.
warnings.filterwarnings("ignore", message=r".*'tf_ipu\.estimate' found in sys\.modules.*",
                        category=RuntimeWarning)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from device_server.emulator.arch import get_target  # noqa: E402
from device_server.emulator.errors import TileModelError  # noqa: E402
from device_server.emulator.tiles.mapping import check_variable_mapping  # noqa: E402
from device_server.emulator.tiles.replication import replication as _replication  # noqa: E402
from device_server.emulator.tiles.report import (  # noqa: E402
    MEMORY_MARGIN,
    Estimate,
    estimate_module,
    verdict_text,
)
from device_server.protocol import ALL_REDUCE_TARGET, hardware  # noqa: E402
from tf_ipu import report as _report  # noqa: E402,F401  (makes tf_ipu.report.save_html reachable)
from tf_ipu.lowering.program import lower_function  # noqa: E402

__all__ = ["MEMORY_MARGIN", "Estimate", "MaxBatchSize", "Sweep", "TileModelError", "TrainingEstimate",
           "estimate", "estimate_sweep", "main", "max_batch_size"]

_KIND_OF = {"arg": "argument", "var": "variable", "const": "constant"}

# What ``max_batch_size`` keeps while it runs (``_lowerings``): a program is lowered once per
# batch size (and pipeline), however many proportions and flags it is planned for, and planned
# once per set of tile-model arguments (a flag that changes none of them costs nothing).
_LOWERINGS: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar(
    "tf_ipu_estimate_lowerings", default=None)


@contextlib.contextmanager
def _lowerings() -> Any:
    """Within it, :func:`estimate` reuses the lowering of a (model, program, inputs, pipeline)
    it has lowered before, the tile model's estimate of a lowered program with the same
    arguments, and the weight update sized alone (the model must not change meanwhile)."""
    token = _LOWERINGS.set({})
    try:
        yield
    finally:
        _LOWERINGS.reset(token)


def _estimate_lowered(module: Any, target: Any, kinds: dict[int, str], implied: int,
                      many: dict[str, Any]) -> Estimate:
    """``estimate_module`` of a lowered program, or a copy of the one made before with the
    same arguments within ``_lowerings``."""
    kept = _LOWERINGS.get()
    if kept is None:
        return estimate_module(module, None, target, param_kinds=kinds,
                               implied_all_reduce_bytes=implied, **many)
    key = ("planned", id(module), repr(target), repr(sorted(kinds.items())), implied,
           repr(sorted(many.items())))
    if key not in kept:
        kept[key] = estimate_module(module, None, target, param_kinds=kinds,
                                    implied_all_reduce_bytes=implied, **many)
    return copy.deepcopy(kept[key])


def _lowering_key(model: Any, program: str, specs: Sequence[tf.TensorSpec],
                  pipeline: dict[str, Any] | None) -> tuple[Any, ...]:
    return (id(model), program, tuple((tuple(s.shape.as_list()), s.dtype.name) for s in specs),
            json.dumps(pipeline, sort_keys=True, default=str))


def _keras() -> Any:
    import keras

    return keras


def _input_specs(model: Any, batch_size: int, input_spec: Any) -> list[tf.TensorSpec]:
    if input_spec is not None:
        specs = input_spec if isinstance(input_spec, (list, tuple)) else [input_spec]
        out = []
        for s in specs:
            shape = [batch_size, *list(s.shape)[1:]] if s.shape.rank else list(s.shape)
            out.append(tf.TensorSpec(shape, s.dtype))
        return out
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError(
            f"tf_ipu.estimate needs the model's input shapes: model {getattr(model, 'name', model)!r} "
            "has no `inputs` (build it with keras.Input, or pass input_spec=tf.TensorSpec(...)). "
            f"Received: model.inputs={inputs!r}."
        )
    specs = []
    for x in inputs:
        shape = list(x.shape)
        if any(d is None for d in shape[1:]):
            raise ValueError(
                f"tf_ipu.estimate needs static input shapes apart from the batch: input "
                f"{getattr(x, 'name', '')!r} has shape {tuple(shape)}; pass input_spec=..."
            )
        specs.append(tf.TensorSpec([batch_size, *shape[1:]], tf.as_dtype(x.dtype)))
    return specs


def _label_specs(model: Any, batch_size: int, label_spec: Any) -> list[tf.TensorSpec]:
    if label_spec is not None:
        specs = label_spec if isinstance(label_spec, (list, tuple)) else [label_spec]
        return [tf.TensorSpec([batch_size, *list(s.shape)[1:]], s.dtype) for s in specs]
    outputs = getattr(model, "outputs", None) or []
    if not outputs:
        raise ValueError("tf_ipu.estimate(training=True) needs the model's outputs; pass label_spec=...")
    loss = getattr(model, "loss", None)
    losses = loss if isinstance(loss, (list, tuple)) else [loss] * len(outputs)
    specs = []
    for out, ls in zip(outputs, losses, strict=False):
        name = ls if isinstance(ls, str) else type(ls).__name__ if ls is not None else ""
        shape = list(out.shape)
        if "sparse" in str(name).lower():
            specs.append(tf.TensorSpec([batch_size, *shape[1:-1]], tf.int32))
        else:
            specs.append(tf.TensorSpec([batch_size, *shape[1:]], tf.as_dtype(out.dtype)))
    return specs


def _pack(specs_or_tensors: Sequence[Any]) -> Any:
    return specs_or_tensors[0] if len(specs_or_tensors) == 1 else tuple(specs_or_tensors)


def _prepare_training(model: Any, x_specs: list[tf.TensorSpec], y_specs: list[tf.TensorSpec]) -> None:
    """Creates the optimizer's and metrics' variables now (they are created lazily, and a
    traced step may not create them), without changing any weight."""
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError(
            f"tf_ipu.estimate(training=True) uses the model's compiled loss and optimizer: "
            f"call model.compile(optimizer=..., loss=...) first (model "
            f"{getattr(model, 'name', '')!r} is not compiled)."
        )
    opt = model.optimizer
    if not getattr(opt, "built", True):
        opt.build(model.trainable_variables)
    zeros_x = _pack([tf.zeros([1, *s.shape[1:]], s.dtype) for s in x_specs])
    zeros_y = _pack([tf.zeros([1, *s.shape[1:]], s.dtype) for s in y_specs])
    metrics = getattr(model, "_compile_metrics", None)
    if metrics is not None and not getattr(metrics, "built", True):
        y_pred = model(zeros_x, training=False)
        metrics.build(zeros_y, y_pred)
    loss = getattr(model, "_compile_loss", None)
    if loss is not None and not getattr(loss, "built", True):
        y_pred = model(zeros_x, training=False)
        loss.build(zeros_y, y_pred)


def _system(system: Any) -> hardware.System | None:
    if system is None or system == "":
        return None
    if isinstance(system, hardware.System):
        return system
    return hardware.get_system(str(system))


def _has_all_reduce(module: Any) -> bool:
    return any(i.opcode == "custom-call" and "custom_call_target" in i.attrs
               and i.attrs["custom_call_target"].s == ALL_REDUCE_TARGET
               for c in module.computations for i in c.instructions)


def _gradient_bytes(model: Any) -> int:
    """Bytes of the trainable variables (their gradients, summed across replicas each step)."""
    total = 0
    for v in getattr(model, "trainable_variables", []) or []:
        n = 1
        for d in v.shape:
            n *= int(d)
        total += n * tf.as_dtype(v.dtype).size
    return total


def _check_training_schedule(training: bool, accumulation: Any, dataset_size: Any, epochs: Any,
                             steps: Any) -> None:
    """The arguments of gradient accumulation and time to train, checked at the door."""
    if not isinstance(accumulation, int) or isinstance(accumulation, bool) or accumulation < 1:
        raise ValueError(
            f"gradient_accumulation_steps_per_replica must be an int >= 1 (1: no accumulation). "
            f"Received: gradient_accumulation_steps_per_replica={accumulation!r}"
        )
    if dataset_size is not None and (not isinstance(dataset_size, int) or isinstance(dataset_size, bool)
                                     or dataset_size < 1):
        raise ValueError(f"dataset_size must be a positive int (items in the dataset). "
                         f"Received: dataset_size={dataset_size!r}")
    if epochs is not None and (not isinstance(epochs, (int, float)) or isinstance(epochs, bool)
                               or not math.isfinite(epochs) or epochs <= 0):
        raise ValueError(f"epochs must be a positive number. Received: epochs={epochs!r}")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"steps (weight updates) must be a positive int. Received: steps={steps!r}")
    if epochs is not None and steps is not None:
        raise ValueError(f"give the training's length as epochs (with dataset_size) or as steps "
                         f"(weight updates), not both. Received: epochs={epochs!r}, steps={steps!r}")
    if epochs is not None and dataset_size is None:
        raise ValueError(f"epochs needs dataset_size (items per epoch). Received: epochs={epochs!r}, "
                         f"dataset_size=None")
    if not training and (accumulation > 1 or dataset_size is not None or steps is not None):
        raise ValueError(
            f"gradient accumulation and time to train apply to training steps: pass "
            f"training=True. Received: training={training!r}, "
            f"gradient_accumulation_steps_per_replica={accumulation!r}, "
            f"dataset_size={dataset_size!r}, epochs={epochs!r}, steps={steps!r}"
        )


def _plan_alone(fn: Any, specs: list[tf.TensorSpec], name: str, target: Any) -> Estimate:
    """``fn`` lowered and planned on one IPU of ``target`` (no replicas, no system)."""
    lowered = lower_function(fn, specs, name)
    params = json.loads(lowered.signature)["params"]
    kinds = {n: _KIND_OF[p["kind"]] for n, p in enumerate(params)}
    return estimate_module(lowered.module, None, target, param_kinds=kinds)


def _size_weight_update(model: Any, target: Any, in_replica: Any, name: str) -> tuple[int, int, list[str]]:
    """Device cycles, on one IPU, of the optimizer's update of the trainable variables alone
    and of adding one step's gradients into accumulators (one per trainable variable, laid out
    as it is), each lowered and planned as a program of its own; and notes. Nothing runs."""
    variables = list(getattr(model, "trainable_variables", []) or [])
    if not variables:
        return 0, 0, ["the model has no trainable variables: no weight update to separate"]
    specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's own

    def update(*grads: tf.Tensor) -> tf.Tensor:
        in_replica(lambda *g: inner.apply(list(g), variables), *grads)
        return tf.constant(0, tf.int32)

    def accumulate(*grads: tf.Tensor) -> Any:
        return in_replica(lambda *g: [tf.convert_to_tensor(v) + x for v, x in zip(variables, g, strict=True)],
                          *grads)

    sized, notes = [], []
    for what, fn in (("weight update", update), ("gradient accumulation", accumulate)):
        try:
            est = _plan_alone(fn, specs, f"{name}/{what.replace(' ', '_')}", target)
        except TileModelError:
            raise  # the tile model failed: never an arbitrary time to train
        except Exception as e:  # noqa: BLE001 - not lowered alone: goes on without it, says so
            est, why = None, f"{type(e).__name__}: {e}"
        if est is None:
            notes.append(f"the {what} could not be sized on its own ({why}): "
                         + ("it stays in every micro-batch's step" if what == "weight update"
                            else "not charged"))
            sized.append(0)
        else:
            sized.append(int(est.device_cycles))
    return sized[0], sized[1], notes


def estimate(model: Any, batch_size: int, training: bool = False, ipu_version: str = "ipu2",
             tiles_per_ipu: int = 0, *, input_spec: Any = None, label_spec: Any = None,
             replicas: int = 1, system: Any = None, ipu_ids: Sequence[int] = (),
             gradient_accumulation_steps_per_replica: int = 1, dataset_size: int | None = None,
             epochs: float | None = None, steps: int | None = None,
             recomputation: bool | None = None,
             available_memory_proportion: float | str | Mapping[str, float]
             | Sequence[float | str | Mapping[str, float] | None] | None = None,
             partials_type: str | Mapping[str, str] | None = None,
             variable_mapping: str = "consumer",
             ) -> Estimate | TrainingEstimate:
    """Estimates one step of ``model`` on an IPU preset, without running it.

    Args:
        model: a built Keras model (its ``inputs`` give the input shapes).
        batch_size: items per step (per replica; with accumulation, per micro-batch).
        training: estimate a training step (``model.train_step`` with the model's compiled
            loss and optimizer); else inference (``model(x, training=False)``).
        ipu_version: "ipu1" (GC2), "ipu2" (GC200) or "bow" (alias "ipu21").
        tiles_per_ipu: use that many tiles (0: all of the chip's).
        input_spec: ``tf.TensorSpec`` (or a list, one per input) overriding the model's input
            shapes; the first dimension is replaced by ``batch_size``.
        label_spec: the same for the labels of a training step (default: integer labels for
            sparse losses, else the outputs' shape and dtype).
        replicas: copies of the step running at once, one per IPU (data parallelism);
            ``batch_size`` is per replica.
        system: the system whose IPUs run them: a name ("bow2000", "dss8440", ...) or a
            ``device_server.protocol.hardware.System``; None: ``replicas`` plain IPUs.
        ipu_ids: which of the system's IPUs (default: the first ``replicas``).
        gradient_accumulation_steps_per_replica: micro-batches (steps of ``batch_size``) per
            weight update on each replica (Graphcore's name; 1: an update every step). The
            step is planned as one micro-batch; its all-reduce and the optimizer's update are
            charged once per N micro-batches, and each micro-batch adds its gradients into
            accumulators (training only).
        dataset_size: items in the dataset, for the time to train (with ``epochs``; alone:
            one epoch).
        epochs: passes over ``dataset_size`` items (may be fractional).
        steps: the training's length in weight updates instead (not with ``epochs``).
        recomputation: for a pipelined model (its stages set by ``PipelineStage`` or
            ``set_pipeline_stage_assignment``, its options by ``set_pipelining_options``):
            whether its backward passes recompute forward activations (None:
            ``IPUConfig.allow_recompute`` of the configured system, else off). A pipelined
            model is planned stage by stage on its IPUs (docs/tile_model.md, "Pipelines");
            recomputation checkpoints bound a stage's liveness, and a model without a
            pipeline remakes cheap element-wise results (docs/tile_model.md, "Recomputation").
        available_memory_proportion: PopLibs' ``availableMemoryProportion`` (0 .. 1, a float
            or its string) for the plans of every matmul and convolution: the share of a
            tile's memory their temporaries may use (lower: fewer temporaries, more cycles).
            None: ``IPUConfig.matmuls`` / ``convolutions.poplar_options`` of the configured
            system, else the preset's 0.6. A ``{"matmul": ..., "convolution": ...}`` dict sets
            each kind. A pipelined model's ``PipelineStageOptions``
            (``set_pipelining_options``' ``forward_propagation_stages_poplar_options``,
            ``backward_propagation_stages_poplar_options``, ``weight_update_poplar_options``)
            replace it in the pass of the stage that sets one, as on Graphcore's IPUs. For a
            pipelined model, a list with one entry per stage (a proportion, a per-kind dict,
            or None: the program's) gives each stage's forward and backward passes theirs
            instead of its ``PipelineStageOptions`` (as Graphcore's TF2 BERT passes one list
            for both); the global proportion is then the configured system's.
        partials_type: PopLibs' ``partialsType``, ``"float"`` or ``"half"``, for every matmul
            and convolution, or ``{"matmul": ..., "convolution": ...}``: FP16 products planned
            with "half" hold and exchange FP16 partial sums (half their bytes). None:
            ``IPUConfig.matmuls`` / ``convolutions`` (``partials_type`` or
            ``poplar_options["partialsType"]``) of the configured system, else "float".
        variable_mapping: how the model's variables are laid out on the tiles: "consumer"
            (as their first consumer wants them, what Graphcore's TensorFlow does) or
            "linear" (``poputil::mapTensorLinearly``, as a Poplar program maps them): a matmul
            or convolution that broadcasts a linear variable to more than 7 tiles then holds a
            rearranged copy of it while it runs (docs/tile_model.md, "Memory per tile").

    Returns:
        An :class:`Estimate`: ``.latency_s``, ``.throughput`` (items/s), ``.cycles``,
        ``.peak_tile_bytes``, ``.fits`` (the fullest tile at most its SRAM; False when it
        would not fit: never raises for that), ``.within_margin`` and ``.margin_bytes`` (over
        it by at most the tile model's 5% margin, which compile lets run with a warning),
        ``.to_json()``, ``.save_html(path)``; with replicas, ``.all_reduce_cycles``,
        ``.all_reduce_share`` and the per-IPU figures of one replica. A training estimate
        with ``gradient_accumulation_steps_per_replica`` > 1, ``dataset_size`` or ``steps``
        is a :class:`TrainingEstimate` instead: the same figures per micro-batch with the
        weight update amortized, ``.effective_batch``, ``.seconds_per_update``,
        ``.time_to_train_s``, and the step's own :class:`Estimate` as ``.step``.

    Raises:
        ValueError: a bad ``batch_size``, accumulation count or training length (naming the
            value received), or replicas the system cannot run (more than its IPUs,
            ``ipu_ids`` not one per replica, IPUs of another version).
        TileModelError: the tile model failed on the step (a limit or bug of the model),
            naming the IR instruction it was planning and its Keras layer.

    Example:
        >>> model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        >>> r = tf_ipu.estimate(model, batch_size=32, ipu_version="bow")
        >>> r.fits, f"{r.latency_s * 1e6:.1f} us", f"{r.throughput:,.0f} items/s"
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        >>> t = tf_ipu.estimate(model, 32, training=True, ipu_version="bow", replicas=4,
        ...                     system="bow2000", gradient_accumulation_steps_per_replica=8,
        ...                     dataset_size=60_000, epochs=10)
        >>> t.effective_batch, t.all_reduce_share, t.time_to_train_summary()
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int. Received: batch_size={batch_size!r}")
    accumulation = gradient_accumulation_steps_per_replica
    _check_training_schedule(training, accumulation, dataset_size, epochs, steps)
    target = get_target(ipu_version, tiles_per_ipu)
    system = _system(system)
    many = {"replicas": replicas, "system": system, "ipu_ids": tuple(ipu_ids)}
    _replication(replicas, system, tuple(ipu_ids), target)  # checked before lowering
    per_stage = isinstance(available_memory_proportion, (list, tuple))
    many["memory_proportions"] = _memory_proportions(
        None if per_stage else available_memory_proportion)
    many["partials_types"] = _partials_types(partials_type)
    if check_variable_mapping(variable_mapping, "tf_ipu.estimate: variable_mapping") == "linear":
        many["variable_mapping"] = "linear"
    if recomputation:  # a program without a pipeline: allow_recompute's cheap remaking
        many["recomputation"] = True
    x_specs = _input_specs(model, batch_size, input_spec)
    name = getattr(model, "name", "model")
    t0 = time.perf_counter()
    # A model built under a strategy (IPUStrategy) is traced as its strategy runs it: its
    # variables (optimizer slots built here) in the strategy's scope, the step in a replica
    # context. Nothing runs; the model's state is left as fit would find it.
    strategy = getattr(model, "_distribute_strategy", None)

    def scope() -> Any:  # a new context manager each time it is entered
        return strategy.scope() if strategy is not None else contextlib.nullcontext()

    def in_replica(fn: Any, *args: Any) -> Any:
        if strategy is None:
            return fn(*args)
        lowering = getattr(strategy, "lowering", None)
        with lowering() if lowering is not None else contextlib.nullcontext():
            return strategy.extended.call_for_each_replica(fn, args=args)

    with scope():
        if training:
            y_specs = _label_specs(model, batch_size, label_spec)
            _prepare_training(model, x_specs, y_specs)
            nx = len(x_specs)

            def step(*args: tf.Tensor) -> Any:
                return in_replica(model.train_step, (_pack(args[:nx]), _pack(args[nx:])))

            specs = [*x_specs, *y_specs]
            program = f"{name}/train_step[batch={batch_size}]"
        else:
            def step(*args: tf.Tensor) -> Any:
                return in_replica(lambda x: model(x, training=False), _pack(args))

            specs = x_specs
            program = f"{name}/predict[batch={batch_size}]"
        pipeline = _pipeline_of(model, recomputation)
        if pipeline is not None:
            program = f"{program[:-1]}, stages={pipeline['stages']}]"
        kept = _LOWERINGS.get()
        key = _lowering_key(model, program, specs, pipeline)
        lowered = kept.get(key) if kept is not None else None
        if lowered is None and pipeline is None:
            lowered = lower_function(step, specs, program)
        elif lowered is None:  # each layer call's ops tagged with its stage, as IPUStrategy does
            from tf_ipu import pipelining

            with pipelining.tagging(model, pipelining.stages_of(model)):
                lowered = lower_function(step, specs, program, pipeline=pipeline)
        if kept is not None:
            kept[key] = lowered
        if pipeline is not None:
            many.update(pipeline_stages=pipeline["stages"], stage_ipus=tuple(pipeline["stage_ipus"]),
                        ipus_per_replica=pipeline["ipus_per_replica"],
                        pipeline_schedule=pipeline["schedule"],
                        micro_batches=pipeline["micro_batches"],
                        recomputation=pipeline["recomputation"],
                        optimizer_state_offload=pipeline.get("offload"),
                        optimizer_state_sharding=bool(pipeline.get("sharding", False)))
    entries = (_stage_proportions(available_memory_proportion, pipeline, name) if per_stage
               else (pipeline or {}).get("stage_memory_proportions") or ())
    if entries:  # PipelineStageOptions (or the list given here), per stage and pass
        many["stage_memory_proportions"] = tuple(tuple(e) for e in entries)
    lower_s = time.perf_counter() - t0
    params = json.loads(lowered.signature)["params"]
    kinds = {n: _KIND_OF[p["kind"]] for n, p in enumerate(params)}
    implied = 0
    if training and replicas > 1 and not _has_all_reduce(lowered.module):
        implied = _gradient_bytes(model)  # the cross-replica gradient sum of each step
    t1 = time.perf_counter()
    report = _estimate_lowered(lowered.module, target, kinds, implied, many)
    plan_s = time.perf_counter() - t1
    report.items_per_call = batch_size
    report.context = {
        **report.context,
        "model": name, "batch_size": batch_size, "training": bool(training),
        "inputs": ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in specs),
        "lower_seconds": round(lower_s, 3), "plan_seconds": round(plan_s, 3),
    }
    if report.replicas > 1:
        report.context["global_batch"] = batch_size * report.replicas
    own, _ = _accumulation_options(model)
    if training and own > 1 and accumulation == 1:
        report.notes.append(f"the model's set_gradient_accumulation_options({own}) is not applied "
                            f"here: pass gradient_accumulation_steps_per_replica={own}")
    if pipeline is not None and training and (dataset_size is not None or steps is not None):
        if accumulation != 1:
            raise ValueError(
                f"tf_ipu.estimate: {name} is pipelined: its micro-batches per weight update are "
                f"set_pipelining_options' gradient_accumulation_steps_per_replica "
                f"({pipeline['micro_batches']}); leave gradient_accumulation_steps_per_replica "
                f"at 1 here. Received: {accumulation}")
        optimizer = getattr(model, "optimizer", None)
        return TrainingEstimate(
            step=report, gradient_accumulation_steps_per_replica=pipeline["micro_batches"],
            accumulator_bytes=0, dataset_size=dataset_size,
            epochs=(1 if steps is None and epochs is None else epochs), steps=steps,
            precision=str(getattr(getattr(model, "dtype_policy", None), "name", "") or ""),
            optimizer=type(optimizer).__name__ if optimizer is not None else "",
            notes=[f"pipelined: {pipeline['stages']} stages, {pipeline['schedule']} schedule, "
                   f"{pipeline['micro_batches']} micro-batches per weight update"],
            pipelined=True)
    if not training or (accumulation == 1 and dataset_size is None and steps is None):
        return report
    t2 = time.perf_counter()
    kept = _LOWERINGS.get()
    sized = kept.get(("update", id(model), repr(target))) if kept is not None else None
    if sized is None:
        with scope():
            sized = _size_weight_update(model, target, in_replica, name)
        if kept is not None:
            kept[("update", id(model), repr(target))] = sized
    update, accumulate, notes = sized[0], sized[1], list(sized[2])
    report.context["update_seconds"] = round(time.perf_counter() - t2, 3)
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    return TrainingEstimate(
        step=report, gradient_accumulation_steps_per_replica=accumulation,
        update_cycles=min(update, report.device_cycles), accumulate_cycles=accumulate,
        accumulator_bytes=_gradient_bytes(model), dataset_size=dataset_size,
        epochs=(1 if dataset_size is not None and steps is None and epochs is None else epochs),
        steps=steps, precision=str(getattr(getattr(model, "dtype_policy", None), "name", "") or ""),
        optimizer=type(optimizer).__name__ if optimizer is not None else "", notes=notes)


def _memory_proportions(given: float | str | Mapping[str, float] | None,
                        what: str = "tf_ipu.estimate: available_memory_proportion"
                        ) -> dict[str, float]:
    """Opcode -> availableMemoryProportion of the plans: ``given`` for dot and convolution,
    else the configured ``IPUConfig``'s poplar_options (else none: the preset's). ``what``
    names the argument in a ValueError."""
    from tf_ipu import config, runtime

    if isinstance(given, Mapping):  # per kind of product, as Poplar's options are set
        ops = {"matmul": "dot", "matmuls": "dot", "dot": "dot", "convolution": "convolution",
               "convolutions": "convolution"}
        unknown = sorted(set(given) - set(ops))
        if unknown:
            raise ValueError(f"{what} keys are 'matmul' and 'convolution'. Received: "
                             f"{dict(given)!r}")
        return {ops[k]: config._memory_proportion(f"{what}[{k!r}]", v) for k, v in given.items()}
    if given is not None:
        amp = config._memory_proportion(what, given)
        return {"dot": amp, "convolution": amp}
    cfg = runtime.get_runtime().config
    out = {}
    for opcode, group in (("dot", "matmuls"), ("convolution", "convolutions")):
        amp = getattr(getattr(cfg, group, None), "available_memory_proportion", None)
        if amp is not None:
            out[opcode] = float(amp)
    return out


def _stage_proportions(given: Sequence[Any], pipeline: dict[str, Any] | None,
                       name: str) -> list[tuple[str, int, str, float]]:
    """``available_memory_proportion`` given as a list, one entry per pipeline stage: the
    forward and backward availableMemoryProportion entries of each stage (a proportion for
    both kinds of product, a per-kind dict, or None: none for that stage). ValueError
    naming the stage for a bad entry, or when the model is not pipelined or has another
    number of stages."""
    what = "tf_ipu.estimate: available_memory_proportion"
    if pipeline is None:
        raise ValueError(f"{what} is a list (one proportion per pipeline stage), but {name} is "
                         f"not pipelined: give one proportion. Received: {list(given)!r}")
    if len(given) != pipeline["stages"]:
        raise ValueError(f"{what} gives {len(given)} proportions for the {pipeline['stages']} "
                         f"pipeline stages of {name}: give one per stage. Received: "
                         f"{list(given)!r}")
    out = []
    for stage, value in enumerate(given):
        if value is None:
            continue
        kinds = _memory_proportions(value, f"{what}[{stage}] (pipeline stage {stage})")
        for opcode, amp in sorted(kinds.items()):
            kind = "matmul" if opcode == "dot" else "convolution"
            out += [("forward", stage, kind, amp), ("backward", stage, kind, amp)]
    return out


def _partials_types(given: str | Mapping[str, str] | None) -> dict[str, str]:
    """Opcode -> partialsType of the plans: ``given`` for dot and convolution, else the
    configured ``IPUConfig``'s (else none: FP32 partials)."""
    from tf_ipu import runtime

    ops = {"matmul": "dot", "matmuls": "dot", "dot": "dot", "convolution": "convolution",
           "convolutions": "convolution"}
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(ops))
        if unknown:
            raise ValueError(f"tf_ipu.estimate: partials_type keys are 'matmul' and "
                             f"'convolution'. Received: {dict(given)!r}")
        chosen = {ops[k]: v for k, v in given.items()}
    elif given is not None:
        chosen = {"dot": given, "convolution": given}
    else:
        cfg = runtime.get_runtime().config
        chosen = {}
        for opcode, group in (("dot", "matmuls"), ("convolution", "convolutions")):
            kind = getattr(getattr(cfg, group, None), "effective_partials_type", None)
            if kind is not None:
                chosen[opcode] = kind
    out = {}
    for opcode, kind in chosen.items():
        if not isinstance(kind, str) or kind.lower() not in ("float", "half"):
            raise ValueError(f"tf_ipu.estimate: partials_type must be 'float' or 'half' "
                             f"(PopLibs' partialsType). Received: {kind!r}")
        out[opcode] = kind.lower()
    return out


def _pipeline_of(model: Any, recomputation: bool | None) -> dict[str, Any] | None:
    """A pipelined model's stages (``set_pipeline_stage_assignment`` or PipelineStage scopes,
    and ``set_pipelining_options``), as the device would run them, or None. Recomputation:
    as given, else ``IPUConfig.allow_recompute`` of the configured system (else off)."""
    from tf_ipu import pipelining, runtime

    pipeline = pipelining.plan(model, 1)
    if pipeline is not None:
        if recomputation is None:
            cfg = runtime.get_runtime().config
            recomputation = bool(getattr(cfg, "allow_recompute", False))
        pipeline["recomputation"] = bool(recomputation)
    return pipeline


def _accumulation_options(model: Any) -> tuple[int, str]:
    """The model's own ``set_gradient_accumulation_options`` ((1, "sum") if never set)."""
    from tf_ipu import accumulation

    return accumulation.options(model)


def _fmt_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:,.3f} ms"
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:,.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:,.2f} h"
    return f"{seconds / 86400:,.2f} days"


@dataclass
class TrainingEstimate:
    """A training step with gradient accumulation and the time to train (``tf_ipu.estimate``
    with ``gradient_accumulation_steps_per_replica``, ``dataset_size``/``epochs`` or
    ``steps``).

    ``step`` is the per-step :class:`Estimate` (one micro-batch, planned as without
    accumulation: its all-reduce and the optimizer's update inside). From its fields, with N
    micro-batches per weight update (``update_cycles``, ``accumulate_cycles``: 0 with N = 1)::

        micro_batch_cycles  = step.cycles - step.all_reduce_cycles - update_cycles
                              + accumulate_cycles        (compute, host transfers, syncs)
        weight_update_cycles = step.all_reduce_cycles + update_cycles   (once per update)
        cycles_per_update   = N x micro_batch_cycles + weight_update_cycles
        cycles              = cycles_per_update / N      (per micro-batch, amortized)
        throughput          = replicas x batch x N / seconds_per_update
        effective_batch     = batch x N x replicas       (items per weight update)
        time_to_train_s     = weight updates x seconds_per_update

    ``cycles``, ``seconds``, ``latency_s``, ``all_reduce_cycles`` and ``throughput`` are per
    micro-batch with the weight update amortized (so ``all_reduce_share`` = ``all_reduce_cycles
    / cycles`` as for an Estimate); ``peak_tile_bytes`` and ``fits`` count the accumulators.
    Any other attribute is the step's (``host_cycles``, ``device_cycles``, ``top_ops``, ...).

    Example:
        >>> t = tf_ipu.estimate(model, 4, training=True, ipu_version="bow", replicas=4,
        ...                     system="bow2000", gradient_accumulation_steps_per_replica=16,
        ...                     dataset_size=1_281_167, epochs=90)
        >>> t.throughput, t.all_reduce_share, t.effective_batch, t.time_to_train_s
        >>> t.with_accumulation(64).time_to_train(dataset_size=1_281_167, epochs=90)
    """

    step: Estimate
    gradient_accumulation_steps_per_replica: int = 1
    update_cycles: int = 0        # the optimizer's update alone, one IPU (inside step.device_cycles)
    accumulate_cycles: int = 0    # adding one micro-batch's gradients into the accumulators
    accumulator_bytes: int = 0    # per IPU: one accumulator per trainable variable, its dtype
    dataset_size: int | None = None
    epochs: float | None = None
    steps: int | None = None      # the training's length in weight updates (instead of epochs)
    precision: str = ""           # the model's dtype policy ("mixed_float16", "float32")
    optimizer: str = ""
    notes: list[str] = field(default_factory=list)
    # A pipelined step: the tile model's pipeline already spreads the weight update (and the
    # all-reduce) over its micro-batches: ``step.cycles`` is one micro-batch's share.
    pipelined: bool = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "step":  # copy/pickle probe before __init__
            raise AttributeError(name)
        return getattr(self.step, name)

    # -- the schedule ------------------------------------------------------------------------
    @property
    def accumulating(self) -> bool:
        """True with N > 1 (accumulators, the update once per N micro-batches)."""
        return self.gradient_accumulation_steps_per_replica > 1

    @property
    def micro_batch_cycles(self) -> float:
        """Cycles of one micro-batch without the weight update: compute, host transfers,
        replica syncs (and the accumulation of its gradients)."""
        s = self.step
        if self.pipelined:
            return float(s.cycles)
        if not self.accumulating:
            return float(s.cycles - s.all_reduce_cycles)
        return float(s.cycles - s.all_reduce_cycles - self.update_cycles + self.accumulate_cycles)

    @property
    def weight_update_cycles(self) -> float:
        """Cycles of one weight update: the gradients' all-reduce and (with N > 1) the
        optimizer's update."""
        if self.pipelined:
            return 0.0  # in the micro-batches' share (the pipeline's time per update)
        return float(self.step.all_reduce_cycles + (self.update_cycles if self.accumulating else 0))

    @property
    def cycles_per_update(self) -> float:
        return self.gradient_accumulation_steps_per_replica * self.micro_batch_cycles \
            + self.weight_update_cycles

    @property
    def seconds_per_update(self) -> float:
        return self.cycles_per_update / self.step.clock_hz

    @property
    def cycles(self) -> float:
        """Cycles per micro-batch, the weight update amortized over N."""
        return self.cycles_per_update / self.gradient_accumulation_steps_per_replica

    @property
    def seconds(self) -> float:
        return self.cycles / self.step.clock_hz

    @property
    def latency_s(self) -> float:
        """Seconds per micro-batch, the weight update amortized (``seconds``)."""
        return self.seconds

    @property
    def all_reduce_cycles(self) -> float:
        """The all-reduce's cycles per micro-batch: the step's over N (a pipelined step's
        are already one micro-batch's share)."""
        if self.pipelined:
            return float(self.step.all_reduce_cycles)
        return self.step.all_reduce_cycles / self.gradient_accumulation_steps_per_replica

    def _per_update(self, cycles: float) -> float:
        """``cycles`` of the step as a share of the time per weight update (0..1): a
        pipelined step's figures are one micro-batch's share of an update already."""
        if self.cycles_per_update <= 0:
            return 0.0
        n = self.gradient_accumulation_steps_per_replica if self.pipelined else 1
        return n * cycles / self.cycles_per_update

    @property
    def all_reduce_share(self) -> float:
        """The all-reduce's share of the time per weight update (0..1)."""
        return self._per_update(self.step.all_reduce_cycles)

    @property
    def all_reduce_links(self) -> list[str]:
        """The links the all-reduce crosses: IPU-Links, and GW-Links across Pod64s."""
        return self.step.all_reduce_links

    @property
    def all_reduce_gw_share(self) -> float:
        """The GW-Link part of the all-reduce's share of the time per weight update (0..1)."""
        return self._per_update(self.step.all_reduce_gw_cycles)

    @property
    def effective_batch(self) -> int:
        """Items per weight update: batch x N x replicas."""
        return self.step.items_per_call * self.gradient_accumulation_steps_per_replica \
            * max(1, self.step.replicas)

    @property
    def throughput(self) -> float:
        """Items per second of all replicas, the weight update amortized."""
        return self.effective_batch / self.seconds_per_update if self.cycles_per_update > 0 else 0.0

    # -- memory ------------------------------------------------------------------------------
    def _peak(self) -> tuple[int, int]:
        """(tile, bytes) of the fullest tile with the accumulators (laid out as the trainable
        variables, which are that share of the step's variable bytes on every tile)."""
        s = self.step
        if not self.accumulating or not self.accumulator_bytes:
            return s.peak_tile, s.peak_tile_bytes
        mem = s.memory or {}
        variables = mem.get("variables") or []
        held = float(sum(variables))
        if not held:
            return s.peak_tile, s.peak_tile_bytes + math.ceil(self.accumulator_bytes / s.tiles_per_ipu)
        share = self.accumulator_bytes / held
        totals = [sum(col) + v * share for col, v in zip(zip(*mem.values(), strict=True), variables,
                                                         strict=True)]
        tile = max(range(len(totals)), key=totals.__getitem__)
        return tile, int(math.ceil(totals[tile]))

    @property
    def peak_tile_bytes(self) -> int:
        """The fullest tile's bytes, with the accumulators (N > 1)."""
        return self._peak()[1]

    @property
    def peak_tile(self) -> int:
        return self._peak()[0]

    @property
    def fits(self) -> bool | None:
        """The fullest tile, with the accumulators, at most its SRAM (None: unknown)."""
        if self.step.fits is None:
            return None
        return self.peak_tile_bytes <= self.step.tile_bytes_limit

    @property
    def within_margin(self) -> bool:
        """Over the tile's SRAM, with the accumulators, by at most the tile model's margin."""
        return self.fits is False and \
            self.peak_tile_bytes <= self.step.tile_bytes_limit + self.step.margin_bytes

    @property
    def refused(self) -> bool:
        """Over by more than the margin: compile would refuse it."""
        return self.fits is False and not self.within_margin

    # -- time to train -----------------------------------------------------------------------
    def updates(self, dataset_size: int | None = None, epochs: float | None = None,
                steps: int | None = None) -> int | None:
        """Weight updates of a training of ``steps`` updates, or of ``epochs`` passes over
        ``dataset_size`` items (ceil(epochs x dataset_size / effective_batch): the dataset
        streamed through, the last update completed); default: the estimate's own length."""
        if dataset_size is None and epochs is None and steps is None:
            dataset_size, epochs, steps = self.dataset_size, self.epochs, self.steps
        _check_training_schedule(True, self.gradient_accumulation_steps_per_replica, dataset_size,
                                 epochs, steps)
        if steps is not None:
            return steps
        if dataset_size is None:
            return None
        return math.ceil((1 if epochs is None else epochs) * dataset_size / self.effective_batch)

    def time_to_train(self, dataset_size: int | None = None, epochs: float | None = None,
                      steps: int | None = None) -> float | None:
        """Seconds to train: weight updates (see :meth:`updates`) x ``seconds_per_update``;
        None without a length."""
        n = self.updates(dataset_size, epochs, steps)
        return None if n is None else n * self.seconds_per_update

    @property
    def time_to_train_s(self) -> float | None:
        """Seconds to train for the estimate's ``dataset_size``/``epochs`` or ``steps``."""
        return self.time_to_train()

    def with_accumulation(self, gradient_accumulation_steps_per_replica: int) -> TrainingEstimate:
        """The same step with another accumulation count (nothing is planned again)."""
        _check_training_schedule(True, gradient_accumulation_steps_per_replica, None, None, None)
        from dataclasses import replace

        return replace(self, gradient_accumulation_steps_per_replica=gradient_accumulation_steps_per_replica)

    # -- output ------------------------------------------------------------------------------
    def configuration(self) -> str:
        """The configuration the figures assume, in words (IPUs, system, batch, accumulation,
        replicas, precision, optimizer)."""
        s = self.step
        product = (s.preset or {}).get("product") or s.ipu_version
        r = max(1, s.replicas)
        where = f"{r} {product} IPU{'s' if r > 1 else ''}" + (f" of {s.system}" if s.system else "")
        kind = ", ".join(x for x in (self.precision, self.optimizer) if x)
        return (f"{where}, batch {s.items_per_call} x accumulation "
                f"{self.gradient_accumulation_steps_per_replica} x {r} replica{'s' if r > 1 else ''}"
                f" = effective batch {self.effective_batch:,}" + (f", {kind}" if kind else ""))

    def time_to_train_summary(self) -> str:
        """One line: the training's length, the time to train and the configuration."""
        n = self.updates()
        if n is None:
            return "time to train: no length given (dataset_size with epochs, or steps)"
        t = n * self.seconds_per_update
        length = (f"{self.epochs:g} epoch{'s' if self.epochs != 1 else ''} of {self.dataset_size:,} "
                  f"items = {n:,} weight updates" if self.steps is None else f"{n:,} weight updates")
        line = (f"time to train {self.step.context.get('model', self.step.program or 'the model')}: "
                f"{length} x {self.seconds_per_update * 1e3:,.3f} ms = {_fmt_duration(t)} "
                f"({self.throughput:,.1f} items/s) on {self.configuration()}")
        error = self.expected_error_summary()
        return f"{line}; {error}" if error else line

    @property
    def expected_error(self) -> list[dict[str, Any]]:
        """The step's dominant calibration classes with their held-out errors."""
        return self.step.expected_error

    def expected_error_summary(self) -> str:
        """One line: the expected error of the classes that dominate the estimate."""
        from device_server.emulator import calibration

        return calibration.describe(self.step.expected_error)

    def summary(self) -> str:
        """One line: the configuration, throughput, time per micro-batch and per update, the
        all-reduce's share, memory (and the time to train)."""
        s = self.step
        line = (f"{s.program or 'program'} on {self.configuration()}: "
                f"{self.throughput:,.1f} items/s, {self.seconds * 1e3:.3f} ms per micro-batch, "
                f"{self.seconds_per_update * 1e3:.3f} ms per weight update (all-reduce "
                f"{self.all_reduce_share:.1%} of it"
                + (f", over {' and '.join(self.all_reduce_links)}" if self.all_reduce_links else "")
                + (f", {self.all_reduce_gw_share:.1%} on the GW-Links" if self.all_reduce_gw_share else "")
                + f"); peak tile {self.peak_tile} "
                f"{self.peak_tile_bytes:,} B of {s.tile_bytes_limit:,} B"
                + (" with the accumulators" if self.accumulating else "")
                + verdict_text(self))
        if self.updates() is not None:
            t = self.time_to_train_s or 0.0
            line += f"; {self.updates():,} weight updates: {_fmt_duration(t)}"
        return line

    def __repr__(self) -> str:
        return f"<TrainingEstimate {self.summary()}>"

    def to_dict(self) -> dict[str, Any]:
        """The step's report (``Estimate.to_dict``) with a ``training`` entry of these figures
        and the summary in its notes."""
        d = self.step.to_dict()
        d["training"] = {
            "gradient_accumulation_steps_per_replica": self.gradient_accumulation_steps_per_replica,
            "update_cycles": self.update_cycles, "accumulate_cycles": self.accumulate_cycles,
            "accumulator_bytes": self.accumulator_bytes,
            "micro_batch_cycles": self.micro_batch_cycles,
            "weight_update_cycles": self.weight_update_cycles,
            "cycles_per_update": self.cycles_per_update, "seconds_per_update": self.seconds_per_update,
            "cycles": self.cycles, "seconds": self.seconds, "throughput": self.throughput,
            "all_reduce_share": self.all_reduce_share, "all_reduce_links": self.all_reduce_links,
            "all_reduce_gw_share": self.all_reduce_gw_share, "effective_batch": self.effective_batch,
            "peak_tile": self.peak_tile, "peak_tile_bytes": self.peak_tile_bytes, "fits": self.fits,
            "within_margin": self.within_margin, "precision": self.precision, "optimizer": self.optimizer,
            "dataset_size": self.dataset_size, "epochs": self.epochs, "steps": self.steps,
            "updates": self.updates(), "time_to_train_s": self.time_to_train_s,
            "summary": self.summary(),
        }
        d["notes"] = [*d["notes"], *self.notes, self.summary()]
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent,
                          default=lambda x: x.item() if hasattr(x, "item") else str(x))

    def save_html(self, path: str) -> str:
        """The step's HTML report, with this summary among its notes; returns the path."""
        return _report.save_html(self.to_dict(), path)

    def _repr_html_(self) -> str:
        return _report.render_html(self.to_dict())


@dataclass
class Sweep:
    """Estimates of one model at several batch sizes."""

    estimates: list[Estimate | TrainingEstimate]
    points: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"points": self.points, "estimates": [e.to_dict() for e in self.estimates]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"points": self.points}, indent=indent)

    def best(self) -> Estimate | TrainingEstimate:
        """The highest-throughput estimate that fits (else the smallest batch)."""
        fitting = [e for e in self.estimates if e.fits]
        if not fitting:
            return min(self.estimates, key=lambda e: e.items_per_call)
        return max(fitting, key=lambda e: e.throughput)

    def save_html(self, path: str, batch_size: int | None = None) -> str:
        """The report of ``batch_size`` (default: :meth:`best`) with the sweep plotted."""
        chosen = self.best() if batch_size is None else \
            next(e for e in self.estimates if e.items_per_call == batch_size)
        return chosen.save_html(path)

    def __repr__(self) -> str:
        pts = ", ".join(f"{p['batch_size']}: {p['latency_s'] * 1e3:.3f} ms/{p['throughput']:,.0f}/s"
                        + ("" if p["fits"] else " (no fit)") for p in self.points)
        return f"Sweep({pts})"


def estimate_sweep(model: Any, batch_sizes: Sequence[int], training: bool = False,
                   ipu_version: str = "ipu2", tiles_per_ipu: int = 0, *,
                   gradient_accumulation_steps_per_replica: int = 1, **kwargs: Any) -> Sweep:
    """:func:`estimate` at each of ``batch_sizes``: latency and throughput vs batch size.

    Every estimate carries the sweep (``report.sweep``), so its HTML page plots it. With
    ``replicas=R`` (and ``system=...``) in ``kwargs`` the batch sizes are per replica and each
    point's throughput counts all R replicas' items. With
    ``gradient_accumulation_steps_per_replica=N`` (training) they are micro-batches: each
    estimate is a :class:`TrainingEstimate` and each point has its ``effective_batch``, its
    throughput and all-reduce share with the weight update amortized over N.

    Raises:
        TileModelError: the tile model failed at one of the batch sizes (as :func:`estimate`).

    Example:
        >>> sweep = tf_ipu.estimate_sweep(model, [1, 2, 4, 8, 16])
        >>> [(p["batch_size"], p["latency_s"], p["throughput"]) for p in sweep.points]
        >>> sweep.save_html("sweep.html")
    """
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"batch_sizes must be positive ints. Received: {list(batch_sizes)!r}")
    estimates = [estimate(model, b, training, ipu_version, tiles_per_ipu,
                          gradient_accumulation_steps_per_replica=gradient_accumulation_steps_per_replica,
                          **kwargs) for b in sizes]
    points = []
    for e in estimates:
        pt = {"batch_size": e.items_per_call, "latency_s": e.latency_s, "throughput": e.throughput,
              "fits": e.fits, "within_margin": e.within_margin,
              "peak_tile_bytes": e.peak_tile_bytes, "cycles": e.cycles,
              "replicas": e.replicas, "all_reduce_share": e.all_reduce_share}
        if isinstance(e, TrainingEstimate):
            pt.update(gradient_accumulation_steps_per_replica=e.gradient_accumulation_steps_per_replica,
                      effective_batch=e.effective_batch, seconds_per_update=e.seconds_per_update)
            if e.time_to_train_s is not None:
                pt["time_to_train_s"] = e.time_to_train_s
        points.append(pt)
    for e in estimates:
        (e.step if isinstance(e, TrainingEstimate) else e).sweep = points
    return Sweep(estimates, points)


# ------------------------------------------------------------------- largest micro-batch

#: The proportions of ``max_batch_size``'s table (PopLibs' availableMemoryProportion).
MAX_BATCH_PROPORTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
#: Where the search stops by default: a micro-batch of 4096 that still fits is reported as
#: ">= 4096" (``capped``), not searched further.
MAX_BATCH_LIMIT = 4096
# Options of ``estimate`` that change the time to train but not memory: left out of the search.
_LENGTH_OPTIONS = ("dataset_size", "epochs", "steps")


@dataclass
class MaxBatchSize:
    """The largest micro-batch that fits (``max_batch_size``): the fullest tile at most its SRAM.

    Attributes:
        batch_size: the answer for the options given (0: not even a micro-batch of 1 fits).
        capped: True when ``limit`` itself fits (the answer is then ``limit``, a lower bound).
        limit: where the search stopped.
        training: a training step (else inference).
        ipu_version: the preset.
        options: the :func:`estimate` options given (besides batch size, training, version).
        table: one cell per (recomputation, availableMemoryProportion): dicts with
            ``recomputation``, ``available_memory_proportion``, ``batch_size``, ``capped``.
        probes: the answer's search, in order: ``batch_size``, ``fits``, ``within_margin``,
            ``peak_tile_bytes``, ``tile_bytes_limit``.
        estimate: the estimate at the answer (at batch 1 when the answer is 0), its HTML
            report carrying the table.
        estimates: how many verdicts the search asked for (all cells).
        plans: how many of them the tile model planned (the others had the same arguments
            as one before: recomputation where it changes nothing, for one).
        seconds: the time the search took.
    """

    batch_size: int
    capped: bool
    limit: int
    training: bool
    ipu_version: str
    options: dict[str, Any] = field(default_factory=dict)
    table: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    estimate: Estimate | TrainingEstimate | None = None
    estimates: int = 0
    plans: int = 0
    seconds: float = 0.0

    def cell(self, recomputation: bool, available_memory_proportion: float) -> int:
        """The table's largest micro-batch for ``recomputation`` and that proportion.

        Raises:
            KeyError: a cell the table does not have (naming it).
        """
        for c in self.table:
            if c["recomputation"] == bool(recomputation) and \
                    math.isclose(c["available_memory_proportion"], float(available_memory_proportion)):
                return int(c["batch_size"])
        raise KeyError(f"max_batch_size's table has no cell for recomputation={recomputation!r}, "
                       f"available_memory_proportion={available_memory_proportion!r}; it has "
                       f"{sorted({c['available_memory_proportion'] for c in self.table})}")

    def options_text(self) -> str:
        """The options given, as ``key=value, ...`` ("defaults" without any)."""
        return ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items())) or "defaults"

    def summary(self) -> str:
        """One line: the answer, with its limit and where it came from."""
        what = "training" if self.training else "inference"
        n = f">= {self.batch_size:,} (the search's cap)" if self.capped else f"{self.batch_size:,}"
        return (f"largest {what} micro-batch that fits on {self.ipu_version} ({self.options_text()}): "
                f"{n}; {self.estimates} estimates ({self.plans} planned) in {self.seconds:.1f} s")

    def table_text(self) -> str:
        """The table as text: a row per availableMemoryProportion, recomputation off and on."""
        amps = sorted({float(c["available_memory_proportion"]) for c in self.table})
        by = {(float(c["available_memory_proportion"]), bool(c["recomputation"])): c for c in self.table}

        def cell(c: dict[str, Any] | None) -> str:
            if c is None:
                return "-"
            return f">={c['batch_size']}" if c.get("capped") else str(c["batch_size"])

        lines = [f"{'availableMemoryProportion':>26}  {'recomputation off':>17}  {'recomputation on':>16}"]
        lines += [f"{a:>26g}  {cell(by.get((a, False))):>17}  {cell(by.get((a, True))):>16}" for a in amps]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able), without the estimate (its report carries this as
        ``max_batch``)."""
        return {"batch_size": self.batch_size, "capped": self.capped, "limit": self.limit,
                "training": self.training, "ipu_version": self.ipu_version,
                "options": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                            for k, v in self.options.items()},
                "options_text": self.options_text(), "table": list(self.table),
                "probes": list(self.probes), "estimates": self.estimates, "plans": self.plans,
                "seconds": round(self.seconds, 3), "memory_margin": MEMORY_MARGIN}

    def save_html(self, path: str) -> str:
        """The report of the estimate at the answer, with the table; returns the path."""
        if self.estimate is None:
            raise ValueError("max_batch_size made no estimate to report.")
        return self.estimate.save_html(path)

    def __repr__(self) -> str:
        return f"<MaxBatchSize {self.summary()}>"


def _largest(fits: Callable[[int], bool], limit: int) -> tuple[int, bool]:
    """The largest n in 1 .. ``limit`` with ``fits(n)`` (0: none) as the search finds it: n = 1,
    2, 4, ... (``limit`` last) until one does not fit, then bisection between the last that
    fits and the first that does not; and whether ``limit`` itself fits. The answer fits and
    the next does not; a larger n may fit again where the planner changes plans (memory is not
    always monotone in the batch), which the search does not look for."""
    lo, n = 0, 1
    while True:
        n = min(n, limit)
        if not fits(n):
            hi = n
            break
        lo = n
        if n == limit:
            return limit, True
        n *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


def max_batch_size(model: Any, training: bool = False, ipu_version: str = "ipu2",
                   tiles_per_ipu: int = 0, *, limit: int = MAX_BATCH_LIMIT, table: bool = True,
                   **estimate_options: Any) -> MaxBatchSize:
    """The largest micro-batch of ``model`` that fits an IPU (its fullest tile at most its
    SRAM: ``Estimate.fits``; the tile model's margin does not count), by :func:`estimate`.

    The answer, for the options given: micro-batches 1, 2, 4, ... up to ``limit`` until one
    does not fit, then bisection between the last that fits and the first that does not: the
    answer fits and the next does not. (Memory is not always monotone in the batch: where
    the planner changes a product's split, a larger batch may fit again; the search does not
    look past the first power of two that does not fit.) The table is the same search for
    recomputation off and on (``recomputation=``) and each availableMemoryProportion of 0.1 ..
    0.6 (``available_memory_proportion=``). A program is lowered once per batch size, and
    planned once per set of tile-model arguments: a flag that changes nothing of what the tile
    model is given (recomputation, where :func:`estimate` does not apply it) costs nothing. Each
    other estimate plans the program again, seconds for a large model; ``table=False`` skips
    the table's 12 searches.

    Args:
        model: a built Keras model (see :func:`estimate`; compiled for ``training``).
        training: size a training step (else inference).
        ipu_version: "ipu1", "ipu2" or "bow".
        tiles_per_ipu: use that many tiles (0: all of the chip's).
        limit: the largest micro-batch tried (4096 by default); if it fits, the answer is
            ``limit`` with ``capped`` True.
        table: also compute the table (12 searches).
        **estimate_options: any other option of :func:`estimate` (``replicas``, ``system``,
            ``gradient_accumulation_steps_per_replica``, ``recomputation``,
            ``available_memory_proportion``, ``input_spec``, ...); the training's length
            (``dataset_size``, ``epochs``, ``steps``) changes no memory and is ignored.

    Returns:
        A :class:`MaxBatchSize`: ``.batch_size``, ``.table``, ``.cell(recomputation,
        proportion)``, ``.table_text()``, ``.estimate`` (at the answer; its HTML report shows
        the table), ``.save_html(path)``.

    Raises:
        ValueError: a bad ``limit``, or what :func:`estimate` refuses.
        TileModelError: the tile model failed on one of the programs.

    Example:
        >>> m = tf_ipu.max_batch_size(model, training=True, ipu_version="bow")
        >>> m.batch_size, m.cell(recomputation=True, available_memory_proportion=0.2)
        >>> print(m.table_text())
    """
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"limit must be a positive int (the largest micro-batch tried). "
                         f"Received: limit={limit!r}")
    for k in ("batch_size", "batch_sizes"):
        if k in estimate_options:
            raise ValueError(f"max_batch_size searches the batch size: do not pass {k}. "
                             f"Received: {k}={estimate_options[k]!r}")
    options = {k: v for k, v in estimate_options.items() if k not in _LENGTH_OPTIONS}
    t0 = time.perf_counter()
    made: dict[tuple[int, Any, Any], Estimate | TrainingEstimate] = {}
    verdicts: dict[tuple[int, Any, Any], bool] = {}

    def fits_with(recomputation: Any, proportion: Any, keep: bool = False) -> Callable[[int], bool]:
        def fits(n: int) -> bool:
            key = (n, recomputation, proportion)
            if key not in verdicts:
                est = estimate(model, n, training, ipu_version, tiles_per_ipu,
                               **{**options, "recomputation": recomputation,
                                  "available_memory_proportion": proportion})
                verdicts[key] = bool(est.fits)
                if keep:
                    made[key] = est
                    probes.append({"batch_size": n, "fits": bool(est.fits),
                                   "within_margin": bool(est.within_margin),
                                   "peak_tile_bytes": int(est.peak_tile_bytes),
                                   "tile_bytes_limit": int(getattr(est, "step", est).tile_bytes_limit)})
            return verdicts[key]
        return fits

    probes: list[dict[str, Any]] = []
    given = (options.get("recomputation"), options.get("available_memory_proportion"))
    cells: list[dict[str, Any]] = []
    with _lowerings():
        kept = _LOWERINGS.get()
        answer, capped = _largest(fits_with(*given, keep=True), limit)
        if table:
            for recomputation in (False, True):
                for amp in MAX_BATCH_PROPORTIONS:
                    n, cap = _largest(fits_with(recomputation, amp), limit)
                    cells.append({"recomputation": recomputation, "available_memory_proportion": amp,
                                  "batch_size": n, "capped": cap})
    at = made.get((max(answer, 1), *given))
    result = MaxBatchSize(
        batch_size=answer, capped=capped, limit=limit, training=bool(training),
        ipu_version=ipu_version, options=dict(options), table=cells, probes=probes, estimate=at,
        estimates=len(verdicts), plans=sum(1 for k in (kept or {}) if k[0] == "planned"),
        seconds=time.perf_counter() - t0)
    if at is not None:
        getattr(at, "step", at).max_batch = result.to_dict()
    return result


# ------------------------------------------------------------------------------- CLI


def build_model(name: str, precision: str = "fp32") -> Any:
    """A model by name: "mlp", "cnn", or a ``keras.applications`` model (``weights=None``)."""
    keras = _keras()
    if precision == "fp16":
        keras.mixed_precision.set_global_policy("mixed_float16")
    key = name.lower().replace("-", "").replace("_", "")
    if key == "mlp":
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                 keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)],
                                name="mlp")
    if key == "cnn":
        return keras.Sequential([
            keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)], name="cnn")
    apps = {n.lower(): n for n in dir(keras.applications) if n[:1].isupper()}
    if key not in apps:
        known = ", ".join(sorted(["mlp", "cnn", *apps]))
        raise ValueError(f"Unknown model {name!r}; accepted: {known}.")
    return getattr(keras.applications, apps[key])(weights=None)


def _calibration() -> int:
    """``--calibration``: the tile model's calibration as the package's data file holds it
    (device_server/emulator/calibration.json, written by bench/calibration/fit.py)."""
    from device_server.emulator import calibration

    print(calibration.table())
    return 0


def _print_max_batch(model: Any, args: argparse.Namespace, many: dict[str, Any]) -> int:
    """``--max-batch-size``: the answer, its search and the table (and the HTML/JSON report of
    the estimate at the answer)."""
    defaults = {"replicas": 1, "system": None, "gradient_accumulation_steps_per_replica": 1}
    options = {k: v for k, v in many.items() if k not in _LENGTH_OPTIONS and defaults.get(k, ...) != v}
    m = max_batch_size(model, args.training, args.ipu_version, args.tiles_per_ipu,
                       limit=args.max_batch_limit, **options)
    print(m.summary())
    print("  search: " + ", ".join(f"{p['batch_size']} {'fits' if p['fits'] else 'no'}"
                                   for p in m.probes))
    print(m.table_text())
    if args.html and m.estimate is not None:
        print(f"HTML report: {m.save_html(args.html)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(m.to_dict(), f, indent=1)
        print(f"JSON: {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tf_ipu.estimate``: see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m tf_ipu.estimate",
                                description="Estimate a Keras model on an emulated IPU preset.")
    p.add_argument("--model", default="resnet50", help="mlp, cnn or a keras.applications name")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--training", action="store_true", help="a training step (SGD, sparse CE loss)")
    p.add_argument("--optimizer", default="sgd", help="optimizer for --training (default sgd)")
    p.add_argument("--ipu-version", default="ipu2", help="ipu1 (GC2), ipu2 (GC200), bow")
    p.add_argument("--tiles-per-ipu", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas, one per IPU")
    p.add_argument("--system", default="", help="the replicas' system: " + ", ".join(hardware.SYSTEMS))
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="fp16: Keras mixed_float16 policy")
    p.add_argument("--gradient-accumulation", type=int, default=1, metavar="N",
                   help="--training: micro-batches per weight update per replica (default 1)")
    p.add_argument("--dataset-size", type=int, default=None,
                   help="--training: items in the dataset, for the time to train")
    p.add_argument("--epochs", type=float, default=None, help="with --dataset-size (default 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="--training: the time to train of this many weight updates")
    p.add_argument("--sweep", default="", help="batch sizes to sweep, e.g. 1,2,4,8")
    p.add_argument("--html", default="", help="write the HTML report here")
    p.add_argument("--json", default="", help="write the JSON report here")
    p.add_argument("--max-batch-size", action="store_true",
                   help="print the largest micro-batch that fits, and its table for "
                        "recomputation off/on and availableMemoryProportion 0.1 .. 0.6")
    p.add_argument("--max-batch-limit", type=int, default=MAX_BATCH_LIMIT, metavar="N",
                   help=f"--max-batch-size: the largest micro-batch tried (default {MAX_BATCH_LIMIT})")
    p.add_argument("--calibration", action="store_true",
                   help="print the tile model's calibration (its fitted figures, per class the "
                        "held-out error; the end-to-end fit beside one constant on all cycles)")
    args = p.parse_args(argv)
    if args.calibration:
        return _calibration()
    model = build_model(args.model, args.precision)
    if args.training:
        model.compile(optimizer=args.optimizer, loss=_keras().losses.SparseCategoricalCrossentropy(from_logits=True))
    many = {"replicas": args.replicas, "system": args.system or None,
            "gradient_accumulation_steps_per_replica": args.gradient_accumulation}
    if args.dataset_size is not None or args.steps is not None or args.epochs is not None:
        many.update(dataset_size=args.dataset_size, steps=args.steps,
                    epochs=None if args.epochs is None else
                    int(args.epochs) if float(args.epochs).is_integer() else args.epochs)
    try:
        if args.max_batch_size:
            return _print_max_batch(model, args, many)
        if args.sweep:
            sizes = [int(s) for s in args.sweep.split(",") if s.strip()]
            sweep = estimate_sweep(model, sorted({*sizes, args.batch_size}), args.training,
                                   args.ipu_version, args.tiles_per_ipu, **many)
            report = next(e for e in sweep.estimates if e.items_per_call == args.batch_size)
            for pt in sweep.points:
                print(f"  batch {pt['batch_size']:5d}: {pt['latency_s'] * 1e3:9.3f} ms  "
                      f"{pt['throughput']:12,.1f} items/s  {'fits' if pt['fits'] else 'DOES NOT FIT'}")
        else:
            report = estimate(model, args.batch_size, args.training, args.ipu_version,
                              args.tiles_per_ipu, **many)
    except ValueError as e:
        p.error(str(e))
    except TileModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    step = report.step if isinstance(report, TrainingEstimate) else report
    from device_server.emulator import calibration

    if step.expected_error:
        print("  " + calibration.describe(step.expected_error))
    if isinstance(report, TrainingEstimate):
        if report.time_to_train_s is not None:
            print(report.time_to_train_summary())
        print(f"  per step (one micro-batch, its weight update in it): {step.summary()}")
        print(f"  weight update {report.weight_update_cycles:,.0f} cycles (all-reduce "
              f"{step.all_reduce_cycles:,} + optimizer {report.update_cycles:,}) once per "
              f"{report.gradient_accumulation_steps_per_replica} micro-batches of "
              f"{report.micro_batch_cycles:,.0f} cycles (accumulating "
              f"{report.accumulate_cycles:,} of them)")
    print(f"  lowering {step.context['lower_seconds']:.2f} s, planning "
          f"{step.context['plan_seconds']:.2f} s; {step.supersteps:,} supersteps; "
          f"compute {step.compute_cycles:,} / exchange {step.exchange_cycles:,} / sync "
          f"{step.sync_cycles:,} / host {step.host_cycles:,} cycles"
          + (f" / all-reduce {step.all_reduce_cycles:,} / replica syncs "
             f"{step.replica_sync_cycles:,}" if step.replicas > 1 else ""))
    for op in step.top_ops[:5]:
        print(f"    {op['cycles']:12,.0f} cycles  {op['name']} ({op['opcode']}) {op['layer']}")
    if not step.fits:
        print(step.oom_message())
    elif not report.fits:
        print(f"With the gradient accumulators ({report.accumulator_bytes:,} B per IPU) tile "
              f"{report.peak_tile} holds {report.peak_tile_bytes:,} B of "
              f"{step.tile_bytes_limit:,} B: it does not fit.")
    if args.html:
        print(f"HTML report: {report.save_html(args.html)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(report.to_json(indent=1))
        print(f"JSON report: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
