"""Graphcore's TF2 examples (single-IPU, and the replicated Keras demo), as scripts of our own making the same API calls.

Each ``example_*`` function below mirrors one public Graphcore example (its docstring names the
repository and path): Graphcore's import lines at its top, the same ``ipu`` and Keras calls,
on small synthetic data instead of the downloads (there is no network here), fewer steps and
epochs. Each trains (or runs) the same model twice from the same seeds (so the same initial
weights and dropout masks): under ``IPUStrategy``, and with plain Keras on the CPU
(``XLA_ON_CPU`` where the model has dropout; a seeded, non-reshuffling ``shuffled()`` where
``fit`` takes a shuffled dataset: both say why). The comparison: History losses within 1e-4
relative, final weights within 1e-3 relative L2, and predictions, evaluations, served values
and outfeeds where the example makes them.

All examples run in ONE subprocess (TensorFlow's import costs seconds), with the one added
line, ``import tf_ipu``, at its top, against the suite's device server; the subprocess prints
one ``GCEX {json}`` line per example and the tests below are parametrized over them:

- ``test_example_matches_cpu[name]``: the example ran and matched the CPU;
- ``test_example_runs_as_graphcore_wrote_it[name]``: every Graphcore call ran as written.
  A call that tf_ipu lacks is recorded (``Run.graphcore_call``) with its error, the nearest
  call we have is made instead so that the rest of the example is still compared, and the
  test is an expected failure (``GAPS``, strict: it fails once the call works, so the entry
  must then go).

Calls that docs/porting.md lists as out of scope (Keras 2's ``optimizer_v2``,
``get_gradients``, ``ipu.scopes``) are left out, with a comment where they were. Every
``set_gradient_accumulation_options`` call is made, on the IPU and, where the example
accumulates, by the CPU reference too. Run this file as a script (``python
tests/test_graphcore_examples.py [names]``) to see the JSON lines.

Graphcore's single-IPU TF2 examples found, and where they are here (repository/path):

- graphcore/tutorials tutorials/tensorflow2/keras/completed_demos/completed_demo_ipu.py
  (and the same section of demo.py, demo_walkthrough.py): ``example_keras_demo_ipu``
- .../keras/completed_demos/completed_demo_faster.py: ``example_keras_demo_faster``
- .../keras/completed_demos/completed_demo_replicated.py: ``example_keras_demo_replicated``
  (2 replicas)
- graphcore/tutorials simple_applications/tensorflow2/mnist/mnist.py (graphcore/examples
  tutorials/simple_applications/tensorflow2/mnist/mnist_code_only.py): ``example_mnist``
- graphcore/examples tutorials/tutorials/tensorflow2/infeed_outfeed/completed_code/
  mnist_without_feeds.py: ``example_mnist_without_feeds``; mnist_with_feeds.py:
  ``example_mnist_with_feeds`` (tests/test_graphcore_api.py runs the same loop with an
  ``IPUInfeedQueue``; here with Graphcore's plain iterator and models built by their first call)
- graphcore/examples tutorials/feature_examples/tensorflow2/embeddings/imdb_single_ipu.py:
  ``example_imdb_single_ipu``; imdb_single_ipu_sequential.py: ``example_imdb_sequential``
  (``ipu_tensorflow_addons.keras.layers``' Embedding and LSTM; the same files are in
  graphcore/tutorials feature_examples/tensorflow2/embeddings/)
- .../feature_examples/tensorflow2/inspecting_tensors/mnist.py with outfeed_layers.py,
  outfeed_optimizer.py, outfeed_wrapper.py, outfeed_callback.py (``--no-pipelining
  --model-type Model``): ``example_inspecting_tensors``
- graphcore/keras keras/ipu/docs/example1.py .. example6.py, example10.py:
  ``example_user_guide_1`` .. ``_6``, ``_10`` (example3.py and example6.py accumulate
  gradients)
- graphcore/keras keras/ipu/docs/als_example1.py, als_example2.py: ``example_als``;
  als_example1_non_keras.py, als_example2_non_keras.py: ``example_als_non_keras``
- graphcore/keras keras/ipu/docs/exporting_model_example.py,
  exporting_model_preprocessing_postprocessing_example.py,
  exporting_model_preprocessing_postprocessing_cpu_example.py: ``example_export*``
- graphcore/tutorials tutorials/tensorflow2/recompilation/TF2_recompilation.py:
  ``example_recompilation``
- graphcore/examples code_examples/tensorflow2/neural_image_fields/train_nif.py with
  strategy_utils.py: ``example_neural_image_fields``
- graphcore/examples code_examples/tensorflow2/adversarial_generalized_method_of_moments/
  tf2_AdGMoM.py: ``example_adgmom``

- graphcore/keras keras/ipu/docs/example7.py, example8.py (pipelined, 2 IPUs), example9.py
  (ResNet50's stage assignment): ``example_user_guide_7`` .. ``_9``
- .../keras/completed_demos/completed_demo_pipelining.py: ``example_keras_demo_pipelining``
  (2 replicas of a 2-IPU pipeline)
- the model-parallelism tech note's TF2 scripts and recomputation_checkpoints/
  recompute_lstm.py: tests/test_graphcore_pipelined_examples.py
- graphcore/keras keras/ipu/docs/exporting_pipelined_model_example.py and its two
  preprocessing_postprocessing variants, and graphcore/tensorflow's docs/
  exporting_pipelined_model*_example.py (``ipu.serving.export_pipeline``): also
  tests/test_graphcore_pipelined_examples.py (``example_exporting_pipelined_model*``,
  ``example_export_pipeline*``), each export then served by a fresh process

Elsewhere: keras/ipu/docs example11 (a subclassed model's pipeline):
tests/test_pipelining_subclassed.py; tensorboard/demo.py: tests/test_tensorboard.py;
embeddings/imdb.py: tests/test_accumulation_sparse.py; abc_covid_19/ABC_IPU.py:
tests/test_outfeed_control_flow.py.

Skipped: keras/ipu/docs example12, als_example3; completed_example/main.py,
embeddings/imdb_sequential.py, popdist/* (tf-ipu-run runs instances, issue 27),
ipu_estimator/*_replica.py and *_pipeline_*.py;
``tf.compat.v1`` / estimator ones (ipu_estimator/cifar10_ipu_estimator.py,
recompilation/recompilation.py); SDK 2's ``ipu.keras.Sequential`` / ``ipu.keras.layers`` ones
(code_examples/tensorflow2/mnist/mnist.py, shakespeare/shakespeare.py,
message_passing_neural_network/*); cifar10/cifar10_ipu_strategy.py (SDK 2.0's
``ipu.utils.create_ipu_config``); gnn/qm9_ipu.py (spektral's layers, not installed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import keras_util as ku
import numpy as np
import pytest

# -- what the subprocess records -----------------------------------------------------------


class Run:
    """What one example recorded: comparisons with the CPU, and Graphcore calls that failed."""

    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.gaps: dict[str, str] = {}

    def losses(self, what: str, ipu, cpu) -> None:
        """Values compared one by one, within 1e-4 relative (History losses, evaluations)."""
        self.checks.append({"what": what, "kind": "close",
                            "ipu": [float(v) for v in np.ravel(ipu)],
                            "cpu": [float(v) for v in np.ravel(cpu)]})

    def arrays(self, what: str, ipu, cpu, tolerance: float = 1e-3) -> None:
        """Arrays (or lists of arrays: weights) compared within ``tolerance`` relative L2
        (1e-3 unless an example states why not), each."""
        ipu = ipu if isinstance(ipu, (list, tuple)) else [ipu]
        cpu = cpu if isinstance(cpu, (list, tuple)) else [cpu]
        if len(ipu) != len(cpu):
            self.true(what, False, f"{len(ipu)} arrays against {len(cpu)}")
            return
        distances = [rel_l2(a, b) for a, b in zip(ipu, cpu, strict=True)]
        self.checks.append({"what": what, "kind": "l2", "distance": max(distances, default=0.0),
                            "tolerance": tolerance})

    def true(self, what: str, value: bool, detail: object = "") -> None:
        self.checks.append({"what": what, "kind": "true", "value": bool(value),
                            "detail": str(detail)[:500]})

    def expect(self, what: str, value: bool, detail: object = "") -> None:
        """A behaviour of Graphcore's code as written; if it does not hold here, it is
        recorded with the gaps (not with the comparisons)."""
        if not value:
            self.gaps[what] = str(detail)[:500]

    def graphcore_call(self, what: str, call, instead):
        """Makes Graphcore's ``call()``; if tf_ipu lacks it, records the error under ``what``
        and returns ``instead()``, the nearest call we have, so the example goes on."""
        try:
            return call()
        except (AttributeError, ImportError, TypeError, NotImplementedError) as e:
            self.gaps[what] = f"{type(e).__name__}: {e}"
            return instead()


def rel_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (norm if norm > 0 else 1.0))


def fake_mnist(n_train: int, n_test: int, side: int = 28, seed: int = 0):
    """What ``keras.datasets.mnist.load_data()`` returns, in shape and dtype: uint8 images and
    uint8 labels 0..9 (random ones: the runs are compared with each other, not scored)."""
    rng = np.random.default_rng(seed)

    def part(n: int):
        x = rng.integers(0, 256, (n, side, side)).astype(np.uint8)
        y = rng.integers(0, 10, n).astype(np.uint8)
        return x, y

    return part(n_train), part(n_test)


#: The CPU reference's compile argument where the model draws random numbers (Dropout): Keras
#: on the CPU runs TF's kernels by default (``jit_compile="auto"`` is False there), whose
#: stateless random numbers are not XLA's; the IPU runs the program XLA lowered, so its masks
#: are those of Keras with ``jit_compile=True`` on the CPU.
XLA_ON_CPU = {"jit_compile": True}


def shuffled(dataset, buffer_size: int):
    """``dataset.shuffle(buffer_size)``, Graphcore's call, with a seed and one order for every
    iterator: under a tf.distribute strategy (IPUStrategy, and OneDeviceStrategy on the CPU
    as well) Keras's ``fit`` opens one more iterator of the dataset than plain Keras does, so
    an unseeded, reshuffling dataset would give the IPU run its second order and the CPU run
    its first."""
    return dataset.shuffle(buffer_size, seed=0, reshuffle_each_iteration=False)


# -- the examples ---------------------------------------------------------------------------


def _keras_demo_data(keras, train: int, test: int):
    """The tutorial's load_data() on fake MNIST: normalized, a channel axis, one-hot labels."""
    (x_train, y_train), (x_test, y_test) = fake_mnist(train, test)
    x_train = np.expand_dims(x_train.astype("float32") / 255, -1)
    x_test = np.expand_dims(x_test.astype("float32") / 255, -1)
    return ((x_train, keras.utils.to_categorical(y_train, 10)),
            (x_test, keras.utils.to_categorical(y_test, 10)))


