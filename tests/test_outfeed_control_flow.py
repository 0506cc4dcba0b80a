"""Outfeeds that lose nothing: ``IPUOutfeedQueue.enqueue`` in every control-flow context of a
function given to ``strategy.run`` delivers every value it runs for.

Each case runs one body twice: on the IPU, its enqueues going to a queue; and on the CPU as
a plain ``tf.function`` whose "enqueue" is a ``tf.py_function`` appending to a list (TF's own
control flow decides what runs). Every value dequeued (ALL mode: count, order and values;
LAST mode: the last one) must be what the CPU run appended. Bodies are wrapped three ways:
called as they are (``plain``), as a ``tf.function``, and as a ``tf.function`` with
``jit_compile=True``: one program per wrapping holds every case (each with its own queue),
called twice; the inputs of the second call choose the other branch.

The last test runs a script of our own making the same API calls as Graphcore's ABC
COVID-19 example in a fresh process and checks that every accepted sample is dequeued.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import server_util as su

Emit = Callable[[Any], Any]


def _wrap(kind: str, fn: Callable) -> Callable:
    import tensorflow as tf

    if kind == "plain":
        return fn
    return tf.function(fn, jit_compile=(kind == "jit") or None)


_REFERENCES: dict[tuple, list[list[np.ndarray]]] = {}


def _cpu_reference(body: Callable, args: list) -> list[list[np.ndarray]]:
    """What ``body`` enqueues when TF runs it on the CPU: one flat list of arrays each."""
    import tensorflow as tf

    key = (body, *(np.asarray(a).tobytes() for a in args))
    if key in _REFERENCES:
        return _REFERENCES[key]
    seen: list[list[np.ndarray]] = _REFERENCES.setdefault(key, [])

    def emit(value: Any) -> Any:
        flat = tf.nest.flatten(value)
        return tf.py_function(lambda *a: seen.append([t.numpy() for t in a]), flat, Tout=[])

    tf.function(lambda *a: body(emit, *a))(*args)
    return seen


def _check_all(queue: Any, expected: list[list[np.ndarray]], what: str) -> None:
    """``queue.dequeue()`` (ALL) holds exactly ``expected``, in order."""
    import tensorflow as tf

    got = [t.numpy() for t in tf.nest.flatten(queue.dequeue())]
    assert got, what
    for k, leaf in enumerate(got):
        assert leaf.shape[0] == len(expected), (what, leaf.shape, len(expected))
        want = (np.stack([e[k] for e in expected]) if expected
                else np.zeros((0, *leaf.shape[1:]), leaf.dtype))
        np.testing.assert_array_equal(leaf, want, err_msg=what)


# Bodies: ``body(emit, x, n)`` with x float32[3], n int32 scalar.

def _single(emit: Emit, x: Any, n: Any) -> None:
    emit(x * 2.0)  # one enqueue, outside any loop


def _cond(emit: Emit, x: Any, n: Any) -> None:
    import tensorflow as tf

    # Graphcore's ABC pattern: the enqueue's op is a branch output, a no_op the other.
    done = tf.cond(tf.reduce_sum(x) > 0, lambda: emit((x, n)), lambda: tf.no_op())
    with tf.control_dependencies([done]):
        tf.identity(n)


def _while(emit: Emit, x: Any, n: Any) -> None:
    import tensorflow as tf

    def body(i: Any) -> Any:
        op = emit({"i": i, "x": x * tf.cast(i, tf.float32)})
        with tf.control_dependencies([op]):
            return i + 1

    tf.while_loop(lambda i: i < n, body, [tf.constant(0)])


def _cond_in_while(emit: Emit, x: Any, n: Any) -> None:
    import tensorflow as tf

    def body(i: Any, total: Any) -> Any:
        tf.cond(i % 3 == 0, lambda: emit(x + tf.cast(i, tf.float32)), lambda: tf.no_op())
        return i + 1, total + x

    tf.while_loop(lambda i, t: i < n, body, [tf.constant(0), tf.zeros(3)])


def _while_in_cond(emit: Emit, x: Any, n: Any) -> None:
    import tensorflow as tf

    def loop() -> Any:
        def body(i: Any) -> Any:
            emit(x - tf.cast(i, tf.float32))
            return i + 1

        return tf.while_loop(lambda i: i < n, body, [tf.constant(0)])[0]

    tf.cond(tf.reduce_sum(x) > 0, loop, lambda: tf.constant(0))


def _nested_functions(emit: Emit, x: Any, n: Any) -> None:
    """A while loop whose body is a tf.function holding a cond (ABC's build_graph)."""
    import tensorflow as tf

    @tf.function
    def step(i: Any, acc: Any) -> Any:
        tf.cond(tf.reduce_sum(acc) > 1.0, lambda: emit(acc), lambda: tf.no_op())
        return i + 1, acc * 1.5

    tf.while_loop(lambda i, acc: i < n, step, [tf.constant(0), x])


CASES = {
    # name: (body, [(x, n) for the first call, (x, n) for the second])
    "single": (_single, [([1.0, 2.0, 3.0], 0), ([-1.0, 0.5, 4.0], 0)]),
    "cond": (_cond, [([1.0, 2.0, 3.0], 7), ([-1.0, -2.0, 0.5], 8)]),  # taken, not taken
    "while": (_while, [([1.0, -2.0, 0.5], 4), ([2.0, 2.0, 2.0], 0)]),  # 4 times, never
    "cond_in_while": (_cond_in_while, [([0.5, 1.0, 1.5], 8), ([1.0, 1.0, 1.0], 2)]),
    "while_in_cond": (_while_in_cond, [([1.0, 2.0, 3.0], 3), ([-5.0, 1.0, 1.0], 3)]),
    "nested_functions": (_nested_functions, [([0.25, 0.25, 0.25], 6), ([0.1, 0.1, 0.1], 2)]),
}
# How many enqueues each case runs in its two calls (what the CPU reference must find).
COUNTS = {"single": (1, 1), "cond": (1, 0), "while": (4, 0), "cond_in_while": (3, 1),
          "while_in_cond": (3, 0), "nested_functions": (5, 0)}


@pytest.mark.parametrize("kind", ["plain", "function", "jit"])
def test_every_enqueue_is_dequeued(ipu_system, kind: str) -> None:
    """Every case, each with its own queue, in one device function (one program per
    wrapping, called twice)."""
    import tensorflow as tf
    from tensorflow.python import ipu

    strategy = ipu.ipu_strategy.IPUStrategy()
    queues = {case: ipu.ipu_outfeed_queue.IPUOutfeedQueue() for case in CASES}
    ops: dict[str, list[Any]] = {case: [] for case in CASES}

    def emitter(case: str) -> Emit:
        def emit(value: Any) -> Any:
            op = queues[case].enqueue(value)
            ops[case].append(op)
            return op
        return emit

    def every_case(qs: dict[str, Any], x: dict[str, Any], n: dict[str, Any]) -> None:
        for case, (body, _) in CASES.items():
            body(emitter(case), x[case], n[case])

    device_fn = _wrap(kind, every_case)
    for call in range(2):
        x = {case: tf.constant(inputs[call][0], tf.float32) for case, (_, inputs) in CASES.items()}
        n = {case: tf.constant(inputs[call][1], tf.int32) for case, (_, inputs) in CASES.items()}
        with strategy.scope():
            strategy.run(device_fn, args=[queues, x, n])
        for case, (body, _) in CASES.items():
            expected = _cpu_reference(body, [x[case], n[case]])
            assert len(expected) == COUNTS[case][call], (case, call, len(expected))
            _check_all(queues[case], expected, f"{case}, call {call}")
    for case, made in ops.items():  # an operation, as Graphcore's enqueue returns
        assert made and all(isinstance(op, tf.Operation) for op in made), (case, made)
        assert queues[case].enqueued


@pytest.mark.parametrize("case", ["single", "cond", "cond_in_while", "nested_functions"])
def test_last_mode_gives_the_last_value_enqueued(ipu_system, case: str) -> None:
    import tensorflow as tf
    from tensorflow.python import ipu

    body, inputs = CASES[case]
    strategy = ipu.ipu_strategy.IPUStrategy()
    queue = ipu.ipu_outfeed_queue.IPUOutfeedQueue(ipu.ipu_outfeed_queue.IPUOutfeedMode.LAST)
    device_fn = tf.function(lambda q, x, n: body(q.enqueue, x, n))
    x, n = inputs[0]
    args = [tf.constant(x, tf.float32), tf.constant(n, tf.int32)]
    expected = _cpu_reference(body, args)
    assert expected
    with strategy.scope():
        strategy.run(device_fn, args=[queue, *args])
    for got, want in zip(tf.nest.flatten(queue.dequeue()), expected[-1], strict=True):
        np.testing.assert_array_equal(got.numpy(), want)


def test_last_mode_with_nothing_enqueued_is_an_error(ipu_system) -> None:
    """The cond was not taken: as Graphcore's, there is no last value to give."""
    import tensorflow as tf
    from tensorflow.python import ipu

    strategy = ipu.ipu_strategy.IPUStrategy()
    queue = ipu.ipu_outfeed_queue.IPUOutfeedQueue(ipu.ipu_outfeed_queue.IPUOutfeedMode.LAST,
                                                  feed_name="last_never")
    with strategy.scope():
        strategy.run(tf.function(lambda q, x, n: _cond(q.enqueue, x, n)),
                     args=[queue, tf.constant([-1.0, -1.0, -1.0]), tf.constant(1)])
    with pytest.raises(tf.errors.FailedPreconditionError, match="'last_never'.*nothing was"):
        queue.dequeue()


def test_python_control_flow_in_a_plain_function(ipu_system) -> None:
    """A plain function's ``while`` and ``if`` on tensors (which run eagerly on
    Graphcore's IPUStrategy) become device loops and conds: every enqueue is dequeued."""
    import tensorflow as tf
    from tensorflow.python import ipu

    strategy = ipu.ipu_strategy.IPUStrategy()
    queue = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def loop(outfeed: Any, n: Any) -> None:
        i = tf.constant(0)
        while i < n:
            if i % 2 == 1:
                outfeed.enqueue(tf.cast(i, tf.float32) * 10.0)
            i += 1

    with strategy.scope():
        strategy.run(loop, args=[queue, tf.constant(7)])
    np.testing.assert_array_equal(queue.dequeue().numpy(), [10.0, 30.0, 50.0])


def test_eager_enqueue_delivers_and_a_host_graph_names_the_enqueue(ipu_system) -> None:
    """Eagerly, the value is kept at once (Graphcore's op then returns None). A tf.function
    run on the host cannot send it: TF fails naming the queue's enqueue, nothing is kept;
    the same tf.function given to strategy.run afterwards delivers."""
    import tensorflow as tf
    from tensorflow.python import ipu

    queue = ipu.ipu_outfeed_queue.IPUOutfeedQueue(feed_name="both_ways")
    assert queue.enqueue(tf.constant([1.0, 2.0])) is None

    @tf.function
    def fn(x: Any) -> None:
        tf.cond(x[0] > 0, lambda: queue.enqueue(x), lambda: tf.no_op())

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="IPUOutfeedQueue_both_ways_enqueue"):
        fn(tf.constant([3.0, 4.0]))
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        strategy.run(fn, args=[tf.constant([5.0, 6.0])])  # the host's trace, reused
    np.testing.assert_array_equal(queue.dequeue().numpy(), [[1.0, 2.0], [5.0, 6.0]])


