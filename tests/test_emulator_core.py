"""Differential tests of the emulator core (and the HLO -> IR converter) against XLA on CPU.

Each test lowers a small ``tf.function(jit_compile=True)`` to HLO, converts it with
``tf_ipu.lowering.hlo_to_ir``, runs it on the emulator and compares with XLA's run of the same
function. Tolerances: float32 ``rtol=1e-5`` unless a test states otherwise (transcendental
functions get a small ``atol`` near zero crossings; XLA's CPU backend flushes subnormals, so
subnormal inputs are excluded and results below 1e-30 in magnitude are not compared
relatively); integers and booleans exactly. Opcodes no TF op produces (``count-leading-zeros``,
``round-nearest-afz``, ``cbrt``, total-order ``compare``, ``map``, ``custom-call``) are
tested on hand-built IR against numpy references. The same kernels at the edges (FP16 with
FP32 partials, subnormals, +-inf, NaN, overflow, generated ``dot_general`` dimension numbers,
stable sorts with NaNs; 200 examples each) are in ``test_emulator_properties.py``.
"""

from __future__ import annotations

import time
from typing import Any

import emulator_util as eu
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensorflow.compiler.tf2xla.python import xla

from device_server.emulator import (
    CompileOptions,
    ExecutionError,
    InvalidProgramError,
    OutOfMemoryError,
    UnsupportedOpError,
    compile_module,
    get_target,
    layer_of,
)
from device_server.emulator.estimate import while_trip_count
from device_server.protocol import ir_pb2

HYP = settings(max_examples=15, deadline=None, derandomize=True)
TARGET = get_target("ipu2")
TINY = 1e-30  # below this, XLA (flush-to-zero) and numpy may differ


def floats(shape: tuple[int, ...], lo: float = -1e3, hi: float = 1e3, specials: bool = True,
           dtype: type = np.float32, nan: bool = True) -> st.SearchStrategy[np.ndarray]:
    width = np.dtype(dtype).itemsize * 8
    ftype = np.dtype(dtype).type
    lo, hi = float(ftype(lo)), float(ftype(hi))  # exactly representable bounds
    elems = st.floats(lo, hi, width=width, allow_subnormal=False)
    if specials:
        elems = elems | st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0][0 if nan else 1:])
    return hnp.arrays(dtype, shape, elements=elems)


def ints(shape: tuple[int, ...], dtype: type = np.int32) -> st.SearchStrategy[np.ndarray]:
    info = np.iinfo(dtype)
    edge = [info.min, info.max, 0, 1, 2, 31, 32] + ([-1, -2, -31, -32] if info.min < 0 else [])
    elems = st.integers(int(info.min), int(info.max)) | st.sampled_from([int(e) for e in edge])
    return hnp.arrays(dtype, shape, elements=elems)


# ------------------------------------------------------------------ landing: the basics


def test_matmul_bias_reshape_and_variable_alias() -> None:
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    module = eu.check(lambda x, w: tf.reshape(tf.matmul(x, w) * 2.0 + 1.0, [20]), x, w)
    assert module.frontend == "xla-hlo"
    v = tf.Variable(np.ones([3], np.float32))

    @tf.function(jit_compile=True)
    def step(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        v.assign_add(x[0])
        return tf.reduce_sum(x * v, axis=1), x * 2

    module, params, expected = eu.lower_step(step, tf.constant(x))
    exe = compile_module(module, TARGET)
    assert exe.aliases == {2: 1}
    assert exe.parameters == [(np.dtype(np.float32), (4, 3)), (np.dtype(np.float32), (3,))]
    assert exe.outputs[2] == (np.dtype(np.float32), (3,))
    eu.assert_same(exe.run(params), expected)


# ------------------------------------------------------------------ element-wise: floats

UNARY_FLOAT = [
    # name, fn, opcode, (lo, hi), rtol, atol
    ("abs", tf.abs, "abs", (-1e30, 1e30), 0, 0),
    ("negate", tf.negative, "negate", (-1e30, 1e30), 0, 0),
    ("exp", tf.exp, "exponential", (-100, 100), 2e-6, TINY),
    ("expm1", tf.math.expm1, "exponential-minus-one", (-50, 50), 2e-6, TINY),
    ("log", tf.math.log, "log", (-10, 1e30), 2e-6, 1e-7),
    ("log1p", tf.math.log1p, "log-plus-one", (-2, 1e30), 2e-6, 1e-7),
    ("sigmoid", tf.math.sigmoid, "logistic", (-100, 100), 2e-6, TINY),
    ("sqrt", tf.sqrt, "sqrt", (-10, 1e30), 1e-6, 0),
    ("rsqrt", tf.math.rsqrt, "rsqrt", (-10, 1e30), 2e-6, 0),
    ("tanh", tf.tanh, "tanh", (-20, 20), 1e-5, 1e-7),
    ("sin", tf.sin, "sine", (-100, 100), 1e-5, 1e-6),
    ("cos", tf.cos, "cosine", (-100, 100), 1e-5, 1e-6),
    ("tan", tf.math.tan, "tan", (-1.5, 1.5), 1e-5, 1e-6),
    ("floor", tf.floor, "floor", (-1e6, 1e6), 0, 0),
    ("ceil", tf.math.ceil, "ceil", (-1e6, 1e6), 0, 0),
    ("round", tf.round, "round-nearest-even", (-1e3, 1e3), 0, 0),
    ("sign", tf.sign, "sign", (-1e3, 1e3), 0, 0),
    ("erf", tf.math.erf, "erf", (-6, 6), 1e-5, 1e-7),
    ("is_finite", tf.math.is_finite, "is-finite", (-1e30, 1e30), 0, 0),
]


@pytest.mark.parametrize("name,fn,opcode,domain,rtol,atol", UNARY_FLOAT, ids=[u[0] for u in UNARY_FLOAT])
def test_unary_float(name: str, fn, opcode: str, domain, rtol: float, atol: float) -> None:
    d = eu.Differential(lambda x: fn(x), np.zeros(16, np.float32))
    assert opcode in d.opcodes

    @HYP
    @given(floats((16,), *domain))
    def prop(x: np.ndarray) -> None:
        d.check(x, rtol=rtol, atol=max(atol, TINY))

    prop()
    # Half-way points and signed zeros, where rounding modes differ.
    d.check(np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0, -0.0, 0.49999997, -0.49999997,
                      1e-3, -1e-3, 3.0, -3.0, 7.25, -7.75], np.float32)
            .clip(*domain).astype(np.float32), rtol=rtol, atol=atol)