def _keras_demo_model(keras):
    """The tutorial's model_fn(): a small convnet with dropout, functional."""
    input_layer = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu")(input_layer)
    x = keras.layers.MaxPooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu")(x)
    x = keras.layers.MaxPooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.5)(x)
    x = keras.layers.Dense(10, activation="softmax")(x)
    return input_layer, x


def example_keras_demo_ipu(run: Run) -> None:
    """graphcore/tutorials tutorials/tensorflow2/keras/completed_demos/completed_demo_ipu.py:
    the tutorial's convnet, fit on arrays trimmed to a multiple of the batch, then evaluate."""
    import numpy as np  # noqa: F401  (Graphcore's import lines)
    import tensorflow.keras as keras
    from tensorflow.python import ipu

    batch_size = 64

    def make_divisible(number, divisor):
        return number - number % divisor

    (x_train, y_train), (x_test, y_test) = _keras_demo_data(keras, 64 * 3 + 20, 64 * 2 + 9)
    train_data_len = make_divisible(x_train.shape[0], batch_size)
    x_train, y_train = x_train[:train_data_len], y_train[:train_data_len]
    test_data_len = make_divisible(x_test.shape[0], batch_size)
    x_test, y_test = x_test[:test_data_len], y_test[:test_data_len]

    def train(**cpu):
        model = keras.Model(*_keras_demo_model(keras))
        model.compile("sgd", "categorical_crossentropy", metrics=["accuracy"], **cpu)
        return model

    keras.utils.set_random_seed(1)
    reference = train(**XLA_ON_CPU)
    cpu = reference.fit(x_train, y_train, epochs=2, batch_size=batch_size, verbose=0)
    cpu_eval = reference.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)

    ipu_config = ipu.config.IPUConfig()
    ipu_config.auto_select_ipus = 1
    ipu_config.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = train()
        model.summary()
        history = model.fit(x_train, y_train, epochs=2, batch_size=batch_size, verbose=0)
        evaluated = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
    run.losses("History loss", history.history["loss"], cpu.history["loss"])
    run.losses("evaluate (loss, accuracy)", evaluated, cpu_eval)
    run.arrays("weights", model.get_weights(), reference.get_weights())


