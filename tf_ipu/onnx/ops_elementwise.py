"""Element-wise ONNX operators: arithmetic, comparisons, logic, activations, Cast, Clip,
Where. Broadcasting is numpy's (``Comp.binary``: explicit ``broadcast`` instructions).
"""

from __future__ import annotations

import math

import numpy as np

from tf_ipu.onnx import dtypes
from tf_ipu.onnx.context import Ctx
from tf_ipu.onnx.ir_builder import Val
from tf_ipu.onnx.registry import register

_UNARY = {
    "Abs": "abs", "Neg": "negate", "Exp": "exponential", "Log": "log", "Sqrt": "sqrt",
    "Tanh": "tanh", "Sigmoid": "logistic", "Erf": "erf", "Floor": "floor", "Ceil": "ceil",
    "Sin": "sine", "Cos": "cosine", "Tan": "tan", "Sign": "sign", "Round": "round-nearest-even",
    "Not": "not",
}
_BINARY = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide",
           "And": "and", "Or": "or", "Xor": "xor", "BitwiseAnd": "and", "BitwiseOr": "or",
           "BitwiseXor": "xor"}
_COMPARE = {"Equal": "EQ", "Less": "LT", "LessOrEqual": "LE", "Greater": "GT", "GreaterOrEqual": "GE"}
_VARIADIC = {"Max": "maximum", "Min": "minimum", "Sum": "add", "Mean": "add"}


def _same_types(ctx: Ctx, vals: list[Val]) -> None:
    kinds = {v.dtype for v in vals}
    if len(kinds) > 1:
        raise ctx.refuse(f"inputs of different types {sorted(str(k) for k in kinds)}")


def _float_only(ctx: Ctx, v: Val) -> None:
    if not dtypes.is_float(v.dtype):
        raise ctx.refuse(f"input of type {v.dtype} is not supported (floating-point only)")


