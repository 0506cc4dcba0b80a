"""Differential tests of the ``custom-call`` targets the emulator runs, against XLA on CPU.

tf2xla lowers ``tf.linalg.qr``, ``inv``, ``solve`` and ``expm`` to the custom calls ``Qr`` and
``ProductOfElementaryHouseholderReflectors`` (LAPACK geqrf / orgqr), and ``tf.linalg.eigh`` /
``eigvalsh`` to ``Eigh`` (kernels ``custom_linalg.py``). Each TF function is lowered and compiled
once per signature (``Differential``); hypothesis then varies the values (10 examples each).
Hand-built IR covers what no TF op produces: the upper triangle and unsorted flag of ``Eigh``,
``m > n > k`` reflector products (against an explicit product of the reflectors), malformed
instructions, an unregistered target (refused, naming it) and the tile plans.

Inputs and tolerances (the emulator computes in float64 and rounds once, XLA in the operand's
type):

- QR, inverse, solve: well-conditioned inputs, ``|m| <= 1`` plus ``+-2 sqrt(m n)`` on the
  diagonal (condition number <= 3; random signs exercise both Householder sign branches, and
  ``m = 0`` draws exercise ``tau = 0``). A rank-deficient matrix would make Q's trailing
  columns depend on rounding noise (float32 in XLA, float64 here), not on the semantics.
  float32/complex64: ``rtol=1e-4, atol=1e-5`` (entries of R up to ~10, XLA's error a few
  float32 ulps times n); solves with right-hand sides up to 10: ``atol=1e-4``; float64:
  ``rtol=1e-10, atol=1e-11``. Drawn magnitudes below 1e-12 are made 0: XLA flushes float32
  subnormals and its float32 squares of such values underflow, so a column that is tiny
  below the diagonal counts as zero there (``tau = 0``, ``beta = alpha``) but not in the
  emulator (``beta = -sign(alpha) ||x||``): R's diagonal entry and Q's column change sign.
- expm of matrices with entries in [-1, 1] (results up to e^n): float32 ``rtol=1e-4,
  atol=1e-5``; float64 ``rtol=1e-10, atol=1e-12`` (both run the same Pade/squaring program
  around the solve).
- Eigh: eigenvalues compared directly (float32/complex64 ``atol=1e-5 * (1 + ||a||)``, XLA's
  Jacobi stops at a relative off-diagonal norm of 1e-6; float64 ``1e-10``). Eigenvectors are
  unique only up to sign/phase (and rotations within repeated eigenvalues), so both sides'
  vectors are checked by reconstruction, ``V diag(w) V^H = a`` and ``V^H V = I``
  (``atol`` times ``1 + ||a||``: the emulator's float32 ``1e-4``, float64 ``1e-10``; XLA's at
  least ``1e-5``, since its Jacobi iteration stops at ``tol = 1e-6`` and leaves float64
  vectors ~1e-7 off; its eigenvalues, quadratic in that residual, stay accurate), not
  compared raw. For complex inputs TF 2.21's
  XLA kernel returns real eigenvalues in a buffer TF reads as complex64 (a TF bug): the test
  reads XLA's values back from that buffer's first half.
- Hand-built IR against numpy references in float64: ``rtol=atol=1e-10``.
"""

from __future__ import annotations

import emulator_util as eu
import numpy as np
import pytest
import server_util as su
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from device_server.emulator import (
    CompileOptions,
    InvalidProgramError,
    UnsupportedOpError,
    compile_module,
    get_target,
)
from device_server.emulator.kernels import CUSTOM_CALLS
from device_server.emulator.tiles import plan_module
from device_server.protocol import dtypes, ir_pb2

HYP = settings(max_examples=10, deadline=None, derandomize=True)
TARGET = get_target("ipu2")
_DIFFS: dict[str, eu.Differential] = {}
QR_TARGETS = ("Qr", "ProductOfElementaryHouseholderReflectors")


def _differential(key: str, fn, *example) -> eu.Differential:  # noqa: ANN001 - any TF function
    """``fn`` lowered and compiled once per test session for the signature of ``example``."""
    if key not in _DIFFS:
        _DIFFS[key] = eu.Differential(fn, *example)
    return _DIFFS[key]


