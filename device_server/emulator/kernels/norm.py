"""Batch normalization: ``batch-norm-training``, ``batch-norm-inference``, ``batch-norm-grad``.

For each feature (index ``i`` along dimension ``feature_index`` of the operand) the moments
are taken over every other dimension (``N`` elements per feature). Following XLA's operation
semantics:

- training ``(x, scale, offset)`` -> ``(y, mean, var)``: ``mean = sum(x) / N``,
  ``var = sum((x - mean)^2) / N`` (biased), ``y = (x - mean) * scale / sqrt(var + eps) + offset``;
- inference ``(x, scale, offset, mean, var)`` -> ``y``, the same normalization with the given
  moments;
- grad ``(x, scale, mean, var, dy)`` -> ``(dx, dscale, doffset)``: ``doffset = sum(dy)``,
  ``dscale = sum(dy (x - mean)) / sqrt(var + eps)``,
  ``dx = scale / sqrt(var + eps) * (dy - doffset / N - (x - mean) sum(dy (x - mean)) / (N (var + eps)))``.

Attributes: ``epsilon`` (f), ``feature_index`` (i). Everything is computed in float64 and the
moments in two passes, then rounded once to the result types. XLA's CPU backend expands these
ops with one-pass moments in the operand's type (``var = E[x^2] - E[x]^2``), which loses digits
when ``|mean|`` is large against the spread; the emulator gives the exact moments there. With
``N = 0`` the moments are NaN (0/0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator.kernels import KernelContext, KernelFn, register
from device_server.emulator.kernels.window import attr_int, invalid
from device_server.protocol import dtypes

_F64 = np.dtype(np.float64)

# opcode -> (operand names, number of per-feature vector operands after the first)
_SIGNATURES = {
    "batch-norm-training": ("operand, scale, offset", 2),
    "batch-norm-inference": ("operand, scale, offset, mean, variance", 4),
    "batch-norm-grad": ("operand, scale, mean, variance, grad_output", 3),
}


class _Plan:
    """Shapes and attributes shared by the three batch-norm kernels."""

    def __init__(self, ctx: KernelContext) -> None:
        op = ctx.instr.opcode
        names, vectors = _SIGNATURES[op]
        n_ops = vectors + 1 + (op == "batch-norm-grad")
        if len(ctx.operand_shapes) != n_ops:
            raise invalid(ctx, f"expected {n_ops} operands ({names}), got {len(ctx.operand_shapes)}.")
        self.shape = tuple(ctx.operand_shapes[0])
        rank = len(self.shape)
        self.dtype = ctx.operand_dtypes[0]
        if self.dtype is None or not (self.dtype.kind == "f" or self.dtype.name == "bfloat16"):
            raise invalid(ctx, f"the operand must be a floating-point array, got {self.dtype}.")
        self.feature = attr_int(ctx, "feature_index")
        if not 0 <= self.feature < rank:
            raise invalid(ctx, f"feature_index {self.feature} is not a dimension of the operand "
                          f"{list(self.shape)}.")
        self.features = self.shape[self.feature]
        for k in range(1, vectors + 1):
            if tuple(ctx.operand_shapes[k]) != (self.features,):
                raise invalid(ctx, f"operand {k} must have shape [{self.features}] (one value per "
                              f"feature), got {list(ctx.operand_shapes[k])}.")
        if op == "batch-norm-grad" and tuple(ctx.operand_shapes[4]) != self.shape:
            raise invalid(ctx, f"grad_output {list(ctx.operand_shapes[4])} must have the operand's "
                          f"shape {list(self.shape)}.")
        self.epsilon = float(ctx.attr("epsilon"))
        self.axes = tuple(d for d in range(rank) if d != self.feature)
        self.count = int(np.prod([self.shape[d] for d in self.axes], dtype=np.int64))
        self.bshape = tuple(self.features if d == self.feature else 1 for d in range(rank))
        out = ctx.instr.shape
        leaves = list(out.tuple_shapes) if out.is_tuple else [out]
        vector = (self.features,)
        want = [self.shape] if op == "batch-norm-inference" else [self.shape, vector, vector]
        if out.is_tuple == (op == "batch-norm-inference") or [tuple(s.dims) for s in leaves] != want:
            shown = "an array" if op == "batch-norm-inference" else "a tuple"
            raise invalid(ctx, f"the result must be {shown} of shape(s) {[list(w) for w in want]}.")
        self.out_dtypes = [dtypes.to_numpy(s.dtype) for s in leaves]

    def column(self, v: Any) -> np.ndarray:
        """A per-feature vector in float64, shaped to broadcast along the feature dimension."""
        return np.asarray(v).astype(_F64).reshape(self.bshape)

    def sum(self, x: np.ndarray) -> np.ndarray:
        return np.add.reduce(x, axis=self.axes)


@register("batch-norm-training")
def batch_norm_training(ctx: KernelContext) -> KernelFn:
    """(normalized operand, batch mean, biased batch variance)."""
    p = _Plan(ctx)
    y_dt, mean_dt, var_dt = p.out_dtypes

    def run(ops: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.asarray(ops[0]).astype(_F64)
        mean = p.sum(x) / p.count
        centered = x - mean.reshape(p.bshape)
        var = p.sum(centered * centered) / p.count
        factor = p.column(ops[1]) / np.sqrt(var.reshape(p.bshape) + p.epsilon)
        y = centered * factor + p.column(ops[2])
        return y.astype(y_dt), mean.astype(mean_dt), var.astype(var_dt)

    return run


@register("batch-norm-inference")
def batch_norm_inference(ctx: KernelContext) -> KernelFn:
    """The operand normalized with the given mean and variance."""
    p = _Plan(ctx)
    y_dt = p.out_dtypes[0]

    def run(ops: Sequence[Any]) -> np.ndarray:
        x = np.asarray(ops[0]).astype(_F64)
        factor = p.column(ops[1]) / np.sqrt(p.column(ops[4]) + p.epsilon)
        return ((x - p.column(ops[3])) * factor + p.column(ops[2])).astype(y_dt)

    return run


@register("batch-norm-grad")
def batch_norm_grad(ctx: KernelContext) -> KernelFn:
    """(gradient of the operand, of the scale, of the offset)."""
    p = _Plan(ctx)
    dx_dt, dscale_dt, doffset_dt = p.out_dtypes

    def run(ops: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.asarray(ops[0]).astype(_F64)
        dy = np.asarray(ops[4]).astype(_F64)
        var_eps = p.column(ops[3]) + p.epsilon
        rstd = 1.0 / np.sqrt(var_eps)
        centered = x - p.column(ops[2])
        sum_dy = p.sum(dy)
        sum_dy_centered = p.sum(dy * centered)
        dscale = sum_dy_centered * rstd.reshape(-1)
        correction = sum_dy.reshape(p.bshape) + centered * (sum_dy_centered.reshape(p.bshape) / var_eps)
        inner = dy - correction / p.count
        dx = p.column(ops[1]) * rstd * inner
        return dx.astype(dx_dt), dscale.astype(dscale_dt), sum_dy.astype(doffset_dt)

    return run