@register(*_UNARY, attrs=("consumed_inputs",))
def unary(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    op = _UNARY[ctx.node.op_type]
    if op not in ("abs", "negate", "sign", "not"):
        _float_only(ctx, x)
    if op == "not" and x.dtype != np.bool_:
        raise ctx.refuse(f"Not of {x.dtype}")
    return [ctx.comp.unary(op, x)]


@register("Reciprocal", attrs=("consumed_inputs",))
def reciprocal(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    _float_only(ctx, x)
    return [ctx.comp.binary("divide", ctx.comp.scalar(1, x.dtype, x.shape), x)]


@register(*_BINARY, attrs=("broadcast", "axis", "consumed_inputs"))
def binary(ctx: Ctx) -> list[Val]:
    a, b = ctx.input(0), ctx.input(1)
    if ctx.opset < 7 and ctx.attr("broadcast", 0):
        raise ctx.refuse("legacy broadcast attribute (opset < 7)")
    _same_types(ctx, [a, b])
    op = _BINARY[ctx.node.op_type]
    if op in ("and", "or", "xor") and ctx.node.op_type.startswith("Bitwise") == (a.dtype == np.bool_):
        raise ctx.refuse(f"{ctx.node.op_type} of {a.dtype}")
    return [ctx.comp.binary(op, a, b)]


@register("Mod", attrs=("fmod",))
def mod(ctx: Ctx) -> list[Val]:
    a, b = ctx.input(0), ctx.input(1)
    _same_types(ctx, [a, b])
    c = ctx.comp
    r = c.binary("remainder", a, b)  # the dividend's sign (C's fmod)
    if ctx.attr("fmod", 0) or a.dtype.kind == "u":
        return [r]
    if dtypes.is_float(a.dtype):
        raise ctx.refuse("fmod=0 on floating-point inputs is not allowed by ONNX")
    zero = c.scalar(0, a.dtype, r.shape)
    fix = c.op("and", [c.compare("NE", r, zero),
                       c.compare("NE", c.compare("LT", r, zero), c.compare("LT", c.broadcast_to(b, r.shape), zero))],
               np.bool_, r.shape)
    return [c.select(fix, c.binary("add", r, b), r)]


@register("Pow")
def power(ctx: Ctx) -> list[Val]:
    x, y = ctx.input(0), ctx.input(1)
    c = ctx.comp
    if y.dtype != x.dtype:
        y = c.convert(y, x.dtype)
    return [c.binary("power", x, y)]


@register(*_COMPARE)
def compare(ctx: Ctx) -> list[Val]:
    a, b = ctx.input(0), ctx.input(1)
    _same_types(ctx, [a, b])
    return [ctx.comp.compare(_COMPARE[ctx.node.op_type], a, b)]


@register(*_VARIADIC, attrs=("consumed_inputs",))
def variadic(ctx: Ctx) -> list[Val]:
    vals = [ctx.input(i) for i in range(len(ctx.inputs))]
    _same_types(ctx, vals)
    op = _VARIADIC[ctx.node.op_type]
    out = vals[0]
    for v in vals[1:]:
        out = ctx.comp.binary(op, out, v)
    if ctx.node.op_type == "Mean":
        out = ctx.comp.binary("divide", out, ctx.comp.scalar(len(vals), out.dtype))
    if len(vals) == 1:
        out = ctx.comp.unary("copy", ctx.comp.use(out))
    return [out]


@register("Where")
def where(ctx: Ctx) -> list[Val]:
    cond, x, y = ctx.input(0), ctx.input(1), ctx.input(2)
    _same_types(ctx, [x, y])
    return [ctx.comp.select(cond, x, y)]


@register("Identity", "Dropout", attrs=("ratio", "seed", "is_test", "consumed_inputs"))
def identity(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    if ctx.node.op_type == "Dropout":
        training = ctx.const(2, "training_mode")
        if training is not None and bool(ctx.one_value(training, "training_mode (input 2)")):
            raise ctx.refuse("training_mode=True (random dropout) is not supported")
        if len(ctx.node.output) > 1 and ctx.node.output[1]:
            return [x, ctx.comp.scalar(True, np.bool_, x.shape)]
    return [x]


@register("Cast", attrs=("to", "saturate", "round_mode"))
def cast(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    to = int(ctx.attr("to"))
    dt = dtypes.to_numpy(to)
    if dt is None:
        name = dtypes.type_name(to)
        raise ctx.refuse(f"cast to {name}, which the IPU does not have", dtype=name)
    if ctx.attr("round_mode", "up") != "up":
        raise ctx.refuse(f"round_mode={ctx.attr('round_mode')!r}")
    if ctx.imp.precision == "fp16" and dt == np.float32:
        dt = np.dtype(np.float16)
    return [ctx.comp.convert(x, dt) if x.dtype != dt else x]


@register("CastLike", attrs=("saturate", "round_mode"))
def cast_like(ctx: Ctx) -> list[Val]:
    x, like = ctx.input(0), ctx.input(1)
    return [ctx.comp.convert(x, like.dtype) if x.dtype != like.dtype else x]


@register("Clip", attrs=("min", "max"))
def clip(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    if ctx.opset < 11:
        lo, hi = ctx.attr("min"), ctx.attr("max")
        lo = None if lo is None else Val.of(np.asarray(lo, x.dtype))
        hi = None if hi is None else Val.of(np.asarray(hi, x.dtype))
    else:
        lo = ctx.inputs[1] if ctx.has(1) else None
        hi = ctx.inputs[2] if ctx.has(2) else None
    out = x
    if lo is not None:
        out = c.binary("maximum", out, c.convert(lo, x.dtype))
    if hi is not None:
        out = c.binary("minimum", out, c.convert(hi, x.dtype))
    if out is x:
        out = c.unary("copy", c.use(x))
    return [out]


@register("Relu")
def relu(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    return [ctx.comp.binary("maximum", x, ctx.comp.scalar(0, x.dtype))]


@register("LeakyRelu", attrs=("alpha",))
def leaky_relu(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    alpha = c.scalar(ctx.attr("alpha", 0.01), x.dtype)
    neg = c.compare("LT", x, c.scalar(0, x.dtype))
    return [c.select(neg, c.binary("multiply", x, alpha), x)]


@register("PRelu")
def prelu(ctx: Ctx) -> list[Val]:
    x, slope = ctx.input(0), ctx.input(1)
    c = ctx.comp
    neg = c.compare("LT", x, c.scalar(0, x.dtype))
    return [c.select(neg, c.binary("multiply", x, slope), x)]


@register("Elu", attrs=("alpha",))
def elu(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    neg = c.compare("LT", x, c.scalar(0, x.dtype))
    em1 = c.binary("multiply", c.unary("exponential-minus-one", x), c.scalar(ctx.attr("alpha", 1.0), x.dtype))
    return [c.select(neg, em1, x)]


@register("Selu", attrs=("alpha", "gamma"))
def selu(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    alpha, gamma = ctx.attr("alpha", 1.67326319217681884765625), ctx.attr("gamma", 1.05070102214813232421875)
    neg = c.compare("LE", x, c.scalar(0, x.dtype))
    em1 = c.binary("multiply", c.unary("exponential-minus-one", x), c.scalar(alpha, x.dtype))
    return [c.binary("multiply", c.select(neg, em1, x), c.scalar(gamma, x.dtype))]


@register("Softplus")
def softplus(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    return [ctx.comp.unary("log-plus-one", ctx.comp.unary("exponential", x))]


def _hard_sigmoid(ctx: Ctx, x: Val, alpha: float, beta: float) -> Val:
    c = ctx.comp
    lin = c.binary("add", c.binary("multiply", x, c.scalar(alpha, x.dtype)), c.scalar(beta, x.dtype))
    return c.op("clamp", [c.scalar(0, x.dtype), lin, c.scalar(1, x.dtype)], x.dtype, x.shape)


@register("HardSigmoid", attrs=("alpha", "beta"))
def hard_sigmoid(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    return [_hard_sigmoid(ctx, x, ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5))]


@register("HardSwish")
def hard_swish(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    return [ctx.comp.binary("multiply", x, _hard_sigmoid(ctx, x, 1 / 6, 0.5))]


@register("Gelu", attrs=("approximate",))
def gelu(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    _float_only(ctx, x)
    c = ctx.comp
    half = c.binary("multiply", x, c.scalar(0.5, x.dtype))
    approx = ctx.attr("approximate", "none")
    if approx == "none":
        inner = c.unary("erf", c.binary("multiply", x, c.scalar(1 / math.sqrt(2), x.dtype)))
    elif approx == "tanh":
        cube = c.binary("multiply", c.binary("multiply", x, x), x)
        poly = c.binary("add", x, c.binary("multiply", cube, c.scalar(0.044715, x.dtype)))
        inner = c.unary("tanh", c.binary("multiply", poly, c.scalar(math.sqrt(2 / math.pi), x.dtype)))
    else:
        raise ctx.refuse(f"approximate={approx!r}")
    return [c.binary("multiply", half, c.binary("add", inner, c.scalar(1, x.dtype)))]


@register("IsNaN")
def is_nan(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    return [ctx.comp.compare("NE", x, x)]
