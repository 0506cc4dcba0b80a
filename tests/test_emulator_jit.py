"""Compiled loops for fused groups (emulator/jit.py).

A fused group runs as compiled loops when numba is there; the members it compiles are those
whose IEEE result does not depend on how it is computed, so every result here is compared bit
for bit with the same program run with the jit off (numpy blocks), and with numpy itself.
Inputs include NaN, infinities, signed zeros and subnormals. Hand-built IR; the last test
compares a fused GELU with XLA.
"""

from __future__ import annotations

import subprocess
import sys

import emulator_util as eu
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_server.emulator import compile_module, fusion, get_target, jit, parallel

TARGET = get_target("ipu2")
F32, F64 = np.float32, np.float64
SHAPE = (64, 48, 64)  # 196608 elements: fused (fusion.MIN_ELEMENTS is 131072)


@pytest.fixture(autouse=True)
def jit_on():
    before = jit.enabled()
    jit.set_enabled(True)
    yield
    jit.set_enabled(before)


def _fused_steps(exe) -> list[bool]:
    """For each fused step of the entry program: does it run compiled loops?"""
    return [s.fn.jit for s in exe._program.steps if hasattr(s.fn, "jit")]


def _both(module, args):
    """(result with the jit, result without it, the jit executable)."""
    exe = compile_module(module, TARGET)
    jit.set_enabled(False)
    try:
        plain = compile_module(module, TARGET)
    finally:
        jit.set_enabled(True)
    assert not any(_fused_steps(plain))
    return exe.run(args), plain.run(args), exe


def _values(rng: np.random.Generator, shape, dtype=F32) -> np.ndarray:
    """Normal values with NaN, +-inf, +-0 and subnormals sprinkled in."""
    x = rng.standard_normal(shape).astype(dtype) * 4
    flat = x.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(dtype).tiny / 4, 1.0],
                        dtype)
    idx = rng.choice(flat.size, size=min(flat.size, 700), replace=False)
    flat[idx] = specials[np.arange(idx.size) % specials.size]
    return x


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)  # NaN equals NaN here; +0 equals -0
    if a.dtype.kind == "f":  # and the signs of zeros and NaNs match too
        np.testing.assert_array_equal(np.signbit(a[a == 0]), np.signbit(b[a == 0]))


BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum"]


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_every_compiled_opcode_gives_numpys_bits(dtype):
    """One group using each opcode jit.expression compiles, in float32 and float64."""
    b = eu.IRBuilder("all_ops")
    x = b.parameter(dtype, SHAPE)
    y = b.parameter(dtype, SHAPE)
    vals = [b.op(op, [x, y], dtype, SHAPE) for op in BINARY]
    vals += [b.op(op, [x], dtype, SHAPE) for op in ("negate", "abs", "sqrt")]
    vals.append(b.op("clamp", [y, x, vals[0]], dtype, SHAPE))
    acc = vals[0]
    for v in vals[1:]:
        acc = b.op("add", [acc, v], dtype, SHAPE)
    preds = [b.op("compare", [x, y], bool, SHAPE, direction=d, compare_type="FLOAT")
             for d in ("EQ", "NE", "LT", "LE", "GT", "GE")]
    p = b.op("and", [preds[2], preds[1]], bool, SHAPE)
    p = b.op("or", [p, preds[0]], bool, SHAPE)
    p = b.op("xor", [p, preds[5]], bool, SHAPE)
    p = b.op("not", [p], bool, SHAPE)
    sel = b.op("select", [p, acc, y], dtype, SHAPE)
    other = F64 if dtype == F32 else F32
    there = b.op("convert", [sel], other, SHAPE)
    back = b.op("convert", [b.op("multiply", [there, there], other, SHAPE)], dtype, SHAPE)
    flag = b.op("convert", [preds[3]], dtype, SHAPE)
    nz = b.op("convert", [back], bool, SHAPE)
    res = b.op("add", [back, flag], dtype, SHAPE)
    b.root(b.op("select", [nz, res, x], dtype, SHAPE))
    rng = np.random.default_rng(0)
    args = [_values(rng, SHAPE, dtype), _values(rng, SHAPE, dtype)]
    args[1].reshape(-1)[:50] = args[0].reshape(-1)[:50]  # equal operands for EQ/LE/GE
    with_jit, without, exe = _both(b.module(), args)
    assert _fused_steps(exe) == [True], exe._program.source
    _same(with_jit[0], without[0])
    # and numpy itself, written out
    xv, yv = args
    with np.errstate(all="ignore"):
        vals_np = [xv + yv, xv - yv, xv * yv, xv / yv, np.maximum(xv, yv), np.minimum(xv, yv),
                   -xv, np.abs(xv), np.sqrt(xv)]
        vals_np.append(np.minimum(np.maximum(xv, yv), vals_np[0]))
        acc_np = vals_np[0]
        for v in vals_np[1:]:
            acc_np = acc_np + v
        p_np = ~(((xv < yv) & (xv != yv) | (xv == yv)) ^ (xv >= yv))
        sel_np = np.where(p_np, acc_np, yv)
        there_np = sel_np.astype(other)
        back_np = (there_np * there_np).astype(dtype)
        res_np = back_np + (xv <= yv).astype(dtype)
        expected = np.where(back_np != 0, res_np, xv)
    _same(with_jit[0], expected)


