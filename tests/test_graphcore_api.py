"""Graphcore's code runs with one added line (``import tf_ipu``): scripts of our own that make
the same API calls as Graphcore's public TF2 Keras examples, with Graphcore's import lines,
run in a fresh process against the suite's device server and match CPU Keras.

Reference: the same model trained by plain Keras on the CPU from the same weights (1e-4
relative on History losses, 1e-3 relative L2 on the weights).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import server_util as su

_KERAS_TUTORIAL = r'''
import json, sys
import numpy as np
import tf_ipu  # the one added line
import tensorflow as tf
from tensorflow import keras
from tensorflow.python import ipu
from tensorflow.python.ipu import config as ipu_config, ipu_strategy, utils

def model_fn():
    return keras.Sequential([
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])

def dataset():
    rng = np.random.default_rng(0)
    x = rng.random((256, 28, 28)).astype("float32")
    y = rng.integers(0, 10, 256).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)

cfg = ipu.config.IPUConfig()
cfg.auto_select_ipus = 1
cfg.configure_ipu_system()
assert ipu_config.IPUConfig is ipu.config.IPUConfig and ipu.utils is utils
utils.move_variable_initialization_to_cpu()

utils.reset_ipu_seed(7)
reference = model_fn()
reference.build((None, 28, 28))
reference.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                  optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"])
initial = reference.get_weights()
cpu = reference.fit(dataset(), epochs=2, verbose=0).history["loss"]

strategy = ipu_strategy.IPUStrategy()
with strategy.scope():
    model = model_fn()
    model.build((None, 28, 28))
    model.set_weights(initial)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                  optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                  steps_per_execution=4)
    ipu_loss = model.fit(dataset(), epochs=2, verbose=0).history["loss"]
    evaluated = model.evaluate(dataset(), verbose=0)
distance = max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
               for a, b in zip(model.get_weights(), reference.get_weights()))
print(json.dumps({"cpu": cpu, "ipu": ipu_loss, "distance": distance, "evaluated": evaluated,
                  "module": ipu.__name__, "strategy": type(strategy).__module__}))
'''


def test_keras_tutorial_calls_run_with_one_added_import(device_server):
    env = su.child_env(TF_IPU_SERVER=device_server, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _KERAS_TUTORIAL], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["module"] == "tf_ipu.graphcore" and result["strategy"] == "tf_ipu.strategy"
    for a, b in zip(result["ipu"], result["cpu"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (result["ipu"], result["cpu"])
    assert result["distance"] <= 1e-3, result["distance"]
    assert len(result["evaluated"]) == 2  # loss and accuracy


def test_graphcore_paths_resolve_to_this_project():
    import importlib

    tf_ipu = importlib.import_module("tf_ipu")  # the one added import, before Graphcore's paths
    import keras
    import tensorflow.python.ipu.ipu_strategy as gc_strategy
    from tensorflow.python import ipu

    assert ipu.config.IPUConfig is tf_ipu.IPUConfig
    assert gc_strategy.IPUStrategy is tf_ipu.IPUStrategy
    assert ipu.ipu_strategy.IPUStrategyV1 is tf_ipu.IPUStrategy
    # SDK 2's ipu.keras is keras.ipu (its PipelineStage, which Graphcore's tutorials use);
    # its Keras 2 models are out of scope: no placeholder.
    assert ipu.keras.PipelineStage is keras.ipu.PipelineStage
    assert not hasattr(ipu.keras, "Sequential") and not hasattr(ipu.keras, "Model")
    assert ipu.ops.pipelining_ops.PipelineSchedule.Grouped.name == "Grouped"
    from tensorflow.python.ipu import loops

    assert loops.repeat is ipu.loops.repeat


def test_keras_ipu_is_one_namespace_through_keras_and_tf_keras():
    import importlib

    import keras
    from tensorflow import keras as tf_keras  # TF's lazy loader over keras._tf_keras.keras

    import tf_ipu  # noqa: F401  (installs keras.ipu)

    Dense = importlib.import_module("keras.ipu.layers").Dense  # `from keras.ipu.layers import`

    assert keras.ipu.layers.Dense is tf_keras.ipu.layers.Dense is Dense
    assert issubclass(Dense, keras.layers.Dense)
    assert keras.ipu.PipelineStage is tf_keras.ipu.PipelineStage  # pipelining is here
    # Graphcore's nested models' assignments are here too (tf_ipu.pipelining)...
    assert keras.ipu.FunctionalNestedModelPipelineStageAssignment is \
        tf_keras.ipu.FunctionalNestedModelPipelineStageAssignment
    assert issubclass(keras.ipu.FunctionalNestedModelPipelineStageAssignment,
                      keras.ipu.NestedModelPipelineStageAssignment)
    assert keras.ipu.SequentialNestedModelPipelineStageAssignment
    assert not hasattr(keras.ipu, "extensions")  # ... Graphcore's internals are not: no placeholder


def test_reset_ipu_seed_makes_two_runs_with_dropout_bit_identical(ipu_system):
    import keras
    import numpy as np
    from tensorflow.python import ipu

    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 8)).astype("float32")
    y = rng.integers(0, 3, 64)

    def run() -> list[np.ndarray]:
        ipu.utils.reset_ipu_seed(11)
        with ipu.ipu_strategy.IPUStrategy().scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dropout(0.5), keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=2,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    first, second = run(), run()
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_custom_loop_with_infeed_and_outfeed_queues_matches_cpu(ipu_system):
    """Graphcore's infeed/outfeed tutorial pattern: strategy.run(loop, args=[iterator, steps,
    outfeed, model, optimizer]) where the loop calls next(iterator) under tf.range(steps):
    one device call per run, its batches streamed from the host during the call; the losses
    come back through the outfeed (ALL, and LAST)."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.python import ipu

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 16)).astype("float32")
    y = rng.integers(0, 4, 256).astype("int32")

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True).repeat()

    def make():
        keras.utils.set_random_seed(2)
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dense(4)])

    @tf.function
    def step(features, labels, model, optimizer):
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                labels, logits, from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def training_loop(iterator, steps, outfeed, model, optimizer):
        for _ in tf.range(steps):
            features, labels = next(iterator)
            outfeed.enqueue(step(features, labels, model, optimizer))

    reference = make()
    ref_opt = keras.optimizers.SGD(0.05)
    ref_opt.build(reference.trainable_variables)
    batches = iter(dataset())
    expected = [float(step(*next(batches), reference, ref_opt)) for _ in range(24)]

    outfeed = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
    last = ipu.ipu_outfeed_queue.IPUOutfeedQueue(ipu.ipu_outfeed_queue.IPUOutfeedMode.LAST)
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = make()
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)
    infeed = ipu.ipu_infeed_queue.IPUInfeedQueue(dataset())
    calls = tf_ipu_calls()
    for _ in range(2):  # calls go on where the last one stopped
        strategy.run(training_loop, args=[infeed, 8, outfeed, model, optimizer])
    strategy.run(training_loop, args=[infeed, 8, last, model, optimizer])
    assert tf_ipu_calls() - calls == 3  # one device call per run
    losses = outfeed.dequeue().numpy()
    assert losses.shape == (16,)
    np.testing.assert_allclose(losses, expected[:16], rtol=1e-4)
    np.testing.assert_allclose(float(last.dequeue()), expected[23], rtol=1e-4)
    assert outfeed.dequeue().numpy().shape == (0,)  # dequeue empties the queue
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)


