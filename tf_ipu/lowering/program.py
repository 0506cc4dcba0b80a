"""Lowering a TensorFlow function to a device program (IR module + calling signature).

    Python fn (a Keras step, a device loop, a user's function under strategy.run)
      -> tf.function(jit_compile=True) traced for concrete input specs
      -> HLO (unoptimized, "hlo_serialized")  -> IR module (hlo_to_ir)
      -> LoweredProgram: the IR bytes + a JSON signature that says, for every entry
         parameter, whether it is an argument, a variable (device-resident) or a captured
         constant, and which outputs carry new values of which variables.

Lowering needs static shapes, so it happens once per concrete input signature; callers
cache the result.

Results whose size depends on the data (``tf.boolean_mask``, ``tf.where(c)``, ``tf.unique``)
have bounded dynamic dimensions in XLA (docs/ir.md): a static bound and a run-time size. The
IpuExecute op allocates its outputs before the device runs, so such a result travels at its
bound, with its run-time dims beside it::

    IpuExecute outputs: [entry outputs, each at its static shape or bound] + [one int32[rank]
                         per dynamic output: its run-time dims]
    runtime:            writes a dynamic output's run-time value into the leading corner of
                        its bound-sized buffer (zeros elsewhere), its dims into the extra one
    call_lowered:       tf.slice(output, 0, dims) -> the result at its run-time size, with
                        the static shape TF's own op gives (None where the size is dynamic)

The signature lists them (``"dynamic_outputs": [{"output": k, "dynamic": [flags]}]``, in the
order of the extra outputs; absent for static programs, which get no extra output). Variables
keep static shapes: a function that assigns one a value of dynamic size is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from device_server.protocol import dtypes as wire_dtypes
from device_server.protocol import ir_pb2
from tf_ipu.lowering.hlo_to_ir import hlo_module_to_ir

_KEY_ATTR = "_tf_ipu_key"


def variable_key(var: tf.Variable) -> str:
    """A process-independent key naming ``var`` on the device (stable for the object's life)."""
    key = getattr(var, _KEY_ATTR, None)
    if key is None:
        name = var.name.split(":")[0]
        key = f"{name}#{uuid.uuid4().hex[:12]}"
        try:
            setattr(var, _KEY_ATTR, key)
        except AttributeError:  # objects that refuse attributes get a fresh key each lowering
            pass
    return key


@dataclass(frozen=True)
class DynamicOutput:
    """An entry output with bounded dynamic dimensions (a result whose size depends on data).

    ``index``: the entry output (one of the function's results); ``dynamic``: which of its
    dimensions have a run-time size (``LoweredProgram.output_shapes[index]`` holds the
    bounds); ``shape``: the static shape of the result as TF gives it (``None`` where the
    size is dynamic).
    """

    index: int
    dynamic: tuple[bool, ...]
    shape: tf.TensorShape


@dataclass
class LoweredProgram:
    """A function lowered for one input signature, ready to be called on the device."""

    name: str
    program: bytes                      # serialized ir_pb2.Module
    signature: str                      # JSON, see module docstring
    arg_specs: list[tf.TensorSpec]
    variables: list[tf.Variable]        # in parameter order, after the arguments
    constants: list[tf.Tensor]          # captured non-variable tensors, after the variables
    output_dtypes: list[tf.DType]       # the kernel's outputs: the flattened entry result
    output_shapes: list[tf.TensorShape] # but for resident variables' new values (see updates)
    num_results: int                    # leading outputs that are the function's results
    result_structure: Any               # nest structure of the function's results
    # (entry output, variable) for every variable the program updates; the new values of
    # IPUVariables stay on the device, the others are kernel outputs assigned on the host.
    updates: list[tuple[int, tf.Variable]] = field(default_factory=list)
    module: ir_pb2.Module | None = None
    captured_kinds: list[str] = field(default_factory=list)  # "var"/"const", capture order
    # TF's dtype of each result where XLA's differs (a complex eigh's eigenvalues are real
    # in XLA, complex in TF's op): the results are cast back to what the function promised.
    result_casts: dict[int, tf.DType] = field(default_factory=dict)
    # Results of data-dependent size, in the order of the op's extra dims outputs (see the
    # module docstring); empty for static programs.
    dynamic_outputs: list[DynamicOutput] = field(default_factory=list)
    op_outputs: list[int] = field(default_factory=list)  # entry output of each kernel output
    replicas: int = 1  # replicas that run it at once: every kernel output is [replicas, ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.program).hexdigest()[:16]


_NO_XLA_KERNEL = re.compile(
    r"(\w+) \(No registered '\w+' OpKernel for XLA_\w+ devices compatible with node "
    r"(?:\{\{function_node [^}]+\}\})?\{\{node ([^}]+)\}\}")


def _not_compilable(message: str, program: str) -> Exception | None:
    """The error for TF ops XLA cannot compile (string ops, py_function, ...), naming each
    op, its type and its Keras layer; None if ``message`` is about something else."""
    from device_server.protocol.names import layer_of
    from tf_ipu import errors

    found = dict.fromkeys(_NO_XLA_KERNEL.findall(message))  # in order, once each
    if not found:
        return None
    if any(op_type == "IpuExecute" for op_type, _ in found):
        return errors.UnsupportedOpError(
            f"{program}: the function already runs on the IPU (it holds a device call, an "
            f"IpuExecute op, e.g. a loaded serving function or a tf.function that calls "
            f"strategy.run): call it directly, not through strategy.run.",
            kind="not-compilable",
        )
    named = []
    for op_type, node in found:
        layer = layer_of(node)
        named.append(f"op '{node}' ({op_type})" + (f" in Keras layer '{layer}'" if layer else ""))
    return errors.UnsupportedOpError(
        f"{program}: the IPU runs only what XLA compiles, and XLA has no kernel for "
        f"{'; '.join(named)}. Move that computation out of the model (into the input "
        f"pipeline, or after predict), or write it with ops XLA compiles.",
        kind="not-compilable",
    )


def _flatten_results(out: Any) -> list[tf.Tensor]:
    if out is None:  # a function run for its effects (variables, outfeeds)
        return []
    flat = tf.nest.flatten(out)
    for t in flat:
        if t is None:
            raise ValueError("A device function may not return None in its results.")
    return flat


def lower_function(
    fn: Callable[..., Any], arg_specs: Sequence[tf.TensorSpec], name: str, replicas: int = 1,
    pipeline: dict[str, Any] | None = None,
) -> LoweredProgram:
    """Traces ``fn`` for ``arg_specs`` and lowers it to a device program.

    Args:
        fn: takes one tensor per spec; returns a nest of tensors. It may read and assign
            variables; they become device-resident parameters.
        arg_specs: fully defined TensorSpecs.
        name: a name for messages and reports (e.g. "train_function").
        replicas: how many replicas run the program at once (``fn`` is one replica's
            program: every replica gets the same arguments and its own variables). Each of
            the op's outputs then has a leading dimension of replicas, and ``call_lowered``
            returns the results so.
        pipeline: a pipelined program's stages (``tf_ipu.pipelining.plan``); its ops were
            traced in their stages' name scopes, and each instruction gets its stage
            (``lowering/stages.py``).

    Returns:
        The ``LoweredProgram``.
    """
    for i, s in enumerate(arg_specs):
        if not s.shape.is_fully_defined():
            raise ValueError(
                f"{name}: argument {i} has shape {s.shape}; the IPU needs static shapes."
            )
    holder: dict[str, Any] = {}

    def flat_fn(*args: tf.Tensor) -> list[tf.Tensor]:
        out = fn(*args)
        holder["structure"] = out
        return _flatten_results(out)

    jf = tf.function(flat_fn, jit_compile=True)
    # This also works while an outer function is being traced (a serving function that
    # calls strategy.run): the program is then embedded in the outer graph. (No init_scope:
    # it would pause gradient tapes, and train steps need them.)
    from tf_ipu import feeds
    from tf_ipu.summaries import refuse_summaries

    try:
        with feeds.device_program():  # outfeed enqueues check what the device can send
            concrete = jf.get_concrete_function(*arg_specs)
            # tf.summary calls traced into the device program: an error naming each one
            # (XLA's own would name nothing).
            refuse_summaries(concrete.graph, name)
            hlo = jf.experimental_get_compiler_ir(*arg_specs)(stage="hlo_serialized")
    except (ValueError, tf.errors.OpError) as e:
        refused = _not_compilable(str(e), name)
        if refused is None:
            raise
        raise refused from None
    module = hlo_module_to_ir(hlo)
    module.name = name
    if pipeline:
        from tf_ipu.lowering.stages import assign_stages

        assign_stages(module, int(pipeline["stages"]),
                      checkpoints=bool(pipeline.get("recomputation_checkpoints")))

    from tf_ipu.variables import IPUVariable

    by_handle = {id(v.handle): v for v in concrete.variables}
    params: list[dict[str, Any]] = [{"kind": "arg", "index": i} for i in range(len(arg_specs))]
    ordered_vars: list[tf.Variable] = []
    ordered_consts: list[tf.Tensor] = []
    for captured in concrete.captured_inputs:
        var = by_handle.get(id(captured))
        if var is not None:
            ordered_vars.append(var)
            params.append({"kind": "var", "key": variable_key(var), "name": var.name,
                           "resident": isinstance(var, IPUVariable)})
        elif captured.dtype == tf.resource:
            raise ValueError(
                f"{name}: the function captures a resource that is not a variable "
                f"({captured!r}); only variables can live on the IPU."
            )
        else:
            ordered_consts.append(captured)
            params.append({"kind": "const"})

    entry = next(c for c in module.computations if c.id == module.entry_computation_id)
    n_params = sum(1 for i in entry.instructions if i.opcode == "parameter")
    if n_params != len(params):
        raise RuntimeError(
            f"{name}: the lowered program has {n_params} parameters but the function has "
            f"{len(arg_specs)} arguments and {len(concrete.captured_inputs)} captured inputs."
        )
    _annotate_parameters(entry, params)
    root = next(i for i in entry.instructions if i.id == entry.root_id)
    out_shapes = _flat_shapes(root.shape)
    out_dynamic = _flat_dynamic(root.shape)
    flat_results = _flatten_results(holder["structure"])
    num_results = len(flat_results)

    var_param = {
        idx: var
        for idx, var in zip(
            [i for i, p in enumerate(params) if p["kind"] == "var"], ordered_vars, strict=True
        )
    }
    updates: list[tuple[int, tf.Variable]] = []
    for alias in module.aliases:
        var = var_param.get(alias.parameter_number)
        if var is None:
            raise RuntimeError(
                f"{name}: output {alias.output_index} aliases parameter "
                f"{alias.parameter_number}, which is not a variable."
            )
        flags = out_dynamic[alias.output_index]
        if any(flags):
            shown = _spelling(out_shapes[alias.output_index][1], flags)
            raise ValueError(
                f"{name}: variable {var.name!r} is assigned a value whose size depends on "
                f"the data (shape {shown}, e.g. from tf.boolean_mask, tf.where or "
                f"tf.unique), but variables on the IPU keep static shapes. Assign a value of "
                f"the variable's shape (e.g. tf.where(mask, x, 0) rather than "
                f"tf.boolean_mask(x, mask)), or return the value from the function."
            )
        updates.append((alias.output_index, var))
    # The kernel's outputs: all entry outputs but the new values of resident variables,
    # which stay on the device (host reads fetch them: tf_ipu.variables).
    resident_outputs = {o for o, v in updates if isinstance(v, IPUVariable)}
    op_outputs = [k for k in range(len(out_shapes)) if k not in resident_outputs]

    dynamic_outputs: list[DynamicOutput] = []
    for k, flags in enumerate(out_dynamic):
        if not any(flags):
            continue
        if k >= num_results:  # not a result, not a variable's new value: cannot happen
            raise RuntimeError(
                f"{name}: output {k} has a dynamic shape but is not one of the function's "
                f"{num_results} results."
            )
        bound = out_shapes[k][1]
        shape = tf.TensorShape([None if dyn else d for d, dyn in zip(bound, flags, strict=True)])
        try:
            shape = shape.merge_with(flat_results[k].shape)
        except ValueError:
            pass  # XLA's bounds are the truth for the device; TF's shape only refines them
        dynamic_outputs.append(DynamicOutput(k, flags, shape))

    if replicas > 1 and dynamic_outputs:
        raise ValueError(
            f"{name}: results whose size depends on the data (shapes "
            f"{[str(d.shape) for d in dynamic_outputs]}) cannot come from a replicated "
            f"program ({replicas} replicas): return values of static shapes.")
    sig: dict[str, Any] = {"version": 1, "name": name, "params": params,
                           "num_results": num_results}
    if replicas > 1:
        sig["replicas"] = int(replicas)
    if pipeline:
        sig["pipeline"] = {k: pipeline[k] for k in ("stages", "stage_ipus", "ipus_per_replica",
                                                    "schedule", "micro_batches", "recomputation",
                                                    "offload", "sharding",
                                                    "stage_memory_proportions") if k in pipeline}
    if resident_outputs:
        sig["op_outputs"] = op_outputs
    if dynamic_outputs:
        sig["dynamic_outputs"] = [
            {"output": d.index, "dynamic": list(d.dynamic)} for d in dynamic_outputs
        ]
    signature = json.dumps(sig)
    return LoweredProgram(
        name=name,
        program=module.SerializeToString(deterministic=True),
        signature=signature,
        arg_specs=list(arg_specs),
        variables=ordered_vars,
        constants=ordered_consts,
        output_dtypes=[tf.as_dtype(wire_dtypes.to_numpy(out_shapes[k][0])) for k in op_outputs],
        output_shapes=[tf.TensorShape(((replicas,) if replicas > 1 else ()) + tuple(out_shapes[k][1]))
                       for k in op_outputs],
        num_results=num_results,
        result_structure=holder["structure"],
        updates=updates,
        module=module,
        captured_kinds=[p["kind"] for p in params[len(arg_specs):]],
        result_casts={
            i: t.dtype for i, (t, (d, _)) in enumerate(zip(flat_results, out_shapes, strict=False))
            if t.dtype != tf.as_dtype(wire_dtypes.to_numpy(d))
        },
        dynamic_outputs=dynamic_outputs,
        op_outputs=op_outputs,
        replicas=max(1, int(replicas)),
    )


_PARAM_KINDS = {"arg": "argument", "var": "variable", "const": "constant"}


def _annotate_parameters(entry: ir_pb2.Computation, params: list[dict[str, Any]]) -> None:
    """Says in each entry parameter's ``source_type`` whether it is an argument (streamed from
    the host each call), a variable (resident on the device) or a captured constant, and names
    variables in ``source_op`` (their layer, for memory reports); see docs/ir.md."""
    for instr in entry.instructions:
        if instr.opcode != "parameter" or instr.parameter_number >= len(params):
            continue
        p = params[instr.parameter_number]
        instr.source_type = _PARAM_KINDS[p["kind"]]
        if p["kind"] == "var":
            instr.source_op = str(p["name"]).split(":")[0]


def _flat_shapes(shape: ir_pb2.Shape) -> list[tuple[int, tuple[int, ...]]]:
    if shape.is_tuple:
        out: list[tuple[int, tuple[int, ...]]] = []
        for s in shape.tuple_shapes:
            out.extend(_flat_shapes(s))
        return out
    return [(shape.dtype, tuple(int(d) for d in shape.dims))]


def _flat_dynamic(shape: ir_pb2.Shape) -> list[tuple[bool, ...]]:
    """Which dimensions of each leaf of ``shape`` (flattened as ``_flat_shapes``) are dynamic."""
    if shape.is_tuple:
        out: list[tuple[bool, ...]] = []
        for s in shape.tuple_shapes:
            out.extend(_flat_dynamic(s))
        return out
    flags = tuple(bool(b) for b in shape.dynamic_dims)
    return [flags + (False,) * (len(shape.dims) - len(flags))]


def _spelling(dims: Sequence[int], dynamic: Sequence[bool]) -> str:
    """``[<=8,3]``: a dynamic dimension is spelled by its bound, as in HLO."""
    return "[" + ",".join(("<=" if dy else "") + str(d) for d, dy in zip(dims, dynamic, strict=True)) + "]"


def call_lowered(lowered: LoweredProgram, args: Sequence[tf.Tensor]) -> Any:
    """Emits the device call for ``lowered`` (in a graph being traced, or eagerly).

    Reads the variables, runs the program on the device through the IpuExecute op, writes
    the new values of updated variables back to the host variables (so every host read sees
    the result of the last device call), and returns the function's results. A result of
    data-dependent size comes from the op at its bound, with its run-time dims in an extra
    output, and is sliced to them here (module docstring).
    """
    import tf_ipu_ops
    from tensorflow.python.ops import gen_resource_variable_ops

    from tf_ipu import runtime

    runtime.get_runtime().ensure_handler()
    inputs: list[tf.Tensor] = list(args)
    vars_iter = iter(lowered.variables)
    consts_iter = iter(lowered.constants)
    for kind in lowered.captured_kinds:
        if kind == "var":
            # The host buffer as it is (no refresh from the device: the runtime uploads it
            # only if the host wrote it since).
            var = next(vars_iter)
            inputs.append(gen_resource_variable_ops.read_variable_op(var.handle, var.dtype))
        else:
            inputs.append(next(consts_iter))
    dyn = lowered.dynamic_outputs
    outs = tf_ipu_ops.ipu_execute(
        inputs,
        Tout=lowered.output_dtypes + [tf.int32] * len(dyn),
        output_shapes=lowered.output_shapes
        + [tf.TensorShape([len(d.dynamic)]) for d in dyn],
        program=lowered.program,
        signature=lowered.signature,
    )
    position = {k: i for i, k in enumerate(lowered.op_outputs)}
    for index, var in lowered.updates:
        if index in position:  # not resident: the device sent it back (replica 0's)
            var.assign(outs[position[index]] if lowered.replicas == 1 else outs[position[index]][0])
    results = list(outs[: lowered.num_results])
    n_outputs = len(lowered.op_outputs)
    for d, dims in zip(dyn, outs[n_outputs:], strict=True):
        value = tf.slice(results[d.index], tf.zeros_like(dims), dims)
        value.set_shape(d.shape)
        results[d.index] = value
    for i, dtype in lowered.result_casts.items():
        results[i] = tf.cast(results[i], dtype)
    if lowered.result_structure is None:
        return None
    return tf.nest.pack_sequence_as(lowered.result_structure, results)