def test_broadcast_inputs_scalars_and_hoisting():
    """Inputs broadcast along rows, along columns, in a middle dimension, a scalar parameter
    and scalar constants: each is read with its own index pattern."""
    shape = (16, 96, 160)
    b = eu.IRBuilder("broadcasts")
    x = b.parameter(F32, shape)
    bias = b.parameter(F32, (160,))
    scale = b.parameter(F32, (16, 1, 1))
    mid = b.parameter(F32, (96,))
    s = b.parameter(F32, ())
    c = b.constant(np.float32(0.75))
    bb = b.op("broadcast", [bias], F32, shape, dimensions=[2])
    sr = b.op("reshape", [scale], F32, (16,))
    sb = b.op("broadcast", [sr], F32, shape, dimensions=[0])
    mb = b.op("broadcast", [mid], F32, shape, dimensions=[1])
    scb = b.op("broadcast", [s], F32, shape, dimensions=[])
    cb = b.op("broadcast", [c], F32, shape, dimensions=[])
    t = b.op("add", [x, bb], F32, shape)
    t = b.op("multiply", [t, sb], F32, shape)
    t = b.op("subtract", [t, mb], F32, shape)
    u = b.op("multiply", [scb, cb], F32, shape)  # depends on scalars only: hoisted
    t = b.op("divide", [t, u], F32, shape)
    b.root(b.op("maximum", [t, cb], F32, shape))
    rng = np.random.default_rng(1)
    args = [_values(rng, shape), rng.standard_normal(160).astype(F32),
            rng.standard_normal((16, 1, 1)).astype(F32), rng.standard_normal(96).astype(F32),
            np.float32(1.5)]
    with_jit, without, exe = _both(b.module(), args)
    assert _fused_steps(exe) == [True]
    _same(with_jit[0], without[0])
    x_, bias_, scale_, mid_, s_ = args
    with np.errstate(all="ignore"):
        expected = np.maximum(((x_ + bias_) * scale_ - mid_[:, None]) / (s_ * F32(0.75)), F32(0.75))
    _same(with_jit[0], expected)


def test_numpy_members_between_compiled_loops():
    """exp and tanh run their numpy kernels inside the group; a value read by a numpy member
    and by later compiled members, a numpy member of broadcast inputs only, and a numpy root."""
    shape = (256, 768)
    b = eu.IRBuilder("mixed")
    x = b.parameter(F32, shape)
    bias = b.parameter(F32, (768,))
    bb = b.op("broadcast", [bias], F32, shape, dimensions=[1])
    eb = b.op("exponential", [bb], F32, shape)      # numpy, of a broadcast input only
    t = b.op("multiply", [x, x], F32, shape)        # read by exp and by the add below
    e = b.op("exponential", [b.op("negate", [t], F32, shape)], F32, shape)
    u = b.op("add", [e, t], F32, shape)
    u = b.op("multiply", [u, eb], F32, shape)
    b.root(b.op("tanh", [u], F32, shape))           # numpy root
    rng = np.random.default_rng(2)
    args = [_values(rng, shape), rng.standard_normal(768).astype(F32)]
    with_jit, without, exe = _both(b.module(), args)
    assert _fused_steps(exe) == [True], exe._program.source
    _same(with_jit[0], without[0])
    x_, bias_ = args
    with np.errstate(all="ignore"):
        t_ = x_ * x_
        expected = np.tanh((np.exp(-t_) + t_) * np.exp(bias_))
    _same(with_jit[0], expected)


