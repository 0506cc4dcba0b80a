"""Kernels that apply a called computation: reduce (variadic), sort and map.

Fast paths: a reducer that is one binary op of its two parameters becomes a numpy ufunc
reduction; a sort comparator that is ``compare(a_i, b_i)`` with ``LT``/``GT`` becomes a stable
``argsort`` of operand ``i`` (floats ordered by XLA's total order). Otherwise, when the called
computation is purely element-wise it is called on whole arrays at once (a tree reduction for
``reduce``, a bitonic network of vectorized compare-exchanges for ``sort``); only computations
using other ops fall back to a scalar Python loop.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from device_server.emulator import parallel
from device_server.emulator.kernels import KernelContext, KernelFn, inline, register
from device_server.emulator.kernels.elementwise import total_order_key
from device_server.protocol import dtypes, ir_pb2

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _leaf_dtypes(shape: ir_pb2.Shape) -> list[np.dtype]:
    if shape.is_tuple:
        return [dtypes.to_numpy(s.dtype) for s in shape.tuple_shapes]
    return [dtypes.to_numpy(shape.dtype)]


def _as_list(value: Any, n: int) -> list[Any]:
    if n == 1 and not isinstance(value, tuple):
        return [value]
    return list(value)


# ------------------------------------------------------------------------------------ reduce

# A float32 sum over the leading dimensions of at least this many elements is cut into parts.
_SPLIT_REDUCE_ELEMENTS = 1 << 18
_SUM_PARTS = 8


def _split_leading_sum(rows: int, kept_shape: tuple[int, ...], dt: np.dtype) -> KernelFn:
    """A float32 sum over the leading dimensions (a BatchNormalization's moments over
    N*H*W): the rows are cut into a fixed number of parts (so the result does not depend on
    the thread count), each summed in float64 on the emulator's threads, then the partial
    sums are added in float64 and rounded once."""
    ranges = parallel.split(rows, _SUM_PARTS)
    cols = int(np.prod(kept_shape, dtype=np.int64))

    def run(ops: Sequence[Any]) -> np.ndarray:
        x = np.asarray(ops[0]).reshape(rows, cols)
        partial = np.empty((len(ranges), cols), np.float64)

        def part(i: int) -> None:
            s, e = ranges[i]
            np.add.reduce(x[s:e], axis=0, dtype=np.float64, out=partial[i])

        parallel.run_parts(part, len(ranges))
        return np.add(np.add.reduce(partial, axis=0), ops[1]).astype(dt).reshape(kept_shape)

    return run



def _compiled_row_sum(in_shape: tuple[int, ...], dt: np.dtype) -> KernelFn | None:
    """A float32 sum over the rows of a 2-D array (a Dense layer's bias gradient) as one
    compiled loop (``jit.row_sum``: numpy's float64 sum, bit for bit), which costs a fifth of
    numpy's casting reduction on small arrays; None when the jit is off. An operand that is
    not C-ordered (numpy would then sum it in another order) takes numpy's path."""
    from device_server.emulator import jit  # noqa: PLC0415 (it imports the kernels)

    kernel = jit.row_sum()
    if kernel is None:
        return None
    cols = in_shape[1]
    f64 = np.dtype(np.float64)

    def run(ops: Sequence[Any]) -> np.ndarray:
        x = ops[0]
        if not (isinstance(x, np.ndarray) and x.dtype == dt and x.flags.c_contiguous):
            return np.add(np.add.reduce(x, axis=(0,), dtype=f64), ops[1]).astype(dt)
        out = np.empty(cols, dt)
        kernel(x, float(ops[1]), out)
        return out

    return run


@register("reduce")
def _reduce(ctx: KernelContext) -> KernelFn:
    n = len(ctx.operand_shapes) // 2
    if n < 1 or len(ctx.operand_shapes) != 2 * n:
        raise ValueError(f"reduce needs inputs and as many init values, got {len(ctx.operand_shapes)} operands")
    dims = tuple(sorted(ctx.attr("dimensions", ())))
    in_shape = ctx.operand_shapes[0]
    rank = len(in_shape)
    kept = tuple(d for d in range(rank) if d not in dims)
    kept_shape = tuple(in_shape[d] for d in kept)
    out_dts = _leaf_dtypes(ctx.instr.shape)
    ufunc = ctx.reducer_ufunc(0) if n == 1 else None

    if ufunc is not None:
        dt = out_dts[0]
        wide = np.dtype(np.float32) if dt in (np.dtype(np.float16), _BF16) and ufunc is np.add else None
        if not dims:
            return lambda ops: ufunc(ops[0], ops[1])
        if wide is not None:
            def run_wide(ops: Sequence[Any]) -> np.ndarray:
                r = ufunc.reduce(np.asarray(ops[0], wide), axis=dims)
                return np.asarray(r + np.asarray(ops[1], wide)).astype(dt)
            return run_wide
        if ufunc is np.add and dt == np.float32 and dims != tuple(range(rank - len(dims), rank)):
            # Over a non-innermost axis numpy adds float32 rows one after another: a
            # BatchNormalization's moments over N*H*W were off by ~1e-6, 2-5x XLA's error,
            # and MobileNetV2's training step amplified that to 1e-2 gradient errors (XLA's:
            # 3e-4 from float64). Accumulate in float64 (buffered, ~2x this reduce's time)
            # and round once.
            lead_rows = int(np.prod(in_shape[: len(dims)], dtype=np.int64))
            if dims == tuple(range(len(dims))) and int(np.prod(in_shape, dtype=np.int64)) >= _SPLIT_REDUCE_ELEMENTS:
                return _split_leading_sum(lead_rows, kept_shape, dt)
            if rank == 2 and dims == (0,) and in_shape[1] >= 2:
                fn = _compiled_row_sum(in_shape, dt)
                if fn is not None:
                    return fn
            return inline(
                lambda ops: np.add(np.add.reduce(ops[0], axis=dims, dtype=np.float64), ops[1]).astype(dt),
                "{u}({r}({0}, axis={d}, dtype={w}), {1}).astype({t})",
                u=np.add, r=np.add.reduce, d=dims, w=np.dtype(np.float64), t=dt,
            )
        if ufunc in (np.maximum, np.minimum):
            return inline(
                lambda ops: ufunc.reduce(ops[0], axis=dims, initial=np.asarray(ops[1])[()]),
                "{r}({0}, axis={d}, initial={a}({1})[()])", r=ufunc.reduce, d=dims, a=np.asarray,
            )
        # dtype=: numpy would widen small integers; XLA wraps in the element type.
        return inline(
            lambda ops: ufunc(ufunc.reduce(ops[0], axis=dims, dtype=dt), ops[1]),
            "{u}({r}({0}, axis={d}, dtype={t}), {1})", u=ufunc, r=ufunc.reduce, d=dims, t=dt,
        )

    comp = ctx.computation(0)
    perm = kept + dims
    R = int(np.prod([in_shape[d] for d in dims], dtype=np.int64))
    flat_shape = kept_shape + (R,)
    arg = _argminmax(ctx, dims) if n == 2 and R > 0 else None

    def gather(ops: Sequence[Any]) -> tuple[list[np.ndarray], list[Any]]:
        xs = [np.asarray(x).transpose(perm).reshape(flat_shape) for x in ops[:n]]
        return xs, list(ops[n:])

    def finish(vals: list[np.ndarray]) -> Any:
        outs = [np.asarray(v).astype(dt, copy=False).reshape(kept_shape)
                for v, dt in zip(vals, out_dts, strict=True)]
        return outs[0] if n == 1 else tuple(outs)

    if ctx.is_elementwise(0):  # type: ignore[attr-defined]
        def run_tree(ops: Sequence[Any]) -> Any:
            if arg is not None:
                found = arg(ops)
                if found is not None:
                    return found
            xs, inits = gather(ops)
            if R == 0:
                return finish([np.broadcast_to(i, kept_shape) for i in inits])
            size = R
            while size > 1:
                half = size // 2
                a = [x[..., :half] for x in xs]
                b = [x[..., half:2 * half] for x in xs]
                merged = [np.broadcast_to(m, a[0].shape) for m in _as_list(comp(a + b), n)]
                if size % 2:
                    merged = [np.concatenate([m, x[..., 2 * half:]], axis=-1)
                              for m, x in zip(merged, xs, strict=True)]
                xs = merged
                size = half + size % 2
            last = [x[..., 0] for x in xs]
            return finish(_as_list(comp(list(inits) + last), n))
        return run_tree

    def run_scalar(ops: Sequence[Any]) -> Any:
        xs, inits = gather(ops)
        outs = [np.empty(kept_shape, dt) for dt in out_dts]
        for idx in itertools.product(*(range(s) for s in kept_shape)):
            acc = [np.asarray(i) for i in inits]
            for k in range(R):
                acc = _as_list(comp(acc + [x[idx + (k,)] for x in xs]), n)
            for o, v in zip(outs, acc, strict=True):
                o[idx] = v
        return outs[0] if n == 1 else tuple(outs)

    return run_scalar


def _argminmax(ctx: KernelContext, dims: tuple[int, ...]) -> Callable[[Sequence[Any]], Any] | None:
    """The reduction of ``(values, iota)`` pairs by the usual arg-max (arg-min) reducer::

        ge = compare(a, b, GE); eq = compare(a, b, EQ)           (LE for arg-min)
        (select(ge, a, b), select(eq, minimum(i, j), select(ge, i, j)))

    over one dimension along which operand 1 is an ``iota``: without NaNs that is the value
    at the first position of the maximum and that position (np.argmax), as the reducer applied
    in any order gives; then combined with the init values by the reducer. Returns a function
    giving the ``(value, index)`` result, or None when a NaN is among the values (the caller then reduces
    the general way, so NaN behaviour stays that of the reducer); None if not the pattern."""
    if len(dims) != 1:
        return None
    operands = getattr(ctx, "operand_instrs", None)
    if operands is None or len(operands) != 4:
        return None
    vdt, idt = ctx.operand_dtypes[0], ctx.operand_dtypes[1]
    if vdt is None or idt is None or vdt.kind != "f" or idt.kind not in "iu":
        return None
    iota = operands[1]
    if iota.opcode != "iota" or "dimension" not in iota.attrs or int(iota.attrs["dimension"].i) != dims[0]:
        return None
    if ctx.operand_shapes[0][dims[0]] - 1 > np.iinfo(idt).max:
        return None
    comp = ctx.computation_ir(0)  # type: ignore[attr-defined]
    by_id = {i.id: i for i in comp.instructions}
    params = {i.parameter_number: i.id for i in comp.instructions if i.opcode == "parameter"}
    if sorted(params) != [0, 1, 2, 3]:
        return None
    p0, p1, p2, p3 = (params[k] for k in range(4))

    def direction(iid: int) -> str | None:
        c = by_id.get(iid)
        if c is None or c.opcode != "compare" or list(c.operands) != [p0, p2]:
            return None
        kind = c.attrs["compare_type"].s if "compare_type" in c.attrs else "FLOAT"
        return c.attrs["direction"].s if kind == "FLOAT" and "direction" in c.attrs else None

    root = by_id.get(comp.root_id)
    if root is None or root.opcode != "tuple" or len(root.operands) != 2:
        return None
    vsel, isel = (by_id.get(o) for o in root.operands)
    if vsel is None or vsel.opcode != "select" or list(vsel.operands[1:]) != [p0, p2]:
        return None
    order = direction(vsel.operands[0])
    if order not in ("GE", "LE"):
        return None
    if isel is None or isel.opcode != "select" or direction(isel.operands[0]) != "EQ":
        return None
    low = by_id.get(isel.operands[1])
    pick = by_id.get(isel.operands[2])
    if low is None or low.opcode != "minimum" or sorted(low.operands) != sorted([p1, p3]):
        return None
    if pick is None or pick.opcode != "select" or list(pick.operands[1:]) != [p1, p3] \
            or direction(pick.operands[0]) != order:
        return None
    axis = dims[0]
    shape = ctx.operand_shapes[0]
    rank = len(shape)
    perm = None if axis == rank - 1 else tuple(d for d in range(rank) if d != axis) + (axis,)
    kept_shape = tuple(s for d, s in enumerate(shape) if d != axis)
    rows = int(np.prod(kept_shape, dtype=np.int64))
    flat = (rows, shape[axis])
    every_row = np.arange(rows)

    beyond = np.greater if order == "GE" else np.less
    find_name = "argmax" if order == "GE" else "argmin"
    combine = ctx.computation(0)
    all_of = np.logical_and.reduce
    any_of = np.logical_or.reduce

    def run(ops: Sequence[Any]) -> list[np.ndarray] | None:
        x = np.asarray(ops[0])
        if perm is not None:
            x = x.transpose(perm)
        x = x.reshape(flat)
        k = getattr(x, find_name)(axis=1)
        v = x[every_row, k]
        k = k.astype(idt)
        if all_of(beyond(v, ops[2])):  # the init value neither wins nor ties anywhere
            return v.reshape(kept_shape), k.reshape(kept_shape)
        if any_of(np.isnan(v)):
            return None
        found = _as_list(combine([ops[2], ops[3], v, k]), 2)
        return (np.asarray(found[0]).astype(vdt, copy=False).reshape(kept_shape),
                np.asarray(found[1]).astype(idt, copy=False).reshape(kept_shape))

    return run


# -------------------------------------------------------------------------------------- sort


def _sort_fast_path(ctx: KernelContext, n: int) -> tuple[int, bool, bool] | None:
    """(key operand, descending, total order) when the comparator is a plain LT/GT of one
    operand pair; ``total order`` is false for a float compare of type FLOAT (or none given),
    under which -0 and +0 tie."""
    comp = ctx.computation_ir(0)  # type: ignore[attr-defined]
    by_id = {i.id: i for i in comp.instructions}
    root = by_id[comp.root_id]
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    a, b = (by_id[o] for o in root.operands)
    if a.opcode != "parameter" or b.opcode != "parameter":
        return None
    direction = root.attrs["direction"].s if "direction" in root.attrs else ""
    pa, pb = a.parameter_number, b.parameter_number
    if pa // 2 != pb // 2 or pa == pb or direction not in ("LT", "GT"):
        return None
    ascending = (pa < pb) == (direction == "LT")
    total = "compare_type" in root.attrs and root.attrs["compare_type"].s == "TOTALORDER"
    return pa // 2, not ascending, total


def _sort_key(x: np.ndarray, total: bool = True) -> np.ndarray:
    dt = x.dtype
    if dt.kind == "f" or dt == _BF16:
        if not total:  # IEEE's order: -0 ties with +0 (NaN, unordered, goes anywhere)
            x = np.where(x == 0, np.zeros((), dt), x)
        return total_order_key(x, dt)
    if dt == np.bool_:
        return x.astype(np.int8)
    return x


@register("sort")
def _sort(ctx: KernelContext) -> KernelFn:
    n = len(ctx.operand_shapes)
    shape = ctx.operand_shapes[0]
    dim = int(ctx.attr("dimension", len(shape) - 1 if shape else 0))
    if shape and not 0 <= dim < len(shape):
        raise ValueError(f"sort dimension {dim} out of range for {list(shape)}")
    fast = _sort_fast_path(ctx, n)

    def pack(outs: list[np.ndarray]) -> Any:
        return outs[0] if n == 1 and not ctx.instr.shape.is_tuple else tuple(outs)

    if not shape:
        return lambda ops: pack([np.asarray(o) for o in ops])
    if fast is not None:
        key_index, descending, total = fast

        def run_fast(ops: Sequence[Any]) -> Any:
            key = _sort_key(np.asarray(ops[key_index]), total)
            if descending:
                key = np.invert(key)
            order = np.argsort(key, axis=dim, kind="stable")
            return pack([np.take_along_axis(np.asarray(o), order, axis=dim) for o in ops])

        return run_fast

    comp = ctx.computation(0)
    size = shape[dim]
    if ctx.is_elementwise(0):  # type: ignore[attr-defined]
        return _bitonic(comp, n, dim, size, pack)

    def run_rows(ops: Sequence[Any]) -> Any:
        arrays = [np.moveaxis(np.asarray(o), dim, -1) for o in ops]
        outs = [a.copy() for a in arrays]
        rows = arrays[0].shape[:-1]

        for idx in itertools.product(*(range(s) for s in rows)):
            def cmp(i: int, j: int, idx: tuple[int, ...] = idx) -> int:
                args = []
                for a in arrays:
                    args += [a[idx + (i,)], a[idx + (j,)]]
                if bool(comp(args)):
                    return -1
                args = []
                for a in arrays:
                    args += [a[idx + (j,)], a[idx + (i,)]]
                return 1 if bool(comp(args)) else 0

            order = sorted(range(size), key=functools.cmp_to_key(cmp))
            for o, a in zip(outs, arrays, strict=True):
                o[idx] = a[idx][order]
        return pack([np.moveaxis(o, -1, dim) for o in outs])

    return run_rows


def _bitonic(comp: Callable[[Sequence[Any]], Any], n: int, dim: int, size: int,
             pack: Callable[[list[np.ndarray]], Any]) -> KernelFn:
    """Stable sort by a vectorizable comparator: a bitonic network over the padded length,
    ties (neither less) broken by original position, padding ordered last."""
    width = 1
    while width < size:
        width *= 2
    stages: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    pos = np.arange(width)
    k = 2
    while k <= width:
        j = k // 2
        while j >= 1:
            partner = pos ^ j
            lo = pos[partner > pos]
            hi = lo ^ j
            up = (lo & k) == 0
            stages.append((lo, hi, up))
            j //= 2
        k *= 2

    def run(ops: Sequence[Any]) -> Any:
        arrays = [np.moveaxis(np.asarray(o), dim, -1) for o in ops]
        if width != size:
            pad = width - size
            arrays = [np.concatenate([a, np.repeat(a[..., -1:], pad, axis=-1)], axis=-1) if size
                      else np.zeros(a.shape[:-1] + (width,), a.dtype) for a in arrays]
        arrays = [a.copy() for a in arrays]
        rows = arrays[0].shape[:-1]
        index = np.broadcast_to(np.arange(width), rows + (width,)).copy()

        def less(xs: list[np.ndarray], xi: np.ndarray, ys: list[np.ndarray], yi: np.ndarray) -> np.ndarray:
            args: list[Any] = []
            for x, y in zip(xs, ys, strict=True):
                args += [x, y]
            lt = np.asarray(comp(args), bool)
            args = []
            for x, y in zip(xs, ys, strict=True):
                args += [y, x]
            gt = np.asarray(comp(args), bool)
            x_pad, y_pad = xi >= size, yi >= size
            tie = ~lt & ~gt
            real = np.where(tie, xi < yi, lt)
            return np.where(x_pad | y_pad, (~x_pad & y_pad) | (x_pad & y_pad & (xi < yi)), real)

        for lo, hi, up in stages:
            a = [x[..., lo] for x in arrays]
            b = [x[..., hi] for x in arrays]
            ai, bi = index[..., lo], index[..., hi]
            b_first = less(b, bi, a, ai)
            a_first = less(a, ai, b, bi)
            swap = np.where(up, b_first, a_first)
            for x, va, vb in zip(arrays, a, b, strict=True):
                x[..., lo] = np.where(swap, vb, va)
                x[..., hi] = np.where(swap, va, vb)
            index[..., lo], index[..., hi] = np.where(swap, bi, ai), np.where(swap, ai, bi)
        return pack([np.moveaxis(x[..., :size], -1, dim) for x in arrays])

    return run


# --------------------------------------------------------------------------------------- map


@register("map")
def _map(ctx: KernelContext) -> KernelFn:
    comp = ctx.computation(0)
    shape = ctx.out_shape
    dt = ctx.out_dtype
    if ctx.is_elementwise(0):  # type: ignore[attr-defined]
        return lambda ops: np.broadcast_to(np.asarray(comp(list(ops))).astype(dt, copy=False), shape)

    def run_scalar(ops: Sequence[Any]) -> np.ndarray:
        out = np.empty(shape, dt)
        arrays = [np.asarray(o) for o in ops]
        for idx in itertools.product(*(range(s) for s in shape)):
            out[idx] = comp([a[idx] for a in arrays])
        return out

    return run_scalar