def test_enqueue_the_device_cannot_send_is_an_error(ipu_system) -> None:
    """A value whose size depends on the data cannot leave the IPU: the error names the
    queue's enqueue."""
    import tensorflow as tf
    from tensorflow.python import ipu

    strategy = ipu.ipu_strategy.IPUStrategy()
    queue = ipu.ipu_outfeed_queue.IPUOutfeedQueue(feed_name="masked")

    def fn(q: Any, x: Any) -> None:
        q.enqueue(tf.boolean_mask(x, x > 0))

    with strategy.scope(), pytest.raises(ValueError, match=r"IPUOutfeedQueue\('masked'\).enqueue"):
        strategy.run(fn, args=[queue, tf.constant([1.0, -1.0, 2.0])])


_ABC_SCRIPT = r'''
# Our own script making the same API calls as Graphcore's ABC COVID-19 example:
# graphcore/examples, ai_for_simulation/abc_covid_19/tensorflow2/ABC_IPU.py at commit
# 09b7c672cf2dd700894b11d765a532b7f2e5e11d. Small sizes; tensorflow_probability's Uniform
# and Normal samples are written with tf.random; made-up case counts replace covid_data.
# Both of its outfeed modes: the whole batch (with --outfeed-num-samples) and chunks
# (--enqueue-chunk-size), each enqueued in a tf.cond only if a sample was accepted.
import json, sys
import numpy as np
import tf_ipu  # the one added line
import tensorflow as tf
from tensorflow.python import ipu

N_DAYS, BATCH, CHUNK = 6, 32, 8
TARGET, MAX_RUNS, TOLERANCE = 40, 12, 1000.0
POPULATION = 1.0e5
rng = np.random.default_rng(3)
CASES = np.cumsum(rng.integers(5, 40, size=(3, N_DAYS)), axis=1).astype("float32")
MIXING = tf.constant([[-1, 1, 0, 0, 0, 0], [0, -1, 1, 0, 0, 0], [0, 0, -1, 1, 0, 0],
                      [0, 0, -1, 0, 1, 0], [0, -1, 0, 0, 0, 1]], dtype=tf.float32)
LOWER = tf.constant([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])
UPPER = tf.constant([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 20.0, 100.0, 6.0])

cfg = ipu.utils.IPUConfig()
cfg.device_connection.type = ipu.utils.DeviceConnectionType.ON_DEMAND
cfg.auto_select_ipus = 1
cfg.configure_ipu_system()
strategy = ipu.ipu_strategy.IPUStrategy()


def make(chunk_size, outfeed_num_samples):
    outfeed_data = ipu.ipu_outfeed_queue.IPUOutfeedQueue()

    def conditional_enqueue_op(params, n_accs, dists, gain):
        def _enq_fn(to_enq):
            return outfeed_data.enqueue(to_enq)
        if outfeed_num_samples:
            return tf.cond(tf.math.greater(gain, 0),
                           lambda: _enq_fn([params, dists, n_accs]), lambda: tf.no_op())
        return tf.cond(tf.math.greater(gain, 0),
                       lambda: _enq_fn([params, dists]), lambda: tf.no_op())

    def chunked_outfeed_enqueue(chunk_id, total_gain, p_vec, d_vec, acc_mask):
        g = ipu.cross_replica_ops.assume_equal_across_replicas(
            ipu.cross_replica_ops.cross_replica_sum(acc_mask[chunk_id], name="accumulated_sum"))
        maybe_enqueue = conditional_enqueue_op(params=tf.gather(p_vec, chunk_id, axis=1),
                                               dists=tf.gather(d_vec, chunk_id),
                                               n_accs=acc_mask[chunk_id], gain=g)
        with tf.control_dependencies([maybe_enqueue]):
            g = tf.identity(g)
        return chunk_id + 1, total_gain + g, p_vec, d_vec, acc_mask

    @tf.function(experimental_compile=True)
    def build_graph(accumulated_number_of_samples, run_number, local_tolerance):
        n_days = tf.cast(CASES.shape[1], tf.int32)
        P = tf.ones(BATCH) * POPULATION
        A_0 = tf.ones(BATCH) * CASES[0, 0]
        R_0 = tf.ones(BATCH) * CASES[1, 0]
        D_0 = tf.ones(BATCH) * CASES[2, 0]
        param_vector = tf.transpose(LOWER + (UPPER - LOWER) * tf.random.uniform([BATCH, 9]))
        summary = tf.zeros([n_days, 3, BATCH])
        S_store = P - param_vector[7] * A_0 - (A_0 + R_0 + D_0)
        I_store = param_vector[7] * A_0
        summary = tf.tensor_scatter_nd_add(tensor=summary, indices=[[0, 0], [0, 1], [0, 2]],
                                           updates=tf.stack([A_0, R_0, D_0]))
        init_vars = [tf.zeros([], dtype=tf.int32) + 1, summary, S_store, I_store, A_0, R_0,
                     D_0, tf.zeros(BATCH)]

        def body(i, s, S, I, A, R, D, Ru):
            U = A / (tf.pow(10.0, param_vector[8]))
            alpha_t = param_vector[0] + (
                param_vector[1] / (tf.constant(1.0) + tf.pow(U, param_vector[6])))
            h = tf.stack([(S * I / P) * alpha_t, I * param_vector[3], A * param_vector[2],
                          A * param_vector[4], I * param_vector[2] * param_vector[5]])
            normal_sample = h + tf.sqrt(h) * tf.random.normal(tf.shape(h))
            Y_store = tf.clip_by_value(tf.math.floor(normal_sample), 0.0, P)
            m = tf.matmul(tf.transpose(MIXING), Y_store)
            S = tf.clip_by_value(S + m[0, :], 0.0, P)
            I = tf.clip_by_value(I + m[1, :], 0.0, P)
            A = tf.clip_by_value(A + m[2, :], 0.0, P)
            R = tf.clip_by_value(R + m[3, :], 0.0, P)
            D = tf.clip_by_value(D + m[4, :], 0.0, P)
            Ru = tf.clip_by_value(Ru + m[5, :], 0.0, P)
            s = tf.tensor_scatter_nd_add(tensor=s, indices=[[i, 0], [i, 1], [i, 2]],
                                         updates=tf.stack([A, R, D]))
            return i + 1, s, S, I, A, R, D, Ru

        k, summary, *_ = tf.while_loop(cond=lambda k, *_: k < n_days, body=body,
                                       loop_vars=init_vars)
        t_summary = tf.transpose(summary, perm=[2, 1, 0])
        distances = tf.norm(tf.broadcast_to(CASES, tf.constant(
            [BATCH, CASES.shape[0], CASES.shape[1]], dtype=tf.int32)) - t_summary, axis=2)
        reduced_distances = tf.reduce_sum(distances, axis=1)
        acceptance_vector = tf.cast(reduced_distances <= local_tolerance, dtype=tf.int32)
        if chunk_size:
            n_chunk = tf.constant(BATCH // chunk_size)
            acc_chunk_shp = [n_chunk, chunk_size]
            acc_chunk = tf.reduce_sum(tf.reshape(acceptance_vector, acc_chunk_shp), axis=1)
            param_chunk_shp = [param_vector.shape[0]] + acc_chunk_shp
            init_vars = [tf.constant(0), tf.constant(0),
                         tf.reshape(param_vector, param_chunk_shp),
                         tf.reshape(reduced_distances, acc_chunk_shp), acc_chunk]
            _, gain, _, _, _ = tf.while_loop(cond=lambda n, *_: tf.less(n, n_chunk),
                                             body=chunked_outfeed_enqueue, loop_vars=init_vars)
        else:
            num_accepted_samples = tf.reduce_sum(acceptance_vector, name="num_accepted_samples")
            gain = ipu.cross_replica_ops.assume_equal_across_replicas(
                ipu.cross_replica_ops.cross_replica_sum(num_accepted_samples,
                                                        name="accumulated_sum"))
            conditional_enqueue_op(params=param_vector, dists=reduced_distances,
                                   n_accs=num_accepted_samples, gain=gain)
        return accumulated_number_of_samples + gain, run_number + 1, local_tolerance

    @tf.function(experimental_compile=True)
    def loop_collect_samples(local_samples_target, local_max_num_runs, local_tolerance):
        a = tf.zeros([], dtype=tf.int32)
        n = tf.zeros([], dtype=tf.int32)
        a, n, *_ = tf.while_loop(
            lambda a, n, *_: tf.logical_and(tf.less(a, local_samples_target),
                                            tf.less(n, local_max_num_runs)),
            build_graph, [a, n, local_tolerance])
        return a, n

    return outfeed_data, loop_collect_samples


def run(chunk_size, outfeed_num_samples):
    tolerance = tf.constant(TOLERANCE, dtype=tf.float32)
    outfeed_data, loop_collect_samples = make(chunk_size, outfeed_num_samples)
    with strategy.scope():
        strategy.run(loop_collect_samples, [tf.constant(TARGET), tf.constant(1), tolerance])
        warm = outfeed_data.dequeue()
        a, n = strategy.run(loop_collect_samples,
                            [tf.constant(TARGET), tf.constant(MAX_RUNS), tolerance])
        deq_out = outfeed_data.dequeue()
    param_vector, reduced_distances = deq_out[0].numpy(), deq_out[1].numpy()
    accepted = reduced_distances <= TOLERANCE
    out = {"accepted": int(a), "runs": int(n), "warm_items": int(warm[0].shape[0]),
           "items": int(param_vector.shape[0]), "dequeued_accepted": int(accepted.sum()),
           "items_without_accepted": int((accepted.sum(axis=-1) == 0).sum()),
           "param_shape": list(param_vector.shape),
           "params_in_prior": bool(((param_vector >= LOWER.numpy()[None, :, None])
                                    & (param_vector <= UPPER.numpy()[None, :, None])).all())}
    if outfeed_num_samples:
        out["n_accs_match"] = bool((deq_out[2].numpy() == accepted.sum(axis=-1)).all())
    return out


print(json.dumps({"whole": run(None, True), "chunked": run(CHUNK, False)}))
'''


def test_abc_covid_19_dequeues_every_accepted_sample(device_server) -> None:
    env = su.child_env(TF_IPU_SERVER=device_server, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _ABC_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    whole, chunked = result["whole"], result["chunked"]
    for name, r, size in (("whole", whole, 32), ("chunked", chunked, 8)):
        # Every sample the device counted as accepted came back, and only enqueued items
        # that hold one (each enqueue sits in a tf.cond on the count).
        assert r["accepted"] > 0 and r["dequeued_accepted"] == r["accepted"], (name, r)
        assert r["items_without_accepted"] == 0 and r["warm_items"] >= 1, (name, r)
        assert r["param_shape"][1:] == [9, size] and r["params_in_prior"], (name, r)
        assert 1 <= r["runs"] <= 12
    assert whole["n_accs_match"] and whole["items"] <= whole["runs"]
    assert chunked["items"] <= 4 * chunked["runs"]
