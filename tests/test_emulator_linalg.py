"""Differential tests of the matrix, FFT and batch-norm kernels against XLA on CPU.

Covers ``cholesky``, ``triangular-solve``, ``fft``, ``batch-norm-training``/``-inference``/
``-grad`` and ``topk`` (kernels ``linalg.py``, ``fft.py``, ``norm.py``), the converter's
defaults for their attributes, and their tile plans. Each TF function is lowered and compiled
once per signature (``Differential``). Hypothesis then varies the values (15 examples, the
same as ``test_emulator_core``). XLA's own run is the reference.
Variants no TF op produces are checked on hand-built IR against numpy references: a right-side
solve, ``transpose_a=TRANSPOSE``, ``unit_diagonal``, an upper Cholesky, ``feature_index=0``,
and ``topk`` itself, which ``tf.math.top_k`` lowers to sort + slice.

Tolerances (the emulator computes in float64 and rounds once, XLA in the operand's type):

- float32 cholesky: ``rtol=1e-4, atol=1e-5``; float32 triangular-solve: ``rtol=atol=1e-4``
  (right-hand sides up to 10, so solutions near 0 carry absolute errors ~1e-5). Inputs are
  well conditioned (``m m^T / n + I`` with |m| <= 2, cond <= 1 + 4n, for Cholesky; diagonal
  entries of magnitude >= 1 against off-diagonal ones <= 1 for the solves), so XLA's float32
  error is ~cond x 1e-7. float64: ``rtol=1e-10``. Hand-built variants against numpy in
  float64: ``rtol=atol=1e-9``.
- fft: ``atol = 1e-5 x sqrt(N) x max|x|`` (N the transform size), about 50 times the error
  bound of a float32 FFT (eps x log2 N x ||x||_2). Inputs are finite: with infinities the NaN
  pattern depends on the FFT algorithm's order of operations.
- batch norm: ``rtol=atol=1e-4`` (gradients ``1e-3``; float16 ``1e-2``). XLA's CPU expansion
  computes the moments in float32, the variance as E[x^2] - E[x]^2: values stay within about
  [-4, 4] and every feature has a spread (variance ~1). For a constant feature XLA's
  ``x - mean`` is rounding noise, amplified by ``1/sqrt(eps)``; the emulator's is exactly 0.
- NaN/inf results of non-positive-definite Cholesky inputs must match exactly. For a
  singular triangle XLA's blocked inverse spreads NaN over more rows than the emulator
  (see ``kernels/linalg.py``): every emulator NaN must be non-finite in XLA, and finite
  values must agree.
"""

from __future__ import annotations

import emulator_util as eu
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensorflow.compiler.xla import xla_data_pb2 as xd
from tensorflow.compiler.xla.service import hlo_pb2

from device_server.emulator import InvalidProgramError, compile_module, get_target
from device_server.emulator.tiles import plan_module

HYP = settings(max_examples=15, deadline=None, derandomize=True)
TARGET = get_target("ipu2")
_DIFFS: dict[str, eu.Differential] = {}


def _differential(key: str, fn, *example) -> eu.Differential:  # noqa: ANN001 - any TF function
    """``fn`` lowered and compiled once per test session for the signature of ``example``."""
    if key not in _DIFFS:
        _DIFFS[key] = eu.Differential(fn, *example)
    return _DIFFS[key]


def values(shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0,
           dtype: type = np.float64) -> st.SearchStrategy[np.ndarray]:
    """Finite floats in [lo, hi] (no subnormals), as ``dtype``."""
    return hnp.arrays(np.float64, shape, elements=st.floats(lo, hi, allow_subnormal=False)).map(
        lambda a: a.astype(dtype))


def _lowered_without_empties(fn, *args) -> tuple[eu.ir_pb2.Module, list[np.ndarray]]:  # noqa: ANN001
    """TF turns empty arguments into constants: the module takes only the others."""
    module, expected = eu.lower(fn, *args)
    got = eu.run_ir(module, [a for a in args if a.size])
    eu.assert_same(got, expected)
    return module, expected


def _opcodes(module: eu.ir_pb2.Module) -> set[str]:
    return {i.opcode for c in module.computations for i in c.instructions}


# ---------------------------------------------------------------------------------- cholesky


