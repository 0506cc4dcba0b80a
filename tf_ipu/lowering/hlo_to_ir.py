"""Converts an XLA ``HloModuleProto`` into the device IR (``ir_pb2.Module``).

The IR keeps HLO's opcode spellings and meaning; this module only re-expresses HLO's typed
proto fields as the IR's generic, named attributes (documented per opcode in ``docs/ir.md``,
the contract every front end follows). It converts every computation and instruction, tuple
shapes, constants (decoded to raw little-endian bytes), the entry's input/output aliasing and
the TF op name/type of each instruction (``source_op``/``source_type``), so errors and reports
can name the Keras layer.

Anything in the HLO that would change the meaning of an instruction but has no IR
representation here (collectives' replica groups, infeed configs, fp8 element types, tuple
parameters in aliases, ...) raises :class:`HloConversionError` naming the opcode, the
instruction and the TF op, rather than being dropped silently. Opcodes without special fields
pass through unchanged; whether the device can run them is the emulator's decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from tensorflow.compiler.xla import xla_data_pb2 as xd
from tensorflow.compiler.xla.service import hlo_pb2

from device_server.protocol import ir_pb2

__all__ = ["HloConversionError", "hlo_module_to_ir", "hlo_proto_to_ir"]


class HloConversionError(ValueError):
    """An HLO construct that has no IR equivalent (names opcode, instruction and TF op)."""


# XLA element type -> (IR dtype, numpy dtype for literal decoding).
_ELEMENT_TYPES: dict[int, tuple[int, np.dtype | None]] = {
    xd.PRED: (ir_pb2.PRED, np.dtype(np.bool_)),
    xd.S8: (ir_pb2.S8, np.dtype(np.int8)),
    xd.S16: (ir_pb2.S16, np.dtype(np.int16)),
    xd.S32: (ir_pb2.S32, np.dtype(np.int32)),
    xd.S64: (ir_pb2.S64, np.dtype(np.int64)),
    xd.U8: (ir_pb2.U8, np.dtype(np.uint8)),
    xd.U16: (ir_pb2.U16, np.dtype(np.uint16)),
    xd.U32: (ir_pb2.U32, np.dtype(np.uint32)),
    xd.U64: (ir_pb2.U64, np.dtype(np.uint64)),
    xd.F16: (ir_pb2.F16, np.dtype(np.float16)),
    xd.BF16: (ir_pb2.BF16, np.dtype(ml_dtypes.bfloat16)),
    xd.F32: (ir_pb2.F32, np.dtype(np.float32)),
    xd.F64: (ir_pb2.F64, np.dtype(np.float64)),
    xd.C64: (ir_pb2.C64, np.dtype(np.complex64)),
    xd.C128: (ir_pb2.C128, np.dtype(np.complex128)),
    xd.TOKEN: (ir_pb2.TOKEN, None),
}

# HLO instruction fields that carry no meaning for a single-device functional execution.
_IGNORED_FIELDS = frozenset(
    {
        "name", "opcode", "shape", "metadata", "id", "operand_ids", "called_computation_ids",
        "control_predecessor_ids",  # ordering only; the IR is side-effect free
        "sharding", "domain_entry_sharding", "domain_exit_sharding",  # single device
        "frontend_attributes", "statistics_viz", "original_value", "parameter_replication",
        "backend_config",  # backend tuning hints (but a custom-call's opaque data, kept below)
        "is_composite",  # a composite call still means "call"
        "padding_type", "conv_kind", "is_associative",  # hints derivable from other fields
    }
)

_CUSTOM_CALL_FIELDS = frozenset(
    {
        "custom_call_has_side_effect", "operand_shapes_with_layout", "output_operand_aliasing",
        "custom_call_schedule", "custom_call_api_version",
        "constrain_layout",  # layouts are the default, row-major, on the device anyway
    }
)


def _where(instr: hlo_pb2.HloInstructionProto) -> str:
    src = instr.metadata.op_name or "<no TF op>"
    kind = f" ({instr.metadata.op_type})" if instr.metadata.op_type else ""
    return f"{instr.opcode} instruction '{instr.name}' from TF op '{src}'{kind}"


def _spelled(enum: Any, value: int) -> str:
    """``value``'s name in the proto ``enum``, or ``#value`` for a number it does not name."""
    return enum.Name(value) if value in enum.values() else f"#{value}"


