"""Shape and data-movement ONNX operators: Constant, Shape, Reshape, Flatten, Transpose,
(Un)Squeeze, Concat, Split, Slice, Gather(Elements), Expand, Tile, Pad, ConstantOfShape.

Shapes are static: every operand that sets a shape (Reshape's shape, Slice's starts, ...) is a
host value (``Ctx.const``), folded from the shape subgraph that computes it.
"""

from __future__ import annotations

import numpy as np

from tf_ipu.onnx import dtypes
from tf_ipu.onnx.context import Ctx
from tf_ipu.onnx.ir_builder import Val
from tf_ipu.onnx.registry import register


def _ints(a: np.ndarray | None) -> list[int]:
    return [] if a is None else [int(x) for x in np.asarray(a).reshape(-1)]


@register("Constant", attrs=("value", "value_float", "value_floats", "value_int", "value_ints",
                             "value_string", "value_strings", "sparse_value"))
def constant(ctx: Ctx) -> list[Val]:
    for name in ("value_string", "value_strings", "sparse_value"):
        if name in ctx.attrs:
            raise ctx.refuse(f"attribute {name!r} (strings and sparse tensors are not supported)")
    if "value" in ctx.attrs:
        return [ctx.imp.host(ctx.attr("value"))]
    for name, dt in (("value_float", np.float32), ("value_floats", np.float32),
                     ("value_int", np.int64), ("value_ints", np.int64)):
        if name in ctx.attrs:
            return [ctx.imp.host(np.asarray(ctx.attr(name), dtype=dt))]
    raise ctx.refuse("no value attribute")


@register("Shape", attrs=("start", "end"))
def shape(ctx: Ctx) -> list[Val]:
    dims = np.asarray(ctx.input(0).shape, dtype=np.int64)
    return [Val.of(dims[ctx.attr("start", 0):ctx.attr("end")])]


@register("Size")
def size(ctx: Ctx) -> list[Val]:
    return [Val.of(np.int64(np.prod(ctx.input(0).shape, dtype=np.int64)))]


@register("ConstantOfShape", attrs=("value",))
def constant_of_shape(ctx: Ctx) -> list[Val]:
    dims = _ints(ctx.const(0, "shape"))
    value = ctx.attr("value")
    value = np.zeros([1], np.float32) if value is None else np.asarray(value)
    if ctx.imp.precision == "fp16" and value.dtype == np.float32:
        value = value.astype(np.float16)
    return [ctx.comp.scalar(ctx.one_value(value, "value attribute"), value.dtype, dims)]


def _reshape_dims(ctx: Ctx, x: Val, target: list[int], allowzero: bool) -> list[int]:
    if any(d < -1 for d in target):
        raise ctx.refuse(f"shape {target} has a dimension below -1")
    if not allowzero and any(d == 0 and i >= x.rank for i, d in enumerate(target)):
        raise ctx.refuse(f"shape {target} copies (0) a dimension the input {list(x.shape)} "
                         "does not have")
    dims = [x.shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if dims.count(-1) > 1:
        raise ctx.refuse(f"shape {target} has more than one -1")
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        total = int(np.prod(x.shape))
        if known == 0 or total % known:
            raise ctx.refuse(f"cannot reshape {list(x.shape)} to {target}")
        dims[dims.index(-1)] = total // known
    if int(np.prod(dims)) != int(np.prod(x.shape)):
        raise ctx.refuse(f"cannot reshape {list(x.shape)} to {target}")
    return dims


@register("Reshape", attrs=("shape", "allowzero", "consumed_inputs"))
def reshape(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    target = list(ctx.attr("shape")) if ctx.opset < 5 else _ints(ctx.const(1, "shape"))
    return [ctx.comp.reshape(x, _reshape_dims(ctx, x, target, bool(ctx.attr("allowzero", 0))))]


@register("Flatten", attrs=("axis",))
def flatten(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    axis = ctx.attr("axis", 1)
    axis = axis + x.rank if axis < 0 else axis
    if not 0 <= axis <= x.rank:
        raise ctx.refuse(f"axis {ctx.attr('axis')} is out of range for rank {x.rank}")
    return [ctx.comp.reshape(x, [int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:]))])]