def _spd(m: np.ndarray, junk: np.ndarray) -> np.ndarray:
    """A well-conditioned symmetric (Hermitian) positive definite batch from ``m``, with
    ``junk`` in the strict upper triangle (which a lower Cholesky must ignore)."""
    n = m.shape[-1]
    a = m @ np.conj(np.swapaxes(m, -1, -2)) / n + np.eye(n)
    return np.tril(a) + np.triu(junk, 1)


CHOLESKY_CASES = {
    "f32-batch": ((3, 4, 4), np.float32, dict(rtol=1e-4, atol=1e-5)),
    "f64-two-batch-dims": ((2, 1, 3, 3), np.float64, dict(rtol=1e-10)),
    "f32-1x1": ((1, 1), np.float32, dict(rtol=1e-6)),
}


@pytest.mark.parametrize("case", sorted(CHOLESKY_CASES))
@HYP
@given(data=st.data())
def test_cholesky_matches_xla(case: str, data: st.DataObject) -> None:
    shape, dtype, tol = CHOLESKY_CASES[case]
    m = data.draw(values(shape, -2, 2))
    junk = data.draw(values(shape, -1e3, 1e3))
    a = _spd(m, junk).astype(dtype)
    d = _differential(f"chol-{case}", lambda a: tf.linalg.cholesky(a), a)
    assert "cholesky" in d.opcodes
    d.check(a, **tol)


@HYP
@given(re=values((2, 3, 3), -2, 2), im=values((2, 3, 3), -2, 2))
def test_cholesky_complex_matches_xla(re: np.ndarray, im: np.ndarray) -> None:
    a = _spd(re + 1j * im, np.zeros_like(re)).astype(np.complex64)
    _differential("chol-c64", lambda a: tf.linalg.cholesky(a), a).check(a, rtol=1e-4, atol=1e-5)


def test_cholesky_of_non_positive_definite_matrices_matches_xla() -> None:
    """XLA's CPU answer: a negative or NaN pivot makes the whole matrix NaN; a zero or +inf
    pivot gives NaN on that diagonal entry only."""
    nan, inf = np.nan, np.inf
    cases = [
        [[1, 0], [0, 0]], [[1, 0], [0, -0.0]], [[1, 0], [0, -1]], [[1, 0], [nan, 1]],
        [[1, 0], [0, inf]], [[inf, 0], [0, 1]], [[inf, 0], [1, 1]], [[4, 0], [2, inf]],
        [[0, 0], [0, 0]], [[0, 0], [1, 1]], [[4, 0], [2, 1]], [[-4, 0], [0, 1]],
        [[4, nan], [2, 5]],  # NaN in the ignored triangle
    ]
    a = np.array(cases, np.float32)
    got = eu.check(lambda a: tf.linalg.cholesky(a), a)
    assert "cholesky" in _opcodes(got)
    big = np.stack([np.eye(5) * 3 + 0.5, np.eye(5) * 3 + 0.5]).astype(np.float64)
    big[1, 3, 3] = -10.0  # fails at the fourth column: the whole matrix is NaN
    eu.check(lambda a: tf.linalg.cholesky(a), big, rtol=1e-10)


def test_cholesky_of_empty_batches_and_matrices() -> None:
    _lowered_without_empties(lambda a: tf.linalg.cholesky(a), np.zeros((0, 3, 3), np.float32))
    _lowered_without_empties(lambda a: tf.linalg.cholesky(a), np.zeros((2, 0, 0), np.float32))


def _cholesky_module(n: int, dtype: type, lower: bool) -> eu.ir_pb2.Module:
    b = eu.IRBuilder("cholesky")
    a = b.parameter(dtype, [2, n, n])
    b.root(b.op("cholesky", [a], dtype, [2, n, n], lower=lower))
    return b.module()


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@HYP
@given(data=st.data())
def test_upper_cholesky_reads_the_upper_triangle(dtype: type, data: st.DataObject) -> None:
    m = data.draw(values((2, 4, 4), -2, 2))
    if dtype is np.complex128:
        m = m + 1j * data.draw(values((2, 4, 4), -2, 2))
    full = _spd(m, np.zeros((2, 4, 4))).astype(dtype)
    full = full + np.conj(np.swapaxes(np.tril(full, -1), -1, -2))  # the Hermitian matrix
    junk = data.draw(values((2, 4, 4), -1e3, 1e3))
    a = np.triu(full) + np.tril(junk, -1)
    got = eu.run_ir(_cholesky_module(4, dtype, lower=False), [a])[0]
    expect = np.conj(np.swapaxes(np.linalg.cholesky(full), -1, -2))
    np.testing.assert_allclose(np.triu(got), expect, rtol=1e-10, atol=1e-12)
    assert not np.tril(got, -1).any()


