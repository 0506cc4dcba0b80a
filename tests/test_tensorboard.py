"""TensorBoard under IPUStrategy (issue 26, point 6): event files that TensorBoard's own readers
open, with the tags, steps and values that were logged.

- Keras's ``TensorBoard`` callback (``histogram_freq=1``, ``update_freq="batch"``,
  ``steps_per_execution=4``, validation): the same tags and steps as plain Keras on the CPU
  with the same arguments, values within 1e-5 relative of the CPU's, and exactly the History's
  (``epoch_*``), the weights' histograms counting the final weights.
- Graphcore's TensorBoard tutorial, as a script of our own making its API calls (see
  ``test_the_tensorboard_tutorial_logs_what_fit_and_evaluate_returned``).
- ``tf.summary`` inside a step that runs on the IPU cannot be written from the device: it is
  an error naming the call (never a summary silently missing).

Readers: ``tensorboard.backend.event_processing.event_accumulator.EventAccumulator`` and
``tf.compat.v1.train.summary_iterator``.
"""

from __future__ import annotations

import glob
import os
import pathlib
import re

import numpy as np
import pytest

RNG = np.random.default_rng(6)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = RNG.normal(size=(64, 2)).astype("float32")


def _events(run_dir: str) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Every tensor summary in ``run_dir`` as read by TensorBoard: tag -> [(step, value)]."""
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(run_dir, size_guidance={ea.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def _model():
    import keras

    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
                             keras.layers.Dense(2, name="out")], name="logged")


def _fit_with_tensorboard(log_dir: str, initial, strategy=None):
    import contextlib

    import keras

    with strategy.scope() if strategy else contextlib.nullcontext():
        model = _model()
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                        validation_data=(X[:32], Y[:32]),
                        callbacks=[keras.callbacks.TensorBoard(log_dir, histogram_freq=1,
                                                               update_freq="batch")])
    return model, history.history


def test_the_keras_tensorboard_callback_logs_as_on_the_cpu(ipu_system, tmp_path):
    import tensorboard

    import tf_ipu

    requirements = pathlib.Path(__file__).parent.parent / "requirements.txt"
    pinned = re.search(r"^tensorboard==(\S+)", requirements.read_text(), re.M)
    assert pinned and pinned.group(1) == tensorboard.__version__  # installed as pinned

    initial = _model().get_weights()
    _fit_with_tensorboard(str(tmp_path / "cpu"), initial)
    model, history = _fit_with_tensorboard(str(tmp_path / "ipu"), initial, tf_ipu.IPUStrategy())

    for run in ("train", "validation"):
        got, want = _events(str(tmp_path / "ipu" / run)), _events(str(tmp_path / "cpu" / run))
        assert sorted(got) == sorted(want), run
        for tag, series in want.items():
            if tag == "keras":  # the model's config as JSON
                continue
            assert [s for s, _ in got[tag]] == [s for s, _ in series], (run, tag)
            for (_, a), (_, b) in zip(got[tag], series, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{run}/{tag}")
    train = _events(str(tmp_path / "ipu" / "train"))
    validation = _events(str(tmp_path / "ipu" / "validation"))
    # One batch_loss per device call of 4 steps: 2 calls an epoch, 2 epochs.
    assert [s for s, _ in train["batch_loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in train["epoch_loss"]] == [0, 1]
    assert [float(v) for _, v in train["epoch_loss"]] == [np.float32(v) for v in history["loss"]]
    assert [float(v) for _, v in validation["epoch_loss"]] == [
        np.float32(v) for v in history["val_loss"]]
    assert [s for s, _ in validation["evaluation_loss_vs_iterations"]] == [8, 16]
    # The last epoch's histograms count the final weights, from their minimum to maximum.
    for weight in model.weights:
        tag = f"{weight.path}/histogram"
        step, buckets = train[tag][-1]
        value = weight.numpy()
        assert step == 1 and buckets[:, 2].sum() == value.size, tag
        np.testing.assert_allclose([buckets[0, 0], buckets[-1, 1]], [value.min(), value.max()],
                                   rtol=1e-6, err_msg=tag)


# -- Graphcore's TensorBoard tutorial ----------------------------------------------------------
# A script of our own making the API calls of graphcore/examples
# tutorials/tutorials/tensorflow2/tensorboard/demo_code_only.py (from demo.py), commit
# 2d8b565326ef6ba730492ad8badd984b067645bc (also in graphcore/tutorials
# tutorials/tensorflow2/tensorboard/): tf.summary.create_file_writer and tf.summary.scalar /
# tf.summary.image in callbacks (plus tf.summary.histogram), Keras's TensorBoard callback with
# histogram_freq=1, a two-stage pipelined CNN on 2 IPUs with set_pipelining_options,
# set_pipeline_stage_assignment and set_asynchronous_callbacks(True), metrics, RMSprop,
# steps_per_execution, fit with validation_freq. Small sizes, made-up images (no download).


def _tutorial(log_path: str):
    import tensorflow as tf
    from tensorflow.python import ipu

    class EveryNth(tf.keras.callbacks.Callback):
        """Runs ``work(epoch)`` at every ``period``-th epoch end (the tutorial's staggering)."""

        def __init__(self, period: int):
            super().__init__()
            self.period, self.calls = period, 0

        def on_epoch_end(self, epoch, logs=None):
            self.calls += 1
            if self.calls % self.period == 0:
                self.work(epoch)

    class Evaluate(EveryNth):
        """The tutorial's EvaluateCallback: evaluate, then a scalar summary per result."""

        def __init__(self, path, model, dataset, period, steps):
            super().__init__(period)
            self.model_, self.dataset, self.steps = model, dataset, steps
            self.writer = tf.summary.create_file_writer(path)
            self.results: list[tuple[int, dict]] = []

        def work(self, epoch):
            results = self.model_.evaluate(self.dataset, steps=self.steps, return_dict=True,
                                           verbose=0)
            self.results.append((self.calls, results))
            with self.writer.as_default():
                for name, value in results.items():
                    tf.summary.scalar(f"evaluation_{name}", value, step=self.calls)

    class Filters(EveryNth):
        """The tutorial's FilterRenderCallback: each conv layer's kernels as one image (here
        side by side, scaled together to [0, 1]), and their histogram."""

        def __init__(self, path, model, layer_names, period):
            super().__init__(period)
            self.model_, self.layer_names = model, layer_names
            self.writer = tf.summary.create_file_writer(path)

        def work(self, epoch):
            with self.writer.as_default():
                for name in self.layer_names:
                    kernel = self.model_.get_layer(name).get_weights()[0]
                    h, w = kernel.shape[:2]
                    flat = kernel.reshape(h, w, -1).transpose(0, 2, 1).reshape(h, -1)
                    image = (flat - flat.min()) / (flat.max() - flat.min())
                    tf.summary.image(name, image[None, :, :, None], step=epoch)
                    tf.summary.histogram(f"{name}_kernel", kernel, step=epoch)

    def create_datasets():
        rng = np.random.default_rng(9)

        def prepare_ds(n):
            x = np.expand_dims(rng.integers(0, 256, (n, 28, 28)), -1) / 255.0
            y = rng.integers(0, 10, n)
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=1).batch(
                8, drop_remainder=True)
            return ds.map(lambda d, label: (tf.cast(d, tf.float32),
                                          tf.cast(tf.one_hot(label, 10), tf.int32)))

        return prepare_ds(64).repeat().prefetch(4), prepare_ds(32).prefetch(4), prepare_ds(32)

    def create_model():
        return tf.keras.Sequential([
            tf.keras.layers.Input((28, 28, 1)),
            tf.keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu", name="conv_0"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2), name="pool_0"),
            tf.keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu", name="conv_1"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2), name="pool_1"),
            tf.keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu", name="conv_2"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2), name="pool_2"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dropout(0.5),
            tf.keras.layers.Dense(10, activation="softmax"),
        ])

    config = ipu.config.IPUConfig()
    config.auto_select_ipus = 2
    config.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        m = create_model()
        training_dataset, validation_dataset, test_dataset = create_datasets()
        metrics = ["accuracy", tf.keras.metrics.AUC(), tf.keras.metrics.TopKCategoricalAccuracy(3)]
        m.compile(loss=tf.keras.losses.CategoricalCrossentropy(),
                  optimizer=tf.keras.optimizers.RMSprop(), metrics=metrics, steps_per_execution=8)
        m.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
        m.set_pipeline_stage_assignment([0] * 4 + [1] * 5)
        m.set_asynchronous_callbacks(True)
        evaluate = Evaluate(log_path, m, test_dataset, 2, steps=4)
        callbacks = [Filters(log_path, m, [f"conv_{n}" for n in (0, 1, 2)], 2), evaluate,
                     tf.keras.callbacks.TensorBoard(log_path, histogram_freq=1)]
        history = m.fit(training_dataset, epochs=2, steps_per_epoch=8,
                        validation_data=validation_dataset, validation_freq=2,
                        validation_steps=4, callbacks=callbacks, verbose=False)
    return m, history.history, evaluate.results


