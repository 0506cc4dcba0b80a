"""``custom-call`` targets of XLA's linear algebra: ``Qr``,
``ProductOfElementaryHouseholderReflectors`` and ``Eigh``.

XLA's builder library (and so tf2xla) emits these three custom calls, and every XLA backend
either implements them or expands them (the CPU backend: ``QrExpander``, ``EighExpander``).
Their meaning is public and fixed: the first two are LAPACK's ``geqrf`` and ``orgqr``
(``ungqr`` for complex types), the third the symmetric/Hermitian eigendecomposition of LAPACK's
``syevd``/``heevd``. Every dimension but the two minor ones is a batch dimension. Arithmetic runs
in float64 (complex128 for complex types) and is rounded once to the result type.

Operands, results and attributes (as written by ``tf_ipu.lowering.hlo_to_ir``, ``docs/ir.md``):

- ``Qr``: operand ``a [..., m, n]``; result ``(a', taus)`` with ``a' [..., m, n]`` and
  ``taus [..., min(m, n)]``, both of a's type. ``a'`` holds ``R`` on and above the diagonal and
  the Householder vectors ``v_i`` below it (``v_i[i] = 1`` implicit, ``v_i[:i] = 0``), such that
  ``a = H_0 H_1 ... H_{k-1} R`` with ``H_i = I - tau_i v_i v_i^H``. The reflectors follow
  LAPACK's ``larfg``: ``beta = -sign(re(alpha)) * ||(alpha, x)||`` (sign(0) = +1), so ``R``'s
  diagonal is real; a column already zero below the diagonal (with a real diagonal entry) gets
  ``tau = 0``. XLA's CPU expansion gives the same reflectors (checked against TF 2.21).
- ``ProductOfElementaryHouseholderReflectors``: operands ``(a [..., m, n], taus [..., k])``
  with ``m >= n >= k``; result ``Q [..., m, n]`` (a's type), the first ``n`` columns of
  ``H_0 H_1 ... H_{k-1}``, the ``v_i`` read from below the diagonal of a's first ``k`` columns
  (the rest of ``a`` is ignored). It is computed as in ``orgqr``: the identity's columns, with
  the reflectors applied from the last to the first.
- ``Eigh``: operand ``a [..., n, n]``; result ``(v, w)``: eigenvectors ``v [..., n, n]``
  (columns, a's type) and eigenvalues ``w [..., n]`` (the real type of a's). Attribute
  ``backend_config`` (b): the ASCII text ``lower,sort_eigenvalues,max_iter,tol`` of XLA's
  builder (e.g. ``1,1,4,0.000001``). Only the ``lower`` (1) or upper (0) triangle is read; for
  complex types the diagonal's imaginary part is ignored. Eigenvalues come in ascending order,
  with or without ``sort_eigenvalues`` (without it XLA's order is unspecified). ``max_iter``
  and ``tol`` tune XLA's Jacobi iteration; the emulator solves to float64 accuracy and only
  checks that they parse. Eigenvectors are unique only up to a sign (a phase for complex
  types), and within a repeated eigenvalue up to a rotation; the emulator's choice (LAPACK's)
  need not be XLA's. A matrix with a non-finite entry in the read triangle gives NaN
  eigenvalues and eigenvectors (XLA's Jacobi iteration returns unconverged values there; the
  operation semantics say nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator.kernels import KernelContext, KernelFn, register_custom_call
from device_server.emulator.kernels.window import invalid
from device_server.protocol import dtypes, ir_pb2


def _compute_dtype(ctx: KernelContext, dt: np.dtype | None) -> np.dtype:
    """float64 / complex128 for a floating-point or complex operand."""
    if dt is None or not (dt.kind in "fc" or dt.name == "bfloat16"):
        raise invalid(ctx, f"the operand must be a floating-point or complex array, got {dt}.")
    return np.dtype(np.complex128) if dt.kind == "c" else np.dtype(np.float64)


def _real_dtype(dt: np.dtype) -> np.dtype:
    return np.dtype(np.float32 if dt == np.complex64 else np.float64) if dt.kind == "c" else dt


def _operands(ctx: KernelContext, n: int, names: str) -> None:
    if len(ctx.operand_shapes) != n:
        raise invalid(ctx, f"expected {n} operand(s) ({names}), got {len(ctx.operand_shapes)}.")


def _tuple_result(ctx: KernelContext, want: Sequence[tuple[np.dtype, tuple[int, ...]]], names: str) -> None:
    out = ctx.instr.shape
    got = [] if not out.is_tuple else [
        (None if s.is_tuple or s.dtype == ir_pb2.TOKEN else dtypes.to_numpy(s.dtype), tuple(s.dims))
        for s in out.tuple_shapes
    ]
    if got != list(want):
        spelled = ", ".join(f"{dt}{list(shape)}" for dt, shape in want)
        raise invalid(ctx, f"the result must be a tuple ({names}) = ({spelled}).")


# ------------------------------------------------------------------------------------------ Qr


@register_custom_call("Qr")
def qr(ctx: KernelContext) -> KernelFn:
    """Householder QR in LAPACK ``geqrf`` form: ``(R and the reflectors, taus)``."""
    _operands(ctx, 1, "a")
    shape = tuple(ctx.operand_shapes[0])
    dt = ctx.operand_dtypes[0]
    if len(shape) < 2:
        raise invalid(ctx, f"the operand must be a batch of matrices [..., m, n], got {list(shape)}.")
    cdt = _compute_dtype(ctx, dt)
    m, n = shape[-2:]
    k = min(m, n)
    _tuple_result(ctx, [(dt, shape), (dt, shape[:-2] + (k,))], "a', taus")

    def run(ops: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        a = np.asarray(ops[0]).astype(cdt)
        if a.size == 0:
            return a.astype(dt), np.zeros(shape[:-2] + (k,), dt)
        # numpy's "raw" mode is geqrf's output, in LAPACK's column-major order: [..., n, m].
        h, tau = np.linalg.qr(a, mode="raw")
        return np.ascontiguousarray(np.swapaxes(h, -1, -2)).astype(dt), tau.astype(dt)

    return run


# ---------------------------------------------------------- ProductOfElementaryHouseholderReflectors


@register_custom_call("ProductOfElementaryHouseholderReflectors")
def householder_product(ctx: KernelContext) -> KernelFn:
    """LAPACK ``orgqr``: the first ``n`` columns of ``H_0 H_1 ... H_{k-1}``."""
    _operands(ctx, 2, "a, taus")
    a_shape, t_shape = tuple(ctx.operand_shapes[0]), tuple(ctx.operand_shapes[1])
    dt = ctx.operand_dtypes[0]
    if len(a_shape) < 2 or len(t_shape) != len(a_shape) - 1 or t_shape[:-1] != a_shape[:-2]:
        raise invalid(ctx, f"operands must be a [..., m, n] and taus [..., k] with the same batch "
                      f"dimensions, got {list(a_shape)} and {list(t_shape)}.")
    m, n = a_shape[-2:]
    k = t_shape[-1]
    if not m >= n >= k:
        raise invalid(ctx, f"needs m >= n >= k, got m = {m}, n = {n}, k = {k}.")
    if ctx.operand_dtypes[1] != dt or ctx.out_dtype != dt or tuple(ctx.out_shape) != a_shape:
        raise invalid(ctx, f"a {dt}, taus {ctx.operand_dtypes[1]} and the result "
                      f"{ctx.out_dtype}{list(ctx.out_shape)} must share the element type; the "
                      "result has a's shape.")
    cdt = _compute_dtype(ctx, dt)
    batch = a_shape[:-2]

    def run(ops: Sequence[Any]) -> np.ndarray:
        a = np.asarray(ops[0]).astype(cdt)
        taus = np.asarray(ops[1]).astype(cdt)
        q = np.zeros(batch + (m, n), cdt)
        idx = np.arange(n)
        q[..., idx, idx] = 1
        for i in range(k - 1, -1, -1):
            # Columns before i are still e_j, which H_i (v_i[:i] = 0) leaves alone.
            v = a[..., i:, i].copy()
            v[..., 0] = 1
            block = q[..., i:, i:]
            w = (np.conj(v)[..., None, :] @ block)[..., 0, :]  # v^H Q
            block -= taus[..., i, None, None] * v[..., :, None] * w[..., None, :]
        return q.astype(dt)

    return run


# ---------------------------------------------------------------------------------------- Eigh


def _eigh_config(ctx: KernelContext) -> tuple[bool, bool]:
    """(lower, sort_eigenvalues) from ``backend_config`` = ``lower,sort,max_iter,tol``."""
    raw = ctx.attr("backend_config", None)
    if raw is None:
        raise invalid(ctx, "Eigh needs backend_config 'lower,sort_eigenvalues,max_iter,tol'.")
    try:
        text = raw.decode("ascii") if isinstance(raw, bytes) else str(raw)
        fields = text.split(",")
        if len(fields) != 4:
            raise ValueError(f"{len(fields)} fields")
        lower, sort, max_iter = (int(f) for f in fields[:3])
        tol = float(fields[3])
        if lower not in (0, 1) or sort not in (0, 1) or max_iter < 0 or not tol >= 0:
            raise ValueError("out of range")
    except (UnicodeDecodeError, ValueError) as e:
        raise invalid(ctx, f"Eigh backend_config {raw!r} is not 'lower,sort_eigenvalues,max_iter,tol' "
                      f"({e}).") from None
    return bool(lower), bool(sort)


@register_custom_call("Eigh")
def eigh(ctx: KernelContext) -> KernelFn:
    """Eigendecomposition of symmetric / Hermitian matrices: ``(vectors, values)``."""
    _operands(ctx, 1, "a")
    shape = tuple(ctx.operand_shapes[0])
    dt = ctx.operand_dtypes[0]
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise invalid(ctx, f"the operand must be a batch of square matrices [..., n, n], got {list(shape)}.")
    cdt = _compute_dtype(ctx, dt)
    real_dt = _real_dtype(dt)
    _tuple_result(ctx, [(dt, shape), (real_dt, shape[:-1])], "vectors, values")
    lower, _sort = _eigh_config(ctx)  # numpy's eigenvalues are ascending either way
    n = shape[-1]
    rows, cols = np.arange(n)[:, None], np.arange(n)[None, :]
    read = rows >= cols if lower else rows <= cols

    def run(ops: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        a = np.asarray(ops[0]).astype(cdt)
        if a.size == 0:
            return a.astype(dt), np.zeros(shape[:-1], real_dt)
        bad = ~np.all(np.isfinite(np.where(read, a, 0)), axis=(-2, -1))
        if bad.any():
            a = np.where(bad[..., None, None], 0, a)
        w, v = np.linalg.eigh(a, UPLO="L" if lower else "U")
        if bad.any():
            w[bad] = np.nan
            v[bad] = np.nan
        return np.ascontiguousarray(v).astype(dt), w.astype(real_dt)

    return run
