"""What the planner reads off the IR: shapes, attributes, opcode families, Keras layers.

    ir_pb2.Shape        -> shape_elems, shape_itemsize, is_floating, leaf_shapes (tuples flattened)
    ir_pb2.Instruction  -> attr_int, attr_ints, attr_str, backend_config, layer_name
    opcode families     -> VIEW_OPS (no superstep), MOVE_OPS, ELEMENTWISE_OPS, ... (which
                           planner of ``planner.py`` an instruction goes to)

Nothing here plans anything; every opcode planner imports from it.
"""

from __future__ import annotations

from device_server.emulator.errors import layer_of
from device_server.protocol import dtypes, ir_pb2

__all__ = ["STAGE_ATTR", "BATCH_NORM_OPS", "ELEMENTWISE_OPS", "MOVE_OPS", "PLUMBING_OPS", "PROBLEM_CUSTOM_CALLS",
           "PROBLEM_OPS", "RNG_OPS", "TINY_OPS", "TRANSCENDENTAL_OPS", "VIEW_OPS", "attr_int",
           "attr_ints", "attr_str", "backend_config", "is_floating", "layer_name", "leaf_shapes",
           "shape_elems", "shape_itemsize", "stage_of"]

#: The attribute of a pipelined program's instructions naming their pipeline stage (docs/ir.md).
STAGE_ATTR = "pipeline_stage"

# Views: the result is (part of) the operand's buffer, no superstep.
VIEW_OPS = frozenset({"reshape", "bitcast", "copy", "opt-barrier", "add-dependency",
                      "set-dimension-size", "dynamic-reshape"})
TINY_OPS = frozenset({"after-all", "partition-id", "replica-id", "get-dimension-size"})
MOVE_OPS = frozenset({"transpose", "slice", "concatenate", "pad", "reverse", "dynamic-slice",
                      "dynamic-update-slice", "gather", "scatter"})
TRANSCENDENTAL_OPS = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "sqrt", "rsqrt",
    "cbrt", "tanh", "sine", "cosine", "tan", "atan2", "power", "erf", "divide", "remainder",
})
PLUMBING_OPS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "reshape",
                          "bitcast", "copy", "broadcast", "convert"})
RNG_OPS = frozenset({"rng", "rng-bit-generator", "rng-get-and-update-state"})
# Batches of independent problems (matrices, transforms, rows), planned by ``problems.py``.
PROBLEM_OPS = frozenset({"cholesky", "triangular-solve", "fft", "topk"})
# custom-call targets planned the same way (other targets fall back to one compute set).
PROBLEM_CUSTOM_CALLS = frozenset({"Qr", "ProductOfElementaryHouseholderReflectors", "Eigh"})
BATCH_NORM_OPS = frozenset({"batch-norm-training", "batch-norm-inference", "batch-norm-grad"})
ELEMENTWISE_OPS = frozenset({
    "abs", "negate", "sign", "exponential", "exponential-minus-one", "log", "log-plus-one",
    "logistic", "sqrt", "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "erf", "is-finite", "not", "popcnt",
    "count-leading-zeros", "clz", "real", "imag", "add", "subtract", "multiply", "divide",
    "remainder", "power", "maximum", "minimum", "atan2", "and", "or", "xor", "shift-left",
    "shift-right-logical", "shift-right-arithmetic", "complex", "compare", "select", "clamp",
    "convert", "bitcast-convert", "reduce-precision", "map",
})


def stage_of(instr: ir_pb2.Instruction) -> int:
    """The pipeline stage of an instruction (its ``pipeline_stage`` attribute; absent: 0)."""
    return attr_int(instr, STAGE_ATTR, 0)


def layer_name(instr: ir_pb2.Instruction) -> str:
    """The Keras layer of an instruction (of a variable parameter: the variable's layer)."""
    if instr.opcode == "parameter" and instr.source_type == "variable":
        parts = [p for p in instr.source_op.split("/") if p]
        return parts[-2] if len(parts) >= 2 else ""
    return layer_of(instr.source_op) if instr.source_op else ""


def shape_elems(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple:
        return sum(shape_elems(s) for s in shape.tuple_shapes)
    n = 1
    for d in shape.dims:
        n *= int(d)
    return n


def shape_itemsize(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple or shape.dtype in (ir_pb2.TOKEN, ir_pb2.DTYPE_INVALID):
        return 0
    return dtypes.to_numpy(shape.dtype).itemsize


def is_floating(shape: ir_pb2.Shape) -> bool:
    return shape.dtype in (ir_pb2.F16, ir_pb2.BF16, ir_pb2.F32, ir_pb2.F64, ir_pb2.C64, ir_pb2.C128)


def leaf_shapes(shape: ir_pb2.Shape) -> list[ir_pb2.Shape]:
    if shape.is_tuple:
        return [leaf for s in shape.tuple_shapes for leaf in leaf_shapes(s)]
    return [shape]


def attr_ints(instr: ir_pb2.Instruction, name: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    if name not in instr.attrs:
        return default
    v = instr.attrs[name]
    if v.WhichOneof("value") == "ints":
        return tuple(int(x) for x in v.ints.values)
    if v.WhichOneof("value") == "i":
        return (int(v.i),)
    return default


def attr_str(instr: ir_pb2.Instruction, name: str, default: str = "") -> str:
    if name not in instr.attrs:
        return default
    v = instr.attrs[name]
    return v.s if v.WhichOneof("value") == "s" else default


def backend_config(instr: ir_pb2.Instruction) -> str:
    if "backend_config" not in instr.attrs:
        return ""
    v = instr.attrs["backend_config"]
    kind = v.WhichOneof("value")
    raw = v.s if kind == "s" else v.b.decode("utf-8", "replace") if kind == "b" else ""
    return raw.strip()


def attr_int(instr: ir_pb2.Instruction, name: str, default: int = 0) -> int:
    if name not in instr.attrs:
        return default
    v = instr.attrs[name]
    return int(v.i) if v.WhichOneof("value") == "i" else default