BINARY_FLOAT = [
    ("add", tf.add, "add", 0, 0),
    ("subtract", tf.subtract, "subtract", 0, 0),
    ("multiply", tf.multiply, "multiply", 0, 0),
    ("divide", tf.math.divide, "divide", 0, 0),
    ("truncatemod", tf.truncatemod, "remainder", 0, 0),
    ("floormod", tf.math.floormod, "remainder", 0, 0),
    ("pow", tf.pow, "power", 2e-6, TINY),
    ("maximum", tf.maximum, "maximum", 0, 0),
    ("minimum", tf.minimum, "minimum", 0, 0),
    ("atan2", tf.math.atan2, "atan2", 2e-6, 1e-7),
]


@pytest.mark.parametrize("name,fn,opcode,rtol,atol", BINARY_FLOAT, ids=[b[0] for b in BINARY_FLOAT])
def test_binary_float(name: str, fn, opcode: str, rtol: float, atol: float) -> None:
    d = eu.Differential(lambda x, y: fn(x, y), np.zeros(12, np.float32), np.zeros(12, np.float32))
    assert opcode in d.opcodes
    lim = 30.0 if name == "pow" else 1e3
    nan = name not in ("maximum", "minimum")  # see test_maximum_minimum_propagate_nan

    @HYP
    @given(floats((12,), -lim, lim, nan=nan), floats((12,), -lim, lim, nan=nan))
    def prop(x: np.ndarray, y: np.ndarray) -> None:
        d.check(x, y, rtol=rtol, atol=max(atol, TINY))

    prop()


def test_maximum_minimum_propagate_nan() -> None:
    """XLA's semantics: NaN in either operand gives NaN. Measured: TF 2.21's XLA CPU uses
    "fast" min/max (``a < b ? b : a``), which returns the first operand when the second is
    NaN and ignores NaNs in reductions; the emulator follows the semantics, so it agrees with
    XLA CPU only where the first operand is NaN (or there is no NaN)."""
    d = eu.Differential(lambda x, y: (tf.maximum(x, y), tf.minimum(x, y), tf.reduce_max(y)),
                        np.zeros(4, np.float32), np.zeros(4, np.float32))
    x = np.array([np.nan, 1.0, np.nan, -3.0], np.float32)
    y = np.array([1.0, np.nan, np.nan, 2.0], np.float32)
    got, expected = d.run(x, y)
    for k in (0, 1):
        assert np.isnan(got[k][:3]).all()
        eu.assert_same([got[k][[0, 2, 3]]], [expected[k][[0, 2, 3]]])
    assert np.isnan(got[2])
    d.check(x[[0, 3]].repeat(2), np.array([1, 2, 3, 4], np.float32))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_other_float_types(dtype: type) -> None:
    def fn(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, ...]:
        c = tf.constant([1.5, -2.25, 3.0, 0.1] * 8, dtype=x.dtype)  # a 16-bit literal
        return (x + y, x * y, x / y, tf.exp(x), tf.tanh(y), tf.maximum(x, y), tf.sqrt(tf.abs(x)),
                x * c, tf.reduce_sum(x * y), tf.cast(x, tf.float32))

    rng = np.random.default_rng(3)
    x = rng.uniform(-4, 4, 32).astype(dtype)
    y = rng.uniform(0.5, 4, 32).astype(dtype)
    rtol = {np.float64: 1e-12}.get(dtype, 1e-2)
    eu.check(fn, x, y, rtol=rtol, atol=1e-3 if rtol > 1e-6 else 0.0)


# ------------------------------------------------------------------ element-wise: integers

INT_BINARY = [
    ("add", tf.add, "add"),
    ("subtract", tf.subtract, "subtract"),
    ("multiply", tf.multiply, "multiply"),
    ("truncatediv", tf.truncatediv, "divide"),
    ("truncatemod", tf.truncatemod, "remainder"),
    ("floordiv", tf.math.floordiv, "divide"),
    ("maximum", tf.maximum, "maximum"),
    ("minimum", tf.minimum, "minimum"),
    ("and", tf.bitwise.bitwise_and, "and"),
    ("or", tf.bitwise.bitwise_or, "or"),
    ("xor", tf.bitwise.bitwise_xor, "xor"),
    ("shift_left", tf.bitwise.left_shift, "shift-left"),
    ("shift_right", tf.bitwise.right_shift, "shift-right-arithmetic"),
    ("pow", tf.pow, "power"),
]


@pytest.mark.parametrize("name,fn,opcode", INT_BINARY, ids=[b[0] for b in INT_BINARY])
def test_binary_int32(name: str, fn, opcode: str) -> None:
    d = eu.Differential(lambda x, y: fn(x, y), np.zeros(12, np.int32), np.ones(12, np.int32))
    assert opcode in d.opcodes

    @HYP
    @given(ints((12,)), ints((12,)))
    def prop(x: np.ndarray, y: np.ndarray) -> None:
        if name == "pow":
            y = (y % 40 - 5).astype(np.int32)  # small exponents, some negative
        d.check(x, y)

    prop()
    edge = np.array([np.iinfo(np.int32).min, 7, -7, 7, -7, 0, 5, -5, 1, -1, 3, 100], np.int32)
    div = np.array([-1, 2, 2, -2, -2, 0, 0, 0, 33, 32, -1, 7], np.int32)
    d.check(edge, div)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.int64, np.int8])
