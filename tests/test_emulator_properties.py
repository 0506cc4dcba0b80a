"""Property tests of the emulator's kernels against XLA, searched harder (issue 25, point 5).

``test_emulator_core.py`` checks the kernels on 15 float32 examples each, away from the edges
of the range. Here every test draws 200 examples (derandomized, so a run is repeatable; each
compiles its programs once and feeds them new values), the float ones in float32 *and*
float16, with subnormals, +-0, +-inf, NaN and values that overflow; ``dot_general``
dimension numbers and sort comparators are generated too, and integers go to their extremes.
``@example`` rows keep the regressions that these tests found (reduce-precision of FP16
subnormals and of NaN with 0 mantissa bits; the sort fast path's -0/+0 under a FLOAT
compare).

References (XLA on CPU, ``jit_compile=True``; :func:`emulator_util.widened_reference`):

- float32: XLA run on the arguments widened to float64, each result rounded once to float32.
  XLA's CPU backend runs float32 with denormals flushed to zero (subnormal arguments read as
  zero, subnormal results flushed: ``log(1e-40)`` is ``-inf`` there); the emulator keeps
  IEEE's gradual underflow (documented in ``device_server/emulator/__init__.py``), which the
  float64 run gives exactly.
- float16: XLA run on the arguments widened to float32, each float16 result rounded once
  (``float32_reference``). It stands for the IPU's FP16 arithmetic: FP16 inputs, FP32
  partials in reductions and matrix products, one rounding of the result. XLA's own FP16
  programs round according to the host's instruction set (AVX512-FP16 hosts compute in FP16),
  so they are no reference.
- Sorts and ``reduce-precision`` round nothing: XLA in the argument's own type, bit for bit.

Tolerances are stated per dtype in units in the last place of the result type ("ulps":
the distance between the two results in the float type's total order, so +-inf is one ulp
from the largest finite value and -0 one from +0) or as a bound derived from the number of
operations. NaN must match NaN everywhere.

``maximum``/``minimum`` (element-wise and in reductions) propagate NaN as XLA's semantics
say; XLA's CPU backend uses "fast" min/max that may drop a NaN, so its reference is replaced
by NaN where an operand is NaN (see ``test_maximum_minimum_propagate_nan``). The sign of a
zero they return is not compared: the emulator's is numpy's (float32 ``maximum(+0, -0)`` is
``-0`` with numpy's SIMD loops, ``+0`` in float16), XLA CPU returns the first operand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import emulator_util as eu
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensorflow.compiler.tf2xla.python import xla

from device_server.emulator import compile_module, get_target

HYP = settings(max_examples=200, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TARGET = get_target("ipu2")
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
BF16 = np.dtype(ml_dtypes.bfloat16)
U32 = 2.0**-24  # float32 unit roundoff: one rounding moves a value by at most U32 * |value|


# ------------------------------------------------------------------ strategies


def edge_floats(dtype: Any, lo: float, hi: float, *, nan: bool = True,
                infinities: bool = True) -> st.SearchStrategy[float]:
    """Elements of ``dtype`` in [lo, hi] (clipped to the finite range), mixed with
    subnormals, +-0, +-1, the extremes of the type (which overflow in most ops), +-inf and
    NaN."""
    dt = np.dtype(dtype)
    fi = np.finfo(dt)
    width = dt.itemsize * 8
    top = float(fi.max)
    lo, hi = float(dt.type(max(lo, -top))), float(dt.type(min(hi, top)))
    tiny = float(fi.smallest_normal)
    inside = st.floats(lo, hi, width=width)
    parts = [inside, inside, inside]
    if lo < tiny and hi > -tiny:  # subnormals (and zeros) inside the domain
        parts.append(st.floats(max(lo, -tiny), min(hi, tiny), width=width))
    specials = [0.0, -0.0, 1.0, -1.0, tiny, -tiny, float(fi.smallest_subnormal), top, -top, lo, hi]
    specials = [v for v in specials if lo <= v <= hi or abs(v) in (top, tiny)]
    if infinities:
        specials += [np.inf, -np.inf]
    if nan:
        specials.append(np.nan)
    parts.append(st.sampled_from(specials))
    return st.one_of(*parts)


def edge_arrays(dtype: Any, shape: tuple[int, ...], lo: float = -np.inf, hi: float = np.inf,
                **kw: Any) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.dtype(dtype), shape, elements=edge_floats(dtype, lo, hi, **kw))


# ------------------------------------------------------------------ comparisons


def order_key(x: np.ndarray) -> np.ndarray:
    """int64 keys in the float type's total order, consecutive for neighbouring values
    (-0 and +0 are one apart, the largest finite value and inf too)."""
    x = np.asarray(x)
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[x.dtype.itemsize]
    bits = x.view(ints).astype(np.int64)
    magnitude = bits & (2 ** (8 * x.dtype.itemsize - 1) - 1)
    return np.where(bits < 0, -magnitude - 1, magnitude)


def _report(what: str, bad: np.ndarray, got: np.ndarray, ref: np.ndarray, *inputs: np.ndarray) -> str:
    idx = np.argwhere(bad)[:5]
    lines = [f"{what}: {int(bad.sum())} of {bad.size} differ"]
    for i in idx:
        t = tuple(i)
        lines.append(f"  at {t}: got {got[t]!r}, expected {ref[t]!r}")
    for k, a in enumerate(inputs):
        lines.append(f"  input {k}: {np.array2string(np.asarray(a), precision=9, threshold=64)}")
    return "\n".join(lines)


def assert_ulps(got: np.ndarray, ref: np.ndarray, ulps: int, *, atol: float = 0.0,
                zero_sign: bool = True, what: str = "", inputs: Sequence[np.ndarray] = ()) -> None:
    """Same dtype and shape; NaN exactly where ``ref`` is NaN; elsewhere at most ``ulps``
    apart in the type's total order (or within ``atol``). ``zero_sign=False``: -0 equals +0."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, ref.dtype, got.shape, ref.shape)
    if ref.dtype.kind not in "fV":
        bad = got != ref
        assert not bad.any(), _report(what, bad, got, ref, *inputs)
        return
    gn, rn = np.isnan(got), np.isnan(ref)
    g, r = got, ref
    if not zero_sign:
        g, r = np.where(g == 0, np.zeros((), g.dtype), g), np.where(r == 0, np.zeros((), r.dtype), r)
    dist = np.abs(order_key(g) - order_key(r))
    with np.errstate(invalid="ignore", over="ignore"):
        near = np.abs(g.astype(F64) - r.astype(F64)) <= atol
    bad = (gn != rn) | (~rn & ~gn & (dist > ulps) & ~near)
    assert not bad.any(), _report(what, bad, got, ref, *inputs)