@register("Transpose", attrs=("perm",))
def transpose(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    perm = ctx.attr("perm", list(range(x.rank))[::-1])
    if sorted(perm) != list(range(x.rank)):
        raise ctx.refuse(f"perm {perm} is not a permutation of {x.rank} dimensions")
    return [ctx.comp.transpose(x, perm)]


def _axes_operand(ctx: Ctx, index: int) -> list[int] | None:
    if ctx.opset >= 13:
        a = ctx.const(index, "axes")
        return None if a is None else _ints(a)
    a = ctx.attr("axes")
    return None if a is None else list(a)


@register("Squeeze", attrs=("axes",))
def squeeze(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    axes = _axes_operand(ctx, 1)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = [ctx.axis(a, x.rank) for a in axes]
    for a in axes:
        if x.shape[a] != 1:
            raise ctx.refuse(f"cannot squeeze dimension {a} of size {x.shape[a]}")
    return [ctx.comp.reshape(x, [d for i, d in enumerate(x.shape) if i not in axes])]


@register("Unsqueeze", attrs=("axes",))
def unsqueeze(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    axes = _axes_operand(ctx, 1) or []
    rank = x.rank + len(axes)
    axes = sorted(ctx.axis(a, rank) for a in axes)
    dims = list(x.shape)
    for a in axes:
        dims.insert(a, 1)
    return [ctx.comp.reshape(x, dims)]


@register("Concat", attrs=("axis",))
def concat(ctx: Ctx) -> list[Val]:
    vals = [v for v in ctx.inputs if v is not None]
    if not vals or vals[0].rank == 0:
        raise ctx.refuse("it needs inputs of rank >= 1 (scalars do not concatenate)")
    axis = ctx.axis(ctx.attr("axis", 1 if ctx.opset < 4 else None) or 0, vals[0].rank)
    if len({v.dtype for v in vals}) > 1:
        raise ctx.refuse("inputs of different types")
    for v in vals:
        if v.rank != vals[0].rank or any(d != e for i, (d, e) in enumerate(zip(v.shape, vals[0].shape, strict=True)) if i != axis):
            raise ctx.refuse(f"shapes {[list(v.shape) for v in vals]} do not concatenate on axis {axis}")
    vals = [v for v in vals if v.shape[axis] > 0] or vals[:1]
    return [ctx.comp.concatenate(vals, axis)]


@register("Split", attrs=("axis", "split", "num_outputs"))
def split(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    axis = ctx.axis(ctx.attr("axis", 0), x.rank)
    n = len(ctx.node.output)
    sizes = _ints(ctx.const(1, "split")) if ctx.opset >= 13 else list(ctx.attr("split", []))
    if not sizes:
        dim = x.shape[axis]
        if ctx.attr("num_outputs") is not None:
            n = int(ctx.attr("num_outputs"))
            each = -(-dim // n)
            sizes = [min(each, dim - i * each) for i in range(n)]
        else:
            if dim % n:
                raise ctx.refuse(f"dimension {dim} does not split into {n} equal parts")
            sizes = [dim // n] * n
    if sum(sizes) != x.shape[axis]:
        raise ctx.refuse(f"split sizes {sizes} do not add up to dimension {x.shape[axis]}")
    outs, start = [], 0
    for s in sizes:
        lo = [0] * x.rank
        hi = list(x.shape)
        lo[axis], hi[axis] = start, start + s
        outs.append(ctx.comp.slice(x, lo, hi) if s != x.shape[axis] else ctx.comp.unary("copy", ctx.comp.use(x)))
        start += s
    return outs


@register("Slice", attrs=("starts", "ends", "axes"))
def slice_(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    if ctx.opset < 10:
        starts, ends = list(ctx.attr("starts")), list(ctx.attr("ends"))
        axes = list(ctx.attr("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(ctx.const(1, "starts")), _ints(ctx.const(2, "ends"))
        axes = _ints(ctx.const(3, "axes")) if ctx.has(3) else list(range(len(starts)))
        steps = _ints(ctx.const(4, "steps")) if ctx.has(4) else [1] * len(starts)
    lo, hi, st = [0] * x.rank, list(x.shape), [1] * x.rank
    reverse = []
    for s, e, a, step in zip(starts, ends, axes, steps, strict=True):
        a = ctx.axis(a, x.rank)
        d = x.shape[a]
        if step == 0:
            raise ctx.refuse("a step of 0")
        s = s + d if s < 0 else s
        e = e + d if e < 0 else e
        if step > 0:
            s, e = min(max(s, 0), d), min(max(e, 0), d)
            lo[a], hi[a], st[a] = s, max(s, e), step
        else:
            s, e = min(max(s, 0), d - 1), min(max(e, -1), d - 1)
            # reversed coordinates: j = d - 1 - i
            rs, re_ = d - 1 - s, d - 1 - e
            lo[a], hi[a], st[a] = rs, max(rs, re_), -step
            reverse.append(a)
    v = c.op("reverse", [x], x.dtype, x.shape, dimensions=reverse) if reverse else x
    out = c.slice(v, lo, hi, st)
    if out is x:
        out = c.unary("copy", c.use(x))
    return [out]


def _normalized_indices(ctx: Ctx, idx: Val, dim: int | Val) -> Val:
    c = ctx.comp
    if idx.const is not None and isinstance(dim, int):
        fixed = np.where(idx.const < 0, idx.const + dim, idx.const).astype(idx.dtype)
        if fixed.size and (fixed.min() < 0 or fixed.max() >= dim):
            raise ctx.refuse(f"index out of range for a dimension of size {dim}")
        return Val.of(fixed)
    if idx.dtype.kind == "u":
        return idx
    d = c.scalar(dim, idx.dtype, idx.shape) if isinstance(dim, int) else dim
    return c.select(c.compare("LT", idx, c.scalar(0, idx.dtype, idx.shape)), c.binary("add", idx, d), idx)


@register("Gather", attrs=("axis",))
def gather(ctx: Ctx) -> list[Val]:
    x, idx = ctx.input(0), ctx.input(1)
    if x.rank == 0:
        raise ctx.refuse("its data (input 0) is a scalar; it must have rank >= 1")
    axis = ctx.axis(ctx.attr("axis", 0), x.rank)
    if idx.dtype.kind not in "iu":
        raise ctx.refuse(f"indices of type {idx.dtype}")
    idx = _normalized_indices(ctx, idx, x.shape[axis])
    r = idx.rank
    out_dims = list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:])
    offset = list(range(axis)) + list(range(axis + r, len(out_dims)))
    sizes = list(x.shape)
    sizes[axis] = 1
    return [ctx.comp.op("gather", [x, idx], x.dtype, out_dims, offset_dims=offset,
                        collapsed_slice_dims=[axis], start_index_map=[axis], operand_batching_dims=[],
                        start_indices_batching_dims=[], index_vector_dim=r, slice_sizes=sizes)]


@register("GatherElements", attrs=("axis",))
def gather_elements(ctx: Ctx) -> list[Val]:
    x, idx = ctx.input(0), ctx.input(1)
    if x.rank == 0:
        raise ctx.refuse("its data (input 0) is a scalar; it must have rank >= 1")
    c = ctx.comp
    axis = ctx.axis(ctx.attr("axis", 0), x.rank)
    if idx.rank != x.rank:
        raise ctx.refuse("indices must have the data's rank")
    idx = _normalized_indices(ctx, idx, x.shape[axis])
    idx = c.convert(idx, np.int64)
    cols = []
    for d in range(x.rank):
        col = idx if d == axis else c.op("iota", [], np.int64, idx.shape, dimension=d)
        cols.append(c.reshape(col, [*idx.shape, 1]))
    full = c.concatenate(cols, x.rank)
    return [c.op("gather", [x, full], x.dtype, idx.shape, offset_dims=[],
                 collapsed_slice_dims=list(range(x.rank)), start_index_map=list(range(x.rank)),
                 operand_batching_dims=[], start_indices_batching_dims=[], index_vector_dim=x.rank,
                 slice_sizes=[1] * x.rank)]


@register("Expand")
def expand(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    target = _ints(ctx.const(1, "shape"))
    try:
        dims = np.broadcast_shapes(x.shape, tuple(target))
    except ValueError:
        raise ctx.refuse(f"shape {list(x.shape)} does not broadcast to {target}") from None
    out = ctx.comp.broadcast_to(x, dims)
    return [out if out is not x else ctx.comp.unary("copy", ctx.comp.use(x))]


@register("Tile")
def tile(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    reps = _ints(ctx.const(1, "repeats"))
    if len(reps) != x.rank:
        raise ctx.refuse(f"repeats {reps} must have one entry per dimension ({x.rank})")
    dims = [v for r, d in zip(reps, x.shape, strict=True) for v in (r, d)]
    b = ctx.comp.broadcast_in_dim(x, dims, [2 * i + 1 for i in range(x.rank)])
    return [ctx.comp.reshape(b, [r * d for r, d in zip(reps, x.shape, strict=True)])]


@register("Pad", attrs=("mode", "pads", "value"))
def pad(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    mode = ctx.attr("mode", "constant")
    if ctx.opset < 11:
        pads, value = list(ctx.attr("pads")), ctx.attr("value", 0.0)
        axes = list(range(x.rank))
    else:
        pads = _ints(ctx.const(1, "pads"))
        cv = ctx.const(2, "constant_value") if ctx.has(2) else None
        value = 0 if cv is None else np.asarray(cv).reshape(-1)[0] if np.asarray(cv).size else 0
        axes = [ctx.axis(a, x.rank) for a in _ints(ctx.const(3, "axes"))] if ctx.has(3) else list(range(x.rank))
    n = len(axes)
    if len(pads) != 2 * n:
        raise ctx.refuse(f"pads {pads} must have 2 entries per padded axis ({n})")
    low, high = [0] * x.rank, [0] * x.rank
    for k, a in enumerate(axes):
        low[a], high[a] = pads[k], pads[k + n]
    if mode == "constant":
        dims = [d + lo + hi for d, lo, hi in zip(x.shape, low, high, strict=True)]
        return [c.op("pad", [x, c.constant(np.asarray(value).astype(x.dtype), x.dtype)], x.dtype, dims,
                     edge_padding_low=low, edge_padding_high=high, interior_padding=[0] * x.rank)]
    if mode not in ("reflect", "edge", "wrap"):
        raise ctx.refuse(f"mode {mode!r}")
    out = x
    for a in range(x.rank):
        lo, hi = low[a], high[a]
        if lo < 0 or hi < 0:
            raise ctx.refuse(f"negative pads with mode {mode!r}")
        if not lo and not hi:
            continue
        d = out.shape[a]

        def part(start: int, stop: int, rev: bool = False, v: Val = out, axis: int = a) -> Val:
            s, e = [0] * v.rank, list(v.shape)
            s[axis], e[axis] = start, stop
            p = c.slice(v, s, e)
            return c.op("reverse", [p], p.dtype, p.shape, dimensions=[axis]) if rev else p

        pieces = []
        if mode == "reflect":
            if lo >= d or hi >= d:
                raise ctx.refuse(f"reflect pads {lo, hi} need a dimension larger than {d}")
            if lo:
                pieces.append(part(1, lo + 1, True))
            pieces.append(out)
            if hi:
                pieces.append(part(d - 1 - hi, d - 1, True))
        elif mode == "edge":
            if lo:
                e = part(0, 1)
                pieces.append(c.broadcast_to(e, [lo if i == a else s for i, s in enumerate(e.shape)]))
            pieces.append(out)
            if hi:
                e = part(d - 1, d)
                pieces.append(c.broadcast_to(e, [hi if i == a else s for i, s in enumerate(e.shape)]))
        else:
            if lo > d or hi > d:
                raise ctx.refuse(f"wrap pads {lo, hi} larger than the dimension {d}")
            if lo:
                pieces.append(part(d - lo, d))
            pieces.append(out)
            if hi:
                pieces.append(part(0, hi))
        out = c.concatenate(pieces, a)
    return [out]


@register("Range")
def range_(ctx: Ctx) -> list[Val]:
    start = ctx.const(0, "start")
    limit = ctx.const(1, "limit")
    delta = ctx.const(2, "delta")
    if start is None or limit is None or delta is None:
        raise ctx.refuse("start, limit and delta are required")
    values = np.arange(start.reshape(()), limit.reshape(()), delta.reshape(())).astype(start.dtype)
    n = values.size
    c = ctx.comp
    iota = c.op("iota", [], start.dtype, [n], dimension=0)
    return [c.binary("add", c.binary("multiply", iota, c.scalar(delta.reshape(()), start.dtype, [n])),
                     c.scalar(start.reshape(()), start.dtype, [n]))]


@register("EyeLike", attrs=("dtype", "k"))
def eye_like(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    dt = dtypes.to_numpy(ctx.attr("dtype")) if ctx.attr("dtype") is not None else x.dtype
    if dt is None:
        raise ctx.refuse(f"dtype {dtypes.type_name(ctx.attr('dtype'))}")
    c = ctx.comp
    rows = c.op("iota", [], np.int64, x.shape, dimension=0)
    cols = c.op("iota", [], np.int64, x.shape, dimension=1)
    on = c.compare("EQ", c.binary("add", rows, c.scalar(ctx.attr("k", 0), np.int64, x.shape)), cols)
    return [c.convert(on, dt)]
