"""ONNX graph -> IR module (docs/ir.md): the walk over nodes, host folding of shape
subgraphs, subgraphs of If/Loop as called computations.

    ModelProto (static input shapes: shapes.py)
      initializers, Constant           -> host values (Val.const)
      node, all inputs host values,
        op in fold.FOLDERS              -> folded on the host (Shape/Gather/Concat/... of shapes)
      node                              -> registry.OPS[op_type](ctx): IR instructions
      If (condition not known)          -> conditional, a computation per branch
      Loop                              -> while (condition, body computations)
    entry: parameters = the model's inputs (converted to FP16 when asked), root = a tuple of
    the model's outputs (converted back to their declared types)

An operator, attribute or data type with no mapping raises ``UnsupportedOnnxError`` naming
the node, op_type, domain and opset; nothing is dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from device_server.protocol import REPLICA_ID_TARGET, ir_pb2
from tf_ipu.onnx import dtypes, fold
from tf_ipu.onnx import ops_control as _ops_control  # noqa: F401  (registers its ops)
from tf_ipu.onnx import ops_elementwise as _ops_elementwise  # noqa: F401
from tf_ipu.onnx import ops_nn as _ops_nn  # noqa: F401
from tf_ipu.onnx import ops_tensor as _ops_tensor  # noqa: F401
from tf_ipu.onnx.context import Ctx, NeedsInputValue  # noqa: F401  (NeedsInputValue: re-exported)
from tf_ipu.onnx.errors import OnnxError, OnnxLoadError, UnsupportedOnnxError
from tf_ipu.onnx.ir_builder import Comp, ModuleBuilder, Val
from tf_ipu.onnx.loader import ONNX_DOMAINS, default_opset
from tf_ipu.onnx.registry import OPS
from tf_ipu.onnx.shapes import InputSpec

PRECISIONS = ("fp32", "fp16")


@dataclass(frozen=True)
class OutputSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclass
class ImportedProgram:
    """What the importer made: the module and the signature run() checks against."""

    module: ir_pb2.Module
    inputs: list[InputSpec]          # the entry parameters, in order (full batch)
    outputs: list[OutputSpec]        # the entry's outputs, per replica
    op_types: dict[str, int] = field(default_factory=dict)  # op_type -> nodes imported


class Importer:
    """Imports one model (checked, opset >= 7) for the given static input shapes."""

    def __init__(self, model: onnx.ModelProto, specs: Sequence[InputSpec], precision: str = "fp32",
                 input_values: Mapping[str, np.ndarray] | None = None, replicas: int = 1,
                 name: str = "model", entry_specs: Sequence[InputSpec] | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}.")
        self.model = model
        self.graph = model.graph
        self.specs = list(specs)
        #: the entry parameters' shapes (the whole batch when replicated; else ``specs``)
        self.entry_specs = list(entry_specs or specs)
        self.precision = precision
        self.float_type = np.dtype(np.float16 if precision == "fp16" else np.float32)
        self.input_values = {k: np.asarray(v) for k, v in (input_values or {}).items()}
        self.replicas = replicas
        self.name = name
        self.opset = default_opset(model)
        self.other_opsets = {i.domain: i.version for i in model.opset_import if i.domain not in ONNX_DOMAINS}
        self.input_names = {s.name for s in self.specs}
        self.mb = ModuleBuilder(name)
        self.op_types: dict[str, int] = {}
        self.local_functions = {(f.domain, f.name): f for f in model.functions}
        self.current_env: dict[str, Val] = {}

    # -- values -------------------------------------------------------------------------
    def host(self, a: np.ndarray) -> Val:
        """A host constant, float32 demoted to FP16 when asked."""
        a = np.asarray(a)
        if self.precision == "fp16" and a.dtype == np.float32:
            a = a.astype(np.float16)
        return Val.of(a)

    def tensor_value(self, t: onnx.TensorProto, what: str) -> np.ndarray:
        dt = dtypes.to_numpy(t.data_type)
        if dt is None:
            name = dtypes.type_name(t.data_type)
            raise UnsupportedOnnxError(f"{what}: tensor {t.name!r} has data type {name}, which the IPU does not have.",
                                       dtype=name)
        try:
            return np.asarray(numpy_helper.to_array(t), order="C")
        except (ValueError, TypeError) as e:
            raise OnnxLoadError(f"{what}: tensor {t.name!r} cannot be read: {e}") from None

    # -- the model ----------------------------------------------------------------------
    def run(self) -> ImportedProgram:
        entry = self.mb.computation("main")
        env: dict[str, Val] = {}
        for t in self.graph.initializer:
            env[t.name] = self.host(self.tensor_value(t, "Initializer"))
        for t in self.graph.sparse_initializer:
            raise UnsupportedOnnxError(f"Sparse initializer {t.values.name!r} is not supported.")
        replica_start = None
        if self.replicas > 1:
            rid = entry.op("custom-call", [], np.int32, (), custom_call_target=REPLICA_ID_TARGET)
            replica_start = rid
        number = 0
        for spec, full in zip(self.specs, self.entry_specs, strict=True):
            if spec.name in self.input_values:
                value = np.asarray(self.input_values[spec.name])
                if value.dtype != full.dtype or value.shape != full.shape:
                    raise OnnxLoadError(
                        f"input_values[{spec.name!r}] is {value.dtype}{list(value.shape)}; the model "
                        f"declares {full.dtype}{list(full.shape)}.")
                env[spec.name] = self.host(value)
                continue
            p = entry.parameter(number, full.dtype, full.shape, source_type="argument", source_op=spec.name)
            number += 1
            if replica_start is not None and full.shape != spec.shape:
                per = spec.shape[0]
                start = entry.binary("multiply", replica_start, entry.constant(np.int32(per), np.int32))
                zero = entry.constant(np.int32(0), np.int32)
                p = entry.op("dynamic-slice", [p, start] + [zero] * (len(spec.shape) - 1), spec.dtype,
                             spec.shape, slice_sizes=list(spec.shape))
            if self.precision == "fp16" and spec.dtype == np.float32:
                p = entry.convert(p, np.float16)
            env[spec.name] = p
        self.import_nodes(self.graph, entry, env, self.opset)
        outs, specs = [], []
        for o in self.graph.output:
            if o.name not in env:
                raise OnnxLoadError(f"Graph output {o.name!r} is computed by no node.")
            v = env[o.name]
            declared = None
            if o.type.HasField("tensor_type") and o.type.tensor_type.elem_type:
                declared = dtypes.to_numpy(o.type.tensor_type.elem_type)
            if declared is None:
                declared = np.dtype(np.float32) if (self.precision == "fp16" and v.dtype == np.float16) else v.dtype
            v = entry.use(entry.convert(v, declared)) if v.dtype != declared else entry.use(v)
            outs.append(v)
            specs.append(OutputSpec(o.name, v.dtype, v.shape))
        entry.root(entry.tuple(outs))
        module = self.mb.finish(entry)
        inputs = [s for s in self.entry_specs if s.name not in self.input_values]
        return ImportedProgram(module, inputs, specs, dict(self.op_types))

    def import_nodes(self, graph: onnx.GraphProto, comp: Comp, env: dict[str, Val], opset: int) -> None:
        for node in graph.node:
            self.import_node(node, comp, env, opset)

    def import_node(self, node: onnx.NodeProto, comp: Comp, env: dict[str, Val], opset: int) -> None:
        inputs: list[Val | None] = []
        for name in node.input:
            if not name:
                inputs.append(None)
            elif name in env:
                inputs.append(env[name])
            else:
                raise OnnxLoadError(f"ONNX node {node.name!r} ({node.op_type}) reads {name!r}, which no "
                                    "earlier node, input or initializer defines.")
        ctx = Ctx(self, node, comp, inputs, opset)
        self.current_env = env
        if (node.domain or "") not in ONNX_DOMAINS:
            fn = self.local_functions.get((node.domain, node.op_type))
            if fn is not None:
                return self._inline_function(ctx, fn, env)
            raise UnsupportedOnnxError(
                f"ONNX {ctx.describe().replace(f'opset {opset}', f'opset {self.other_opsets.get(node.domain, 0)}')}: "
                f"the domain {node.domain!r} is not supported (only ai.onnx).",
                node=node.name, op_type=node.op_type, domain=node.domain,
                opset=self.other_opsets.get(node.domain, 0))
        opdef = OPS.get(node.op_type)
        if opdef is None:
            raise ctx.refuse("this operator is not supported (docs/onnx.md lists those that are)")
        unknown = sorted(set(ctx.attrs) - opdef.attrs)
        if unknown:
            raise ctx.refuse(f"attribute(s) {unknown} not supported")
        for a in node.attribute:
            if a.ref_attr_name:
                raise ctx.refuse(f"attribute {a.name!r} refers to a function attribute; not supported")
        comp.source = (node.name or f"{node.op_type}:{node.output[0]}", node.op_type)
        try:
            folded = fold.try_fold(ctx)
            outs = folded if folded is not None else opdef.fn(ctx)
        except OnnxError:
            raise
        except ValueError as e:  # numpy's, e.g. inputs whose shapes do not broadcast
            raise OnnxLoadError(f"ONNX {ctx.describe()}: its inputs do not fit the operator "
                                f"(shapes {[list(v.shape) if v is not None else None for v in inputs]}): "
                                f"{e}") from None
        self.op_types[node.op_type] = self.op_types.get(node.op_type, 0) + 1
        if len(outs) < len([o for o in node.output if o]):
            wanted = [o for o in node.output[len(outs):] if o]
            if wanted:
                raise ctx.refuse(f"output(s) {wanted} are not supported")
        for name, v in zip(node.output, outs, strict=False):
            if name:
                self._check_dtype(ctx, v)
                env[name] = v

    def _check_dtype(self, ctx: Ctx, v: Val) -> None:
        if v.dtype.kind == "c":
            raise ctx.refuse(f"complex values ({v.dtype}) are not supported")

    def _inline_function(self, ctx: Ctx, fn: onnx.FunctionProto, env: dict[str, Val]) -> None:
        inner: dict[str, Val] = {}
        for formal, actual in zip(fn.input, ctx.node.input, strict=False):
            if actual:
                inner[formal] = env[actual]
        fn_opset = next((i.version for i in fn.opset_import if i.domain in ONNX_DOMAINS), self.opset)
        for node in fn.node:
            if any(a.ref_attr_name for a in node.attribute):
                raise ctx.refuse(f"function {fn.name!r} uses attribute references; not supported")
            self.import_node(node, ctx.comp, inner, fn_opset)
        for formal, actual in zip(fn.output, ctx.node.output, strict=False):
            if actual:
                env[actual] = inner[formal]

    # -- subgraphs ----------------------------------------------------------------------
    @staticmethod
    def free_names(graph: onnx.GraphProto) -> list[str]:
        """Names a subgraph reads from its enclosing scopes, in first-use order."""
        defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
        free: list[str] = []
        for node in graph.node:
            reads = list(node.input)
            for a in node.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    reads += Importer.free_names(g)
            for name in reads:
                if name and name not in defined and name not in free:
                    free.append(name)
            defined.update(node.output)
        return free

    def subgraph(self, ctx: Ctx, graph: onnx.GraphProto, env: Mapping[str, Val], label: str,
                 leading: Sequence[Val] = ()) -> tuple[Comp, list[Val], list[str], list[Val]]:
        """A computation for ``graph``: parameter 0 a tuple of ``leading`` values (bound to the
        graph's first inputs) then the outer values it captures. Returns the computation, the
        captured outer values, their names, and the graph's outputs (in the computation)."""
        captured_names = [n for n in self.free_names(graph) if n in env and not env[n].is_const]
        captured = [env[n] for n in captured_names]
        comp = self.mb.computation(self.mb.unique(f"{ctx.node.name or ctx.node.op_type}_{label}"))
        inner_env = {n: v for n, v in env.items() if v.is_const}
        params = comp.tuple_parameter(0, list(leading) + captured)
        for formal, v in zip(graph.input, params[:len(leading)], strict=False):
            inner_env[formal.name] = v
        for n, v in zip(captured_names, params[len(leading):], strict=True):
            inner_env[n] = v
        for t in graph.initializer:
            inner_env[t.name] = self.host(self.tensor_value(t, "Initializer"))
        saved = comp.source
        self.import_nodes(graph, comp, inner_env, ctx.opset)
        comp.source = saved
        outs = []
        for o in graph.output:
            if o.name not in inner_env:
                raise ctx.refuse(f"{label} output {o.name!r} is computed by no node")
            outs.append(comp.use(inner_env[o.name]))
        return comp, captured, captured_names, outs


def import_model(model: onnx.ModelProto, specs: Sequence[InputSpec], **kwargs: Any) -> ImportedProgram:
    """Imports ``model`` (see ``Importer``)."""
    return Importer(model, specs, **kwargs).run()