def test_integer_types(dtype: type) -> None:
    def fn(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (x + y, x - y, x * y, tf.truncatediv(x, y), tf.math.floormod(x, y),
                xla.shift_right_logical(x, y), xla.shift_right_arithmetic(x, y),
                xla.shift_left(x, y), tf.bitwise.invert(x), xla.max(x, y), xla.min(x, y),
                xla.lt(x, y), xla.ge(x, y), tf.cast(x, tf.float32))

    d = eu.Differential(fn, np.zeros(10, dtype), np.ones(10, dtype))
    assert {"shift-right-logical", "shift-right-arithmetic", "divide", "remainder"} <= d.opcodes

    @HYP
    @given(ints((10,), dtype), ints((10,), dtype))
    def prop(x: np.ndarray, y: np.ndarray) -> None:
        d.check(x, y)

    prop()


def test_unary_int_and_popcount() -> None:
    def fn(x: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.abs(x), tf.negative(x), tf.sign(x), tf.bitwise.invert(x),
                tf.raw_ops.PopulationCount(x=x), tf.cast(x, tf.float32), tf.cast(x, tf.int8))

    d = eu.Differential(fn, np.zeros(16, np.int32))
    assert {"popcnt", "not", "sign", "abs", "negate", "convert"} <= d.opcodes

    @HYP
    @given(ints((16,)))
    def prop(x: np.ndarray) -> None:
        d.check(x)

    prop()


def test_bool_logic_and_select() -> None:
    def fn(a: tf.Tensor, b: tf.Tensor, x: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.logical_and(a, b), tf.logical_or(a, b), tf.math.logical_xor(a, b),
                tf.logical_not(a), tf.where(a, x, -x), tf.cast(a, tf.float32),
                tf.cast(x, tf.bool), tf.equal(a, b))

    d = eu.Differential(fn, np.zeros(8, bool), np.zeros(8, bool), np.zeros(8, np.float32))
    assert {"and", "or", "not", "select"} <= d.opcodes

    @HYP
    @given(hnp.arrays(bool, (8,)), hnp.arrays(bool, (8,)), floats((8,)))
    def prop(a: np.ndarray, b: np.ndarray, x: np.ndarray) -> None:
        d.check(a, b, x)

    prop()


def test_compare_all_directions_with_nan() -> None:
    def fn(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return x == y, x != y, x < y, x <= y, x > y, x >= y

    d = eu.Differential(fn, np.zeros(9, np.float32), np.zeros(9, np.float32))
    x = np.array([np.nan, 1, np.nan, 0.0, -0.0, np.inf, -np.inf, 2, 1], np.float32)
    y = np.array([1, np.nan, np.nan, -0.0, 0.0, np.inf, np.inf, 1, 2], np.float32)
    d.check(x, y)
    di = eu.Differential(fn, np.zeros(4, np.uint32), np.zeros(4, np.uint32))
    di.check(np.array([0, 1, 2**31, 2**32 - 1], np.uint32), np.array([1, 1, 5, 0], np.uint32))


def test_clamp_and_clip() -> None:
    d = eu.Differential(lambda x, lo, hi: (xla.clamp(lo, x, hi), tf.clip_by_value(x, -1.0, 1.0)),
                        np.zeros(6, np.float32), np.zeros(6, np.float32), np.zeros(6, np.float32))
    # (TF lowers both to maximum/minimum; the clamp opcode is tested on hand-built IR.)
    d.check(np.array([-5, 0, 5, 2.0, 0.5, -0.5], np.float32), np.full(6, -1, np.float32),
            np.full(6, 1, np.float32))


# ------------------------------------------------------------------ conversions


def test_convert_float_to_int_saturates_and_nan_is_zero() -> None:
    def fn(x: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.cast(x, tf.int32), tf.cast(x, tf.int8), tf.cast(x, tf.uint8),
                tf.cast(x, tf.int64), tf.cast(x, tf.uint32), tf.cast(x, tf.float16),
                tf.cast(x, tf.bfloat16), tf.cast(x, tf.float64), tf.cast(x, tf.bool))

    d = eu.Differential(fn, np.zeros(12, np.float32))
    x = np.array([np.nan, np.inf, -np.inf, 3e9, -3e9, 2.9, -2.9, 255.5, -0.5, 1e20, 65504.0, 70000.0],
                 np.float32)
    d.check(x)

    @HYP
    @given(floats((12,), -1e10, 1e10))
    def prop(v: np.ndarray) -> None:
        d.check(v)

    prop()


def test_bitcast_convert_same_and_other_width() -> None:
    def fn(x: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return tf.bitcast(x, tf.int32), tf.bitcast(x, tf.uint8), tf.bitcast(tf.bitcast(x, tf.uint16), tf.float32)

    d = eu.Differential(fn, np.zeros((2, 3), np.float32))
    assert "bitcast-convert" in d.opcodes
    d.check(np.array([[1.5, -0.0, np.nan], [np.inf, 3e-3, -7]], np.float32))


@pytest.mark.parametrize("bits", [(5, 10), (8, 7), (4, 3), (8, 23), (11, 52)])
def test_reduce_precision(bits: tuple[int, int]) -> None:
    d = eu.Differential(lambda x: xla.reduce_precision(x, exponent_bits=bits[0], mantissa_bits=bits[1]),
                        np.zeros(16, np.float32))
    assert "reduce-precision" in d.opcodes

    @HYP
    @given(floats((16,), -1e6, 1e6) | floats((16,), -1e-3, 1e-3) | floats((16,), -1e38, 1e38))
    def prop(x: np.ndarray) -> None:
        d.check(x, rtol=0, atol=TINY)

    prop()


# ------------------------------------------------------------------ shapes and data movement


def test_shape_ops() -> None:
    def fn(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (
            tf.broadcast_to(x[:, None, :], [3, 2, 4]),
            xla.broadcast(y, [2]),
            tf.transpose(tf.reshape(x, [3, 2, 2]), [2, 0, 1]),
            x[::2, 1:4:2],
            tf.concat([x, x * 2, x[:, :1]], axis=1),
            tf.reverse(x, [0, 1]),
            xla.pad(x, tf.constant(-1.0), [1, -1], [-1, 2], [1, 0]),
            tf.range(6, dtype=tf.float32) + y[0],
            tf.reshape(x, [-1]),
        )

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.arange(5, dtype=np.float32)
    d = eu.Differential(fn, x, y)
    assert {"broadcast", "transpose", "slice", "concatenate", "reverse", "pad", "reshape"} <= d.opcodes
    d.check(x, y)


def test_empty_dimensions() -> None:
    def fn(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.reduce_sum(x, axis=0), tf.reduce_max(x, axis=1), x + 1, tf.matmul(x, y),
                tf.concat([x, x], axis=0), tf.transpose(x), tf.reduce_prod(x, axis=0),
                tf.reduce_sum(y))

    x, y = np.zeros((0, 3), np.float32), np.ones((3, 2), np.float32)
    module, expected = eu.lower(fn, x, y)
    # tf2xla turns zero-element arguments into constants: only y is an HLO parameter.
    exe = compile_module(module, TARGET)
    assert exe.parameters == [(np.dtype(np.float32), (3, 2))]
    eu.assert_same(exe.run([y]), expected)
    b = eu.IRBuilder("empty")
    p = b.parameter(np.float32, [0, 4])
    mx = b.computation(_scalar_fn("max", "maximum"))
    b.root(b.op("reduce", [p, b.constant(np.float32(-np.inf))], np.float32, [4], called=[mx], dimensions=[0]))
    got = compile_module(b.module(), TARGET).run([np.zeros((0, 4), np.float32)])
    np.testing.assert_array_equal(got[0], np.full(4, -np.inf, np.float32))


# ------------------------------------------------------------------ dot


def test_dot_general_batch_and_multiple_contractions() -> None:
    def fn(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        dn = xla.DotDimensionNumbers()
        dn.lhs_batch_dimensions.append(1)
        dn.rhs_batch_dimensions.append(2)
        dn.lhs_contracting_dimensions.extend([0, 3])
        dn.rhs_contracting_dimensions.extend([3, 0])
        return xla.dot_general(a, b, dn)

    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)   # [k0, batch, m, k1]
    b = rng.standard_normal((5, 6, 2, 3)).astype(np.float32)   # [k1, n, batch, k0]
    d = eu.Differential(fn, a, b)
    assert "dot" in d.opcodes
    d.check(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.int32, np.float64])
def test_dot_types(dtype: type) -> None:
    rng = np.random.default_rng(6)
    a = rng.uniform(-3, 3, (2, 5, 7)).round().astype(dtype)
    b = rng.uniform(-3, 3, (2, 7, 3)).round().astype(dtype)
    eu.check(lambda a, b: (tf.matmul(a, b), tf.einsum("bij,bjk->bik", a, b)), a, b, rtol=1e-3)


def test_dense_matmul_hypothesis() -> None:
    d = eu.Differential(lambda a, b: tf.matmul(a, b, transpose_b=True), np.zeros((5, 8), np.float32),
                        np.zeros((6, 8), np.float32))

    @HYP
    @given(floats((5, 8), -10, 10, specials=False), floats((6, 8), -10, 10, specials=False))
    def prop(a: np.ndarray, b: np.ndarray) -> None:
        d.check(a, b, rtol=1e-5, atol=1e-4)

    prop()


# ------------------------------------------------------------------ reduce, sort, map


def test_reductions() -> None:
    def fn(x: tf.Tensor, b: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.reduce_sum(x, axis=[0, 2]), tf.reduce_max(x, axis=1), tf.reduce_min(x),
                tf.reduce_prod(x, axis=2), tf.reduce_any(b, axis=0), tf.reduce_all(b, axis=1),
                tf.argmax(x, axis=1), tf.argmin(x, axis=2), tf.reduce_mean(x, axis=0))

    d = eu.Differential(fn, np.zeros((3, 4, 5), np.float32), np.zeros((3, 4), bool))
    assert {"reduce", "iota"} <= d.opcodes

    @HYP
    @given(floats((3, 4, 5), -10, 10, specials=False), hnp.arrays(bool, (3, 4)))
    def prop(x: np.ndarray, b: np.ndarray) -> None:
        d.check(x, b, rtol=1e-5, atol=1e-5)

    prop()
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    x[0, 0, :] = 7.0  # ties: argmax picks the first
    d.check(x, np.zeros((3, 4), bool), rtol=1e-5, atol=1e-5)


def test_variadic_reduce_and_integer_reduce() -> None:
    def fn(x: tf.Tensor, i: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.reduce_sum(i, axis=1), tf.reduce_max(i, axis=0), tf.math.argmax(i, axis=1),
                tf.reduce_sum(x, axis=[]))

    d = eu.Differential(fn, np.zeros((4, 6), np.float32), np.zeros((4, 6), np.int32))

    @HYP
    @given(floats((4, 6)), ints((4, 6)))
    def prop(x: np.ndarray, i: np.ndarray) -> None:
        d.check(x, i)

    prop()


def test_reduce_with_custom_reducer() -> None:
    # max(|a|, |b|): not a plain ufunc, but element-wise (vectorized tree path).
    @tf.function
    def absmax(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.maximum(tf.abs(a), tf.abs(b))

    def fn(x: tf.Tensor) -> tf.Tensor:
        return xla.reduce(x, tf.constant(0.0), [1], absmax.get_concrete_function(
            tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.float32)))

    x = np.random.default_rng(2).standard_normal((5, 7)).astype(np.float32)
    eu.check(fn, x)


def test_sort_and_argsort() -> None:
    def fn(x: tf.Tensor, k: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.sort(x, axis=1), tf.sort(x, axis=0, direction="DESCENDING"),
                tf.argsort(k, axis=1, stable=True), xla.key_value_sort(k, x)[1])

    d = eu.Differential(fn, np.zeros((4, 9), np.float32), np.zeros((4, 9), np.int32))
    assert "sort" in d.opcodes

    @HYP
    @given(floats((4, 9), -100, 100), hnp.arrays(np.int32, (4, 9), elements=st.integers(-3, 3)))
    def prop(x: np.ndarray, k: np.ndarray) -> None:
        got, expected = d.run(x, k)
        # tf.sort (TopK) and argsort are exact; key_value_sort is unstable in XLA: compare keys.
        eu.assert_same(got[:3], expected[:3])
        order = np.argsort(k, axis=1, kind="stable")
        assert np.array_equal(np.sort(k, axis=1), np.take_along_axis(k, order, axis=1))

    prop()


def test_variadic_sort_with_tf_comparator() -> None:
    @tf.function
    def by_abs_desc(a: tf.Tensor, b: tf.Tensor, i: tf.Tensor, j: tf.Tensor) -> tf.Tensor:
        return tf.abs(a) > tf.abs(b)

    spec = tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.float32)
    cmp = by_abs_desc.get_concrete_function(*spec, tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32))

    def fn(x: tf.Tensor, i: tf.Tensor) -> list[tf.Tensor]:
        return xla.variadic_sort([x, i], 1, cmp, True)

    x = np.array([[3, -3, 1, -5, 0, 2, -2, 1], [1, 1, -1, 4, -4, 0.5, 9, -9]], np.float32)
    i = np.arange(16, dtype=np.int32).reshape(2, 8)
    d = eu.Differential(fn, x, i)
    d.check(x, i)


def _scalar_fn(name: str, opcode: str, dtype: type = np.float32, wrap: bool = False) -> eu.IRBuilder:
    """A computation ``opcode(p0, p1)``; ``wrap`` adds a ``reshape`` (not element-wise safe),
    which forces the scalar fallback paths of reduce/sort/map."""
    sub = eu.IRBuilder(name)
    p0, p1 = sub.parameter(dtype, []), sub.parameter(dtype, [])
    if wrap:
        p0 = sub.op("reshape", [p0], dtype, [])
    out_dtype = bool if opcode == "compare" else dtype
    extra = {"direction": "GT", "compare_type": "FLOAT"} if opcode == "compare" else {}
    sub.root(sub.op(opcode, [p0, p1], out_dtype, [], **extra))
    return sub


def test_sort_with_general_comparator() -> None:
    # Sort by |x| descending, ties by value: comparator is not a plain compare (bitonic path).
    sub = eu.IRBuilder("cmp")
    p0 = sub.parameter(np.float32, [])
    p1 = sub.parameter(np.float32, [])
    a0 = sub.op("abs", [p0], np.float32, [])
    a1 = sub.op("abs", [p1], np.float32, [])
    gt = sub.op("compare", [a0, a1], bool, [], direction="GT", compare_type="FLOAT")
    eq = sub.op("compare", [a0, a1], bool, [], direction="EQ", compare_type="FLOAT")
    lt = sub.op("compare", [p0, p1], bool, [], direction="LT", compare_type="FLOAT")
    both = sub.op("and", [eq, lt], bool, [])
    sub.root(sub.op("or", [gt, both], bool, []))
    b = eu.IRBuilder("sort")
    x = b.parameter(np.float32, [2, 7])
    b.root(b.op("sort", [x], np.float32, [2, 7], called=[b.computation(sub)], dimension=1, is_stable=True))
    data = np.array([[3, -3, 1, -5, 0, 2, -2], [1, 1, -1, 4, -4, 0.5, 9]], np.float32)
    got = compile_module(b.module(), TARGET).run([data])[0]
    expected = np.array([sorted(row, key=lambda v: (-abs(v), v)) for row in data], np.float32)
    np.testing.assert_array_equal(got, expected)


def test_scalar_fallbacks_for_non_elementwise_computations() -> None:
    b = eu.IRBuilder("fallbacks")
    x = b.parameter(np.float32, [3, 5])
    add = b.computation(_scalar_fn("add", "add", wrap=True))
    gt = b.computation(_scalar_fn("gt", "compare", wrap=True))
    mul = b.computation(_scalar_fn("mul", "multiply", wrap=True))
    red = b.op("reduce", [x, b.constant(np.float32(1))], np.float32, [3], called=[add], dimensions=[1])
    srt = b.op("sort", [x], np.float32, [3, 5], called=[gt], dimension=1, is_stable=True)
    mp = b.op("map", [x, x], np.float32, [3, 5], called=[mul], dimensions=[0, 1])
    b.root(b.tuple([red, srt, mp]))
    data = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    got = compile_module(b.module(), TARGET).run([data])
    np.testing.assert_allclose(got[0], data.sum(axis=1) + 1, rtol=1e-6)
    np.testing.assert_array_equal(got[1], -np.sort(-data, axis=1))
    np.testing.assert_array_equal(got[2], data * data)


def test_dead_code_is_removed_and_not_refused() -> None:
    b = eu.IRBuilder("dce")
    x = b.parameter(np.float32, [4])
    b.op("custom-call", [x], np.float32, [4], custom_call_target="unused")
    y = b.op("add", [x, x], np.float32, [4])
    b.root(b.op("copy", [y], np.float32, [4]))
    exe = compile_module(b.module(), TARGET)
    assert exe.step_count == 1 and exe.instruction_count == 3
    np.testing.assert_array_equal(exe.run([np.ones(4, np.float32)])[0], np.full(4, 2, np.float32))


def test_map_and_total_order_compare_and_other_hand_built_ops() -> None:
    b = eu.IRBuilder("misc")
    x = b.parameter(np.float32, [8])
    i = b.parameter(np.int32, [8])
    clz = b.op("count-leading-zeros", [i], np.int32, [8])
    afz = b.op("round-nearest-afz", [x], np.float32, [8])
    cbrt = b.op("cbrt", [x], np.float32, [8])
    total = b.op("compare", [x, afz], bool, [8], direction="LT", compare_type="TOTALORDER")
    mul = b.computation(_scalar_fn("mul", "multiply"))
    mapped = b.op("map", [x, x], np.float32, [8], called=[mul], dimensions=[0])
    b.root(b.tuple([clz, afz, cbrt, total, mapped]))
    xs = np.array([0.5, -0.5, 2.5, -2.5, -0.0, np.nan, 0.49999997, -27], np.float32)
    ints_ = np.array([0, 1, -1, 255, 256, 2**31 - 1, 16, 3], np.int32)
    got = compile_module(b.module(), TARGET).run([xs, ints_])
    np.testing.assert_array_equal(got[0], [32 - int(v).bit_length() if v >= 0 else 0 for v in ints_])
    np.testing.assert_array_equal(got[1], [1, -1, 3, -3, -0.0, np.nan, 0, -27])
    np.testing.assert_allclose(got[2], np.cbrt(xs), rtol=1e-6)
    # Total order: -0.0 < +0.0 and NaN (positive) is above everything.
    np.testing.assert_array_equal(got[3], [True, False, True, False, False, False, False, False])
    np.testing.assert_array_equal(got[4], xs * xs)


def test_complex_and_plumbing_ops() -> None:
    def fn(re: tf.Tensor, im: tf.Tensor) -> tuple[tf.Tensor, ...]:
        z = tf.complex(re, im)
        w = z * z + tf.exp(z)
        a, b = xla.optimization_barrier(re, im)
        return tf.math.real(w), tf.math.imag(w), tf.abs(z), a + b, w

    d = eu.Differential(fn, np.zeros(6, np.float32), np.zeros(6, np.float32))
    assert {"complex", "real", "imag", "opt-barrier"} <= d.opcodes
    rng = np.random.default_rng(8)
    d.check(rng.uniform(-2, 2, 6).astype(np.float32), rng.uniform(-2, 2, 6).astype(np.float32),
            rtol=1e-5, atol=1e-6)


def test_rng_distributions_and_token_ops() -> None:
    b = eu.IRBuilder("rng")
    n = 20000
    u = b.op("rng", [b.constant(np.float32(2)), b.constant(np.float32(5))], np.float32, [n],
             distribution="uniform")
    g = b.op("rng", [b.constant(np.float32(1)), b.constant(np.float32(2))], np.float32, [n],
             distribution="normal")
    k = b.op("rng", [b.constant(np.int32(0)), b.constant(np.int32(10))], np.int32, [n],
             distribution="uniform")
    x = b.parameter(np.float32, [3, 4])
    size = b.op("get-dimension-size", [x], np.int32, [], dimension=1)
    tok = b.op("after-all", [], None, [])
    b.shape(tok).Clear()
    b.shape(tok).dtype = ir_pb2.TOKEN
    dep = b.op("add-dependency", [size, tok], np.int32, [])
    clamp = b.op("clamp", [b.constant(np.float32(-1)), x, b.constant(np.float32(1))], np.float32, [3, 4])
    b.root(b.tuple([u, g, k, dep, clamp]))
    exe = compile_module(b.module(), TARGET)
    xs = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    a = exe.run([xs])
    again = exe.run([xs])
    assert not np.array_equal(a[0], again[0])  # a new stream per call
    uni, nor, ints_, dim, clamped = a
    assert 2 <= uni.min() and uni.max() < 5 and abs(uni.mean() - 3.5) < 0.03
    assert abs(nor.mean() - 1) < 0.05 and abs(nor.std() - 2) < 0.05
    assert set(np.unique(ints_)) == set(range(10))
    assert dim == 4
    np.testing.assert_array_equal(clamped, np.clip(xs, -1, 1))


# ------------------------------------------------------------------ control flow


def test_while_with_dynamic_trip_count() -> None:
    def fn(n: tf.Tensor, x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.while_loop(lambda i, x: i < n, lambda i, x: (i + 1, x * 1.5 + 1.0), (0, x))

    d = eu.Differential(fn, np.int32(3), np.ones(4, np.float32))
    assert "while" in d.opcodes and "call" in d.opcodes
    for n in (0, 1, 5, 17):
        d.check(np.int32(n), np.arange(4, dtype=np.float32))
    assert d.exe.estimate.per_iteration_loops == 1  # the bound is a parameter


def test_while_with_constant_trip_count_is_estimated_per_trip() -> None:
    def fn(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.while_loop(lambda i, x: i < 10, lambda i, x: (i + 1, tf.matmul(x, x)), (0, x))

    d = eu.Differential(fn, np.eye(8, dtype=np.float32))
    d.check(np.eye(8, dtype=np.float32) * 0.5)
    entry = next(c for c in d.module.computations if c.id == d.module.entry_computation_id)
    loop = next(i for i in entry.instructions if i.opcode == "while")
    assert while_trip_count(d.module, loop, {i.id: i for i in entry.instructions}) == 10
    est = d.exe.estimate
    assert est.per_iteration_loops == 0
    assert est.flops >= 10 * 2 * 8 * 8 * 8


def test_conditional_predicate_and_index() -> None:
    def fn(i: tf.Tensor, x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        a = tf.cond(x[0] > 0, lambda: x * 2.0, lambda: x - 1.0)
        b = tf.switch_case(i, [lambda: x * 3.0, lambda: x + 5.0, lambda: -x])
        return a, b

    d = eu.Differential(fn, np.int32(0), np.zeros(3, np.float32))
    assert "conditional" in d.opcodes
    for i in (-1, 0, 1, 2, 7):
        for x0 in (1.0, -1.0):
            d.check(np.int32(i), np.array([x0, 2.0, 3.0], np.float32))


# ------------------------------------------------------------------ random numbers


def test_stateless_random_is_repeatable_and_uniform() -> None:
    fn = lambda s: (tf.random.stateless_uniform([20000], seed=s),  # noqa: E731
                    tf.random.stateless_normal([20000], seed=s))
    d = eu.Differential(fn, np.array([1, 2], np.int32))
    assert "rng-bit-generator" in d.opcodes
    a = d.exe.run([np.array([1, 2], np.int32)])
    b = d.exe.run([np.array([1, 2], np.int32)])
    c = d.exe.run([np.array([1, 3], np.int32)])
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], c[0])
    u, n = a
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1.0) < 0.03
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert hist.min() > 1800 and hist.max() < 2200


def test_rng_bit_generator_state_advances() -> None:
    def fn(state: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return xla.rng_bit_generator(2, state, [1000], dtype=tf.uint32)  # 2 = RNG_PHILOX

    state = np.array([7, 0, 1], np.uint64)
    d = eu.Differential(fn, state)
    s1, bits1 = d.exe.run([state])
    s2, bits2 = d.exe.run([s1])
    assert not np.array_equal(s1, state) and not np.array_equal(bits1, bits2)
    ones = np.unpackbits(bits1.view(np.uint8)).mean()
    assert abs(ones - 0.5) < 0.01


@pytest.mark.parametrize("algorithm", [1, 2])  # RNG_THREE_FRY, RNG_PHILOX
def test_rng_bit_generator_gives_xla_bits(algorithm: int) -> None:
    """A u64 state gives XLA's own Philox-4x32 / ThreeFry-2x32 bits and new state (its CPU
    backend's expansion, xla/hlo/builder/lib/prng.cc): every output width, odd shapes (block
    tails, ThreeFry's split dimension), scalars, and a counter whose low word wraps."""
    def bits(s: tf.Tensor) -> list[Any]:
        return [xla.rng_bit_generator(algorithm, s, shape, dtype=dtype)
                for dtype in (tf.uint8, tf.uint32, tf.uint64) for shape in ([3, 7], [4, 5], [], [9])]

    eu.check(bits, np.array([0x0123456789ABCDEF, 2**64 - 2], np.uint64), rtol=0)


def test_seeded_random_ops_and_dropout_match_xla() -> None:
    """TF's stateless random ops (a 3-word Philox state per op) and Keras' Dropout in training
    (its seed state a variable) draw exactly XLA's numbers, so a training step with dropout
    compares with XLA like one without (normal: Box-Muller's log/sin/cos, last bits)."""
    import keras

    seed = tf.constant([5, 9], tf.int32)
    eu.check(lambda s: (tf.random.stateless_uniform([7, 5], s), tf.random.stateless_uniform([9], s, 0, 50, tf.int32),
                        tf.random.stateless_uniform([3, 3], s, alg="threefry", dtype=tf.float64),
                        tf.random.stateless_uniform([5], s, dtype=tf.float16)), seed, rtol=0)
    eu.check(lambda s: tf.random.stateless_normal([64], s), seed, rtol=1e-6, atol=1e-6)

    keras.utils.set_random_seed(1)
    layer = keras.layers.Dropout(0.5)
    x = tf.constant(np.arange(1, 301, dtype=np.float32).reshape(3, 100))
    fn = tf.function(lambda x: layer(x, training=True), jit_compile=True)
    module, params, expected = eu.lower_step(fn, x)
    got = eu.run_ir(module, params)
    assert "rng-bit-generator" in {i.opcode for c in module.computations for i in c.instructions}
    assert 0 < np.count_nonzero(expected[0]) < x.shape[0] * x.shape[1]
    eu.assert_same(got, expected, rtol=0)  # the mask, the scaled values, the seed state


# ------------------------------------------------------------------ Keras train steps


def _mlp_step(optimizer: str) -> None:
    import keras

    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(4),
    ])
    opt = keras.optimizers.SGD(0.05, momentum=0.9) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 6)).astype(np.float32))
    y = tf.constant(rng.integers(0, 4, 8).astype(np.int32))
    model.train_on_batch(x, y)  # create optimizer state outside the traced step
    step = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=True)
    for k in range(2):  # the second step starts from the updated state
        module, params, expected = eu.lower_step(step, x, y)
        exe = compile_module(module, TARGET)
        assert exe.aliases and all(p >= 2 for p in exe.aliases.values())
        eu.assert_same(exe.run(params), expected, rtol=1e-5, atol=1e-7, what=f"{optimizer} step {k}")
    opcodes = {i.opcode for c in module.computations for i in c.instructions}
    assert {"dot", "reduce", "maximum"} <= opcodes