# -------------------------------------------------------------------------- triangular-solve


def _triangle(data: st.DataObject, shape: tuple[int, ...], lower: bool, complex_: bool) -> np.ndarray:
    """Off-diagonal entries in [-1, 1], diagonal entries of magnitude in [1, 3], garbage in
    the other triangle."""
    m = shape[-1]
    a = data.draw(values(shape, -1, 1))
    diag = data.draw(values(shape[:-1], 1, 3)) * data.draw(st.sampled_from([1.0, -1.0]))
    if complex_:
        a = a + 1j * data.draw(values(shape, -1, 1))
    keep = np.tril(np.ones((m, m), bool), -1) if lower else np.triu(np.ones((m, m), bool), 1)
    junk = data.draw(values(shape, -1e3, 1e3))
    a = np.where(keep, a, junk)
    idx = np.arange(m)
    a[..., idx, idx] = diag
    return a


TRSOLVE_CASES = {  # (lower, adjoint, dtype, tolerance)
    "lower-f32": (True, False, np.float32, dict(rtol=1e-4, atol=1e-4)),
    "upper-adjoint-f32": (False, True, np.float32, dict(rtol=1e-4, atol=1e-4)),
    "lower-adjoint-c64": (True, True, np.complex64, dict(rtol=1e-4, atol=1e-4)),
    "upper-f64": (False, False, np.float64, dict(rtol=1e-10, atol=1e-12)),
}


@pytest.mark.parametrize("case", sorted(TRSOLVE_CASES))
@HYP
@given(data=st.data())
def test_triangular_solve_matches_xla(case: str, data: st.DataObject) -> None:
    lower, adjoint, dtype, tol = TRSOLVE_CASES[case]
    complex_ = np.dtype(dtype).kind == "c"
    a = _triangle(data, (2, 4, 4), lower, complex_).astype(dtype)
    rhs = data.draw(values((2, 4, 3), -10, 10))
    if complex_:
        rhs = rhs + 1j * data.draw(values((2, 4, 3), -10, 10))
    rhs = rhs.astype(dtype)
    d = _differential(f"trsolve-{case}",
                      lambda a, b: tf.linalg.triangular_solve(a, b, lower=lower, adjoint=adjoint), a, rhs)
    assert "triangular-solve" in d.opcodes
    d.check(a, rhs, **tol)


def test_triangular_solve_with_zero_or_infinite_diagonal_matches_xla() -> None:
    """A zero (or infinite) diagonal entry: NaN from its row on. XLA's blocked inverse may
    spread the NaN to earlier rows of its 128-row block (all but the block's first), so
    every NaN row of the emulator must be non-finite in XLA, and finite values must agree."""
    inf = np.inf
    a = np.array([
        [[0, 0, 0], [2, 1, 0], [1, 1, 1]],
        [[1, 0, 0], [0, 0, 0], [1, 1, 1]],
        [[1, 0, 0], [2, 0, 0], [1, 1, 1]],
        [[1, 0, 0], [0, inf, 0], [1, 1, 1]],
        [[1, 0, 0], [5, inf, 0], [1, 1, 1]],
        [[2, 0, 0], [1, 4, 0], [1, 1, 0]],
    ], np.float32)
    rhs = np.array([[[1, 0], [1, 1], [1, 2]]] * len(a), np.float32)
    module, (expected,) = eu.lower(lambda a, b: tf.linalg.triangular_solve(a, b, lower=True), a, rhs)
    got = eu.run_ir(module, [a, rhs])[0]
    first_bad = [0, 1, 1, 1, 1, 2]
    for k, row in enumerate(first_bad):
        assert np.isnan(got[k, row:]).all() and np.isfinite(got[k, :row]).all()
    assert not np.isfinite(expected[np.isnan(got)]).any()
    both = np.isfinite(got) & np.isfinite(expected)
    np.testing.assert_allclose(got[both], expected[both], rtol=1e-6)
    assert both.sum() >= 5


def test_triangular_solve_with_empty_operands() -> None:
    fn = lambda a, b: tf.linalg.triangular_solve(a, b)  # noqa: E731
    _lowered_without_empties(fn, np.zeros((2, 0, 0), np.float32), np.zeros((2, 0, 3), np.float32))
    eye = np.eye(3, dtype=np.float32)[None].repeat(2, 0)
    _lowered_without_empties(fn, eye, np.zeros((2, 3, 0), np.float32))