def test_the_tensorboard_tutorial_logs_what_fit_and_evaluate_returned(ipu_system, device_server,
                                                                      monkeypatch, tmp_path):
    import tensorflow as tf

    monkeypatch.setenv("TF_IPU_SERVER", device_server)  # the tutorial's IPUConfig() finds it
    log_path = str(tmp_path)
    try:
        model, history, evaluations = _tutorial(log_path)
    finally:
        ipu_system.configure_ipu_system()  # the suite's one-IPU system again
    train = _events(os.path.join(log_path, "train"))
    validation = _events(os.path.join(log_path, "validation"))
    for name in ("loss", "accuracy", "auc", "top_k_categorical_accuracy"):
        assert [(s, float(v)) for s, v in train[f"epoch_{name}"]] == [
            (epoch, np.float32(v)) for epoch, v in enumerate(history[name])], name
    # validation_freq=2: validated after the second epoch only.
    assert [(s, float(v)) for s, v in validation["epoch_loss"]] == [
        (1, np.float32(history["val_loss"][0]))]
    assert [s for s, _ in validation["evaluation_loss_vs_iterations"]] == [
        int(model.optimizer.iterations)]
    assert int(model.optimizer.iterations) == 2 * 8 // 4
    for layer in ("conv_0", "conv_1", "conv_2", model.layers[-1].name):  # the last: a Dense
        assert [s for s, _ in train[f"{model.name}/{layer}/kernel/histogram"]] == [0, 1], layer

    # The callbacks' own writer, read with TensorFlow's event-file iterator.
    found: dict[str, list[tuple[int, object]]] = {}
    files = glob.glob(os.path.join(log_path, "events.out.tfevents.*"))
    assert len(files) == 2  # two callbacks, a writer each
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, tf.make_ndarray(value.tensor)))
    (calls, results), = evaluations  # after the second epoch
    for name, value in results.items():
        assert [(s, float(v)) for s, v in found[f"evaluation_{name}"]] == [
            (calls, np.float32(value))], name
    for n in range(3):
        (step, image), = found[f"conv_{n}"]  # [width, height, PNG]
        assert step == 1 and int(image[0]) == 4 * 3 * model.get_layer(f"conv_{n}").kernel.shape[2]
        assert int(image[1]) == 3 and image[2].startswith(b"\x89PNG")
        (step, buckets), = found[f"conv_{n}_kernel"]
        assert step == 1 and buckets[:, 2].sum() == model.get_layer(f"conv_{n}").kernel.numpy().size