def example_keras_demo_faster(run: Run) -> None:
    """graphcore/tutorials tutorials/tensorflow2/keras/completed_demos/completed_demo_faster.py:
    as completed_demo_ipu.py, with steps_per_execution the whole (trimmed) dataset, and the
    model compiled again with the test set's steps_per_execution before evaluate."""
    import numpy as np  # noqa: F401
    import tensorflow.keras as keras
    from tensorflow.python import ipu

    batch_size = 64

    def make_divisible(number, divisor):
        return number - number % divisor

    (x_train, y_train), (x_test, y_test) = _keras_demo_data(keras, 64 * 3 + 20, 64 * 2 + 9)
    train_steps_per_execution = x_train.shape[0] // batch_size
    train_data_len = make_divisible(x_train.shape[0], train_steps_per_execution * batch_size)
    x_train, y_train = x_train[:train_data_len], y_train[:train_data_len]
    test_steps_per_execution = x_test.shape[0] // batch_size
    test_data_len = make_divisible(x_test.shape[0], test_steps_per_execution * batch_size)
    x_test, y_test = x_test[:test_data_len], y_test[:test_data_len]

    def train_and_evaluate(summary: bool, **cpu):
        model = keras.Model(*_keras_demo_model(keras))
        model.compile("sgd", "categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=train_steps_per_execution, **cpu)
        if summary:
            model.summary()
        history = model.fit(x_train, y_train, epochs=2, batch_size=batch_size, verbose=0)
        model.compile("sgd", "categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=test_steps_per_execution, **cpu)
        evaluated = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
        return model, history.history["loss"], evaluated

    keras.utils.set_random_seed(2)
    reference, cpu_loss, cpu_eval = train_and_evaluate(False, **XLA_ON_CPU)

    ipu_config = ipu.config.IPUConfig()
    ipu_config.auto_select_ipus = 1
    ipu_config.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model, ipu_loss, evaluated = train_and_evaluate(True)
    run.losses("History loss", ipu_loss, cpu_loss)
    run.losses("evaluate (loss, accuracy)", evaluated, cpu_eval)
    run.arrays("weights", model.get_weights(), reference.get_weights())


@contextlib.contextmanager
def _ipu_strategy(ipu, count: int):
    """Graphcore's calls: ``auto_select_ipus = count``, configure, an IPUStrategy; the system
    goes back to one IPU after the block (the next example may not configure it)."""
    config = ipu.config.IPUConfig()
    config.auto_select_ipus = count
    config.configure_ipu_system()
    try:
        yield ipu.ipu_strategy.IPUStrategy()
    finally:
        if count != 1:
            config.auto_select_ipus = 1
            config.configure_ipu_system()


def _many_ipu_demo(run: Run, keras, ipu, num_ipus: int, num_replicas: int, model_fn,
                   plain_model_fn, train, test, train_spe: int, test_spe: int, batch_size: int,
                   seed: int, before_compile=None) -> None:
    """The tutorial's many-IPU demos (replicated, pipelined) from the IPU configuration on:
    ``auto_select_ipus = num_ipus``, the model built in the strategy's scope
    (``before_compile(model)``: the example's calls before compile), fit for 3 epochs,
    compiled again for evaluate; the IPU system restored to one IPU after. The model has
    Dropout and each replica draws its own masks, so training is not compared step for
    step: evaluate is, against the CPU's evaluation of the trained weights
    (``plain_model_fn()``: the model without stages) on the last replica's batches (the
    default metric reduction reports the last replica's)."""
    keras.utils.set_random_seed(seed)
    with _ipu_strategy(ipu, num_ipus) as strategy:
        with strategy.scope():
            model = keras.Model(*model_fn())
            if before_compile is not None:
                before_compile(model)
            model.compile("sgd", "categorical_crossentropy", metrics=["accuracy"],
                          steps_per_execution=train_spe)
            model.summary()
            history = model.fit(*train, epochs=3, batch_size=batch_size, verbose=0)
            model.compile("sgd", "categorical_crossentropy", metrics=["accuracy"],
                          steps_per_execution=test_spe)
            evaluated = model.evaluate(*test, batch_size=batch_size, verbose=0)
    losses = history.history["loss"]
    run.true("History: 3 finite epoch losses", len(losses) == 3 and all(np.isfinite(losses)),
             losses)
    reference = keras.Model(*plain_model_fn())
    reference.set_weights(model.get_weights())
    reference.compile("sgd", "categorical_crossentropy", metrics=["accuracy"])
    x_test, y_test = test
    last = np.arange(x_test.shape[0]).reshape(-1, batch_size)[num_replicas - 1::num_replicas]
    cpu_eval = reference.evaluate(x_test[last.ravel()], y_test[last.ravel()],
                                  batch_size=batch_size, verbose=0)
    run.losses("evaluate (loss, accuracy) of the last replica", evaluated, cpu_eval)


def example_keras_demo_replicated(run: Run) -> None:
    """graphcore/tutorials tutorials/tensorflow2/keras/completed_demos/completed_demo_replicated.py:
    the convnet on 2 replicas (``auto_select_ipus = num_replicas = 2``), steps_per_execution
    a whole epoch's steps per replica, fit for 3 epochs, then compiled again for evaluate.
    The model has Dropout, and each replica draws its own masks on a batch half the CPU's,
    so training is not compared step for step: evaluate is, against the CPU's evaluation of
    the trained weights on the last replica's batches (Graphcore's default metric reduction,
    NONE, reports the last replica's)."""
    import numpy as np  # noqa: F401
    import tensorflow.keras as keras
    from tensorflow.python import ipu

    batch_size = 64
    num_ipus = num_replicas = 2

    def make_divisible(number, divisor):
        return number - number % divisor

    (x_train, y_train), (x_test, y_test) = _keras_demo_data(keras, 64 * 6 + 20, 64 * 4 + 9)
    train_steps_per_execution = x_train.shape[0] // (batch_size * num_replicas)
    train_steps_per_execution = make_divisible(train_steps_per_execution, num_replicas)
    train_data_len = make_divisible(x_train.shape[0], train_steps_per_execution * batch_size)
    x_train, y_train = x_train[:train_data_len], y_train[:train_data_len]
    test_steps_per_execution = x_test.shape[0] // (batch_size * num_replicas)
    test_steps_per_execution = make_divisible(test_steps_per_execution, num_replicas)
    test_data_len = make_divisible(x_test.shape[0], test_steps_per_execution * batch_size)
    x_test, y_test = x_test[:test_data_len], y_test[:test_data_len]

    _many_ipu_demo(run, keras, ipu, num_ipus, num_replicas, lambda: _keras_demo_model(keras),
                   lambda: _keras_demo_model(keras), (x_train, y_train), (x_test, y_test),
                   train_steps_per_execution, test_steps_per_execution, batch_size, seed=3)


def example_mnist(run: Run) -> None:
    """graphcore/tutorials simple_applications/tensorflow2/mnist/mnist.py (graphcore/examples
    tutorials/simple_applications/tensorflow2/mnist/mnist_code_only.py): a looped dataset, an
    MLP built by fit, SGD, steps_per_execution dividing steps_per_epoch."""
    import tensorflow as tf
    from tensorflow import keras
    from tensorflow.python import ipu

    def create_dataset():
        (x_train, y_train), _ = fake_mnist(256, 0)
        x_train = x_train / 255.0
        train_ds = shuffled(tf.data.Dataset.from_tensor_slices((x_train, y_train)),
                            10000).batch(32, drop_remainder=True)
        train_ds = train_ds.map(
            lambda d, label: (tf.cast(d, tf.float32), tf.cast(label, tf.float32)))
        return train_ds.repeat()

    def create_model():
        return keras.Sequential([
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ])

    def train():
        model = create_model()
        ds = create_dataset()
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                      optimizer=keras.optimizers.SGD(), steps_per_execution=4)
        history = model.fit(ds, steps_per_epoch=12, epochs=2, verbose=0)
        return model, history.history["loss"]

    keras.utils.set_random_seed(3)
    reference, cpu_loss = train()

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model, ipu_loss = train()
    run.losses("History loss", ipu_loss, cpu_loss)
    run.arrays("weights", model.get_weights(), reference.get_weights())


def _feeds_tutorial(tf, keras):
    """The infeed/outfeed tutorial's create_dataset() and create_model() (fake MNIST)."""

    def create_dataset():
        (x_train, y_train), (_, _) = fake_mnist(256, 0)
        x_train = x_train / 255.0
        train_ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        train_ds = train_ds.cache()
        train_ds = train_ds.shuffle(len(x_train)).batch(32, drop_remainder=True)
        train_ds = train_ds.map(
            lambda d, label: (tf.cast(d, tf.float32), tf.cast(label, tf.int32)))
        train_ds = train_ds.prefetch(tf.data.experimental.AUTOTUNE)
        return train_ds.repeat()

    def create_model():
        return keras.Sequential([
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ])

    def step(features, labels, model, opt):
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            prediction_loss = keras.losses.sparse_categorical_crossentropy(labels, predictions)
            loss = tf.reduce_mean(prediction_loss)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return create_dataset, create_model, step


def example_mnist_without_feeds(run: Run) -> None:
    """graphcore/examples tutorials/tutorials/tensorflow2/infeed_outfeed/completed_code/
    mnist_without_feeds.py: one strategy.run of a jit-compiled training step per batch, the
    batches taken from the dataset on the host."""
    import tensorflow as tf
    from tensorflow import keras
    from tensorflow.python import ipu
    from tensorflow.python.ipu import config

    step_count = 12
    create_dataset, create_model, step = _feeds_tutorial(tf, keras)

    keras.utils.set_random_seed(4)
    cpu_step = tf.function(experimental_compile=True)(step)
    opt = keras.optimizers.SGD(0.01)
    reference = create_model()
    ds = create_dataset()
    cpu = [float(cpu_step(x, y, reference, opt))
           for (x, y), _ in zip(ds, range(step_count), strict=False)]

    cfg = config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.configure_ipu_system()
    strategy = run.graphcore_call(
        "IPUStrategy(enable_dataset_iterators=False)",
        lambda: ipu.ipu_strategy.IPUStrategy(enable_dataset_iterators=False),
        lambda: ipu.ipu_strategy.IPUStrategy())
    training_step = tf.function(experimental_compile=True)(step)
    keras.utils.set_random_seed(4)
    with strategy.scope():
        opt = keras.optimizers.SGD(0.01)
        model = create_model()
        ds = create_dataset()
        losses = []
        for (x, y), _ in zip(ds, range(step_count), strict=False):
            loss = strategy.run(training_step, args=[x, y, model, opt])
            losses.append(float(loss))
    run.losses("step losses", losses, cpu)
    run.arrays("weights", model.get_weights(), reference.get_weights())


def example_mnist_with_feeds(run: Run) -> None:
    """graphcore/examples tutorials/tutorials/tensorflow2/infeed_outfeed/completed_code/
    mnist_with_feeds.py: strategy.run of a jit-compiled loop of steps_per_execution steps,
    next(iterator) in the loop (a plain iterator over the dataset), the losses enqueued on an
    IPUOutfeedQueue and dequeued at the end."""
    import tensorflow as tf
    from tensorflow import keras
    from tensorflow.python.ipu import config, ipu_outfeed_queue, ipu_strategy

    step_count = 24
    steps_per_execution = 8
    create_dataset, create_model, step = _feeds_tutorial(tf, keras)

    @tf.function(experimental_compile=True)
    def training_loop(iterator, outfeed_queue, model, optimizer, steps_per_execution):
        for _ in tf.range(steps_per_execution):
            features, labels = next(iterator)
            with tf.GradientTape() as tape:
                predictions = model(features, training=True)
                prediction_loss = keras.losses.sparse_categorical_crossentropy(
                    labels, predictions)
                loss = tf.reduce_mean(prediction_loss)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            outfeed_queue.enqueue(loss)

    keras.utils.set_random_seed(5)
    opt = keras.optimizers.SGD(0.01)
    reference = create_model()
    batches = iter(create_dataset())
    cpu_step = tf.function(jit_compile=True)(step)
    cpu = [float(cpu_step(*next(batches), reference, opt)) for _ in range(step_count)]

    cfg = config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.configure_ipu_system()
    strategy = ipu_strategy.IPUStrategy()
    keras.utils.set_random_seed(5)
    with strategy.scope():
        opt = keras.optimizers.SGD(0.01)
        model = create_model()
        iterator = iter(create_dataset())
        outfeed_queue = ipu_outfeed_queue.IPUOutfeedQueue()
        for _ in range(0, step_count, steps_per_execution):
            strategy.run(training_loop,
                         args=[iterator, outfeed_queue, model, opt, steps_per_execution])
        result = outfeed_queue.dequeue()
    run.losses("outfed losses", result.numpy(), cpu)
    run.arrays("weights", model.get_weights(), reference.get_weights())


def _imdb(run: Run, sequential: bool) -> None:
    """The two single-IPU IMDB examples: Graphcore's Embedding and LSTM (with dropout), Adam."""
    import tensorflow as tf
    from tensorflow.keras.layers import Dense, Input

    # from tensorflow.keras.datasets import imdb: the data here are made up (no network).
    from tensorflow.keras.optimizers import Adam
    from tensorflow.python import ipu

    def addons_layers():
        from ipu_tensorflow_addons.keras.layers import LSTM, Embedding

        return Embedding, LSTM

    def keras_layers():
        from tensorflow.keras.layers import LSTM, Embedding

        return Embedding, LSTM

    Embedding, LSTM = run.graphcore_call(
        "from ipu_tensorflow_addons.keras.layers import Embedding, LSTM", addons_layers,
        keras_layers)
    max_features = 500
    minibatch_size = 32
    maxlen = 20

    def get_dataset():  # the example downloads IMDB
        return ku.imdb_like_dataset(6, max_features, minibatch_size, maxlen)

    def get_model():
        if sequential:
            return tf.keras.Sequential([
                Embedding(max_features, 16),
                LSTM(16, dropout=0.2),
                Dense(1, activation="sigmoid"),
            ])
        # Graphcore writes Input(shape=(80), ...): Keras 3 cannot convert 80 to a shape.
        input_layer = Input(shape=(maxlen,), dtype=tf.int32, batch_size=minibatch_size)
        x = Embedding(max_features, 16)(input_layer)
        x = LSTM(16, dropout=0.2)(x)
        x = Dense(16, activation="relu")(x)
        x = Dense(1, activation="sigmoid")(x)
        return tf.keras.Model(input_layer, x)

    def train(**cpu):
        model = get_model()
        model.compile(steps_per_execution=4, loss="binary_crossentropy", optimizer=Adam(0.005),
                      **cpu)
        history = model.fit(get_dataset(), steps_per_epoch=8, epochs=2, verbose=0)
        return model, history.history["loss"]

    tf.keras.utils.set_random_seed(6)
    reference, cpu_loss = train(**XLA_ON_CPU)

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    tf.keras.utils.set_random_seed(6)
    with strategy.scope():
        model, ipu_loss = train()
    run.losses("History loss", ipu_loss, cpu_loss)
    run.arrays("weights", model.get_weights(), reference.get_weights())


def example_imdb_single_ipu(run: Run) -> None:
    """graphcore/examples tutorials/feature_examples/tensorflow2/embeddings/imdb_single_ipu.py:
    a functional Embedding, LSTM(dropout=0.2), Dense, Dense model on padded sequences."""
    _imdb(run, sequential=False)


def example_imdb_sequential(run: Run) -> None:
    """graphcore/examples tutorials/feature_examples/tensorflow2/embeddings/
    imdb_single_ipu_sequential.py: the same layers in a Sequential model built by fit."""
    _imdb(run, sequential=True)


def example_inspecting_tensors(run: Run) -> None:
    """graphcore/examples tutorials/feature_examples/tensorflow2/inspecting_tensors/mnist.py
    (``--no-pipelining --model-type Model``) with its outfeed_layers.py (an ``Outfeed`` layer
    enqueuing its input on an IPUOutfeedQueue inside fit), outfeed_optimizer.py (an optimizer
    enqueuing selected gradients on a MaybeOutfeedQueue), outfeed_wrapper.py and
    outfeed_callback.py (callbacks dequeuing both at each epoch end).

    Graphcore's OutfeedOptimizer wraps a Keras 2 ``optimizer_v2`` in a ``tf.compat.v1``
    Optimizer (out of scope): here it is a Keras 3 SGD whose ``apply_gradients`` enqueues
    first, the same calls on the queue. ``model.set_gradient_accumulation_options`` is called
    with 1 step, as without --use-gradient-accumulation.
    """
    import tensorflow as tf
    from tensorflow import keras
    from tensorflow.python import ipu
    from tensorflow.python.ipu import ipu_outfeed_queue

    steps_per_epoch, epochs = 6, 2

    class MaybeOutfeedQueue:  # outfeed_wrapper.py, in our words
        def __init__(self, outfeed_mode=None, filters=None):
            self._queue = ipu_outfeed_queue.IPUOutfeedQueue(outfeed_mode=outfeed_mode)
            self._vals = {}
            self.enqueued = False
            self._filters = list(filters) if filters is not None else None

        def maybe_outfeed(self, key, value):
            if self._filters is None or any(f in key for f in self._filters):
                self._vals[key] = value

        def maybe_enqueue(self):
            if self._vals:
                self.enqueued = True
                return self._queue.enqueue(self._vals)
            return None

        def dequeue(self):
            return self._queue.dequeue()

    enqueued_flags: dict[int, bool] = {}

    def is_enqueued(queue):
        """``queue.enqueued``, Graphcore's attribute of IPUOutfeedQueue."""
        return run.graphcore_call("IPUOutfeedQueue.enqueued", lambda: queue.enqueued,
                                  lambda: enqueued_flags.get(id(queue), False))

    class Outfeed(keras.layers.Layer):  # outfeed_layers.py
        def __init__(self, outfeed_queue, **kwargs):
            super().__init__(**kwargs)
            self._outfeed_queue = outfeed_queue

        def call(self, inputs):
            # Keras 3 traces call() once in a graph named "scratch_graph..." to find the
            # output's shape (Keras 2's check was for a name ending in "_scratch_graph").
            if "scratch_graph" in tf.compat.v1.get_default_graph().name:
                return inputs
            if not is_enqueued(self._outfeed_queue):
                self._outfeed_queue.enqueue({self.name: inputs})
                enqueued_flags[id(self._outfeed_queue)] = True
            return inputs

    class OutfeedSGD(keras.optimizers.SGD):  # outfeed_optimizer.py, BEFORE_APPLY mode
        def __init__(self, outfeed_queue, **kwargs):
            super().__init__(**kwargs)
            self._outfeed = outfeed_queue

        def apply_gradients(self, grads_and_vars):
            grads_and_vars = list(grads_and_vars)
            for g, v in reversed(grads_and_vars):
                self._outfeed.maybe_outfeed(v.path + "_grad", g)
            self._outfeed.maybe_enqueue()
            return super().apply_gradients(grads_and_vars)

    class OutfeedCallback(keras.callbacks.Callback):  # outfeed_callback.py, kept values
        def __init__(self, outfeed_queue, enqueued):
            super().__init__()
            self._outfeed_queue = outfeed_queue
            self._enqueued = enqueued
            self.epochs = []

        def on_epoch_end(self, epoch, logs=None):
            if self._enqueued():
                data = self._outfeed_queue.dequeue()
                self.epochs.append({k: np.asarray(v) for k, v in data.items()})

    def create_dataset():
        (x_train, y_train), _ = fake_mnist(192, 0)
        x_train = x_train / 255.0
        x_train = x_train[..., tf.newaxis]
        train_ds = shuffled(tf.data.Dataset.from_tensor_slices((x_train, y_train)),
                            len(x_train)).batch(32, drop_remainder=True)
        train_ds = train_ds.map(
            lambda d, label: (tf.cast(d, tf.float32), tf.cast(label, tf.float32)))
        return train_ds.repeat()

    def create_model(activations_layer):
        input_layer = keras.layers.Input(shape=(28, 28, 1), dtype=tf.float32, batch_size=32)
        x = keras.layers.Flatten()(input_layer)
        x = keras.layers.Dense(128, activation="relu", name="Dense_128")(x)
        x = activations_layer(x)
        x = keras.layers.Dense(10, activation="softmax", name="Dense_10")(x)
        return keras.Model(input_layer, x)

    keras.utils.set_random_seed(7)
    reference = create_model(keras.layers.Identity(name="Dense_128_acts"))
    initial = reference.get_weights()
    first_x, first_y = next(iter(create_dataset()))
    reference.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                      optimizer=keras.optimizers.SGD(), steps_per_execution=steps_per_epoch)
    cpu = reference.fit(create_dataset(), steps_per_epoch=steps_per_epoch, epochs=epochs,
                        verbose=0)

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    keras.utils.set_random_seed(7)
    with strategy.scope():
        optimizer_outfeed_queue = MaybeOutfeedQueue(filters=["Dense_128"])
        activations_outfeed_queue = ipu.ipu_outfeed_queue.IPUOutfeedQueue()
        gradients_callback = OutfeedCallback(optimizer_outfeed_queue,
                                             lambda: optimizer_outfeed_queue.enqueued)
        layer_callback = OutfeedCallback(activations_outfeed_queue,
                                         lambda: is_enqueued(activations_outfeed_queue))
        model = create_model(Outfeed(activations_outfeed_queue, name="Dense_128_acts"))
        model.set_weights(initial)
        dataset = create_dataset()
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(),
                      optimizer=OutfeedSGD(optimizer_outfeed_queue),
                      steps_per_execution=steps_per_epoch)
        # mnist.py without --use-gradient-accumulation: 1 step (an update every step).
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=1)
        history = model.fit(dataset, callbacks=[gradients_callback, layer_callback],
                            steps_per_epoch=steps_per_epoch, epochs=epochs, verbose=0)
    run.losses("History loss", history.history["loss"], cpu.history["loss"])
    run.arrays("weights", model.get_weights(), reference.get_weights())

    # What the callbacks dequeued: each epoch's steps, stacked. The first step's values are
    # the CPU's at the initial weights on the first batch.
    check = create_model(keras.layers.Identity(name="Dense_128_acts"))
    check.set_weights(initial)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            first_y, check(first_x, training=True)))
    grads = dict(zip([v.path for v in check.trainable_variables],
                     tape.gradient(loss, check.trainable_variables), strict=True))
    hidden = keras.Model(check.input, check.get_layer("Dense_128").output)(first_x)
    acts = layer_callback.epochs
    run.expect("the Outfeed layer's activations dequeued at each epoch end, one per step",
               len(acts) == epochs and all(
                   a["Dense_128_acts"].shape == (steps_per_epoch, 32, 128) for a in acts),
               f"dequeued {[{k: v.shape for k, v in a.items()} for a in acts]}")
    if acts and len(acts[0]["Dense_128_acts"]):
        run.arrays("first step's outfed activations", acts[0]["Dense_128_acts"][0], hidden)
    outfed = gradients_callback.epochs
    names = sorted(outfed[0]) if outfed else []
    run.true("Dense_128's gradients (the filter) dequeued at each epoch end, one per step",
             len(outfed) == epochs and names == sorted(
                 f"{p}_grad" for p in grads if "Dense_128" in p) and all(
                 v.shape[0] == steps_per_epoch for e in outfed for v in e.values()),
             [{k: v.shape for k, v in e.items()} for e in outfed])
    for name in names:
        path = name[: -len("_grad")]
        run.arrays(f"first step's outfed {name}", outfed[0][name][0], grads[path])