def test_groups_with_nothing_to_compile_or_other_types_use_numpy_blocks():
    shape = (512, 512)
    b = eu.IRBuilder("no_jit")
    x = b.parameter(F32, shape)
    b.root(b.op("tanh", [b.op("exponential", [x], F32, shape)], F32, shape))
    exe = compile_module(b.module(), TARGET)
    assert _fused_steps(exe) == [False]
    b = eu.IRBuilder("ints")
    i = b.parameter(np.int32, shape)
    b.root(b.op("multiply", [b.op("add", [i, i], np.int32, shape), i], np.int32, shape))
    exe = compile_module(b.module(), TARGET)
    assert _fused_steps(exe) == [False]
    v = np.arange(512 * 512, dtype=np.int32).reshape(shape)
    np.testing.assert_array_equal(exe.run([v])[0], (v + v) * v)


def test_expression_refuses_what_it_cannot_compute_exactly():
    f32, f16, i32, b1 = (np.dtype(t) for t in (F32, np.float16, np.int32, bool))
    assert jit.expression("add", {}, [f32, f32], f32) == "({0} + {1})"
    assert jit.expression("add", {}, [f16, f16], f16) is None       # no float16 in the loops
    assert jit.expression("divide", {}, [i32, i32], i32) is None    # XLA's integer division
    assert jit.expression("exponential", {}, [f32], f32) is None    # numpy's exp differs
    assert jit.expression("compare", {"direction": "LT", "compare_type": "TOTALORDER"},
                          [f32, f32], b1) is None
    assert jit.expression("compare", {"direction": "LT"}, [f32, f32], b1) == "({0} < {1})"
    assert jit.expression("convert", {}, [f32], i32) is None        # saturating conversion
    assert jit.expression("select", {}, [b1, f32, f32], f32) == "({1} if {0} else {2})"


def test_threads_and_block_sizes_do_not_change_results(monkeypatch):
    shape = (50, 3000)  # rows that do not divide into blocks evenly
    b = eu.IRBuilder("blocks")
    x = b.parameter(F32, shape)
    y = b.parameter(F32, (3000,))
    yb = b.op("broadcast", [y], F32, shape, dimensions=[1])
    t = b.op("multiply", [b.op("add", [x, yb], F32, shape), x], F32, shape)
    b.root(b.op("subtract", [b.op("exponential", [t], F32, shape), yb], F32, shape))
    rng = np.random.default_rng(3)
    args = [_values(rng, shape), rng.standard_normal(3000).astype(F32)]
    results = []
    before = parallel.threads()
    try:
        for threads, block in ((1, 1 << 16), (2, 1 << 16), (3, 1 << 12), (2, 3000 * 7)):
            parallel.set_threads(threads)
            monkeypatch.setattr(fusion, "JIT_BLOCK_ELEMENTS", block)
            exe = compile_module(b.module(), TARGET)
            assert _fused_steps(exe) == [True]
            results.append(exe.run(args)[0])
    finally:
        parallel.set_threads(before)
    for r in results[1:]:
        _same(r, results[0])


