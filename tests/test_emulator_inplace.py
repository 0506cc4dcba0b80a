"""Loop-carried buffers updated in place (emulator/compiler.py ``mark_in_place``, the
``while`` and ``dynamic-update-slice`` kernels).

A while body that writes one slice of a buffer per iteration (a TensorArray, a TensorList
that TF's gradients push every step into) updates the buffer in place, as XLA does, instead of
copying it every iteration. Each case is checked against XLA, that the update was indeed
marked in place (or, where something else reads the buffer, that it was not), and that the
caller's values and the program's constants are unchanged by the loop (a second run gives
the same result).
"""

from __future__ import annotations

import emulator_util as eu
import numpy as np
import pytest
import tensorflow as tf

from device_server.emulator import compile_module, get_target
from device_server.emulator import compiler as emu_compiler

TARGET = get_target("ipu2")
F32 = np.float32


@pytest.fixture()
def marked(monkeypatch):
    """The paths each compiled while loop got marked in place, in compile order."""
    seen: list[tuple[tuple[int, ...], ...]] = []
    orig = emu_compiler._Compiler.mark_in_place

    def spy(self, body):
        paths = orig(self, body)
        seen.append(paths)
        return paths

    monkeypatch.setattr(emu_compiler._Compiler, "mark_in_place", spy)
    return seen