def test_cholesky_solve_and_lstsq_pipelines_match_xla() -> None:
    rng = np.random.default_rng(7)
    m = rng.standard_normal((2, 5, 5))
    a = (m @ np.swapaxes(m, -1, -2) + 5 * np.eye(5)).astype(np.float32)
    rhs = rng.standard_normal((2, 5, 2)).astype(np.float32)
    module = eu.check(lambda a, b: tf.linalg.cholesky_solve(tf.linalg.cholesky(a), b), a, rhs,
                      rtol=1e-4, atol=1e-5)
    assert {"cholesky", "triangular-solve"} <= _opcodes(module)
    eu.check(lambda a, b: (tf.linalg.lstsq(a, b), tf.linalg.logdet(a)), a, rhs, rtol=1e-4, atol=1e-5)


def _solve_module(a_shape: list[int], b_shape: list[int], dtype: type, **attrs: object) -> eu.ir_pb2.Module:
    b = eu.IRBuilder("trsolve")
    pa = b.parameter(dtype, a_shape)
    pb = b.parameter(dtype, b_shape)
    b.root(b.op("triangular-solve", [pa, pb], dtype, b_shape, **attrs))
    return b.module()


@pytest.mark.parametrize("left_side", [True, False])
@pytest.mark.parametrize("transpose_a", ["NO_TRANSPOSE", "TRANSPOSE", "ADJOINT"])
@HYP
@given(data=st.data())
def test_triangular_solve_every_variant_against_numpy(left_side: bool, transpose_a: str,
                                                      data: st.DataObject) -> None:
    lower = data.draw(st.booleans())
    unit = data.draw(st.booleans())
    dtype = data.draw(st.sampled_from([np.float64, np.complex128]))
    complex_ = dtype is np.complex128
    a = _triangle(data, (2, 4, 4), lower, complex_)
    if unit:  # the diagonal is not read: make it garbage
        a[..., np.arange(4), np.arange(4)] = data.draw(values((2, 4), -1e3, 1e3))
    b_shape = [2, 4, 3] if left_side else [2, 3, 4]
    rhs = data.draw(values(tuple(b_shape), -10, 10))
    if complex_:
        rhs = rhs + 1j * data.draw(values(tuple(b_shape)))
    module = _solve_module([2, 4, 4], b_shape, dtype, left_side=left_side, lower=lower,
                           unit_diagonal=unit, transpose_a=transpose_a)
    got = eu.run_ir(module, [a.astype(dtype), rhs.astype(dtype)])[0]
    t = np.tril(a) if lower else np.triu(a)
    if unit:
        t[..., np.arange(4), np.arange(4)] = 1
    op = {"NO_TRANSPOSE": t, "TRANSPOSE": np.swapaxes(t, -1, -2),
          "ADJOINT": np.conj(np.swapaxes(t, -1, -2))}[transpose_a]
    if left_side:
        expect = np.linalg.solve(op, rhs)
    else:  # x op = b  <=>  op^T x^T = b^T
        expect = np.swapaxes(np.linalg.solve(np.swapaxes(op, -1, -2), np.swapaxes(rhs, -1, -2)), -1, -2)
    np.testing.assert_allclose(got, expect, rtol=1e-9, atol=1e-9)


def test_triangular_solve_refuses_a_bad_transpose() -> None:
    module = _solve_module([3, 3], [3, 1], np.float32, left_side=True, transpose_a="TRANSPOSE_INVALID")
    with pytest.raises(InvalidProgramError, match=r"triangular-solve.*transpose_a"):
        compile_module(module, TARGET)


# --------------------------------------------------------------------------------------- fft

