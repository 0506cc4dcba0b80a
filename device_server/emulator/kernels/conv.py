"""The ``convolution`` kernel: XLA's general convolution in vectorized numpy.

Covers general dimension numbers, any number of spatial dimensions, window strides, low/high
padding (negative crops), lhs (base) dilation as in transposed convolutions, rhs (window)
dilation as in atrous convolutions, window reversal, ``feature_group_count`` (grouped and
depthwise convolutions) and ``batch_group_count`` (weight gradients of grouped convolutions).
16-bit float inputs are computed in float32 and rounded once (the IPU's FP32 partials);
integer convolutions accumulate in 64 bits and wrap to the result type. With FP16 partials
requested (``ctx.numerics``, see ``emulator/numerics.py``) an FP16 convolution takes the
general im2col path and accumulates each row's window x input-feature products in FP16,
a chunk at a time (so with 16 or more input features per group, a chunk is 16 features of one
window tap, the AMP's order).

Plan (made once, when the program is compiled):

- the input is brought to ``(batch, spatial..., feature)`` ("canonical") and, if there is any
  padding or dilation, placed into a zero frame; the kernel to ``(groups, window*in, out)``;
- every window position is then visible through one strided view of the frame; blocks of
  output rows are copied out of it (im2col, a few MiB at a time) and multiplied with the
  kernel, one ``matmul`` per block batched over the groups;
- channels first in and out (ONNX's NCHW): a 1x1 stride-1 unpadded convolution is, per image,
  the kernel (out, in) times the input (in, spatial), straight into the result; the im2col
  blocks of other windows are transposed into the channels-first result as each is made;
- a 1x1 stride-1 unpadded convolution is a single matmul of the input; any other 1x1 window
  (strides, padding, base dilation: the input gradient of a strided 1x1 convolution) is one
  matmul of the input elements an output position reads, placed into zeros;
- a depthwise convolution (one input feature per group) is, per cache-sized block of output
  rows, one ``einsum`` of the strided view with the taps (no im2col copy);
- few output positions under a large window with the batch stored after the features (the
  weight gradient of a convolution: ``Conv2DBackpropFilter``) loops over the output positions
  instead, each a matmul of one window slab of a ``(feature, spatial..., batch)`` frame, which
  for NHWC activations needs no transposition at all; with few rows per position (a first
  layer's three colours) several positions are stacked into one matmul.

Blocks of output rows (and output positions, and depthwise blocks) are independent: they run
on the emulator's threads (``emulator/parallel.py``), each im2col block in its thread's scratch.

Speed: ``bench/bench_conv.py`` (``python bench/run.py --only conv``). numpy's OpenBLAS
threads spin-wait; on an oversubscribed machine, single-threaded BLAS
(``OPENBLAS_NUM_THREADS=1``) was 2-10x faster for these shapes.

Attributes read (names as written by ``tf_ipu.lowering.hlo_to_ir``):
``input_batch_dimension``, ``input_feature_dimension``, ``input_spatial_dimensions``,
``kernel_input_feature_dimension``, ``kernel_output_feature_dimension``,
``kernel_spatial_dimensions``, ``output_batch_dimension``, ``output_feature_dimension``,
``output_spatial_dimensions``, ``feature_group_count``, ``batch_group_count`` and the window
(``window_size``, ``window_strides``, ``padding_low``, ``padding_high``, ``base_dilation`` =
lhs dilation, ``window_dilation`` = rhs dilation, ``window_reversal``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from device_server.emulator import parallel
from device_server.emulator.errors import ExecutionError, describe
from device_server.emulator.kernels import KernelContext, KernelFn, register
from device_server.emulator.kernels.window import (
    Window,
    accumulation_dtype,
    attr_int,
    attr_ints,
    invalid,
    read_window,
)

# Elements of one im2col block: bounds the scratch memory of a convolution (4 MiB in f32).
_BLOCK_ELEMENTS = 1 << 20
# Elements of one block of depthwise outputs: small enough to stay in cache.
_DEPTHWISE_BLOCK_ELEMENTS = 1 << 16


def _blocks(nb: int, o1: int, inner: int, row_budget: int) -> list[tuple[int, int, int, int]]:
    """Blocks ``(n0, n1, o0, o1)`` of output rows over (batch, first spatial dim), each
    contiguous in a C-ordered ``(batch, spatial..., feature)`` result."""
    if o1 * inner <= row_budget:
        step = max(1, row_budget // max(1, o1 * inner))
        return [(n0, min(nb, n0 + step), 0, o1) for n0 in range(0, nb, step)]
    step = max(1, row_budget // max(1, inner))
    return [(n, n + 1, a, min(o1, a + step)) for n in range(nb) for a in range(0, o1, step)]


def _unit_window_slices(
    in_sizes: Sequence[int], out_sizes: Sequence[int], w: Window
) -> list[tuple[slice, slice]] | None:
    """For a window of size 1 in every dimension: per dimension, ``(output, input)`` slices
    of the output positions that read an input element (the others read padding or the zeros
    of base dilation, so they are 0) and of the elements they read; None if none does."""
    out = []
    for size, osize, st, lo, bd in zip(in_sizes, out_sizes, w.strides, w.pad_lo, w.base_dilation, strict=True):
        pairs = [(o, (o * st - lo) // bd) for o in range(osize)
                 if o * st - lo >= 0 and (o * st - lo) % bd == 0 and (o * st - lo) // bd < size]
        if not pairs:
            return None
        (o0, i0), (o1, i1) = pairs[0], pairs[-1]
        o_step = pairs[1][0] - o0 if len(pairs) > 1 else 1
        i_step = pairs[1][1] - i0 if len(pairs) > 1 else 1
        out.append((slice(o0, o1 + 1, o_step), slice(i0, i1 + 1, i_step)))
    return out


@register("convolution")
def convolution(ctx: KernelContext) -> KernelFn:
    """XLA ConvWithGeneralDimensions/ConvGeneralDilated (see the module docstring)."""
    if len(ctx.operand_shapes) != 2:
        raise invalid(ctx, f"expected 2 operands (lhs, rhs), got {len(ctx.operand_shapes)}.")
    lhs_shape = tuple(int(v) for v in ctx.operand_shapes[0])
    rhs_shape = tuple(int(v) for v in ctx.operand_shapes[1])
    out_shape = tuple(int(v) for v in ctx.out_shape)
    ib, i_f = attr_int(ctx, "input_batch_dimension"), attr_int(ctx, "input_feature_dimension")
    isp = attr_ints(ctx, "input_spatial_dimensions", ())
    k_in, k_out = attr_int(ctx, "kernel_input_feature_dimension"), attr_int(ctx, "kernel_output_feature_dimension")
    ksp = attr_ints(ctx, "kernel_spatial_dimensions", ())
    ob, o_f = attr_int(ctx, "output_batch_dimension"), attr_int(ctx, "output_feature_dimension")
    osp = attr_ints(ctx, "output_spatial_dimensions", ())
    k = len(isp)
    if len(ksp) != k or len(osp) != k:
        raise invalid(ctx, f"spatial dimension counts differ: input {list(isp)}, kernel {list(ksp)}, output {list(osp)}.")
    for what, dims, shape in (("input", (ib, i_f, *isp), lhs_shape), ("kernel", (k_in, k_out, *ksp), rhs_shape),
                              ("output", (ob, o_f, *osp), out_shape)):
        if sorted(dims) != list(range(len(shape))):
            raise invalid(ctx, f"{what} dimension numbers {list(dims)} are not a permutation of the "
                          f"{len(shape)} dimensions of shape {list(shape)}.")
    w = read_window(ctx, k)
    gf = attr_int(ctx, "feature_group_count", 1)
    gb = attr_int(ctx, "batch_group_count", 1)
    n, c = lhs_shape[ib], lhs_shape[i_f]
    spatial = tuple(lhs_shape[d] for d in isp)
    cg, ko = rhs_shape[k_in], rhs_shape[k_out]
    ksize = tuple(rhs_shape[d] for d in ksp)
    if gf < 1 or gb < 1 or (gf > 1 and gb > 1):
        raise invalid(ctx, f"feature_group_count={gf}, batch_group_count={gb}: both must be >= 1 and not both > 1.")
    if c != cg * gf:
        raise invalid(ctx, f"input features {c} != kernel input features {cg} x feature_group_count {gf}.")
    groups = gf * gb
    if ko % groups or n % gb:
        raise invalid(ctx, f"kernel output features {ko} / batch {n} are not divisible by the group count "
                      f"(feature_group_count={gf}, batch_group_count={gb}).")
    if w.size != ksize:
        raise invalid(ctx, f"window_size {list(w.size)} differs from the kernel's spatial sizes {list(ksize)}.")
    osize = w.output_sizes(spatial)
    nb, og = n // gb, ko // groups
    expect = [0] * (k + 2)
    expect[ob], expect[o_f] = nb, ko
    for d, v in zip(osp, osize, strict=True):
        expect[d] = v
    if tuple(expect) != out_shape:
        raise invalid(ctx, f"result shape {list(out_shape)} does not match the convolution's {expect} "
                      f"(input {list(lhs_shape)}, kernel {list(rhs_shape)}).")

    out_dt = np.dtype(ctx.out_dtype)
    cdt = accumulation_dtype(out_dt, ctx.operand_dtypes[0], ctx.operand_dtypes[1])
    lhs_perm = (ib, *isp, i_f)
    rhs_perm = (*ksp, k_in, k_out)
    out_perm = [0] * (k + 2)
    out_perm[ob], out_perm[o_f] = 0, k + 1
    for i, d in enumerate(osp):
        out_perm[d] = 1 + i
    out_identity = out_perm == list(range(k + 2))
    # Channels first in and out (ONNX's NCHW): a 1x1 stride-1 convolution is, per batch item,
    # the kernel (out, in) times the input (in, spatial) into the output (out, spatial), and
    # im2col blocks are written into the channels-first result as they are made (in cache,
    # on the emulator's threads), instead of one transposition of the whole result at the end.
    ident = tuple(range(k + 2))
    out_channels_first = bool(k) and (ob, o_f, *osp) == ident
    in_channels_first = bool(k) and (ib, i_f, *isp) == ident

    # Without spatial dimensions, work on one spatial dimension of size 1.
    ws = w if k else Window((1,), (1,), (0,), (0,), (1,), (1,), (False,))
    sp = spatial if k else (1,)
    ks = ksize if k else (1,)
    os_ = osize if k else (1,)
    kp = math.prod(ks)
    kc = kp * cg
    rows = nb * math.prod(os_)
    frame = ws.padded_sizes(sp)
    place = ws.placement(sp)
    needs_frame = not ws.is_trivial_padding() and any(v > 0 for v in ws.pad_lo + ws.pad_hi + tuple(d - 1 for d in ws.base_dilation))
    crop = None if ws.is_trivial_padding() or needs_frame else place
    reverse = tuple(slice(None, None, -1) if r else slice(None) for r in ws.reversal)
    any_reverse = any(ws.reversal)
    numerics = getattr(ctx, "numerics", None)
    chunk = numerics.half_partials_chunk("convolution", ctx.operand_dtypes) if numerics is not None else 0
    pointwise = not chunk and kp == 1 and groups == 1 and frame == sp and all(s == 1 for s in ws.strides)
    depthwise = not chunk and gf > 1 and cg == 1
    # A 1x1 window with strides, padding or base dilation (the input gradient of a strided
    # 1x1 convolution): one matmul of the input elements some output reads, placed into
    # zeros; no frame, no im2col.
    unit = not chunk and not pointwise and kp == 1 and groups == 1 and bool(k)
    pointwise_cf = pointwise and in_channels_first and out_channels_first
    hw = math.prod(sp)
    pw_parts = [(i, r0, r1) for i in range(n)
                for r0, r1 in parallel.split(ko, parallel.parts_for(ko * c * hw))]
    unit_slices = _unit_window_slices(sp, os_, ws) if unit else None
    row_budget = max(1, _BLOCK_ELEMENTS // max(1, groups * kc))
    blocks = _blocks(nb, os_[0], math.prod(os_[1:]), row_budget)
    trivial = rows == 0 or kc == 0
    letters = "abcdefghijklmnopqrstuvwxy"
    out_letters, win_letters = letters[: 1 + len(os_)], letters[1 + len(os_): 1 + 2 * len(os_)]
    dw_subscripts = f"{out_letters}{win_letters}z,{win_letters}z->{out_letters}z"
    dw_blocks = _blocks(n, os_[0], math.prod(os_[1:]), max(1, _DEPTHWISE_BLOCK_ELEMENTS // max(1, c)))

    # Few output positions under a large window (weight gradients: the "window" is the image)
    # with the batch after the features in memory: loop over output positions, contracting
    # each window slab of a feature-first frame (features, spatial..., batch) with the kernel.
    by_position = (not chunk and not depthwise and not pointwise and math.prod(os_) <= 256
                   and kp >= math.prod(os_) and ib > i_f)
    positions = list(itertools.product(*(range(v) for v in os_)))
    # The window slab of each output position in the (feature, spatial..., batch) frame.
    window_at = {pos: (slice(None), *(slice(o * st, o * st + (kk - 1) * d + 1, d) for o, st, kk, d in
                                      zip(pos, ws.strides, ks, ws.window_dilation, strict=True)), slice(None))
                 for pos in positions} if by_position else {}
    per_group = max(1, min(-(-64 // max(1, n)), (1 << 22) // max(1, n * kc)))
    position_groups = [positions[i:i + per_group] for i in range(0, len(positions), per_group)]

    def framed(x: np.ndarray) -> np.ndarray:
        """``x`` as (lead, *spatial, trail), padded/dilated into the frame or cropped."""
        if needs_frame:
            buf = np.zeros((x.shape[0], *frame, x.shape[-1]), cdt)
            if place is not None:
                buf[(slice(None), *place[1], slice(None))] = x[(slice(None), *place[0], slice(None))]
            return buf
        if crop is not None:
            x = x[(slice(None), *crop[0], slice(None))]
        return np.ascontiguousarray(x, dtype=cdt)

    def prepare_input_feature_first(lhs: np.ndarray) -> np.ndarray:
        return framed(lhs.transpose((i_f, *isp, ib)).reshape((c, *sp, n)))

    def run_by_position(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
        p = prepare_input_feature_first(lhs)
        kern = rhs.transpose((k_in, *ksp, k_out)).reshape((cg, *ks, ko))
        if any_reverse:
            kern = kern[(slice(None), *reverse)]
        # (groups, in-feature x window, out) with rows ordered (feature, window position).
        kern = np.ascontiguousarray(kern.reshape(cg * kp, groups, og).transpose(1, 0, 2), dtype=cdt)
        out = np.empty((nb, *os_, ko), cdt)
        if groups == 1 and n < 64:
            # Few rows per position (a small batch of the lhs, e.g. a first layer's 3
            # colours): stack several positions' rows into one matmul.
            def position_group(i: int) -> None:
                grp = position_groups[i]
                rows_ = parallel.scratch(len(grp) * n * kc, cdt).reshape(len(grp), n, kc)
                for g, pos in enumerate(grp):
                    np.copyto(rows_[g].reshape((n, c, *ks)), np.moveaxis(p[window_at[pos]], -1, 0))
                res = np.matmul(rows_.reshape(len(grp) * n, kc), kern[0])
                for g, pos in enumerate(grp):
                    out[(slice(None), *pos, slice(None))] = res[g * n:(g + 1) * n]

            parallel.run_parts(position_group, len(position_groups))
            return finish(out)

        def position(i: int) -> None:
            pos = positions[i]
            slab = p[window_at[pos]]
            dst = out[(slice(None), *pos, slice(None))]  # (nb, ko)
            if groups == 1:
                np.matmul(slab.reshape(kc, n).T, kern[0], out=dst)
            elif gb > 1:  # batch groups: the batch is (group, nb)
                a = slab.reshape(kc, gb, nb).transpose(1, 2, 0)
                dst.reshape(nb, gb, og)[...] = np.matmul(a, kern).transpose(1, 0, 2)
            else:  # feature groups: the features are (group, cg)
                a = slab.reshape(gf, kc, n).transpose(0, 2, 1)
                dst.reshape(n, gf, og)[...] = np.matmul(a, kern).transpose(1, 0, 2)

        parallel.run_parts(position, len(positions))
        return finish(out)

    def prepare_input(lhs: np.ndarray) -> np.ndarray:
        return framed(lhs.transpose(lhs_perm).reshape((n, *sp, c)))

    def prepare_kernel(rhs: np.ndarray) -> np.ndarray:
        kern = rhs.transpose(rhs_perm).reshape((*ks, cg, ko))
        if any_reverse:
            kern = kern[reverse]
        if groups == 1 and kern.dtype == cdt:
            # A transposed kernel (input gradients swap its feature dimensions) stays a view:
            # BLAS reads a transposed operand as it is, copying it costs more than the product.
            k2 = kern.reshape(kc, ko)
            if k2.flags.c_contiguous or k2.flags.f_contiguous:
                return k2[None]
        kern = kern.reshape(kp, cg, groups, og).transpose(2, 0, 1, 3)
        return np.ascontiguousarray(kern, dtype=cdt).reshape(groups, kc, og)

    def finish(res: np.ndarray) -> np.ndarray:
        res = res.reshape((nb, *osize, ko))
        if out_identity:
            return res.astype(out_dt, copy=False)
        return np.asarray(res.transpose(out_perm), dtype=out_dt, order="C")

    def windows(p: np.ndarray, grouped: bool) -> np.ndarray:
        """(groups, nb, out..., window..., cg) -- or (n, out..., window..., c) if not grouped."""
        s_n, *s_sp, s_c = p.strides
        o_str = tuple(s * st for s, st in zip(s_sp, ws.strides, strict=True))
        k_str = tuple(s * d for s, d in zip(s_sp, ws.window_dilation, strict=True))
        if not grouped:
            return as_strided(p, (n, *os_, *ks, c), (s_n, *o_str, *k_str, s_c), writeable=False)
        g_str = s_n * nb if gb > 1 else (s_c * cg if gf > 1 else 0)
        return as_strided(p, (groups, nb, *os_, *ks, cg), (g_str, s_n, *o_str, *k_str, s_c), writeable=False)

    def run_unit(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
        out = np.zeros((nb, *os_, ko), cdt)
        if unit_slices is not None:
            x = lhs.transpose(lhs_perm).reshape((n, *sp, c))
            x = x[(slice(None), *(i for _, i in unit_slices), slice(None))]
            res = parallel.matmul(np.ascontiguousarray(x, dtype=cdt).reshape(-1, c), prepare_kernel(rhs)[0])
            out[(slice(None), *(o for o, _ in unit_slices), slice(None))] = res.reshape((*x.shape[:-1], ko))
        return finish(out)

    def run_pointwise_channels_first(lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(lhs, dtype=cdt).reshape(n, c, hw)
        kt = prepare_kernel(rhs)[0].T  # (out, in): a view, BLAS reads it transposed
        out = np.empty((n, ko, hw), cdt)

        def part(j: int) -> None:
            i, r0, r1 = pw_parts[j]
            np.matmul(kt[r0:r1], x[i], out=out[i, r0:r1])

        parallel.run_parts(part, len(pw_parts))
        return out.reshape(out_shape).astype(out_dt, copy=False)

    def run(operands: Sequence[Any]) -> np.ndarray:
        lhs, rhs = np.asarray(operands[0]), np.asarray(operands[1])
        if lhs.shape != lhs_shape or rhs.shape != rhs_shape:
            raise ExecutionError(f"{describe(ctx.instr)}: operands {list(lhs.shape)} and {list(rhs.shape)}, "
                                 f"compiled for {list(lhs_shape)} and {list(rhs_shape)}.")
        if trivial:
            return np.zeros(out_shape, out_dt)
        if by_position:
            return run_by_position(lhs, rhs)
        if unit:
            return run_unit(lhs, rhs)
        if pointwise_cf:
            return run_pointwise_channels_first(lhs, rhs)
        p = prepare_input(lhs)
        kern = prepare_kernel(rhs)
        if pointwise:
            res = parallel.matmul(p.reshape(rows, c), kern[0])
            return finish(res)

        if depthwise:
            # One input feature per group: per block of output rows (sized to stay in cache)
            # and per channel multiplier, one einsum sums the window taps of the strided view
            # times their weights, without temporaries.
            view = windows(p, grouped=False)
            taps = kern.reshape(groups, *ks, og)  # (c, window..., multiplier)
            taps = np.ascontiguousarray(np.moveaxis(taps, (0, -1), (-1, 0)))  # (multiplier, window..., c)
            out = np.empty((og, n, *os_, c), cdt)

            def dw_block(i: int) -> None:
                n0, n1, a0, a1 = dw_blocks[i]
                vb = view[n0:n1, a0:a1]
                for m in range(og):
                    np.einsum(dw_subscripts, vb, taps[m], out=out[m, n0:n1, a0:a1])

            parallel.run_parts(dw_block, len(dw_blocks))
            return finish(np.moveaxis(out, 0, -1) if og > 1 else out[0])
        view = windows(p, grouped=True)
        rest = os_[1:]
        # channels first: each block's rows are made in a buffer of their own, then written
        # (transposed, while in cache) into the result
        out = np.empty((nb, ko, *os_) if out_channels_first else (nb, *os_, ko), cdt)

        def block(i: int) -> None:
            n0, n1, a0, a1 = blocks[i]
            m = (n1 - n0) * (a1 - a0) * math.prod(rest)
            blk = parallel.scratch(groups * m * kc, cdt).reshape((groups, n1 - n0, a1 - a0, *rest, *ks, cg))
            np.copyto(blk, view[:, n0:n1, a0:a1])
            lhs_rows = blk.reshape(groups, m, kc)
            dst = np.empty((m, ko), cdt) if out_channels_first else out[n0:n1, a0:a1].reshape(m, ko)
            if chunk:  # FP16 partials
                res = numerics.chunked_matmul(lhs_rows, kern, chunk)
                dst.reshape(m, groups, og)[...] = res.transpose(1, 0, 2)
            elif groups == 1:
                np.matmul(lhs_rows[0], kern[0], out=dst)
            else:
                dst.reshape(m, groups, og)[...] = np.matmul(lhs_rows, kern).transpose(1, 0, 2)
            if out_channels_first:
                out[n0:n1, :, a0:a1] = np.moveaxis(dst.reshape(n1 - n0, a1 - a0, *rest, ko), -1, 1)

        parallel.run_parts(block, len(blocks))
        if out_channels_first:
            return out.astype(out_dt, copy=False)
        return finish(out)

    return run
