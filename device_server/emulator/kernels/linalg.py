"""Matrix kernels: ``cholesky``, ``triangular-solve`` and ``topk``.

Every dimension but the two minor ones (the last one for ``topk``) is a batch dimension.
Floating-point arithmetic runs in float64 (complex128 for complex types) and is rounded once
to the result type; the loops over a matrix's rows or columns are vectorized over the batch
and the right-hand sides.

Attributes read (names as written by ``tf_ipu.lowering.hlo_to_ir``, see ``docs/ir.md``):

- cholesky: ``lower`` (flag). Operand ``(a)``.
- triangular-solve: ``left_side``, ``lower``, ``unit_diagonal`` (flags), ``transpose_a`` (s:
  ``NO_TRANSPOSE``, ``TRANSPOSE`` or ``ADJOINT``). Operands ``(a, b)``.
- topk: ``k`` (i), ``largest`` (flag). Operand ``(x)``; result ``(values, indices)``.

**cholesky** reads only the named triangle of each matrix and returns the factor in that
triangle, zeros in the other. Column ``j`` has the pivot ``p = a_jj - sum_k |l_jk|^2``; then
``l_jj = p * rsqrt(p)`` and the entries below are scaled by ``rsqrt(p)``. XLA leaves the
result for a matrix that is not positive definite implementation-defined; the kernel returns
what XLA's CPU backend returns (measured with TF 2.21): a matrix with a negative or NaN pivot
comes out all NaN, while a zero or +inf pivot gives a NaN on that diagonal entry only (and
whatever follows from it in later columns).

**triangular-solve** solves ``op(a) x = b`` (``left_side``) or ``x op(a) = b``, reading only
the named triangle of ``a`` (not its diagonal with ``unit_diagonal``). Every case is turned
into a forward substitution with a lower-triangular matrix whose rows are divided by their
diagonal entries. The ratio ``d/d`` is kept as a factor, so a zero (or infinite) diagonal
entry gives NaN from its row on, in the order of the substitution. XLA's CPU backend also
gives NaN there (it inverts 128-row diagonal blocks after dividing their columns by the
diagonal). Its block inverse spreads the NaN further, to every row of that block but the
first. For batches of more than 8 matrices smaller than 32 it substitutes directly and gives
+-inf where the emulator gives NaN. Both cases are outside the operation semantics (a
singular triangle).

**topk** returns the ``k`` largest (``largest``) or smallest elements of each row, in that
order, with their positions (``s32``); equal elements come lowest position first, and floats
are ordered by XLA's total order (``-NaN < -inf < ... < +inf < +NaN``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator.kernels import KernelContext, KernelFn, register
from device_server.emulator.kernels.elementwise import total_order_key
from device_server.emulator.kernels.window import attr_int, invalid
from device_server.protocol import dtypes

_TRANSPOSES = ("NO_TRANSPOSE", "TRANSPOSE", "ADJOINT")


def _float_dtype(ctx: KernelContext, what: str, dt: np.dtype | None) -> np.dtype:
    """The compute dtype for a float or complex operand (float64 / complex128)."""
    if dt is None or not (dt.kind in "fc" or dt.name == "bfloat16"):
        raise invalid(ctx, f"{what} must be a floating-point or complex array, got {dt}.")
    return np.dtype(np.complex128) if dt.kind == "c" else np.dtype(np.float64)


def _operand_count(ctx: KernelContext, n: int, names: str) -> None:
    if len(ctx.operand_shapes) != n:
        raise invalid(ctx, f"expected {n} operand(s) ({names}), got {len(ctx.operand_shapes)}.")


def _square(ctx: KernelContext, shape: tuple[int, ...], what: str) -> int:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise invalid(ctx, f"{what} must be a batch of square matrices [..., m, m], got {list(shape)}.")
    return shape[-1]


def _triangle_mask(m: int, lower: bool) -> np.ndarray:
    rows = np.arange(m)[:, None]
    cols = np.arange(m)[None, :]
    return rows >= cols if lower else rows <= cols


# ---------------------------------------------------------------------------------- cholesky


@register("cholesky")
def cholesky(ctx: KernelContext) -> KernelFn:
    """XLA Cholesky: ``a = l l^H`` (``lower``) or ``a = u^H u`` for a batch of matrices."""
    _operand_count(ctx, 1, "a")
    shape = tuple(ctx.operand_shapes[0])
    n = _square(ctx, shape, "the operand")
    if tuple(ctx.out_shape) != shape or ctx.out_dtype != ctx.operand_dtypes[0]:
        raise invalid(ctx, f"result {ctx.out_dtype}{list(ctx.out_shape)} must match the operand "
                      f"{ctx.operand_dtypes[0]}{list(shape)}.")
    cdt = _float_dtype(ctx, "the operand", ctx.operand_dtypes[0])
    out_dt = ctx.out_dtype
    lower = bool(ctx.attr("lower", False))
    keep = _triangle_mask(n, lower)
    complex_ = cdt.kind == "c"

    def run(ops: Sequence[Any]) -> np.ndarray:
        a = np.where(keep, np.asarray(ops[0]).astype(cdt), 0)
        if not lower:  # the upper triangle, as the lower triangle of the Hermitian matrix
            a = np.swapaxes(a, -1, -2)
            if complex_:
                a = np.conj(a)
        factor = np.zeros(a.shape, cdt)
        failed = np.zeros(shape[:-2], bool)
        for j in range(n):
            row = factor[..., j, :j]
            pivot = np.real(a[..., j, j]) - np.sum(np.abs(row) ** 2, axis=-1)
            failed |= ~(pivot >= 0)  # negative or NaN
            scale = 1.0 / np.sqrt(pivot)
            factor[..., j, j] = pivot * scale
            if j + 1 < n:
                below = a[..., j + 1:, j] - (factor[..., j + 1:, :j] @ np.conj(row)[..., :, None])[..., 0]
                factor[..., j + 1:, j] = below * scale[..., None]
        factor[failed] = np.nan
        if not lower:
            factor = np.swapaxes(factor, -1, -2)
            if complex_:
                factor = np.conj(factor)
        return np.ascontiguousarray(factor).astype(out_dt, copy=False)

    return run


# -------------------------------------------------------------------------- triangular-solve


def _forward_substitution(lower_t: np.ndarray, rhs: np.ndarray, unit: bool) -> np.ndarray:
    """``x`` with ``lower_t x = rhs`` for lower-triangular ``lower_t`` ([..., m, m]) and
    ``rhs`` ([..., m, n]). Without ``unit`` the rows are divided by the diagonal first and the
    ratio ``d/d`` (1, or NaN for a zero or infinite ``d``) multiplies each row of ``x``."""
    m = lower_t.shape[-1]
    if unit:
        scaled, c, ratio = lower_t, rhs, None
    else:
        d = np.diagonal(lower_t, axis1=-2, axis2=-1)[..., :, None]
        scaled = lower_t / d
        c = rhs / d
        ratio = d / d
    x = np.empty(c.shape, c.dtype)
    for i in range(m):
        acc = c[..., i, :]
        if i:
            acc = acc - (scaled[..., i:i + 1, :i] @ x[..., :i, :])[..., 0, :]
        x[..., i, :] = acc if ratio is None else acc * ratio[..., i, :]
    return x


@register("triangular-solve")
def triangular_solve(ctx: KernelContext) -> KernelFn:
    """XLA TriangularSolve: ``op(a) x = b`` or ``x op(a) = b`` with triangular ``a``."""
    _operand_count(ctx, 2, "a, b")
    a_shape, b_shape = tuple(ctx.operand_shapes[0]), tuple(ctx.operand_shapes[1])
    m = _square(ctx, a_shape, "a")
    left = bool(ctx.attr("left_side", False))
    lower = bool(ctx.attr("lower", False))
    unit = bool(ctx.attr("unit_diagonal", False))
    transpose = str(ctx.attr("transpose_a"))
    if transpose not in _TRANSPOSES:
        raise invalid(ctx, f"transpose_a must be one of {', '.join(_TRANSPOSES)}, got {transpose!r}.")
    if len(b_shape) != len(a_shape) or b_shape[:-2] != a_shape[:-2] \
            or b_shape[-2 if left else -1] != m:
        want = "[..., m, k]" if left else "[..., k, m]"
        raise invalid(ctx, f"b {list(b_shape)} must be {want} with the batch dimensions of a "
                      f"{list(a_shape)}.")
    if ctx.operand_dtypes[0] != ctx.operand_dtypes[1] or ctx.out_dtype != ctx.operand_dtypes[1] \
            or tuple(ctx.out_shape) != b_shape:
        raise invalid(ctx, f"a {ctx.operand_dtypes[0]}, b {ctx.operand_dtypes[1]}{list(b_shape)} and the "
                      f"result {ctx.out_dtype}{list(ctx.out_shape)} must share the element type; the "
                      "result has b's shape.")
    cdt = _float_dtype(ctx, "a", ctx.operand_dtypes[0])
    out_dt = ctx.out_dtype
    keep = _triangle_mask(m, lower)
    # Turn op(a) into the matrix of a left-side solve, and that into a lower-triangular one.
    transposed = transpose != "NO_TRANSPOSE"
    conjugate = transpose == "ADJOINT" and cdt.kind == "c"
    if not left:  # x op(a) = b  <=>  op(a)^T x^T = b^T
        transposed = not transposed
    is_lower = lower != transposed
    flip = not is_lower  # an upper-triangular system, solved backwards

    def run(ops: Sequence[Any]) -> np.ndarray:
        t = np.where(keep, np.asarray(ops[0]).astype(cdt), 0)
        if unit:
            idx = np.arange(m)
            t[..., idx, idx] = 1
        if transposed:
            t = np.swapaxes(t, -1, -2)
        if conjugate:
            t = np.conj(t)
        rhs = np.asarray(ops[1]).astype(cdt)
        if not left:
            rhs = np.swapaxes(rhs, -1, -2)
        if flip:
            t = t[..., ::-1, ::-1]
            rhs = rhs[..., ::-1, :]
        x = _forward_substitution(t, rhs, unit)
        if flip:
            x = x[..., ::-1, :]
        if not left:
            x = np.swapaxes(x, -1, -2)
        return np.ascontiguousarray(x).astype(out_dt, copy=False)

    return run


# -------------------------------------------------------------------------------------- topk


@register("topk")
def topk(ctx: KernelContext) -> KernelFn:
    """XLA TopK: the ``k`` largest (or smallest) entries of each row and their positions."""
    _operand_count(ctx, 1, "x")
    shape = tuple(ctx.operand_shapes[0])
    dt = ctx.operand_dtypes[0]
    if not shape or dt is None:
        raise invalid(ctx, f"the operand must be an array of at least one dimension, got {list(shape)}.")
    k = attr_int(ctx, "k")
    largest = bool(ctx.attr("largest", False))
    if not 0 <= k <= shape[-1]:
        raise invalid(ctx, f"k = {k} is not within the last dimension of {list(shape)}.")
    out = ctx.instr.shape
    want = shape[:-1] + (k,)
    if not out.is_tuple or len(out.tuple_shapes) != 2 \
            or any(tuple(s.dims) != want for s in out.tuple_shapes):
        raise invalid(ctx, f"the result must be a tuple (values, indices) of shape {list(want)}.")
    value_dt = dtypes.to_numpy(out.tuple_shapes[0].dtype)
    index_dt = dtypes.to_numpy(out.tuple_shapes[1].dtype)
    if value_dt != dt or index_dt.kind not in "iu":
        raise invalid(ctx, f"the result must be ({dt} values, integer indices), got "
                      f"({value_dt}, {index_dt}).")

    floating = dt.kind == "f" or dt.name == "bfloat16"
    if dt.kind not in "fiub" and not floating:
        raise invalid(ctx, f"topk needs a real or integer operand, got {dt}.")

    def run(ops: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(ops[0])
        key = total_order_key(x, dt) if floating else x.astype(np.int8) if dt == np.bool_ else x
        if largest:
            key = np.invert(key)
        order = np.argsort(key, axis=-1, kind="stable")[..., :k]
        return np.take_along_axis(x, order, axis=-1), order.astype(index_dt)

    return run
