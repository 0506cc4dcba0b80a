"""The emulator's fast paths: generated code, inline scalar arithmetic, lazy broadcasts,
reshape chains and the arg-max/arg-min reduction.

Each fast path must give what the general path gives (bit for bit, NaNs included) and agree
with XLA on CPU as the differential tests of ``test_emulator_core.py`` do.
"""

from __future__ import annotations

import emulator_util as eu
import numpy as np
import pytest
import tensorflow as tf

from device_server.emulator import ExecutionError, compile_module, get_target
from device_server.emulator.kernels import reduce as reduce_kernels

TARGET = get_target("ipu2")


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------------- scalar chains


def test_scalar_chains_match_xla() -> None:
    """Scalar float and integer arithmetic, comparisons, selects and conversions (inline
    Python operators on numpy scalars) give XLA's results and dtypes."""

    def fn(x: tf.Tensor, y: tf.Tensor, i: tf.Tensor, j: tf.Tensor) -> tuple[tf.Tensor, ...]:
        a = x * y + y - x / y
        b = tf.where(x < y, a, -a)
        c = tf.where(i >= j, i * j + 7, i - j)
        d = tf.cast(x * 1e10, tf.int32)  # saturates
        e = tf.cast(i, tf.float32) / tf.cast(j, tf.float32)
        f = tf.cast(tf.equal(x, y), tf.float32) + tf.cast(tf.not_equal(i, j), tf.float32)
        g = tf.pow(x, y) - tf.sqrt(tf.abs(y))
        return a, b, c, d, e, f, g, -x, i * i * i * i  # the last one wraps

    d = eu.Differential(fn, np.float32(1), np.float32(1), np.int32(1), np.int32(1))
    cases = [
        (1.5, 2.25, 3, 4), (-3.0, 0.5, -7, 2), (0.0, 0.0, 0, 0), (2.0, -0.0, 2**20, 3),
        (np.inf, 1.0, -(2**31), -1), (-1e-3, 7.0, 2**31 - 1, 2**31 - 1), (np.nan, 1.0, 5, 5),
    ]
    for x, y, i, j in cases:
        d.check(np.float32(x), np.float32(y), np.int32(i), np.int32(j), rtol=1e-6)


def test_scalar_float_to_int_conversions_saturate() -> None:
    def fn(x: tf.Tensor, z: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.cast(x, tf.int32), tf.cast(x, tf.uint8), tf.cast(x, tf.int64),
                tf.cast(z, tf.int32))

    d = eu.Differential(fn, np.float32(0), np.float64(0))
    for v in (0.0, -0.5, 0.99, -1.5, 255.9, 256.0, 3e9, -3e9, 1e30, np.inf, -np.inf):
        d.check(np.float32(v), np.float64(v))
    # NaN -> 0 (the emulator's documented choice; XLA leaves it unspecified).
    got = d.exe.run([np.asarray(np.float32(np.nan)), np.asarray(np.float64(np.nan))])
    assert [int(g) for g in got] == [0, 0, 0, 0]


# ------------------------------------------------------------------- broadcasts, reshapes


def test_broadcasts_into_elementwise_ops_match_xla() -> None:
    """Broadcasts feeding element-wise ops stay unexpanded (numpy broadcasting); others, and
    broadcast results that leave the computation, are expanded."""

    def fn(x: tf.Tensor, b: tf.Tensor, c: tf.Tensor, s: tf.Tensor) -> tuple[tf.Tensor, ...]:
        bias = x + b                                  # trailing dimension
        rows = x * c[:, None]                         # leading dimension: reshaped view
        masked = tf.where(x > s, x, s * 2.0)          # scalars into select and compare
        both = tf.broadcast_to(b, [4, 5]) + tf.broadcast_to(c[:, None], [4, 5])
        out = tf.broadcast_to(b, [3, 4, 5])           # leaves the computation
        used_twice = tf.broadcast_to(b, [4, 5])
        mm = tf.matmul(used_twice, tf.transpose(used_twice)) + used_twice[:, :4]
        return bias, rows, masked, both, out, mm

    rng = np.random.default_rng(0)
    args = (rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32),
            rng.standard_normal(4).astype(np.float32), np.float32(0.25))
    d = eu.Differential(fn, *args)
    got, expected = d.run(*args)
    eu.assert_same(got, expected, rtol=1e-6)
    for g in got:
        assert g.flags.c_contiguous and g.flags.writeable