def _enum_name(h: hlo_pb2.HloInstructionProto, enum: Any, value: int, what: str) -> str:
    """``value``'s name in the proto ``enum``; a number it does not name is refused."""
    if value not in enum.values():
        raise HloConversionError(f"{_where(h)}: {what} {value} is not one XLA defines.")
    return enum.Name(value)


# ----------------------------------------------------------------------------------- shapes


def _convert_shape(shape: xd.ShapeProto, what: Callable[[], str]) -> ir_pb2.Shape:
    out = ir_pb2.Shape()
    if shape.element_type == xd.TUPLE:
        out.is_tuple = True
        for s in shape.tuple_shapes:
            out.tuple_shapes.append(_convert_shape(s, what))
        return out
    entry = _ELEMENT_TYPES.get(shape.element_type)
    if entry is None:
        raise HloConversionError(
            f"{what()}: element type {_spelled(xd.PrimitiveType, shape.element_type)} is not "
            f"supported by the device IR."
        )
    out.dtype = entry[0]
    out.dims.extend(int(d) for d in shape.dimensions)
    if any(shape.is_dynamic_dimension):
        out.dynamic_dims.extend(bool(b) for b in shape.is_dynamic_dimension)
    return out


def _leaf_count(shape: xd.ShapeProto) -> int:
    if shape.element_type == xd.TUPLE:
        return sum(_leaf_count(s) for s in shape.tuple_shapes)
    return 1


def _flat_index(shape: xd.ShapeProto, path: list[int]) -> int:
    """Index of the leaf at ``path`` in the depth-first flattening of ``shape``."""
    flat = 0
    for k in path:
        if shape.element_type != xd.TUPLE or not 0 <= k < len(shape.tuple_shapes):
            raise HloConversionError(f"alias output index {path} does not exist in the result.")
        flat += sum(_leaf_count(s) for s in shape.tuple_shapes[:k])
        shape = shape.tuple_shapes[k]
    if shape.element_type == xd.TUPLE:
        raise HloConversionError(f"alias output index {path} names a tuple, not an array.")
    return flat


# --------------------------------------------------------------------------------- literals

_LITERAL_FIELD = {
    xd.PRED: "preds", xd.S8: "s8s", xd.U8: "u8s", xd.S16: "s16s", xd.U16: "u16s",
    xd.S32: "s32s", xd.S64: "s64s", xd.U32: "u32s", xd.U64: "u64s", xd.F16: "f16s",
    xd.BF16: "bf16s", xd.F32: "f32s", xd.F64: "f64s", xd.C64: "c64s", xd.C128: "c128s",
}


def _convert_literal(lit: xd.LiteralProto, what: Callable[[], str]) -> ir_pb2.Literal:
    out = ir_pb2.Literal(shape=_convert_shape(lit.shape, what))
    et = lit.shape.element_type
    if et == xd.TUPLE:
        for sub in lit.tuple_literals:
            out.tuple_elements.append(_convert_literal(sub, what))
        return out
    if et == xd.TOKEN:
        return out
    dt = _ELEMENT_TYPES[et][1]
    assert dt is not None
    count = int(np.prod([int(d) for d in lit.shape.dimensions], dtype=np.int64))
    raw = getattr(lit, _LITERAL_FIELD[et])
    if isinstance(raw, bytes):  # s8s/u8s and f16s/bf16s are packed little-endian bytes
        arr = np.frombuffer(raw, dtype=dt.newbyteorder("<"))
    elif dt.kind == "c":
        parts = np.asarray(list(raw), dtype=np.float32 if dt.itemsize == 8 else np.float64)
        arr = parts[0::2] + 1j * parts[1::2] if parts.size else np.zeros(0, dt)
    else:
        arr = np.asarray(list(raw), dtype=dt)
    if arr.size != count:
        raise HloConversionError(
            f"{what()}: constant of shape {list(lit.shape.dimensions)} holds {arr.size} "
            f"values, expected {count}."
        )
    out.data = np.asarray(arr, dtype=dt.newbyteorder("<"), order="C").tobytes()
    return out


# ------------------------------------------------------------------------------- attributes