def _user_guide_dataset(tf, batches: int = 12, repeat: bool = True):
    """keras/ipu/docs' create_dataset() on fake MNIST (``batches`` batches of 32)."""
    (x_train, y_train), (_, _) = fake_mnist(32 * batches, 0)
    x_train = x_train / 255.0
    train_ds = shuffled(tf.data.Dataset.from_tensor_slices((x_train, y_train)),
                        10000).batch(32, drop_remainder=True)
    train_ds = train_ds.map(
        lambda d, label: (tf.cast(d, tf.float32), tf.cast(label, tf.int32)))
    return train_ds.repeat().prefetch(16) if repeat else train_ds.prefetch(16)


def _user_guide_sequential(keras):
    return keras.Sequential([
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def _user_guide_functional(keras):
    input_layer = keras.layers.Input((28, 28))
    x = keras.layers.Flatten()(input_layer)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    x = keras.layers.Dense(10)(x)
    return keras.Model(inputs=input_layer, outputs=x)


def _user_guide(run: Run, create_model, dataset_fn, fit_kwargs: dict, compile_kwargs=None,
                before_fit=None, seed: int = 8, accumulation: int = 0, tolerance: float = 1e-3) -> None:
    """Trains the user guide's model on the CPU, then under IPUStrategy, and compares. With
    ``accumulation``, both models call ``model.set_gradient_accumulation_options(
    gradient_accumulation_steps_per_replica=accumulation)`` after compiling, as the script
    does (the CPU model gets Keras's own accumulation through the same call)."""
    import keras

    def train(on_ipu: bool):
        dataset = dataset_fn()
        model = create_model()
        extra = compile_kwargs(dataset) if compile_kwargs else {}
        if isinstance(extra, tuple):
            dataset, extra = extra
        if not on_ipu and "steps_per_execution" in extra:
            # Keras 3 takes steps_per_execution as a number (a tensor fails in its
            # `if self.steps_per_execution == 1`); Graphcore's Keras took the tensor.
            extra["steps_per_execution"] = int(extra["steps_per_execution"])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer="rmsprop",
                      metrics=["accuracy"], **extra)
        if accumulation:
            model.set_gradient_accumulation_options(
                gradient_accumulation_steps_per_replica=accumulation)
        if on_ipu and before_fit:
            before_fit(model)
        history = model.fit(dataset, verbose=0, **fit_kwargs)
        return model, history.history["loss"]

    _cpu_then_ipu(run, train, seed, tolerance=tolerance)


def _cpu_then_ipu(run: Run, train, seed: int, ipus: int = 1, tolerance: float = 1e-3) -> None:
    """``train(False)`` on the CPU, then ``train(True)`` in IPUStrategy's scope on ``ipus``
    IPUs (the system goes back to one after), from the same seed; compares their History
    losses and final weights (within ``tolerance`` relative L2).

    Both in float64 (``keras_util.float64_policy``): the user guide's scripts compute
    ``SparseCategoricalCrossentropy()`` on logits (no ``from_logits``: Keras divides them by
    their sum and clips them as probabilities) and train with RMSprop, whose first updates
    are about ``lr * sign(g)``. Gradient components that are rounding noise then decide whole
    updates, so two float32 trainings drift apart by however differently they round: the
    emulator's against TensorFlow's on the CPU moved from 1e-4 to 1.4e-4 relative in the
    losses and to 1.8e-3 relative L2 in the weights with oneDNN held to AVX2
    (``ONEDNN_MAX_CPU_ISA``) or OpenBLAS to another kernel (``OPENBLAS_CORETYPE``; 5.6e-2
    with both held to pre-AVX2 code), where the tolerances are 1e-4 and 1e-3. In float64
    the noise is 2^-29 as large (measured: weights within 2e-11 relative L2, losses within
    2e-13, with and without those caps). These examples stand
    for the IPU running the scripts' programs (device loops, gradient accumulation, pipeline
    stages) as Keras runs them; the IPU's float32 arithmetic is tested by test_models.py and
    test_numerics.py."""
    import keras
    from keras_util import float64_policy
    from tensorflow.python import ipu

    keras.utils.set_random_seed(seed)
    with float64_policy():
        reference, cpu_loss = train(False)
    with _ipu_strategy(ipu, ipus) as strategy, float64_policy():
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model, ipu_loss = train(True)
    run.losses("History loss", ipu_loss, cpu_loss)
    run.arrays("weights", model.get_weights(), reference.get_weights(), tolerance)


def example_user_guide_1(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example1.py: a Sequential MLP, rmsprop, a looped dataset,
    fit with steps_per_epoch."""
    import keras
    import tensorflow as tf

    _user_guide(run, lambda: _user_guide_sequential(keras), lambda: _user_guide_dataset(tf),
                {"epochs": 2, "steps_per_epoch": 8})


def example_user_guide_2(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example2.py: steps_per_execution is
    ``dataset.cardinality()`` (a tensor), on a dataset that is not looped."""
    import keras
    import tensorflow as tf

    _user_guide(run, lambda: _user_guide_sequential(keras),
                lambda: _user_guide_dataset(tf, 8, repeat=False), {"epochs": 2},
                lambda dataset: {"steps_per_execution": dataset.cardinality()})


def example_user_guide_3(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example3.py: steps_per_execution a multiple of the
    gradient accumulation steps (10), the dataset cut to it with ``take``, and
    ``model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=10)``:
    one weight update per epoch, on the IPU and in the CPU reference alike."""
    import keras
    import tensorflow as tf

    def compile_kwargs(dataset):
        gradient_accumulation_steps_per_replica = 10
        number_of_accumulated_steps = dataset.cardinality(
        ) // gradient_accumulation_steps_per_replica
        steps_per_execution = number_of_accumulated_steps * \
            gradient_accumulation_steps_per_replica
        dataset = dataset.take(steps_per_execution)
        return dataset, {"steps_per_execution": steps_per_execution}

    _user_guide(run, lambda: _user_guide_sequential(keras),
                lambda: _user_guide_dataset(tf, 12, repeat=False), {"epochs": 2},
                compile_kwargs, accumulation=10)


def example_user_guide_4(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example4.py: example1.py with a functional model."""
    import keras
    import tensorflow as tf

    _user_guide(run, lambda: _user_guide_functional(keras), lambda: _user_guide_dataset(tf),
                {"epochs": 2, "steps_per_epoch": 8})


def example_user_guide_5(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example5.py: the functional model with
    steps_per_execution dividing steps_per_epoch."""
    import keras
    import tensorflow as tf

    _user_guide(run, lambda: _user_guide_functional(keras), lambda: _user_guide_dataset(tf),
                {"epochs": 2, "steps_per_epoch": 8},
                lambda dataset: {"steps_per_execution": 4})


def example_user_guide_6(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example6.py: example5.py with
    ``model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=10)``;
    smaller: steps_per_execution 10 (the script's 50) and 20 steps per epoch (its 100), so
    each device call ends on a weight update as there. (The script's loss on logits without
    ``from_logits`` and RMSprop make float32 trainings drift apart by their rounding: in
    float32 this one was 2.5e-3 relative L2 from the CPU's; compared in float64, see
    ``_cpu_then_ipu``.)"""
    import keras
    import tensorflow as tf

    _user_guide(run, lambda: _user_guide_functional(keras), lambda: _user_guide_dataset(tf),
                {"epochs": 2, "steps_per_epoch": 20},
                lambda dataset: {"steps_per_execution": 10}, accumulation=10)


def example_user_guide_10(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example10.py: ``set_infeed_queue_options(prefetch_depth=2)``
    and ``set_outfeed_queue_options(buffer_depth=2)`` on the model. Graphcore's example stops
    there; here the model is then trained as example1.py does, to compare."""
    import keras
    import tensorflow as tf

    def options(model):
        model.set_infeed_queue_options(prefetch_depth=2)
        model.set_outfeed_queue_options(buffer_depth=2)

    _user_guide(run, lambda: _user_guide_sequential(keras), lambda: _user_guide_dataset(tf),
                {"epochs": 2, "steps_per_epoch": 8},
                lambda dataset: {"steps_per_execution": 4}, before_fit=options)


def _pipelined_user_guide(run: Run, create_model, options, seed: int = 9) -> None:
    """keras/ipu/docs' pipelined examples: ``create_model(stages)`` builds the model (with its
    PipelineStage scopes when ``stages``), ``options(model, ipu)`` makes the example's
    pipelining calls, fit as the example does (smaller: steps_per_execution 16 instead of
    256, 16 steps per epoch instead of 128: one weight update of 16 accumulated micro-batches
    per epoch; RMSprop's first updates are nearly sign(gradient), so over more updates the
    gradient components near zero that round differently on the two sides drift apart)
    on 2 IPUs. Graphcore's models end in Dense(1) on
    (28, 28) inputs with a sparse cross-entropy over 10 classes, which Keras 3 refuses (the
    output's rank): here a Flatten first and Dense(10) last. The CPU reference is the same model
    without stages, with the same gradient accumulation (Keras's, through
    ``set_gradient_accumulation_options``, which a pipeline's options imply)."""
    import keras
    import tensorflow as tf
    from tensorflow.python import ipu

    def train(on_ipu: bool):
        model = create_model(on_ipu)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer="rmsprop",
                      metrics=["accuracy"], steps_per_execution=16)
        if on_ipu:
            options(model, ipu)
        else:
            model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=16)
        history = model.fit(_user_guide_dataset(tf), epochs=2, steps_per_epoch=16, verbose=0)
        return model, history.history["loss"]

    _cpu_then_ipu(run, train, seed, ipus=2)


def example_user_guide_7(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example7.py: a Sequential model on 2 IPUs,
    ``set_pipeline_stage_assignment([0, 0, 1, 1])``, 16 accumulated micro-batches per update,
    the Interleaved schedule."""
    import keras

    def create_model(stages: bool):
        model = keras.Sequential([
            keras.layers.Flatten(),  # Pipeline stage 0 (see _pipelined_user_guide).
            keras.layers.Dense(8),  # Pipeline stage 0.
            keras.layers.Dense(16),  # Pipeline stage 0.
            keras.layers.Dense(16),  # Pipeline stage 1.
            keras.layers.Dense(10),  # Pipeline stage 1.
        ])
        model.build((None, 28, 28))
        if stages:
            model.set_pipeline_stage_assignment([0, 0, 0, 1, 1])
        return model

    def options(model, ipu):
        model.set_pipelining_options(
            gradient_accumulation_steps_per_replica=16,
            pipeline_schedule=ipu.ops.pipelining_ops.PipelineSchedule.Interleaved)

    _pipelined_user_guide(run, create_model, options)


def example_user_guide_8(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example8.py: a functional model whose layers are built
    and called in ``keras.ipu.PipelineStage(0)`` and ``(1)`` scopes, 2 IPUs."""
    import contextlib

    import keras

    def create_model(stages: bool):
        def stage(i):
            return keras.ipu.PipelineStage(i) if stages else contextlib.nullcontext()

        input_layer = keras.layers.Input((28, 28))
        with stage(0):
            x = keras.layers.Flatten()(input_layer)  # see _pipelined_user_guide
            x = keras.layers.Dense(8)(x)
            x = keras.layers.Dense(16)(x)
        with stage(1):
            x = keras.layers.Dense(16)(x)
            x = keras.layers.Dense(10)(x)
        return keras.Model(inputs=input_layer, outputs=x)

    def options(model, ipu):
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=16)

    _pipelined_user_guide(run, create_model, options)


def example_user_guide_9(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/example9.py: ResNet50's assignments (weights=None here:
    no download), edited to split the model at ``conv4_block2_add``, set back, and printed."""
    import io
    from contextlib import redirect_stdout

    from keras.applications import resnet
    from tensorflow.python import ipu

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 1
    config.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = resnet.ResNet50(weights=None)
        assignments = model.get_pipeline_stage_assignment()
        stage_id = 0
        for assignment in assignments:
            assignment.pipeline_stage = stage_id
            if assignment.layer.name.startswith("conv4_block2_add"):
                stage_id = 1
        model.set_pipeline_stage_assignment(assignments)
        printed = io.StringIO()
        with redirect_stdout(printed):
            model.print_pipeline_stage_assignment_summary()
    stages = [a.pipeline_stage for a in model.get_pipeline_stage_assignment()]
    split = next(k for k, a in enumerate(assignments) if a.layer.name.startswith("conv4_block2_add"))
    run.true("stages 0 up to conv4_block2_add, 1 after it",
             stages == [0] * (split + 1) + [1] * (len(stages) - split - 1), stages[split - 2:split + 3])
    run.true("the summary names the split", "conv4_block2_add" in printed.getvalue(),
             printed.getvalue()[:300])


def example_keras_demo_pipelining(run: Run) -> None:
    """graphcore/tutorials tutorials/tensorflow2/keras/completed_demos/completed_demo_pipelining.py:
    the convnet in two ``ipu.keras.PipelineStage`` scopes, 4 IPUs = 2 replicas of a 2-IPU
    pipeline, 8 accumulated micro-batches (Grouped), set_pipelining_options before compile.
    With Dropout each replica draws its own masks, so training is not compared step for
    step: evaluate is, against the CPU's evaluation of the trained weights on the last
    replica's batches (the default metric reduction reports the last replica's)."""
    import numpy as np  # noqa: F401
    import tensorflow.keras as keras
    from tensorflow.python import ipu

    batch_size = 64
    num_ipus = 4
    num_replicas = num_ipus // 2
    gradient_accumulation_steps_per_replica = 8

    def model_fn(stages: bool = True):
        import contextlib

        def stage(i):
            return ipu.keras.PipelineStage(i) if stages else contextlib.nullcontext()

        input_layer = keras.Input(shape=(28, 28, 1))
        with stage(0):
            x = keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu")(input_layer)
            x = keras.layers.MaxPooling2D(pool_size=(2, 2))(x)
            x = keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu")(x)
        with stage(1):
            x = keras.layers.MaxPooling2D(pool_size=(2, 2))(x)
            x = keras.layers.Flatten()(x)
            x = keras.layers.Dropout(0.5)(x)
            x = keras.layers.Dense(10, activation="softmax")(x)
        return input_layer, x

    def make_divisible(number, divisor):
        return number - number % divisor

    (x_train, y_train), (x_test, y_test) = _keras_demo_data(keras, 64 * 36 + 20, 64 * 32 + 9)
    total_gradient_accumulation_steps = gradient_accumulation_steps_per_replica * num_replicas
    train_steps_per_execution = x_train.shape[0] // (batch_size * num_replicas)
    train_steps_per_execution = make_divisible(train_steps_per_execution,
                                               total_gradient_accumulation_steps)
    train_data_len = make_divisible(x_train.shape[0], train_steps_per_execution * batch_size)
    x_train, y_train = x_train[:train_data_len], y_train[:train_data_len]
    test_steps_per_execution = x_test.shape[0] // (batch_size * num_replicas)
    test_steps_per_execution = make_divisible(test_steps_per_execution,
                                              total_gradient_accumulation_steps)
    test_data_len = make_divisible(x_test.shape[0], test_steps_per_execution * batch_size)
    x_test, y_test = x_test[:test_data_len], y_test[:test_data_len]

    def options(model):
        model.set_pipelining_options(
            gradient_accumulation_steps_per_replica=gradient_accumulation_steps_per_replica,
            pipeline_schedule=ipu.ops.pipelining_ops.PipelineSchedule.Grouped)

    _many_ipu_demo(run, keras, ipu, num_ipus, num_replicas, model_fn, lambda: model_fn(False),
                   (x_train, y_train), (x_test, y_test), train_steps_per_execution,
                   test_steps_per_execution, batch_size, seed=4, before_compile=options)


def _als_optimizer(run: Run, optimizer, what: str = "keras.ipu.optimizers.ALSOptimizer"):
    """``ALSOptimizer(optimizer)``; if tf_ipu lacks it, the optimizer itself (automatic loss
    scaling scales by powers of two, which changes nothing in float32)."""

    def als():
        from keras.ipu.optimizers import ALSOptimizer

        return ALSOptimizer(optimizer)

    return run.graphcore_call(what, als, lambda: optimizer)


def example_als(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/als_example1.py and als_example2.py: a functional model
    trained with SGD wrapped in ``ALSOptimizer``, on float16 arrays; als_example2.py compiles
    with steps_per_execution=8, accumulates 4 micro-batches
    (``set_gradient_accumulation_options``) and fits 8 steps per epoch; the CPU reference
    makes the same accumulation call. Keras 2's ``keras.optimizer_v2.gradient_descent.SGD``
    is ``keras.optimizers.SGD`` (Keras 3)."""
    import keras
    import numpy as np
    from keras.optimizers import SGD  # Graphcore: from keras.optimizer_v2.gradient_descent
    from tensorflow.python import ipu

    def train(with_als: bool, steps_per_execution, steps_per_epoch, accumulation):
        input_layer = keras.layers.Input((32,))  # Graphcore: Input(32), not a shape in Keras 3
        x = keras.layers.Dense(16)(input_layer)
        x = keras.layers.Dense(8)(x)
        m = keras.Model(input_layer, x)
        opt = SGD(0.01)
        if with_als:
            opt = _als_optimizer(run, opt)
        m.compile(loss="mse", optimizer=opt, steps_per_execution=steps_per_execution)
        if accumulation:
            m.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=accumulation)
        in_data = np.ones((256, 32), dtype=np.float16)
        targets = 2.0 * np.ones((256, 8), dtype=np.float16)
        history = m.fit(in_data, targets, epochs=2, steps_per_epoch=steps_per_epoch, verbose=0)
        return m, history.history["loss"]

    for label, spe, steps, accumulation in (("als_example1", 1, None, 0), ("als_example2", 8, 8, 4)):
        keras.utils.set_random_seed(9)
        reference, cpu = train(False, spe, steps, accumulation)
        config = ipu.config.IPUConfig()
        config.auto_select_ipus = 1
        config.configure_ipu_system()
        strategy = ipu.ipu_strategy.IPUStrategy()
        keras.utils.set_random_seed(9)
        with strategy.scope():
            m, losses = train(True, spe, steps, accumulation)
        run.losses(f"{label}: History loss", losses, cpu)
        run.arrays(f"{label}: weights", m.get_weights(), reference.get_weights())


def example_als_non_keras(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/als_example1_non_keras.py and als_example2_non_keras.py:
    two Dense layers trained by ``ipu.loops.repeat(10, f, inputs=[x, t, 0.0])`` in a
    jit-compiled function run by strategy.run on float16 arrays, with ALSOptimizer (and, in the
    second, ``ALSGradientAccumulationOptimizer(opt, num_mini_batches=2)``).

    Keras 2-only calls have their Keras 3 equivalents: ``opt.get_gradients(l, v)`` is a
    GradientTape, ``ReductionV2.SUM`` is ``reduction="sum"``, ``optimizer_v2``'s SGD is
    ``keras.optimizers.SGD``. As in Graphcore's, the layers and the optimizer are built by
    their first call, inside the device loop."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras.optimizers import SGD
    from tensorflow.python import ipu
    from tensorflow.python.ipu import loops

    def setup(wrap, accumulate=False):
        # Graphcore's SGD(0.01) on this summed loss (128 x 8 terms) diverges to inf/NaN
        # within the 10 steps in float32, on the CPU as well: a smaller rate, to compare.
        # The CPU reference of the accumulation (SUM of 2): Keras's (a mean) at twice the rate.
        opt = SGD(2e-4, gradient_accumulation_steps=2) if accumulate else SGD(1e-4)
        if wrap:
            opt = _als_optimizer(run, opt)
        if wrap == "accumulate":

            def accumulate():
                from keras.ipu.optimizers import ALSGradientAccumulationOptimizer

                return ALSGradientAccumulationOptimizer(opt, num_mini_batches=2)

            opt = run.graphcore_call("keras.ipu.optimizers.ALSGradientAccumulationOptimizer",
                                     accumulate, lambda: opt)
        layer_0 = keras.layers.Dense(16)
        layer_1 = keras.layers.Dense(8)
        mse = keras.losses.MeanSquaredError(reduction="sum")

        @tf.function(jit_compile=True)
        def f(x, t, _):
            with tf.GradientTape() as tape:
                y = layer_1(layer_0(x))
                loss = mse(y_true=t, y_pred=y)
                scaled = opt.scale_loss(loss)  # what Graphcore's opt.get_gradients(l, v) takes
            v = layer_0.trainable_variables + layer_1.trainable_variables
            g = tape.gradient(scaled, v)
            opt.apply_gradients(zip(g, v, strict=True))
            return x, t, loss

        return f, (layer_0, layer_1)

    in_data = np.ones((128, 32), dtype=np.float16)
    targets = 2.0 * np.ones((128, 8), dtype=np.float16)
    for label, wrap in (("als_example1_non_keras", "als"),
                        ("als_example2_non_keras", "accumulate")):
        keras.utils.set_random_seed(10)
        cpu_f, cpu_v = setup(False, accumulate=wrap == "accumulate")

        @tf.function(jit_compile=True)
        def cpu_loop(x, t, cpu_f=cpu_f):
            loss = tf.constant(0.0)
            for _ in range(10):
                x, t, loss = cpu_f(x, t, loss)
            return loss

        cpu_loss = cpu_loop(tf.constant(in_data), tf.constant(targets))

        config = ipu.config.IPUConfig()
        config.auto_select_ipus = 1
        config.configure_ipu_system()
        strategy = ipu.ipu_strategy.IPUStrategy()
        keras.utils.set_random_seed(10)
        with strategy.scope():
            f, v = setup(wrap)

            @tf.function(jit_compile=True)
            def training_loop(x, t, f=f):
                _, _, loss = loops.repeat(10, f, inputs=[x, t, 0.0])
                return loss

            loss = strategy.run(training_loop, args=[in_data, targets])
        run.losses(f"{label}: last loss", [loss], [cpu_loss])
        run.arrays(f"{label}: weights", [w for layer in v for w in layer.get_weights()],
                   [w for layer in cpu_v for w in layer.get_weights()])


def _export(run: Run, variant: str) -> None:
    """The user guide's three single-IPU export examples (see their wrappers below)."""
    import keras
    import tensorflow as tf
    from tensorflow.python import ipu

    batch_size = 1
    width = 6 if variant == "cpu" else 4
    input_shape = (batch_size, width)
    iterations = 16
    saved_model_directory = tempfile.mkdtemp(prefix="gcex_saved_model_")

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 1
    if variant != "plain":
        cfg.device_connection.enable_remote_buffers = True
        cfg.device_connection.type = ipu.config.DeviceConnectionType.ON_DEMAND
    cfg.configure_ipu_system()

    preprocessing_step = postprocessing_step = None
    if variant == "cpu":
        string_spec = tf.TensorSpec(shape=input_shape, dtype=tf.string)

        @tf.function(input_signature=(string_spec, string_spec))
        def preprocessing_step(lhs_input, rhs_input):
            def transform_fn(value):
                return tf.constant(1.0) if value == "graphcore" else tf.random.uniform(
                    shape=(), dtype=np.float32)

            def transform_string(value):
                return tf.stack([tf.stack([transform_fn(e) for e in tf.unstack(rank1)])
                                 for rank1 in tf.unstack(value)])

            return transform_string(lhs_input), transform_string(rhs_input)

        @tf.function(input_signature=(tf.TensorSpec(shape=input_shape, dtype=np.float32),))
        def postprocessing_step(model_result):
            return tf.abs(model_result)

    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        input1 = keras.layers.Input(shape=input_shape[1:], batch_size=batch_size, name="input_1")
        input2 = keras.layers.Input(shape=input_shape[1:], batch_size=batch_size, name="input_2")
        if variant == "ipu":
            abs_layer = keras.layers.Lambda(tf.abs)
            x = keras.layers.Add()([abs_layer(input1), abs_layer(input2)])
            output = keras.layers.Lambda(tf.reduce_sum)(x)
        else:
            output = keras.layers.Add()([input1, input2])
        model = keras.Model(inputs=[input1, input2], outputs=output)
        model.build([input_shape, input_shape])
        model.compile(steps_per_execution=iterations)

    def graphcore_export():
        if preprocessing_step is None:
            return model.export_for_ipu_serving(saved_model_directory)
        return model.export_for_ipu_serving(saved_model_directory,
                                            preprocessing_step=preprocessing_step,
                                            postprocessing_step=postprocessing_step)

    def documented_export():
        """docs/user_guide.md, "Saving a serving function": strategy.run in a tf.function of a
        tf.Module, saved and loaded again."""
        dtype = tf.string if variant == "cpu" else tf.float32
        spec = tf.TensorSpec(input_shape, dtype)

        class Serving(tf.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            @tf.function(input_signature=[spec, spec])
            def serve(self, a, b):
                if preprocessing_step is not None:
                    a, b = preprocessing_step(a, b)
                y = strategy.run(self.model, args=([a, b],))
                return postprocessing_step(y) if postprocessing_step is not None else y

        tf.saved_model.save(Serving(model), saved_model_directory)
        loaded = tf.saved_model.load(saved_model_directory)
        return lambda a, b: loaded.serve(a, b)

    runtime_func = run.graphcore_call("model.export_for_ipu_serving", graphcore_export,
                                      documented_export)
    with strategy.scope():
        if variant == "cpu":
            input1_data = tf.constant(
                ["graphcore", "red", "blue", "yellow", "graphcore", "purple"],
                shape=input_shape, dtype=tf.string)
            input2_data = tf.constant(
                ["apple", "banana", "graphcore", "orange", "pineapple", "graphcore"],
                shape=input_shape, dtype=tf.string)
            out = np.asarray(runtime_func(input1_data, input2_data)).ravel()
            # Each value is 1 (a "graphcore") or a uniform sample, summed with its pair.
            hits = np.array([1, 0, 1, 0, 1, 1], bool)
            run.true("served values: |1 + U(0,1)| where a 'graphcore' is, |U + U| elsewhere",
                     out.shape == (6,) and np.all(out[hits] >= 1.0) and np.all(out < 2.0)
                     and np.all(out >= 0.0), out)
            return
        served, expected = [], []
        for i in range(iterations):
            input1_data = np.ones(input_shape, dtype=np.float32) * i
            input2_data = np.ones(input_shape, dtype=np.float32) * 2
            served.append(np.asarray(runtime_func(input1_data, input2_data)))
            expected.append(np.sum(np.abs(input1_data) + np.abs(input2_data)) if variant == "ipu"
                            else input1_data + input2_data)
    run.arrays("served values", served, expected)


def example_export(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/exporting_model_example.py: an Add model exported with
    ``model.export_for_ipu_serving(dir)``, the returned function called 16 times."""
    _export(run, "plain")


def example_export_ipu_processing(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/exporting_model_preprocessing_postprocessing_example.py:
    the model's pre- and post-processing (Lambda layers) on the IPU; ON_DEMAND, remote
    buffers."""
    _export(run, "ipu")


def example_export_cpu_processing(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/exporting_model_preprocessing_postprocessing_cpu_example.py:
    string inputs turned into numbers by a CPU preprocessing_step, abs() in a CPU
    postprocessing_step, both given to export_for_ipu_serving."""
    _export(run, "cpu")


def example_recompilation(run: Run) -> None:
    """graphcore/tutorials tutorials/tensorflow2/recompilation/TF2_recompilation.py: an
    executable cache in TF_POPLAR_FLAGS, a jit-compiled function of constants run three times
    with ``strategy.experimental_run_v2`` (new values, the same shapes): one compile.

    Left out: ``from tensorflow.python.ipu.scopes import ipu_scope`` (out of scope, and unused
    by the TF2 code), and the XLA_FLAGS dumps and POPLAR_LOG_LEVEL (debug output)."""
    import tensorflow as tf
    from tensorflow.python import ipu

    import tf_ipu

    # The cache folder is the embedded device server's: with TF_IPU_SERVER naming a running
    # server (as in the suite), that server's own cache is used and this folder is not.
    cache = tempfile.mkdtemp(prefix="gcex_cache_")
    saved = os.environ.get("TF_POPLAR_FLAGS")
    os.environ["TF_POPLAR_FLAGS"] = f"--executable_cache_path={cache}"
    try:
        cfg = ipu.config.IPUConfig()
        cfg.auto_select_ipus = 1
        cfg.configure_ipu_system()
    finally:
        if saved is None:
            os.environ.pop("TF_POPLAR_FLAGS", None)
        else:
            os.environ["TF_POPLAR_FLAGS"] = saved

    with tf.device("cpu"):
        pa = tf.constant([[1., 1.]], dtype=tf.float32, name="a")
        pb = tf.constant([[0., 1.]], dtype=tf.float32, name="b")
        pc = tf.constant([[1., 5.]], dtype=tf.float32, name="c")
    mult = tf.constant(0.5, dtype=tf.float32, name="multiplier")

    @tf.function(experimental_compile=True)
    def basic_graph(pa, pb, pc, mult=mult):
        o1 = pa + pb
        o2 = pa + pc
        return mult * (o1 + o2)

    strategy = ipu.ipu_strategy.IPUStrategy()

    def run_v2(*args):
        return run.graphcore_call("IPUStrategy.experimental_run_v2",
                                  lambda: strategy.experimental_run_v2(*args),
                                  lambda: strategy.run(*args))

    compiles = len(tf_ipu.get_runtime().reports)
    results, expected = [], []
    multipliers = [tf.constant(10, dtype=tf.float32, name="multiplier"),
                   tf.constant(0.375, dtype=tf.float32, name="multiplier"),
                   tf.constant(0.625, dtype=tf.float32, name="multiplier")]
    with strategy.scope():
        for m in multipliers:
            results.append(np.asarray(run_v2(basic_graph, [pa, pb, pc, m])))
            expected.append(basic_graph(pa, pb, pc, m).numpy())
    run.arrays("results", results, expected)
    compiled = len(tf_ipu.get_runtime().reports) - compiles
    run.true("one compile for the three runs (new constants, the same shapes)", compiled == 1,
             f"{compiled} compiles")


def example_neural_image_fields(run: Run) -> None:
    """graphcore/examples code_examples/tensorflow2/neural_image_fields/train_nif.py with
    strategy_utils.py's get_train_strategy: the ReLU MLP (input concatenated half-way) on
    positionally encoded coordinates, Huber loss, ``AdamIpuOptimizer`` with its state kept in
    float32 (as the script's later revision makes it: ``from ipu_tensorflow_addons.keras.optimizers
    import AdamIpuOptimizer``; its first revision used Keras's Adam), a ModelCheckpoint
    callback; the CPU reference trains with the same optimizer, as the script's ``--no-ipu``
    does; the config
    with stochastic rounding, fast math, remote buffers, ON_DEMAND and reset_ipu_seed(101);
    then predictions. The image is made up; left out: the example's EvalCallback (PSNR in
    another process) and its TensorBoard callback (TensorBoard is not installed here). Its
    ``model.set_gradient_accumulation_options(1, experimental_normalize_gradients=True,
    dtype=tf.float32)`` is made (the two optimizer-wrapper options are named once: Keras's
    own accumulation is used)."""
    import tensorflow as tf
    from ipu_tensorflow_addons.keras.optimizers import AdamIpuOptimizer
    from tensorflow import keras
    from tensorflow.python import ipu

    layer_size, num_layers, batch_size, embedding_dimension = 32, 4, 64, 4

    def create_model(input_dim, input_dtype):
        init_fn, act_fn, concat_dim = "glorot_uniform", "relu", input_dim
        input = keras.Input(shape=(input_dim,), dtype=input_dtype)
        half_size = num_layers // 2
        front_end = [keras.layers.Dense(layer_size, activation=act_fn, use_bias=False,
                                        kernel_initializer=init_fn)
                     for _ in range(half_size - 1)]
        front_end.append(keras.layers.Dense(layer_size - concat_dim, activation=act_fn,
                                            use_bias=False, kernel_initializer=init_fn))
        concat = tf.keras.layers.Concatenate(axis=1)
        back_end = [keras.layers.Dense(layer_size, activation=act_fn, use_bias=False,
                                       kernel_initializer=init_fn)
                    for _ in range(half_size - 1)]
        back_end.append(keras.layers.Dense(layer_size, activation=act_fn,
                                           kernel_initializer=init_fn))
        back_end.append(keras.layers.Dense(3, activation="linear"))
        x = input
        for dense in front_end:
            x = dense(x)
        x = concat([x, input])
        for dense in back_end:
            x = dense(x)
        return keras.Model(inputs=input, outputs=x, name="nif_model")

    rng = np.random.default_rng(11)
    uv = rng.random((batch_size * 8, 2)).astype(np.float32)
    values = (0.5 + 0.5 * np.sin(np.stack([3 * uv[:, 0], 5 * uv[:, 1], 7 * uv.sum(1)], 1))
              ).astype(np.float32)
    scales = 2.0 ** np.arange(embedding_dimension // 2)
    train_uv = np.concatenate([np.sin(uv[:, :, None] * scales).reshape(len(uv), -1),
                               np.cos(uv[:, :, None] * scales).reshape(len(uv), -1)],
                              1).astype(np.float32)
    steps_per_epoch, steps_per_exec = 8, 4
    loss_fn = tf.keras.losses.Huber(delta=0.001, reduction="sum_over_batch_size",
                                    name="huber_loss")

    def dataset():
        ds = tf.data.Dataset.from_tensor_slices((train_uv, values)).batch(
            batch_size, drop_remainder=True)
        return ds.cache().repeat()

    def train(callbacks, on_ipu: bool = False):
        model = create_model(train_uv.shape[-1], train_uv.dtype)
        if on_ipu:  # the script's call (--gradient-accumulation-count 1), before compile
            model.set_gradient_accumulation_options(
                gradient_accumulation_steps_per_replica=1,
                experimental_normalize_gradients=True, dtype=tf.float32)
        model.summary(print_fn=lambda *a, **k: None)
        # The script keeps Adam's state in float32 (the master weights might be float16).
        opt = AdamIpuOptimizer(learning_rate=0.001, m_dtype="float32", v_dtype="float32",
                               vhat_dtype="float32")
        model.compile(loss=loss_fn, optimizer=opt, steps_per_execution=steps_per_exec)
        history = model.fit(dataset(), steps_per_epoch=steps_per_epoch, epochs=2, verbose=0,
                            callbacks=callbacks)
        return model, history.history["loss"]

    keras.utils.set_random_seed(101)
    reference, cpu = train([])
    cpu_predictions = reference.predict(train_uv, batch_size=batch_size, verbose=0)

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.floating_point_behaviour.esr = ipu.config.StochasticRoundingBehaviour.ON
    cfg.compilation_poplar_options = {"target.deterministicWorkers": "portable"}
    cfg.device_connection.type = run.graphcore_call(
        "ipu.utils.DeviceConnectionType", lambda: ipu.utils.DeviceConnectionType.ON_DEMAND,
        lambda: ipu.config.DeviceConnectionType.ON_DEMAND)
    cfg.device_connection.enable_remote_buffers = True
    cfg.optimizations.math.fast = True
    cfg.configure_ipu_system()
    ipu.utils.reset_ipu_seed(101)
    strategy = ipu.ipu_strategy.IPUStrategy()
    logs = tempfile.mkdtemp(prefix="gcex_nif_")
    saved_model_path = os.path.join(logs, "nif.keras")  # Keras 3 saves to a .keras file
    with strategy.scope():
        model, losses = train([
            tf.keras.callbacks.ModelCheckpoint(filepath=saved_model_path,
                                               save_weights_only=False, save_best_only=False),
            # tf.keras.callbacks.TensorBoard(log_dir, histogram_freq=5): left out, TensorBoard
            # is not installed here (tf.summary then raises TBNotInstalledError).
        ], on_ipu=True)
        predictions = model.predict(train_uv, batch_size=batch_size, verbose=0)
    run.losses("History loss", losses, cpu)
    run.arrays("weights", model.get_weights(), reference.get_weights())
    run.arrays("predictions", predictions, cpu_predictions)
    saved = keras.models.load_model(saved_model_path)
    run.arrays("the last checkpoint holds the trained weights", saved.get_weights(),
               model.get_weights())


def example_adgmom(run: Run) -> None:
    """graphcore/examples code_examples/tensorflow2/adversarial_generalized_method_of_moments/
    tf2_AdGMoM.py: a Keras modeler (Sequential, L2 regularized) and a Gaussian critic of
    constrained tf.Variables, each with its Adam, trained against each other by
    ``ipu.loops.repeat(n, body, [max_loss], infeed_queue)`` in a jit-compiled function, the
    IPUInfeedQueue (over a zip of three dict datasets) reached through the closure; the
    example's CPU path is the reference. Graphcore draws the data with tensorflow_probability
    and clusters with scikit-learn (neither installed): here numpy draws the same model and
    the centres are the example's ``random_points`` option. As in Graphcore's, the modeler and
    the optimizers are built by their first call, inside the device loop."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python import ipu

    n_samples, n_instruments, n_critics, batch_size = 256, 2, 8, 32
    iterations_per_loop, runs = 8, 2

    def data():
        rng = np.random.default_rng(12)
        e = rng.normal(0, 2, (n_samples, 1))
        x = rng.normal(0, 2, (n_samples, n_instruments))
        w = 0.5 * x[:, :1] + 0.5 * e + rng.normal(0, 0.1, (n_samples, 1))
        y = np.abs(w) + e + rng.normal(0, 0.1, (n_samples, 1))
        centers = x[rng.choice(n_samples, n_critics, replace=False)]
        return [tf.constant(a, tf.float32) for a in (x, w, y)], centers.T.astype(np.float32)

    class KerasModeler:
        def __init__(self, optimizer):
            reg = tf.keras.regularizers.l2(1e-3)
            self._optimizer = optimizer
            self.model = tf.keras.Sequential([
                tf.keras.layers.Dense(16, activation="relu", name="layer_1",
                                      kernel_regularizer=reg),
                tf.keras.layers.Dense(1, name="output", kernel_regularizer=reg)],
                name="modeler")
            self.model.compile()

        def predict(self, data_w):
            return self.model(data_w)

        @property
        def trainable_variables(self):
            return self.model.trainable_variables

        @property
        def optimizer(self):
            return self._optimizer

    class GaussianVectorizedCritic:
        def __init__(self, optimizer, center, precision):
            self.size_k = n_critics
            self.num_reduced_dims = min(2, n_instruments)
            self._center = tf.Variable(center, name="center", constraint=lambda v: tf.clip_by_value(
                v, center - 0.4 * np.abs(center), center + 0.4 * np.abs(center)))
            self._precision = tf.Variable(precision, name="precision",
                                          constraint=lambda v: tf.clip_by_value(
                                              v, 0.2 * precision, 1.2 * precision))
            self._translation = tf.Variable(tf.random.normal(
                [self.size_k, n_instruments, self.num_reduced_dims], 0, 1, tf.float32),
                name="translation")
            self._optimizer = optimizer
            self.learning_rate_hedge = tf.constant(0.05)
            self.weights = tf.Variable(tf.ones([n_critics]) / n_critics,
                                       name="critic_weights", trainable=False)

        def predict(self, data_x):
            size_n, size_k = data_x.shape[0], self.size_k
            translation = tf.reshape(self._translation,
                                     [1, size_k, n_instruments, self.num_reduced_dims])
            normalized = tf.nn.l2_normalize(translation, 2, epsilon=1e-7)
            t_x = tf.broadcast_to(tf.reshape(data_x, [size_n, 1, 1, n_instruments]),
                                  [size_n, size_k, 1, n_instruments])
            center = tf.broadcast_to(tf.reshape(tf.transpose(self._center),
                                                [1, size_k, 1, n_instruments]),
                                     [size_n, size_k, 1, n_instruments])
            t_normalized = tf.broadcast_to(normalized, [size_n, size_k, n_instruments,
                                                        self.num_reduced_dims])
            kernel_data = tf.reshape(tf.matmul(t_x - center, t_normalized),
                                     [size_n, size_k, self.num_reduced_dims])
            dimension = kernel_data.shape[-1]
            squared = tf.reduce_sum(tf.pow(kernel_data, 2), axis=-1)
            w = tf.exp(-tf.pow(self._precision, 2) / 2.0 * squared) / tf.pow(
                2.0 * np.pi, dimension / 2.0)
            return tf.pow(tf.abs(self._precision), dimension) * w

        @property
        def optimizer(self):
            return self._optimizer

        @property
        def trainable_variables(self):
            return [self._center, self._precision, self._translation]

    def expected_values(batch, modeler, critic):
        residual = batch["Y"] - modeler.predict(batch["W"])
        return tf.reduce_mean(residual * critic.predict(batch["X"]), axis=0)

    def computational_graph(modeler, critic):
        def body(max_loss, s1, s2, s3):
            weights = critic.weights
            e1 = tf.stop_gradient(expected_values(s1, modeler, critic))
            u_ft = tf.pow(tf.stop_gradient(expected_values(s3, modeler, critic)), 2)
            variables = modeler.trainable_variables + critic.trainable_variables
            with tf.GradientTape(persistent=True) as tape:
                # Keras 3's variables are not tf.Variables: the tape watches their value.
                tape.watch([v.value if isinstance(v, tf.keras.Variable) else v
                            for v in variables])
                e2 = expected_values(s2, modeler, critic)
                total_modeler_sum = 2 * tf.reduce_sum(e2 * tf.stop_gradient(weights) * e1)
                regularization = modeler.model.losses
                if regularization:
                    total_modeler_sum += tf.math.add_n(regularization)
                total_critics_sum = -2 * tf.reduce_sum(e2 * e1)
            modeler_gradients = tape.gradient(total_modeler_sum, modeler.trainable_variables)
            critic_gradients = tape.gradient(total_critics_sum, critic.trainable_variables)
            del tape
            modeler.optimizer.apply_gradients(
                zip(modeler_gradients, modeler.trainable_variables, strict=True))
            critic.optimizer.apply_gradients(
                zip(critic_gradients, critic.trainable_variables, strict=True))
            unscaled = tf.exp(critic.learning_rate_hedge * u_ft) * weights
            critic.weights.assign(unscaled / tf.reduce_sum(unscaled))
            return tf.math.maximum(tf.reduce_max(u_ft), max_loss)

        return body

    def build():
        (data_x, data_w, data_y), centers = data()

        def one(batch):
            return tf.data.Dataset.from_tensor_slices(
                {"Y": data_y, "W": data_w, "X": data_x}).shuffle(n_samples).batch(
                batch, drop_remainder=True).prefetch(tf.data.experimental.AUTOTUNE).cache(
                ).repeat()

        full_dataset = tf.data.Dataset.zip((one(batch_size), one(batch_size), one(64)))
        modeler = KerasModeler(tf.keras.optimizers.Adam(learning_rate=0.01))
        critic = GaussianVectorizedCritic(tf.keras.optimizers.Adam(learning_rate=0.01),
                                          centers, np.full(n_critics, 0.5, np.float32))
        return full_dataset, modeler, critic

    tf.keras.utils.set_random_seed(12)
    full_dataset, cpu_modeler, cpu_critic = build()
    cpu_graph = tf.function(experimental_compile=True)(computational_graph(cpu_modeler,
                                                                           cpu_critic))
    cpu_losses = []
    for loop_ind, (s1, s2, s3) in enumerate(full_dataset):
        cpu_losses.append(float(cpu_graph(tf.constant(-1e6), s1, s2, s3)))
        if loop_ind + 1 == runs * iterations_per_loop:
            break
    cpu_max = [max(cpu_losses[i:i + iterations_per_loop])
               for i in range(0, len(cpu_losses), iterations_per_loop)]

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.matmuls.poplar_options = {"availableMemoryProportion": "0.6"}
    cfg.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    tf.keras.utils.set_random_seed(12)
    with strategy.scope():
        full_dataset, keras_modeler, critic = build()
        ipu.utils.move_variable_initialization_to_cpu()
        infeed_queue = ipu.ipu_infeed_queue.IPUInfeedQueue(full_dataset)
        infeed_queue.initializer  # noqa: B018  (Graphcore's line: nothing to do in TF2)

        @tf.function(experimental_compile=True)
        def training_loop(modeler, critic):
            max_loss = -1e6
            return ipu.loops.repeat(iterations_per_loop, computational_graph(modeler, critic),
                                    [max_loss], infeed_queue)

        losses = [float(np.ravel(strategy.run(training_loop, args=[keras_modeler, critic]))[0])
                  for _ in range(runs)]
    run.losses("max violation per run", losses, cpu_max)
    run.arrays("modeler weights", keras_modeler.model.get_weights(),
               cpu_modeler.model.get_weights())
    run.arrays("critic variables", [v.numpy() for v in critic.trainable_variables],
               [v.numpy() for v in cpu_critic.trainable_variables])
    run.arrays("critic weights (hedge)", critic.weights.numpy(), cpu_critic.weights.numpy())


EXAMPLES = {name[len("example_"):]: fn for name, fn in sorted(globals().items())
            if name.startswith("example_") and callable(fn)}

#: Examples whose Graphcore calls do not all run as written here (Run.graphcore_call records
#: what failed and the example makes the nearest call we have instead; Run.expect records a
#: behaviour that differs): what, for the strict expected failures.
GAPS = {
}


# -- the subprocess --------------------------------------------------------------------------


def main(names: list[str]) -> None:
    import tf_ipu  # noqa: F401  (the one added line: Graphcore's import paths resolve here)

    with tempfile.TemporaryDirectory(prefix="gcex_") as scratch:
        tempfile.tempdir = scratch  # the examples' saved models, checkpoints and caches
        for name in names or list(EXAMPLES):
            _run_one(name)


def _run_one(name: str) -> None:
    """Runs one example and prints its record (an error is recorded; the next one runs)."""
    run = Run()
    start = time.monotonic()
    record = {"name": name}
    try:
        EXAMPLES[name](run)
        record["ok"] = True
    except Exception:  # noqa: BLE001
        record["ok"] = False
        record["error"] = traceback.format_exc()[-4000:]
    record.update(checks=run.checks, gaps=run.gaps, seconds=round(time.monotonic() - start, 1))
    print("GCEX " + json.dumps(record), flush=True)


# -- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(device_server, request):
    """The subprocess's records, by example: it runs the examples the session selected."""
    import server_util as su

    here = os.path.abspath(__file__)
    names = sorted({item.callspec.params["name"] for item in request.session.items
                    if os.path.abspath(str(item.fspath)) == here and hasattr(item, "callspec")})
    env = su.child_env(TF_IPU_SERVER=device_server, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, here, *names], capture_output=True,
                          text=True, env=env, timeout=900, cwd=tempfile.gettempdir())
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("GCEX "):
            record = json.loads(line[5:])
            found[record["name"]] = record
    return found, done


def _result(results, name: str) -> dict:
    found, done = results
    if name not in found:
        pytest.fail(f"example {name} reported nothing (exit {done.returncode}):\n"
                    f"{done.stderr[-3000:]}")
    return found[name]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_matches_cpu(results, name):
    record = _result(results, name)
    assert record["ok"], record.get("error")
    assert record["checks"], "the example compared nothing"
    failures = []
    for check in record["checks"]:
        if check["kind"] == "close":
            ipu, cpu = check["ipu"], check["cpu"]
            if len(ipu) != len(cpu) or not all(
                    math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-4 * abs(b)
                    for a, b in zip(ipu, cpu, strict=True)):
                failures.append(f"{check['what']}: {ipu} against the CPU's {cpu}")
        elif check["kind"] == "l2":
            if not check["distance"] <= check.get("tolerance", 1e-3):
                failures.append(f"{check['what']}: relative L2 {check['distance']:.3g}")
        elif not check["value"]:
            failures.append(f"{check['what']}: {check['detail']}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=GAPS[n])) if n in GAPS else n
    for n in EXAMPLES])
def test_example_runs_as_graphcore_wrote_it(results, name):
    record = _result(results, name)
    assert record["ok"], record.get("error")
    assert record["gaps"] == {}, record["gaps"]


if __name__ == "__main__":
    main(sys.argv[1:])