FFT_CASES = {  # name: (function, input shape, input dtype, transform size)
    "fft-c64": (lambda x: tf.signal.fft(x), (2, 8), np.complex64, 8),
    "ifft-c128-odd": (lambda x: tf.signal.ifft(x), (3, 5), np.complex128, 5),
    "fft2d-c64": (lambda x: tf.signal.fft2d(x), (2, 4, 6), np.complex64, 24),
    "ifft3d-c64": (lambda x: tf.signal.ifft3d(x), (2, 3, 4), np.complex64, 24),
    "rfft-f32": (lambda x: tf.signal.rfft(x), (3, 10), np.float32, 10),
    "rfft-f32-crop-odd": (lambda x: tf.signal.rfft(x, [7]), (3, 10), np.float32, 7),
    "rfft-f32-pad": (lambda x: tf.signal.rfft(x, [16]), (3, 10), np.float32, 16),
    "irfft-c64": (lambda x: tf.signal.irfft(x), (3, 6), np.complex64, 10),
    "irfft-c64-odd": (lambda x: tf.signal.irfft(x, [11]), (3, 6), np.complex64, 11),
    "rfft2d-f64": (lambda x: tf.signal.rfft2d(x), (2, 6, 5), np.float64, 30),
    "irfft2d-c64": (lambda x: tf.signal.irfft2d(x), (2, 4, 5), np.complex64, 32),
    "rfft3d-f32": (lambda x: tf.signal.rfft3d(x), (2, 3, 4, 6), np.float32, 72),
}


@pytest.mark.parametrize("case", sorted(FFT_CASES))
@HYP
@given(data=st.data())
def test_fft_matches_xla(case: str, data: st.DataObject) -> None:
    fn, shape, dtype, n = FFT_CASES[case]
    x = data.draw(values(shape, -10, 10))
    if np.dtype(dtype).kind == "c":
        x = x + 1j * data.draw(values(shape, -10, 10))
    x = x.astype(dtype)
    d = _differential(f"fft-{case}", fn, x)
    assert "fft" in d.opcodes
    got, expected = d.run(x)
    scale = max(1.0, float(np.abs(x).max()))
    eps = 1e-5 if dtype in (np.float32, np.complex64) else 1e-12
    eu.assert_same(got, expected, rtol=0.0, atol=eps * np.sqrt(n) * scale, what=case)


def test_fft_of_empty_arrays() -> None:
    _lowered_without_empties(lambda x: tf.signal.fft(x), np.zeros((0, 8), np.complex64))
    _lowered_without_empties(lambda x: tf.signal.rfft(x), np.zeros((2, 0), np.float32))
    eu.check(lambda x: tf.signal.irfft(x), np.ones((2, 1), np.complex64))  # fft_length [0]


def test_stft_and_dct_use_the_fft_kernel() -> None:
    x = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)
    module = eu.check(lambda x: (tf.signal.stft(x, 8, 4), tf.signal.dct(x)), x, rtol=1e-4, atol=1e-4)
    assert "fft" in _opcodes(module)


# -------------------------------------------------------------------------------- batch norm

_X_SHAPE = (4, 3, 3, 5)  # NHWC, 5 features


def _bn_training(x: tf.Tensor, s: tf.Tensor, o: tf.Tensor) -> tuple[tf.Tensor, ...]:
    return tf.compat.v1.nn.fused_batch_norm(x, s, o, epsilon=1e-3)


def _bn_training_nchw(x: tf.Tensor, s: tf.Tensor, o: tf.Tensor) -> tuple[tf.Tensor, ...]:
    return tf.compat.v1.nn.fused_batch_norm(tf.transpose(x, [0, 3, 1, 2]), s, o, epsilon=1e-2,
                                            data_format="NCHW")


def _bn_inference(x: tf.Tensor, s: tf.Tensor, o: tf.Tensor) -> tuple[tf.Tensor, ...]:
    return tf.compat.v1.nn.fused_batch_norm(x, s, o, mean=o * 2, variance=tf.abs(s) + 0.5,
                                            epsilon=1e-3, is_training=False)


def _bn_grad(x: tf.Tensor, s: tf.Tensor, o: tf.Tensor) -> list[tf.Tensor]:
    with tf.GradientTape() as tape:
        tape.watch([x, s, o])
        y = tf.compat.v1.nn.fused_batch_norm(x, s, o, epsilon=1e-3)[0]
        loss = tf.reduce_sum(y * y * tf.range(1, x.shape[-1] + 1, dtype=tf.float32))
    return tape.gradient(loss, [x, s, o])


def _bn_training_f16(x: tf.Tensor, s: tf.Tensor, o: tf.Tensor) -> tuple[tf.Tensor, ...]:
    return tf.compat.v1.nn.fused_batch_norm(tf.cast(x, tf.float16), s, o, epsilon=1e-3)