_UNARY = ["negate", "abs", "sqrt", "exponential", "tanh"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_groups_match_numpy_blocks(data):
    """Random element-wise DAGs (compiled and numpy members mixed, inputs of random broadcast
    patterns) give the same bits with and without the jit."""
    rank = data.draw(st.integers(2, 3))
    shape = tuple(data.draw(st.sampled_from([1, 3, 8, 64, 200])) for _ in range(rank - 1)) + (
        data.draw(st.sampled_from([5, 128, 1024])),)
    if np.prod(shape) < fusion.MIN_ELEMENTS:
        shape = (fusion.MIN_ELEMENTS // int(np.prod(shape)) + 1, *shape)
        rank += 1
    dtype = data.draw(st.sampled_from([F32, F64]))
    b = eu.IRBuilder("random")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    vals, args = [], []
    for _ in range(data.draw(st.integers(1, 3))):
        pattern = tuple(d if data.draw(st.booleans()) else 1 for d in shape)
        p = b.parameter(dtype, pattern)
        keep = [i for i, d in enumerate(pattern) if d != 1]
        r = b.op("reshape", [p], dtype, [pattern[i] for i in keep])
        vals.append(b.op("broadcast", [r], dtype, shape, dimensions=keep))
        args.append(_values(rng, pattern, dtype))
    full = b.parameter(dtype, shape)
    vals.append(full)
    args.append(_values(rng, shape, dtype))
    for _ in range(data.draw(st.integers(2, 8))):
        kind = data.draw(st.sampled_from(["binary", "unary", "select"]))
        pick = st.sampled_from(range(len(vals)))
        a, c = vals[data.draw(pick)], vals[data.draw(pick)]
        if kind == "binary":
            vals.append(b.op(data.draw(st.sampled_from(BINARY)), [a, c], dtype, shape))
        elif kind == "unary":
            vals.append(b.op(data.draw(st.sampled_from(_UNARY)), [a], dtype, shape))
        else:
            pred = b.op("compare", [a, c], bool, shape, direction=data.draw(
                st.sampled_from(["LT", "GE", "NE"])), compare_type="FLOAT")
            vals.append(b.op("select", [pred, a, c], dtype, shape))
    b.root(vals[-1])
    with_jit, without, _ = _both(b.module(), args)
    _same(with_jit[0], without[0])


def test_environment_variable_switches_the_jit_off():
    code = ("from device_server.emulator import jit; import sys; "
            "sys.exit(0 if jit.enabled() is False else 1)")
    env = {"TF_IPU_EMULATOR_JIT": "0", "PATH": ""}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


def test_fused_gelu_with_jit_matches_xla():
    import tensorflow as tf

    x = np.random.default_rng(4).standard_normal((128, 3072)).astype(F32) * 3

    def gelu(v):
        return tf.nn.gelu(v, approximate=False)

    d = eu.Differential(gelu, x)
    assert _fused_steps(d.exe) == [True], d.exe._program.source
    d.check(x, rtol=1e-5, atol=1e-6)


def test_server_flag_switches_the_jit_off():
    from device_server import cli

    assert cli.build_parser().parse_args([]).emulator_jit is True
    assert cli.build_parser().parse_args(["--no-emulator-jit"]).emulator_jit is False


def test_a_loop_that_does_not_compile_falls_back_to_numpy(monkeypatch, caplog):
    def broken(source, sig):
        raise RuntimeError("LLVM ran out of luck")

    monkeypatch.setattr(jit, "_compile", broken)
    shape = (512, 512)
    b = eu.IRBuilder("fallback")
    x = b.parameter(F32, shape)
    b.root(b.op("multiply", [b.op("add", [x, x], F32, shape), x], F32, shape))
    exe = compile_module(b.module(), TARGET)
    assert _fused_steps(exe) == [False]
    assert "did not compile (RuntimeError: LLVM ran out of luck)" in caplog.text
    v = np.random.default_rng(6).standard_normal(shape).astype(F32)
    np.testing.assert_array_equal(exe.run([v])[0], (v + v) * v)


def test_sessions_running_the_same_compiled_loops_at_once_get_their_own_results():
    shape = (256, 1024)
    b = eu.IRBuilder("concurrent")
    x = b.parameter(F32, shape)
    t = b.op("multiply", [b.op("add", [x, x], F32, shape), x], F32, shape)
    b.root(b.op("subtract", [b.op("exponential", [t], F32, shape), x], F32, shape))
    exe = compile_module(b.module(), TARGET)
    assert _fused_steps(exe) == [True]
    inputs = [np.random.default_rng(10 + k).uniform(-2, 2, shape).astype(F32) for k in range(4)]
    expected = [np.exp((v + v) * v) - v for v in inputs]
    got: dict[int, list[np.ndarray]] = {}

    def worker(k: int) -> None:
        got[k] = [exe.run([inputs[k]])[0] for _ in range(5)]

    eu.run_in_threads(worker, 4)
    for k in range(4):
        for r in got[k]:
            _same(r, expected[k])


def _scaled_chain(c: float) -> object:
    shape = (512, 512)
    b = eu.IRBuilder("scaled")
    x = b.parameter(F32, shape)
    k = b.op("broadcast", [b.constant(F32(c))], F32, shape, dimensions=[])
    b.root(b.op("multiply", [b.op("add", [x, k], F32, shape), x], F32, shape))
    return b.module()


def test_chains_differing_in_constants_share_a_kernel_and_the_kernel_count_is_capped(
        monkeypatch, caplog):
    """Compiled code is never freed, so kernels take constants as arguments (one kernel for
    every constant) and a process compiles at most jit.MAX_KERNELS of them."""
    v = np.random.default_rng(7).standard_normal((512, 512)).astype(F32)
    first = compile_module(_scaled_chain(0.5), TARGET)
    count = jit._compiled
    second = compile_module(_scaled_chain(-3.25), TARGET)
    assert jit._compiled == count  # the same kernel
    assert _fused_steps(first) == _fused_steps(second) == [True]
    np.testing.assert_array_equal(first.run([v])[0], (v + F32(0.5)) * v)
    np.testing.assert_array_equal(second.run([v])[0], (v + F32(-3.25)) * v)
    monkeypatch.setattr(jit, "MAX_KERNELS", count)
    b = eu.IRBuilder("new_kind")
    x = b.parameter(F32, (512, 512))
    b.root(b.op("subtract", [b.op("multiply", [x, x], F32, (512, 512)), x], F32, (512, 512)))
    third = compile_module(b.module(), TARGET)
    assert _fused_steps(third) == [False]
    assert "kernels compiled in this process" in caplog.text
    np.testing.assert_array_equal(third.run([v])[0], v * v - v)


def _special_values(rng, shape, dtype):
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    flat = x.reshape(-1)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(dtype).tiny / 4, 1.0], dtype)
    k = max(1, flat.size // 6)
    flat[rng.choice(flat.size, size=k, replace=False)] = special[np.arange(k) % special.size]
    return x


@pytest.mark.parametrize("seed", range(6))
def test_small_element_wise_groups_in_loop_bodies_compile_to_the_same_bits(monkeypatch, seed):
    """Chains of element-wise ops over small arrays in a while body run as compiled groups
    (fusion.plan_small_groups, jit.group_function) once hot; here at once (HOT_RUNS = 1):
    the results are those of the numpy path bit for bit (NaN, infinities, signed zeros,
    subnormals), and the loop's groups did compile."""
    import tensorflow as tf

    monkeypatch.setattr(jit, "HOT_RUNS", 1)
    rng = np.random.default_rng(seed)
    shape = [(7,), (3, 5), (16, 64), (2, 3, 4), (1, 10), (40, 40)][seed]
    dtype = (F32, F64)[seed % 2]
    ops = ["add", "sub", "mul", "div", "max", "min", "neg", "abs", "sqrt", "select", "exp",
           "tanh", "bias", "scale"]
    plan = [(ops[int(rng.integers(len(ops)))], int(rng.integers(100)), int(rng.integers(100)))
            for _ in range(int(rng.integers(5, 12)))]
    x0, y0 = _special_values(rng, shape, dtype), _special_values(rng, shape, dtype)
    bias = _special_values(rng, shape[-1:], dtype)
    scale = np.asarray(rng.standard_normal(), dtype)

    def apply(op, u, v, bias, s):
        if op in ("add", "sub", "mul", "div"):
            return {"add": tf.add, "sub": tf.subtract, "mul": tf.multiply, "div": tf.divide}[op](u, v)
        if op in ("max", "min"):
            return (tf.maximum if op == "max" else tf.minimum)(u, v)
        if op in ("neg", "abs", "sqrt", "exp", "tanh"):
            return {"neg": tf.negative, "abs": tf.abs, "sqrt": tf.sqrt, "exp": tf.exp,
                    "tanh": tf.tanh}[op](u)
        if op == "select":
            return tf.where(u < v, u, v * 0.5)
        return u + bias if op == "bias" else u * s + 1.5

    def fn(x, y, bias, s):
        def body(t, a, b):
            vals = [a, b]
            for op, i, j in plan:
                vals.append(apply(op, vals[i % len(vals)], vals[j % len(vals)], bias, s))
            return t + 1, vals[-1], vals[-2] - a * 0.25

        _, a, b = tf.while_loop(lambda t, *_: t < 5, body, (tf.constant(0), x, y))
        return a, b

    f = tf.function(fn, jit_compile=True, autograph=False)
    module = eu.hlo_module_to_ir(eu.hlo_of(f, x0, y0, bias, scale))
    with np.errstate(all="ignore"):
        got, want, exe = _both(module, [x0, y0, bias, scale])
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
        zero = a == 0
        np.testing.assert_array_equal(np.signbit(a[zero]), np.signbit(b[zero]))
    assert _compiled_groups(exe) >= 1, "no group of the loop body ran compiled"


def _compiled_groups(exe) -> int:
    """Compiled small groups reachable from an executable's program (through the generated
    code's globals and the kernels' closures: the while body is one of them)."""
    seen: set[int] = set()
    count = 0

    def walk(fn, depth: int = 0) -> None:
        nonlocal count
        if depth > 6 or id(fn) in seen:
            return
        seen.add(id(fn))
        scope = getattr(fn, "__globals__", None)
        if scope is not None and scope.get("fail") is not None:  # a generated program
            for value in list(scope.values()):
                if getattr(value, "compiled_group", False) and value.compiled():
                    count += 1
                if callable(value):
                    walk(value, depth + 1)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if callable(value):
                walk(value, depth + 1)

    walk(exe._program._call)
    return count
