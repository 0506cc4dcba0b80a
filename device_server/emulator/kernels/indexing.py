"""Indexing kernels: ``gather``, ``scatter``, ``dynamic-slice`` and ``dynamic-update-slice``.

They follow XLA's operation semantics with general dimension numbers, including the batching
dimensions (``operand_batching_dims``/``start_indices_batching_dims`` for gather,
``input_batching_dims``/``scatter_indices_batching_dims`` for scatter). Out-of-range start
indices are clamped for gather, dynamic-slice and dynamic-update-slice so the slice stays
inside the operand; a scatter window that would not fit entirely inside the operand is
skipped, as XLA does.

The factory turns the dimension numbers into a plan of flat (row-major) offsets: at run
time a gather is one clip, one multiply-add per index component and one ``take``; a scatter
computes the flat target of every update element and applies the update computation with a
ufunc's ``at`` (add, multiply, max, min, ...), a plain assignment (a computation returning
its second parameter), or, for anything else, the ordered rounds of
:func:`device_server.emulator.kernels.window.ordered_scatter`.

Attributes read (names as written by ``tf_ipu.lowering.hlo_to_ir``):

- gather: ``offset_dims``, ``collapsed_slice_dims``, ``start_index_map``,
  ``index_vector_dim``, ``operand_batching_dims``, ``start_indices_batching_dims``,
  ``slice_sizes``; operands ``(operand, start_indices)``.
- scatter: ``update_window_dims``, ``inserted_window_dims``, ``scatter_dims_to_operand_dims``,
  ``index_vector_dim``, ``input_batching_dims``, ``scatter_indices_batching_dims``; operands
  ``(operands..., scatter_indices, updates...)``; called computation ``[update]``.
- dynamic-slice: ``slice_sizes`` (defaults to the result shape); operands
  ``(operand, start_index...)`` with scalar start indices (a single 1-d index vector is also
  accepted).
- dynamic-update-slice: operands ``(operand, update, start_index...)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator.errors import ExecutionError, describe
from device_server.emulator.kernels import KernelContext, KernelFn, register
from device_server.emulator.kernels.window import (
    accumulation_dtype,
    attr_int,
    attr_ints,
    classify_binary,
    elementwise,
    invalid,
    ordered_scatter,
)

_INT64_SAFE = np.uint64(2**62)


def _as_int64(a: np.ndarray) -> np.ndarray:
    """Indices as int64; huge unsigned values saturate (they are out of range anyway)."""
    a = np.asarray(a)
    if a.dtype == np.uint64:
        a = np.minimum(a, _INT64_SAFE)
    return a.astype(np.int64, copy=False)


def _row_major_strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _check_dims(ctx: KernelContext, name: str, dims: Sequence[int], rank: int, what: str) -> None:
    if any(not 0 <= d < rank for d in dims) or len(set(dims)) != len(dims):
        raise invalid(ctx, f"attribute '{name}' = {list(dims)} must be distinct dimensions of the {rank}-d {what}.")


class _IndexPlan:
    """How a start-indices array selects window origins in an operand.

    Shared by gather and scatter: ``index_map`` maps index-vector components to operand
    dimensions, ``operand_batching``/``indices_batching`` pair operand dimensions with batch
    dimensions of the indices (the origin along such a dimension is the batch position).
    """

    def __init__(self, ctx: KernelContext, operand_shape: tuple[int, ...], indices_shape: tuple[int, ...],
                 index_vector_dim: int, index_map: Sequence[int], operand_batching: Sequence[int],
                 indices_batching: Sequence[int], window: Sequence[int]) -> None:
        rank = len(operand_shape)
        if not 0 <= index_vector_dim <= len(indices_shape):
            raise invalid(ctx, f"index_vector_dim {index_vector_dim} is out of range for indices of shape "
                          f"{list(indices_shape)}.")
        self.index_vector_dim = index_vector_dim
        self.implicit = index_vector_dim == len(indices_shape)
        n_vec = 1 if self.implicit else indices_shape[index_vector_dim]
        if len(index_map) != n_vec:
            raise invalid(ctx, f"the index vector has {n_vec} components but {len(index_map)} operand "
                          f"dimensions are mapped ({list(index_map)}).")
        _check_dims(ctx, "index map", index_map, rank, "operand")
        _check_dims(ctx, "operand batching dims", operand_batching, rank, "operand")
        if len(operand_batching) != len(indices_batching):
            raise invalid(ctx, f"{len(operand_batching)} operand batching dims but {len(indices_batching)} "
                          "indices batching dims.")
        self.batch_dims = [d for d in range(len(indices_shape)) if d != index_vector_dim]
        self.batch_shape = tuple(indices_shape[d] for d in self.batch_dims)
        for d in indices_batching:
            if d not in self.batch_dims:
                raise invalid(ctx, f"indices batching dim {d} is not a batch dimension of the indices "
                              f"(shape {list(indices_shape)}, index_vector_dim {index_vector_dim}).")
        strides = _row_major_strides(operand_shape)
        self.components = [(k, strides[d], operand_shape[d] - window[d]) for k, d in enumerate(index_map)]
        # Batching dims: the origin is the batch coordinate; precompute its flat offset.
        base = np.zeros(self.batch_shape, np.int64)
        for od, idd in zip(operand_batching, indices_batching, strict=True):
            pos = self.batch_dims.index(idd)
            shape = [1] * len(self.batch_shape)
            shape[pos] = self.batch_shape[pos]
            base = base + (np.arange(self.batch_shape[pos], dtype=np.int64) * strides[od]).reshape(shape)
        self.batch_base = base if operand_batching else None

    def vectors(self, indices: np.ndarray) -> np.ndarray:
        """Indices as (batch..., components) int64."""
        idx = _as_int64(indices)
        if self.implicit:
            return idx[..., None]
        return np.moveaxis(idx, self.index_vector_dim, -1)

    def clamped_origins(self, indices: np.ndarray) -> np.ndarray:
        """Flat offset of each window's origin, indices clamped so the window fits."""
        vec = self.vectors(indices)
        flat = np.zeros(self.batch_shape, np.int64) if self.batch_base is None else self.batch_base.copy()
        for k, stride, hi in self.components:
            flat += np.clip(vec[..., k], 0, max(hi, 0)) * stride
        return flat

    def checked_origins(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat offset of each window's origin, and whether the whole window is in range."""
        vec = self.vectors(indices)
        flat = np.zeros(self.batch_shape, np.int64) if self.batch_base is None else self.batch_base.copy()
        ok = np.ones(self.batch_shape, bool)
        for k, stride, hi in self.components:
            c = vec[..., k]
            ok &= (c >= 0) & (c <= hi)
            flat += np.clip(c, 0, max(hi, 0)) * stride
        return flat, ok


def _window_offsets(shape: Sequence[int], dims: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """Flat offsets of a window spanning ``sizes[j]`` along operand dim ``dims[j]``."""
    strides = _row_major_strides(shape)
    off = np.zeros(tuple(sizes), np.int64)
    for j, (d, s) in enumerate(zip(dims, sizes, strict=True)):
        view = [1] * len(sizes)
        view[j] = s
        off = off + (np.arange(s, dtype=np.int64) * strides[d]).reshape(view)
    return off


# ------------------------------------------------------------------------------------ gather


@register("gather")
def gather(ctx: KernelContext) -> KernelFn:
    """XLA Gather: slices of ``operand`` at the (clamped) origins given by ``start_indices``."""
    if len(ctx.operand_shapes) != 2:
        raise invalid(ctx, f"expected (operand, start_indices), got {len(ctx.operand_shapes)} operands.")
    operand_shape = tuple(int(v) for v in ctx.operand_shapes[0])
    indices_shape = tuple(int(v) for v in ctx.operand_shapes[1])
    out_shape = tuple(int(v) for v in ctx.out_shape)
    rank = len(operand_shape)
    offset_dims = attr_ints(ctx, "offset_dims", ())
    collapsed = attr_ints(ctx, "collapsed_slice_dims", ())
    index_map = attr_ints(ctx, "start_index_map", ())
    ivd = attr_int(ctx, "index_vector_dim")
    op_batch = attr_ints(ctx, "operand_batching_dims", ())
    idx_batch = attr_ints(ctx, "start_indices_batching_dims", ())
    slice_sizes = attr_ints(ctx, "slice_sizes")
    if len(slice_sizes) != rank:
        raise invalid(ctx, f"slice_sizes {list(slice_sizes)} needs one entry per operand dimension ({rank}).")
    for d, s in enumerate(slice_sizes):
        if not 0 <= s <= operand_shape[d]:
            raise invalid(ctx, f"slice size {s} for dimension {d} does not fit the operand {list(operand_shape)}.")
    _check_dims(ctx, "collapsed_slice_dims", collapsed, rank, "operand")
    for d in (*collapsed, *op_batch):
        if slice_sizes[d] != 1:
            raise invalid(ctx, f"collapsed/batching dimension {d} must have slice size 1, got {slice_sizes[d]}.")
    plan = _IndexPlan(ctx, operand_shape, indices_shape, ivd, index_map, op_batch, idx_batch, slice_sizes)
    window_dims = [d for d in range(rank) if d not in collapsed and d not in op_batch]
    out_rank = len(plan.batch_shape) + len(offset_dims)
    _check_dims(ctx, "offset_dims", offset_dims, out_rank, "result")
    if len(window_dims) != len(offset_dims) or list(offset_dims) != sorted(offset_dims):
        raise invalid(ctx, f"offset_dims {list(offset_dims)} must list, in order, the {len(window_dims)} "
                      f"uncollapsed operand dimensions {window_dims}.")
    batch_pos = [a for a in range(out_rank) if a not in offset_dims]
    expect = [0] * out_rank
    for a, s in zip(batch_pos, plan.batch_shape, strict=True):
        expect[a] = s
    for a, d in zip(offset_dims, window_dims, strict=True):
        expect[a] = slice_sizes[d]
    if tuple(expect) != out_shape:
        raise invalid(ctx, f"result shape {list(out_shape)} does not match the gather's {expect} "
                      f"(operand {list(operand_shape)}, indices {list(indices_shape)}).")
    nb = len(plan.batch_shape)
    # Result axes come out as (batch..., window...); put them where the result wants them.
    perm = [0] * out_rank
    for j, a in enumerate(batch_pos):
        perm[a] = j
    for j, a in enumerate(offset_dims):
        perm[a] = nb + j
    identity = perm == list(range(out_rank))
    out_dt = np.dtype(ctx.out_dtype)

    # Fast path: whole rows along one dimension (embedding lookups, tf.gather on an axis).
    take_dim = index_map[0] if len(index_map) == 1 else -1
    take = (take_dim >= 0 and collapsed == (take_dim,) and not op_batch
            and all(slice_sizes[d] == operand_shape[d] for d in range(rank) if d != take_dim))
    if take:
        # np.take gives (operand dims before, batch..., operand dims after).
        take_axes = list(range(take_dim)) + [-1] * nb + list(range(take_dim + 1, rank))
        src_of_window = {d: i for i, d in enumerate(take_axes) if d >= 0}
        tperm = [0] * out_rank
        for j, a in enumerate(batch_pos):
            tperm[a] = take_dim + j
        for a, d in zip(offset_dims, window_dims, strict=True):
            tperm[a] = src_of_window[d]
        tidentity = tperm == list(range(out_rank))
        hi = operand_shape[take_dim] - 1

        def run_take(ops: Sequence[Any]) -> np.ndarray:
            operand = np.asarray(ops[0])
            if 0 in out_shape:
                return np.empty(out_shape, out_dt)
            idx = np.clip(plan.vectors(np.asarray(ops[1]))[..., 0], 0, hi)
            res = np.take(operand, idx, axis=take_dim)
            return res if tidentity else np.ascontiguousarray(res.transpose(tperm))

        return run_take

    offsets = _window_offsets(operand_shape, window_dims, [slice_sizes[d] for d in window_dims])
    expand = (Ellipsis,) + (None,) * offsets.ndim

    def run(ops: Sequence[Any]) -> np.ndarray:
        operand = np.asarray(ops[0])
        if operand.shape != operand_shape:
            raise ExecutionError(f"{describe(ctx.instr)}: operand {list(operand.shape)}, compiled for "
                                 f"{list(operand_shape)}.")
        if 0 in out_shape:
            return np.empty(out_shape, out_dt)
        origins = plan.clamped_origins(np.asarray(ops[1]))
        res = np.take(operand.reshape(-1), origins[expand] + offsets)
        return res if identity else np.ascontiguousarray(res.transpose(perm))

    return run


# ----------------------------------------------------------------------------------- scatter


@register("scatter")
def scatter(ctx: KernelContext) -> KernelFn:
    """XLA Scatter: combines windows of ``updates`` into copies of the operands with the
    update computation, at origins given by ``scatter_indices``; windows that do not fit
    inside the operand are skipped."""
    n_ops = len(ctx.operand_shapes)
    if n_ops < 3 or n_ops % 2 == 0:
        raise invalid(ctx, f"expected (operands..., scatter_indices, updates...), got {n_ops} operands.")
    n = (n_ops - 1) // 2
    operand_shape = tuple(int(v) for v in ctx.operand_shapes[0])
    indices_shape = tuple(int(v) for v in ctx.operand_shapes[n])
    updates_shape = tuple(int(v) for v in ctx.operand_shapes[n + 1])
    for k in range(n):
        if tuple(ctx.operand_shapes[k]) != operand_shape or tuple(ctx.operand_shapes[n + 1 + k]) != updates_shape:
            raise invalid(ctx, "variadic scatter operands (and updates) must share one shape; got "
                          f"{[list(s) for s in ctx.operand_shapes]}.")
    rank = len(operand_shape)
    uwd = attr_ints(ctx, "update_window_dims", ())
    inserted = attr_ints(ctx, "inserted_window_dims", ())
    index_map = attr_ints(ctx, "scatter_dims_to_operand_dims", ())
    ivd = attr_int(ctx, "index_vector_dim")
    in_batch = attr_ints(ctx, "input_batching_dims", ())
    idx_batch = attr_ints(ctx, "scatter_indices_batching_dims", ())
    _check_dims(ctx, "inserted_window_dims", inserted, rank, "operand")
    _check_dims(ctx, "update_window_dims", uwd, len(updates_shape), "updates")
    window_dims = [d for d in range(rank) if d not in inserted and d not in in_batch]
    if len(window_dims) != len(uwd) or list(uwd) != sorted(uwd):
        raise invalid(ctx, f"update_window_dims {list(uwd)} must list, in order, one updates dimension per "
                      f"operand window dimension {window_dims}.")
    wsize = [1] * rank
    for d, u in zip(window_dims, uwd, strict=True):
        wsize[d] = updates_shape[u]
        if wsize[d] > operand_shape[d]:
            raise invalid(ctx, f"update window size {wsize[d]} exceeds operand dimension {d} of size "
                          f"{operand_shape[d]}.")
    plan = _IndexPlan(ctx, operand_shape, indices_shape, ivd, index_map, in_batch, idx_batch, wsize)
    scatter_dims = [a for a in range(len(updates_shape)) if a not in uwd]
    if tuple(updates_shape[a] for a in scatter_dims) != plan.batch_shape:
        raise invalid(ctx, f"updates {list(updates_shape)} (window dims {list(uwd)}) do not match the "
                      f"indices' batch shape {list(plan.batch_shape)}.")
    offsets = _window_offsets(operand_shape, window_dims, [wsize[d] for d in window_dims])
    expand = (Ellipsis,) + (None,) * offsets.ndim
    upd_perm = (*scatter_dims, *uwd)
    upd_identity = list(upd_perm) == list(range(len(updates_shape)))
    dtypes = [np.dtype(ctx.operand_dtypes[k]) for k in range(n)]

    ufunc = ctx.reducer_ufunc(0) if n == 1 else None
    kind = None if ufunc is not None or n > 1 else classify_binary(ctx.computation(0), dtypes[0], ("rhs",))
    combine = None if ufunc is not None or kind is not None else elementwise(ctx, 0, n)
    acc_dt = [accumulation_dtype(dt) if ufunc is np.add and (dt.kind == "f" or dt.name == "bfloat16") else dt
              for dt in dtypes]

    def run(ops: Sequence[Any]) -> Any:
        operands = [np.asarray(o) for o in ops[:n]]
        indices = np.asarray(ops[n])
        updates = [np.asarray(u) for u in ops[n + 1:]]
        if operands[0].shape != operand_shape or updates[0].shape != updates_shape:
            raise ExecutionError(f"{describe(ctx.instr)}: operand {list(operands[0].shape)} / updates "
                                 f"{list(updates[0].shape)}, compiled for {list(operand_shape)} / "
                                 f"{list(updates_shape)}.")
        outs = [o.astype(dt, copy=True).reshape(-1) for o, dt in zip(operands, acc_dt, strict=True)]
        if updates[0].size and outs[0].size:
            origins, ok = plan.checked_origins(indices)
            targets = origins[expand] + offsets
            vals = [u if upd_identity else u.transpose(upd_perm) for u in updates]
            if ok.all():
                targets = targets.reshape(-1)
                vals = [v.reshape(-1) for v in vals]
            else:
                targets = targets[ok]
                vals = [v[ok] for v in vals]
                targets = targets.reshape(-1)
                vals = [v.reshape(-1) for v in vals]
            if ufunc is not None:
                ufunc.at(outs[0], targets, vals[0].astype(acc_dt[0], copy=False))
            elif kind == "rhs":
                outs[0][targets] = vals[0]
            else:
                assert combine is not None
                ordered_scatter(outs, targets, vals, combine)
        res = tuple(o.reshape(operand_shape).astype(dt, copy=False) for o, dt in zip(outs, dtypes, strict=True))
        return res if n > 1 else res[0]

    return run


# ------------------------------------------------------------------ dynamic (update) slice


def _start_operands(ctx: KernelContext, first: int, rank: int) -> str:
    """'scalars' for one scalar start index per dimension, 'vector' for one 1-d index array."""
    shapes = [tuple(s) for s in ctx.operand_shapes[first:]]
    if len(shapes) == rank and all(s == () for s in shapes):
        return "scalars"
    if len(shapes) == 1 and shapes[0] == (rank,) and rank != 0:
        return "vector"
    raise invalid(ctx, f"expected {rank} scalar start indices, got operands of shapes {[list(s) for s in shapes]}.")


def _starts(ops: Sequence[Any], first: int, form: str, limits: Sequence[int]) -> tuple[slice, ...]:
    raw = [np.asarray(v) for v in ops[first:]]
    values = [int(v) for v in (_as_int64(raw[0]) if form == "vector" else [_as_int64(r) for r in raw])]
    return tuple(slice(min(max(v, 0), hi), min(max(v, 0), hi) + size) for v, (hi, size) in zip(values, limits, strict=True))


def _scalar_starts(limits: Sequence[tuple[int, int]], first: int) -> Any:
    """For one integer scalar start index per dimension (operands ``first``...): a function of
    the operands giving the clamped slices, in Python ints (no overflow, so no int64 detour).
    A dimension taken whole ignores its start index (it clamps to 0)."""
    full = tuple(slice(None) if hi == 0 else None for hi, _ in limits)
    moving = [(first + d, hi, size) for d, (hi, size) in enumerate(limits) if hi != 0]

    def starts(ops: Sequence[Any]) -> tuple[slice, ...]:
        index = list(full)
        for k, hi, size in moving:
            lo = min(max(int(ops[k]), 0), hi)
            index[k - first] = slice(lo, lo + size)
        return tuple(index)

    return starts


@register("dynamic-slice")
def dynamic_slice(ctx: KernelContext) -> KernelFn:
    """XLA DynamicSlice: a ``slice_sizes`` block at run-time start indices, clamped so the
    block lies inside the operand."""
    shape = tuple(int(v) for v in ctx.operand_shapes[0])
    rank = len(shape)
    sizes = attr_ints(ctx, "slice_sizes", tuple(ctx.out_shape))
    if len(sizes) != rank or any(not 0 <= s <= d for s, d in zip(sizes, shape, strict=True)):
        raise invalid(ctx, f"slice_sizes {list(sizes)} do not fit the operand {list(shape)}.")
    if tuple(ctx.out_shape) != sizes:
        raise invalid(ctx, f"result shape {list(ctx.out_shape)} differs from slice_sizes {list(sizes)}.")
    form = _start_operands(ctx, 1, rank)
    limits = [(d - s, s) for d, s in zip(shape, sizes, strict=True)]

    def run(ops: Sequence[Any]) -> np.ndarray:
        operand = np.asarray(ops[0])
        return np.array(operand[_starts(ops, 1, form, limits)], copy=True)

    if form == "scalars":
        starts = _scalar_starts(limits, 1)

        def run_scalars(ops: Sequence[Any]) -> np.ndarray:
            return np.asarray(ops[0])[starts(ops)].copy()

        return run_scalars
    return run


@register("dynamic-update-slice")
def dynamic_update_slice(ctx: KernelContext) -> KernelFn:
    """XLA DynamicUpdateSlice: a copy of ``operand`` with ``update`` written at run-time start
    indices, clamped so the update lies inside the operand (written into ``operand`` itself
    when the compiler marked it ``in_place``)."""
    if len(ctx.operand_shapes) < 2:
        raise invalid(ctx, f"expected (operand, update, start indices...), got {len(ctx.operand_shapes)} operands.")
    shape = tuple(int(v) for v in ctx.operand_shapes[0])
    ushape = tuple(int(v) for v in ctx.operand_shapes[1])
    rank = len(shape)
    if len(ushape) != rank or any(u > d for u, d in zip(ushape, shape, strict=True)):
        raise invalid(ctx, f"update {list(ushape)} does not fit the operand {list(shape)}.")
    form = _start_operands(ctx, 2, rank)
    limits = [(d - u, u) for d, u in zip(shape, ushape, strict=True)]

    if form == "scalars":
        starts = _scalar_starts(limits, 2)
    else:
        def starts(ops: Sequence[Any]) -> tuple[slice, ...]:
            return _starts(ops, 2, form, limits)

    def run(ops: Sequence[Any]) -> np.ndarray:
        out = np.array(ops[0], copy=True)
        out[starts(ops)] = ops[1]
        return out

    if getattr(ctx, "in_place", False):
        # The operand is a loop's own buffer that nothing else reads (see ``while``).
        def run_in_place(ops: Sequence[Any]) -> np.ndarray:
            out = ops[0]
            if not (isinstance(out, np.ndarray) and out.flags.writeable):
                return run(ops)
            out[starts(ops)] = ops[1]
            return out

        return run_in_place
    return run