class _Attrs:
    """Helper writing typed values into an instruction's attribute map."""

    def __init__(self, instr: ir_pb2.Instruction) -> None:
        self.m = instr.attrs

    def i(self, name: str, v: int) -> None:
        self.m[name].i = int(v)

    def f(self, name: str, v: float) -> None:
        self.m[name].f = float(v)

    def s(self, name: str, v: str) -> None:
        self.m[name].s = v

    def b(self, name: str, v: bytes) -> None:
        self.m[name].b = v

    def flag(self, name: str, v: bool) -> None:
        self.m[name].flag = bool(v)

    def ints(self, name: str, vs) -> None:  # noqa: ANN001 - any iterable of ints
        self.m[name].ints.values.extend(int(v) for v in vs)
        self.m[name].ints.SetInParent()

    def strings(self, name: str, vs) -> None:  # noqa: ANN001
        self.m[name].strings.values.extend(vs)
        self.m[name].strings.SetInParent()


_SINGLE_DIMENSION_OPCODES = {
    "concatenate", "iota", "sort", "get-dimension-size", "set-dimension-size",
}


def _dimensions(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    if h.opcode == "transpose":
        a.ints("permutation", h.dimensions)
    elif h.opcode in _SINGLE_DIMENSION_OPCODES:
        if len(h.dimensions) != 1:
            raise HloConversionError(f"{_where(h)}: expected one dimension, got {list(h.dimensions)}.")
        a.i("dimension", h.dimensions[0])
    else:
        a.ints("dimensions", h.dimensions)


def _window(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    dims = h.window.dimensions
    a.ints("window_size", (d.size for d in dims))
    a.ints("window_strides", (d.stride or 1 for d in dims))
    a.ints("padding_low", (d.padding_low for d in dims))
    a.ints("padding_high", (d.padding_high for d in dims))
    a.ints("base_dilation", (d.base_dilation or 1 for d in dims))
    a.ints("window_dilation", (d.window_dilation or 1 for d in dims))
    a.ints("window_reversal", (int(d.window_reversal) for d in dims))


def _conv_dims(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    c = h.convolution_dimension_numbers
    a.i("input_batch_dimension", c.input_batch_dimension)
    a.i("input_feature_dimension", c.input_feature_dimension)
    a.ints("input_spatial_dimensions", c.input_spatial_dimensions)
    a.i("kernel_input_feature_dimension", c.kernel_input_feature_dimension)
    a.i("kernel_output_feature_dimension", c.kernel_output_feature_dimension)
    a.ints("kernel_spatial_dimensions", c.kernel_spatial_dimensions)
    a.i("output_batch_dimension", c.output_batch_dimension)
    a.i("output_feature_dimension", c.output_feature_dimension)
    a.ints("output_spatial_dimensions", c.output_spatial_dimensions)


def _dot_dims(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    d = h.dot_dimension_numbers
    a.ints("lhs_contracting_dimensions", d.lhs_contracting_dimensions)
    a.ints("rhs_contracting_dimensions", d.rhs_contracting_dimensions)
    a.ints("lhs_batch_dimensions", d.lhs_batch_dimensions)
    a.ints("rhs_batch_dimensions", d.rhs_batch_dimensions)


def _gather_dims(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    g = h.gather_dimension_numbers
    a.ints("offset_dims", g.offset_dims)
    a.ints("collapsed_slice_dims", g.collapsed_slice_dims)
    a.ints("start_index_map", g.start_index_map)
    a.i("index_vector_dim", g.index_vector_dim)
    a.ints("operand_batching_dims", g.operand_batching_dims)
    a.ints("start_indices_batching_dims", g.start_indices_batching_dims)


def _scatter_dims(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    s = h.scatter_dimension_numbers
    a.ints("update_window_dims", s.update_window_dims)
    a.ints("inserted_window_dims", s.inserted_window_dims)
    a.ints("scatter_dims_to_operand_dims", s.scatter_dims_to_operand_dims)
    a.i("index_vector_dim", s.index_vector_dim)
    a.ints("input_batching_dims", s.input_batching_dims)
    a.ints("scatter_indices_batching_dims", s.scatter_indices_batching_dims)


def _slice(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    sd = h.slice_dimensions
    a.ints("start_indices", (d.start for d in sd))
    a.ints("limit_indices", (d.limit for d in sd))
    a.ints("strides", (d.stride or 1 for d in sd))


def _padding(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    pd = h.padding_config.dimensions
    a.ints("edge_padding_low", (d.edge_padding_low for d in pd))
    a.ints("edge_padding_high", (d.edge_padding_high for d in pd))
    a.ints("interior_padding", (d.interior_padding for d in pd))


def _precision(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    pc = h.precision_config
    if pc.algorithm != 0:
        raise HloConversionError(
            f"{_where(h)}: dot algorithm {_spelled(xd.PrecisionConfig.Algorithm, pc.algorithm)} is not "
            f"supported (only the default algorithm)."
        )
    if pc.operand_precision:
        a.strings("operand_precision", (_enum_name(h, xd.PrecisionConfig.Precision, p, "operand precision") for p in pc.operand_precision))


def _result_accuracy(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    ra = h.result_accuracy
    if ra.ListFields() and not (ra.HasField("mode") and ra.mode == 0):
        raise HloConversionError(f"{_where(h)}: a requested result accuracy is not supported.")


def _rng_algorithm(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    a.s("algorithm", _enum_name(h, xd.RandomAlgorithm, h.rng_algorithm, "rng algorithm").removeprefix("RNG_").lower())


def _distribution(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    a.s("distribution", _enum_name(h, xd.RandomDistribution, h.distribution, "distribution").removeprefix("RNG_").lower())


def _triangular(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
    t = h.triangular_solve_options
    a.flag("left_side", t.left_side)
    a.flag("lower", t.lower)
    a.flag("unit_diagonal", t.unit_diagonal)
    a.s("transpose_a", _enum_name(h, xd.TriangularSolveOptions.Transpose, t.transpose_a, "transpose_a"))


def _simple(field: str, attr: str, kind: str) -> Callable[[hlo_pb2.HloInstructionProto, _Attrs], None]:
    def conv(h: hlo_pb2.HloInstructionProto, a: _Attrs) -> None:
        v = getattr(h, field)
        if kind == "ints":
            a.ints(attr, v)
        else:
            getattr(a, kind)(attr, v)

    return conv


# HLO field name -> converter writing the IR attributes. A set field missing here is an error.
_FIELD_CONVERTERS: dict[str, Callable[[hlo_pb2.HloInstructionProto, _Attrs], None]] = {
    "tuple_index": _simple("tuple_index", "index", "i"),
    "dimensions": _dimensions,
    "window": _window,
    "convolution_dimension_numbers": _conv_dims,
    "feature_group_count": _simple("feature_group_count", "feature_group_count", "i"),
    "batch_group_count": _simple("batch_group_count", "batch_group_count", "i"),
    "slice_dimensions": _slice,
    "exponent_bits": _simple("exponent_bits", "exponent_bits", "i"),
    "mantissa_bits": _simple("mantissa_bits", "mantissa_bits", "i"),
    "dynamic_slice_sizes": _simple("dynamic_slice_sizes", "slice_sizes", "ints"),
    "padding_config": _padding,
    "distribution": _distribution,
    "epsilon": _simple("epsilon", "epsilon", "f"),
    "feature_index": _simple("feature_index", "feature_index", "i"),
    "custom_call_target": _simple("custom_call_target", "custom_call_target", "s"),
    "dot_dimension_numbers": _dot_dims,
    "fft_type": lambda h, a: a.s("fft_type", _enum_name(h, xd.FftType, h.fft_type, "fft_type")),
    "fft_length": _simple("fft_length", "fft_length", "ints"),
    "comparison_direction": _simple("comparison_direction", "direction", "s"),
    "comparison_type": _simple("comparison_type", "compare_type", "s"),
    "gather_dimension_numbers": _gather_dims,
    "gather_slice_sizes": _simple("gather_slice_sizes", "slice_sizes", "ints"),
    "scatter_dimension_numbers": _scatter_dims,
    "indices_are_sorted": _simple("indices_are_sorted", "indices_are_sorted", "flag"),
    "unique_indices": _simple("unique_indices", "unique_indices", "flag"),
    "is_stable": _simple("is_stable", "is_stable", "flag"),
    "precision_config": _precision,
    "rng_algorithm": _rng_algorithm,
    "result_accuracy": _result_accuracy,
    "triangular_solve_options": _triangular,
    "cholesky_options": lambda h, a: a.flag("lower", h.cholesky_options.lower),
    "k": _simple("k", "k", "i"),
    "largest": _simple("largest", "largest", "flag"),
    "literal": lambda h, a: None,  # handled by the constant conversion
    "parameter_number": lambda h, a: None,  # an Instruction field of its own
}


def _default_compare_type(dtype: int) -> str:
    if dtype in (ir_pb2.F16, ir_pb2.BF16, ir_pb2.F32, ir_pb2.F64, ir_pb2.C64, ir_pb2.C128):
        return "FLOAT"
    if dtype in (ir_pb2.S8, ir_pb2.S16, ir_pb2.S32, ir_pb2.S64):
        return "SIGNED"
    return "UNSIGNED"


# ------------------------------------------------------------------------------ conversion


def _order(instrs: list[hlo_pb2.HloInstructionProto], root_id: int) -> list[hlo_pb2.HloInstructionProto]:
    """``instrs`` in an order where every operand precedes its users (stable if already so)."""
    by_id = {i.id: i for i in instrs}
    seen: set[int] = set()
    out: list[hlo_pb2.HloInstructionProto] = []
    for start in instrs:
        if start.id in seen:
            continue
        stack: list[tuple[hlo_pb2.HloInstructionProto, int]] = [(start, 0)]
        seen.add(start.id)
        while stack:
            node, k = stack.pop()
            if k < len(node.operand_ids):
                stack.append((node, k + 1))
                op = node.operand_ids[k]
                if op not in by_id:
                    raise HloConversionError(f"{_where(node)}: operand id {op} is not in its computation.")
                if op not in seen:
                    seen.add(op)
                    stack.append((by_id[op], 0))
            else:
                out.append(node)
    return out


def _convert_instruction(
    h: hlo_pb2.HloInstructionProto, shapes: dict[int, xd.ShapeProto]
) -> ir_pb2.Instruction:
    out = ir_pb2.Instruction(
        id=h.id,
        name=h.name,
        opcode=h.opcode,
        shape=_convert_shape(h.shape, lambda: _where(h)),
        operands=list(h.operand_ids),
        source_op=h.metadata.op_name,
        source_type=h.metadata.op_type,
        parameter_number=h.parameter_number,
    )
    called = list(h.called_computation_ids)
    if h.opcode == "while":
        if len(called) != 2:
            raise HloConversionError(f"{_where(h)}: expected a body and a condition.")
        called = [called[1], called[0]]  # HLO stores (body, condition); the IR (condition, body)
    out.called_computations.extend(called)
    attrs = _Attrs(out)
    for field, _ in h.ListFields():
        name = field.name
        if name == "backend_config" and h.opcode == "custom-call":
            attrs.b("backend_config", h.backend_config)  # XLA CustomCall's "opaque" string
            continue
        if name in _IGNORED_FIELDS:
            continue
        if name in _CUSTOM_CALL_FIELDS and h.opcode == "custom-call":
            continue
        conv = _FIELD_CONVERTERS.get(name)
        if conv is None:
            raise HloConversionError(
                f"{_where(h)}: HLO field '{name}' is not supported by the device IR."
            )
        conv(h, attrs)
    if h.opcode == "constant":
        out.attrs["value"].literal.CopyFrom(_convert_literal(h.literal, lambda: _where(h)))
    elif h.opcode == "compare":
        if "direction" not in out.attrs:
            raise HloConversionError(f"{_where(h)}: compare without a direction.")
        if "compare_type" not in out.attrs:
            op_shape = shapes.get(h.operand_ids[0]) if h.operand_ids else None
            et = _ELEMENT_TYPES.get(op_shape.element_type, (0, None))[0] if op_shape else 0
            attrs.s("compare_type", _default_compare_type(et))
    elif h.opcode == "convolution":
        for name in ("feature_group_count", "batch_group_count"):
            if name not in out.attrs:
                attrs.i(name, 1)
        if "window_size" not in out.attrs:  # a convolution without spatial dimensions
            _window(h, attrs)
    if h.opcode == "dot" and "lhs_contracting_dimensions" not in out.attrs:
        _dot_dims(h, attrs)
    if h.opcode == "reduce-precision":
        for name in ("exponent_bits", "mantissa_bits"):
            if name not in out.attrs:
                attrs.i(name, 0)
    if h.opcode == "get-tuple-element" and "index" not in out.attrs:
        attrs.i("index", 0)
    if h.opcode in ("iota", "concatenate", "sort") and "dimension" not in out.attrs:
        attrs.i("dimension", 0)
    if h.opcode in ("broadcast", "reduce", "reverse", "map") and "dimensions" not in out.attrs:
        attrs.ints("dimensions", ())
    if h.opcode == "transpose" and "permutation" not in out.attrs:
        attrs.ints("permutation", ())
    if h.opcode == "sort" and "is_stable" not in out.attrs:
        attrs.flag("is_stable", False)
    if h.opcode == "rng-bit-generator" and "algorithm" not in out.attrs:
        attrs.s("algorithm", "default")
    if h.opcode == "pad" and "edge_padding_low" not in out.attrs:
        _padding(h, attrs)
    if h.opcode == "slice" and "start_indices" not in out.attrs:
        _slice(h, attrs)
    # Proto3 leaves out zero values: FFT is fft_type 0, feature_index 0 and epsilon 0 are legal.
    for name, kind, value in _DEFAULTS.get(h.opcode, ()):
        if name not in out.attrs:
            getattr(attrs, kind)(name, value)
    if h.opcode == "triangular-solve" and "transpose_a" not in out.attrs:
        _triangular(h, attrs)  # no options at all: TRANSPOSE_INVALID, refused by the emulator
    return out


# opcode -> (attribute, kind, value) written when the HLO leaves the field at its default.
_DEFAULTS: dict[str, tuple[tuple[str, str, object], ...]] = {
    "fft": (("fft_type", "s", "FFT"),),
    **dict.fromkeys(
        ("batch-norm-training", "batch-norm-inference", "batch-norm-grad"),
        (("epsilon", "f", 0.0), ("feature_index", "i", 0)),
    ),
    "cholesky": (("lower", "flag", False),),
    "topk": (("k", "i", 0), ("largest", "flag", False)),
}


def hlo_proto_to_ir(hlo: hlo_pb2.HloModuleProto) -> ir_pb2.Module:
    """Converts a parsed ``HloModuleProto`` (see :func:`hlo_module_to_ir`)."""
    module = ir_pb2.Module(name=hlo.name, frontend="xla-hlo")
    entry_id = hlo.entry_computation_id
    if not entry_id:
        by_name = {c.name: c.id for c in hlo.computations}
        entry_id = by_name.get(hlo.entry_computation_name, 0)
    module.entry_computation_id = entry_id
    entry = None
    for comp in hlo.computations:
        shapes = {i.id: i.shape for i in comp.instructions}
        out = module.computations.add(id=comp.id, name=comp.name, root_id=comp.root_id)
        for h in _order(list(comp.instructions), comp.root_id):
            out.instructions.append(_convert_instruction(h, shapes))
        if comp.id == entry_id:
            entry = comp
    if entry is None:
        raise HloConversionError(f"module '{hlo.name}': entry computation {entry_id} not found.")
    root_shape = next((i.shape for i in entry.instructions if i.id == entry.root_id), None)
    if root_shape is None:
        raise HloConversionError(f"module '{hlo.name}': the root {entry.root_id} of entry "
                                 f"computation '{entry.name}' is not one of its instructions.")
    for e in hlo.input_output_alias.entries:
        if list(e.parameter_shape_index):
            raise HloConversionError(
                f"module '{hlo.name}': aliasing into tuple parameter {e.parameter_number} at "
                f"{list(e.parameter_shape_index)} is not supported."
            )
        module.aliases.add(
            output_index=_flat_index(root_shape, list(e.output_shape_index)),
            parameter_number=e.parameter_number,
        )
    return module


def hlo_module_to_ir(hlo_serialized: bytes) -> ir_pb2.Module:
    """Converts a serialized XLA ``HloModuleProto`` into an IR module.

    ``hlo_serialized`` is what ``tf.function(...).experimental_get_compiler_ir(*args)(
    stage="hlo_serialized")`` returns. Raises :class:`HloConversionError` for HLO the IR
    cannot express.
    """
    return hlo_proto_to_ir(hlo_pb2.HloModuleProto.FromString(hlo_serialized))