BN_CASES = {
    "training": (_bn_training, "batch-norm-training", dict(rtol=1e-4, atol=1e-4)),
    "training-nchw": (_bn_training_nchw, "batch-norm-training", dict(rtol=1e-4, atol=1e-4)),
    "inference": (_bn_inference, "batch-norm-inference", dict(rtol=1e-4, atol=1e-4)),
    "grad": (_bn_grad, "batch-norm-grad", dict(rtol=1e-3, atol=1e-3)),
    "training-f16": (_bn_training_f16, "batch-norm-training", dict(rtol=1e-2, atol=1e-2)),
}


_SPREAD = np.random.default_rng(11).standard_normal(_X_SHAPE)


@pytest.mark.parametrize("case", sorted(BN_CASES))
@HYP
@given(wiggle=values(_X_SHAPE, -0.25, 0.25), shift=values((5,), -2, 2),
       s=values((5,), -2, 2, np.float32), o=values((5,), -2, 2, np.float32))
def test_batch_norm_matches_xla(case: str, wiggle: np.ndarray, shift: np.ndarray, s: np.ndarray,
                                o: np.ndarray) -> None:
    # Every feature keeps a spread (variance ~1): with a (near) constant feature XLA's float32
    # x - mean is rounding noise, which 1/sqrt(var + eps) amplifies (the emulator gives 0).
    x = (_SPREAD + wiggle + shift).astype(np.float32)
    fn, opcode, tol = BN_CASES[case]
    d = _differential(f"bn-{case}", fn, x, s, o)
    assert opcode in d.opcodes
    d.check(x, s, o, **tol)


def test_batch_norm_of_one_element_per_feature_matches_xla() -> None:
    x = np.arange(3, dtype=np.float32).reshape(1, 1, 1, 3)
    eu.check(_bn_training, x, np.ones(3, np.float32), np.zeros(3, np.float32))


def _hlo_shape(dims: list[int], et: int = xd.F32) -> xd.ShapeProto:
    return xd.ShapeProto(element_type=et, dimensions=dims,
                         layout=xd.LayoutProto(minor_to_major=list(range(len(dims)))[::-1]))


def _hlo_module(opcode: str, operands: list[list[int]], shape: xd.ShapeProto,
                **fields: object) -> bytes:
    """A one-instruction HLO module (parameters, then ``opcode`` over them) as TF would
    serialize it: fields left at their proto defaults are simply absent."""
    instrs = [hlo_pb2.HloInstructionProto(name=f"p{k}", opcode="parameter", id=k + 1, parameter_number=k,
                                          shape=_hlo_shape(dims))
              for k, dims in enumerate(operands)]
    root = len(operands) + 1
    instrs.append(hlo_pb2.HloInstructionProto(name="op", opcode=opcode, id=root, shape=shape,
                                              operand_ids=list(range(1, root)), **fields))
    comp = hlo_pb2.HloComputationProto(name="entry", id=1, root_id=root, instructions=instrs)
    return hlo_pb2.HloModuleProto(name="m", entry_computation_id=1, computations=[comp]).SerializeToString()


def test_converter_fills_batch_norm_defaults_and_feature_index_zero_runs() -> None:
    """feature_index 0 and epsilon 0 are proto defaults: the HLO leaves them out."""
    x_shape = [3, 4, 2]  # features first
    hlo = _hlo_module("batch-norm-inference", [x_shape, [3], [3], [3], [3]], _hlo_shape(x_shape))
    module = eu.hlo_module_to_ir(hlo)
    op = next(i for i in module.computations[0].instructions if i.opcode == "batch-norm-inference")
    assert op.attrs["feature_index"].i == 0 and op.attrs["epsilon"].f == 0.0
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    scale, offset, mean = (rng.standard_normal(3).astype(np.float32) for _ in range(3))
    var = np.array([0.5, 1.0, 2.0], np.float32)
    got = eu.run_ir(module, [x, scale, offset, mean, var])[0]
    col = (slice(None), None, None)
    expect = (x - mean[col]) * scale[col] / np.sqrt(var[col]) + offset[col]
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)