def tf_ipu_calls() -> int:
    import tf_ipu

    return tf_ipu.get_runtime().device_calls


@pytest.mark.parametrize("kind", ["as_string", "numpy_function"])
def test_an_op_xla_cannot_compile_is_named_with_its_layer(ipu_system, kind):
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_ipu

    class Host(keras.layers.Layer):
        def call(self, x):
            if kind == "as_string":
                return x + tf.cast(tf.strings.length(tf.strings.as_string(x)), x.dtype) * 0.0
            return tf.reshape(tf.numpy_function(lambda a: a * 2, [x], tf.float32), tf.shape(x))

    with tf_ipu.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), Host(name="hostly")])
        model.compile(loss="mse", optimizer="sgd", steps_per_execution=2)
    op = {"as_string": "AsString", "numpy_function": "PyFunc"}[kind]
    with pytest.raises(tf_ipu.errors.UnsupportedOpError) as info:
        model.predict(np.ones((8, 4), "float32"), batch_size=4, verbose=0)
    message = info.value.message
    assert f"({op}) in Keras layer 'hostly'" in message, message
    assert "the IPU runs only what XLA compiles" in message and "XLA_CPU_JIT" not in message


def test_a_device_error_in_fit_is_not_wrapped_in_graph_execution_error(ipu_system):
    """A device call that fails while running (here a floating-point check) raises the TF
    error class of its status with the device's message alone: no "Graph execution error",
    no traceback of where tf_ipu defined the op."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_ipu

    cfg = tf_ipu.IPUConfig()
    cfg.server_address = ipu_system.server_address
    cfg.floating_point_behaviour.div0 = True
    cfg.configure_ipu_system()
    try:
        with tf_ipu.IPUStrategy().scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda x: 1.0 / x,
                                                                             name="reciprocal"),
                                      keras.layers.Dense(1)])
            model.compile(loss="mse", optimizer="sgd")
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            model.fit(np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32"), verbose=0)
        message = raised.value.message
        assert message.startswith("INVALID_ARGUMENT: Execute of executable"), message
        assert "div0" in message and "Keras layer 'reciprocal'" in message, message
        assert "Graph execution error" not in message and "Detected at node" not in message
    finally:
        ipu_system.configure_ipu_system()


def test_layers_are_named_inside_the_device_loop():
    from device_server.protocol.names import layer_of

    assert layer_of("tf_ipu_device_loop/functional_1/dense_1/MatMul") == "dense"
    assert layer_of("tf_ipu_device_loop_2/sequential/conv2d/Conv2D") == "conv2d"
    assert layer_of("gradient_tape/sequential/dense/MatMul") == "dense (backward)"


def test_estimate_before_the_first_fit_leaves_the_model_as_it_was(ipu_system):
    """Notebook manners: tf_ipu.estimate(training=True) on a model built under IPUStrategy,
    before it ever ran, then fit: the same weights, bit for bit, as without the estimate; the
    estimate's repr is one line and it shows itself as HTML in Jupyter."""
    import keras
    import numpy as np

    import tf_ipu

    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 16)).astype("float32")
    y = rng.standard_normal((32, 4)).astype("float32")
    trained = []
    for estimate_first in (True, False):
        keras.utils.set_random_seed(5)
        with tf_ipu.IPUStrategy().scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(4)])
            model.compile(loss="mse", optimizer="adam", steps_per_execution=2)
        if estimate_first:
            report = tf_ipu.estimate(model, batch_size=8, training=True)
            assert report.fits and report.cycles > 0
            assert "\n" not in repr(report) and len(repr(report)) < 300
            assert "<svg" in report._repr_html_()
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        trained.append(model.get_weights())
    for a, b in zip(*trained, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_custom_loop_that_outruns_its_dataset_gets_out_of_range(ipu_system):
    import numpy as np
    import tensorflow as tf

    import tf_ipu

    with tf_ipu.IPUStrategy().scope():
        acc = tf.Variable(0.0)

    @tf.function
    def loop(iterator, steps):
        for _ in tf.range(steps):
            acc.assign_add(tf.reduce_sum(next(iterator)))

    ds = tf.data.Dataset.from_tensor_slices(np.ones((6, 4), "float32")).batch(2, drop_remainder=True)
    strategy = tf_ipu.IPUStrategy()
    with pytest.raises(tf.errors.OutOfRangeError, match="no more elements"):
        strategy.run(loop, args=[iter(ds), 5])  # 3 batches for 5 steps
    strategy.run(loop, args=[iter(ds), 3])  # the IPU goes on serving
    assert float(acc.numpy()) == 24.0  # the failed call kept nothing; this one added 3 x 8


def test_device_connection_types(ipu_system, device_server):
    """ON_DEMAND attaches at the first device call; PRE_COMPILE compiles and sizes, and
    answers zeros; NEVER compiles and sizes, and refuses to run."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python import ipu

    import tf_ipu
    from tf_ipu.client import DeviceClient

    def sessions() -> int:
        with DeviceClient(device_server) as probe:
            return probe.counters()["sessions_opened"]

    strategy = tf_ipu.IPUStrategy()
    x = tf.constant(np.arange(6, dtype="float32").reshape(2, 3))

    @tf.function
    def double(v):
        return strategy.run(lambda t: t * 2.0 + 1.0, args=(v,))

    cfg = ipu.config.IPUConfig()
    cfg.server_address = device_server
    try:
        cfg.device_connection.type = ipu.config.DeviceConnectionType.ON_DEMAND
        before = sessions()
        cfg.configure_ipu_system()
        assert sessions() == before  # nothing attached yet
        np.testing.assert_array_equal(double(x).numpy(), x.numpy() * 2 + 1)
        assert sessions() == before + 1  # the first call attached

        cfg.device_connection.type = ipu.config.DeviceConnectionType.PRE_COMPILE
        cfg.configure_ipu_system()
        reports = len(tf_ipu.get_runtime().reports)
        halve = tf.function(lambda v: strategy.run(lambda t: t / 2.0, args=(v,)))
        np.testing.assert_array_equal(halve(x).numpy(), np.zeros((2, 3)))  # compiled, not run
        assert len(tf_ipu.get_runtime().reports) == reports + 1

        cfg.device_connection.type = ipu.config.DeviceConnectionType.NEVER
        cfg.configure_ipu_system()
        triple = tf.function(lambda v: strategy.run(lambda t: t * 3.0, args=(v,)))
        with pytest.raises(tf.errors.FailedPreconditionError, match="device_connection.type is NEVER"):
            triple(x)
        with pytest.raises(ValueError, match="must be a DeviceConnectionType"):
            cfg.device_connection.type = "NEVER"
    finally:
        ipu_system.configure_ipu_system()


def test_a_long_compile_shows_progress(ipu_system, monkeypatch, capsys):
    import time

    import numpy as np
    import tensorflow as tf

    import tf_ipu
    from tf_ipu import runtime

    client = runtime.get_runtime().client
    real = client.compile

    def slow(*args, **kwargs):  # a compile that takes longer than a second
        time.sleep(1.4)
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "compile", slow)
    strategy = tf_ipu.IPUStrategy()
    out = tf.function(lambda v: strategy.run(lambda t: t - 7.0, args=(v,)))(tf.ones([3]))
    np.testing.assert_array_equal(out.numpy(), np.full(3, -6.0))
    err = capsys.readouterr().err
    assert "tf_ipu: compiling run:<lambda> for the IPU ... 1 s" in err, err
    assert "tf_ipu: compiled run:<lambda> in 1." in err, err


def test_make_demo_shows_no_tensorflow_start_up_noise(device_server):
    """Notebook manners: the demo's stderr holds at most 3 lines besides tf_ipu's own (today
    none: TensorFlow's C++ start-up lines, which ignore TF_CPP_MIN_LOG_LEVEL, are held back)."""
    import os

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "demo.py")
    env = su.child_env(TF_IPU_SERVER=device_server, TF_IPU_DEMO_QUICK="1")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, demo], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Emulator estimates" in done.stdout
    foreign = [line for line in done.stderr.splitlines() if not line.startswith("tf_ipu: ")]
    assert len(foreign) <= 3, foreign


def test_a_function_that_already_calls_the_device_is_refused_by_strategy_run(ipu_system):
    import tensorflow as tf

    import tf_ipu
    from tf_ipu import errors

    strategy = tf_ipu.IPUStrategy()
    on_device = tf.function(lambda x: strategy.run(lambda t: t + 1.0, args=(x,)))
    concrete = on_device.get_concrete_function(tf.ones((2,)))
    with pytest.raises(errors.UnsupportedOpError, match="already runs on the IPU .* call it "
                                                        "directly, not through strategy.run"):
        strategy.run(concrete, args=(tf.ones((2,)),))