def test_keras_mlp_train_step_sgd_momentum() -> None:
    _mlp_step("sgd")


def test_keras_mlp_train_step_adam() -> None:
    _mlp_step("adam")


# ------------------------------------------------------------------ errors and switches


def _dense_model_module() -> ir_pb2.Module:
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense_1")], name="sequential")
    x = np.ones((2, 3), np.float32)
    module, _ = eu.lower(lambda x: model(x), x)
    return module


def test_refused_opcode_names_opcode_and_layer() -> None:
    module = _dense_model_module()
    with pytest.raises(UnsupportedOpError) as err:
        compile_module(module, TARGET, CompileOptions(refuse_opcodes=frozenset({"dot"})))
    msg = str(err.value)
    assert "'dot'" in msg and "Keras layer 'dense_1'" in msg and "/MatMul" in msg


def test_unregistered_custom_call_targets_and_unknown_opcodes_are_refused() -> None:
    b = eu.IRBuilder()
    x = b.parameter(np.float32, [2])
    b.root(b.op("custom-call", [x], np.float32, [2], source_op="functional/conv2d/Foo",
                custom_call_target="foo"))
    with pytest.raises(UnsupportedOpError, match="custom-call.*target 'foo'"):
        compile_module(b.module(), TARGET)
    b = eu.IRBuilder()
    x = b.parameter(np.float32, [2])
    b.root(b.op("all-reduce", [x], np.float32, [2], source_op="gradient_tape/model/conv2d/AllReduce"))
    with pytest.raises(UnsupportedOpError, match=r"all-reduce.*conv2d \(backward\)"):
        compile_module(b.module(), TARGET)