def test_tensor_array_written_each_step_matches_xla(marked):
    steps = 20

    def fn(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        ta = tf.TensorArray(tf.float32, size=steps)

        def body(t, ta, h):
            h = tf.tanh(x[t] + 0.5 * h)
            return t + 1, ta.write(t, h), h

        _, ta, h = tf.while_loop(lambda t, *_: t < steps, body, (0, ta, tf.zeros_like(x[0])))
        return ta.stack(), h

    x = np.random.default_rng(0).standard_normal((steps, 8, 16)).astype(F32)
    d = eu.Differential(fn, x)
    assert any(paths for paths in marked), marked
    d.check(x, rtol=1e-6, atol=1e-6)
    first = d.exe.run([x])
    second = d.exe.run([x])  # the loop's initial buffer (a constant) was not written
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_recurrent_gradients_with_pushed_tensor_lists_match_xla(marked):
    """TF's while-loop gradients push every intermediate into TensorLists (nested tuples of
    buffer and size in the state): those pushes are marked in place. The backward loop adds
    each step's input gradient (a dynamic-update-slice of zeros) into an accumulator: that
    becomes an update of one slice, in place too."""
    steps = 15

    def fn(v: tf.Tensor, w: tf.Tensor, u: tf.Tensor) -> tuple[tf.Tensor, ...]:
        with tf.GradientTape() as tape:
            tape.watch([v, w, u])

            def body(t, h, acc):
                h = tf.tanh(tf.matmul(v[:, t], w) + tf.matmul(h, u))
                return t + 1, h, acc + tf.reduce_sum(h * h)

            _, h, loss = tf.while_loop(lambda t, *_: t < steps, body,
                                       (0, tf.zeros([4, 12]), tf.constant(0.0)),
                                       maximum_iterations=steps)  # XLA needs the bound
        return (h, loss, *tape.gradient(loss, [v, w, u]))

    rng = np.random.default_rng(1)
    args = [rng.standard_normal((4, steps, 6)).astype(F32),
            (rng.standard_normal((6, 12)) / 3).astype(F32),
            (rng.standard_normal((12, 12)) / 4).astype(F32)]
    d = eu.Differential(fn, *args)
    forward, backward = marked  # the pushes; the input gradient added into its accumulator
    assert len(forward) >= 2 and all(len(p) == 2 for p in forward), marked
    assert len(backward) == 1, marked
    d.check(*args, rtol=2e-5, atol=2e-6)
    first = d.exe.run(args)
    for a, b in zip(first, d.exe.run(args), strict=True):
        np.testing.assert_array_equal(a, b)


def _loop_module(mode: str) -> eu.IRBuilder:
    """while (i < 6): buf = dynamic-update-slice(buf, row(i), i); i += 1, and element 2 of the
    state is: ``pass`` -- passed through; ``old-value-read`` -- the buffer before the update
    (read whole: the update must copy); ``slice-before`` / ``slice-after`` -- updated with the
    row of the buffer before the update, a dynamic-slice placed before (the update may then
    write in place) or after the update in program order (it may not)."""
    shape = (6, 4)
    s32 = np.int32
    cond = eu.IRBuilder("cond")
    cp = cond.parameter(F32, [])  # given the state's tuple shape below
    cond_param = cond._comp.instructions[-1]
    body = eu.IRBuilder("body")
    bp = body.parameter(F32, [])
    body_param = body._comp.instructions[-1]
    main = eu.IRBuilder("main")
    i0 = main.constant(np.int32(0))
    buf0 = main.parameter(F32, shape)
    old0 = main.constant(np.zeros(shape, F32))
    init = main.tuple([i0, buf0, old0])
    for param in (cond_param, body_param):
        param.shape.CopyFrom(main.shape(init))
    i = cond.op("get-tuple-element", [cp], s32, [], index=0)
    six = cond.constant(np.int32(6))
    cond.root(cond.op("compare", [i, six], bool, [], direction="LT", compare_type="SIGNED"))
    bi = body.op("get-tuple-element", [bp], s32, [], index=0)
    buf = body.op("get-tuple-element", [bp], F32, shape, index=1)
    fi = body.op("convert", [bi], F32, [])
    row = body.op("broadcast", [fi], F32, (1, 4), dimensions=[])
    zero = body.constant(np.int32(0))

    def read_row() -> int:
        return body.op("dynamic-slice", [buf, bi, zero], F32, (1, 4), slice_sizes=[1, 4])

    got = read_row() if mode == "slice-before" else None
    new = body.op("dynamic-update-slice", [buf, row, bi, zero], F32, shape)
    if mode == "slice-after":
        got = read_row()
    one = body.constant(np.int32(1))
    ni = body.op("add", [bi, one], s32, [])
    if mode == "old-value-read":
        old = body.op("multiply", [buf, body.op("broadcast", [body.constant(F32(1))], F32, shape,
                                                 dimensions=[])], F32, shape)
    elif got is not None:
        acc = body.op("get-tuple-element", [bp], F32, shape, index=2)
        old = body.op("dynamic-update-slice", [acc, got, bi, zero], F32, shape)
    else:
        old = body.op("get-tuple-element", [bp], F32, shape, index=2)
    body.root(body.tuple([ni, new, old]))
    loop = main.op("while", [init], None, [init], called=[main.computation(cond), main.computation(body)])
    main._comp.instructions[-1].shape.CopyFrom(main.shape(init))
    r1 = main.op("get-tuple-element", [loop], F32, shape, index=1)
    r2 = main.op("get-tuple-element", [loop], F32, shape, index=2)
    main.root(main.tuple([r1, r2, buf0]))
    return main


@pytest.mark.parametrize("mode, paths", [
    ("pass", ((1,),)), ("old-value-read", ()), ("slice-before", ((1,), (2,))), ("slice-after", ((2,),)),
])
def test_updates_are_in_place_only_when_nothing_else_reads_the_buffer(marked, mode, paths):
    module = _loop_module(mode).module()
    exe = compile_module(module, TARGET)
    assert marked == [paths]
    start = np.full((6, 4), -1.0, F32)
    caller_copy = start.copy()
    for _ in range(2):
        new, old, passed_through = exe.run([start])
        np.testing.assert_array_equal(new, np.repeat(np.arange(6, dtype=F32)[:, None], 4, axis=1))
        expected_old = new.copy()
        if mode == "old-value-read":  # the last iteration returned the buffer before its update
            expected_old[5] = -1.0
        elif mode == "pass":
            expected_old[:] = 0.0
        else:  # each row as it was before its update
            expected_old[:] = -1.0
        np.testing.assert_array_equal(old, expected_old)
        np.testing.assert_array_equal(passed_through, caller_copy)
        np.testing.assert_array_equal(start, caller_copy)  # the caller's array is untouched