def test_reshape_chains_are_composed() -> None:
    def fn(x: tf.Tensor) -> tuple[tf.Tensor, ...]:
        a = tf.reshape(tf.reshape(tf.reshape(x, [6, 4]), [2, 12]), [24])
        back = tf.reshape(tf.reshape(x, [24]), [2, 3, 4]) * 2.0
        s = tf.reshape(tf.reshape(tf.reduce_sum(x), [1]), []) + 1.0
        return a, back, s, tf.reshape(a, [4, 6])

    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    module = eu.check(fn, x, rtol=0)
    exe = compile_module(module, TARGET)
    assert exe.step_count <= 6  # the reshapes of reshapes collapse


def test_common_subexpressions_run_once() -> None:
    """As Adam's bias corrections, once per variable it updates: the same ops of the same
    operands (and equal constants) are one step, with XLA's results."""
    def fn(t: tf.Tensor, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, ...]:
        outs = []
        for v in (x, y, x):
            step = tf.cast(t + 1, tf.float32)
            corr = tf.sqrt(1.0 + step * 0.999) / (1.0 + step * 0.9)
            outs.append(v * corr)
        return tuple(outs)

    rng = np.random.default_rng(0)
    args = (np.int64(3), rng.standard_normal((4, 5)).astype(np.float32),
            rng.standard_normal((4, 5)).astype(np.float32))
    module = eu.check(fn, *args, rtol=0)
    exe = compile_module(module, TARGET)
    # t + 1, convert, 2 x (multiply, add), sqrt, divide: once; x * corr, y * corr; the tuple
    # (the third output is the first's value, given as its own array)
    assert exe.step_count <= 11, exe.step_count
    a, b, c = exe.run(list(args))
    assert np.array_equal(a, c) and not np.shares_memory(a, c)  # equal values, own arrays


# ---------------------------------------------------------------------- arg-max / arg-min


def _argfns(x: tf.Tensor) -> tuple[tf.Tensor, ...]:
    return (tf.argmax(x, axis=1, output_type=tf.int32), tf.argmin(x, axis=0, output_type=tf.int32),
            tf.argmax(x, axis=2), tf.argmin(x, axis=2, output_type=tf.int32))


