"""``dot`` with general dimension numbers.

Both operands are permuted to ``[batch, free, contracting]`` / ``[batch, contracting, free]``,
reshaped to 3-D and multiplied with ``np.matmul``; the result comes out as XLA orders it:
batch dimensions, then the lhs free dimensions, then the rhs free dimensions.

Numerics: floating-point products are computed in float32 (float64 when an operand or the
result is float64) and rounded once to the result type. This matches the IPU's AMP units, which
take FP16 inputs and accumulate in FP32 "partials", and XLA's CPU backend for FP16/BF16 dots.
Integer dots are computed in the result type (wrapping). Big products are cut by batch or by
rows over the emulator's threads (``emulator/parallel.py``). With FP16 partials requested
(``ctx.numerics``, see ``emulator/numerics.py``) an FP16 dot keeps an FP16 accumulator instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator import parallel
from device_server.emulator.kernels import KernelContext, KernelFn, inline, register


def _compute_dtype(out: np.dtype, lhs: np.dtype, rhs: np.dtype) -> np.dtype:
    if out.kind == "c" or lhs.kind == "c" or rhs.kind == "c":
        return np.dtype(np.complex128) if 16 in (out.itemsize, lhs.itemsize, rhs.itemsize) else np.dtype(np.complex64)
    if out.kind in "iub" and lhs.kind in "iub" and rhs.kind in "iub":
        return np.dtype(np.int64) if out == np.bool_ else out
    if np.dtype(np.float64) in (out, lhs, rhs):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


@register("dot")
def _dot(ctx: KernelContext) -> KernelFn:
    lhs_shape, rhs_shape = ctx.operand_shapes[0], ctx.operand_shapes[1]
    lb = tuple(ctx.attr("lhs_batch_dimensions", ()))
    rb = tuple(ctx.attr("rhs_batch_dimensions", ()))
    lc = tuple(ctx.attr("lhs_contracting_dimensions", ()))
    rc = tuple(ctx.attr("rhs_contracting_dimensions", ()))
    if len(lb) != len(rb) or len(lc) != len(rc):
        raise ValueError(f"batch {lb}/{rb} or contracting {lc}/{rc} dimension counts differ")
    for a, b in zip(lb + lc, rb + rc, strict=True):
        if lhs_shape[a] != rhs_shape[b]:
            raise ValueError(
                f"lhs dimension {a} ({lhs_shape[a]}) does not match rhs dimension {b} "
                f"({rhs_shape[b]}) of shapes {list(lhs_shape)} x {list(rhs_shape)}"
            )
    lf = tuple(d for d in range(len(lhs_shape)) if d not in lb and d not in lc)
    rf = tuple(d for d in range(len(rhs_shape)) if d not in rb and d not in rc)

    def size(shape: tuple[int, ...], dims: tuple[int, ...]) -> int:
        return int(np.prod([shape[d] for d in dims], dtype=np.int64))

    B, M, K, N = size(lhs_shape, lb), size(lhs_shape, lf), size(lhs_shape, lc), size(rhs_shape, rf)
    lperm = lb + lf + lc
    rperm = rb + rc + rf
    lperm_t = None if lperm == tuple(range(len(lhs_shape))) else lperm
    rperm_t = None if rperm == tuple(range(len(rhs_shape))) else rperm
    out_shape = ctx.out_shape
    expected = tuple(lhs_shape[d] for d in lb) + tuple(lhs_shape[d] for d in lf) + tuple(rhs_shape[d] for d in rf)
    if expected != out_shape:
        raise ValueError(f"dot of {list(lhs_shape)} x {list(rhs_shape)} gives {list(expected)}, not {list(out_shape)}")
    out_dt = ctx.out_dtype
    cdt = _compute_dtype(out_dt, ctx.operand_dtypes[0], ctx.operand_dtypes[1])
    lhs3, rhs3 = (B, M, K), (B, K, N)
    two_d = B == 1 and not lb
    numerics = getattr(ctx, "numerics", None)
    chunk = numerics.half_partials_chunk("dot", ctx.operand_dtypes) if numerics is not None else 0
    # Big products are cut over threads (``parallel.matmul``: by batch or by rows).
    matmul = parallel.matmul if B * M * K * N >= 2 * parallel.MIN_PART_MACS else np.matmul
    if chunk:
        def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # FP16 partials
            return numerics.chunked_matmul(a, b, chunk)

    if not chunk and two_d and len(lf) == len(lc) == len(rf) == len(rc) == 1 and out_dt == cdt \
            and ctx.operand_dtypes[0] == cdt and ctx.operand_dtypes[1] == cdt:
        # A plain matrix product: np.matmul of the operands or their transposed views (the
        # same views the general path below makes).
        lt = "" if lperm_t is None else ".T"
        rt = "" if rperm_t is None else ".T"

        def run2(ops: Sequence[Any]) -> np.ndarray:
            lhs = np.asarray(ops[0])
            rhs = np.asarray(ops[1])
            return matmul(lhs if lperm_t is None else lhs.T, rhs if rperm_t is None else rhs.T)

        def rows(ops: Sequence[Any], a: int, b: int, out: np.ndarray) -> np.ndarray:
            """Rows a:b of the product, into ``out`` (b - a by N): how a fused consumer
            computes it a block at a time instead of reading it whole (rewrites.py
            ``_dots_into_fused``)."""
            lhs = np.asarray(ops[0])
            rhs = np.asarray(ops[1])
            lhs = lhs if lperm_t is None else lhs.T
            return np.matmul(lhs[a:b], rhs if rperm_t is None else rhs.T, out=out)

        run2.rows = rows  # type: ignore[attr-defined]
        return inline(run2, f"{{m}}({{0}}{lt}, {{1}}{rt})", m=matmul)

    def run(ops: Sequence[Any]) -> np.ndarray:
        lhs = np.asarray(ops[0])
        rhs = np.asarray(ops[1])
        if lhs.dtype != cdt:
            lhs = lhs.astype(cdt)
        if rhs.dtype != cdt:
            rhs = rhs.astype(cdt)
        if lperm_t is not None:
            lhs = lhs.transpose(lperm_t)
        if rperm_t is not None:
            rhs = rhs.transpose(rperm_t)
        if two_d:
            out = matmul(lhs.reshape(M, K), rhs.reshape(K, N))
        else:
            out = matmul(lhs.reshape(lhs3), rhs.reshape(rhs3))
        out = out.reshape(out_shape)
        return out if out.dtype == out_dt else out.astype(out_dt)

    return run