def test_fault_injection_changes_results() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    module, expected = eu.lower(lambda x: tf.matmul(x, tf.transpose(x)) + 1.0, x)
    clean = eu.run_ir(module, [x])
    eu.assert_same(clean, expected)
    faulty = eu.run_ir(module, [x], options=CompileOptions(fault_inject_opcode="dot"))
    assert not np.allclose(faulty[0], expected[0], rtol=1e-3)
    module_i, expected_i = eu.lower(lambda i: i * 3, np.arange(4, dtype=np.int32))
    faulty_i = eu.run_ir(module_i, [np.arange(4, dtype=np.int32)],
                         options=CompileOptions(fault_inject_opcode="multiply"))
    np.testing.assert_array_equal(faulty_i[0], expected_i[0] + 1)


def test_run_validates_arguments() -> None:
    module, _ = eu.lower(lambda x, y: x + y, np.zeros(3, np.float32), np.zeros(3, np.float32))
    exe = compile_module(module, TARGET)
    with pytest.raises(ExecutionError, match="takes 2 arguments"):
        exe.run([np.zeros(3, np.float32)])
    with pytest.raises(ExecutionError, match=r"parameter 1 .*f.*\[3\].*\[4\]"):
        exe.run([np.zeros(3, np.float32), np.zeros(4, np.float32)])
    with pytest.raises(ExecutionError, match="parameter 0.*float32.*int32"):
        exe.run([np.zeros(3, np.int32), np.zeros(3, np.float32)])


