"""Neural-network ONNX operators: Conv, pooling, normalizations, Gemm, MatMul, Softmax, the
reductions. Layouts are ONNX's (NCHW, OIHW): the IR's convolution and reduce-window take
dimension numbers, so no transpose is inserted.
"""

from __future__ import annotations

import numpy as np

from tf_ipu.onnx import dtypes
from tf_ipu.onnx.context import Ctx
from tf_ipu.onnx.ir_builder import Comp, Val, Window, highest, lowest
from tf_ipu.onnx.registry import register

_POOL_ATTRS = ("auto_pad", "kernel_shape", "pads", "strides", "dilations", "ceil_mode",
               "count_include_pad", "storage_order")


def _spatial(ctx: Ctx, x: Val, kernel: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """strides, dilations, pad_low, pad_high of a window over x's spatial dimensions."""
    n = len(kernel)
    strides = list(ctx.attr("strides", [1] * n))
    dil = list(ctx.attr("dilations", [1] * n))
    pads = list(ctx.attr("pads", [0] * (2 * n)))
    if min([*kernel, *strides, *dil], default=1) < 1:
        raise ctx.refuse(f"kernel_shape {kernel}, strides {strides} and dilations {dil} must be "
                         f">= 1")
    auto = ctx.attr("auto_pad", "NOTSET")
    lo, hi = pads[:n], pads[n:]
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        lo, hi = [], []
        for d, k, s, r in zip(x.shape[2:], kernel, strides, dil, strict=True):
            out = -(-d // s)
            total = max(0, (out - 1) * s + (k - 1) * r + 1 - d)
            small, big = total // 2, total - total // 2
            lo.append(small if auto == "SAME_UPPER" else big)
            hi.append(big if auto == "SAME_UPPER" else small)
    elif auto == "VALID":
        lo, hi = [0] * n, [0] * n
    elif auto != "NOTSET":
        raise ctx.refuse(f"auto_pad={auto!r}")
    return strides, dil, lo, hi


def _out_dims(ins: list[int], kernel: list[int], strides: list[int], dil: list[int], lo: list[int],
              hi: list[int], ceil: bool) -> list[int]:
    out = []
    for d, k, s, r, a, b in zip(ins, kernel, strides, dil, lo, hi, strict=True):
        span = d + a + b - ((k - 1) * r + 1)
        o = (-(-span // s) if ceil else span // s) + 1
        if ceil and (o - 1) * s >= d + a:  # the last window must start inside the input or the low pad
            o -= 1
        out.append(max(o, 0))
    return out


@register("Conv", attrs=("auto_pad", "kernel_shape", "pads", "strides", "dilations", "group"))
def conv(ctx: Ctx) -> list[Val]:
    x, w = ctx.input(0), ctx.input(1)
    c = ctx.comp
    if not dtypes.is_float(x.dtype):
        raise ctx.refuse(f"input of type {x.dtype}")
    if x.rank < 3 or w.rank != x.rank:
        raise ctx.refuse(f"input {list(x.shape)} and weights {list(w.shape)} must have one rank, "
                         f"3 or more (batch, channels, spatial dimensions)")
    if w.dtype != x.dtype:
        w = c.convert(w, x.dtype)
    n = x.rank - 2
    kernel = list(w.shape[2:])
    if ctx.attr("kernel_shape") is not None and list(ctx.attr("kernel_shape")) != kernel:
        raise ctx.refuse(f"kernel_shape {ctx.attr('kernel_shape')} differs from the weights' {kernel}")
    group = int(ctx.attr("group", 1))
    if x.shape[1] != w.shape[1] * group:
        raise ctx.refuse(f"input channels {x.shape[1]} != weight channels {w.shape[1]} x group {group}")
    strides, dil, lo, hi = _spatial(ctx, x, kernel)
    spatial = _out_dims(list(x.shape[2:]), kernel, strides, dil, lo, hi, False)
    dims = [x.shape[0], w.shape[0], *spatial]
    sp = list(range(2, 2 + n))
    win = Window(kernel, strides, lo, hi, dil)
    y = c.op("convolution", [x, w], x.dtype, dims, **win.attrs(),
             input_batch_dimension=0, input_feature_dimension=1, input_spatial_dimensions=sp,
             kernel_output_feature_dimension=0, kernel_input_feature_dimension=1,
             kernel_spatial_dimensions=sp, output_batch_dimension=0, output_feature_dimension=1,
             output_spatial_dimensions=sp, feature_group_count=group, batch_group_count=1)
    if ctx.has(2):
        b = ctx.input(2)
        b = c.convert(b, x.dtype)
        y = c.binary("add", y, c.reshape(b, [1, b.shape[0]] + [1] * n))
    return [y]


def _pool_window(ctx: Ctx, x: Val) -> tuple[list[int], Window, list[int], list[int], list[int]]:
    kernel = list(ctx.attr("kernel_shape"))
    strides, dil, lo, hi = _spatial(ctx, x, kernel)
    ceil = bool(ctx.attr("ceil_mode", 0))
    spatial = _out_dims(list(x.shape[2:]), kernel, strides, dil, lo, hi, ceil)
    # extra high padding so that reduce-window makes `spatial` windows (ceil mode)
    extra = [max(0, (o - 1) * s + (k - 1) * r + 1 - (d + a + b))
             for o, s, k, r, d, a, b in zip(spatial, strides, kernel, dil, x.shape[2:], lo, hi, strict=True)]
    win = Window([1, 1, *kernel], [1, 1, *strides], [0, 0, *lo],
                 [0, 0, *[b + e for b, e in zip(hi, extra, strict=True)]], [1, 1, *dil])
    return [x.shape[0], x.shape[1], *spatial], win, lo, hi, extra


def _reduce_window(c: Comp, x: Val, win: Window, kind: str, init: object, dims: list[int]) -> Val:
    return c.op("reduce-window", [x, c.constant(np.asarray(init).astype(x.dtype), x.dtype)], x.dtype, dims,
                called=[c.mb.reducer(kind, x.dtype)], **win.attrs())


@register("MaxPool", attrs=_POOL_ATTRS)
def max_pool(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    dims, win, *_ = _pool_window(ctx, x)
    if not (len(ctx.node.output) > 1 and ctx.node.output[1]):
        return [_reduce_window(ctx.comp, x, win, "maximum", lowest(x.dtype), dims)]
    # Indices: a variadic reduce-window over (value, flat index), the larger value winning
    # and, on a tie, the lower index. The index is row-major, or column-major over the
    # spatial dimensions with storage_order=1 (the batch and channel offsets stay).
    c = ctx.comp
    size = int(np.prod(x.shape))
    if ctx.attr("storage_order", 0):
        n, ch, spatial = x.shape[0], x.shape[1], x.shape[2:]
        plane = int(np.prod(spatial))
        grid = np.indices(spatial).reshape(len(spatial), -1)
        within = np.ravel_multi_index(tuple(grid), spatial, order="F").reshape(spatial)
        offsets = (np.arange(n * ch, dtype=np.int64) * plane).reshape(n, ch, *[1] * len(spatial))
        flat = Val.of((offsets + within).astype(np.int64))
    else:
        flat = c.reshape(c.op("iota", [], np.int64, [size], dimension=0), x.shape)
    mb = c.mb
    red = mb.computation(mb.unique("argmax_pair"))
    av, ai = red.parameter(0, x.dtype, ()), red.parameter(1, np.int64, ())
    bv, bi = red.parameter(2, x.dtype, ()), red.parameter(3, np.int64, ())
    tie = red.op("and", [red.compare("EQ", bv, av), red.compare("LT", bi, ai)], np.bool_, ())
    take = red.op("or", [red.compare("GT", bv, av), tie], np.bool_, ())
    red.root(red.tuple([red.select(take, bv, av), red.select(take, bi, ai)]))
    init_v = c.constant(np.asarray(lowest(x.dtype)).astype(x.dtype), x.dtype)
    init_i = c.constant(np.int64(np.iinfo(np.int64).max), np.int64)
    r = c.tuple_op("reduce-window", [x, flat, init_v, init_i], [(x.dtype, dims), (np.int64, dims)],
                   called=[red.cid], **win.attrs())
    return [c.gte(r, 0, x.dtype, dims), c.gte(r, 1, np.int64, dims)]


@register("AveragePool", attrs=_POOL_ATTRS)
def average_pool(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    dims, win, lo, hi, extra = _pool_window(ctx, x)
    total = _reduce_window(c, x, win, "add", 0, dims)
    n = len(lo)
    if ctx.attr("count_include_pad", 0):
        # the explicit pads count, the ceil-mode overhang does not
        ones = c.scalar(1, x.dtype, [1, 1, *[d + a + b for d, a, b in zip(x.shape[2:], lo, hi, strict=True)]])
        cwin = Window(win.size, win.strides, [0] * (n + 2), [0, 0, *extra], win.dilation)
    else:
        ones = c.scalar(1, x.dtype, [1, 1, *x.shape[2:]])
        cwin = win
    counts = _reduce_window(c, ones, cwin, "add", 0, [1, 1, *dims[2:]])
    return [c.binary("divide", total, counts)]


@register("GlobalAveragePool", "GlobalMaxPool")
def global_pool(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    axes = list(range(2, x.rank))
    if ctx.node.op_type == "GlobalMaxPool":
        r = c.reduce(x, axes, "maximum", lowest(x.dtype))
    else:
        r = c.reduce(x, axes, "add", 0)
        r = c.binary("divide", r, c.scalar(int(np.prod(x.shape[2:])), x.dtype))
    return [c.reshape(r, [x.shape[0], x.shape[1]] + [1] * len(axes))]


def _per_channel(c: Comp, v: Val, x: Val) -> Val:
    """A [C] vector shaped to broadcast against x's channel dimension (1)."""
    return c.reshape(c.convert(v, x.dtype), [1, v.shape[0]] + [1] * (x.rank - 2))


@register("BatchNormalization", attrs=("epsilon", "momentum", "spatial", "training_mode", "is_test",
                                       "consumed_inputs"))
def batch_norm(ctx: Ctx) -> list[Val]:
    x, scale, bias, mean, var = (ctx.input(i) for i in range(5))
    c = ctx.comp
    eps = float(ctx.attr("epsilon", 1e-5))
    if not ctx.attr("spatial", 1):
        raise ctx.refuse("spatial=0")
    training = bool(ctx.attr("training_mode", 0)) or (ctx.opset < 7 and not ctx.attr("is_test", 0))
    outputs = [o for o in ctx.node.output[1:] if o]
    if not training:
        if outputs and ctx.opset >= 14:
            raise ctx.refuse("running statistics outputs outside training mode")
        args = [c.convert(v, x.dtype) for v in (scale, bias, mean, var)]
        y = c.op("batch-norm-inference", [x, *args], x.dtype, x.shape, epsilon=eps, feature_index=1)
        return [y]
    momentum = float(ctx.attr("momentum", 0.9))
    axes = [0] + list(range(2, x.rank))
    count = int(np.prod([x.shape[a] for a in axes]))
    bmean = c.binary("divide", c.reduce(x, axes, "add", 0), c.scalar(count, x.dtype))
    centred = c.binary("subtract", x, _per_channel(c, bmean, x))
    bvar = c.binary("divide", c.reduce(c.binary("multiply", centred, centred), axes, "add", 0),
                    c.scalar(count, x.dtype))
    inv = c.unary("rsqrt", c.binary("add", bvar, c.scalar(eps, x.dtype)))
    y = c.binary("add", c.binary("multiply", c.binary("multiply", centred, _per_channel(c, inv, x)),
                                 _per_channel(c, scale, x)), _per_channel(c, bias, x))
    m = c.scalar(momentum, x.dtype)
    one_m = c.scalar(1 - momentum, x.dtype)
    run_mean = c.binary("add", c.binary("multiply", c.convert(mean, x.dtype), m), c.binary("multiply", bmean, one_m))
    run_var = c.binary("add", c.binary("multiply", c.convert(var, x.dtype), m), c.binary("multiply", bvar, one_m))
    return [y, run_mean, run_var]


@register("InstanceNormalization", attrs=("epsilon",))
def instance_norm(ctx: Ctx) -> list[Val]:
    x, scale, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    c = ctx.comp
    axes = list(range(2, x.rank))
    y, _, _ = _normalize(c, x, axes, float(ctx.attr("epsilon", 1e-5)))
    return [c.binary("add", c.binary("multiply", y, _per_channel(c, scale, x)), _per_channel(c, bias, x))]


def _normalize(c: Comp, x: Val, axes: list[int], eps: float) -> tuple[Val, Val, Val]:
    """(x - mean) / sqrt(var + eps) over ``axes`` (kept as size-1 dims), with mean and 1/std."""
    kept = [1 if i in axes else d for i, d in enumerate(x.shape)]
    count = int(np.prod([x.shape[a] for a in axes]))
    mean = c.reshape(c.binary("divide", c.reduce(x, axes, "add", 0), c.scalar(count, x.dtype)), kept)
    centred = c.binary("subtract", x, mean)
    var = c.reshape(c.binary("divide", c.reduce(c.binary("multiply", centred, centred), axes, "add", 0),
                             c.scalar(count, x.dtype)), kept)
    inv = c.unary("rsqrt", c.binary("add", var, c.scalar(eps, x.dtype)))
    return c.binary("multiply", centred, inv), mean, inv


@register("LayerNormalization", attrs=("axis", "epsilon", "stash_type"))
def layer_norm(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    axis = ctx.axis(ctx.attr("axis", -1), x.rank)
    stash = ctx.attr("stash_type", 1)
    work = np.float32 if stash == 1 and x.dtype != np.float64 else x.dtype
    xs = c.convert(x, work)
    y, mean, inv = _normalize(c, xs, list(range(axis, x.rank)), float(ctx.attr("epsilon", 1e-5)))
    y = c.convert(y, x.dtype)
    y = c.binary("multiply", y, c.convert(ctx.input(1), x.dtype))
    if ctx.has(2):
        y = c.binary("add", y, c.convert(ctx.input(2), x.dtype))
    return [y, c.convert(mean, work), c.convert(inv, work)]


@register("Gemm", attrs=("alpha", "beta", "transA", "transB", "broadcast"))
def gemm(ctx: Ctx) -> list[Val]:
    a, b = ctx.input(0), ctx.input(1)
    c = ctx.comp
    if b.dtype != a.dtype:
        b = c.convert(b, a.dtype)
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    y = c.dot_general(a, b, [0 if ta else 1], [1 if tb else 0])
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    if alpha != 1.0:
        y = c.binary("multiply", y, c.scalar(alpha, y.dtype))
    if ctx.has(2) and beta != 0.0:
        bias = c.convert(ctx.input(2), y.dtype)
        if beta != 1.0:
            bias = c.binary("multiply", bias, c.scalar(beta, y.dtype))
        y = c.binary("add", y, bias)
    return [y]


@register("MatMul")
def matmul(ctx: Ctx) -> list[Val]:
    a, b = ctx.input(0), ctx.input(1)
    c = ctx.comp
    if b.dtype != a.dtype:
        raise ctx.refuse(f"inputs of different types {a.dtype}, {b.dtype}")
    if a.rank == 0 or b.rank == 0:
        raise ctx.refuse(f"shapes {list(a.shape)} and {list(b.shape)}: scalars do not multiply "
                         "as matrices (rank >= 1)")
    a2 = c.reshape(a, [1, a.shape[0]]) if a.rank == 1 else a
    b2 = c.reshape(b, [b.shape[0], 1]) if b.rank == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ctx.refuse(f"shapes {list(a.shape)} and {list(b.shape)} do not multiply")
    if b2.rank == 2:  # a batch of matrices (or one) times one matrix: the batch rides in a's rows
        batch = a2.shape[:-2]
        y = c.dot_general(a2, b2, [a2.rank - 1], [0])
    else:
        batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        nb = len(batch)
        a2 = c.broadcast_to(a2, [*batch, *a2.shape[-2:]])
        b2 = c.broadcast_to(b2, [*batch, *b2.shape[-2:]])
        y = c.dot_general(a2, b2, [nb + 1], [nb], list(range(nb)), list(range(nb)))
    dims = list(batch) + ([a.shape[-2]] if a.rank > 1 else []) + ([b.shape[-1]] if b.rank > 1 else [])
    return [c.reshape(y, dims)]


def _softmax(ctx: Ctx, log: bool) -> Val:
    x = ctx.input(0)
    c = ctx.comp
    axis = ctx.axis(ctx.attr("axis", -1 if ctx.opset >= 13 else 1), x.rank)
    shape = x.shape
    if ctx.opset < 13:  # the input is coerced to 2-D at axis
        x = c.reshape(x, [int(np.prod(shape[:axis])), int(np.prod(shape[axis:]))])
        axis = 1
    kept = [1 if i == axis else d for i, d in enumerate(x.shape)]
    m = c.reshape(c.reduce(x, [axis], "maximum", lowest(x.dtype)), kept)
    z = c.binary("subtract", x, m)
    e = c.unary("exponential", z)
    s = c.reshape(c.reduce(e, [axis], "add", 0), kept)
    y = c.binary("subtract", z, c.unary("log", s)) if log else c.binary("divide", e, s)
    return c.reshape(y, shape)


@register("Softmax", attrs=("axis",))
def softmax(ctx: Ctx) -> list[Val]:
    return [_softmax(ctx, False)]


@register("LogSoftmax", attrs=("axis",))
def log_softmax(ctx: Ctx) -> list[Val]:
    return [_softmax(ctx, True)]


_REDUCE_SINCE_INPUT = {"ReduceSum": 13}  # the others take axes as an input from opset 18


def _reduce_axes(ctx: Ctx, x: Val) -> list[int] | None:
    """The axes to reduce; None for a no-op (empty axes with noop_with_empty_axes)."""
    since = _REDUCE_SINCE_INPUT.get(ctx.node.op_type, 18)
    axes = _ints_or_none(ctx.const(1, "axes")) if ctx.opset >= since else ctx.attr("axes")
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return None
        return list(range(x.rank))
    return sorted({ctx.axis(a, x.rank) for a in axes})


def _ints_or_none(a: np.ndarray | None) -> list[int] | None:
    return None if a is None else [int(v) for v in np.asarray(a).reshape(-1)]


_REDUCERS = {
    "ReduceSum": ("add", 0), "ReduceMean": ("add", 0), "ReduceMax": ("maximum", None),
    "ReduceMin": ("minimum", None), "ReduceProd": ("multiply", 1), "ReduceSumSquare": ("add", 0),
    "ReduceL1": ("add", 0), "ReduceL2": ("add", 0), "ReduceLogSum": ("add", 0),
    "ReduceLogSumExp": ("add", 0),
}


@register(*_REDUCERS, attrs=("axes", "keepdims", "noop_with_empty_axes"))
def reduce(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    op = ctx.node.op_type
    axes = _reduce_axes(ctx, x)
    if axes is None:
        if op in ("ReduceSumSquare",):
            return [c.binary("multiply", x, x)]
        if op == "ReduceL1":
            return [c.unary("abs", x)]
        return [c.unary("copy", c.use(x))]
    kind, init = _REDUCERS[op]
    if init is None:
        init = lowest(x.dtype) if kind == "maximum" else highest(x.dtype)
    v = x
    if op in ("ReduceSumSquare", "ReduceL2"):
        v = c.binary("multiply", x, x)
    elif op == "ReduceL1":
        v = c.unary("abs", x)
    elif op == "ReduceLogSumExp":
        v = c.unary("exponential", x)
    r = c.reduce(v, axes, kind, init)
    count = int(np.prod([x.shape[a] for a in axes]))
    if op == "ReduceMean":
        r = c.binary("divide", r, c.scalar(count, r.dtype)) if count else c.binary(
            "divide", r, c.scalar(0, r.dtype))
    elif op == "ReduceL2":
        r = c.unary("sqrt", r)
    elif op in ("ReduceLogSum", "ReduceLogSumExp"):
        r = c.unary("log", r)
    if ctx.attr("keepdims", 1):
        r = c.reshape(r, [1 if i in axes else d for i, d in enumerate(x.shape)])
    return [r]


@register("ArgMax", "ArgMin", attrs=("axis", "keepdims", "select_last_index"))
def arg_reduce(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    axis = ctx.axis(ctx.attr("axis", 0), x.rank)
    kind = "maximum" if ctx.node.op_type == "ArgMax" else "minimum"
    best = c.reduce(x, [axis], kind, lowest(x.dtype) if kind == "maximum" else highest(x.dtype))
    kept = [1 if i == axis else d for i, d in enumerate(x.shape)]
    hit = c.compare("EQ", x, c.reshape(best, kept))
    idx = c.op("iota", [], np.int64, x.shape, dimension=axis)
    n = x.shape[axis]
    if ctx.attr("select_last_index", 0):
        cand = c.select(hit, idx, c.scalar(-1, np.int64, x.shape))
        r = c.reduce(cand, [axis], "maximum", -1)
    else:
        cand = c.select(hit, idx, c.scalar(n, np.int64, x.shape))
        r = c.reduce(cand, [axis], "minimum", n)
    if ctx.attr("keepdims", 1):
        r = c.reshape(r, kept)
    return [r]


@register("LRN", attrs=("alpha", "beta", "bias", "size"))
def lrn(ctx: Ctx) -> list[Val]:
    x = ctx.input(0)
    c = ctx.comp
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    n = x.rank
    win = Window([1, size] + [1] * (n - 2), [1] * n, [0, lo] + [0] * (n - 2), [0, hi] + [0] * (n - 2))
    sq = _reduce_window(c, c.binary("multiply", x, x), win, "add", 0, list(x.shape))
    base = c.binary("add", c.binary("multiply", sq, c.scalar(alpha / size, x.dtype)), c.scalar(bias, x.dtype))
    return [c.binary("divide", x, c.binary("power", base, c.scalar(beta, x.dtype)))]