def _cases(nan: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    out = []
    for k in range(12):
        x = rng.standard_normal((3, 5, 6)).astype(np.float32)
        if k % 3 == 0:
            x = np.round(x)  # many ties
        if k % 4 == 1:
            x[rng.random(x.shape) < 0.3] = 0.0
            x[rng.random(x.shape) < 0.3] = -0.0
        if k % 4 == 2:
            x[rng.random(x.shape) < 0.2] = -np.inf
            x[0, :, :] = -np.inf  # whole rows at the init value
        if k % 4 == 3:
            x[rng.random(x.shape) < 0.2] = np.inf
        if nan and k % 2:
            x[rng.random(x.shape) < 0.15] = np.nan
        out.append(x)
    return out


def test_argminmax_fast_path_matches_xla() -> None:
    d = eu.Differential(_argfns, np.zeros((3, 5, 6), np.float32))
    for x in _cases(nan=False):
        d.check(x)


def test_argminmax_fast_path_is_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit what the reducer applied by the general (tree) path gives, NaNs included."""
    module = eu.hlo_module_to_ir(eu.hlo_of(_argfns, np.zeros((3, 5, 6), np.float32)))
    fast = compile_module(module, TARGET)
    monkeypatch.setattr(reduce_kernels, "_argminmax", lambda ctx, dims: None)
    general = compile_module(module, TARGET)
    for x in _cases(nan=True):
        for a, b in zip(fast.run([x]), general.run([x]), strict=True):
            assert _bits_equal(a, b)


def test_variadic_reduce_with_other_reducer_is_not_taken_for_argmax() -> None:
    """A (value, index) reduce whose reducer keeps the last maximum is not the pattern."""
    def keep_last(x: tf.Tensor) -> tf.Tensor:
        n = x.shape[1]
        return n - 1 - tf.argmax(tf.reverse(x, [1]), axis=1, output_type=tf.int32)

    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [-1, 5, 0, 5]], np.float32)
    eu.check(keep_last, x)


# ----------------------------------------------------------------- generated code: errors


def _set_size_module(inside_while: bool) -> object:
    """``set-dimension-size`` with a run-time size: the kernel fails unless it is 4."""
    body = eu.IRBuilder("body")
    p = body.parameter(np.int32, [])
    x = body.op("broadcast", [p], np.int32, [4], dimensions=[])
    y = body.op("set-dimension-size", [x, p], np.int32, [4], source_op="model/dense/Reshape",
                dimension=0)
    body.root(body.op("reduce", [y, body.constant(0, np.int32)], np.int32, [], dimensions=[0],
                      called=[0]))
    add = eu.IRBuilder("add")
    a, b = add.parameter(np.int32, []), add.parameter(np.int32, [])
    add.root(add.op("add", [a, b], np.int32, []))
    if not inside_while:
        cid = body.computation(add)
        next(i for i in body._comp.instructions if i.opcode == "reduce").called_computations[:] = [cid]
        return body.module()
    top = eu.IRBuilder("top")
    n = top.parameter(np.int32, [])
    cond = eu.IRBuilder("cond")
    c = cond.parameter(np.int32, [])
    cond.root(cond.op("compare", [c, cond.constant(100, np.int32)], np.bool_, [], direction="LT"))
    cond_id = top.computation(cond)
    body_id = top.computation(body)
    add_id = top.computation(add)
    for comp in top._module.computations:
        for i in comp.instructions:
            if i.opcode == "reduce":
                i.called_computations[:] = [add_id]
    top.root(top.op("while", [n], np.int32, [], source_op="model/while", called=[cond_id, body_id]))
    return top.module()


def test_kernel_failure_names_the_instruction() -> None:
    exe = compile_module(_set_size_module(False), TARGET)
    assert int(exe.run([np.asarray(4, np.int32)])[0]) == 16
    with pytest.raises(ExecutionError, match=r"set-dimension-size.*model/dense/Reshape.*dynamic shapes"):
        exe.run([np.asarray(3, np.int32)])


def test_kernel_failure_inside_a_loop_names_both_instructions() -> None:
    exe = compile_module(_set_size_module(True), TARGET)
    with pytest.raises(ExecutionError, match=r"set-dimension-size.*while running.*opcode while"):
        exe.run([np.asarray(3, np.int32)])


# ------------------------------------------------------------------------ thread safety


def test_loop_with_scalar_state_is_thread_safe() -> None:
    """A training-style loop (scalar counters, bias corrections, matmuls) from 4 threads."""
    def fn(x: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, ...]:
        def body(i: tf.Tensor, w: tf.Tensor, m: tf.Tensor, t: tf.Tensor) -> tuple[tf.Tensor, ...]:
            xi = x[i]
            g = tf.matmul(xi, tf.nn.relu(tf.matmul(xi, w)), transpose_a=True)
            t = t + 1.0
            m = 0.9 * m + 0.1 * g
            w = w - 0.01 * m / (1.0 - tf.pow(0.9, t))
            return i + 1, w, m, t

        _, w, m, t = tf.while_loop(lambda i, *_: i < x.shape[0], body,
                                   (tf.constant(0), w, tf.zeros_like(w), tf.constant(0.0)))
        return w, tf.argmax(m, axis=1), t

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((6, 8, 8)).astype(np.float32) for _ in range(4)]
    w = (rng.standard_normal((8, 8)) * 0.1).astype(np.float32)
    module, expected = eu.lower(fn, xs[0], w)
    exe = compile_module(module, TARGET)
    eu.assert_same(exe.run([xs[0], w]), expected, rtol=1e-5, atol=1e-6)
    want = [exe.run([x, w]) for x in xs]
    failures: list[str] = []

    def worker(k: int) -> None:
        for r in range(10):
            j = (k + r) % len(xs)
            if not all(_bits_equal(a, b) for a, b in zip(exe.run([xs[j], w]), want[j], strict=True)):
                failures.append(f"thread {k} input {j}")

    eu.run_in_threads(worker)
    assert not failures


# ------------------------------------------------------------------------ bitwise select


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int8, np.bool_,
                                   np.uint64])
def test_bitwise_select_is_np_where(dtype: type) -> None:
    from device_server.emulator.kernels.elementwise import _bitwise_select

    rng = np.random.default_rng(1)
    for shape in ((16, 8, 8, 8), (32, 64)):  # the general path, and the +0-only path
        fn = _bitwise_select(np.dtype(dtype), shape)
        assert fn is not None
        raw = rng.integers(0, 256, (2, *shape, np.dtype(dtype).itemsize), dtype=np.uint8)
        if dtype is np.bool_:
            raw &= 1
        a, b = (np.ascontiguousarray(r).view(dtype).reshape(shape) for r in raw)  # NaN payloads too
        p = rng.random(shape) < 0.5
        zero, negzero = np.zeros((), dtype), np.asarray(-0.0).astype(dtype)
        for args in ((p, a, b), (p, a, zero), (p, a, negzero), (p[0], a, zero), (p, a[0], b),
                     (p, zero, b), (np.True_, a, b), (p, a.T.copy().T, b[..., ::-1])):
            assert _bits_equal(fn(*args), np.where(*args)), (shape, [np.shape(x) for x in args])


def test_large_selects_match_xla() -> None:
    def fn(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, ...]:
        relu_grad = tf.where(x > 0, y, tf.zeros_like(y))
        mixed = tf.where(x > y, x, y * 2.0)
        return relu_grad, mixed, tf.where(x < 0, tf.cast(x, tf.int32), tf.cast(y, tf.int32))

    rng = np.random.default_rng(2)
    x, y = (rng.standard_normal((16, 8, 8, 8)).astype(np.float32) for _ in range(2))
    x[0, 0, 0, :4] = [np.nan, -0.0, np.inf, -np.inf]
    eu.check(fn, x, y, rtol=0)


# --------------------------------------------------------------------------------- dot


def test_matrix_products_and_other_dots_match_xla() -> None:
    """The plain matrix product (operands or their transposes straight into np.matmul) and
    the dots that are not one (full contractions, vectors, batches) next to it."""

    def fn(a: tf.Tensor, b: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.matmul(a, b), tf.matmul(a, a, transpose_b=True), tf.matmul(b, b, transpose_a=True),
                tf.matmul(b, a, transpose_a=True, transpose_b=True), tf.tensordot(a, a, axes=2),
                tf.linalg.matvec(a, v), tf.tensordot(v, a, axes=[[0], [1]]),
                tf.einsum("ij,kj->ik", a, a), tf.einsum("bij,bjk->bik", tf.stack([a, a]), tf.stack([b, b])))

    rng = np.random.default_rng(4)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 5)).astype(np.float32)
    v = rng.standard_normal(7).astype(np.float32)
    eu.check(fn, a, b, v, rtol=1e-5, atol=1e-5)


def test_dot_contracting_every_dimension_of_matrices() -> None:
    """Rank-2 operands are not always a matrix product: a full contraction (hand-built IR)."""
    b = eu.IRBuilder("frobenius")
    x = b.parameter(np.float32, [3, 4])
    y = b.parameter(np.float32, [4, 3])
    full = b.op("dot", [x, y], np.float32, [], lhs_contracting_dimensions=[0, 1],
                rhs_contracting_dimensions=[1, 0])
    outer = b.op("dot", [x, y], np.float32, [3, 4, 4, 3])
    b.root(b.tuple([full, outer]))
    rng = np.random.default_rng(6)
    xv = rng.standard_normal((3, 4)).astype(np.float32)
    yv = rng.standard_normal((4, 3)).astype(np.float32)
    got = compile_module(b.module(), TARGET).run([xv, yv])
    np.testing.assert_allclose(got[0], np.sum(xv * yv.T), rtol=1e-5)
    np.testing.assert_allclose(got[1], np.multiply.outer(xv, yv), rtol=1e-6)


def _input_gradient_fp16_reference(x: np.ndarray, k1: np.ndarray, k3: np.ndarray) -> tuple[np.ndarray, ...]:
    """The float16 program of ``test_input_gradients_read_the_kernel_transposed_in_place``
    as the IPU computes it, each convolution in float64 (standing for FP32 partials) and
    rounded to FP16 where the program has an FP16 result: ``y1``, the two input gradients
    (of ``2 * y1`` through ``k1``, of the constant 1.5 through ``k3``; the doubling is exact)
    and their sum. Returns (gradient, y1, and the two partial gradients)."""
    f64, f16 = np.float64, np.float16
    x64, k1_64, k3_64 = (tf.constant(a.astype(f64)) for a in (x, k1, k3))
    y1 = tf.nn.conv2d(x64, k1_64, 1, "VALID").numpy().astype(f16)
    g1 = tf.nn.conv2d_transpose(tf.constant(2 * y1.astype(f64)), k1_64, x.shape, 1, "VALID")
    dy3 = tf.constant(np.full((*x.shape[:3], k3.shape[3]), 1.5, f64))
    g3 = tf.nn.conv2d_transpose(dy3, k3_64, x.shape, 1, "SAME")
    g1, g3 = g1.numpy().astype(f16), g3.numpy().astype(f16)
    return (g1.astype(f64) + g3).astype(f16), y1, g1, g3


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_input_gradients_read_the_kernel_transposed_in_place(dtype: type) -> None:
    """An input gradient contracts the kernel over its output features: the kernel is a
    transposed view straight into the matrix product (1x1: pointwise; 3x3: reversed, copied;
    float16: converted). float32 against XLA; float16 against the program computed in
    float64 and rounded to FP16 at the program's FP16 results
    (``_input_gradient_fp16_reference``), standing for the IPU's FP16 convolutions (FP32
    partials, one rounding each). Bound: the FP32 sums of at most 360 products are within
    360 * 2^-24 relative of float64, which moves each rounding by at most one ulp: y1 within
    1 ulp, the gradient within ulp(g1) + ulp(g3) + ulp(gradient). (XLA's float16 program is
    no reference: how it accumulates FP16 depends on the host's instruction set.)"""

    def fn(x: tf.Tensor, k1: tf.Tensor, k3: tf.Tensor) -> tuple[tf.Tensor, ...]:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y1 = tf.nn.conv2d(x, k1, 1, "VALID")
            y3 = tf.nn.conv2d(x, k3, 1, "SAME")
            loss = tf.reduce_sum(y1 * y1) + tf.reduce_sum(y3 * tf.cast(1.5, x.dtype))
        return tape.gradient(loss, x), y1

    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 6, 5, 24)).astype(dtype)
    k1 = (rng.standard_normal((1, 1, 24, 40)) / 5).astype(dtype)
    k3 = (rng.standard_normal((3, 3, 24, 40)) / 10).astype(dtype)
    if dtype == np.float32:
        eu.check(fn, x, k1, k3, rtol=1e-5, atol=1e-5)
        return
    module, _ = eu.lower(fn, x, k1, k3)
    grad, y1 = eu.run_ir(module, [x, k1, k3])
    want, want_y1, g1, g3 = _input_gradient_fp16_reference(x, k1, k3)
    assert grad.dtype == y1.dtype == np.float16

    def ulp(a: np.ndarray) -> np.ndarray:
        return np.spacing(np.abs(a)).astype(np.float64)

    assert np.all(np.abs(y1.astype(np.float64) - want_y1) <= ulp(want_y1))
    assert np.all(np.abs(grad.astype(np.float64) - want) <= ulp(g1) + ulp(g3) + ulp(want))
