"""Differential tests of the emulator's spatial kernels against XLA on CPU.

Kernels under test: ``convolution`` (kernels/conv.py), ``reduce-window`` and
``select-and-scatter`` (kernels/window.py), ``gather``, ``scatter``, ``dynamic-slice`` and
``dynamic-update-slice`` (kernels/indexing.py).

Each differential test writes a small function with TF ops or
``tensorflow.compiler.tf2xla.python.xla`` ops, lowers it to IR with the project's converter,
runs it on the whole emulator (``tests/emulator_util``) and compares with the same function run
by XLA (``tf.function(jit_compile=True)``, the reference); it also asserts that the lowered
module really holds the opcode under test. What TF cannot express (window reversal, variadic
reduce-window, tie-breaking in padded select-and-scatter windows, error messages) is tested on
the kernel factories with hand-written contexts.

Tolerances: float32 results must satisfy ``|got - xla| <= 1e-5 * (|xla| + max|xla|)`` (rtol
1e-5, atol 1e-5 relative to the result's magnitude); 16-bit floats 1e-2 the same way (the
kernels accumulate in float32 and round once); integers, booleans and every pure
selection/indexing result exactly. The reference of a 16-bit convolution, pooling or scatter
is XLA in float32 on the widened arguments, rounded once (``check(..., wide=True)``,
``emulator_util.float32_reference``): the IPU's FP32 partials. XLA's own 16-bit arithmetic
is no reference there, since how it accumulates depends on the host's instruction set
(native FP16 on AVX512-FP16 hosts); float32 results differ between hosts only in the order
of the additions, orders of magnitude below the 16-bit tolerance. Selections and
non-overlapping scatters of 16-bit values are exact and compare with XLA's 16-bit program.

Known differences from XLA CPU, excluded from the random cases and documented in the tests:
in some padded select-and-scatter windows XLA CPU breaks ties in another order than the
sequential definition; a scatter with an empty index vector and several update windows
applies only one of them in XLA CPU.

Benchmarks of these kernels (against TF on CPU) are in ``bench/bench_conv.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import emulator_util as eu
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from tensorflow.compiler.tf2xla.ops import gen_xla_ops
from tensorflow.compiler.tf2xla.python import xla
from tensorflow.compiler.xla import xla_data_pb2

from device_server.emulator.errors import InvalidProgramError
from device_server.emulator.kernels import REGISTRY, window
from device_server.protocol import ir_pb2

HYP = settings(max_examples=12, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def run_both(fn: Callable[..., Any], *args: Any, expect: str | None = None,
             wide: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Runs ``fn`` on the emulator and with XLA; returns (emulator, XLA) outputs, flattened.
    ``wide``: XLA's outputs computed in float32 from 16-bit float arguments and rounded once
    (``emulator_util.float32_reference``; see the module docstring)."""
    f = tf.function(fn, jit_compile=True, autograph=False)
    targs = [tf.constant(a) for a in args]
    module, ref = eu.lower(f, *targs)
    opcodes = {i.opcode for c in module.computations for i in c.instructions}
    if expect is not None:
        assert expect in opcodes, f"the lowered module holds no {expect} ({sorted(opcodes)})"
    entry = next(c for c in module.computations if c.id == module.entry_computation_id)
    n_params = sum(1 for i in entry.instructions if i.opcode == "parameter")
    params = [np.asarray(a) for a in args]
    if n_params != len(params):  # TF folds zero-size arguments into constants
        params = [a for a in params if a.size]
    assert n_params == len(params), f"{n_params} entry parameters for {len(args)} arguments"
    ours = eu.run_ir(module, params)
    return ours, eu.float32_reference(f, targs, ours) if wide else ref