def test_run_is_thread_safe() -> None:
    def fn(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        h = tf.nn.relu(tf.matmul(x, w))
        return tf.reduce_sum(tf.matmul(h, w, transpose_b=True) * x, axis=1)

    rng = np.random.default_rng(9)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    inputs = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(8)]
    module, _ = eu.lower(fn, inputs[0], w)
    exe = compile_module(module, TARGET)
    expected = [exe.run([x, w])[0] for x in inputs]
    failures: list[str] = []

    def worker(k: int) -> None:
        for _ in range(30):
            j = (k + _) % len(inputs)
            if not np.array_equal(exe.run([inputs[j], w])[0], expected[j]):
                failures.append(f"thread {k} input {j}")

    eu.run_in_threads(worker)
    assert not failures


# ------------------------------------------------------------------ targets and estimates


def test_targets() -> None:
    gc2, gc200, bow = get_target("ipu1"), get_target("ipu2"), get_target("bow")
    assert (gc2.tiles_per_ipu, gc2.sram_bytes_per_tile) == (1216, 262_144)
    assert (gc200.tiles_per_ipu, gc200.sram_bytes_per_tile) == (1472, 638_976)
    assert get_target("ipu21") == bow and bow.clock_hz == 1.85e9
    assert get_target("ipu2", tiles_per_ipu=4).tiles_per_ipu == 4
    with pytest.raises(ValueError, match=r"'ipu3'.*'ipu1'.*'ipu2'.*'bow'.*'ipu21'"):
        get_target("ipu3")
    with pytest.raises(ValueError, match="tiles_per_ipu"):
        get_target("ipu1", tiles_per_ipu=5000)


