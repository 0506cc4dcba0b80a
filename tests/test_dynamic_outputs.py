"""Results whose size depends on the data (XLA's bounded dynamic shapes: tf.boolean_mask,
tf.where(c), tf.unique) come back from strategy.run at their run-time size, eagerly, in a
tf.function and from a SavedModel, equal to plain TF on the CPU.

Path under test: lower_function records the dynamic outputs -> IpuExecute gets one extra
int32[rank] output per dynamic output -> the runtime writes the run-time value into the corner
of its bound-sized buffer and its dims into the extra output -> call_lowered slices.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import tf_ipu
from tf_ipu import errors, runtime

X8 = np.array([1.5, -2.0, 3.0, -4.0, 5.0, 0.0, -7.0, 8.0], np.float32)
MASKS = {
    "some": X8 > 0,
    "none": np.zeros(8, bool),   # size 0
    "all": np.ones(8, bool),     # size = the bound
}


def _masked_double(x, m):
    return tf.boolean_mask(x, m) * 2


def _mixed(x, m):
    """Static and dynamic results in one nest."""
    return {
        "total": tf.reduce_sum(x),
        "kept": tf.boolean_mask(x, m),
        "scaled": x * 3,
        "where": tf.where(m),
        "count": tf.size(tf.boolean_mask(x, m)),
    }


def _ipu_ops(fn, *args) -> list[tf.Operation]:
    graph = fn.get_concrete_function(*args).graph
    return [op for op in graph.get_operations() if op.type == "IpuExecute"]


def _assert_same(got, want) -> None:
    tf.nest.assert_same_structure(got, want)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape, (g.shape, w.shape)
        np.testing.assert_array_equal(g.numpy(), w.numpy())


@pytest.fixture(scope="module")
def strategy(ipu_system):
    return tf_ipu.IPUStrategy()


def test_boolean_mask_in_tf_function(strategy):
    """One program serves every mask: some, none (size 0), all (size = bound); the traced
    result has TF's static shape ([None]) and one extra dims output."""

    @tf.function
    def f(x, m):
        return strategy.run(_masked_double, args=(x, m))

    x = tf.constant(X8)
    for name, mask in MASKS.items():
        m = tf.constant(mask)
        got = f(x, m)
        want = _masked_double(x, m)
        assert got.shape == (int(mask.sum()),), name
        _assert_same(got, want)
    assert f.get_concrete_function(x, m).structured_outputs.shape.as_list() == [None]
    (op,) = _ipu_ops(f, x, m)
    assert [t.shape.as_list() for t in op.outputs] == [[8], [1]]
    assert op.get_attr("Tout") == [tf.float32, tf.int32]
    assert json.loads(op.get_attr("signature"))["dynamic_outputs"] == [
        {"output": 0, "dynamic": [True]}
    ]


def test_boolean_mask_2d_along_axis_and_2d_mask(strategy):
    x = tf.reshape(tf.range(24, dtype=tf.float32) - 10.0, [3, 8])
    for name, mask in MASKS.items():
        m = tf.constant(mask)
        got = strategy.run(lambda x, m: tf.boolean_mask(x, m, axis=1), args=(x, m))
        _assert_same(got, tf.boolean_mask(x, m, axis=1))
        assert got.shape == (3, int(mask.sum())), name
    m2 = x > 0  # a 2-D mask over a 2-D tensor: f32[<=24]
    _assert_same(strategy.run(tf.boolean_mask, args=(x, m2)), tf.boolean_mask(x, m2))


def test_where_gives_int64_indices(strategy):
    @tf.function
    def f(x):
        return strategy.run(lambda x: tf.where(x > 0), args=(x,))

    x = tf.constant([[1.0, -1.0, 2.0], [0.0, 3.0, -4.0]])
    got = f(x)
    _assert_same(got, tf.where(x > 0))
    assert got.dtype == tf.int64 and got.shape == (3, 2)
    assert f.get_concrete_function(x).structured_outputs.shape.as_list() == [None, 2]
    empty = f(-tf.abs(x) - 1.0)
    _assert_same(empty, tf.zeros([0, 2], tf.int64))


