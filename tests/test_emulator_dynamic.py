"""Differential tests of bounded dynamic shapes on the emulator against XLA on CPU.

tf2xla gives a tensor a dynamic dimension (a static bound, a run-time size) for ``tf.where``
with one argument, ``tf.boolean_mask``, ``tf.unique`` and non-max suppression, and the ops
downstream keep it. Each test lowers a ``tf.function(jit_compile=True)``, runs the IR on the
emulator and compares with XLA's run, outputs at their run-time shapes. Masks and values come
from hypothesis, with the edge cases (no element kept, every element kept) as explicit
examples; integer and boolean data as well as floats. Hand-built IR covers what tf2xla does not
produce (``set-dimension-size`` growing a value, size errors, refusals).

Not compared, because XLA on CPU (TF 2.21) fails there: a ``slice`` of a dynamic dimension whose
limit lies past the run-time size (``tf.slice(masked, [0], [2])`` with every element kept,
``masked[1:]`` with none kept) corrupts XLA's heap; ``tf.cumsum`` over a dynamic dimension (a
``reduce-window``) crashes it. Also not compared: results that depend on padding, whose content
XLA leaves unspecified (the emulator's padding is zeros): ``tf.math.top_k`` with ``k`` above
the run-time size, and ``tf.unique`` of a tensor with a dynamic dimension (tf2xla sorts it with
a static index ``iota``, so the padding takes part: XLA gives 2 unique values for
``[0, 1][1:]``, TF's own kernel 1), and ``tf.where`` of a tensor that is itself dynamic (XLA
reads padding in tf2xla's prefix sum: compared with numpy instead).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import emulator_util as eu
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tensorflow.compiler.tf2xla.python import xla

from device_server.emulator import (
    CompileOptions,
    ExecutionError,
    FloatingPointExceptionError,
    UnsupportedOpError,
    compile_module,
    dynamic,
    get_target,
    kernels,
)

HYP = settings(max_examples=10, deadline=None, derandomize=True)
TARGET = get_target("ipu2")
N = 8  # the bound of the masked dimension

NONE = np.zeros(N, bool)
ALL = np.ones(N, bool)
X0 = np.array([1.5, -2, 3, -4, 5, 0, 7, -8], np.float32)
XI = np.array([3, 1, 3, 2, 1, 5, 3, 0], np.int32)

masks = hnp.arrays(np.bool_, N)
floats = hnp.arrays(np.float32, N, elements=st.floats(-50, 50, width=32, allow_subnormal=False))
small_ints = hnp.arrays(np.int32, N, elements=st.integers(-3, 5))
bools = hnp.arrays(np.bool_, N)


def _masked(x: tf.Tensor, m: tf.Tensor) -> tf.Tensor:
    return tf.boolean_mask(x, m)


# Functions of (x: float32[8], m: bool[8]).
VECTOR: dict[str, Callable[[tf.Tensor, tf.Tensor], object]] = {
    "where": lambda x, m: tf.where(m),
    "where_of_compare": lambda x, m: tf.where(x > 0),
    "boolean_mask": _masked,
    "reduce_sum_mean": lambda x, m: (tf.reduce_sum(_masked(x, m)), tf.reduce_mean(_masked(x, m))),
    "reduce_max_prod": lambda x, m: (tf.reduce_max(_masked(x, m)), tf.reduce_prod(_masked(x, m) / 8)),
    "argmax_argmin": lambda x, m: (tf.argmax(_masked(x, m)), tf.argmin(_masked(x, m))),
    "elementwise": lambda x, m: tf.tanh(_masked(x, m) / 10) * 2 + _masked(x * x, m),
    "softmax": lambda x, m: tf.nn.softmax(_masked(x, m) / 10),
    "shape_and_size": lambda x, m: (tf.shape(_masked(x, m)) * 2 + 1, tf.size(_masked(x, m))),
    "range_fill_zeros": lambda x, m: (tf.cast(tf.range(tf.size(_masked(x, m))), tf.float32) + _masked(x, m),
                                      tf.fill(tf.shape(_masked(x, m)), 2.0), tf.zeros_like(_masked(x, m)) + 1),
    "sort_reverse": lambda x, m: (tf.sort(_masked(x, m)), tf.reverse(_masked(x, m), [0])),
    "pad_tile": lambda x, m: (tf.pad(_masked(x, m), [[1, 2]], constant_values=3.0), tf.tile(_masked(x, m), [2])),
    "concat_stack": lambda x, m: (tf.concat([_masked(x, m), x], 0), tf.stack([_masked(x, m), -_masked(x, m)])),
    "broadcast_transpose": lambda x, m: tf.transpose(_masked(x, m)[:, None] * tf.constant([[1.0, 2.0, 3.0]])),
    "cast_bitcast_one_hot": lambda x, m: (tf.cast(_masked(x, m), tf.int32), tf.bitcast(_masked(x, m), tf.int32),
                                          tf.one_hot(tf.cast(_masked(x, m), tf.int32) % 3, 3)),
    "gather_by_where": lambda x, m: tf.gather(x * 2, tf.where(m)[:, 0]),
    "scatter_by_where": lambda x, m: tf.tensor_scatter_nd_update(x, tf.where(m), _masked(x, m) * 10),
    "segment_sum": lambda x, m: tf.math.unsorted_segment_sum(
        _masked(x, m), tf.cast(tf.where(m)[:, 0], tf.int32) // 2, 4),
    "dot_of_masked": lambda x, m: tf.tensordot(_masked(x, m), _masked(x, m), 1),
    "while_loop": lambda x, m: tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 1.5 - 1),
                                             (0, _masked(x, m)))[1],
    "cond": lambda x, m: tf.cond(tf.reduce_sum(tf.cast(m, tf.int32)) > 2,
                                 lambda: _masked(x, m), lambda: _masked(-x, m) * 2),
}

W = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)

# Functions of (x: float32[8, 3], m: bool[8]).
MATRIX: dict[str, Callable[[tf.Tensor, tf.Tensor], object]] = {
    "dense_relu": lambda x, m: tf.nn.relu(tf.matmul(_masked(x, m), W) + 0.5),
    "reshape": lambda x, m: (tf.reshape(_masked(x, m), [-1]), tf.reshape(_masked(x, m), [-1, 3])),
    "reductions_by_axis": lambda x, m: (tf.reduce_sum(_masked(x, m), axis=0), tf.reduce_mean(_masked(x, m), axis=1)),
    "concat_pad": lambda x, m: (tf.concat([_masked(x, m), _masked(x, m)], 1),
                                tf.pad(_masked(x, m), [[1, 0], [0, 2]], constant_values=3.0)),
    "gram": lambda x, m: tf.matmul(_masked(x, m), _masked(x, m), transpose_a=True),
    "gather_axis1": lambda x, m: (tf.gather(tf.transpose(x), tf.where(m)[:, 0], axis=1),
                                  tf.gather(_masked(x, m), [2, 0], axis=1)),
    "mask_2d_and_where_2d": lambda x, m: (tf.boolean_mask(x, x > 0), tf.where(x > 0)),
    "mask_axis1": lambda x, m: tf.boolean_mask(x, m[:3], axis=1),
}

# Functions of (x: int32[8], m: bool[8]) and of (b: bool[8], m: bool[8]).
INTEGER: dict[str, Callable[[tf.Tensor, tf.Tensor], object]] = {
    "mask_int": lambda x, m: (_masked(x, m), tf.reduce_sum(_masked(x, m)), tf.sort(_masked(x, m))),
    "unique": lambda x, m: tf.unique(x),
    "where_int": lambda x, m: tf.where(x > 1),
}
BOOLEAN: dict[str, Callable[[tf.Tensor, tf.Tensor], object]] = {
    "mask_bool": lambda b, m: (_masked(b, m), tf.reduce_any(_masked(b, m)), tf.reduce_all(_masked(b, m))),
}


@functools.cache
def _differential(group: str, name: str) -> eu.Differential:
    fns, example_args = {
        "vector": (VECTOR, (X0, NONE)),
        "matrix": (MATRIX, (np.arange(24, dtype=np.float32).reshape(8, 3) - 9, NONE)),
        "integer": (INTEGER, (XI, NONE)),
        "boolean": (BOOLEAN, (XI > 1, NONE)),
    }[group]
    d = eu.Differential(fns[name], *(tf.constant(a) for a in example_args))
    assert eu.dynamic_opcodes(d.module), f"{name}: no dynamic shape in the lowered module"
    return d


def _check(group: str, name: str, *args: np.ndarray) -> None:
    _differential(group, name).check(*(tf.constant(a) for a in args), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- against XLA on CPU


@pytest.mark.parametrize("name", sorted(VECTOR))
@HYP
@given(x=floats, m=masks)
@example(x=X0, m=NONE)
@example(x=X0, m=ALL)
def test_masked_vector_ops(name: str, x: np.ndarray, m: np.ndarray) -> None:
    _check("vector", name, x, m)


@pytest.mark.parametrize("name", sorted(MATRIX))
@HYP
@given(x=hnp.arrays(np.float32, (N, 3), elements=st.floats(-20, 20, width=32, allow_subnormal=False)), m=masks)
@example(x=np.linspace(-5, 5, 24, dtype=np.float32).reshape(N, 3), m=NONE)
@example(x=np.linspace(-5, 5, 24, dtype=np.float32).reshape(N, 3), m=ALL)
def test_masked_matrix_ops(name: str, x: np.ndarray, m: np.ndarray) -> None:
    _check("matrix", name, x, m)


@pytest.mark.parametrize("name", sorted(INTEGER))
@HYP
@given(x=small_ints, m=masks)
@example(x=XI, m=NONE)
@example(x=XI, m=ALL)
@example(x=np.zeros(N, np.int32), m=ALL)
def test_integer_ops(name: str, x: np.ndarray, m: np.ndarray) -> None:
    _check("integer", name, x, m)


@HYP
@given(b=bools, m=masks)
@example(b=ALL, m=NONE)
@example(b=ALL, m=ALL)
def test_boolean_ops(b: np.ndarray, m: np.ndarray) -> None:
    _check("boolean", "mask_bool", b, m)


@HYP
@given(b=bools, m=masks)
@example(b=ALL, m=np.arange(N) < 2)
def test_where_of_a_dynamic_tensor(b: np.ndarray, m: np.ndarray) -> None:
    """``tf.where`` of a tensor that is itself dynamic. Compared with numpy: tf2xla's prefix
    sum adds strided slices of different run-time sizes, where XLA reads padding; on CPU it
    answers ``[0, 0]`` for ``where([True, True])`` (TF's kernel and the emulator: ``[0, 1]``)."""
    d = _where_of_masked()
    got = d.exe.run([b, m])
    eu.assert_same(got, [np.argwhere(b[m]).astype(np.int64)])


@functools.cache
def _where_of_masked() -> eu.Differential:
    return eu.Differential(lambda b, m: tf.where(_masked(b, m)), tf.constant(ALL), tf.constant(ALL))


@pytest.mark.parametrize("n", [0, 1, 3, N])
def test_slices_past_the_run_time_size(n: int) -> None:
    """Slices whose static limits pass the run-time size keep the elements that exist (numpy's
    rule). Compared with numpy: XLA on CPU corrupts its heap on some of these (see the module
    docstring), TF's own kernels reject them."""
    m = np.arange(N) < n
    for exe, expect in _slice_programs():
        eu.assert_same(exe.run([X0, m]), [expect(X0[m])])


@functools.cache
def _slice_programs() -> list[tuple[object, Callable[[np.ndarray], np.ndarray]]]:
    out = []
    for fn, expect in ((lambda x, m: tf.slice(_masked(x, m), [0], [2]), lambda v: v[:2]),
                       (lambda x, m: _masked(x, m)[1:3], lambda v: v[1:3]),
                       (lambda x, m: _masked(x, m)[1:], lambda v: v[1:])):
        module = eu.hlo_module_to_ir(eu.hlo_of(fn, tf.constant(X0), tf.constant(ALL)))
        assert "slice" in eu.dynamic_opcodes(module)
        out.append((compile_module(module, TARGET), expect))
    return out


def test_dynamic_slice_and_update_of_a_masked_vector() -> None:
    """Start indices clamp against the bound, as in XLA: an update past the run-time size
    lands in the padding. (A slice read past the size returns padding: not compared.)"""
    m = np.arange(N) % 2 == 0  # 4 of 8 kept
    d = eu.Differential(lambda x, m, s: (xla.dynamic_slice(_masked(x, m), [s], [2]),
                                         xla.dynamic_update_slice(_masked(x, m), tf.constant([7.0, 8.0]), [s])),
                        tf.constant(X0), tf.constant(m), tf.constant(np.int32(0)))
    assert {"dynamic-update-slice"} <= eu.dynamic_opcodes(d.module)
    for start in range(-1, 3):
        d.check(tf.constant(X0), tf.constant(m), tf.constant(np.int32(start)))
    for start in (3, 5, 9):
        got, expected = d.run(tf.constant(X0), tf.constant(m), tf.constant(np.int32(start)))
        eu.assert_same(got[1:], expected[1:])


def test_top_k_of_a_masked_vector() -> None:
    d = eu.Differential(lambda x, m: tf.math.top_k(_masked(x, m), 2), tf.constant(X0), tf.constant(ALL))
    for n in (2, 5, 8):
        d.check(tf.constant(X0), tf.constant(np.arange(N) >= N - n))


@HYP
@given(m=hnp.arrays(np.bool_, 4))
@example(m=np.zeros(4, bool))
def test_convolution_and_pooling_over_a_dynamic_batch(m: np.ndarray) -> None:
    _conv_differential().check(tf.constant(_IMAGES), tf.constant(m), rtol=1e-5, atol=1e-5)


_IMAGES = np.random.default_rng(1).standard_normal((4, 5, 5, 2)).astype(np.float32)
_KERNEL = np.random.default_rng(2).standard_normal((3, 3, 2, 3)).astype(np.float32)


@functools.cache
def _conv_differential() -> eu.Differential:
    def fn(x: tf.Tensor, m: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        y = tf.nn.conv2d(_masked(x, m), _KERNEL, 1, "SAME")
        return tf.nn.relu(y), tf.nn.max_pool2d(y, 2, 2, "VALID")

    d = eu.Differential(fn, tf.constant(_IMAGES), tf.constant(np.ones(4, bool)))
    assert {"convolution", "reduce-window"} <= eu.dynamic_opcodes(d.module)
    return d


@HYP
@given(order=st.permutations(range(N)))
def test_non_max_suppression(order: list[int]) -> None:
    """Both variants use ``set-dimension-size``; the unpadded one returns a dynamic result."""
    scores = (np.asarray(order, np.float32) + 0.5) / N
    _nms_differential().check(tf.constant(_BOXES), tf.constant(scores))


_BOXES = np.random.default_rng(3).uniform(0, 1, (N, 4)).astype(np.float32)


@functools.cache
def _nms_differential() -> eu.Differential:
    def fn(boxes: tf.Tensor, scores: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        kept = tf.image.non_max_suppression(boxes, scores, 4, iou_threshold=0.3, score_threshold=0.2)
        padded, count = tf.image.non_max_suppression_padded(boxes, scores, 4, iou_threshold=0.3,
                                                            pad_to_max_output_size=True)
        return kept, padded, count

    return eu.Differential(fn, tf.constant(_BOXES), tf.constant(np.linspace(0, 1, N, dtype=np.float32)))


def test_fault_injection_is_caught() -> None:
    """The comparison is sharp: a wrong ``gather`` after a mask is caught."""
    fn = VECTOR["boolean_mask"]
    module, expected = eu.lower(fn, tf.constant(X0), tf.constant(X0 > 0))
    got = eu.run_ir(module, [X0, X0 > 0], options=CompileOptions(fault_inject_opcode="gather"))
    with pytest.raises(AssertionError):
        eu.assert_same(got, expected)


def test_dynamic_program_runs_on_several_threads() -> None:
    d = _differential("matrix", "dense_relu")
    x = np.arange(24, dtype=np.float32).reshape(N, 3) / 7
    cases = [np.arange(N) < k for k in range(N + 1)]
    expected = [d.run(x, m)[1] for m in cases]
    failures: list[str] = []

    def worker(k: int) -> None:
        for _ in range(20):
            for j in range(k, len(cases), 4):
                got = d.exe.run([x, cases[j]])
                if got[0].shape != expected[j][0].shape or not np.allclose(got[0], expected[j][0], rtol=1e-5):
                    failures.append(f"mask {j}")

    eu.run_in_threads(worker)
    assert not failures


def test_floating_point_checks_name_the_instruction() -> None:
    module, _ = eu.lower(lambda x, m: tf.math.log(_masked(x, m)), tf.constant(X0), tf.constant(X0 > 0))
    exe = compile_module(module, TARGET, CompileOptions(inv=True))
    np.testing.assert_allclose(exe.run([X0, X0 > 0])[0], np.log(X0[X0 > 0]), rtol=1e-6)
    with pytest.raises(FloatingPointExceptionError, match="Log"):
        exe.run([X0, X0 < 0])


# ------------------------------------------------------------- the compiler and the model


def test_static_programs_never_take_the_dynamic_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("dynamic.plan called for a static program")

    monkeypatch.setattr(dynamic, "plan", refuse)
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    eu.check(lambda x: tf.reduce_sum(tf.nn.relu(tf.matmul(x, W)), axis=0) * tf.cast(tf.shape(x)[0], tf.float32), x)


def test_tile_model_plans_with_the_bounds() -> None:
    x = np.ones((1024, 16), np.float32)
    w = np.ones((16, 8), np.float32)
    m = np.arange(1024) % 4 == 0
    masked, _ = eu.lower(lambda x, m, w: tf.matmul(_masked(x, m), w), x, m, w)
    whole, _ = eu.lower(lambda x, m, w: tf.matmul(x, w), x, m, w)
    est_masked = compile_module(masked, TARGET).estimate
    est_whole = compile_module(whole, TARGET).estimate
    assert est_masked.to_dict()["host_bytes_out"] == est_whole.to_dict()["host_bytes_out"] == 1024 * 8 * 4
    assert est_masked.fits


def test_outputs_and_arguments_at_run_time_sizes() -> None:
    """An entry parameter with a dynamic dimension takes arrays up to the bound; outputs come
    back at their run-time shape; ``Executable`` lists which dimensions are dynamic."""
    b = eu.IRBuilder("dyn")
    p = b.dynamic(b.parameter(np.float32, [N, 2]), 0)
    two = b.op("broadcast", [b.constant(np.float32(2))], np.float32, [N, 2], dimensions=[])
    y = b.dynamic(b.op("multiply", [p, two], np.float32, [N, 2]), 0)
    size = b.op("get-dimension-size", [y], np.int32, [], dimension=0)
    b.root(b.tuple([y, size]))
    exe = compile_module(b.module(), TARGET)
    assert exe.parameter_dynamic == [(True, False)] and exe.output_dynamic == [(True, False), ()]
    for n in (0, 3, N):
        a = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
        out, count = exe.run([a])
        np.testing.assert_array_equal(out, a * 2)
        assert int(count) == n
    with pytest.raises(ExecutionError, match=r"expects float32\[<=8,2\], received float32\[9,2\]"):
        exe.run([np.zeros((N + 1, 2), np.float32)])
    with pytest.raises(ExecutionError, match=r"received float32\[3,1\]"):
        exe.run([np.zeros((3, 1), np.float32)])


def _set_size(bound_dynamic: bool) -> object:
    b = eu.IRBuilder("set_size")
    x = b.parameter(np.int32, [4, 3])
    n = b.parameter(np.int32, [])
    small = b.dynamic(b.op("set-dimension-size", [x, n], np.int32, [4, 3], dimension=0,
                           source_op="model/Where"), 0)
    m = b.parameter(np.int32, [])
    grown = b.op("set-dimension-size", [small, m], np.int32, [4, 3], dimension=0, source_op="model/TopK")
    if bound_dynamic:
        b.dynamic(grown, 0)
    b.root(b.tuple([small, grown]))
    return b.module()


def test_set_dimension_size_cuts_and_pads() -> None:
    """Elements past a size are padding: growing a value pads it with zeros; a negative size
    is 0 (TF computes it for ``x[1:]`` of an empty ``x``); past the bound is an error; a
    static result dimension may only be set to its bound."""
    x = np.arange(12, dtype=np.int32).reshape(4, 3)
    exe = compile_module(_set_size(True), TARGET)
    small, grown = exe.run([x, np.int32(2), np.int32(3)])
    np.testing.assert_array_equal(small, x[:2])
    np.testing.assert_array_equal(grown, np.concatenate([x[:2], np.zeros((1, 3), np.int32)]))
    small, grown = exe.run([x, np.int32(-1), np.int32(1)])
    assert small.shape == (0, 3) and grown.tolist() == [[0, 0, 0]]
    with pytest.raises(ExecutionError, match=r"'set-dimension-size.*model/TopK.*more than its bound 4"):
        exe.run([x, np.int32(2), np.int32(5)])
    exe = compile_module(_set_size(False), TARGET)
    np.testing.assert_array_equal(exe.run([x, np.int32(1), np.int32(4)])[1],
                                  np.concatenate([x[:1], np.zeros((3, 3), np.int32)]))
    with pytest.raises(ExecutionError, match=r"model/TopK.*static with size 4"):
        exe.run([x, np.int32(1), np.int32(3)])


def test_dynamic_reshape_checks_sizes() -> None:
    b = eu.IRBuilder("dynamic_reshape")
    x = b.dynamic(b.parameter(np.float32, [6]), 0)
    rows = b.parameter(np.int32, [])
    y = b.dynamic(b.op("dynamic-reshape", [x, rows, b.constant(np.int32(2))], np.float32, [3, 2],
                       source_op="model/Reshape"), 0)
    b.root(y)
    exe = compile_module(b.module(), TARGET)
    np.testing.assert_array_equal(exe.run([np.arange(4, dtype=np.float32), np.int32(2)])[0],
                                  np.arange(4, dtype=np.float32).reshape(2, 2))
    with pytest.raises(ExecutionError, match=r"dynamic-reshape.*model/Reshape.*cannot reshape \[4\]"):
        exe.run([np.arange(4, dtype=np.float32), np.int32(3)])


def test_refusals_name_the_instruction() -> None:
    # A convolution over a dynamic spatial dimension.
    b = eu.IRBuilder("conv")
    x = b.dynamic(b.parameter(np.float32, [1, 8, 2]), 1)
    k = b.parameter(np.float32, [3, 2, 2])
    b.root(b.dynamic(b.op(
        "convolution", [x, k], np.float32, [1, 6, 2], source_op="model/conv1d/Conv1D",
        input_batch_dimension=0, input_feature_dimension=2, input_spatial_dimensions=[1],
        kernel_input_feature_dimension=1, kernel_output_feature_dimension=2, kernel_spatial_dimensions=[0],
        output_batch_dimension=0, output_feature_dimension=2, output_spatial_dimensions=[1],
        window_size=[3], feature_group_count=1, batch_group_count=1), 1))
    with pytest.raises(UnsupportedOpError, match=r"model/conv1d/Conv1D.*dynamic batch dimension"):
        compile_module(b.module(), TARGET)
    # A reshape that would leave two dynamic dimensions in one group.
    b = eu.IRBuilder("reshape")
    x = b.dynamic(b.parameter(np.float32, [16]), 0)
    b.root(b.dynamic(b.op("reshape", [x], np.float32, [4, 4], source_op="model/Reshape"), 0, 1))
    with pytest.raises(UnsupportedOpError, match=r"model/Reshape.*sizes are ambiguous"):
        compile_module(b.module(), TARGET)
    # An opcode without a kernel for dynamic dimensions is listed with the others.
    b = eu.IRBuilder("replica")
    b.root(b.dynamic(b.op("replica-id", [], np.uint32, [2], source_op="model/id"), 0))
    with pytest.raises(UnsupportedOpError, match=r"'replica-id' \(has no emulator kernel for dynamic dimensions\)"):
        compile_module(b.module(), TARGET)


def test_run_time_sizes_are_planned_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel is planned for the bounds at compile time and once per new run-time shape."""
    planned: list[tuple[int, ...]] = []
    factory = kernels.REGISTRY["dot"]

    def counting(ctx: kernels.KernelContext) -> kernels.KernelFn:
        planned.append(tuple(ctx.operand_shapes[0]))
        return factory(ctx)

    monkeypatch.setitem(kernels.REGISTRY, "dot", counting)
    exe = compile_module(_differential("matrix", "dense_relu").module, TARGET)
    assert planned == [(N, 3)]
    x = np.arange(24, dtype=np.float32).reshape(N, 3)
    for _ in range(3):
        for k in range(N + 1):
            exe.run([x, np.arange(N) < k])
    assert sorted(planned) == sorted([(N, 3)] + [(k, 3) for k in range(N)])


def test_big_masked_values_are_not_fused() -> None:
    """Loop fusion cuts static shapes into blocks; values with run-time sizes stay out of it
    (an element-wise chain over a masked 512 x 512 matrix must still agree with XLA)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((512, 512)).astype(np.float32)
    m = rng.random(512) < 0.6

    def fn(x: tf.Tensor, m: tf.Tensor) -> tf.Tensor:
        y = tf.boolean_mask(x, m)
        return tf.reduce_sum(tf.nn.relu(y * 2.0 + 1.0) - y, axis=0), tf.exp(y * 0.5) + y

    eu.check(fn, x, m, rtol=1e-5, atol=1e-6)  # exp(y/2) + y cancels near 0: 1 ulp of 1