def test_estimate_and_out_of_memory() -> None:
    x = np.zeros((256, 256), np.float32)
    module, _ = eu.lower(lambda a, b: tf.nn.relu(tf.matmul(a, b)), x, x)
    exe = compile_module(module, TARGET)
    est = exe.estimate
    assert est.fits and est.cycles > 0 and est.seconds == pytest.approx(est.cycles / TARGET.clock_hz)
    assert est.flops >= 2 * 256**3
    assert est.total_bytes >= 3 * 256 * 256 * 4
    d = est.to_dict()
    assert d["ipu_version"] == "ipu2" and d["tiles_per_ipu"] == 1472 and d["assumptions"]
    fp32_cycles = 2 * 256**3 / (TARGET.amp_fp32_flops_per_cycle_per_tile * 1472)
    assert est.cycles >= fp32_cycles
    small = get_target("ipu1", tiles_per_ipu=2)
    with pytest.raises(OutOfMemoryError, match=r"Out of memory on tile .* bytes used but tiles only have 262144 bytes"):
        compile_module(module, small)
    exe = compile_module(module, small, CompileOptions(allow_out_of_memory=True))
    assert not exe.estimate.fits and exe.estimate.peak_tile_bytes > 262_144


def test_layer_of() -> None:
    assert layer_of("sequential/dense_1/MatMul") == "dense_1"
    assert layer_of("gradient_tape/sequential/conv2d/Conv2DBackpropFilter") == "conv2d (backward)"
    assert layer_of("XLA_Args") == "" and layer_of("adam/Sqrt") == ""
    # Keras 3 in a traced tf.function: every scope uniquified once.
    assert layer_of("sequential_1/dense_1/MatMul") == "dense"
    assert layer_of("gradient_tape/functional_1/conv2d_3_1/Conv2D") == "conv2d_3 (backward)"
    # The backward pass of a step of the device loop; a pipeline stage's scope.
    assert layer_of("gradient_tape/tf_ipu_device_loop/bert_1/attention_1/MatMul") == \
        "attention (backward)"
    assert layer_of("tf_ipu_device_loop/sequential_2_1/tf_ipu_stage_0_1/dense_7_1/MatMul") == \
        "dense_7"