def test_unique_dynamic_y_static_idx(strategy):
    @tf.function
    def f(x):
        return strategy.run(tf.unique, args=(x,))

    for values in ([3, 1, 3, 2, 1, 7, 7, 0], [5] * 8, list(range(8))):
        x = tf.constant(values, tf.int32)
        got = f(x)
        want = tf.unique(x)
        _assert_same(tuple(got), tuple(want))
    spec = f.get_concrete_function(x).structured_outputs
    assert spec.y.shape.as_list() == [None] and spec.idx.shape.as_list() == [8]
    (op,) = _ipu_ops(f, x)
    assert len(op.outputs) == 3  # y, idx, y's dims (idx is static: no dims output)


def test_static_and_dynamic_results_together(strategy):
    @tf.function
    def f(x, m):
        return strategy.run(_mixed, args=(x, m))

    x = tf.constant(X8)
    for mask in MASKS.values():
        m = tf.constant(mask)
        _assert_same(f(x, m), _mixed(x, m))
    out = f.get_concrete_function(x, m).structured_outputs
    assert out["kept"].shape.as_list() == [None] and out["where"].shape.as_list() == [None, 1]
    assert out["scaled"].shape.as_list() == [8] and out["total"].shape.as_list() == []


def test_eager_strategy_run(strategy):
    x = tf.constant(X8)
    for mask in MASKS.values():
        m = tf.constant(mask)
        _assert_same(strategy.run(_mixed, args=(x, m)), _mixed(x, m))


def test_static_program_has_no_extra_outputs(strategy):
    @tf.function
    def f(x):
        return strategy.run(lambda x: (x * 2, tf.reduce_max(x)), args=(x,))

    x = tf.constant(X8)
    (op,) = _ipu_ops(f, x)
    assert len(op.outputs) == 2
    assert "dynamic_outputs" not in json.loads(op.get_attr("signature"))
    _assert_same(f(x), (x * 2, tf.reduce_max(x)))


def test_variable_assigned_a_dynamic_value_is_refused(strategy):
    with strategy.scope():
        v = tf.Variable(tf.zeros([8]))

    def fn(x, m):
        v.assign(tf.boolean_mask(x, m))
        return tf.reduce_sum(x)

    with pytest.raises(ValueError, match=r"variable 'Variable:0' is assigned a value whose size "
                                         r"depends on the data \(shape \[<=8\]"):
        strategy.run(fn, args=(tf.constant(X8), tf.constant(MASKS["all"])))


def test_runtime_checks_run_time_dims_against_bounds():
    out = np.full((3, 4), 7, np.float32)
    runtime._fill_corner(out, np.ones((3, 2), np.float32), (False, True), "p: output 0")
    np.testing.assert_array_equal(out, [[1, 1, 0, 0]] * 3)
    runtime._fill_corner(out, np.ones((3, 0), np.float32), (False, True), "p: output 0")
    np.testing.assert_array_equal(out, np.zeros((3, 4)))
    for bad in ((3, 5), (2, 4), (3,)):
        with pytest.raises(errors.DeviceError, match=r"p: output 0: the device returned shape "
                                                     r".* outside the output's bounds \[3,<=4\]"):
            runtime._fill_corner(out, np.ones(bad, np.float32), (False, True), "p: output 0")


class _Serving(tf.Module):
    def __init__(self, strategy: tf_ipu.IPUStrategy) -> None:
        super().__init__()
        self._strategy = strategy

    @tf.function(input_signature=[tf.TensorSpec([8], tf.float32), tf.TensorSpec([8], tf.bool)])
    def serve(self, x, m):
        return self._strategy.run(_mixed, args=(x, m))


def test_saved_model_reloads_dynamic_results(strategy, ipu_system, tmp_path):
    """The loaded graph's kernels register their program again from the saved signature
    (with a fresh runtime here, as in a new process) and slice the same way."""
    path = str(tmp_path / "saved")
    tf.saved_model.save(_Serving(strategy), path)
    loaded = tf.saved_model.load(path)
    fresh = runtime.DeviceRuntime()
    try:
        fresh.configure(ipu_system)  # installs its handler: the kernels register with it
        x = tf.constant(X8)
        for mask in MASKS.values():
            m = tf.constant(mask)
            _assert_same(loaded.serve(x, m), _mixed(x, m))
        assert fresh.device_calls == len(MASKS)
        assert [e.dynamic_outputs for e in fresh._programs] == [{1: (True,), 4: (True, False)}]
    finally:
        fresh.shutdown()
        runtime.get_runtime().ensure_handler()
