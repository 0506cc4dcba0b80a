"""Loop fusion (emulator/fusion.py) and intra-op threads (emulator/parallel.py).

Fused element-wise groups must give exactly the unfused results (each member runs the same
numpy call on a block of rows, so float32 results are compared bit for bit), and every
kernel that splits its work over threads must give the same bits with 1 and 2 threads.
Hand-built IR (no TensorFlow) except the last test, which compares a fused GELU with XLA.
"""

from __future__ import annotations

import threading

import emulator_util as eu
import numpy as np
import pytest

from device_server.emulator import CompileOptions, compile_module, fusion, get_target, parallel

TARGET = get_target("ipu2")
F32 = np.float32


def _arithmetic_steps(exe) -> list[str]:
    """Opcodes of the entry's steps that compute (a fused step carries its root's opcode)."""
    return [i.opcode for i in exe._program.instrs if i.opcode not in ("reshape", "broadcast")]


@pytest.fixture()
def two_threads():
    before = parallel.threads()
    parallel.set_threads(2)
    yield
    parallel.set_threads(before)


def _bias_scale_relu(shape: tuple[int, ...], scale_dims: tuple[int, ...]) -> eu.IRBuilder:
    """relu((x + bias) * scale): bias broadcast along the last dim, scale of ``scale_dims``
    (aligned with the leading dims of ``shape``, ones elsewhere) broadcast over the rest."""
    b = eu.IRBuilder("bias_scale_relu")
    x = b.parameter(F32, shape)
    bias = b.parameter(F32, shape[-1:])
    scale = b.parameter(F32, scale_dims)
    zero = b.constant(np.float32(0))
    rank = len(shape)
    bb = b.op("broadcast", [bias], F32, shape, dimensions=[rank - 1])
    keep = [d for d in range(rank) if scale_dims[d] != 1] if len(scale_dims) == rank else []
    sr = b.op("reshape", [scale], F32, [scale_dims[d] for d in keep]) if keep else scale
    sb = b.op("broadcast", [sr], F32, shape, dimensions=keep)
    zb = b.op("broadcast", [zero], F32, shape, dimensions=[])
    t = b.op("add", [x, bb], F32, shape)
    t = b.op("multiply", [t, sb], F32, shape)
    b.root(b.op("maximum", [t, zb], F32, shape))
    return b