def values(shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> st.SearchStrategy[np.ndarray]:
    """Finite float64s in [lo, hi], magnitudes below 1e-12 made 0 (see the module docstring)."""
    return hnp.arrays(np.float64, shape, elements=st.floats(lo, hi, allow_subnormal=False)).map(
        lambda a: np.where(np.abs(a) < 1e-12, 0.0, a))


def _targets(module: eu.ir_pb2.Module) -> list[str]:
    return [i.attrs["custom_call_target"].s for c in module.computations for i in c.instructions
            if i.opcode == "custom-call"]


def _custom_call(b: eu.IRBuilder, operands: list[int], leaves: list[tuple[type, list[int]]],
                 **attrs: object) -> int:
    """A ``custom-call`` whose result is the tuple of ``leaves`` ((dtype, dims) each)."""
    call = b.op("custom-call", operands, np.float32, [], **attrs)
    instr = next(i for i in b.module().computations[0].instructions if i.id == call)
    instr.shape.Clear()
    instr.shape.is_tuple = True
    for dt, dims in leaves:
        instr.shape.tuple_shapes.add(dtype=dtypes.from_numpy(np.dtype(dt)), dims=dims)
    return call


def _draw_matrix(data: st.DataObject, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """``|m| <= 1`` (complex: both parts) plus ``+-2 sqrt(m n)`` on the diagonal: singular
    values within [sqrt(m n), 3 sqrt(m n)]."""
    m = data.draw(values(shape))
    if np.dtype(dtype).kind == "c":
        m = m + 1j * data.draw(values(shape))
    rows, cols = shape[-2:]
    k = min(rows, cols)
    signs = data.draw(hnp.arrays(np.float64, shape[:-2] + (k,), elements=st.sampled_from([1.0, -1.0])))
    idx = np.arange(k)
    m[..., idx, idx] += 2 * np.sqrt(rows * cols) * signs
    return m.astype(dtype)


# ---------------------------------------------------------------------------------------- QR

F32_TOL = dict(rtol=1e-4, atol=1e-5)
F64_TOL = dict(rtol=1e-10, atol=1e-11)
QR_CASES = {  # shape, dtype, full_matrices, tolerance
    "f32-tall-batch": ((2, 5, 3), np.float32, False, F32_TOL),
    "f32-wide-full": ((3, 5), np.float32, True, F32_TOL),
    "f64-square-two-batch-dims-full": ((2, 1, 4, 4), np.float64, True, F64_TOL),
    "c64-tall-full": ((2, 4, 3), np.complex64, True, F32_TOL),
    "c64-wide": ((2, 3, 4), np.complex64, False, F32_TOL),
}


@pytest.mark.parametrize("case", sorted(QR_CASES))
@HYP
@given(data=st.data())
def test_qr_matches_xla(case: str, data: st.DataObject) -> None:
    shape, dtype, full, tol = QR_CASES[case]
    a = _draw_matrix(data, shape, dtype)
    d = _differential(f"qr-{case}", lambda a: tf.linalg.qr(a, full_matrices=full), a)
    assert _targets(d.module) == list(QR_TARGETS)
    d.check(a, **tol)


INV_SOLVE_CASES = {
    "f32": (np.float32, dict(rtol=1e-4, atol=1e-4)),
    "f64": (np.float64, dict(rtol=1e-10, atol=1e-11)),
}


def _inv_and_solve(a: tf.Tensor, b: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    return tf.linalg.inv(a), tf.linalg.solve(a, b)


@pytest.mark.parametrize("case", sorted(INV_SOLVE_CASES))
@HYP
@given(data=st.data())
def test_inv_and_solve_match_xla(case: str, data: st.DataObject) -> None:
    dtype, tol = INV_SOLVE_CASES[case]
    a = _draw_matrix(data, (3, 4, 4), dtype)
    b = data.draw(values((3, 4, 2), -10, 10)).astype(dtype)
    d = _differential(f"inv-solve-{case}", _inv_and_solve, a, b)
    assert _targets(d.module) == list(QR_TARGETS) * 2
    assert "triangular-solve" in d.opcodes
    d.check(a, b, **tol)


EXPM_CASES = {
    "f32": ((2, 3, 3), np.float32, dict(rtol=1e-4, atol=1e-5)),
    "f64": ((4, 4), np.float64, dict(rtol=1e-10, atol=1e-12)),
}


@pytest.mark.parametrize("case", sorted(EXPM_CASES))
@HYP
@given(data=st.data())
def test_expm_matches_xla(case: str, data: st.DataObject) -> None:
    shape, dtype, tol = EXPM_CASES[case]
    a = data.draw(values(shape)).astype(dtype)
    d = _differential(f"expm-{case}", lambda a: tf.linalg.expm(a), a)
    assert set(QR_TARGETS) <= set(_targets(d.module))
    d.check(a, **tol)


def test_qr_of_empty_batches_matches_xla() -> None:
    """TF makes an empty argument a constant: the custom calls run at compile time."""
    for shape in [(0, 3, 2), (2, 0, 3)]:
        a = np.zeros(shape, np.float32)
        module, expected = eu.lower(lambda a: tf.linalg.qr(a, full_matrices=True), a)
        eu.assert_same(eu.run_ir(module, []), expected)


def test_a_faulty_custom_call_is_caught() -> None:
    a = np.eye(3, dtype=np.float32) * 2 + 0.1
    module, expected = eu.lower(lambda a: tf.linalg.inv(a), a)
    eu.assert_same(eu.run_ir(module, [a]), expected, rtol=1e-5, atol=1e-6)
    faulty = eu.run_ir(module, [a], options=CompileOptions(fault_inject_opcode="custom-call"))
    assert not np.allclose(faulty[0], expected[0], rtol=1e-3)


# -------------------------------------------------------------------------------------- Eigh


def _hermitian(lower: np.ndarray) -> np.ndarray:
    """The Hermitian matrix whose lower triangle is that of ``lower`` (real diagonal)."""
    strict = np.tril(lower, -1)
    diag = np.real(np.diagonal(lower, axis1=-2, axis2=-1))
    n = lower.shape[-1]
    return strict + np.conj(np.swapaxes(strict, -1, -2)) + diag[..., None] * np.eye(n)


def _check_eigh(a: np.ndarray, w: np.ndarray, v: np.ndarray, atol: float, what: str) -> None:
    """``v diag(w) v^H = a`` and ``v^H v = I``, ``w`` ascending."""
    n = a.shape[-1]
    vh = np.conj(np.swapaxes(v, -1, -2))
    np.testing.assert_allclose((v * w[..., None, :]) @ vh, a, atol=atol, err_msg=f"{what}: V W V^H")
    np.testing.assert_allclose(vh @ v, np.broadcast_to(np.eye(n), a.shape), atol=atol,
                               err_msg=f"{what}: V^H V")
    assert np.all(np.diff(w, axis=-1) >= 0), f"{what}: eigenvalues not ascending"


def _xla_eigenvalues(w: np.ndarray, real_dtype: type) -> np.ndarray:
    """XLA's eigenvalues; for complex inputs TF 2.21 hands the real values over in a buffer
    typed complex (twice their size): they are its first half."""
    if w.dtype.kind != "c":
        return w
    return np.ascontiguousarray(w).view(real_dtype).reshape(-1)[:w.size].reshape(w.shape)


EIGH_CASES = {  # shape, dtype, vector tolerance, eigenvalue tolerance (times 1 + ||a||)
    "f32-batch": ((3, 4, 4), np.float32, 1e-4, 1e-5),
    "f64-two-batch-dims": ((2, 1, 5, 5), np.float64, 1e-10, 1e-10),
    "c64": ((2, 3, 3), np.complex64, 1e-4, 1e-5),
    "f32-1x1": ((1, 1), np.float32, 1e-6, 1e-6),
}


@pytest.mark.parametrize("case", sorted(EIGH_CASES))
@HYP
@given(data=st.data())
def test_eigh_matches_xla(case: str, data: st.DataObject) -> None:
    shape, dtype, vec_tol, val_tol = EIGH_CASES[case]
    complex_ = np.dtype(dtype).kind == "c"
    lower = data.draw(values(shape))
    if complex_:
        lower = lower + 1j * data.draw(values(shape))
    junk = data.draw(values(shape, -1e3, 1e3))  # the upper triangle is never read
    a = (np.tril(lower) + np.triu(junk, 1)).astype(dtype)
    d = _differential(f"eigh-{case}", lambda a: tf.linalg.eigh(a), a)
    assert _targets(d.module) == ["Eigh"]
    config = next(i.attrs["backend_config"].b for c in d.module.computations for i in c.instructions
                  if i.opcode == "custom-call")
    assert config.startswith(b"1,1,")  # lower, sorted
    (w, v), (xw, xv) = d.run(a)
    real = np.float64 if np.dtype(dtype) in (np.float64, np.complex128) else np.float32
    assert w.dtype == real and v.dtype == dtype
    herm = _hermitian(np.asarray(a, np.complex128 if complex_ else np.float64))
    scale = 1 + np.abs(herm).sum(axis=(-2, -1)).max()
    np.testing.assert_allclose(w, _xla_eigenvalues(xw, real), atol=val_tol * scale)
    _check_eigh(herm, w.astype(np.float64), v.astype(herm.dtype), vec_tol * scale, "emulator")
    _check_eigh(herm, w.astype(np.float64), xv.astype(herm.dtype), max(vec_tol, 1e-5) * scale, "XLA")


def test_eigvalsh_and_repeated_eigenvalues_match_xla() -> None:
    a = np.stack([np.eye(4), np.zeros((4, 4)), np.diag([3.0, 1.0, 3.0, -2.0]),
                  np.tril(np.full((4, 4), 2.0))]).astype(np.float32)
    module = eu.check(lambda a: tf.linalg.eigvalsh(a), a, rtol=1e-6, atol=1e-6)
    assert _targets(module) == ["Eigh"]
    w, v = eu.run_ir(eu.lower(lambda a: tf.linalg.eigh(a), a)[0], [a])
    _check_eigh(_hermitian(a.astype(np.float64)), w.astype(np.float64), v.astype(np.float64), 1e-5,
                "repeated")


def _eigh_module(n: int, dtype: type, config: bytes | None) -> eu.ir_pb2.Module:
    real = np.float32 if np.dtype(dtype) in (np.float32, np.complex64) else np.float64
    b = eu.IRBuilder("eigh")
    a = b.parameter(dtype, [2, n, n])
    attrs = {} if config is None else {"backend_config": config}
    call = _custom_call(b, [a], [(dtype, [2, n, n]), (real, [2, n])], custom_call_target="Eigh", **attrs)
    v = b.op("get-tuple-element", [call], dtype, [2, n, n], index=0)
    w = b.op("get-tuple-element", [call], real, [2, n], index=1)
    b.root(b.tuple([w, v]))
    return b.module()


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@HYP
@given(data=st.data())
def test_eigh_upper_unsorted_reads_the_upper_triangle(dtype: type, data: st.DataObject) -> None:
    upper = data.draw(values((2, 4, 4)))
    if dtype is np.complex128:
        upper = upper + 1j * data.draw(values((2, 4, 4)))
    junk = data.draw(values((2, 4, 4), -1e3, 1e3))
    a = (np.triu(upper) + np.tril(junk, -1)).astype(dtype)
    w, v = eu.run_ir(_eigh_module(4, dtype, b"0,0,15,0.000001"), [a])
    herm = _hermitian(np.conj(np.swapaxes(a, -1, -2)))  # its lower triangle is a's upper one
    np.testing.assert_allclose(w, np.linalg.eigvalsh(herm), rtol=1e-10, atol=1e-10)
    _check_eigh(herm, w, v, 1e-10, "upper")


def test_eigh_of_non_finite_matrices_is_nan_only_where_read() -> None:
    a = np.stack([np.eye(3), np.eye(3)])
    a[0, 2, 0] = np.nan  # read (lower)
    a[1, 0, 2] = np.inf  # not read
    w, v = eu.run_ir(_eigh_module(3, np.float64, b"1,1,4,0.000001"), [a])
    assert np.isnan(w[0]).all() and np.isnan(v[0]).all()
    np.testing.assert_allclose(w[1], np.ones(3), rtol=1e-12)
    _check_eigh(np.eye(3), w[1], v[1], 1e-12, "identity")


# ------------------------------------------------ Householder products beyond what TF emits


def _householder_module(m: int, n: int, k: int) -> eu.ir_pb2.Module:
    b = eu.IRBuilder("orgqr")
    a = b.parameter(np.float64, [2, m, n])
    taus = b.parameter(np.float64, [2, k])
    b.root(b.op("custom-call", [a, taus], np.float64, [2, m, n],
                custom_call_target="ProductOfElementaryHouseholderReflectors"))
    return b.module()


@HYP
@given(a=values((2, 6, 4), -2, 2), taus=values((2, 2), 0, 2))
def test_householder_product_is_the_product_of_the_reflectors(a: np.ndarray, taus: np.ndarray) -> None:
    got = eu.run_ir(_householder_module(6, 4, 2), [a, taus])[0]
    for b in range(2):
        q = np.eye(6)
        for i in range(2):
            v = np.concatenate([np.zeros(i), [1.0], a[b, i + 1:, i]])
            q = q @ (np.eye(6) - taus[b, i] * np.outer(v, v))
        np.testing.assert_allclose(got[b], q[:, :4], rtol=1e-10, atol=1e-10)


@HYP
@given(data=st.data())
def test_qr_factors_in_geqrf_form(data: st.DataObject) -> None:
    """``a = H_0 H_1 H_2 R`` with the reflectors below a''s diagonal and R on and above it."""
    a = _draw_matrix(data, (2, 5, 3), np.complex128)
    b = eu.IRBuilder("qr")
    x = b.parameter(np.complex128, [2, 5, 3])
    b.root(_custom_call(b, [x], [(np.complex128, [2, 5, 3]), (np.complex128, [2, 3])],
                        custom_call_target="Qr"))
    packed, taus = eu.run_ir(b.module(), [a])
    r = np.triu(packed)
    np.testing.assert_allclose(np.imag(np.diagonal(r, axis1=-2, axis2=-1)), 0, atol=1e-12)
    for k in range(2):
        q = np.eye(5, dtype=complex)
        for i in range(3):
            v = np.concatenate([np.zeros(i), [1.0], packed[k, i + 1:, i]])
            q = q @ (np.eye(5) - taus[k, i] * np.outer(v, np.conj(v)))
        np.testing.assert_allclose(q @ r[k], a[k], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(np.conj(q.T) @ q, np.eye(5), atol=1e-10)


# --------------------------------------------------------------------- refusal and malformed


def test_unregistered_custom_call_target_is_refused_naming_it() -> None:
    assert {"Qr", "ProductOfElementaryHouseholderReflectors", "Eigh"} <= set(CUSTOM_CALLS)
    b = eu.IRBuilder("unknown")
    x = b.parameter(np.float32, [4])
    b.root(b.op("custom-call", [x], np.float32, [4], source_op="model/dense/MyOp",
                custom_call_target="MyFancyKernel"))
    with pytest.raises(UnsupportedOpError, match=r"'MyFancyKernel'.*custom-call\.2.*Keras layer 'dense'"):
        compile_module(b.module(), TARGET)
    b = eu.IRBuilder("no-target")
    x = b.parameter(np.float32, [4])
    b.root(b.op("custom-call", [x], np.float32, [4]))
    with pytest.raises(UnsupportedOpError, match="target ''"):
        compile_module(b.module(), TARGET)


def test_refuse_opcodes_still_refuses_registered_targets() -> None:
    a = np.eye(3, dtype=np.float32)
    module, _ = eu.lower(lambda a: tf.linalg.qr(a), a)
    with pytest.raises(UnsupportedOpError, match="custom-call.*refused by the compile options"):
        compile_module(module, TARGET, CompileOptions(refuse_opcodes=frozenset({"custom-call"})))


def _one_call(target: str, operands: list[tuple[type, list[int]]], result: list[tuple[type, list[int]]],
              **attrs: object) -> eu.ir_pb2.Module:
    b = eu.IRBuilder(target)
    params = [b.parameter(dt, dims) for dt, dims in operands]
    if len(result) == 1:
        b.root(b.op("custom-call", params, result[0][0], result[0][1], custom_call_target=target, **attrs))
        return b.module()
    b.root(_custom_call(b, params, result, custom_call_target=target, **attrs))
    return b.module()


_F, _D = np.float32, np.float64
MALFORMED = {
    "qr-int": (_one_call("Qr", [(np.int32, [3, 3])], [(np.int32, [3, 3]), (np.int32, [3])]),
               "floating-point or complex"),
    "qr-vector": (_one_call("Qr", [(_F, [3])], [(_F, [3]), (_F, [1])]), r"\[\.\.\., m, n\]"),
    "qr-taus-shape": (_one_call("Qr", [(_F, [4, 3])], [(_F, [4, 3]), (_F, [4])]), r"a', taus"),
    "householder-k-above-n": (_one_call("ProductOfElementaryHouseholderReflectors",
                                        [(_F, [4, 2]), (_F, [3])], [(_F, [4, 2])]), "m >= n >= k"),
    "householder-dtypes": (_one_call("ProductOfElementaryHouseholderReflectors",
                                     [(_F, [3, 3]), (_D, [3])], [(_F, [3, 3])]), "element type"),
    "eigh-no-config": (_one_call("Eigh", [(_F, [3, 3])], [(_F, [3, 3]), (_F, [3])]), "backend_config"),
    "eigh-bad-config": (_one_call("Eigh", [(_F, [3, 3])], [(_F, [3, 3]), (_F, [3])],
                                  backend_config=b"1,1,x,0.1"), "backend_config"),
    "eigh-bad-lower": (_one_call("Eigh", [(_F, [3, 3])], [(_F, [3, 3]), (_F, [3])],
                                 backend_config=b"2,1,4,0.1"), "backend_config"),
    "eigh-not-square": (_one_call("Eigh", [(_F, [3, 2])], [(_F, [3, 2]), (_F, [2])],
                                  backend_config=b"1,1,4,0.1"), "square"),
    "eigh-complex-values": (_one_call("Eigh", [(np.complex64, [2, 2])],
                                      [(np.complex64, [2, 2]), (np.complex64, [2])],
                                      backend_config=b"1,1,4,0.1"), "vectors, values"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_custom_calls_are_invalid_programs(case: str) -> None:
    module, message = MALFORMED[case]
    with pytest.raises(InvalidProgramError, match=message):
        compile_module(module, TARGET)


# -------------------------------------------------------------------------------- tile model


def test_custom_calls_have_tile_plans_and_costs() -> None:
    a = np.eye(32, dtype=np.float32)[None].repeat(8, axis=0)
    module, _ = eu.lower(lambda a: (tf.linalg.qr(a), tf.linalg.eigh(a)), a)
    exe = compile_module(module, TARGET)
    assert exe.estimate.fits
    plan = plan_module(module, TARGET)
    assert not [n for n in plan.notes if "no planner" in n], plan.notes
    by_target = {}
    for c in module.computations:
        for i in c.instructions:
            if i.opcode == "custom-call":
                rec = plan.op(i.name)
                by_target[i.attrs["custom_call_target"].s] = sum(s.flops * s.repeat for s in rec.steps)
    n = 32
    assert by_target["Qr"] == pytest.approx(8 * (4 / 3 * n ** 3 + n * TARGET.flops_per_transcendental))
    assert by_target["ProductOfElementaryHouseholderReflectors"] == pytest.approx(8 * 4 / 3 * n ** 3)
    assert by_target["Eigh"] == pytest.approx(8 * 9 * n ** 3)
    # A 2 MB matrix does not fit in an eighth of a tile: split, one stage per column.
    b = eu.IRBuilder("big")
    x = b.parameter(np.float32, [724, 724])
    b.root(b.op("custom-call", [x, b.parameter(np.float32, [724])], np.float32, [724, 724],
                custom_call_target="ProductOfElementaryHouseholderReflectors"))
    rec = next(r for r in plan_module(b.module(), TARGET).ops.values() if r.opcode == "custom-call")
    assert rec.mapping is not None and rec.mapping.tiles > 1
    assert any(s.repeat == 724 for s in rec.steps)


def test_complex_eigh_through_strategy_keeps_tf_dtypes(ipu_system) -> None:
    """XLA's eigenvalues of a complex matrix are real, TF's op promises complex: the device
    call casts them back, so the traced function's result dtypes are what TF said."""
    import tf_ipu

    rng = np.random.default_rng(5)
    m = (rng.standard_normal((4, 4)) + 1j * rng.standard_normal((4, 4))).astype(np.complex64)
    a = (m + m.conj().T) / 2
    strategy = tf_ipu.IPUStrategy()

    @tf.function
    def f(x):
        return strategy.run(tf.linalg.eigh, args=(x,))

    w, v = f(tf.constant(a))
    assert w.dtype == tf.complex64 and v.dtype == tf.complex64
    np.testing.assert_allclose(w.numpy().real, np.linalg.eigvalsh(a), atol=1e-4)
    np.testing.assert_array_equal(w.numpy().imag, 0)
    recon = (v.numpy() * w.numpy()[None, :]) @ v.numpy().conj().T
    np.testing.assert_allclose(recon, a, atol=1e-4)


# -- host calls inside control flow whose results nothing reads ------------------------------


def _outfeed_in_branch_module() -> ir_pb2.Module:
    """``main(x: f32[3], p: pred[]) = x + x``, beside a ``call`` of a computation whose
    ``conditional`` on ``p`` outfeeds ``x`` in its true branch and twice in a ``while`` loop of
    its false branch. Nothing reads the call's result: only the host sees what it does."""
    m = ir_pb2.Module(name="outfeed_in_branch", entry_computation_id=0, frontend="test")
    vec, pred, s32 = su.array_shape(np.float32, [3]), su.array_shape(np.bool_, []), \
        su.array_shape(np.int32, [])
    state = ir_pb2.Shape(is_tuple=True, tuple_shapes=[s32, vec])

    true_branch = su.Builder(m, 1, "true_branch")
    x = true_branch.parameter(vec)
    true_branch.op("custom-call", [x], pred, custom_call_target="tf_ipu_outfeed",
                   backend_config="seen")
    true_branch.root(x)

    cond = su.Builder(m, 5, "cond")
    i, _ = cond.unpack(state)
    cond.root(cond.op("compare", [i, cond.constant(np.array(2, np.int32))], pred,
                      direction="LT", compare_type="SIGNED"))
    body = su.Builder(m, 6, "body")
    i, x = body.unpack(state)
    body.op("custom-call", [x], pred, custom_call_target="tf_ipu_outfeed", backend_config="seen")
    body.root(body.tuple([body.op("add", [i, body.constant(np.array(1, np.int32))]), x]))
    false_branch = su.Builder(m, 2, "false_branch")
    x = false_branch.parameter(vec)
    loop = false_branch.op("while", [false_branch.tuple(
        [false_branch.constant(np.array(0, np.int32)), x])], state, called=[5, 6])
    false_branch.root(false_branch.op("get-tuple-element", [loop], vec, index=1))

    inner = su.Builder(m, 3, "inner")
    x, p = inner.parameter(vec), inner.parameter(pred)
    inner.root(inner.op("conditional", [p, x, x], vec, called=[1, 2]))

    main = su.Builder(m, 0, "main")
    x, p = main.parameter(vec), main.parameter(pred)
    main.op("call", [x, p], vec, called=[3])  # its result is never read
    main.root(main.op("add", [x, x]))
    return m


@pytest.mark.parametrize("taken, expected", [(True, 1), (False, 2)])
def test_an_outfeed_in_unread_control_flow_still_runs(taken: bool, expected: int) -> None:
    """A conditional branch or loop body that talks to the host is not dead code, though
    nothing reads its result (a Graphcore outfeed enqueue inside ``tf.cond``/``while``): the
    true branch enqueues once, the false branch's loop twice."""
    from device_server.emulator import cancel

    exe = compile_module(_outfeed_in_branch_module(), get_target("ipu2"))
    got: list[tuple[str, list[np.ndarray]]] = []
    token = cancel.StopToken()
    token.outfeed = lambda feed, arrays: got.append((feed, arrays))
    x = np.array([1.0, -2.0, 3.5], np.float32)
    (out,) = exe.run([x, np.array(taken)], stop=token)
    np.testing.assert_array_equal(out, x + x)
    assert [feed for feed, _ in got] == ["seen"] * expected
    for _, arrays in got:
        np.testing.assert_array_equal(arrays[0], x)