def test_converter_fills_fft_type_and_topk_defaults() -> None:
    """FFT is fft_type 0 and largest=false / k=0 are proto defaults too."""
    fft = eu.hlo_module_to_ir(_hlo_module("fft", [[2, 4]], _hlo_shape([2, 4], xd.C64), fft_length=[4]))
    op = next(i for i in fft.computations[0].instructions if i.opcode == "fft")
    assert op.attrs["fft_type"].s == "FFT"
    out = xd.ShapeProto(element_type=xd.TUPLE,
                        tuple_shapes=[_hlo_shape([2, 2]), _hlo_shape([2, 2], xd.S32)])
    module = eu.hlo_module_to_ir(_hlo_module("topk", [[2, 5]], out, k=2))
    op = next(i for i in module.computations[0].instructions if i.opcode == "topk")
    assert op.attrs["largest"].flag is False and op.attrs["k"].i == 2
    x = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], np.float32)
    values_, indices = eu.run_ir(module, [x])
    np.testing.assert_array_equal(values_, [[1, 1], [2, 3]])
    np.testing.assert_array_equal(indices, [[1, 3], [1, 4]])


# -------------------------------------------------------------------------------------- topk


def _topk_module(shape: list[int], dtype: type, k: int, largest: bool) -> eu.ir_pb2.Module:
    b = eu.IRBuilder("topk")
    x = b.parameter(dtype, shape)
    root = b.op("topk", [x], np.float32, [], k=k, largest=largest)
    module = b.module()
    instr = next(i for i in module.computations[0].instructions if i.id == root)
    instr.shape.Clear()
    instr.shape.is_tuple = True
    for dt in (dtype, np.int32):
        leaf = instr.shape.tuple_shapes.add(dtype=eu.dtypes.from_numpy(np.dtype(dt)))
        leaf.dims.extend(shape[:-1] + [k])
    b.root(root)
    return module


@HYP
@given(data=st.data())
def test_topk_against_a_stable_sort(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 9))
    k = data.draw(st.integers(0, n))
    largest = data.draw(st.booleans())
    dtype = data.draw(st.sampled_from([np.float32, np.int32]))
    elems = st.integers(-3, 3)  # few distinct values: many ties
    x = data.draw(hnp.arrays(np.int64, (3, n), elements=elems)).astype(dtype)
    got_v, got_i = eu.run_ir(_topk_module([3, n], dtype, k, largest), [x])
    for row in range(3):
        order = sorted(range(n), key=lambda j: (-x[row, j] if largest else x[row, j], j))[:k]
        np.testing.assert_array_equal(got_i[row], order)
        np.testing.assert_array_equal(got_v[row], x[row, order])
    assert got_v.dtype == dtype and got_i.dtype == np.int32


def test_topk_orders_floats_totally() -> None:
    nan = np.float32(np.nan)
    x = np.array([[1.0, -nan, np.inf, nan, -0.0, 0.0, -np.inf]], np.float32)
    x[0, 1] = -np.abs(nan)  # a NaN with the sign bit set
    v, i = eu.run_ir(_topk_module([1, 7], np.float32, 7, True), [x])
    np.testing.assert_array_equal(i[0], [3, 2, 0, 5, 4, 6, 1])
    assert np.signbit(v[0, 4]) and not np.signbit(v[0, 3])
    _, i = eu.run_ir(_topk_module([1, 7], np.float32, 3, False), [x])
    np.testing.assert_array_equal(i[0], [1, 6, 4])


def test_tf_top_k_is_sort_and_slice_and_matches_xla() -> None:
    x = np.random.default_rng(5).standard_normal((3, 9)).astype(np.float32)
    x[0, :4] = 1.0
    x[1, 2] = np.nan
    module = eu.check(lambda x: tf.math.top_k(x, 4), x)
    assert "sort" in _opcodes(module) and "topk" not in _opcodes(module)


# --------------------------------------------------------------------- malformed programs


def _one_op(opcode: str, operands: list[tuple[type, list[int]]], dtype: type, dims: list[int],
            **attrs: object) -> eu.ir_pb2.Module:
    b = eu.IRBuilder(opcode)
    params = [b.parameter(dt, shape) for dt, shape in operands]
    b.root(b.op(opcode, params, dtype, dims, **attrs))
    return b.module()


