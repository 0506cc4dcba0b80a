"""Host folding of shape subgraphs: a node whose inputs are all known on the host (shapes,
initializers, what other folded nodes made) and whose operator is shape arithmetic is
computed here, so that Reshape, Slice, Expand, ... get static operands.

    Shape(x) ─┐                        x has a static shape: Shape is always a host value
    Gather ───┼─ all inputs host values, integer (or <= 64 elements) ─> numpy here
    Concat ───┘                      anything else ─> IR instructions, run by the emulator

Only operators of shape arithmetic fold, and only on small or integer values: the model's
arithmetic on data (also on constant weights) is always the emulator's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tf_ipu.onnx.ir_builder import Val  # noqa: F401  (the type of what it returns)

_SMALL = 64


def _ints(a: np.ndarray | None) -> list[int]:
    return [] if a is None else [int(x) for x in np.asarray(a).reshape(-1)]


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        q = np.abs(a) // np.abs(b)
        return (np.sign(a) * np.sign(b) * q).astype(a.dtype)
    return (a / b).astype(a.dtype)


def _axes(ctx: Any, arrays: list[np.ndarray | None], index: int, attr: str = "axes") -> list[int] | None:
    if ctx.opset >= 13 and ctx.node.op_type in ("Squeeze", "Unsqueeze"):
        return _ints(arrays[index]) if index < len(arrays) and arrays[index] is not None else None
    a = ctx.attr(attr)
    return None if a is None else list(a)


def _squeeze(ctx: Any, a: list) -> list:
    x = a[0]
    axes = _axes(ctx, a, 1)
    if axes is None:
        return [np.squeeze(x)]
    return [np.squeeze(x, axis=tuple(ax % x.ndim for ax in axes))]


def _unsqueeze(ctx: Any, a: list) -> list:
    x = a[0]
    axes = _axes(ctx, a, 1) or []
    rank = x.ndim + len(axes)
    out = x
    for ax in sorted(ax % rank for ax in axes):
        out = np.expand_dims(out, ax)
    return [out]


def _gather(ctx: Any, a: list) -> list:
    x, idx = a[0], a[1]
    axis = int(ctx.attr("axis", 0)) % max(x.ndim, 1)
    idx = np.where(idx < 0, idx + x.shape[axis], idx)
    return [np.take(x, idx, axis=axis)]


def _slice(ctx: Any, a: list) -> list:
    x = a[0]
    if ctx.opset < 10:
        starts, ends = list(ctx.attr("starts")), list(ctx.attr("ends"))
        axes = list(ctx.attr("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(a[1]), _ints(a[2])
        axes = _ints(a[3]) if len(a) > 3 and a[3] is not None else list(range(len(starts)))
        steps = _ints(a[4]) if len(a) > 4 and a[4] is not None else [1] * len(starts)
    index = [slice(None)] * x.ndim
    for s, e, ax, st in zip(starts, ends, axes, steps, strict=True):
        index[ax % x.ndim] = slice(s, e, st)
    return [x[tuple(index)]]


def _reshape(ctx: Any, a: list) -> list:
    x = a[0]
    shape = _ints(a[1]) if ctx.opset >= 5 else list(ctx.attr("shape"))
    if not ctx.attr("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return [x.reshape(shape)]


def _shape(ctx: Any, a: list) -> list:
    dims = np.asarray(a[0].shape, dtype=np.int64)
    start, end = ctx.attr("start", 0), ctx.attr("end")
    return [dims[start:end]]


def _range(ctx: Any, a: list) -> list:
    start, limit, delta = (np.asarray(x).reshape(()) for x in a[:3])
    return [np.arange(start, limit, delta).astype(np.asarray(a[0]).dtype)]


def _cast(ctx: Any, a: list) -> list:
    from tf_ipu.onnx import dtypes

    dt = dtypes.to_numpy(int(ctx.attr("to")))
    if dt is None:
        return None  # the handler refuses the type
    return [a[0].astype(dt)]


def _constant_of_shape(ctx: Any, a: list) -> list:
    value = ctx.attr("value")
    value = np.zeros([1], np.float32) if value is None else np.asarray(value)
    return [np.full(_ints(a[0]), value.reshape(-1)[0], dtype=value.dtype)]


def _concat(ctx: Any, a: list) -> list:
    return [np.concatenate([x for x in a if x is not None], axis=int(ctx.attr("axis")))]


def _expand(ctx: Any, a: list) -> list:
    shape = np.broadcast_shapes(a[0].shape, tuple(_ints(a[1])))
    return [np.broadcast_to(a[0], shape).copy()]


def _reduce(fn: Callable) -> Callable:
    def f(ctx: Any, a: list) -> list | None:
        x = a[0]
        axes = ctx.attr("axes")
        if axes is None and len(a) > 1 and a[1] is not None:
            axes = _ints(a[1])
        keep = bool(ctx.attr("keepdims", 1))
        if not axes:
            if ctx.attr("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(x.ndim))
        return [fn(x, axis=tuple(ax % x.ndim for ax in axes), keepdims=keep).astype(x.dtype)]

    return f


def _binary(fn: Callable) -> Callable:
    return lambda ctx, a: [np.asarray(fn(a[0], a[1]))]


FOLDERS: dict[str, Callable[[Any, list], list | None]] = {
    "Shape": _shape,
    "Size": lambda ctx, a: [np.asarray(a[0].size, dtype=np.int64)],
    "Identity": lambda ctx, a: [a[0]],
    "Gather": _gather,
    "Concat": _concat,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Slice": _slice,
    "Reshape": _reshape,
    "Cast": _cast,
    "Range": _range,
    "ConstantOfShape": _constant_of_shape,
    "Expand": _expand,
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _binary(_int_div),
    "Equal": _binary(np.equal),
    "Less": _binary(np.less),
    "Greater": _binary(np.greater),
    "Not": lambda ctx, a: [np.logical_not(a[0])],
    "Neg": lambda ctx, a: [np.negative(a[0])],
    "Abs": lambda ctx, a: [np.abs(a[0])],
    "Min": lambda ctx, a: [np.minimum.reduce(np.broadcast_arrays(*a))],
    "Max": lambda ctx, a: [np.maximum.reduce(np.broadcast_arrays(*a))],
    "Where": lambda ctx, a: [np.where(a[0], a[1], a[2])],
    "ReduceProd": _reduce(np.prod),
    "ReduceSum": _reduce(np.sum),
    "ReduceMin": _reduce(np.min),
    "ReduceMax": _reduce(np.max),
    "Transpose": lambda ctx, a: [np.transpose(a[0], ctx.attr("perm"))],
}


def try_fold(ctx: Any) -> list[Val] | None:
    """The node's outputs folded on the host, or None if it is not shape arithmetic on host
    values (then its handler makes instructions)."""
    fn = FOLDERS.get(ctx.node.op_type)
    if fn is None or not ctx.inputs:
        return None
    if any(v is not None and v.const is None for v in ctx.inputs):
        return None
    arrays = [None if v is None else v.const for v in ctx.inputs]
    present = [a for a in arrays if a is not None]
    if not all(a.dtype.kind in "iub" or a.size <= _SMALL for a in present):
        return None
    try:
        with np.errstate(all="ignore"):
            out = fn(ctx, arrays)
    except (ValueError, IndexError, TypeError, ZeroDivisionError):
        return None  # let the handler say what is wrong
    if out is None:
        return None
    result = []
    for o in out:
        o = np.asarray(o)
        if o.size > 4096 and o.dtype.kind not in "iub":
            return None
        result.append(ctx.imp.host(o))
    return result
