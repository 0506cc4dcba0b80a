"""Windowed reductions: ``reduce-window`` and ``select-and-scatter`` (pooling and its gradient).

Also holds the helpers the spatial kernels share (``conv.py``, ``indexing.py``): parsing of
the window attributes, the conversion of a called computation into an elementwise function
over arrays, recognition of common called computations, and an ordered scatter that applies
any update computation the way XLA's sequential definition does.

Attributes read (names as written by ``tf_ipu.lowering.hlo_to_ir``, see ``docs/ir.md``):

- window (reduce-window, select-and-scatter, convolution): ``window_size``,
  ``window_strides``, ``padding_low``, ``padding_high``, ``base_dilation``,
  ``window_dilation``, ``window_reversal`` (ints, one per dimension; all but
  ``window_size`` default to the identity window when absent).
- called computations: reduce-window ``[reducer]``; select-and-scatter ``[select, scatter]``.

Operands: reduce-window ``(inputs..., init_values...)`` (variadic: a tuple result);
select-and-scatter ``(operand, source, init_value)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from device_server.emulator.errors import ExecutionError, InvalidProgramError, describe
from device_server.emulator.kernels import KernelContext, KernelFn, register

__all__ = [
    "Window",
    "accumulation_dtype",
    "attr_int",
    "attr_ints",
    "classify_binary",
    "elementwise",
    "invalid",
    "ordered_scatter",
    "read_window",
]

ArrayFn = Callable[[Sequence[np.ndarray]], tuple[np.ndarray, ...]]


# ------------------------------------------------------------------------------ attributes


def invalid(ctx: KernelContext, message: str) -> InvalidProgramError:
    """A compile-time error naming the instruction (and its TF op / Keras layer)."""
    return InvalidProgramError(f"{describe(ctx.instr)}: {message}")


def attr_ints(ctx: KernelContext, name: str, default: Sequence[int] | None = None) -> tuple[int, ...]:
    """An integer-list attribute as a tuple (``default`` when absent, if given)."""
    value = ctx.attr(name) if default is None else ctx.attr(name, None)
    if value is None:
        return tuple(int(v) for v in (default or ()))
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise invalid(ctx, f"attribute '{name}' must be a list of integers, got {value!r}.") from None


def attr_int(ctx: KernelContext, name: str, default: int | None = None) -> int:
    """An integer attribute (``default`` when absent, if given)."""
    value = ctx.attr(name) if default is None else ctx.attr(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise invalid(ctx, f"attribute '{name}' must be an integer, got {value!r}.") from None


@dataclass(frozen=True)
class Window:
    """A window over ``rank`` dimensions, with XLA's meaning of every field."""

    size: tuple[int, ...]
    strides: tuple[int, ...]
    pad_lo: tuple[int, ...]
    pad_hi: tuple[int, ...]
    base_dilation: tuple[int, ...]
    window_dilation: tuple[int, ...]
    reversal: tuple[bool, ...]

    @property
    def rank(self) -> int:
        return len(self.size)

    def padded_sizes(self, in_sizes: Sequence[int]) -> tuple[int, ...]:
        """Size of each dimension after base dilation and (possibly negative) padding."""
        out = []
        for s, bd, lo, hi in zip(in_sizes, self.base_dilation, self.pad_lo, self.pad_hi, strict=True):
            dilated = (s - 1) * bd + 1 if s > 0 else 0
            out.append(dilated + lo + hi)
        return tuple(out)

    def effective_sizes(self) -> tuple[int, ...]:
        """Extent of the dilated window in each dimension."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.size, self.window_dilation, strict=True))

    def output_sizes(self, in_sizes: Sequence[int]) -> tuple[int, ...]:
        """Number of window positions in each dimension."""
        out = []
        for p, e, st in zip(self.padded_sizes(in_sizes), self.effective_sizes(), self.strides, strict=True):
            out.append((p - e) // st + 1 if p >= e else 0)
        return tuple(out)

    def is_trivial_padding(self) -> bool:
        return all(v == 0 for v in self.pad_lo + self.pad_hi) and all(v == 1 for v in self.base_dilation)

    def placement(self, in_sizes: Sequence[int]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
        """Where the input lands in the dilated, padded frame: ``(src, dst)`` slices, or None
        when no input element survives (negative padding cropped everything)."""
        src: list[slice] = []
        dst: list[slice] = []
        for s, bd, lo, p in zip(in_sizes, self.base_dilation, self.pad_lo, self.padded_sizes(in_sizes), strict=True):
            # Input element i sits at lo + i*bd; keep those with 0 <= lo + i*bd < p.
            first = max(0, -(lo // bd)) if lo < 0 else 0
            last = min(s - 1, (p - 1 - lo) // bd) if p - 1 - lo >= 0 else -1
            if first > last:
                return None
            src.append(slice(first, last + 1))
            dst.append(slice(lo + first * bd, lo + last * bd + 1, bd))
        return tuple(src), tuple(dst)


def read_window(ctx: KernelContext, rank: int) -> Window:
    """Reads and validates the window attributes for ``rank`` dimensions."""

    def get(name: str, default: int) -> tuple[int, ...]:
        vals = attr_ints(ctx, name, (default,) * rank)
        if len(vals) != rank:
            raise invalid(ctx, f"attribute '{name}' has {len(vals)} entries, expected {rank} (one per dimension).")
        return vals

    size = attr_ints(ctx, "window_size", ()) if rank == 0 else attr_ints(ctx, "window_size")
    if len(size) != rank:
        raise invalid(ctx, f"attribute 'window_size' has {len(size)} entries, expected {rank} (one per dimension).")
    w = Window(
        size=size,
        strides=get("window_strides", 1),
        pad_lo=get("padding_low", 0),
        pad_hi=get("padding_high", 0),
        base_dilation=get("base_dilation", 1),
        window_dilation=get("window_dilation", 1),
        reversal=tuple(bool(v) for v in get("window_reversal", 0)),
    )
    for name, vals in (("window_size", w.size), ("window_strides", w.strides),
                       ("base_dilation", w.base_dilation), ("window_dilation", w.window_dilation)):
        if any(v < 1 for v in vals):
            raise invalid(ctx, f"attribute '{name}' must be positive, got {list(vals)}.")
    return w


def accumulation_dtype(result: np.dtype, *inputs: np.dtype | None) -> np.dtype:
    """The dtype to accumulate in: float32 for 16-bit floats (the IPU's FP32 partials),
    64-bit integers for integer and bool results (wraps like the narrow type once cast)."""
    dts = [np.dtype(d) for d in (result, *inputs) if d is not None]
    result = np.dtype(result)
    if result.kind == "c":
        wide = any(d in (np.dtype(np.complex128), np.dtype(np.float64)) for d in dts)
        return np.dtype(np.complex128 if wide else np.complex64)
    if result.kind == "f" or result.name == "bfloat16":
        return np.dtype(np.float64 if any(d == np.float64 for d in dts) else np.float32)
    if result.kind == "u":
        return np.dtype(np.uint64)
    if result.kind in "ib":
        return np.dtype(np.int64)
    raise TypeError(f"no accumulation type for {result}")


# ------------------------------------------------------------------- called computations


def _per_element(fn: Callable[[Sequence[Any]], Any], n_out: int) -> ArrayFn:
    def run(args: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        arrays = np.broadcast_arrays(*[np.asarray(a) for a in args])
        shape = arrays[0].shape
        outs: list[np.ndarray] | None = None
        for pos in np.ndindex(*shape):
            res = fn([np.asarray(a[pos]) for a in arrays])
            res_t = tuple(res) if isinstance(res, (tuple, list)) else (res,)
            if outs is None:
                outs = [np.empty(shape, np.asarray(r).dtype) for r in res_t]
            for o, r in zip(outs, res_t, strict=True):
                o[pos] = r
        if outs is None:  # nothing to compute; dtypes follow the arguments
            return tuple(np.empty(shape, arrays[min(i, len(arrays) - 1)].dtype) for i in range(n_out))
        return tuple(outs)

    return run


def elementwise(ctx: KernelContext, index: int, n_out: int) -> ArrayFn:
    """The index-th called computation (scalar in, scalar out) as a function over arrays.

    If the context can tell (the emulator's ``is_elementwise``), a computation of
    shape-agnostic elementwise ops is called once on whole arrays and any other once per
    element. Otherwise the first call tries whole arrays and checks the result against
    per-element calls on a sample, falling back to per-element calls (correct for any
    computation, but slow) if that fails or disagrees. Floating-point exceptions are
    silenced, as XLA does not report them.
    """
    fn = ctx.computation(index)
    slow = _per_element(fn, n_out)
    probe = getattr(ctx, "is_elementwise", None)
    state: dict[str, bool] = {}
    if callable(probe):
        state["vectorized"] = bool(probe(index))
        state["trusted"] = True

    def vectorized(arrays: list[np.ndarray], shape: tuple[int, ...]) -> tuple[np.ndarray, ...] | None:
        try:
            res = fn(arrays)
            res_t = tuple(np.asarray(r) for r in (res if isinstance(res, (tuple, list)) else (res,)))
        except Exception:  # noqa: BLE001 - any failure means "not vectorizable"
            return None
        if len(res_t) != n_out or any(r.shape != shape for r in res_t):
            return None
        if not state.get("trusted"):
            flat = [a.reshape(-1) for a in arrays]
            sample = np.unique(np.linspace(0, flat[0].size - 1, num=min(8, flat[0].size)).astype(np.int64))
            ref = slow([f[sample] for f in flat])
            if not all(np.array_equal(r.reshape(-1)[sample], e, equal_nan=r.dtype.kind in "fc")
                       for r, e in zip(res_t, ref, strict=True)):
                return None
            state["trusted"] = True
        return res_t

    def run(args: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        arrays = list(np.broadcast_arrays(*[np.asarray(a) for a in args]))
        shape = arrays[0].shape
        with np.errstate(all="ignore"):
            if state.get("vectorized") is not False and shape and arrays[0].size:
                res = vectorized(arrays, shape)
                if res is not None:
                    state["vectorized"] = True
                    return res
                state["vectorized"] = False
            return slow(arrays)

    return run


_COMPARISONS: dict[str, np.ufunc] = {
    "ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less,
}


def _probe_pairs(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    if dtype.kind == "b":
        a, b = [False, True, False, True], [False, False, True, True]
    elif dtype.kind == "u":
        a, b = [0, 1, 0, 3, 7, 200], [0, 0, 1, 7, 3, 200]
    else:
        a, b = [0, 1, 0, 3, -7, 5, 2, -2], [0, 0, 1, -7, 3, 5, -2, 2]
        if dtype.kind == "f" or dtype.name == "bfloat16":
            a += [np.nan, 1.0, np.nan, np.inf, -np.inf, 0.5]
            b += [1.0, np.nan, np.nan, -np.inf, np.inf, -0.0]
    return np.asarray(a, dtype=dtype), np.asarray(b, dtype=dtype)


def classify_binary(
    fn: Callable[[Sequence[Any]], Any], dtype: np.dtype, candidates: Sequence[str]
) -> str | None:
    """Recognizes a scalar binary computation by probing it on a few pairs of values.

    ``candidates`` are among ``"ge" "gt" "le" "lt"`` (comparisons) and ``"rhs"``/``"lhs"``
    (returns its second/first argument, e.g. a scatter that assigns). Returns the first
    candidate that agrees on every probe (NaNs and infinities included for floats), or None.
    """
    dtype = np.dtype(dtype)
    a, b = _probe_pairs(dtype)
    try:
        with np.errstate(all="ignore"):
            got = [np.asarray(fn([np.asarray(x), np.asarray(y)])) for x, y in zip(a, b, strict=True)]
    except Exception:  # noqa: BLE001 - a computation we cannot probe is simply not recognized
        return None
    if any(g.shape != () for g in got):
        return None
    for name in candidates:
        if name in _COMPARISONS:
            with np.errstate(invalid="ignore"):  # bfloat16 (ml_dtypes) warns comparing NaNs
                want = _COMPARISONS[name](a, b)
            if all(g.dtype == np.bool_ and bool(g) == bool(w) for g, w in zip(got, want, strict=True)):
                return name
        elif name in ("rhs", "lhs"):
            want = b if name == "rhs" else a
            if all(g.dtype == dtype and np.array_equal(g, w, equal_nan=True) for g, w in zip(got, want, strict=True)):
                return name
    return None


def ordered_scatter(
    targets: Sequence[np.ndarray],
    index: np.ndarray,
    updates: Sequence[np.ndarray],
    combine: ArrayFn,
) -> None:
    """``targets[j][index[i]] = combine(targets..., updates...)[j]`` for every ``i`` in order.

    ``targets`` are flat arrays updated in place; ``index`` and every ``updates[j]`` are 1-d
    and aligned. Updates to the same element are applied in their order in ``index``; each
    round applies, vectorized, the next update of every element still having one.
    """
    n = index.size
    if n == 0:
        return
    order = np.argsort(index, kind="stable")
    sorted_idx = index[order]
    starts = np.ones(n, dtype=bool)
    starts[1:] = sorted_idx[1:] != sorted_idx[:-1]
    run_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    rank = np.arange(n) - run_start
    by_rank = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[by_rank], np.arange(int(rank.max()) + 2))
    for r in range(len(bounds) - 1):
        sel = order[by_rank[bounds[r]:bounds[r + 1]]]
        where = index[sel]
        new = combine([t[where] for t in targets] + [u[sel] for u in updates])
        for t, v in zip(targets, new, strict=True):
            t[where] = v


# ---------------------------------------------------------------------------- reduce-window


def _window_views(
    buf: np.ndarray, w: Window, out_sizes: Sequence[int]
) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """``view[κ..., o...] = buf[o*stride + κ*dilation]``: all window positions at once."""
    strides = buf.strides
    shape = (*w.size, *out_sizes)
    vstrides = (
        *(s * d for s, d in zip(strides, w.window_dilation, strict=True)),
        *(s * st for s, st in zip(strides, w.strides, strict=True)),
    )
    return as_strided(buf, shape, vstrides, writeable=False), list(itertools.product(*(range(k) for k in w.size)))


def window_masks(w: Window, in_sizes: Sequence[int], out_sizes: Sequence[int]) -> list[np.ndarray | None]:
    """For every window offset κ (row-major), which windows see a real input element there
    (not padding, not a base-dilation hole): a boolean array broadcastable to ``out_sizes``,
    or None when all do."""
    rank = len(in_sizes)
    per_dim = []
    for d in range(rank):
        o = np.arange(out_sizes[d], dtype=np.int64)[:, None]
        pos = o * w.strides[d] + np.arange(w.size[d], dtype=np.int64)[None, :] * w.window_dilation[d] - w.pad_lo[d]
        src, rem = np.divmod(pos, w.base_dilation[d])
        per_dim.append((rem == 0) & (src >= 0) & (src < in_sizes[d]))
    masks: list[np.ndarray | None] = []
    for kap in itertools.product(*(range(k) for k in w.size)):
        mask = None
        for d in range(rank):
            col = per_dim[d][:, kap[d]]
            if not col.all():
                shape = [1] * rank
                shape[d] = out_sizes[d]
                m = col.reshape(shape)
                mask = m if mask is None else mask & m
        masks.append(mask)
    return masks


def ufunc_identity(ufunc: np.ufunc, dtype: np.dtype) -> Any | None:
    """A value ``e`` with ``ufunc(e, x) == x`` for every ``x`` of ``dtype``, or None."""
    dtype = np.dtype(dtype)
    floating = dtype.kind == "f" or dtype.name == "bfloat16"
    if ufunc is np.add and floating:
        return np.asarray(-0.0, dtype)  # x + -0.0 == x, also for x = -0.0
    if ufunc in (np.add, np.bitwise_or, np.bitwise_xor, np.logical_or, np.logical_xor):
        return np.zeros((), dtype)
    if ufunc is np.multiply:
        return np.ones((), dtype)
    if ufunc in (np.bitwise_and, np.logical_and):
        return np.ones((), dtype) if dtype.kind == "b" else np.invert(np.zeros((), dtype))
    if ufunc in (np.maximum, np.minimum):
        low = ufunc is np.maximum
        if floating:
            return np.asarray(-np.inf if low else np.inf, dtype)
        if dtype.kind == "b":
            return np.asarray(not low)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            return np.asarray(info.min if low else info.max, dtype)
    return None


@register("reduce-window")
def reduce_window(ctx: KernelContext) -> KernelFn:
    """XLA ReduceWindow: every output element is the init value combined with the input
    elements its window covers in the base-dilated, padded frame (padding and dilation holes
    contribute nothing, as in XLA's CPU implementation)."""
    n_ops = len(ctx.operand_shapes)
    if n_ops < 2 or n_ops % 2:
        raise invalid(ctx, f"expected N inputs followed by N init values, got {n_ops} operands.")
    n = n_ops // 2
    in_shape = tuple(ctx.operand_shapes[0])
    for k in range(n):
        if tuple(ctx.operand_shapes[k]) != in_shape:
            raise invalid(ctx, f"input {k} has shape {list(ctx.operand_shapes[k])}, input 0 has {list(in_shape)}.")
        if tuple(ctx.operand_shapes[n + k]) != ():
            raise invalid(ctx, f"init value {k} must be a scalar, got shape {list(ctx.operand_shapes[n + k])}.")
    rank = len(in_shape)
    w = read_window(ctx, rank)
    out_sizes = w.output_sizes(in_shape)
    if n == 1 and ctx.out_shape is not None and tuple(ctx.out_shape) != out_sizes:
        raise invalid(ctx, f"result shape {list(ctx.out_shape)} does not match the window's {list(out_sizes)}.")
    dtypes = [np.dtype(ctx.operand_dtypes[k]) for k in range(n)]
    padded = w.padded_sizes(in_shape)
    place = w.placement(in_shape)
    trivial = w.is_trivial_padding()
    ufunc = ctx.reducer_ufunc(0) if n == 1 else None
    if ufunc is not None:
        acc_dt = accumulation_dtype(dtypes[0]) if ufunc is np.add and (
            dtypes[0].kind == "f" or dtypes[0].name == "bfloat16") else dtypes[0]
        fill = ufunc_identity(ufunc, acc_dt)
        if fill is None:
            ufunc = None

    def framed(x: np.ndarray, fill: Any, dtype: np.dtype) -> np.ndarray:
        if trivial:
            return x.astype(dtype, copy=False)
        buf = np.full(padded, fill, dtype=dtype)
        if place is not None:
            buf[place[1]] = x[place[0]]
        return buf

    if ufunc is not None:
        # Associative and commutative with an identity: reduce one dimension at a time (the
        # sum of the window sizes in passes, not their product), each pass combining the
        # in-range part of every tap straight from the input (no padded copy), then combine
        # with the init value once. Base dilation goes through a frame filled with the
        # identity.
        out_dt = dtypes[0]
        plans = []
        sizes = list(in_shape) if all(b == 1 for b in w.base_dilation) else list(padded)
        lows = w.pad_lo if all(b == 1 for b in w.base_dilation) else (0,) * rank
        for d in range(rank):
            k, st, wd, lo, o, size = w.size[d], w.strides[d], w.window_dilation[d], lows[d], out_sizes[d], sizes[d]
            if k == 1 and st == 1 and lo == 0 and size == o:
                continue
            taps = []
            for j in range(k):
                first = max(0, -((j * wd - lo) // st)) if j * wd - lo < 0 else 0
                last = min(o - 1, (size - 1 - j * wd + lo) // st) if size - 1 - j * wd + lo >= 0 else -1
                if first <= last:
                    p0 = first * st + j * wd - lo
                    taps.append((slice(first, last + 1), slice(p0, p0 + (last - first) * st + 1, st)))
            full = [t for t in taps if t[0] == slice(0, o)]
            taps.sort(key=lambda t: t[0] != slice(0, o))  # a tap covering every window first
            plans.append((d, o, taps, bool(full)))

        def run_ufunc(ops: Sequence[Any]) -> np.ndarray:
            x, init = np.asarray(ops[0]), np.asarray(ops[1])
            if 0 in out_sizes:
                return np.empty(out_sizes, out_dt)
            acc = x if all(b == 1 for b in w.base_dilation) else framed(x, fill, acc_dt)
            for d, o, taps, has_full in plans:
                shape_d = list(acc.shape)
                shape_d[d] = o
                lead = (slice(None),) * d
                if has_full:
                    res = np.empty(shape_d, acc_dt)
                    np.copyto(res, acc[(*lead, taps[0][1])], casting="unsafe")
                    rest = taps[1:]
                else:
                    res = np.full(shape_d, fill, acc_dt)
                    rest = taps
                for dst, src in rest:
                    part = res[(*lead, dst)]
                    ufunc(part, acc[(*lead, src)], out=part)
                acc = res
            return np.asarray(ufunc(init.astype(acc_dt), acc), dtype=out_dt, order="C")

        return run_ufunc

    combine = elementwise(ctx, 0, n)
    masks = window_masks(w, in_shape, out_sizes) if 0 not in out_sizes else []

    def run_generic(ops: Sequence[Any]) -> Any:
        xs = [np.asarray(o) for o in ops[:n]]
        inits = [np.asarray(o) for o in ops[n:]]
        if 0 in out_sizes:
            res = tuple(np.empty(out_sizes, dt) for dt in dtypes)
        else:
            bufs = [framed(x, i, dt) for x, i, dt in zip(xs, inits, dtypes, strict=True)]
            views = [_window_views(b, w, out_sizes) for b in bufs]
            acc = [np.full(out_sizes, i, dtype=dt) for i, dt in zip(inits, dtypes, strict=True)]
            for kappa, mask in zip(views[0][1], masks, strict=True):
                vals = [np.asarray(v[0][kappa]) for v in views]
                new = [np.asarray(a, dtype=dt) for a, dt in zip(combine(acc + vals), dtypes, strict=True)]
                acc = new if mask is None else [np.where(mask, a_new, a) for a_new, a in zip(new, acc, strict=True)]
            res = tuple(np.ascontiguousarray(a) for a in acc)
        return res if n > 1 else res[0]

    return run_generic


# ------------------------------------------------------------------------ select-and-scatter


@register("select-and-scatter")
def select_and_scatter(ctx: KernelContext) -> KernelFn:
    """XLA SelectAndScatter: in every window of ``operand`` select one element (walking the
    window in row-major order, the candidate replaces the current choice unless
    ``select(current, candidate)`` holds; padding is never selected), then combine the
    window's ``source`` value into a result that starts as ``init_value`` everywhere, with
    ``scatter``.

    Ties therefore go to the first maximum for ``ge`` (max pooling) and the last for ``gt``.
    XLA CPU agrees on unpadded windows; in some padded windows its expansion into a variadic
    reduce-window breaks ties in another order (seen on TF 2.21), which this kernel does not
    imitate.

    Fast path: a ``ge``/``gt``/``le``/``lt`` select on NaN-free input keeps the running
    selection as a running max/min; the window index chosen is kept with a running max (each
    new index exceeds the earlier ones); the flat targets then go through ``ufunc.at`` (or a
    plain assignment when windows do not overlap), computed in cache-sized row blocks."""
    if len(ctx.operand_shapes) != 3:
        raise invalid(ctx, f"expected (operand, source, init_value), got {len(ctx.operand_shapes)} operands.")
    shape = tuple(ctx.operand_shapes[0])
    rank = len(shape)
    w = read_window(ctx, rank)
    if any(v != 1 for v in w.base_dilation + w.window_dilation):
        raise invalid(ctx, "dilated windows are not supported by select-and-scatter "
                      f"(base_dilation={list(w.base_dilation)}, window_dilation={list(w.window_dilation)}).")
    out_sizes = w.output_sizes(shape)
    if tuple(ctx.operand_shapes[1]) != out_sizes:
        raise invalid(ctx, f"source has shape {list(ctx.operand_shapes[1])}, the window over operand "
                      f"{list(shape)} gives {list(out_sizes)}.")
    if tuple(ctx.operand_shapes[2]) != ():
        raise invalid(ctx, f"init_value must be a scalar, got shape {list(ctx.operand_shapes[2])}.")
    dtype = np.dtype(ctx.operand_dtypes[0])
    out_dt = np.dtype(ctx.out_dtype) if ctx.out_dtype is not None else np.dtype(ctx.operand_dtypes[1])

    kind = classify_binary(ctx.computation(0), dtype, ("ge", "gt", "le", "lt"))
    generic_select = None if kind is not None else elementwise(ctx, 0, 1)

    def select_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out = select(a, b), elementwise."""
        if kind is not None:
            _COMPARISONS[kind](a, b, out=out)
        else:
            assert generic_select is not None
            out[...] = np.asarray(generic_select([a, b])[0], dtype=bool)

    scatter_ufunc = ctx.reducer_ufunc(1)
    scatter_generic = None if scatter_ufunc is not None else elementwise(ctx, 1, 1)
    acc_dt = accumulation_dtype(out_dt) if scatter_ufunc is np.add and (
        out_dt.kind == "f" or out_dt.name == "bfloat16") else out_dt
    overlapping = any(st < k for st, k in zip(w.strides, w.size, strict=True))

    # Window geometry: operand index of window o at offset κ along dimension d is
    # o*stride + κ - pad_lo; the windows walk over a frame holding the operand and its
    # padding (negative padding crops), in which padding is masked out.
    estrides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(rank)]
    kappas = list(itertools.product(*(range(k) for k in w.size)))
    masks = window_masks(w, shape, out_sizes)
    kappa_dt = np.int8 if len(kappas) < 2**7 else (np.int16 if len(kappas) < 2**15 else np.int64)
    frame = tuple(s + lo + hi for s, lo, hi in zip(shape, w.pad_lo, w.pad_hi, strict=True))
    place = w.placement(shape)
    trivial = w.is_trivial_padding()
    # With a plain comparison and no NaN, the running selected value is the running max (ge,
    # gt) or min (le, lt) -- equal values compare alike, so which one is kept does not matter
    # -- and padding can hold a value that never wins.
    extreme = {"ge": np.maximum, "gt": np.maximum, "le": np.minimum, "lt": np.minimum}.get(kind or "")
    sentinel = ufunc_identity(extreme, dtype) if extreme is not None else None
    floating = dtype.kind in "fc" or dtype.name == "bfloat16"
    complement = {"ge": np.less, "gt": np.less_equal, "le": np.greater, "lt": np.greater_equal}.get(kind or "")
    # Offsets of every window element in the operand, as the sum of one small broadcastable
    # array per dimension: origin (o*stride - pad_lo) plus the offset inside the window.
    index_dt = np.int32 if math.prod(shape) < 2**31 else np.int64
    origin_parts = []
    for d in range(rank):
        bshape = [1] * rank
        bshape[d] = out_sizes[d]
        o = np.arange(out_sizes[d], dtype=np.int64)
        origin_parts.append(((o * w.strides[d] - w.pad_lo[d]) * estrides[d]).astype(index_dt).reshape(bshape))
    tap_offsets = np.array([sum(k * es for k, es in zip(kap, estrides, strict=True)) for kap in kappas], index_dt)
    # Blocks along the first result dimension, so a block's running state stays in cache.
    per_row = math.prod(out_sizes[1:]) if rank else 1
    rows_per_block = max(1, (1 << 16) // max(1, per_row))
    lead = out_sizes[0] if rank else 1
    blocks = [(r0, min(lead, r0 + rows_per_block)) for r0 in range(0, lead, rows_per_block)] if rank else [(0, 1)]

    def rows(a: np.ndarray | None, r0: int, r1: int) -> np.ndarray | None:
        """Rows r0:r1 of an array broadcastable to the result (None stays None)."""
        if a is None or not rank or a.shape[0] == 1:
            return a
        return a[r0:r1]

    def select_block(views: np.ndarray, r0: int, r1: int, fast: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Index (into the row-major window offsets) of the selected element of every window
        in rows r0:r1, and which of them have any element at all (None: all of them)."""
        sub = (slice(None),) * len(w.size) + ((slice(r0, r1),) if rank else ())
        v = views[sub]
        bshape = v.shape[len(w.size):]
        sel_val = np.array(v[kappas[0]], copy=True)
        sel_k = np.zeros(bshape, kappa_dt)
        step = np.empty(bshape, kappa_dt)
        replace = np.empty(bshape, bool)
        have: np.ndarray | None = None
        if masks[0] is not None:
            have = np.broadcast_to(rows(masks[0], r0, r1), bshape).copy()
        for j in range(1, len(kappas)):
            cand = v[kappas[j]]
            if fast:
                assert complement is not None
                complement(sel_val, cand, out=replace)  # the candidate wins unless select(current, it)
            else:
                select_into(sel_val, cand, replace)
                np.logical_not(replace, out=replace)
            m = rows(masks[j], r0, r1)
            if have is not None:
                replace |= ~have  # a window's first valid element is always taken
            if m is not None:
                replace &= m  # padding is never selected
            if have is not None:
                if m is None:
                    have = None
                else:
                    have |= m
            if fast:
                assert extreme is not None
                extreme(sel_val, cand, out=sel_val)
            else:
                np.copyto(sel_val, cand, where=replace)
            # j exceeds every index chosen so far: the max keeps the old choice or takes j.
            np.multiply(replace, kappa_dt(j), out=step)
            np.maximum(sel_k, step, out=sel_k)
        return sel_k, have

    def run(ops: Sequence[Any]) -> np.ndarray:
        operand, source, init = (np.asarray(o) for o in ops)
        if operand.shape != shape or source.shape != out_sizes:
            raise ExecutionError(f"{describe(ctx.instr)}: operand {list(operand.shape)} / source "
                                 f"{list(source.shape)}, compiled for {list(shape)} / {list(out_sizes)}.")
        if source.size == 0 or operand.size == 0:
            return np.full(shape, init, dtype=out_dt)
        fast = complement is not None and sentinel is not None and not (floating and np.isnan(operand).any())
        if trivial:
            buf = operand
        else:
            buf = np.full(frame, sentinel if fast else 0, dtype=operand.dtype)
            if place is not None:
                buf[place[1]] = operand[place[0]]
        views, _ = _window_views(buf, w, out_sizes)
        target = np.empty(out_sizes, index_dt)
        valid = None
        for r0, r1 in blocks:
            sel_k, have = select_block(views, r0, r1, fast)
            t = target[r0:r1] if rank else target
            np.take(tap_offsets, sel_k, out=t)
            for part in origin_parts:
                t += rows(part, r0, r1)
            if have is not None:
                if valid is None:
                    valid = np.ones(out_sizes, bool)
                valid[r0:r1] = have
        src = source.astype(acc_dt, copy=False)
        if valid is not None:
            target, src = target[valid], src[valid]
        target, src = target.reshape(-1), src.reshape(-1)
        out = np.full(shape, init, dtype=acc_dt)
        flat = out.reshape(-1)
        if scatter_ufunc is not None:
            if overlapping:
                scatter_ufunc.at(flat, target, src)
            else:  # every element is selected by at most one window
                flat[target] = scatter_ufunc(init.astype(acc_dt), src)
        else:  # any other computation, in source order as the definition applies it
            assert scatter_generic is not None
            ordered_scatter([flat], target, [src], scatter_generic)
        return out.astype(out_dt, copy=False)

    return run
