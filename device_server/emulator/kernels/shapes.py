"""Data-movement kernels: copy, broadcast, reshape, bitcast, dynamic-reshape, transpose, slice,
concatenate, reverse, pad and iota.

Results may be read-only numpy views of their operands (broadcast, transpose, slice, reverse):
values are immutable in the emulator, so nothing is copied until an op needs new data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator.kernels import KernelContext, KernelFn, inline, register

_SMALL = 16384  # elements: below this, materialize broadcasts instead of making views


@register("copy")
def _copy(ctx: KernelContext) -> KernelFn:
    return lambda ops: ops[0]


@register("broadcast")
def _broadcast(ctx: KernelContext) -> KernelFn:
    """Operand dimension i becomes output dimension ``dimensions[i]``."""
    dims = tuple(ctx.attr("dimensions", ()))
    out_shape = ctx.out_shape
    in_shape = ctx.operand_shapes[0]
    if len(dims) != len(in_shape):
        raise ValueError(f"broadcast dimensions {list(dims)} do not match operand rank {len(in_shape)}")
    for i, d in enumerate(dims):
        if not 0 <= d < len(out_shape) or in_shape[i] not in (out_shape[d], 1):
            raise ValueError(
                f"broadcast of {list(in_shape)} to {list(out_shape)} with dimensions {list(dims)}"
            )
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    perm = None if order == list(range(len(dims))) else tuple(order)
    expanded = [1] * len(out_shape)
    for i, d in enumerate(dims):
        expanded[d] = in_shape[i]
    expanded_t = tuple(expanded)
    dt = ctx.out_dtype
    if int(np.prod(out_shape, dtype=np.int64)) <= _SMALL:
        # Small results: filling a new array is cheaper than np.broadcast_to's view setup.
        def run_small(ops: Sequence[Any]) -> np.ndarray:
            a = np.asarray(ops[0])
            if perm is not None:
                a = a.transpose(perm)
            out = np.empty(out_shape, dt)
            out[...] = a.reshape(expanded_t)
            return out
        return run_small

    def run(ops: Sequence[Any]) -> np.ndarray:
        a = np.asarray(ops[0])
        if perm is not None:
            a = a.transpose(perm)
        return np.broadcast_to(a.reshape(expanded_t), out_shape)

    return run


@register("reshape", "bitcast")
def _reshape(ctx: KernelContext) -> KernelFn:
    shape = ctx.out_shape
    if int(np.prod(shape, dtype=np.int64)) != int(np.prod(ctx.operand_shapes[0], dtype=np.int64)):
        raise ValueError(f"cannot reshape {list(ctx.operand_shapes[0])} to {list(shape)}")
    return reshape_kernel(shape)


@register("dynamic-reshape")
def _dynamic_reshape(ctx: KernelContext) -> KernelFn:
    """Operand 0's elements (row-major, at its run-time shape) reshaped to the sizes given by
    the scalar operands 1..rank; a static dimension's size must be its bound, a dynamic one's
    at most its bound."""
    bounds = tuple(ctx.out_shape)
    dynamic = ctx.out_dynamic
    if len(ctx.operand_shapes) != len(bounds) + 1 or any(s != () for s in ctx.operand_shapes[1:]):
        raise ValueError(f"expected an operand and {len(bounds)} scalar sizes, got operands of shapes "
                         f"{[list(s) for s in ctx.operand_shapes]}")

    def run(ops: Sequence[Any]) -> np.ndarray:
        sizes = tuple(int(v) for v in ops[1:])
        for d, (n, b, dy) in enumerate(zip(sizes, bounds, dynamic, strict=True)):
            if not (0 <= n <= b if dy else n == b):
                raise ValueError(f"size {n} of dimension {d} does not fit {'the bound' if dy else 'the static size'} {b}")
        a = np.asarray(ops[0])
        if a.size != int(np.prod(sizes, dtype=np.int64)):
            raise ValueError(f"cannot reshape {list(a.shape)} ({a.size} elements) to {list(sizes)}")
        return a.reshape(sizes)

    return run


def reshape_kernel(shape: tuple[int, ...]) -> KernelFn:
    """``np.reshape(x, shape)``; to ``()`` it gives a numpy scalar (cheaper to compute with)."""
    if shape == ():
        return inline(lambda ops: np.reshape(ops[0], ())[()], "{0}.reshape(())[()]")
    return inline(lambda ops: np.reshape(ops[0], shape), "{0}.reshape({s})", s=shape)


@register("transpose")
def _transpose(ctx: KernelContext) -> KernelFn:
    perm = tuple(ctx.attr("permutation"))
    if sorted(perm) != list(range(len(ctx.operand_shapes[0]))):
        raise ValueError(f"permutation {list(perm)} does not fit rank {len(ctx.operand_shapes[0])}")
    return inline(lambda ops: np.transpose(ops[0], perm), "{0}.transpose({p})", p=perm)


@register("slice")
def _slice(ctx: KernelContext) -> KernelFn:
    starts = ctx.attr("start_indices")
    limits = ctx.attr("limit_indices")
    strides = ctx.attr("strides", (1,) * len(starts))
    index = tuple(slice(s, lim, st) for s, lim, st in zip(starts, limits, strides, strict=True))
    return inline(lambda ops: np.asarray(ops[0])[index], "{0}[{i}]", i=index)


@register("concatenate")
def _concatenate(ctx: KernelContext) -> KernelFn:
    axis = int(ctx.attr("dimension"))
    dt = ctx.out_dtype
    return lambda ops: np.concatenate(ops, axis=axis, dtype=dt)


@register("reverse")
def _reverse(ctx: KernelContext) -> KernelFn:
    dims = tuple(ctx.attr("dimensions", ()))
    index = tuple(
        slice(None, None, -1) if d in dims else slice(None) for d in range(len(ctx.out_shape))
    )
    return lambda ops: np.asarray(ops[0])[index]


@register("pad")
def _pad(ctx: KernelContext) -> KernelFn:
    """Edge padding (negative = cropping) and interior padding, per dimension."""
    lo = ctx.attr("edge_padding_low")
    hi = ctx.attr("edge_padding_high")
    interior = ctx.attr("interior_padding", (0,) * len(lo))
    in_shape = ctx.operand_shapes[0]
    dt = ctx.out_dtype
    big_shape = []
    place = []
    crop = []
    for n, low, high, inner in zip(in_shape, lo, hi, interior, strict=True):
        if inner < 0:
            raise ValueError(f"negative interior padding {inner}")
        dilated = n + (n - 1) * inner if n > 0 else 0
        plo, phi = max(low, 0), max(high, 0)
        size = plo + dilated + phi
        big_shape.append(size)
        place.append(slice(plo, plo + dilated, inner + 1))
        crop.append(slice(max(-low, 0), size - max(-high, 0)))
    big = tuple(big_shape)
    place_t = tuple(place)
    crop_t = tuple(crop)
    if tuple(len(range(*c.indices(b))) for c, b in zip(crop_t, big, strict=True)) != ctx.out_shape:
        raise ValueError(f"padding {list(lo)}/{list(hi)}/{list(interior)} of {list(in_shape)} "
                         f"does not give {list(ctx.out_shape)}")
    simple_crop = all(c.start == 0 and c.stop == b for c, b in zip(crop_t, big, strict=True))

    def run(ops: Sequence[Any]) -> np.ndarray:
        out = np.full(big, ops[1], dtype=dt)
        out[place_t] = ops[0]
        return out if simple_crop else out[crop_t]

    return run


@register("iota")
def _iota(ctx: KernelContext) -> KernelFn:
    dim = int(ctx.attr("dimension"))
    shape = ctx.out_shape
    dt = ctx.out_dtype
    ramp_shape = [1] * len(shape)
    ramp_shape[dim] = shape[dim]
    value = np.broadcast_to(np.arange(shape[dim]).astype(dt).reshape(ramp_shape), shape)
    return lambda ops: value