def test_converter_refuses_unknown_hlo_fields() -> None:
    from tensorflow.compiler.xla.service import hlo_pb2

    HloConversionError = eu.converter.HloConversionError  # noqa: N806

    x = np.ones(3, np.float32)
    hlo = hlo_pb2.HloModuleProto.FromString(eu.hlo_of(lambda x: x * 2.0, x))
    instr = next(i for c in hlo.computations for i in c.instructions if i.opcode == "multiply")
    instr.replica_groups.add().replica_ids.extend([0, 1])
    with pytest.raises(HloConversionError, match=r"multiply.*TF op 'mul'.*replica_groups"):
        eu.hlo_module_to_ir(hlo.SerializeToString())


def test_interpreter_overhead_per_instruction() -> None:
    """A chain of 400 scalar ops: run time per executed step, well under 10 us."""
    def fn(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        for k in range(100):
            x = tf.maximum(x * y + y, x - float(k))
        return x

    module, _ = eu.lower(fn, np.float32(1), np.float32(0.5))
    exe = compile_module(module, TARGET)
    args = [np.asarray(np.float32(1)), np.asarray(np.float32(0.5))]
    exe.run(args)
    runs = 50
    start = time.perf_counter()
    for _ in range(runs):
        exe.run(args)
    per_step = (time.perf_counter() - start) / runs / exe.step_count
    print(f"\ninterpreter: {exe.step_count} steps, {per_step * 1e6:.2f} us per step")
    assert exe.step_count >= 300
    assert per_step < 10e-6


def test_wrong_operand_count_is_an_invalid_program() -> None:
    """A malformed program (here `subtract` with one operand, as a fuzzer sent) is refused
    at compile time naming the opcode and the counts, not failed with an internal error."""
    b = eu.IRBuilder("malformed")
    p = b.parameter(np.float32, [3])
    b.root(b.op("subtract", [p], np.float32, [3]))
    with pytest.raises(InvalidProgramError, match=r"'subtract' takes 2 operand\(s\), received 1"):
        compile_module(b.module(), get_target("ipu2"))
