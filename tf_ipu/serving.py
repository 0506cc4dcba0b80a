"""Exporting models for serving: Graphcore's ``model.export_for_ipu_serving`` and
``ipu.serving.export_keras`` / ``export_single_step`` / ``export_pipeline``, on this
project's serving path.

    model.export_for_ipu_serving(export_dir, batch_size, output_names,
                                 preprocessing_step, postprocessing_step, ...)
      -> a tf.Module whose tf.function ``predict`` (input signature: the model's inputs, or
         the preprocessing step's, with the batch size fixed) is
             inputs --preprocessing_step (host CPU)--> model inputs
                    --the model on the IPUs---------> one IpuExecute op (the program lowered
                                                      and compiled at export)
                    --postprocessing_step (host CPU)--> outputs (dict if output_names)
      -> tf.saved_model.save(module, export_dir), signature "serving_default" = predict
      <- returns ``predict``, a tf.function that runs the same program in this process

    elsewhere:  import tf_ipu; loaded = tf.saved_model.load(export_dir)
                loaded.signatures["serving_default"](input_1=..., ...)   -> {"output_0": ...}
                loaded.predict(x1, x2)                                 -> the model's outputs

Steps that can run on the IPU belong inside the model (Keras layers): they are lowered with it
into the device program. ``preprocessing_step`` and ``postprocessing_step`` run on the host,
as in Graphcore's SDK, so they may use ops XLA cannot compile (strings, random draws).

How a Keras model's program spreads over the IPUs is decided at export, from the IPUs the
exporting process attached (``IPUConfig.auto_select_ipus``), as for its ``predict``:

    pipelined model (PipelineStage / set_pipeline_stage_assignment, device_mapping)
        -> one replica = its stages on the IPUs of device_mapping (a power of two spanned);
           the attached IPUs / that many replicas (one request a call: one micro-batch)
    model on one IPU
        -> one replica per attached IPU, each computing the request (replica 0's answers)

``export_pipeline(computational_stages, ...)`` lays out its stage functions the same way: stage
i on IPU ``device_mapping[i]`` of a replica (the first stage takes ``inputs`` then the fed
values, each next one the previous one's outputs), as many replicas as the attached IPUs hold.

The program's IPU count (replicas x IPUs per replica) is recorded in the IpuExecute op's
signature (``"ipus"``), as Graphcore's exported executables carried theirs, and in
``assets.extra/tf_ipu_serving.json`` (``read_requirements``) for whoever deploys it. A process
that loads the SavedModel and configured no IPU system attaches that many IPUs at its first
call (``tf_ipu.runtime``); one configured with fewer gets an error naming the count to set.

Where this differs from Graphcore's: the program is not a Poplar executable in the
SavedModel's assets but the IpuExecute op's lowered program, and the model's weights are
saved as variables beside it (Graphcore froze them into constants), read at each call; so
the returned function uses the model's current weights if it is trained further.
``steps_per_execution`` (Graphcore's loop over requests held by the device) and
``iterations`` have no effect: each call of the serving function is one device call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tf_ipu.serving_checks import (
    _arg_names,
    _as_function,
    _as_tuple,
    _batch_size,
    _check_callable,
    _check_export_dir,
    _check_output_names,
    _check_signature,
    _dataset_signature,
    _fn_name,
    _fully_defined,
    _match,
    _named,
    _positional_count,
    _step_signature,
    _step_signatures,
    _unnamed,
)

if TYPE_CHECKING:
    from tf_ipu.lowering.program import LoweredProgram

_log = logging.getLogger("tf_ipu")

#: The SavedModel signature the serving function is saved under (TensorFlow Serving's
#: default, as in Graphcore's exports).
SIGNATURE_KEY = tf.saved_model.DEFAULT_SERVING_SIGNATURE_DEF_KEY

Signature = Sequence[tf.TensorSpec]


# -- the device program ----------------------------------------------------------------------

#: Written beside the SavedModel (``assets.extra/``, which TensorFlow Serving leaves alone):
#: how its device programs are laid out and how many IPUs a process that loads it attaches.
REQUIREMENTS_FILE = "tf_ipu_serving.json"


def program_sizing(lowered: LoweredProgram) -> dict[str, Any]:
    """How ``lowered`` runs on the IPUs: its replicas, a pipeline's stages and the IPUs
    they are mapped to within a replica, and the IPUs it needs in all (replicas x the IPUs
    one replica spans) -- what a process that loads the export attaches."""
    from tf_ipu.runtime import program_ipus

    sig = json.loads(lowered.signature)
    pipeline = sig.get("pipeline") or {}
    return {
        "program": lowered.name,
        "ipus": program_ipus(sig),
        "replicas": max(1, int(sig.get("replicas", 1))),
        "stages": int(pipeline.get("stages", 1)),
        "stage_ipus": [int(i) for i in pipeline.get("stage_ipus", [0])],
        "ipus_per_replica": int(pipeline.get("ipus_per_replica", 1)),
    }


class DeviceProgram:
    """The device program of an exported Keras model (or of ``export_pipeline``'s stage
    functions), lowered and compiled at export: a pipelined model's stages on their IPUs
    (``set_pipelining_options(device_mapping=...)``), as many replicas of it (or of a model on
    one IPU) as the configured IPUs hold; its IPU count is recorded in the program's
    signature, for the process that loads the export.

    Attributes:
        lowered: the ``LoweredProgram`` (the IpuExecute op's program and signature).
        report: its ``CompileReport`` (also in ``strategy.reports``).
        sizing: ``program_sizing(lowered)``: ``ipus``, ``replicas``, ``stages``,
            ``stage_ipus``, ``ipus_per_replica``.
    """

    def __init__(self, lowered: LoweredProgram, report: Any) -> None:
        self.lowered = lowered
        self.report = report
        self.sizing = program_sizing(lowered)

    def __call__(self, values: Sequence[tf.Tensor]) -> Any:
        """The device call (an IpuExecute op, in the graph being traced); a replicated
        program's results are replica 0's (every replica ran the same inputs)."""
        from tf_ipu.lowering.program import call_lowered

        result = call_lowered(self.lowered, list(values))
        if self.lowered.replicas <= 1 or result is None:
            return result
        return tf.nest.map_structure(lambda t: t[0], result)


def _with_ipus(lowered: LoweredProgram) -> LoweredProgram:
    """``lowered`` with the IPUs it needs recorded in its signature (``"ipus"``), as
    Graphcore's exported executables carried their IPU count."""
    from tf_ipu.runtime import program_ipus

    sig = json.loads(lowered.signature)
    sig["ipus"] = program_ipus(sig)
    return dataclasses.replace(lowered, signature=json.dumps(sig))


def _keras_program(model: Any, strategy: Any, fn: Callable[..., Any],
                   specs: list[tf.TensorSpec], what: str) -> DeviceProgram:
    """``fn`` (the model's call) lowered as the model runs on the configured IPUs: a
    pipelined model as its pipeline (one request a call: one micro-batch through the
    stages), replicated when the IPUs hold several of it; compiled now, so that errors
    (an op XLA cannot compile, too few IPUs, out of memory) surface at export."""
    from tf_ipu import pipelining, replication, runtime
    from tf_ipu.lowering.program import lower_function

    strategy._ensure_configured()
    pipeline = pipelining.plan(model, 1)
    try:
        replicas = replication.replicas_for(model)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if pipeline is not None:
        pipeline = dict(pipeline, micro_batches=1, accumulation_set=False,
                        recomputation=False)
    shown = [f"stages={pipeline['stages']}"] if pipeline is not None else []
    shown += [f"replicas={replicas}"] if replicas > 1 else []
    name = f"{model.name}/export_for_ipu_serving" + (f"[{', '.join(shown)}]" if shown else "")

    def replica_fn(*xs: tf.Tensor) -> Any:
        with strategy.lowering(replicas):
            return strategy.extended.call_for_each_replica(fn, args=xs)

    unnamed = _unnamed(specs)
    if pipeline is not None:
        with pipelining.tagging(model, pipelining.stages_of(model)):
            lowered = lower_function(replica_fn, unnamed, name, replicas, pipeline)
    else:
        lowered = lower_function(replica_fn, unnamed, name, replicas)
    lowered = _with_ipus(lowered)
    report = runtime.get_runtime().compile(lowered.program, lowered.signature)
    program = DeviceProgram(lowered, report)
    size = program.sizing
    layout = (f"a pipeline of {size['stages']} stages on IPUs {size['stage_ipus']}"
              if pipeline is not None else "the whole model on one IPU")
    _log.info("tf_ipu: %s: model %r is exported as %s, %d replica%s: %d IPU%s (a process "
              "that loads it attaches them)", what, model.name, layout, size["replicas"],
              "s" if size["replicas"] != 1 else "", size["ipus"],
              "s" if size["ipus"] != 1 else "")
    return program


def _write_requirements(export_dir: str, sizes: list[dict[str, Any]], what: str) -> None:
    """Records the IPUs the export's device programs need beside the SavedModel (for
    whoever deploys it; the process that loads it reads them from the programs)."""
    folder = os.path.join(export_dir, "assets.extra")
    os.makedirs(folder, exist_ok=True)
    record = {"exported_by": f"tf_ipu {what}",
              "ipus": max([s["ipus"] for s in sizes], default=1),
              "programs": sizes}
    with open(os.path.join(folder, REQUIREMENTS_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)


def read_requirements(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What an export recorded about its device programs (``REQUIREMENTS_FILE``):
    ``ipus`` (the IPUs to attach: ``IPUConfig.auto_select_ipus``) and, per program,
    its ``replicas``, ``stages``, ``stage_ipus`` and ``ipus_per_replica``.

    Example:
        >>> tf_ipu.serving.read_requirements("exported")["ipus"]   # doctest: +SKIP
        2
    """
    path = os.path.join(os.fspath(export_dir), "assets.extra", REQUIREMENTS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{os.fspath(export_dir)!r} holds no {REQUIREMENTS_FILE} (assets.extra/): it was "
            f"not exported by tf_ipu's export_for_ipu_serving / ipu.serving.") from None


# -- the serving module ----------------------------------------------------------------------


class _ServingModule(tf.Module):
    """What the SavedModel holds: the serving function ``predict`` and what it uses."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)


def _export(
    what: str,
    export_dir: str,
    strategy: Any,
    device_fn: Callable[..., Any] | DeviceProgram,
    device_label: str,
    device_signature: list[tf.TensorSpec],
    input_signature: list[tf.TensorSpec],
    output_names: list[str] | None,
    preprocessing_step: Callable[..., Any] | None,
    postprocessing_step: Callable[..., Any] | None,
    postprocessing_signature: list[tf.TensorSpec] | None,
    keep: dict[str, Any],
) -> Any:
    """Builds the serving function, saves it under ``export_dir``, returns it.

    ``device_fn`` takes one tensor per ``device_signature`` spec and runs through
    ``strategy.run`` (one IpuExecute op), or is a ``DeviceProgram`` lowered already (a Keras
    model's: a pipeline or replicas, sized for the IPUs it needs); the steps run on the host
    around it. ``keep``: the objects the SavedModel must hold (a model: its variables).
    """
    pre = post = None
    step_variables: list[tf.Variable] = []
    if preprocessing_step is not None:
        pre = _as_function(preprocessing_step, input_signature)
        step_variables += list(pre.get_concrete_function(*_unnamed(input_signature)).variables)
    if postprocessing_step is not None:
        post = _as_function(postprocessing_step, postprocessing_signature)
    traced: dict[str, list[tf.TensorSpec]] = {}

    def predict(*args: tf.Tensor) -> Any:
        values = list(args)
        if pre is not None:
            values = _match(_as_tuple(pre(*values)), device_signature, "preprocessing_step",
                            device_label, what)
        if isinstance(device_fn, DeviceProgram):
            out = device_fn(values)
        else:
            out = strategy.run(device_fn, args=tuple(values))
        if post is not None:
            flat = tf.nest.flatten(out)
            if postprocessing_signature is not None:
                flat = _match(flat, postprocessing_signature, device_label,
                              "postprocessing_step", what)
            traced["post"] = [tf.TensorSpec(t.shape, t.dtype) for t in flat]
            out = post(*flat)
        if output_names is not None:
            flat = tf.nest.flatten(out)
            if len(flat) != len(output_names):
                raise ValueError(f"{what}: output_names names {len(output_names)} outputs "
                                 f"({output_names}), but the exported function returns "
                                 f"{len(flat)}.")
            return dict(zip(output_names, flat, strict=True))
        return out

    predict.__name__ = "predict"
    module = _ServingModule(name="ipu_serving")
    for attr, obj in keep.items():
        setattr(module, attr, obj)
    module.predict = tf.function(predict, input_signature=input_signature)
    concrete = module.predict.get_concrete_function()  # lowers and compiles the program
    if post is not None:
        step_variables += list(post.get_concrete_function(*traced["post"]).variables)
    # Variables the device program reads (a model's, or a predict_step's closure's) and the
    # host steps read: the SavedModel saves them and the loaded function restores them.
    if isinstance(device_fn, DeviceProgram):
        programs = [device_fn.lowered]
    else:
        programs = [lowered for lowered, _ in strategy._run_cache.get(device_fn, {}).values()]
    device_variables = [v for lowered in programs for v in lowered.variables]
    module.variables_used = list({id(v): v for v in device_variables + step_variables}.values())
    if os.path.isdir(export_dir) and os.listdir(export_dir):  # purge_export_dir=True
        shutil.rmtree(export_dir)
    tf.saved_model.save(module, export_dir, signatures={SIGNATURE_KEY: concrete})
    _write_requirements(export_dir, [program_sizing(p) for p in programs], what)
    return module.predict


def _ipu_strategy_of(model: Any, what: str) -> Any:
    from tf_ipu.strategy import IPUStrategy

    strategy = getattr(model, "_distribute_strategy", None)
    if not isinstance(strategy, IPUStrategy):
        name = getattr(model, "name", type(model).__name__)
        raise ValueError(
            f"{what}: model {name!r} was not created inside an IPU strategy "
            f"(its strategy is {type(strategy).__name__ if strategy is not None else 'none'}). "
            f"Create it in `with IPUStrategy().scope():`.")
    return strategy


def _keras_inputs(model: Any, what: str) -> tuple[list[tf.TensorSpec], Any]:
    """The model's inputs (specs named after its Input layers) and their structure."""
    import keras

    name = getattr(model, "name", type(model).__name__)
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError):
        inputs = []
    if inputs:
        specs = []
        for i, t in enumerate(inputs):
            history = getattr(t, "_keras_history", None)
            layer = getattr(history, "operation", None) if history is not None else None
            input_name = getattr(layer, "name", None) or getattr(t, "name", None) or f"input_{i}"
            specs.append(tf.TensorSpec(tf.TensorShape(t.shape), tf.as_dtype(t.dtype),
                                       name=input_name))
        structure = getattr(model, "_inputs_struct", None)
        if structure is None:
            structure = inputs[0] if len(inputs) == 1 else inputs
        return specs, structure
    shapes = getattr(model, "_build_shapes_dict", None)
    if model.built and shapes and len(shapes) == 1:
        shape = next(iter(shapes.values()))

        def is_shape(s: Any) -> bool:
            return isinstance(s, (tuple, list)) and all(
                d is None or isinstance(d, int) for d in s)

        structure = shape if is_shape(shape) else None
        leaves = [shape] if structure is not None else None
        if structure is None and isinstance(shape, (tuple, list)) and all(map(is_shape, shape)):
            structure, leaves = list(shape), list(shape)
        if leaves is not None:
            dtype = tf.as_dtype(getattr(model, "input_dtype", None) or keras.backend.floatx())
            specs = [tf.TensorSpec(tf.TensorShape(s), dtype, name=f"input_{i + 1}")
                     for i, s in enumerate(leaves)]
            return specs, (specs[0] if is_shape(shape) else specs)
    raise ValueError(
        f"{what}: the input shapes of model {name!r} are not known. Build it first: "
        f"model.build(input_shape), Input layers, or a call on data.")


# -- public functions ------------------------------------------------------------------------


def export_keras(
    model: Any,
    export_dir: str | os.PathLike[str],
    batch_size: int | None = None,
    output_names: str | Sequence[str] | None = None,
    preprocessing_step: Callable[..., Any] | None = None,
    preprocessing_step_signature: Signature | None = None,
    postprocessing_step: Callable[..., Any] | None = None,
    postprocessing_step_signature: Signature | None = None,
    purge_export_dir: bool = False,
) -> Any:
    """Exports a Keras model built under ``IPUStrategy`` as a SavedModel for serving.

    Graphcore's ``ipu.serving.export_keras`` (and ``model.export_for_ipu_serving``, the same
    with the model as ``self``).

    Args:
        model: a built Keras model created in an ``IPUStrategy``'s scope.
        export_dir: where the SavedModel is written: a new or empty directory.
        batch_size: the batch size of the exported program. Without it, the model's own
            (``Input(batch_size=...)``, or ``model.build((batch, ...))``) is used, and a model
            without one is an error.
        output_names: a name, or a list of names, for the outputs: the serving function
            then returns a dict and the signature's outputs are so named. Without it they
            are ``output_0``, ``output_1``, ... in the signature and the function returns
            what the model (or ``postprocessing_step``) returns.
        preprocessing_step: a function run on the host before the model; it returns the
            model's inputs. It gives the SavedModel its inputs, named after its arguments.
        preprocessing_step_signature: its input ``tf.TensorSpec``s; may be omitted when
            ``preprocessing_step`` is a ``tf.function`` with an ``input_signature``.
        postprocessing_step: a function run on the host after the model, on its flattened
            outputs.
        postprocessing_step_signature: its input specs (checked against the model's
            outputs); optional.
        purge_export_dir: empty a non-empty ``export_dir`` first (otherwise an error).

    Returns:
        The serving ``tf.function`` (what the SavedModel holds as ``predict`` and under the
        ``serving_default`` signature), callable here with the inputs.

    Example:
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,), batch_size=2), keras.layers.Dense(3)])
        >>> serve = model.export_for_ipu_serving("exported")       # doctest: +SKIP
        >>> serve(np.ones((2, 4), np.float32))                     # doctest: +SKIP
    """
    what = "export_for_ipu_serving"
    strategy = _ipu_strategy_of(model, what)
    _check_callable(preprocessing_step, "preprocessing_step", what)
    _check_callable(postprocessing_step, "postprocessing_step", what)
    pre_sig = _check_signature(preprocessing_step_signature, "preprocessing_step_signature", what)
    post_sig = _check_signature(postprocessing_step_signature, "postprocessing_step_signature",
                                what)
    names = _check_output_names(output_names, what)
    batch = _batch_size(batch_size, what)
    path = _check_export_dir(export_dir, purge_export_dir, what)

    specs, structure = _keras_inputs(model, what)
    if batch is not None:
        specs = [tf.TensorSpec([batch, *s.shape[1:]], s.dtype, name=s.name) if s.shape.rank
                 else s for s in specs]
    for i, s in enumerate(specs):
        if s.shape.rank and s.shape[0] is None:
            raise ValueError(
                f"{what}: the batch size of model {model.name!r}'s input {i} ({s.name}, shape "
                f"{s.shape}) is not known, and exported programs have static shapes. Pass "
                f"batch_size=..., or give the model's Input a batch_size.")
    _fully_defined(specs, what, f"model {model.name!r}'s")
    specs = _named(specs, [s.name for s in specs])

    input_signature = specs
    if preprocessing_step is not None:
        pre_specs = _step_signature(preprocessing_step, pre_sig)
        if pre_specs is None:
            raise ValueError(
                f"{what}: the inputs of preprocessing_step {_fn_name(preprocessing_step)} are "
                f"not known: make it a tf.function with an input_signature, or pass "
                f"preprocessing_step_signature.")
        _fully_defined(pre_specs, what, "preprocessing_step's")
        input_signature = _named(pre_specs, _arg_names(preprocessing_step, len(pre_specs)))
    post_specs = None
    if postprocessing_step is not None:
        post_specs = _step_signature(postprocessing_step, post_sig)

    def serving_call(*xs: tf.Tensor) -> Any:
        inputs = tf.nest.pack_sequence_as(structure, list(xs))
        return model(inputs, training=False)

    serving_call.__name__ = f"{model.name}/export_for_ipu_serving"
    device = _keras_program(model, strategy, serving_call, specs, what)
    return _export(what, path, strategy, device, f"model {model.name!r}", specs,
                   input_signature, names,
                   preprocessing_step, postprocessing_step, post_specs, {"model": model})


def export_for_ipu_serving(
    self: Any,
    export_dir: str | os.PathLike[str],
    batch_size: int | None = None,
    output_names: str | Sequence[str] | None = None,
    preprocessing_step: Callable[..., Any] | None = None,
    preprocessing_step_signature: Signature | None = None,
    postprocessing_step: Callable[..., Any] | None = None,
    postprocessing_step_signature: Signature | None = None,
    purge_export_dir: bool = False,
) -> Any:
    """Graphcore's ``model.export_for_ipu_serving``: exports this model (built under
    ``IPUStrategy``) as a SavedModel whose ``serving_default`` signature runs it on the
    device; returns the serving ``tf.function``. The arguments are those of
    ``tf_ipu.serving.export_keras`` (this model is its ``model``).

    Example:
        >>> serve = model.export_for_ipu_serving("exported", batch_size=1)  # doctest: +SKIP
    """
    return export_keras(self, export_dir, batch_size, output_names, preprocessing_step,
                        preprocessing_step_signature, postprocessing_step,
                        postprocessing_step_signature, purge_export_dir)


def export_single_step(
    predict_step: Callable[..., Any],
    export_dir: str | os.PathLike[str],
    iterations: int,
    predict_step_signature: Signature | None = None,
    input_dataset: tf.data.Dataset | None = None,
    output_names: str | Sequence[str] | None = None,
    preprocessing_step: Callable[..., Any] | None = None,
    preprocessing_step_signature: Signature | None = None,
    postprocessing_step: Callable[..., Any] | None = None,
    postprocessing_step_signature: Signature | None = None,
    purge_export_dir: bool = False,
) -> Any:
    """Graphcore's ``ipu.serving.export_single_step``: exports ``predict_step`` (run on the
    device through ``IPUStrategy.run``) with optional host-side steps around it.

    Args:
        predict_step: the function to run on the device, one tensor argument per input.
        export_dir: a new or empty directory.
        iterations: Graphcore's loop count (a positive int); here each call is one device
            call, so it has no other effect.
        predict_step_signature: ``predict_step``'s input specs; may be omitted when it is a
            ``tf.function`` with an ``input_signature``, or when ``input_dataset`` gives them.
        input_dataset: a ``tf.data.Dataset`` whose ``element_spec`` gives the exported inputs
            (of ``preprocessing_step`` if there is one, else of ``predict_step``).
        output_names, preprocessing_step, preprocessing_step_signature,
        postprocessing_step, postprocessing_step_signature, purge_export_dir: as for
            ``export_keras``. Without ``predict_step_signature``, a preprocessing step's
            outputs give ``predict_step``'s inputs.

    Returns:
        The serving ``tf.function``.
    """
    what = "export_single_step"
    if not callable(predict_step):
        raise TypeError(f"{what}: predict_step must be a function (or a tf.function). "
                        f"Received: predict_step={predict_step!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) \
            or iterations <= 0:
        raise ValueError(f"{what}: iterations must be a positive int. "
                         f"Received: iterations={iterations!r}")
    _check_callable(preprocessing_step, "preprocessing_step", what)
    _check_callable(postprocessing_step, "postprocessing_step", what)
    predict_sig = _check_signature(predict_step_signature, "predict_step_signature", what)
    pre_sig = _check_signature(preprocessing_step_signature, "preprocessing_step_signature", what)
    post_sig = _check_signature(postprocessing_step_signature, "postprocessing_step_signature",
                                what)
    dataset_sig = _dataset_signature(input_dataset, what)
    names = _check_output_names(output_names, what)

    input_signature, device_sig = _step_signatures(
        what, predict_step, "predict_step", predict_sig, dataset_sig, preprocessing_step, pre_sig)
    _fully_defined(input_signature, what, "the exported")
    _fully_defined(device_sig, what, "predict_step's")
    path = _check_export_dir(export_dir, purge_export_dir, what)

    strategy, post_specs = _strategy_and_post_specs(postprocessing_step, post_sig)

    def device_step(*xs: tf.Tensor) -> Any:
        return predict_step(*xs)

    device_step.__name__ = f"{_fn_name(predict_step)}/export_single_step"
    keep: dict[str, Any] = {}
    if isinstance(predict_step, tf.Module):
        keep["predict_step"] = predict_step
    return _export(what, path, strategy, device_step, "predict_step",
                   [tf.TensorSpec(s.shape, s.dtype) for s in device_sig], input_signature, names,
                   preprocessing_step, postprocessing_step, post_specs, keep)


def _stage_call(stage: Callable[..., Any], values: Any) -> Any:
    """Calls a pipeline stage with the previous stage's outputs, as Graphcore's pipeline
    passes them: a tuple or list as positional arguments, a dict as keyword arguments, a
    single tensor as the one argument (None: no arguments)."""
    if values is None:
        return stage()
    if isinstance(values, dict):
        return stage(**values)
    if isinstance(values, (tuple, list)):
        return stage(*values)
    return stage(values)


def _pipeline_plan(count: int, device_mapping: Any, pipeline_schedule: Any,
                   poplar_options: Any, what: str) -> dict[str, Any]:
    """The pipeline of ``count`` stage functions, in the form ``tf_ipu.pipelining.plan``
    gives a Keras model's (one micro-batch a call: one request); ValueError naming a bad
    argument."""
    from tf_ipu.pipelining import PipelineSchedule, stage_memory_proportions

    if device_mapping is None:
        mapping = list(range(count))
    else:
        if not isinstance(device_mapping, (list, tuple)) or not all(
                isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0
                for i in device_mapping):
            raise ValueError(f"{what}: device_mapping must be a list of IPU indices (ints >= "
                             f"0), one per stage. Received: device_mapping={device_mapping!r}")
        mapping = [int(i) for i in device_mapping]
        if len(mapping) != count:
            raise ValueError(f"{what}: device_mapping {mapping} names {len(mapping)} IPUs for "
                             f"{count} computational stages: give one IPU per stage, e.g. "
                             f"device_mapping={list(range(count))}.")
    schedule = PipelineSchedule.Grouped if pipeline_schedule is None else pipeline_schedule
    if not isinstance(schedule, PipelineSchedule):
        by_name = {s.name.lower(): s for s in PipelineSchedule}
        if not isinstance(schedule, str) or schedule.lower() not in by_name:
            raise ValueError(f"{what}: pipeline_schedule must be a PipelineSchedule (Grouped, "
                             f"Interleaved, Sequential). Received: "
                             f"pipeline_schedule={pipeline_schedule!r}")
        schedule = by_name[schedule.lower()]
    if poplar_options is not None and (not isinstance(poplar_options, (list, tuple))
                                       or len(poplar_options) != count):
        raise ValueError(f"{what}: poplar_options must be a list of {count} "
                         f"PipelineStageOptions, one per stage. Received: "
                         f"poplar_options={poplar_options!r}")
    # Graphcore passes them as the stages' forward options: their availableMemoryProportion
    # plans each stage's products (the tile model); results do not change.
    proportions = stage_memory_proportions(
        {"forward_propagation_stages_poplar_options": poplar_options}, count, what,
        training=False)
    ipus = max(mapping) + 1
    return {
        "stages": count,
        "stage_ipus": mapping,
        "ipus_per_replica": 2 ** int(np.ceil(np.log2(ipus))) if ipus > 1 else 1,
        "schedule": schedule.name.lower(),
        "micro_batches": 1,
        "accumulation_set": False,
        "recomputation": False,
        "recomputation_mode": "Auto",
        "recomputation_checkpoints": False,
        "steps_per_execution": 1,
        "offload": None,
        "sharding": False,
        "stage_memory_proportions": proportions,
    }


def _pipeline_program(stages: list[Callable[..., Any]], fixed: list[Any], strategy: Any,
                      specs: list[tf.TensorSpec], plan: dict[str, Any], label: str,
                      what: str) -> DeviceProgram:
    """The stage functions lowered as one pipeline: stage i's ops on IPU ``stage_ipus[i]``
    (traced in its stage's name scope, as a Keras model's stages are), the first stage called
    with ``fixed`` (``inputs``) then the fed values, each next stage with the previous one's
    outputs; as many replicas as the attached IPUs hold; compiled now."""
    from tf_ipu import runtime
    from tf_ipu.lowering.program import lower_function
    from tf_ipu.pipelining import STAGE_SCOPE

    strategy._ensure_configured()
    attached = strategy.replication_factor
    per = plan["ipus_per_replica"]
    if attached % per:
        raise ValueError(
            f"{what}: {attached} IPU{' is' if attached == 1 else 's are'} attached, but the "
            f"pipeline of {plan['stages']} stages on IPUs {plan['stage_ipus']} needs {per} IPUs "
            f"per replica (a power of two): set IPUConfig.auto_select_ipus to a multiple of "
            f"{per} (e.g. {per} for one replica) before configure_ipu_system().")
    replicas = attached // per
    shown = [f"stages={plan['stages']}"] + ([f"replicas={replicas}"] if replicas > 1 else [])
    name = f"{label}/{what}[{', '.join(shown)}]"

    def pipeline(*fed: tf.Tensor) -> Any:
        values: Any = [*fixed, *fed]
        for i, stage in enumerate(stages):
            with tf.name_scope(f"{STAGE_SCOPE}{i}"):
                values = _stage_call(stage, values)
        return values

    def replica_fn(*xs: tf.Tensor) -> Any:
        with strategy.lowering(replicas):
            return strategy.extended.call_for_each_replica(pipeline, args=xs)

    lowered = _with_ipus(lower_function(replica_fn, _unnamed(specs), name, replicas, plan))
    report = runtime.get_runtime().compile(lowered.program, lowered.signature)
    program = DeviceProgram(lowered, report)
    size = program.sizing
    _log.info("tf_ipu: %s: %d stages on IPUs %s, %d replica%s: %d IPU%s (a process that "
              "loads it attaches them)", what, size["stages"], size["stage_ipus"],
              size["replicas"], "s" if size["replicas"] != 1 else "", size["ipus"],
              "s" if size["ipus"] != 1 else "")
    return program


def export_pipeline(
    computational_stages: Sequence[Callable[..., Any]],
    export_dir: str | os.PathLike[str],
    iterations: int,
    inputs: Sequence[Any] | None = None,
    device_mapping: Sequence[int] | None = None,
    pipeline_schedule: Any = None,
    poplar_options: Sequence[Any] | None = None,
    name: str | None = None,
    predict_step_signature: Signature | None = None,
    input_dataset: tf.data.Dataset | None = None,
    output_names: str | Sequence[str] | None = None,
    preprocessing_step: Callable[..., Any] | None = None,
    preprocessing_step_signature: Signature | None = None,
    postprocessing_step: Callable[..., Any] | None = None,
    postprocessing_step_signature: Signature | None = None,
    purge_export_dir: bool = False,
    *,
    input_signature: Signature | None = None,
    variable_initializer: Callable[..., Any] | None = None,
) -> Any:
    """Graphcore's ``ipu.serving.export_pipeline``: exports a pipeline of stage functions,
    each on its IPU, as a SavedModel whose ``serving_default`` signature runs it.

    The first stage takes ``inputs`` (if any) and then the exported function's inputs (or
    what ``preprocessing_step`` returns); each next stage takes the previous stage's outputs
    (a tuple or list as positional arguments, a dict as keyword arguments, a tensor as the
    one argument); the last stage's outputs are the results (then ``postprocessing_step``'s).
    Stage i runs on IPU ``device_mapping[i]`` of a replica, which spans the next power of
    two of IPUs; the IPUs attached when it is called (``IPUConfig.auto_select_ipus``) must be
    a multiple of that, and hold as many replicas. The program is lowered and compiled here;
    its IPU count is recorded as for ``export_keras`` (``read_requirements``), and a process
    that loads the SavedModel attaches those IPUs itself.

    Args:
        computational_stages: the stage functions (Python functions or tf.functions), in
            order.
        export_dir: a new or empty directory.
        iterations: Graphcore's pipeline depth (``gradient_accumulation_count``: micro-batches
            per execution), a positive int; here each call of the exported function is one
            device call with one request, so it changes nothing else.
        inputs: values passed to the first stage before the fed ones (not inputs of the
            SavedModel: fixed at export, as Graphcore froze them).
        device_mapping: the IPU of each stage; default: stage i on IPU i. Stages may share an
            IPU.
        pipeline_schedule: a ``PipelineSchedule`` (default ``Grouped``); it sizes the
            program, and does not change its results.
        poplar_options: one ``PipelineStageOptions`` per stage, as the stages' forward
            options: their ``availableMemoryProportion`` plans each stage's matmuls and
            convolutions in the estimate; results do not change.
        name: the pipeline's name (the program's, in reports); default ``"pipeline"``.
        predict_step_signature: the first stage's input specs (after ``inputs``); may be
            omitted when it is a tf.function with an ``input_signature``, when
            ``input_dataset`` gives them, or when ``preprocessing_step`` returns them.
        input_dataset: a ``tf.data.Dataset`` whose ``element_spec`` gives the exported inputs
            (of ``preprocessing_step`` if there is one, else of the first stage).
        output_names, preprocessing_step, preprocessing_step_signature,
        postprocessing_step, postprocessing_step_signature, purge_export_dir: as for
            ``export_single_step`` (the steps run on the host, around the pipeline).
        input_signature: the name SDK releases before 3.0 gave ``predict_step_signature``
            (keyword only; give one of the two).
        variable_initializer: TF1's session-based initializer: refused (ValueError), as
            there is no session in TF2. Variables the stages read are exported with the
            values they hold (restore a checkpoint before exporting).

    Returns:
        The serving ``tf.function`` (the SavedModel's ``predict``), callable here.

    Raises:
        ValueError: a bad argument (naming it), or fewer IPUs attached than a replica of the
            pipeline spans.

    Example:
        >>> cfg = tf_ipu.IPUConfig(); cfg.auto_select_ipus = 2     # doctest: +SKIP
        >>> cfg.configure_ipu_system()                             # doctest: +SKIP
        >>> serve = ipu.serving.export_pipeline(                   # doctest: +SKIP
        ...     [lambda x: x * 2, lambda x: x + 3], "exported", iterations=16,
        ...     device_mapping=[0, 1], predict_step_signature=[tf.TensorSpec([4], tf.float32)])
    """
    what = "export_pipeline"
    if isinstance(computational_stages, (str, bytes)) or not isinstance(
            computational_stages, Sequence) or not computational_stages:
        raise TypeError(f"{what}: computational_stages must be a non-empty list of functions. "
                        f"Received: computational_stages={computational_stages!r}")
    stages = list(computational_stages)
    for i, stage in enumerate(stages):
        if not callable(stage):
            raise TypeError(f"{what}: computational_stages[{i}] must be a function (or a "
                            f"tf.function). Received: {stage!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) \
            or iterations <= 0:
        raise ValueError(f"{what}: iterations must be a positive int. "
                         f"Received: iterations={iterations!r}")
    if variable_initializer is not None:
        raise ValueError(
            f"{what}: variable_initializer (a function of a tf.compat.v1.Session) belongs to "
            f"Graphcore's TF1 API; in TF2 there is no session to give it. Initialize or "
            f"restore the variables the stages read before calling {what} (e.g. "
            f"tf.train.Checkpoint(...).restore(path)): their values are exported.")
    if input_signature is not None and predict_step_signature is not None:
        raise ValueError(f"{what}: give predict_step_signature or input_signature (its "
                         f"earlier name), not both.")
    if predict_step_signature is None:
        predict_step_signature = input_signature
    if inputs is not None and (isinstance(inputs, (str, bytes))
                               or not isinstance(inputs, (list, tuple))):
        raise TypeError(f"{what}: inputs must be a list of values for the first stage. "
                        f"Received: inputs={inputs!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"{what}: name must be a non-empty string. Received: name={name!r}")
    _check_callable(preprocessing_step, "preprocessing_step", what)
    _check_callable(postprocessing_step, "postprocessing_step", what)
    predict_sig = _check_signature(predict_step_signature, "predict_step_signature", what)
    pre_sig = _check_signature(preprocessing_step_signature, "preprocessing_step_signature", what)
    post_sig = _check_signature(postprocessing_step_signature, "postprocessing_step_signature",
                                what)
    dataset_sig = _dataset_signature(input_dataset, what)
    names = _check_output_names(output_names, what)
    plan = _pipeline_plan(len(stages), device_mapping, pipeline_schedule, poplar_options, what)
    fixed = [v if isinstance(v, tf.Variable) else tf.convert_to_tensor(v)
             for v in (inputs or [])]

    takes = _positional_count(stages[0])
    if predict_sig is not None and fixed and takes is not None \
            and len(predict_sig) > takes[1] - len(fixed):
        predict_sig = predict_sig[len(fixed):]  # it describes ``inputs`` too (Graphcore's rule)
    signature, device_sig = _step_signatures(
        what, stages[0], "computational_stages[0]", predict_sig, dataset_sig,
        preprocessing_step, pre_sig, skip=len(fixed))
    given = len(fixed) + len(device_sig)
    if takes is not None and not takes[0] <= given <= takes[1]:
        count = str(takes[0]) if takes[0] == takes[1] else f"{takes[0]} to {takes[1]}"
        raise ValueError(
            f"{what}: the first stage {_fn_name(stages[0])} takes {count} arguments, but it "
            f"would get {len(fixed)} from inputs and {len(device_sig)} fed ones "
            f"({[str(s.shape) for s in device_sig]}): the signature does not match its "
            f"arguments.")
    _fully_defined(signature, what, "the exported")
    _fully_defined(device_sig, what, "the first stage's")
    path = _check_export_dir(export_dir, purge_export_dir, what)

    strategy, post_specs = _strategy_and_post_specs(postprocessing_step, post_sig)
    device_specs = [tf.TensorSpec(s.shape, s.dtype) for s in device_sig]
    device = _pipeline_program(stages, fixed, strategy, device_specs, plan, name or "pipeline",
                               what)
    keep: dict[str, Any] = {f"stage_{i}": stage for i, stage in enumerate(stages)
                            if isinstance(stage, tf.Module)}
    return _export(what, path, strategy, device, "the pipeline", device_specs, signature,
                   names, preprocessing_step, postprocessing_step, post_specs, keep)


def _strategy_and_post_specs(postprocessing_step: Any, post_sig: Any) -> tuple[Any, Any]:
    """The strategy an export compiles under (the current IPUStrategy, or a new one) and the
    postprocessing step's argument specs (None without one)."""
    from tf_ipu.strategy import IPUStrategy

    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, IPUStrategy):
        strategy = IPUStrategy()
    if postprocessing_step is None:
        return strategy, None
    return strategy, _step_signature(postprocessing_step, post_sig)




__all__ = ["REQUIREMENTS_FILE", "SIGNATURE_KEY", "DeviceProgram", "export_for_ipu_serving",
           "export_keras", "export_pipeline", "export_single_step", "program_sizing",
           "read_requirements"]