@pytest.mark.parametrize("scale_dims", [(8, 1, 1, 64), (1, 1, 1, 64)], ids=["per-image", "per-channel"])
def test_fused_chain_is_one_step_and_exact(scale_dims, two_threads):
    shape = (8, 24, 24, 64)
    module = _bias_scale_relu(shape, scale_dims).module()
    exe = compile_module(module, TARGET)
    unfused = compile_module(module, TARGET, CompileOptions(inv=True))  # checks: never fused
    assert _arithmetic_steps(exe) == ["maximum"], exe._program.source
    assert _arithmetic_steps(unfused) == ["add", "multiply", "maximum"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(F32)
    bias = rng.standard_normal(shape[-1:]).astype(F32)
    scale = rng.standard_normal(scale_dims).astype(F32)
    expected = np.maximum((x + bias) * scale, F32(0))
    got = exe.run([x, bias, scale])[0]
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(unfused.run([x, bias, scale])[0], expected)
    assert got.flags.c_contiguous and got.shape == shape


def test_value_read_outside_the_group_stays_materialized():
    """y = exp(x) feeds both a fused product and a reduce: y is kept, the rest is fused."""
    shape = (512, 512)
    b = eu.IRBuilder("shared")
    x = b.parameter(F32, shape)
    y = b.op("exponential", [x], F32, shape)
    z = b.op("multiply", [y, y], F32, shape)
    w = b.op("add", [z, y], F32, shape)  # a diamond over y
    add = eu.IRBuilder("sum")
    p, q = add.parameter(F32, []), add.parameter(F32, [])
    add.root(add.op("add", [p, q], F32, []))
    zero = b.constant(np.float32(0))
    s = b.op("reduce", [y, zero], F32, [512], called=[b.computation(add)], dimensions=[1])
    b.root(b.tuple([w, s]))
    exe = compile_module(b.module(), TARGET)
    x_val = np.random.default_rng(1).uniform(-2, 2, shape).astype(F32)
    w_got, s_got = exe.run([x_val])
    y_ref = np.exp(x_val)
    np.testing.assert_array_equal(w_got, y_ref * y_ref + y_ref)
    np.testing.assert_allclose(s_got, y_ref.sum(axis=1, dtype=np.float64), rtol=1e-6)
    # exp stays a step of its own (the reduce reads it); multiply+add became one step.
    assert sorted(_arithmetic_steps(exe)) == ["add", "exponential", "reduce", "tuple"], exe._program.source


def test_small_outputs_are_not_fused():
    shape = (16, 64)  # far below fusion.MIN_ELEMENTS
    assert np.prod(shape) < fusion.MIN_ELEMENTS
    exe = compile_module(_bias_scale_relu(shape, (1, 64)).module(), TARGET)
    assert _arithmetic_steps(exe) == ["add", "multiply", "maximum"]


def test_fault_injection_still_reaches_a_fused_chain():
    shape = (8, 24, 24, 64)
    module = _bias_scale_relu(shape, (1, 1, 1, 64)).module()
    exe = compile_module(module, TARGET, CompileOptions(fault_inject_opcode="multiply"))
    rng = np.random.default_rng(2)
    args = [rng.standard_normal(shape).astype(F32), rng.standard_normal(64).astype(F32),
            rng.standard_normal((1, 1, 1, 64)).astype(F32)]
    clean = np.maximum((args[0] + args[1]) * args[2], F32(0))
    assert not np.array_equal(exe.run(args)[0], clean)


def _conv_dot_module() -> eu.IRBuilder:
    """A 3x3 convolution (im2col path), a 1x1 convolution (one matmul), a depthwise one and
    a batched dot: all of them big enough to be cut over threads."""
    b = eu.IRBuilder("kernels")
    x = b.parameter(F32, (4, 32, 32, 32))
    k3 = b.parameter(F32, (3, 3, 32, 64))
    k1 = b.parameter(F32, (1, 1, 64, 64))
    kd = b.parameter(F32, (3, 3, 1, 64))
    conv = dict(input_batch_dimension=0, input_feature_dimension=3, input_spatial_dimensions=[1, 2],
                kernel_input_feature_dimension=2, kernel_output_feature_dimension=3,
                kernel_spatial_dimensions=[0, 1], output_batch_dimension=0, output_feature_dimension=3,
                output_spatial_dimensions=[1, 2], window_size=[3, 3], window_strides=[1, 1],
                padding_low=[1, 1], padding_high=[1, 1])
    c3 = b.op("convolution", [x, k3], F32, (4, 32, 32, 64), **conv)
    c1 = b.op("convolution", [c3, k1], F32, (4, 32, 32, 64),
              **{**conv, "window_size": [1, 1], "padding_low": [0, 0], "padding_high": [0, 0]})
    dw = b.op("convolution", [c1, kd], F32, (4, 32, 32, 64), feature_group_count=64, **conv)
    r = b.op("reshape", [dw], F32, (4, 1024, 64))
    d = b.op("dot", [r, r], F32, (4, 1024, 1024), lhs_batch_dimensions=[0], rhs_batch_dimensions=[0],
             lhs_contracting_dimensions=[2], rhs_contracting_dimensions=[2])
    b.root(b.tuple([dw, d]))
    return b


def test_threads_do_not_change_results():
    exe = compile_module(_conv_dot_module().module(), TARGET)
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(s).astype(F32) for s in
            ((4, 32, 32, 32), (3, 3, 32, 64), (1, 1, 64, 64), (3, 3, 1, 64))]
    before = parallel.threads()
    try:
        parallel.set_threads(1)
        one = exe.run(args)
        parallel.set_threads(2)
        two = exe.run(args)
        parallel.set_threads(3)  # more threads than cores: still the same bits
        three = exe.run(args)
    finally:
        parallel.set_threads(before)
    for a, b, c in zip(one, two, three, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_run_parts_runs_each_part_once_and_raises_the_first_error(two_threads):
    seen: list[int] = []
    lock = threading.Lock()

    def part(i: int) -> None:
        with lock:
            seen.append(i)

    parallel.run_parts(part, 100)
    assert sorted(seen) == list(range(100))

    def nested(i: int) -> None:  # parts that cut their own work again must not deadlock
        parallel.run_parts(part, 3)

    seen.clear()
    parallel.run_parts(nested, 8)
    assert len(seen) == 24

    def failing(i: int) -> None:
        if i == 5:
            raise ValueError("part 5 failed")

    with pytest.raises(ValueError, match="part 5 failed"):
        parallel.run_parts(failing, 50)
    with pytest.raises(ValueError):
        parallel.set_threads(0)
    assert parallel.split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert parallel.split(2, 8) == [(0, 1), (1, 2)]


def test_parts_keep_the_callers_numpy_error_state(two_threads):
    """Executable.run ignores floating-point warnings; the pool threads must too."""
    shape = (512, 512)
    b = eu.IRBuilder("overflow")
    x = b.parameter(F32, shape)
    y = b.op("exponential", [x], F32, shape)
    b.root(b.op("multiply", [y, y], F32, shape))
    exe = compile_module(b.module(), TARGET)
    assert _arithmetic_steps(exe) == ["multiply"]
    with np.errstate(all="raise"):
        got = exe.run([np.full(shape, 100.0, F32)])[0]  # exp(100) overflows float32
    assert np.isinf(got).all()


def test_fused_gelu_matches_xla():
    import tensorflow as tf

    x = np.random.default_rng(4).standard_normal((256, 1024)).astype(F32) * 3

    def gelu(v):
        return tf.nn.gelu(v, approximate=False) * 2.0 + v

    d = eu.Differential(gelu, x)
    assert len(_arithmetic_steps(d.exe)) == 1, d.exe._program.source  # one fused chain
    d.check(x, rtol=1e-5, atol=1e-6)


def test_server_flag_sets_the_thread_count(capsys):
    from device_server import cli

    assert cli.build_parser().parse_args(["--emulator-threads", "3"]).emulator_threads == 3
    assert cli.main(["--emulator-threads", "-1"]) == 2
    assert "--emulator-threads must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("use_jit", [False, True], ids=["numpy", "jit"])
def test_expanded_broadcasts_are_read_from_their_operands(use_jit):
    """add(broadcast(a), broadcast(b)) has no full-shaped operand, so both broadcasts are
    expanded steps; the fused group reads a and b themselves (ones where they broadcast), and
    the sum, smaller than a block, must not be used as a block's output buffer."""
    from device_server.emulator import jit

    shape = (64, 24, 512)
    b = eu.IRBuilder("expanded")
    x = b.parameter(F32, shape)
    a = b.parameter(F32, (512,))
    c = b.parameter(F32, (64,))
    ab = b.op("broadcast", [a], F32, shape, dimensions=[2])
    cb = b.op("broadcast", [c], F32, shape, dimensions=[0])
    t = b.op("add", [ab, cb], F32, shape)
    u = b.op("multiply", [t, x], F32, shape)
    b.root(b.op("subtract", [u, ab], F32, shape))
    before = jit.enabled()
    jit.set_enabled(use_jit)
    try:
        exe = compile_module(b.module(), TARGET)
    finally:
        jit.set_enabled(before)
    assert _arithmetic_steps(exe) == ["subtract"], exe._program.source  # broadcasts gone too
    rng = np.random.default_rng(5)
    args = [rng.standard_normal(shape).astype(F32), rng.standard_normal(512).astype(F32),
            rng.standard_normal(64).astype(F32)]
    x_, a_, c_ = args
    expected = (a_ + c_[:, None, None]) * x_ - a_
    np.testing.assert_array_equal(exe.run(args)[0], expected)