def assert_close(ours: Sequence[np.ndarray], ref: Sequence[np.ndarray], tol: float | None = None) -> None:
    """Same count, shapes and dtypes; floats within the tolerance of the module docstring
    (NaN where XLA has NaN, equal infinities), everything else exactly."""
    assert len(ours) == len(ref)
    for k, (a, e) in enumerate(zip(ours, ref, strict=True)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"output {k}: shape {a.shape}, XLA {e.shape}"
        assert a.dtype == e.dtype, f"output {k}: dtype {a.dtype}, XLA {e.dtype}"
        if e.dtype.kind in "fc" or e.dtype == ml_dtypes.bfloat16:
            t = tol if tol is not None else (1e-2 if e.dtype.itemsize == 2 else 1e-5)
            a64, e64 = a.astype(np.float64), e.astype(np.float64)
            scale = float(np.max(np.abs(e64[np.isfinite(e64)]), initial=0.0)) if e.size else 0.0
            finite = np.isfinite(e64)
            np.testing.assert_array_equal(np.isnan(a64), np.isnan(e64), err_msg=f"output {k}: NaNs differ")
            np.testing.assert_array_equal(a64[~finite & ~np.isnan(e64)], e64[~finite & ~np.isnan(e64)])
            err = np.abs(a64[finite] - e64[finite])
            bound = t * (np.abs(e64[finite]) + scale)
            assert np.all(err <= bound), (
                f"output {k}: max error {err.max():.3g} (bound {t} relative, scale {scale:.3g})")
        else:
            np.testing.assert_array_equal(a, e, err_msg=f"output {k}")


def check(fn: Callable[..., Any], *args: Any, expect: str | None = None, tol: float | None = None,
          wide: bool = False) -> None:
    """Asserts that the emulator and XLA agree on ``fn(*args)`` (see :func:`assert_close`)."""
    ours, ref = run_both(fn, *args, expect=expect, wide=wide)
    assert_close(ours, ref, tol)


def rand(rng: np.random.Generator, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """Standard normal floats, or small integers (-5..5, unsigned 0..5)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(-5 if dtype.kind == "i" else 0, 6, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)


@pytest.mark.parametrize("opcode", ["convolution", "gather"])
def test_comparison_catches_a_wrong_kernel(opcode: str) -> None:
    """The comparison used here fails when the kernel's results are perturbed (the emulator's
    fault injection switch), so a passing test means something."""
    from device_server.emulator import CompileOptions

    rng = np.random.default_rng(12)
    if opcode == "convolution":
        fn, args = (lambda x, w: tf.nn.conv2d(x, w, 1, "SAME")), [rand(rng, (1, 5, 5, 3)), rand(rng, (3, 3, 3, 2))]
    else:
        fn, args = (lambda t, i: tf.gather(t, i)), [rand(rng, (6, 3), np.int32), np.array([4, 0, 5], np.int32)]
    module, ref = eu.lower(tf.function(fn, jit_compile=True, autograph=False), *[tf.constant(a) for a in args])
    assert_close(eu.run_ir(module, args), ref)
    broken = eu.run_ir(module, args, options=CompileOptions(fault_inject_opcode=opcode))
    with pytest.raises(AssertionError):
        assert_close(broken, ref)


# -------------------------------------------------------------------------- convolution


def _conv_dnums(lhs_layout: str, rhs_layout: str, out_layout: str) -> xla_data_pb2.ConvolutionDimensionNumbers:
    """Dimension numbers from layout strings: N/C (batch/feature), I/O (kernel), digits spatial."""
    d = xla_data_pb2.ConvolutionDimensionNumbers()
    d.input_batch_dimension = lhs_layout.index("N")
    d.input_feature_dimension = lhs_layout.index("C")
    d.kernel_input_feature_dimension = rhs_layout.index("I")
    d.kernel_output_feature_dimension = rhs_layout.index("O")
    d.output_batch_dimension = out_layout.index("N")
    d.output_feature_dimension = out_layout.index("C")
    digits = sorted(ch for ch in lhs_layout if ch.isdigit())
    d.input_spatial_dimensions.extend(lhs_layout.index(ch) for ch in digits)
    d.kernel_spatial_dimensions.extend(rhs_layout.index(ch) for ch in digits)
    d.output_spatial_dimensions.extend(out_layout.index(ch) for ch in digits)
    return d


def _layout_shape(layout: str, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[ch] for ch in layout)


@st.composite
def conv_cases(draw: st.DrawFn) -> dict[str, Any]:
    k = draw(st.integers(0, 3))
    digits = "".join(str(i) for i in range(k))
    lhs_layout = "".join(draw(st.permutations("NC" + digits)))
    rhs_layout = "".join(draw(st.permutations("IO" + digits)))
    out_layout = "".join(draw(st.permutations("NC" + digits)))
    grouping = draw(st.sampled_from(["none", "feature", "batch"]))
    groups = draw(st.integers(2, 3)) if grouping != "none" else 1
    gf = groups if grouping == "feature" else 1
    gb = groups if grouping == "batch" else 1
    cg = draw(st.integers(1, 3))
    og = draw(st.integers(1, 3))
    n = gb * draw(st.integers(0 if k else 1, 2))
    sizes = {"N": n, "C": cg * gf}
    ksizes = {"I": cg, "O": og * groups}
    strides, pads, lhs_dil, rhs_dil = [], [], [], []
    for i in range(k):
        ksize = draw(st.integers(1, 3))
        ksizes[str(i)] = ksize
        sizes[str(i)] = draw(st.integers(1, 7))
        strides.append(draw(st.integers(1, 3)))
        lhs_dil.append(draw(st.integers(1, 3)))
        rhs_dil.append(draw(st.integers(1, 2)))
        lo, hi = draw(st.integers(-2, 3)), draw(st.integers(-2, 3))
        # XLA aborts on a negative padded size; keep at least one window position.
        short = (ksize - 1) * rhs_dil[-1] + 1 - ((sizes[str(i)] - 1) * lhs_dil[-1] + 1 + lo + hi)
        pads.append((lo, hi + max(0, short)))
    return dict(lhs_layout=lhs_layout, rhs_layout=rhs_layout, out_layout=out_layout,
                lhs_shape=_layout_shape(lhs_layout, sizes), rhs_shape=_layout_shape(rhs_layout, ksizes),
                strides=strides, pads=pads, lhs_dil=lhs_dil, rhs_dil=rhs_dil, gf=gf, gb=gb,
                dtype=draw(st.sampled_from([np.float32, np.float32, np.int32, np.float16])),
                seed=draw(st.integers(0, 2**16)))


def _xla_conv(case: dict[str, Any]) -> Callable[..., Any]:
    dn = _conv_dnums(case["lhs_layout"], case["rhs_layout"], case["out_layout"])

    def fn(lhs: tf.Tensor, rhs: tf.Tensor) -> tf.Tensor:
        return xla.conv(lhs, rhs, window_strides=case["strides"], padding=case["pads"],
                        lhs_dilation=case["lhs_dil"], rhs_dilation=case["rhs_dil"], dimension_numbers=dn,
                        feature_group_count=case["gf"], batch_group_count=case["gb"],
                        preferred_element_type=lhs.dtype if case["gb"] > 1 else None)

    return fn


@HYP
@given(conv_cases())
def test_conv_general_random(case: dict[str, Any]) -> None:
    rng = np.random.default_rng(case["seed"])
    lhs = rand(rng, case["lhs_shape"], case["dtype"])
    rhs = rand(rng, case["rhs_shape"], case["dtype"])
    try:
        _xla_conv(case)(tf.constant(lhs), tf.constant(rhs))
    except (tf.errors.InvalidArgumentError, ValueError):  # shapes XLA itself refuses
        reject()
    check(_xla_conv(case), lhs, rhs, expect="convolution", wide=case["dtype"] == np.float16)


@pytest.mark.parametrize(
    "strides,padding,dilations",
    [(1, "SAME", 1), (2, "VALID", 1), (1, "SAME", 2), (2, [[0, 0], [2, 1], [0, 3], [0, 0]], 1)],
)
def test_conv2d_nhwc(strides: int, padding: Any, dilations: int) -> None:
    rng = np.random.default_rng(1)
    x, w = rand(rng, (2, 9, 10, 5)), rand(rng, (3, 3, 5, 7))
    check(lambda x, w: tf.nn.conv2d(x, w, strides, padding, dilations=dilations), x, w, expect="convolution")


def test_conv2d_gradients_and_transpose() -> None:
    rng = np.random.default_rng(2)
    x, w, dy = rand(rng, (2, 8, 8, 6)), rand(rng, (3, 3, 6, 4)), rand(rng, (2, 4, 4, 4))

    def grads(x: tf.Tensor, w: tf.Tensor, dy: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, 2, "SAME")
        return tape.gradient(y, [x, w], output_gradients=dy)

    check(grads, x, w, dy, expect="convolution")
    wt = rand(rng, (3, 3, 4, 6))  # conv2d_transpose: (h, w, out, in)
    check(lambda x, w: tf.nn.conv2d_transpose(x, w, (2, 16, 16, 4), 2, "SAME"), x, wt, expect="convolution")


@pytest.mark.parametrize("channels", [3, 8])
def test_strided_1x1_and_first_layer_gradients(channels: int) -> None:
    """The input gradient of a stride-2 1x1 convolution (a 1x1 window over a base-dilated
    input: the unit-window path) and the weight gradient of a 7x7 stride-2 first layer over
    few channels (few rows per output position: positions are stacked into one matmul)."""
    rng = np.random.default_rng(7)
    x, w1 = rand(rng, (2, 16, 15, channels)), rand(rng, (1, 1, channels, 6))
    w7 = rand(rng, (7, 7, channels, 4))
    dy1, dy7 = rand(rng, (2, 8, 8, 6)), rand(rng, (2, 8, 8, 4))

    def grads(x: tf.Tensor, w1: tf.Tensor, w7: tf.Tensor, dy1: tf.Tensor, dy7: tf.Tensor) -> Any:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, w1, w7])
            y1 = tf.nn.conv2d(x, w1, 2, "SAME")
            y7 = tf.nn.conv2d(x, w7, 2, "SAME")
        return (tape.gradient(y1, [x, w1], output_gradients=dy1),
                tape.gradient(y7, [x, w7], output_gradients=dy7))

    check(grads, x, w1, w7, dy1, dy7, expect="convolution")


def test_grouped_and_depthwise_conv_with_gradients() -> None:
    rng = np.random.default_rng(3)
    x = rand(rng, (2, 7, 7, 6))
    wg = rand(rng, (3, 3, 3, 4))  # 2 groups of 3 input features -> 4 outputs
    wd = rand(rng, (3, 3, 6, 2))  # depthwise, multiplier 2
    dy, dz = rand(rng, (2, 7, 7, 4)), rand(rng, (2, 4, 4, 12))

    def grads(x: tf.Tensor, wg: tf.Tensor, wd: tf.Tensor, dy: tf.Tensor, dz: tf.Tensor) -> Any:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, wg, wd])
            y = tf.nn.conv2d(x, wg, 1, "SAME")
            z = tf.nn.depthwise_conv2d(x, wd, [1, 2, 2, 1], "SAME")
        return (tape.gradient(y, [x, wg], output_gradients=dy),
                tape.gradient(z, [x, wd], output_gradients=dz))

    check(grads, x, wg, wd, dy, dz, expect="convolution")


def test_conv_fp16_bf16_and_int() -> None:
    rng = np.random.default_rng(4)
    x, w = rand(rng, (1, 6, 6, 8), np.float16), rand(rng, (3, 3, 8, 4), np.float16)
    check(lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"), x, w, expect="convolution", wide=True)
    xb, wb = x.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)
    check(lambda x, w: tf.nn.conv2d(x, w, 1, "VALID"), xb, wb, expect="convolution", tol=2e-2, wide=True)
    dn = _conv_dnums("N01C", "01IO", "N01C")
    xi, wi = rand(rng, (2, 5, 5, 3), np.int32) * 1000, rand(rng, (2, 2, 3, 2), np.int32) * 100000
    check(lambda x, w: xla.conv(x, w, [1, 1], [(0, 0), (1, 0)], [1, 1], [1, 1], dn), xi, wi, expect="convolution")


def test_conv_window_reversal_and_empty() -> None:
    rng = np.random.default_rng(5)
    # An empty batch, and an input that negative padding crops away entirely.
    dn = _conv_dnums("NC0", "OI0", "NC0")
    check(lambda x, w: xla.conv(x, w, [1], [(0, 0)], [1], [1], dn),
          rand(rng, (0, 2, 5)), rand(rng, (3, 2, 2)), expect="convolution")
    check(lambda x, w: xla.conv(x, w, [1], [(-3, -2)], [1], [1], dn),
          rand(rng, (2, 2, 5)), rand(rng, (3, 2, 1)), expect="convolution")
    # window_reversal is not reachable from TF; check it against the flipped kernel.
    case = dict(lhs=rand(rng, (2, 3, 6, 5)), rhs=rand(rng, (4, 3, 3, 2)))
    ctx = _FakeConvCtx(case["lhs"].shape, case["rhs"].shape, reversal=(1, 0))
    ours = REGISTRY["convolution"](ctx)([case["lhs"], case["rhs"]])
    flipped = np.ascontiguousarray(case["rhs"][:, :, ::-1, :])
    ref = REGISTRY["convolution"](_FakeConvCtx(case["lhs"].shape, case["rhs"].shape, reversal=(0, 0)))(
        [case["lhs"], flipped])
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


class _FakeConvCtx:
    """A hand-written context: NCHW input, OIHW kernel, NCHW output, 3x2 kernel, no padding."""

    def __init__(self, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], reversal: tuple[int, int]) -> None:
        self.instr = ir_pb2.Instruction(name="convolution.1", opcode="convolution")
        self.operand_shapes = [lhs_shape, rhs_shape]
        self.operand_dtypes = [np.dtype(np.float32)] * 2
        oh, ow = lhs_shape[2] - rhs_shape[2] + 1, lhs_shape[3] - rhs_shape[3] + 1
        self.out_shape = (lhs_shape[0], rhs_shape[0], oh, ow)
        self.out_dtype = np.dtype(np.float32)
        self.attrs = dict(
            input_batch_dimension=0, input_feature_dimension=1, input_spatial_dimensions=(2, 3),
            kernel_input_feature_dimension=1, kernel_output_feature_dimension=0, kernel_spatial_dimensions=(2, 3),
            output_batch_dimension=0, output_feature_dimension=1, output_spatial_dimensions=(2, 3),
            window_size=tuple(rhs_shape[2:]), window_reversal=reversal, feature_group_count=1, batch_group_count=1)

    def attr(self, name: str, default: Any = ...) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        if default is ...:
            raise InvalidProgramError(name)
        return default


def test_conv_errors_name_the_instruction() -> None:
    ctx = _FakeConvCtx((1, 3, 5, 5), (2, 3, 3, 2), (0, 0))
    ctx.attrs["feature_group_count"] = 2
    with pytest.raises(InvalidProgramError, match=r"convolution\.1.*feature_group_count 2"):
        REGISTRY["convolution"](ctx)


# ------------------------------------------------------------------------ reduce-window


def _scalar_fn(body: Callable[[tf.Tensor, tf.Tensor], tf.Tensor], dtype: Any) -> Any:
    spec = tf.TensorSpec((), tf.as_dtype(dtype))
    return tf.function(body, autograph=False).get_concrete_function(spec, spec)


_REDUCERS: dict[str, Callable[[tf.Tensor, tf.Tensor], tf.Tensor]] = {
    "add": lambda a, b: a + b,
    "max": tf.maximum,
    "min": tf.minimum,
    "mul": lambda a, b: a * b,
    "select_max": lambda a, b: tf.where(a > b, a, b),  # max, not recognizable as a ufunc
}


@st.composite
def window_cases(draw: st.DrawFn, dilations: bool = True) -> dict[str, Any]:
    rank = draw(st.integers(1, 4))
    shape, size, strides, pads, bdil, wdil = [], [], [], [], [], []
    for _ in range(rank):
        s = draw(st.integers(0 if dilations else 1, 6))
        k = draw(st.integers(1, 3))
        bd = draw(st.integers(1, 2)) if dilations else 1
        wd = draw(st.integers(1, 2)) if dilations else 1
        lo, hi = draw(st.integers(-1 if dilations else 0, 2)), draw(st.integers(-1 if dilations else 0, 2))
        dilated = (s - 1) * bd + 1 if s else 0
        short = (k - 1) * wd + 1 - (dilated + lo + hi)
        shape.append(s)
        size.append(k)
        strides.append(draw(st.integers(1, 3)))
        pads.append((lo, hi + max(0, short)))
        bdil.append(bd)
        wdil.append(wd)
    return dict(shape=shape, size=size, strides=strides, pads=pads, bdil=bdil, wdil=wdil,
                seed=draw(st.integers(0, 2**16)))


@HYP
@given(window_cases(), st.sampled_from(["add", "max", "min", "mul", "select_max"]),
       st.sampled_from([np.float32, np.int32]))
def test_reduce_window_random(case: dict[str, Any], reducer: str, dtype: Any) -> None:
    rng = np.random.default_rng(case["seed"])
    x = rand(rng, case["shape"], dtype)
    init = np.asarray({"add": 1, "max": -3, "min": 4, "mul": 1, "select_max": -100}[reducer], dtype)
    comp = _scalar_fn(_REDUCERS[reducer], dtype)

    def fn(x: tf.Tensor, init: tf.Tensor) -> tf.Tensor:
        return xla.reduce_window(x, init, comp, case["size"], case["strides"], case["bdil"], case["wdil"],
                                 case["pads"])

    check(fn, x, init, expect="reduce-window")


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_pooling_and_gradients(padding: str) -> None:
    rng = np.random.default_rng(6)
    if padding == "VALID":
        x = rng.integers(0, 4, size=(2, 9, 8, 3)).astype(np.float32)  # ties on purpose
    else:  # no ties where windows are padded (see test_select_and_scatter_ties)
        x = rng.permutation(2 * 9 * 8 * 3).reshape(2, 9, 8, 3).astype(np.float32)
    y_shape = tf.nn.max_pool2d(x, 3, 2, padding).shape
    dy = rand(rng, y_shape)

    def fn(x: tf.Tensor, dy: tf.Tensor) -> Any:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            mx = tf.nn.max_pool2d(x, 3, 2, padding)
            av = tf.nn.avg_pool2d(x, 3, 2, padding)
            m2 = tf.nn.max_pool2d(x, 2, 2, padding)
        dm2 = tf.ones_like(m2)
        return (mx, av, tape.gradient(mx, x, output_gradients=dy), tape.gradient(av, x, output_gradients=dy),
                tape.gradient(m2, x, output_gradients=dm2))

    check(fn, x, dy, expect="select-and-scatter")


def test_reduce_window_fp16_and_variadic() -> None:
    rng = np.random.default_rng(7)
    x = rand(rng, (2, 6, 6, 4), np.float16)
    check(lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"), x, expect="reduce-window", wide=True)
    # Variadic (min and max in one pass), against the single-operand kernel.
    a, b = rand(rng, (5, 7)), rand(rng, (5, 7))
    attrs = dict(window_size=(2, 3), window_strides=(1, 2), padding_low=(1, 0), padding_high=(0, 1))
    ctx = _HandCtx("reduce-window", [a.shape, b.shape, (), ()], [np.float32] * 4, None, None, attrs,
                   [lambda v: (np.minimum(v[0], v[2]), np.maximum(v[1], v[3]))])
    got = REGISTRY["reduce-window"](ctx)([a, b, np.float32(np.inf), np.float32(-np.inf)])
    for arr, uf, init, res in ((a, np.minimum, np.inf, got[0]), (b, np.maximum, -np.inf, got[1])):
        one = _HandCtx("reduce-window", [arr.shape, ()], [np.float32] * 2, (5, 3), np.float32, attrs,
                       [lambda v, uf=uf: uf(v[0], v[1])], ufunc=uf)
        np.testing.assert_array_equal(res, REGISTRY["reduce-window"](one)([arr, np.float32(init)]))


class _HandCtx:
    """A hand-written KernelContext (for what TF cannot express)."""

    def __init__(self, opcode: str, shapes: list[tuple[int, ...]], dtypes: list[Any], out_shape: Any,
                 out_dtype: Any, attrs: dict[str, Any], comps: list[Callable[[Sequence[Any]], Any]],
                 ufunc: np.ufunc | None = None) -> None:
        self.instr = ir_pb2.Instruction(name=f"{opcode}.7", opcode=opcode)
        self.operand_shapes = [tuple(s) for s in shapes]
        self.operand_dtypes = [np.dtype(d) for d in dtypes]
        self.out_shape = () if out_shape is None else tuple(out_shape)
        self.out_dtype = None if out_dtype is None else np.dtype(out_dtype)
        self.attrs, self.comps, self.ufunc = attrs, comps, ufunc

    def attr(self, name: str, default: Any = ...) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        if default is ...:
            raise InvalidProgramError(f"{self.instr.name}: missing attribute {name!r}")
        return default

    def computation(self, index: int) -> Callable[[Sequence[Any]], Any]:
        return self.comps[index]

    def reducer_ufunc(self, index: int) -> np.ufunc | None:
        return self.ufunc


# ------------------------------------------------------------------- select-and-scatter


_SELECTS: dict[str, Callable[[tf.Tensor, tf.Tensor], tf.Tensor]] = {
    "ge": tf.greater_equal, "gt": tf.greater, "le": tf.less_equal,
    "custom": lambda a, b: tf.logical_not(tf.less(a, b)),  # ge, spelled so probing must recognize it
}


@HYP
@given(window_cases(dilations=False), st.sampled_from(["ge", "gt", "le", "custom"]),
       st.sampled_from(["add", "max", "select_max"]), st.sampled_from([np.float32, np.int32]))
def test_select_and_scatter_random(case: dict[str, Any], select: str, scatter: str, dtype: Any) -> None:
    rng = np.random.default_rng(case["seed"])
    if any(lo or hi for lo, hi in case["pads"]):
        # Tie-breaking in padded windows differs between XLA CPU's expansion of
        # select-and-scatter and the sequential definition (see test_select_and_scatter_ties).
        x = rng.permutation(max(1, int(np.prod(case["shape"])))).astype(dtype)[: int(np.prod(case["shape"]))]
        x = x.reshape(case["shape"])
    else:
        x = rng.integers(0, 3, size=case["shape"]).astype(dtype)  # many ties
    w = window.Window(tuple(case["size"]), tuple(case["strides"]), *zip(*case["pads"], strict=True),
                      (1,) * len(case["shape"]), (1,) * len(case["shape"]), (False,) * len(case["shape"]))
    src = rand(rng, w.output_sizes(case["shape"]), dtype)
    init = np.asarray(2, dtype)
    sel, sca = _scalar_fn(_SELECTS[select], dtype), _scalar_fn(_REDUCERS[scatter], dtype)

    def fn(x: tf.Tensor, src: tf.Tensor, init: tf.Tensor) -> tf.Tensor:
        return xla.select_and_scatter(x, case["size"], case["strides"], case["pads"], src, init, sel, sca)

    check(fn, x, src, init, expect="select-and-scatter")


def test_bfloat16_select_and_scatter_warns_nothing() -> None:
    """A bfloat16 max-pool gradient (mixed_bfloat16 training): the select computation is
    recognized by probing it with NaNs, which must not leak numpy RuntimeWarnings (ml_dtypes'
    bfloat16 comparisons warn on NaN outside an errstate)."""
    import warnings

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    x, src = rand(rng, (2, 6, 6, 3)).astype(bf16), rand(rng, (2, 3, 3, 3)).astype(bf16)
    sel, sca = _scalar_fn(_SELECTS["ge"], bf16), _scalar_fn(_REDUCERS["add"], bf16)

    def fn(x: tf.Tensor, src: tf.Tensor, init: tf.Tensor) -> tf.Tensor:
        return xla.select_and_scatter(x, [1, 2, 2, 1], [1, 2, 2, 1], [[0, 0]] * 4, src, init, sel, sca)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check(fn, x, src, np.asarray(0, bf16), expect="select-and-scatter")


# ------------------------------------------------------------------------------ gather


def test_gather_tf_ops_and_embedding_gradient() -> None:
    rng = np.random.default_rng(8)
    table = rand(rng, (10, 4, 3))
    ids = np.array([[0, 3, 9], [12, -1, 3]], np.int32)  # out of range: XLA clamps
    check(lambda t, i: tf.gather(t, i), table, ids, expect="gather")
    check(lambda t, i: tf.gather(t, i, axis=1), table, ids % 4, expect="gather")
    bids = np.array([[1, 0], [3, 3], [2, 7], [0, 0], [1, 2], [3, 1], [0, 2], [1, 1], [2, 2], [3, 0]], np.int64)
    check(lambda t, i: tf.gather(t, i, axis=1, batch_dims=1), table, bids, expect="gather")
    nd = np.array([[1, 2], [9, 3], [0, 0], [4, 7]], np.int32)
    check(lambda t, i: tf.gather_nd(t, i), table, nd, expect="gather")
    ti = rand(rng, (6, 5), np.int32)
    check(lambda t, i: tf.gather(t, i), ti, np.array([5, 0, 5], np.int32), expect="gather")
    emb = rand(rng, (7, 4))
    lookups = np.array([[1, 2, 1], [6, 0, 1]], np.int32)
    dy = rand(rng, (2, 3, 4))

    def grad(emb: tf.Tensor, ids: tf.Tensor, dy: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(emb)
            y = tf.nn.embedding_lookup(emb, ids)
        g = tape.gradient(y, emb, output_gradients=dy)
        return y, tf.convert_to_tensor(g)

    check(grad, emb, lookups, dy, expect="scatter")


@st.composite
def gather_cases(draw: st.DrawFn) -> dict[str, Any]:
    rank = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    dims = list(range(rank))
    n_batching = draw(st.integers(0, min(1, rank - 1)))
    op_batch = draw(st.permutations(dims))[:n_batching]
    free = [d for d in dims if d not in op_batch]
    index_map = draw(st.permutations(free))[: draw(st.integers(0 if free else 0, len(free)))]
    collapsed = sorted(d for d in index_map if draw(st.booleans()))
    slice_sizes = []
    for d in dims:
        if d in op_batch or d in collapsed:
            slice_sizes.append(1)
        else:
            slice_sizes.append(draw(st.integers(0 if d not in index_map else 1, shape[d])))
    n_idx_batch = draw(st.integers(n_batching, n_batching + 2))
    idx_batch_shape = [draw(st.integers(1, 3)) for _ in range(n_idx_batch)]
    for j, od in enumerate(op_batch):  # paired batch dims have equal sizes
        idx_batch_shape[j] = shape[od]
    ivd = draw(st.integers(0, n_idx_batch))
    implicit = draw(st.booleans()) and len(index_map) == 1
    if implicit:
        ivd = n_idx_batch
        idx_shape = list(idx_batch_shape)
    else:
        idx_shape = idx_batch_shape[:ivd] + [len(index_map)] + idx_batch_shape[ivd:]
    batch_dims_of_idx = [d for d in range(len(idx_shape)) if d != ivd]
    idx_batching = [batch_dims_of_idx[j] for j in range(n_batching)]
    out_rank = n_idx_batch + (rank - len(collapsed) - n_batching)
    offset_dims = sorted(draw(st.permutations(list(range(out_rank))))[: rank - len(collapsed) - n_batching])
    return dict(shape=shape, index_map=index_map, collapsed=collapsed, slice_sizes=slice_sizes,
                op_batch=op_batch, idx_batching=idx_batching, ivd=ivd, idx_shape=idx_shape,
                offset_dims=offset_dims, seed=draw(st.integers(0, 2**16)),
                dtype=draw(st.sampled_from([np.float32, np.int32, np.uint8])),
                idx_dtype=draw(st.sampled_from([np.int32, np.int64])))


def _gather_dnums(case: dict[str, Any]) -> xla_data_pb2.GatherDimensionNumbers:
    d = xla_data_pb2.GatherDimensionNumbers()
    d.offset_dims.extend(case["offset_dims"])
    d.collapsed_slice_dims.extend(case["collapsed"])
    d.start_index_map.extend(case["index_map"])
    d.index_vector_dim = case["ivd"]
    d.operand_batching_dims.extend(sorted(case["op_batch"]))
    order = np.argsort(case["op_batch"]) if case["op_batch"] else []
    d.start_indices_batching_dims.extend(case["idx_batching"][i] for i in order)
    return d


@HYP
@given(gather_cases())
def test_gather_random(case: dict[str, Any]) -> None:
    rng = np.random.default_rng(case["seed"])
    x = rand(rng, case["shape"], case["dtype"])
    idx = rng.integers(-2, 7, size=case["idx_shape"]).astype(case["idx_dtype"])  # some out of range
    dn = _gather_dnums(case)

    def fn(x: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
        return xla.gather(x, idx, dn, case["slice_sizes"])

    check(fn, x, idx, expect="gather")


# ----------------------------------------------------------------------------- scatter


def test_tensor_scatter_tf_ops() -> None:
    rng = np.random.default_rng(9)
    x = rand(rng, (6, 4))
    idx = np.array([[1], [3], [1], [9], [-1], [5]], np.int32)  # duplicates; out of range skipped
    upd = rand(rng, (6, 4))
    check(lambda x, i, u: tf.tensor_scatter_nd_add(x, i, u), x, idx, upd, expect="scatter")
    check(lambda x, i, u: tf.tensor_scatter_nd_max(x, i, u), x, idx, upd, expect="scatter")
    check(lambda x, i, u: tf.tensor_scatter_nd_min(x, i, u), x, idx, upd, expect="scatter")
    uniq = np.array([[1], [3], [0], [9], [5], [2]], np.int32)
    check(lambda x, i, u: tf.tensor_scatter_nd_update(x, i, u), x, uniq, upd, expect="scatter")
    xi = rand(rng, (5, 3, 2), np.int32)
    idx2 = np.array([[0, 1], [4, 2], [0, 1], [2, 3]], np.int64)
    check(lambda x, i, u: tf.tensor_scatter_nd_add(x, i, u), xi, idx2, rand(rng, (4, 2), np.int32),
          expect="scatter")
    check(lambda x, i, u: tf.tensor_scatter_nd_sub(x, i, u), x.astype(np.float16), idx, upd.astype(np.float16),
          expect="scatter", wide=True)


@st.composite
def scatter_cases(draw: st.DrawFn) -> dict[str, Any]:
    g = draw(gather_cases())
    # The same geometry read backwards: gather's result shape is scatter's updates shape.
    g["combine"] = draw(st.sampled_from(["add", "max", "mul", "assign", "select_max"]))
    return g


@HYP
@given(scatter_cases())
def test_scatter_random(case: dict[str, Any]) -> None:
    rng = np.random.default_rng(case["seed"])
    dtype = case["dtype"]
    x = rand(rng, case["shape"], dtype)
    idx = rng.integers(-2, 7, size=case["idx_shape"]).astype(case["idx_dtype"])
    gd = _gather_dnums(case)
    batch = [n for d, n in enumerate(case["idx_shape"]) if d != case["ivd"]]
    window_sizes = [s for d, s in enumerate(case["slice_sizes"]) if d not in case["collapsed"] and d not in case["op_batch"]]
    upd_shape, it_b, it_w = [], iter(batch), iter(window_sizes)
    for a in range(len(batch) + len(window_sizes)):
        upd_shape.append(next(it_w) if a in case["offset_dims"] else next(it_b))
    upd = rand(rng, upd_shape, dtype)
    dn = xla_data_pb2.ScatterDimensionNumbers()
    dn.update_window_dims.extend(gd.offset_dims)
    dn.inserted_window_dims.extend(gd.collapsed_slice_dims)
    dn.scatter_dims_to_operand_dims.extend(gd.start_index_map)
    dn.index_vector_dim = gd.index_vector_dim
    dn.input_batching_dims.extend(gd.operand_batching_dims)
    dn.scatter_indices_batching_dims.extend(gd.start_indices_batching_dims)
    if not case["index_map"] and int(np.prod(batch)) > 1:
        # Several windows at the origin through an empty index vector: XLA CPU applies only the
        # last one (seen on TF 2.21); the kernels apply all of them, as the semantics say.
        reject()
    if case["combine"] == "assign":
        # Duplicate targets make assignment order-dependent; keep the windows disjoint.
        vecs = np.moveaxis(idx, case["ivd"], -1) if case["ivd"] < idx.ndim else idx[..., None]
        rows = [tuple(v) for v in vecs.reshape(int(np.prod(vecs.shape[:-1])), vecs.shape[-1]).tolist()]
        distinct = len(set(rows)) == len(rows) if vecs.shape[-1] else len(rows) <= 1
        if not distinct or case["op_batch"] or any(case["slice_sizes"][d] != 1 for d in case["index_map"]):
            reject()
        comp = _scalar_fn(lambda a, b: b, dtype)
    else:
        comp = _scalar_fn(_REDUCERS[case["combine"]], dtype)

    def fn(x: tf.Tensor, idx: tf.Tensor, upd: tf.Tensor) -> tf.Tensor:
        return gen_xla_ops.xla_scatter(x, idx, upd, update_computation=comp,
                                       dimension_numbers=dn.SerializeToString(), indices_are_sorted=False)

    check(fn, x, idx, upd, expect="scatter")


# ------------------------------------------------------------------ dynamic (update) slice


@pytest.mark.parametrize("starts", [(0, 0, 0), (1, 2, 1), (-3, 7, 2), (5, 100, -1)])
def test_dynamic_slice_and_update(starts: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(10)
    x = rand(rng, (4, 6, 3))
    s = np.array(starts, np.int32)
    check(lambda x, s: xla.dynamic_slice(x, s, [2, 3, 2]), x, s, expect="dynamic-slice")
    check(lambda x, s: xla.dynamic_slice(x, s, [4, 0, 3]), x, s, expect="dynamic-slice")
    u = rand(rng, (3, 2, 3))
    check(lambda x, u, s: xla.dynamic_update_slice(x, u, s), x, u, s, expect="dynamic-update-slice")
    xi = rand(rng, (4, 6, 3), np.int64)
    check(lambda x, u, s: xla.dynamic_update_slice(x, u, s), xi, u.astype(np.int64), s.astype(np.int64),
          expect="dynamic-update-slice")


def _sequential_select_and_scatter(x: np.ndarray, src: np.ndarray, init: float, size: Sequence[int],
                                   strides: Sequence[int], pads: Sequence[tuple[int, int]],
                                   select: Callable[[Any, Any], bool]) -> np.ndarray:
    """The operation's definition, one window at a time (row-major window order)."""
    out = np.full(x.shape, init, x.dtype)
    for o in np.ndindex(*src.shape):
        best = None
        for kap in np.ndindex(*size):
            pos = tuple(oi * s + k - lo for oi, s, k, (lo, _) in zip(o, strides, kap, pads, strict=True))
            if all(0 <= p < n for p, n in zip(pos, x.shape, strict=True)):
                if best is None or not select(x[best], x[pos]):
                    best = pos
        if best is not None:
            out[best] += src[o]
    return out


@pytest.mark.parametrize("select", ["ge", "gt"])
def test_select_and_scatter_ties(select: str) -> None:
    """Ties follow the sequential definition: with ``ge`` the first maximum in row-major
    window order is selected, with ``gt`` the last. XLA CPU agrees on unpadded windows (checked
    against XLA in the tests above); for some padded windows its expansion into a variadic
    reduce-window breaks ties in another order, so padded ties are checked against the
    definition here."""
    rng = np.random.default_rng(11)
    x = rng.integers(0, 2, size=(2, 7, 6, 3)).astype(np.float32)
    size, strides, pads = (1, 3, 2, 1), (1, 2, 1, 1), ((0, 0), (1, 1), (0, 1), (0, 0))
    w = window.Window(size, strides, *zip(*pads, strict=True), (1,) * 4, (1,) * 4, (False,) * 4)
    src = rand(rng, w.output_sizes(x.shape))
    attrs = dict(window_size=size, window_strides=strides, padding_low=tuple(p[0] for p in pads),
                 padding_high=tuple(p[1] for p in pads))
    pick = {"ge": np.greater_equal, "gt": np.greater}[select]
    ctx = _HandCtx("select-and-scatter", [x.shape, src.shape, ()], [np.float32] * 3, x.shape, np.float32, attrs,
                   [lambda v: pick(v[0], v[1]), lambda v: np.add(v[0], v[1])], ufunc=np.add)
    got = REGISTRY["select-and-scatter"](ctx)([x, src, np.float32(0.5)])
    ref = _sequential_select_and_scatter(x, src, 0.5, size, strides, pads, lambda a, b: bool(pick(a, b)))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