# -- tf.summary inside a step that runs on the IPU ---------------------------------------------


def _summarizing_model():
    import keras
    import tensorflow as tf

    class Summarizing(keras.Model):
        def train_step(self, data):
            logs = super().train_step(data)
            tf.summary.scalar("step_loss", logs["loss"], step=self.optimizer.iterations)
            return logs

    class Logged(keras.layers.Dense):
        def call(self, inputs):
            outputs = super().call(inputs)
            tf.summary.histogram("activations", outputs)
            return outputs

    inputs = keras.Input((6,))
    return Summarizing(inputs, Logged(2)(keras.layers.Dense(8, activation="tanh")(inputs)))


def test_a_summary_inside_an_ipu_step_is_an_error_naming_the_call(ipu_system, tmp_path):
    import keras
    import tensorflow as tf

    import tf_ipu

    # Plain Keras on the CPU writes both summaries, every step, under the callback's writer.
    cpu = _summarizing_model()
    cpu.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    cpu.fit(X[:32], Y[:32], batch_size=8, verbose=0,
            callbacks=[keras.callbacks.TensorBoard(str(tmp_path / "cpu"), update_freq="batch")])
    logged = _events(str(tmp_path / "cpu" / "train"))
    assert [s for s, _ in logged["step_loss"]] == [1, 2, 3, 4]
    assert [len(v) for tag, v in logged.items() if tag.endswith("/activations")] == [4]

    with tf_ipu.IPUStrategy().scope():
        model = _summarizing_model()
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    # Without a default writer tf.summary records nothing, on the CPU as here: fit runs.
    history = model.fit(X[:32], Y[:32], batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    model.train_function = model.test_function = None  # traced again, under the writers below

    here = re.escape(__file__)
    callback = keras.callbacks.TensorBoard(str(tmp_path / "ipu"), update_freq="batch")
    try:
        with pytest.raises(tf_ipu.errors.UnsupportedOpError,
                           match=rf"train_function: tf\.summary\.histogram\('[^']*activations'\) "
                                 rf"at {here}:\d+; tf\.summary\.scalar\('step_loss'\) at "
                                 rf"{here}:\d+: a TensorBoard summary written inside the step, "
                                 rf"which runs on the IPU"):
            model.fit(X[:32], Y[:32], batch_size=8, verbose=0, callbacks=[callback])
    finally:
        callback.on_train_end()  # Keras leaves the callback's writer the default on an error
    with tf.summary.create_file_writer(str(tmp_path / "own")).as_default(step=0):
        with pytest.raises(tf_ipu.errors.UnsupportedOpError,
                           match=r"test_function: tf\.summary\.histogram\('[^']*activations'\) at"):
            model.evaluate(X[:8], Y[:8], verbose=0)  # the layer's summary


def test_a_summary_inside_a_custom_loop_is_an_error_naming_the_call(ipu_system, tmp_path):
    """A ``tf.summary`` in a custom training loop's ``strategy.run`` body (Graphcore's
    tutorials write such loops) is refused when the body is lowered, naming the call, not
    with XLA's error that names nothing."""
    import tensorflow as tf

    import tf_ipu

    strategy = tf_ipu.IPUStrategy()

    def body(x):
        y = tf.reduce_sum(x * x)
        tf.summary.scalar("body_sum", y, step=0)
        return y

    @tf.function
    def loop(x):
        return strategy.run(body, args=(x,))

    here = re.escape(__file__)
    with tf.summary.create_file_writer(str(tmp_path / "loop")).as_default():
        with pytest.raises(tf_ipu.errors.UnsupportedOpError,
                           match=rf"tf\.summary\.scalar\('body_sum'\) at {here}:\d+: a TensorBoard "
                                 rf"summary written inside the step"):
            loop(tf.ones([4]))
    # Without a writer the call records nothing, as on the CPU, and the body runs.
    assert float(loop(tf.ones([4]))) == 4.0