def assert_within(got: np.ndarray, ref: np.ndarray, bound: np.ndarray, *, skip: np.ndarray | None = None,
                  what: str = "", inputs: Sequence[np.ndarray] = ()) -> None:
    """|got - ref| <= bound (elementwise, in float64), NaN exactly where ``ref`` is NaN,
    infinities as the next power of two beyond the type's largest value (so an overflow
    differs from the largest finite value by one ulp); ``skip`` marks results not compared."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, ref.dtype)
    beyond = 2.0 ** (np.finfo(ref.dtype).maxexp)

    def wide(a: np.ndarray) -> np.ndarray:
        a = a.astype(F64)
        return np.where(np.isinf(a), np.copysign(beyond, a), a)

    gn, rn = np.isnan(got), np.isnan(ref)
    both_inf = np.isinf(got) & np.isinf(ref) & (np.sign(got.astype(F64)) == np.sign(ref.astype(F64)))
    with np.errstate(invalid="ignore"):
        ok = both_inf | (np.abs(wide(got) - wide(ref)) <= bound)
    bad = (gn != rn) | (~gn & ~rn & ~ok)
    if skip is not None:
        bad &= ~skip
    assert not bad.any(), _report(what, bad, got, ref, *inputs)


def spacing(x: np.ndarray, dtype: Any) -> np.ndarray:
    """One ulp of |x| in ``dtype`` (of the largest finite value for infinities), in float64."""
    dt = np.dtype(dtype)
    fi = np.finfo(dt)
    with np.errstate(invalid="ignore", over="ignore"):
        below_top = float(np.nextafter(fi.max, dt.type(0)))  # same binade, finite spacing
        a = np.nan_to_num(np.abs(np.asarray(x, F64)), nan=0.0, posinf=below_top)
        return np.spacing(np.minimum(a, below_top).astype(dt)).astype(F64)


# ------------------------------------------------------------------ one program, two dtypes


class Wide:
    """``fn`` lowered once for the example arguments' signature and compiled once; each
    :meth:`run` gives the emulator's outputs and the widened XLA reference
    (:func:`emulator_util.widened_reference`) for new values."""

    def __init__(self, fn: Callable[..., Any], *example_args: np.ndarray) -> None:
        self.fn = tf.function(fn, jit_compile=True, autograph=False)
        self.module = eu.hlo_module_to_ir(eu.hlo_of(self.fn, *example_args))
        self.exe = compile_module(self.module, TARGET)

    @property
    def opcodes(self) -> set[str]:
        return {i.opcode for c in self.module.computations for i in c.instructions}

    def run(self, *args: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        got = self.exe.run([np.asarray(a, order="C") for a in args])
        return got, eu.widened_reference(self.fn, args, got)


# ------------------------------------------------------------------ element-wise, unary

# name -> (fn, opcode, ulps in float32, ulps in float16); see test_unary_edges.
UNARY: dict[str, tuple[Callable[..., Any], str, int, int]] = {
    "abs": (tf.abs, "abs", 0, 0),
    "negate": (tf.negative, "negate", 0, 0),
    "sqrt": (tf.sqrt, "sqrt", 0, 0),
    "rsqrt": (tf.math.rsqrt, "rsqrt", 2, 1),
    "log": (tf.math.log, "log", 4, 1),
    "log1p": (tf.math.log1p, "log-plus-one", 4, 1),
    "floor": (tf.floor, "floor", 0, 0),
    "ceil": (tf.math.ceil, "ceil", 0, 0),
    "round": (tf.round, "round-nearest-even", 0, 0),
    "sign": (tf.sign, "sign", 0, 0),
    "is_finite": (tf.math.is_finite, "is-finite", 0, 0),
    "exp": (tf.exp, "exponential", 4, 1),
    "expm1": (tf.math.expm1, "exponential-minus-one", 4, 1),
    "sigmoid": (tf.math.sigmoid, "logistic", 4, 1),
    "tanh": (tf.tanh, "tanh", 4, 1),
    "erf": (tf.math.erf, "erf", 4, 1),
    "sin": (tf.sin, "sine", 4, 1),
    "cos": (tf.cos, "cosine", 4, 1),
    "tan": (tf.math.tan, "tan", 4, 1),
}
# Ops grouped by the domain their finite arguments are drawn from (every group also gets
# subnormals, +-0, +-1, the extremes of the type, +-inf and NaN).
UNARY_GROUPS = {
    "whole_range": ((-np.inf, np.inf), ["abs", "negate", "sqrt", "rsqrt", "log", "log1p", "floor",
                                        "ceil", "round", "sign", "is_finite"]),
    "exponential": ((-120.0, 120.0), ["exp", "expm1", "sigmoid", "tanh", "erf", "log1p"]),
    "periodic": ((-1e4, 1e4), ["sin", "cos", "tan"]),
}


@pytest.mark.parametrize("group", list(UNARY_GROUPS))
def test_unary_edges(group: str) -> None:
    """Element-wise unary ops in FP32 and FP16 over a domain and at its edges: subnormal
    arguments and results (kept, as IEEE says), +-0, +-inf, NaN, overflow to inf. The IPU
    computes FP16 element-wise ops from FP16 inputs and rounds each result once. 200 examples
    of 16 elements per dtype, every op of the group on each.

    Tolerance, float32: 0 ulps for the exact and correctly rounded ops (abs, negate, sqrt,
    floor, ceil, round, sign); 4 ulps for the transcendental ones (numpy's SIMD float32
    kernels are within 4 ulps of the correctly rounded result; the float64 reference is
    correctly rounded but for rare double roundings); rsqrt 2 (a division of a rounded
    sqrt). float16: 0 ulps for the correctly rounded ops (an FP16 result computed in FP32 and
    rounded once is correctly rounded for these: 24 >= 2 * 11 + 2 bits); 1 ulp for the
    others, whose FP32 value (emulator: numpy's, reference: XLA's) may lie on either side of
    an FP16 rounding boundary. Measured on the development host: at most 2 float32 ulps
    (exp, sigmoid, tan), 1 float16 ulp (erf)."""
    domain, names = UNARY_GROUPS[group]
    ops = [UNARY[n] for n in names]
    w = Wide(lambda a, b: [f(a) for f, *_ in ops] + [f(b) for f, *_ in ops],
             np.zeros(16, F32), np.zeros(16, F16))
    assert {op[1] for op in ops} <= w.opcodes

    @HYP
    @given(edge_arrays(F32, (16,), *domain), edge_arrays(F16, (16,), *domain))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        got, ref = w.run(a, b)
        n = len(ops)
        for k, (name, (_, _, ulps32, ulps16)) in enumerate(zip(names, ops, strict=True)):
            assert_ulps(got[k], ref[k], ulps32, what=f"{name} float32", inputs=[a])
            assert_ulps(got[n + k], ref[n + k], ulps16, what=f"{name} float16", inputs=[b])

    prop()


# ------------------------------------------------------------------ element-wise, binary

# name -> (fn, opcode, ulps in float32, ulps in float16); see test_binary_edges.
BINARY: dict[str, tuple[Callable[..., Any], str, int, int]] = {
    "add": (tf.add, "add", 0, 0),
    "subtract": (tf.subtract, "subtract", 0, 0),
    "multiply": (tf.multiply, "multiply", 0, 0),
    "divide": (tf.math.divide, "divide", 0, 0),
    "truncatemod": (tf.truncatemod, "remainder", 0, 0),
    "floormod": (tf.math.floormod, "remainder", 0, 0),
    "maximum": (tf.maximum, "maximum", 0, 0),
    "minimum": (tf.minimum, "minimum", 0, 0),
    "pow": (tf.pow, "power", 4, 1),
    "atan2": (tf.math.atan2, "atan2", 4, 1),
}


def test_binary_edges() -> None:
    """Element-wise binary ops in FP32 and FP16 over the whole range: subnormal operands and
    results, overflow to +-inf (a sum or product beyond the type's range), division by zero
    and by subnormals, inf - inf, 0 * inf, NaN. 200 examples of 12 pairs per dtype.

    Tolerance, both dtypes: 0 ulps for +, -, *, /, fmod-based remainders, maximum, minimum
    (IEEE results, correctly rounded; float16 computed in float32 and rounded once is too);
    pow and atan2: 4 float32 ulps (numpy's float32 kernels against the correctly rounded
    float64 reference), 1 float16 ulp (FP32 values on either side of an FP16 rounding
    boundary); measured: 2 float32 ulps (atan2), 0 float16. maximum/minimum: NaN if either
    operand is NaN (XLA's semantics, see the module docstring), the sign of a zero result
    not compared."""
    names = list(BINARY)
    ops = [BINARY[n] for n in names]
    w = Wide(lambda a, b, c, d: [f(a, b) for f, *_ in ops] + [f(c, d) for f, *_ in ops],
             np.zeros(12, F32), np.zeros(12, F32), np.zeros(12, F16), np.zeros(12, F16))
    assert {op[1] for op in ops} <= w.opcodes

    @HYP
    @given(edge_arrays(F32, (12,)), edge_arrays(F32, (12,)), edge_arrays(F16, (12,)),
           edge_arrays(F16, (12,)))
    @example(np.array([0, 0, 1, -1, 1e-45, 3e38, np.inf, np.inf, 0, -0.0, 1e-40, 7], F32),
             np.array([0, 1e-40, 1e-40, -1e-45, 2, 3e38, np.inf, -np.inf, np.inf, 0, 1e-40, -0.0], F32),
             np.array([0, 0, 1, -1, 6e-8, 6e4, np.inf, np.inf, 0, -0.0, 1e-5, 7], F16),
             np.array([0, 1e-5, 1e-7, -6e-8, 2, 6e4, np.inf, -np.inf, np.inf, 0, 1e-5, -0.0], F16))
    def prop(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> None:
        got, ref = w.run(a, b, c, d)
        n = len(ops)
        for k, (name, (_, _, ulps32, ulps16)) in enumerate(zip(names, ops, strict=True)):
            minmax = name in ("maximum", "minimum")
            for out, ulps, (x, y) in ((k, ulps32, (a, b)), (n + k, ulps16, (c, d))):
                expected = ref[out]
                if minmax:
                    expected = np.where(np.isnan(x) | np.isnan(y), np.asarray(np.nan, x.dtype), expected)
                assert_ulps(got[out], expected, ulps, zero_sign=not minmax,
                            what=f"{name} {x.dtype}", inputs=[x, y])

    prop()


def test_convert_edges() -> None:
    """``convert`` between float types and to integers, from FP32 and FP16 over the whole
    range with subnormals, +-0, +-inf and NaN: to FP16 and BF16 to nearest even, overflowing
    to +-inf (the emulator's default; the IPU with ``nanoo`` on would give NaN, and its
    hardware clips to +-65504 with it off, which is not modelled), FP16 subnormals kept; to
    integers truncating and saturating, NaN to 0 (XLA's semantics). One rounding each:
    exact (0 ulps), 200 examples of 16 per dtype. BF16 results below its normal range (that
    of float32) are compared with ml_dtypes' rounding instead: XLA converts to BF16 through
    float32 with subnormals flushed, the emulator keeps BF16's subnormals."""
    def fn(x: tf.Tensor) -> list[tf.Tensor]:
        outs = [tf.cast(x, t) for t in (tf.bfloat16, tf.int32, tf.int8, tf.uint8, tf.int64, tf.uint32)]
        return outs + [tf.cast(x, tf.float16 if x.dtype == tf.float32 else tf.float32)]

    w = Wide(lambda a, b: fn(a) + fn(b), np.zeros(16, F32), np.zeros(16, F16))
    assert "convert" in w.opcodes

    @HYP
    @given(edge_arrays(F32, (16,)) | edge_arrays(F32, (16,), -7e4, 7e4) | edge_arrays(F32, (16,), -1e-4, 1e-4),
           edge_arrays(F16, (16,)))
    @example(np.array([65504, 65519.99, 65520, -65520, 1e5, 5.96e-8, 2.98e-8, 2.99e-8, -3e-8, 1e-40,
                       np.nan, 2.5, 3.5, 255.5, -128.7, 3e9], F32),
             np.array([65504, -65504, 6e-8, -6e-8, 6.1e-5, np.nan, np.inf, -np.inf, 255.9, 256, -129,
                       -0.0, 0.5, 1.5, 2.5, -2.5], F16))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        got, ref = w.run(a, b)
        for k, (g, r) in enumerate(zip(got, ref, strict=True)):
            x = a if k < len(got) // 2 else b
            what = f"convert {x.dtype} to {g.dtype}"
            if g.dtype == BF16:  # XLA converts through float32, flushing BF16's subnormals
                assert_ulps(g, x.astype(BF16), 0, what=what + " vs ml_dtypes", inputs=[x])
                normal = ~(np.abs(x) < np.finfo(F32).smallest_normal)
                g, r = g[normal], r[normal]
            assert_ulps(g, r, 0, what=what, inputs=[x])

    prop()


# ------------------------------------------------------------------ integers

INT_OPS: dict[str, Callable[..., Any]] = {  # every integer type
    "add": xla.add, "subtract": xla.sub, "multiply": xla.mul,
    "maximum": xla.max, "minimum": xla.min, "and": tf.bitwise.bitwise_and, "or": tf.bitwise.bitwise_or,
    "xor": tf.bitwise.bitwise_xor, "shift_left": xla.shift_left,
    "shift_right_arithmetic": xla.shift_right_arithmetic,
    "shift_right_logical": xla.shift_right_logical, "less": xla.lt, "equal": xla.eq,
    "truncatediv": tf.truncatediv, "floordiv": tf.math.floordiv, "floormod": tf.math.floormod,
}
TF_INT_OPS: dict[str, Callable[..., Any]] = {  # TF allows these for int32 and int64 only
    "truncatemod": tf.truncatemod, "remainder": xla.rem,
}


def int_edges(dtype: Any, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Integers over the whole range, mixed with the extremes, 0, +-1 and shift amounts at
    and beyond the width."""
    info = np.iinfo(dtype)
    bits = np.dtype(dtype).itemsize * 8
    edge = {info.min, info.max, 0, 1, 2, bits - 1, bits, bits + 1} | ({-1, -2} if info.min < 0 else set())
    elems = st.integers(int(info.min), int(info.max)) | st.sampled_from(sorted(int(e) for e in edge))
    return hnp.arrays(np.dtype(dtype), shape, elements=elems)


INT_TYPES = [np.int32, np.int8, np.uint8, np.uint32, np.int64]


def test_integer_edges() -> None:
    """Integer element-wise ops (arithmetic wrapping modulo 2^bits, division and remainder
    by 0 and of the minimum by -1, floor division, shifts by the width and beyond, bitwise
    ops, comparisons) of int32, int8, uint8, uint32 and int64 operands: what the IPU's
    integer units compute under XLA's semantics. Exact against XLA, 200 examples of 10 pairs
    per type, every op on each."""
    ops = [(t, name, op) for t, dt in enumerate(INT_TYPES)
           for name, op in INT_OPS.items() | (TF_INT_OPS.items() if dt in (np.int32, np.int64) else set())]

    def fn(*xs: tf.Tensor) -> list[tf.Tensor]:
        return [op(xs[2 * t], xs[2 * t + 1]) for t, _, op in ops]

    zeros = [np.zeros(10, t) for t in INT_TYPES for _ in range(2)]
    d = eu.Differential(fn, *zeros)
    assert {"divide", "remainder", "shift-right-logical", "xor"} <= d.opcodes

    @HYP
    @given(st.tuples(*[int_edges(t, (10,)) for t in INT_TYPES for _ in range(2)]))
    def prop(xs: tuple[np.ndarray, ...]) -> None:
        got, expected = d.run(*xs)
        for g, e, (t, name, _) in zip(got, expected, ops, strict=True):
            x, y = xs[2 * t], xs[2 * t + 1]
            assert_ulps(g, e, 0, what=f"{name} {x.dtype}", inputs=[x, y])

    prop()


# ------------------------------------------------------------------ reductions


def _sum_check(x: np.ndarray, axis: Any, acc_terms: int, scaled: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(bound, skip) of a float32-accumulated sum of ``x`` over ``axis``: the accumulation
    error of ``acc_terms`` terms in any order is at most ``acc_terms * 2^-24 * sum|x|``; the
    result is skipped where a partial sum may overflow float32 in one order and not in
    another (no NaN among the terms, not both infinities, and ``sum|x|`` within that error
    of float32's largest value) unless every finite term has the same sign and the sum
    surely overflows (``scaled``: the sum is then divided, as in a mean, so an overflow of
    the float32 sum, which the float64 reference does not have, is skipped too)."""
    x64 = x.astype(F64)
    finite = np.isfinite(x64)
    terms = np.where(finite, x64, 0.0)
    mag = np.abs(terms).sum(axis=axis)
    top = float(np.finfo(F32).max) + float(spacing(np.finfo(F32).max, F32)) / 2
    nan = np.isnan(x64).any(axis=axis)
    both_inf = (x64 == np.inf).any(axis=axis) & (x64 == -np.inf).any(axis=axis)
    positive, negative = (terms >= 0).all(axis=axis), (terms <= 0).all(axis=axis)
    err = acc_terms * U32 * mag
    surely = (mag - err > top) & ((positive & ~(x64 == -np.inf).any(axis=axis))
                                  | (negative & ~(x64 == np.inf).any(axis=axis)))
    skip = ~nan & ~both_inf & (mag + err >= top) & (~surely | scaled)
    return err, skip


def _prod_check(x: np.ndarray, axis: int, acc_terms: int) -> tuple[np.ndarray, np.ndarray]:
    """(relative bound, skip) of a float32-accumulated product over ``axis``: relative error
    ``acc_terms * 2^-24`` while every partial product stays a normal float32; skipped where a
    partial product may overflow or become subnormal in one order of the factors and not in
    another (the rounding then depends on the order), unless the result is NaN anyway (a NaN,
    or 0 * inf)."""
    x64 = x.astype(F64)
    finite = np.isfinite(x64)
    mag = np.abs(np.where(finite, x64, 1.0))
    with np.errstate(divide="ignore", over="ignore"):
        big = np.log2(np.where(mag > 1, mag, 1.0)).sum(axis=axis) >= 127.9
        small = np.log2(np.where((mag < 1) & (mag > 0), mag, 1.0)).sum(axis=axis) < -125.9
    zero = (x64 == 0).any(axis=axis)
    inf = np.isinf(x64).any(axis=axis)
    nan = np.isnan(x64).any(axis=axis)
    ambiguous = np.where(zero, big, np.where(inf, small, big | small))
    skip = ~nan & ~(zero & inf) & ambiguous
    return np.full(skip.shape, acc_terms * U32), skip


@functools.cache
def _adder(dtype: tf.DType) -> Any:
    """A scalar ``a + b`` reducer in ``dtype``."""
    spec = tf.TensorSpec([], dtype)
    return tf.function(lambda a, b: a + b, autograph=False).get_concrete_function(spec, spec)


def test_reductions_edges() -> None:
    """Sum, mean, product, max, min, argmax and argmin of FP32 and FP16 arrays [4, 6] with
    subnormals, +-0, +-inf, NaN and the extremes of the type. On the IPU (and in TF's
    lowering, which converts FP16 to FP32 around the reduce) FP16 sums, means and products
    accumulate in FP32 and round once; max/min/argmax compare. 200 examples per dtype.

    Tolerance, float32 (K terms, S = sum of |terms|): sums within ``K 2^-24 S`` plus one ulp
    of the result (float32 rounding in any order of additions against the float64
    reference, rounded once), means that over K; products within ``K 2^-24 |result|`` plus
    one ulp. float16: twice the accumulation error (emulator and reference each accumulate
    in float32, in their own order) plus one FP16 ulp (the two float32 sums may round to
    neighbouring FP16 values). Results whose overflow or underflow depends on the order of
    the operations (on the IPU too) are not compared; see ``_sum_check``/``_prod_check``.
    max/min exact (NaN if the slice holds a NaN; sign of zero not compared); argmax/argmin
    exact, except on slices with a NaN: TF's ArgMax reducer (``GE`` then ``select``) is no
    total order there, its result depends on the reduction order. The last output is a
    ``reduce`` whose reducer adds in the argument's own type (no conversion around it): the
    emulator accumulates an FP16 one in FP32 too, as the IPU does, so it has the sums'
    tolerance. Regression (the ``@example``): a reducer wrapped in a ``call`` (as
    ``xla.reduce`` with a TF function lowers) was run element by element, rounding every
    partial sum to FP16 (1022 instead of 1023)."""
    def fn(x: tf.Tensor) -> list[tf.Tensor]:
        return [tf.reduce_sum(x, axis=1), tf.reduce_sum(x, axis=0), tf.reduce_sum(x),
                tf.reduce_mean(x, axis=0), tf.reduce_prod(x, axis=1), tf.reduce_max(x, axis=1),
                tf.reduce_min(x, axis=0), tf.argmax(x, axis=1), tf.argmin(x, axis=0),
                xla.reduce(x, tf.constant(0, x.dtype), [1], _adder(x.dtype))]

    w = Wide(lambda a, b: fn(a) + fn(b), np.zeros((4, 6), F32), np.zeros((4, 6), F16))
    assert {"reduce", "convert"} <= w.opcodes

    @HYP
    @given(edge_arrays(F32, (4, 6), -1e3, 1e3) | edge_arrays(F32, (4, 6), -1e-36, 1e-36)
           | edge_arrays(F32, (4, 6)),
           edge_arrays(F16, (4, 6), -3e3, 3e3) | edge_arrays(F16, (4, 6)))
    @example(np.array([[3e38, 3e38, 1, 1, 1, 1], [3e38, -3e38, 3e38, 0, 0, 0], [1e-40] * 6,
                       [-np.inf, 3e38, 3e38, 1, 1, 1]], F32),
             np.array([[6e4, 6e4, 1, 1, 1, 1], [6e4, -6e4, 6e4, 0, 0, 0], [6e-8] * 6,
                       [-np.inf, 6e4, 6e4, 1, 1, 1]], F16))
    @example(np.zeros((4, 6), F32), np.array([[0, 0, 683, 683, 683, -1026]] * 4, F16))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        got, ref = w.run(a, b)
        n = len(got) // 2
        for base, x in ((0, a), (n, b)):
            g, r = got[base:base + n], ref[base:base + n]
            dt = x.dtype
            twice = 1 if dt == F32 else 2
            tag = f" {dt}"
            for k, (axis, terms) in enumerate([(1, 6), (0, 4), (None, 24)]):
                err, skip = _sum_check(x, axis, terms)
                bound = twice * err + spacing(np.maximum(np.abs(g[k].astype(F64)), np.abs(r[k].astype(F64))), dt)
                assert_within(g[k], r[k], bound, skip=skip, what="sum" + tag, inputs=[x])
            err, skip = _sum_check(x, 0, 4, scaled=True)
            bound = twice * err / 4 + spacing(np.maximum(np.abs(g[3].astype(F64)), np.abs(r[3].astype(F64))), dt)
            assert_within(g[3], r[3], bound, skip=skip, what="mean" + tag, inputs=[x])
            rel, skip = _prod_check(x, 1, 6)
            big = np.maximum(np.abs(g[4].astype(F64)), np.abs(r[4].astype(F64)))
            with np.errstate(invalid="ignore"):
                bound = np.nan_to_num(twice * rel * big) + spacing(big, dt)
            assert_within(g[4], r[4], bound, skip=skip, what="prod" + tag, inputs=[x])
            for k, axis, name in ((5, 1, "max"), (6, 0, "min")):
                expected = np.where(np.isnan(x).any(axis=axis), np.asarray(np.nan, dt), r[k])
                assert_ulps(g[k], expected, 0, zero_sign=False, what=name + tag, inputs=[x])
            for k, axis, name in ((7, 1, "argmax"), (8, 0, "argmin")):
                keep = ~np.isnan(x).any(axis=axis)
                assert_ulps(g[k][keep], r[k][keep], 0, what=name + tag, inputs=[x])
            err, skip = _sum_check(x, 1, 6)
            bound = twice * err + spacing(np.maximum(np.abs(g[9].astype(F64)), np.abs(r[9].astype(F64))), dt)
            assert_within(g[9], r[9], bound, skip=skip, what="reduce with an add reducer" + tag, inputs=[x])

    prop()


# ------------------------------------------------------------------ sort


def _pool(dtype: Any, bits: Sequence[int]) -> np.ndarray:
    """Sort keys with many ties: NaNs of both signs (and another payload), +-inf, +-0, +-1,
    subnormals, the largest finite values, given as bit patterns (NaN payloads survive)."""
    ints = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    return np.array(bits, ints).view(dtype)


SORT_POOLS = {
    F32: _pool(F32, [0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800000, 0xFF800000, 0x00000000,
                     0x80000000, 0x3F800000, 0xBF800000, 0x00000001, 0x80000001, 0x000116C2,
                     0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x40200000, 0xC0200000, 0x3A83126F]),
    F16: _pool(F16, [0x7E00, 0xFE00, 0x7E01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x3C00, 0xBC00,
                     0x0001, 0x8001, 0x03FF, 0x83FF, 0x7BFF, 0xFBFF, 0x4100, 0xC100, 0x1419]),
}


def pooled(dtype: Any, shape: tuple[int, ...], nan: bool = True) -> st.SearchStrategy[np.ndarray]:
    pool = SORT_POOLS[np.dtype(dtype)]
    if not nan:
        pool = pool[~np.isnan(pool)]
    return hnp.arrays(np.int8, shape, elements=st.integers(0, len(pool) - 1)).map(lambda i: pool[i])


def assert_bits(got: np.ndarray, expected: np.ndarray, what: str, inputs: Sequence[np.ndarray] = ()) -> None:
    """Bit for bit (NaN payloads and the signs of zeros included)."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (what, got.dtype, expected.dtype)
    ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[got.dtype.itemsize]
    bad = got.view(ints) != expected.view(ints)
    assert not bad.any(), _report(what, bad, got, expected, *inputs)


def stable_order(keys: np.ndarray, axis: int, descending: bool = False) -> np.ndarray:
    """numpy's stable argsort in the floats' total order (-NaN < -inf < ... < -0 < +0 < ...
    < inf < NaN): ties keep their order, descending too."""
    k = order_key(keys)
    return np.argsort(-k if descending else k, axis=axis, kind="stable")


def test_sort_edges() -> None:
    """``tf.sort`` and ``tf.argsort(stable=True)``, ascending and descending, of FP32 and
    FP16 rows with many ties among NaNs of both signs, +-inf, +-0, subnormals and the
    extremes. TF lowers them to a stable ``sort`` with XLA's total order (``compare`` of type
    TOTALORDER: -NaN < -inf < ... < -0 < +0 < ... < inf < NaN) carrying an ``iota`` index.
    A sort rounds nothing: results bit for bit against XLA in the same dtype (its total-order
    compare works on the bits, so flushing subnormals does not apply), and the indices
    against numpy's stable argsort in that order. 200 examples of [3, 17] per dtype."""
    def fn(x: tf.Tensor) -> list[tf.Tensor]:
        return [tf.sort(x, axis=1), tf.sort(x, axis=1, direction="DESCENDING"), tf.sort(x, axis=0),
                tf.argsort(x, axis=1, stable=True),
                tf.argsort(x, axis=1, direction="DESCENDING", stable=True)]

    d = eu.Differential(lambda a, b: fn(a) + fn(b), np.zeros((3, 17), F32), np.zeros((3, 17), F16))
    assert "sort" in d.opcodes

    @HYP
    @given(pooled(F32, (3, 17)), pooled(F16, (3, 17)))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        got, expected = d.run(a, b)
        for base, x in ((0, a), (5, b)):
            tag = f" {x.dtype}"
            for k, name in enumerate(["sort", "sort descending", "sort axis 0", "argsort",
                                      "argsort descending"]):
                assert_bits(got[base + k], expected[base + k], name + tag, [x])
            up, down = stable_order(x, 1), stable_order(x, 1, descending=True)
            np.testing.assert_array_equal(got[base + 3], up, err_msg="argsort" + tag)
            np.testing.assert_array_equal(got[base + 4], down, err_msg="argsort descending" + tag)
            assert_bits(got[base], np.take_along_axis(x, up, axis=1), "sort vs numpy" + tag, [x])

    prop()


_INT_OF = {tf.float16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}


def _total_key(v: tf.Tensor) -> tf.Tensor:
    """XLA's total order of floats as signed integers, written with TF ops (bitcast, xor,
    select), so that the comparator is no plain ``compare`` the emulator would recognize."""
    it = _INT_OF[v.dtype]
    b = tf.bitcast(v, it)
    return tf.where(b < 0, tf.bitwise.bitwise_xor(b, tf.constant(it.max, it)), b)


@functools.cache
def comparator(kind: str, dtypes: tuple[tf.DType, ...]) -> Any:
    """A sort comparator over operands of ``dtypes`` that looks at the first only:
    ``total<`` / ``total>`` (XLA's total order, NaNs included) or ``float<`` (IEEE's ``<``:
    -0 ties with +0; a strict weak order only without NaN)."""
    def cmp(a: tf.Tensor, b: tf.Tensor, *payload: tf.Tensor) -> tf.Tensor:
        if kind == "total<":
            return _total_key(a) < _total_key(b)
        if kind == "total>":
            return _total_key(a) > _total_key(b)
        return a < b

    specs = [tf.TensorSpec([], t) for t in dtypes for _ in range(2)]
    return tf.function(cmp, autograph=False).get_concrete_function(*specs)


def _vsort(kind: str, operands: Sequence[tf.Tensor], axis: int) -> list[tf.Tensor]:
    cmp = comparator(kind, tuple(o.dtype for o in operands))
    return xla.variadic_sort(list(operands), axis, cmp, True)


def test_stable_variadic_sort_total_order_with_payload() -> None:
    """Stable multi-operand sorts (``sort`` with ``is_stable=True``) whose comparator is XLA's
    total order of the key, written with TF ops (no plain ``compare``: the emulator runs it
    as a vectorized bitonic network breaking ties by position), carrying an int32 index and
    a float16 payload: ascending and descending, on both axes, FP32 and FP16 keys with many
    equal keys (NaNs included). On the IPU a sort moves data and rounds nothing. Exact: bit
    for bit against XLA in the same dtypes, and the index against numpy's stable argsort
    (equal keys keep their order). 200 examples of [5, 13]."""
    def fn(k32: tf.Tensor, k16: tf.Tensor, idx: tf.Tensor) -> list[tf.Tensor]:
        return (_vsort("total<", [k32, idx, k16], 1) + _vsort("total>", [k32, idx], 1)
                + _vsort("total<", [k16, idx], 0) + _vsort("total>", [k16, k32, idx], 1))

    idx = np.arange(65, dtype=np.int32).reshape(5, 13)
    d = eu.Differential(fn, np.zeros((5, 13), F32), np.zeros((5, 13), F16), idx)
    assert "sort" in d.opcodes

    @HYP
    @given(pooled(F32, (5, 13)), pooled(F16, (5, 13)))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        got, expected = d.run(a, b, idx)
        for k, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_bits(g, e, f"output {k}", [a, b])
        cases = [(0, a, 1, False, [a, idx, b]), (3, a, 1, True, [a, idx]),
                 (5, b, 0, False, [b, idx]), (7, b, 1, True, [b, a, idx])]
        for first, key, axis, desc, operands in cases:
            order = stable_order(key, axis, descending=desc)
            for j, o in enumerate(operands):
                assert_bits(got[first + j], np.take_along_axis(o, order, axis=axis),
                            f"operand {j} of the sort at output {first} vs numpy", [key])

    prop()


def test_stable_sort_float_comparator_ties_signed_zeros() -> None:
    """A stable sort by IEEE ``<`` (compare type FLOAT, a strict weak order without NaN:
    -0 and +0 tie and keep their order) of FP32 and FP16 keys with subnormals, carrying the
    index (a sort moves data on the IPU and rounds nothing). The reference is XLA on keys
    widened to float64/float32 (exact; XLA's float32 compare reads subnormals as zero, which
    would tie them with 0), and numpy's stable argsort. Exact, 200 examples of [3, 13]."""
    def fn(k32: tf.Tensor, k16: tf.Tensor, idx: tf.Tensor) -> list[tf.Tensor]:
        return _vsort("float<", [k32, idx], 1) + _vsort("float<", [k16, idx], 1)

    idx = np.arange(39, dtype=np.int32).reshape(3, 13)
    w = Wide(fn, np.zeros((3, 13), F32), np.zeros((3, 13), F16), idx)

    @HYP
    @given(pooled(F32, (3, 13), nan=False), pooled(F16, (3, 13), nan=False))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        got, ref = w.run(a, b, idx)
        for k, (g, e) in enumerate(zip(got, ref, strict=True)):
            assert_bits(g, e, f"output {k}", [a, b])
        for first, key in ((0, a), (2, b)):
            order = np.argsort(np.where(key == 0, 0.0, key.astype(F64)), axis=1, kind="stable")
            np.testing.assert_array_equal(got[first + 1], np.take_along_axis(idx, order, axis=1))

    prop()


def _plain_compare_sort(dtype: Any, direction: str, compare_type: str, n: int) -> Any:
    """A hand-built stable ``sort`` of (key [n], index [n]) whose comparator is one plain
    ``compare(p0, p1)``: what XLA's own passes and the ONNX frontend produce (TF wraps its
    comparators in a ``call``), which the emulator sorts with numpy's stable argsort."""
    sub = eu.IRBuilder("cmp")
    p = [sub.parameter(dtype, []), sub.parameter(dtype, []), sub.parameter(np.int32, []),
         sub.parameter(np.int32, [])]
    sub.root(sub.op("compare", p[:2], bool, [], direction=direction, compare_type=compare_type))
    b = eu.IRBuilder("sort")
    x, i = b.parameter(dtype, [n]), b.parameter(np.int32, [n])
    b.root(b.op("sort", [x, i], None, [x, i], called=[b.computation(sub)], dimension=0, is_stable=True))
    return compile_module(b.module(), TARGET)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["float32", "float16"])
def test_sort_plain_compare_fast_path(dtype: np.dtype) -> None:
    """The emulator's fast path for a comparator that is one ``compare`` (LT ascending, GT
    descending): with TOTALORDER it orders as XLA's total order, NaNs and -0 < +0 included;
    with FLOAT (IEEE's ``<``) -0 and +0 tie, so a stable sort keeps them in their order
    (keys without NaN, under which IEEE's ``<`` is no strict weak order). No XLA run here (TF
    cannot emit such HLO); the reference is numpy's stable argsort. Exact, 200 examples of 19
    keys. Regression: the fast path used the total order for FLOAT compares too."""
    n = 19
    idx = np.arange(n, dtype=np.int32)
    exes = {(d, t): _plain_compare_sort(dtype, d, t, n) for d in ("LT", "GT") for t in ("FLOAT", "TOTALORDER")}

    @HYP
    @given(pooled(dtype, (n,)))
    @example(np.array([0, -0.0, 1, -0.0, 0, -1, 0, 0, -0.0, 2, 2, -2, 0, -0.0, 5, 5, 5, 0, 0], dtype))
    def prop(keys: np.ndarray) -> None:
        for (direction, ctype), exe in exes.items():
            x = keys if ctype == "TOTALORDER" else np.where(np.isnan(keys), np.asarray(1, dtype), keys)
            if ctype == "TOTALORDER":
                order = stable_order(x, 0, descending=direction == "GT")
            else:
                v = np.where(x == 0, 0.0, x.astype(F64))
                order = np.argsort(-v if direction == "GT" else v, kind="stable")
            got = exe.run([x, idx])
            what = f"{direction} {ctype}"
            np.testing.assert_array_equal(got[1], order, err_msg=what)
            assert_bits(got[0], x[order], what, [x])

    prop()


# ------------------------------------------------------------------ reduce-precision

RP_BITS = {F32: [(8, 23), (8, 7), (5, 10), (4, 3), (8, 0), (2, 1), (6, 20), (1, 0), (3, 22)],
           F16: [(5, 10), (5, 7), (4, 3), (3, 1), (5, 0), (2, 9), (1, 2)]}


def test_reduce_precision_edges() -> None:
    """``reduce-precision`` (what the IPU's FP16/BF16/FP8 casts round like: to nearest even,
    overflow to +-inf, values below the narrow format's normal range to +-0, NaN stays NaN)
    of FP32 and FP16 arguments with subnormals, +-inf, NaN and values that overflow the
    narrow format, for several (exponent, mantissa) widths at once. It manipulates bits, so
    XLA's flushing of float32 subnormals does not apply: bit for bit against XLA in the same
    dtype, NaNs compared as NaNs (their payloads are XLA's business). 200 examples of 16.
    Regressions: FP16 subnormals were rounded as float32 normal numbers (keeping up to 10
    significant bits where XLA rounds the 16-bit pattern's mantissa field); with 0 mantissa
    bits NaNs became +-0 or +-inf (XLA keeps them)."""
    def fn(a: tf.Tensor, b: tf.Tensor) -> list[tf.Tensor]:
        return ([xla.reduce_precision(a, exponent_bits=e, mantissa_bits=m) for e, m in RP_BITS[F32]]
                + [xla.reduce_precision(b, exponent_bits=e, mantissa_bits=m) for e, m in RP_BITS[F16]])

    d = eu.Differential(fn, np.zeros(16, F32), np.zeros(16, F16))
    assert "reduce-precision" in d.opcodes

    @HYP
    @given(edge_arrays(F32, (16,)) | edge_arrays(F32, (16,), -1e-36, 1e-36) | edge_arrays(F32, (16,), -1e6, 1e6),
           edge_arrays(F16, (16,)) | edge_arrays(F16, (16,), -1e-3, 1e-3))
    @example(_pool(F32, [0x7FC00000, 0xFFC00000, 0x7F800001, 0x000116C2, 0x807FFFFF, 0x00000001,
                         0x7F7FFFFF, 0x3F800000, 0x477FF000, 0x477FE000, 0x38800000, 0x387FC000,
                         0x33800000, 0x80000000, 0x7F800000, 0xFF800000]),
             _pool(F16, [0x00E3, 0x00E4, 0x03FF, 0x83FF, 0x0001, 0x8003, 0x7E00, 0xFE00, 0x7C01,
                         0x7BFF, 0x3C00, 0x0400, 0x0000, 0x8000, 0x7C00, 0x0007]))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        got, expected = d.run(a, b)
        bits = [(F32, e, m, a) for e, m in RP_BITS[F32]] + [(F16, e, m, b) for e, m in RP_BITS[F16]]
        for g, x, (dt, e, m, arg) in zip(got, expected, bits, strict=True):
            nan = np.isnan(x)
            assert np.array_equal(np.isnan(g), nan), f"NaNs of reduce-precision({e}, {m}) {dt}: {g} vs {x}"
            assert_bits(np.where(nan, 0, g).astype(dt), np.where(nan, 0, x).astype(dt),
                        f"reduce-precision({e}, {m}) {dt}", [arg])

    prop()


# ------------------------------------------------------------------ matmul and dot_general


def test_matmul_edges() -> None:
    """``tf.matmul`` [5, 8] x [8, 6] in FP32 and FP16 with subnormals, +-0, +-inf and NaN
    among the operands (0 * inf and inf - inf give NaN, as on the IPU's AMP, which forms every
    product), and in FP16 results beyond 65504 (overflow to inf). The IPU multiplies FP16
    operands exactly into FP32 partials and rounds the sum once; the emulator does the same
    (default ``partials_type``). 200 examples.

    Tolerance (K = 8 products a result, M = sum of |products|): float32 within
    ``K 2^-24 M + K 2^-149`` plus one ulp (the float32 sum in any order, products rounded
    below the normal range, against the float64 reference rounded once); finite operands up
    to 1e3 so that no product overflows (float32 overflow of a sum depends on its order).
    float16: ``2 K 2^-24 M`` plus one FP16 ulp (both sides accumulate in float32, in their
    own orders, and round once to FP16)."""
    w = Wide(lambda a, b, c, d: [tf.matmul(a, b), tf.matmul(c, d)], np.zeros((5, 8), F32), np.zeros((8, 6), F32),
             np.zeros((5, 8), F16), np.zeros((8, 6), F16))
    assert "dot" in w.opcodes

    def magnitude(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        fx, fy = (np.where(np.isfinite(v), np.abs(v.astype(F64)), 0.0) for v in (x, y))
        return fx @ fy

    f32 = edge_arrays(F32, (5, 8), -1e3, 1e3), edge_arrays(F32, (8, 6), -1e3, 1e3)

    @HYP
    @given(*f32, edge_arrays(F16, (5, 8), -300, 300) | edge_arrays(F16, (5, 8)), edge_arrays(F16, (8, 6), -300, 300))
    def prop(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> None:
        a = np.where(np.abs(a) > 1e3, np.copysign(np.inf, a), a).astype(F32)  # no finite overflow
        b = np.where(np.abs(b) > 1e3, np.copysign(np.inf, b), b).astype(F32)
        got, ref = w.run(a, b, c, d)
        bound = 8 * U32 * magnitude(a, b) + 8 * 2.0**-149 + spacing(ref[0], F32)
        assert_within(got[0], ref[0], bound, what="matmul float32", inputs=[a, b])
        big = np.maximum(np.abs(got[1].astype(F64)), np.abs(ref[1].astype(F64)))
        bound = 2 * 8 * U32 * magnitude(c, d) + spacing(big, F16)
        assert_within(got[1], ref[1], bound, what="matmul float16", inputs=[c, d])

    prop()


Structure = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _dot_structure(rng: np.random.Generator, batch: int, contracting: int, lhs_free: int,
                   rhs_free: int) -> Structure:
    """(lhs shape, rhs shape, lhs batch, rhs batch, lhs contracting, rhs contracting): the
    dimensions of each side in a random order, batch and contracting pairs in a random
    order of their own, sizes 1 to 4."""
    kinds = ([("b", i) for i in range(batch)] + [("c", i) for i in range(contracting)])
    size = {k: int(rng.integers(1, 5)) for k in kinds}
    sides = []
    for free in (lhs_free, rhs_free):
        dims = kinds + [("f", i) for i in range(free)]
        dims = [dims[j] for j in rng.permutation(len(dims))]
        shape = tuple(size[d] if d in size else int(rng.integers(1, 5)) for d in dims)
        sides.append((dims, shape))
    (ld, ls), (rd, rs) = sides
    bp = rng.permutation(batch)
    cp = rng.permutation(contracting)
    return (ls, rs, tuple(ld.index(("b", int(i))) for i in bp), tuple(rd.index(("b", int(i))) for i in bp),
            tuple(ld.index(("c", int(i))) for i in cp), tuple(rd.index(("c", int(i))) for i in cp))


def _dot_structures() -> list[Structure]:
    """One structure per (batch, contracting) count in 0..2 x 0..2 with 0 to 2 free
    dimensions a side, and a second of each with other orders and free counts; rank <= 5."""
    rng = np.random.default_rng(25)
    out = []
    for batch in range(3):
        for contracting in range(3):
            for _ in range(2):
                out.append(_dot_structure(rng, batch, contracting, int(rng.integers(0, 3)), int(rng.integers(0, 3))))
    return out


DOT_STRUCTURES = _dot_structures()


def _einsum_spec(s: Structure) -> str:
    """The numpy einsum of a dot_general: output = batch dims (lhs order of the pairs), then
    the lhs free dims, then the rhs free dims, each in their operand's order."""
    ls, rs, lb, rb, lc, rc = s
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    lhs = [""] * len(ls)
    rhs = [""] * len(rs)
    for i, j in [*zip(lb, rb, strict=True), *zip(lc, rc, strict=True)]:
        lhs[i] = rhs[j] = next(letters)
    for side in (lhs, rhs):
        for k, v in enumerate(side):
            if not v:
                side[k] = next(letters)
    out = [lhs[i] for i in lb] + [lhs[k] for k in range(len(ls)) if k not in lb and k not in lc]
    out += [rhs[k] for k in range(len(rs)) if k not in rb and k not in rc]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


class _DotCase:
    """One dot_general structure: lowered for FP32 and FP16, compiled once each; the XLA
    reference is the FP32 function (on the FP16 case's widened arguments too)."""

    def __init__(self, s: Structure) -> None:
        ls, rs, lb, rb, lc, rc = s

        def fn(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
            dn = xla.DotDimensionNumbers()
            dn.lhs_batch_dimensions.extend(lb)
            dn.rhs_batch_dimensions.extend(rb)
            dn.lhs_contracting_dimensions.extend(lc)
            dn.rhs_contracting_dimensions.extend(rc)
            return xla.dot_general(a, b, dn)

        self.fn = tf.function(fn, jit_compile=True, autograph=False)
        self.exes = {}
        for dt in (F32, F16):
            module = eu.hlo_module_to_ir(eu.hlo_of(self.fn, np.zeros(ls, dt), np.zeros(rs, dt)))
            assert "dot" in {i.opcode for c in module.computations for i in c.instructions}
            self.exes[dt] = compile_module(module, TARGET)
        self.spec = _einsum_spec(s)
        self.terms = int(np.prod([ls[i] for i in lc], dtype=np.int64))

    def run(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        got = self.exes[a.dtype].run([a, b])[0]
        ref = self.fn(a.astype(F32), b.astype(F32)).numpy()
        return got, ref.astype(got.dtype)


@functools.cache
def _dot_case(k: int) -> _DotCase:
    return _DotCase(DOT_STRUCTURES[k])


def test_dot_general_generated_dimension_numbers() -> None:
    """``dot_general`` with generated dimension numbers: 0 to 2 batch and contracting pairs
    and 0 to 2 free dimensions a side, every side's dimensions in a random order and the
    pairs in their own (``DOT_STRUCTURES``: 18 structures, each lowered once per dtype and
    compiled once), FP32 and FP16 operands in [-4, 4]. The IPU's AMP forms FP16 products
    exactly in FP32 partials and rounds each result once. 200 examples (structure, dtype,
    values). The edges (inf, NaN, subnormals, FP16 overflow) are test_matmul_edges'.

    Reference: XLA's float32 dot_general (for FP16, on the widened operands, rounded once).
    Tolerance (K products a result, M = sum of their |values|): float32 ``2 K 2^-24 M``
    (both sides sum in float32, each in its own order) plus ``K 2^-126`` (products below the
    normal range, flushed by XLA); float16 the same plus one FP16 ulp (the two float32 sums
    may round to neighbouring FP16 values). The result also matches numpy's float64 einsum
    within the same bound, and has its shape (batch, lhs free, rhs free dims)."""
    @HYP
    @given(st.integers(0, len(DOT_STRUCTURES) - 1), st.sampled_from([F32, F16]), st.data())
    def prop(k: int, dtype: np.dtype, data: st.DataObject) -> None:
        case = _dot_case(k)
        ls, rs = DOT_STRUCTURES[k][:2]
        elems = st.floats(-4, 4, width=dtype.itemsize * 8, allow_subnormal=False)
        a = data.draw(hnp.arrays(dtype, ls, elements=elems), label="lhs")
        b = data.draw(hnp.arrays(dtype, rs, elements=elems), label="rhs")
        got, ref = case.run(a, b)
        exact = np.einsum(case.spec, a.astype(F64), b.astype(F64))
        assert got.shape == exact.shape, (DOT_STRUCTURES[k], case.spec, got.shape, exact.shape)
        bound = 2 * case.terms * U32 * np.einsum(case.spec, np.abs(a.astype(F64)), np.abs(b.astype(F64)))
        bound += case.terms * 2.0**-126
        if dtype == F16:
            bound += spacing(np.maximum(np.abs(got.astype(F64)), np.abs(ref.astype(F64))), F16)
        what = f"dot_general {DOT_STRUCTURES[k]} {case.spec} {dtype}"
        assert_within(got, ref, bound, what=what, inputs=[a, b])
        assert_within(got, exact.astype(dtype), bound, what=what + " vs float64 einsum", inputs=[a, b])

    prop()