_F, _C = np.float32, np.complex64
MALFORMED = {
    "cholesky-int": (_one_op("cholesky", [(np.int32, [2, 2])], np.int32, [2, 2], lower=True),
                     "floating-point or complex"),
    "cholesky-not-square": (_one_op("cholesky", [(_F, [2, 3])], _F, [2, 3], lower=True), "square"),
    "solve-b-shape": (_one_op("triangular-solve", [(_F, [3, 3]), (_F, [2, 2])], _F, [2, 2], left_side=True,
                              transpose_a="NO_TRANSPOSE"), r"b \[2, 2\]"),
    "solve-no-transpose": (_one_op("triangular-solve", [(_F, [3, 3]), (_F, [3, 2])], _F, [3, 2]),
                           "transpose_a"),
    "fft-length": (_one_op("fft", [(_C, [2, 8])], _C, [2, 8], fft_type="FFT", fft_length=[4]), "fft_length"),
    "fft-type": (_one_op("fft", [(_C, [2, 8])], _C, [2, 8], fft_type="DCT", fft_length=[8]), "fft_type"),
    "fft-real-input": (_one_op("fft", [(_F, [2, 8])], _C, [2, 8], fft_type="FFT", fft_length=[8]),
                       "complex to complex"),
    "fft-4-dims": (_one_op("fft", [(_C, [2, 2, 2, 2])], _C, [2, 2, 2, 2], fft_type="FFT",
                           fft_length=[2, 2, 2, 2]), "1 to 3"),
    "bn-feature-index": (_one_op("batch-norm-inference", [(_F, [2, 3])] + [(_F, [3])] * 4, _F, [2, 3],
                                 epsilon=0.1, feature_index=5), "feature_index 5"),
    "bn-vector-shape": (_one_op("batch-norm-inference", [(_F, [2, 3])] + [(_F, [2])] * 4, _F, [2, 3],
                                epsilon=0.1, feature_index=1), "one value per feature"),
    "bn-operand-count": (_one_op("batch-norm-inference", [(_F, [2, 3])] + [(_F, [3])] * 2, _F, [2, 3],
                                 epsilon=0.1, feature_index=1), "expected 5 operands"),
    "topk-not-a-tuple": (_one_op("topk", [(_F, [2, 5])], _F, [2, 2], k=2, largest=True), "tuple"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_instructions_are_invalid_programs(case: str) -> None:
    module, message = MALFORMED[case]
    with pytest.raises(InvalidProgramError, match=message):
        compile_module(module, TARGET)


# -------------------------------------------------------------------------------- tile model


def test_new_opcodes_have_their_own_tile_plans() -> None:
    b = eu.IRBuilder("plans")
    a = b.parameter(np.float32, [8, 16, 16])
    chol = b.op("cholesky", [a], np.float32, [8, 16, 16], lower=True)
    solve = b.op("triangular-solve", [chol, a], np.float32, [8, 16, 16], left_side=True, lower=True,
                 unit_diagonal=False, transpose_a="NO_TRANSPOSE")
    c = b.parameter(np.complex64, [64, 256])
    fft = b.op("fft", [c], np.complex64, [64, 256], fft_type="FFT", fft_length=[256])
    big = b.parameter(np.float32, [1, 512, 512])
    big_chol = b.op("cholesky", [big], np.float32, [1, 512, 512], lower=True)
    b.root(b.tuple([solve, fft, big_chol]))
    plan = plan_module(b.module(), TARGET)
    assert not [n for n in plan.notes if "no planner" in n], plan.notes

    def flops(name: str) -> float:
        return sum(s.flops * s.repeat for s in plan.op(name).steps)

    per_matrix = 16 ** 3 / 3 + 16 * TARGET.flops_per_transcendental
    assert flops(f"cholesky.{chol}") == pytest.approx(8 * per_matrix)
    assert flops(f"triangular-solve.{solve}") == pytest.approx(8 * 16 * 16 * 16)
    assert flops(f"fft.{fft}") == pytest.approx(64 * 5 * 256 * 8)
    # One 1 MB matrix does not fit a tile: it is split and factored column by column.
    big_rec = plan.op(f"cholesky.{big_chol}")
    assert big_rec.mapping is not None and big_rec.mapping.tiles > 1
    assert any(s.repeat == 512 for s in big_rec.steps)


def test_batch_norm_plans_reduce_partials_in_stages_and_compile_fits() -> None:
    x = np.ones((32, 8, 8, 64), np.float32)
    s = np.ones(64, np.float32)
    module, _ = eu.lower(_bn_grad, x, s, s)
    exe = compile_module(module, TARGET)
    assert exe.estimate.fits
    plan = plan_module(module, TARGET)
    assert not [n for n in plan.notes if "no planner" in n], plan.notes
    grad = next(r for r in plan.ops.values() if r.opcode == "batch-norm-grad")
    assert [st.kind for st in grad.steps] == ["reduce", "reduce", "reduce", "element-wise"]
