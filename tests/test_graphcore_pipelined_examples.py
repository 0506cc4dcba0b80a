"""Graphcore's pipelined TF2 examples, as scripts of our own making the same API calls; and
recomputation checkpoints and nested models' stage assignments.

The ``example_*`` functions mirror Graphcore's public pipelined examples (each docstring names
the repository and path) in the manner of tests/test_graphcore_examples.py, whose ``Run``
records and comparisons they share: Graphcore's import lines, the same ``ipu`` and Keras calls,
our own small models and synthetic data, run in ONE subprocess with the one added line
``import tf_ipu``, each compared with the same model in plain Keras on the CPU (predictions;
training: History losses within 1e-4 relative, weights within 1e-3 relative L2, from the same
initial weights, the CPU model accumulating gradients as the pipeline does).

Graphcore's examples found, and where they are here:

- graphcore/examples tutorials/tech_notes_code/model_parallelism/tensorflow2_code/
  (the tech note "Model Parallelism on the IPU with TensorFlow: Sharding and Pipelining"; the
  same paths in graphcore/tutorials point there): inference_pipelining.py
  (``example_inference_pipelining``), inference_pipelining_sequential.py
  (``example_inference_pipelining_sequential``), inference_pipelining_set_pipeline_stage.py
  (``example_inference_pipelining_set_pipeline_stage``), training_pipelining.py
  (``example_training_pipelining``), training_pipelining_sequential.py
  (``example_training_pipelining_sequential``)
- graphcore/examples tutorials/feature_examples/tensorflow2/recomputation_checkpoints/
  recompute_lstm.py: ``example_recompute_lstm``
- (the Keras tutorial's completed_demo_pipelining.py and keras/ipu/docs example7..9 run in
  tests/test_graphcore_examples.py)

Not here: inspecting_tensors/mnist.py's pipelined models (its OutfeedOptimizer outfeeds
accumulated gradients through a ``tf.compat.v1`` optimizer wrapper), ipu_estimator's
cifar10_ipu_pipeline_estimator.py (``tf.compat.v1`` estimator), popdist_inference.py
(PopDist), keras/ipu/docs exporting_pipelined_*.

The in-process tests below: ``recomputation_checkpoint`` / ``RecomputationCheckpoint`` (the
identity everywhere; in the IR a marked instruction; the tile model's stash and recompute
cycles), and a functional model holding a nested Sequential over two stages (Graphcore's
nested assignments, graphcore/keras keras/ipu/extensions/pipeline_stage_assignment.py and
nested_pipeline_api_test.py) trained against the CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from keras_util import attached_ipus  # noqa: E402
from test_graphcore_examples import Run, _result, _run_one, shuffled  # noqa: E402
from test_graphcore_examples import test_example_matches_cpu as _matches  # noqa: E402

# -- the examples ---------------------------------------------------------------------------


def _configured(cfg):
    """The example's ``cfg.configure_ipu_system()``; one IPU, no recomputation after."""
    return attached_ipus(cfg, cfg.auto_select_ipus, cfg.allow_recompute)


def _images(n: int, side: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(size=(n, side, side, 3)).astype(np.float32)


def _predictions_match(run: Run, model, build_plain, data) -> None:
    """The IPU model's predictions against the same weights in a model without stages, on
    the dataset's samples in order (repeated as often as the device predicted them); and
    ``predict(steps=2)`` giving the 2 steps' predictions, as on Graphcore's IPUs (its Keras
    lowers ``steps_per_execution=10`` to the 2 steps asked for)."""
    got, x = data["ipu"], data["x"]
    run.true("predict(steps=2) gives 2 steps' predictions", len(got) == len(x),
             f"{len(got)} predictions")
    reference = build_plain()
    reference.set_weights(model.get_weights())
    repeated = np.concatenate([x] * max(1, len(got) // len(x)))
    run.arrays("predictions", got, reference.predict(repeated, batch_size=2, verbose=0))


def _inference_dataset(tf, Dataset, x):
    dataset = Dataset.from_tensor_slices(x)
    dataset = dataset.batch(batch_size=2, drop_remainder=True)
    dataset = dataset.cache()
    dataset = dataset.repeat()
    return dataset.prefetch(tf.data.experimental.AUTOTUNE)


def example_inference_pipelining(run: Run) -> None:
    """tech note inference_pipelining.py: a functional model in two ``ipu.PipelineStage``
    scopes (``from tensorflow.keras import ipu``), an Input with a fixed batch size,
    ``set_pipelining_options(gradient_accumulation_steps_per_replica=16)``, compiled without
    a loss, ``predict(dataset, steps=...)`` on a repeated dataset, on 2 IPUs."""
    import tensorflow as tf
    from tensorflow.keras import ipu, layers
    from tensorflow.python.data.ops.dataset_ops import Dataset
    from tensorflow.python.ipu import config, ipu_strategy, utils

    x = _images(4, seed=1)
    dataset = _inference_dataset(tf, Dataset, x)

    def pixel_mixer(stages: bool = True):
        def stage(i):
            return ipu.PipelineStage(i) if stages else contextlib.nullcontext()

        picture = layers.Input(shape=(6, 6, 3), dtype=tf.float32, batch_size=2)
        with stage(0):
            y = layers.Conv2D(5, 1, activation="relu")(picture)
        with stage(1):
            y = layers.Conv2D(2, 1)(y)
        return tf.keras.Model(picture, y)

    cfg = config.IPUConfig()
    cfg.auto_select_ipus = 2
    with _configured(cfg):
        utils.move_variable_initialization_to_cpu()
        strategy = ipu_strategy.IPUStrategy()
        with strategy.scope():
            model = pixel_mixer()
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=16)
            model.compile(steps_per_execution=10)
            got = model.predict(dataset, steps=2)
        run.true("predictions of the model's output shape", got.shape[1:] == (6, 6, 2), got.shape)
        run.true("the program ran as a 2-stage pipeline",
                 any("stages=2" in r.name for r in strategy.reports),
                 [r.name for r in strategy.reports])
    _predictions_match(run, model, lambda: pixel_mixer(False), {"ipu": got, "x": x})


def example_inference_pipelining_sequential(run: Run) -> None:
    """tech note inference_pipelining_sequential.py: a Sequential model without an Input,
    ``set_pipeline_stage_assignment([0, 1])`` before it is built, then predict."""
    import tensorflow as tf
    from tensorflow.keras import layers
    from tensorflow.python.data.ops.dataset_ops import Dataset
    from tensorflow.python.ipu import config, ipu_strategy, utils

    x = _images(4, seed=2)
    dataset = _inference_dataset(tf, Dataset, x)

    def channel_squeezer():
        return tf.keras.Sequential([layers.Conv2D(4, 1, activation="tanh"), layers.Conv2D(3, 1)])

    cfg = config.IPUConfig()
    cfg.auto_select_ipus = 2
    with _configured(cfg):
        utils.move_variable_initialization_to_cpu()
        strategy = ipu_strategy.IPUStrategy()
        with strategy.scope():
            model = channel_squeezer()
            model.set_pipeline_stage_assignment([0, 1])
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=16)
            model.compile(steps_per_execution=10)
            got = model.predict(dataset, steps=2)
        run.true("the program ran as a 2-stage pipeline",
                 any("stages=2" in r.name for r in strategy.reports),
                 [r.name for r in strategy.reports])

    def plain():
        m = channel_squeezer()
        m.build((None, 6, 6, 3))
        return m

    _predictions_match(run, model, plain, {"ipu": got, "x": x})


def example_inference_pipelining_set_pipeline_stage(run: Run) -> None:
    """tech note inference_pipelining_set_pipeline_stage.py: get the assignments of a
    functional model, give stage 1 to the calls after the layer named "split...", set them
    back, then predict."""
    import tensorflow as tf
    from tensorflow.keras import layers
    from tensorflow.python.data.ops.dataset_ops import Dataset
    from tensorflow.python.ipu import config, ipu_strategy, utils

    x = _images(4, seed=3)
    dataset = _inference_dataset(tf, Dataset, x)

    def four_convs():
        picture = layers.Input(shape=(6, 6, 3), dtype=tf.float32, batch_size=2)
        y = layers.Conv2D(4, 1, activation="relu")(picture)
        y = layers.Conv2D(4, 1, name="split_here")(y)
        y = layers.Conv2D(4, 1, activation="relu")(y)
        y = layers.Conv2D(2, 1)(y)
        return tf.keras.Model(picture, y)

    cfg = config.IPUConfig()
    cfg.auto_select_ipus = 2
    with _configured(cfg):
        utils.move_variable_initialization_to_cpu()
        strategy = ipu_strategy.IPUStrategy()
        with strategy.scope():
            model = four_convs()
            assignments = model.get_pipeline_stage_assignment()
            stage_id = 0
            for assignment in assignments:
                assignment.pipeline_stage = stage_id
                if assignment.layer.name.startswith("split"):
                    stage_id = 1
            model.set_pipeline_stage_assignment(assignments)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=16)
            model.compile(steps_per_execution=10)
            got = model.predict(dataset, steps=2)
    stages = [a.pipeline_stage for a in model.get_pipeline_stage_assignment()]
    run.true("stages 0, 0 (split_here), 1, 1", stages == [0, 0, 1, 1], stages)
    _predictions_match(run, model, four_convs, {"ipu": got, "x": x})


def _training_data(tf, Dataset, n: int, seed: int):
    rng = np.random.default_rng(seed)
    dataset = Dataset.from_tensor_slices((rng.uniform(size=(n, 6, 6, 3)).astype(np.float32),
                                          rng.integers(0, 10, n).astype(np.int32)))
    dataset = dataset.batch(batch_size=2, drop_remainder=True)
    dataset = shuffled(dataset, 1000)  # Graphcore's .shuffle(1000), seeded (see the helper)
    dataset = dataset.cache()
    dataset = dataset.repeat()
    return dataset.prefetch(tf.data.experimental.AUTOTUNE)


def _train_like_tech_note(run: Run, build, pipeline_calls, seed: int) -> None:
    """The tech note's training scripts: ``cfg.allow_recompute``, ZIGZAG selection, 4 IPUs,
    8 accumulated micro-batches (Graphcore's default 'sum'), SGD(0.01), fit; smaller: 16
    steps per execution and per epoch. The CPU reference: the same model without stages in
    float64 (so that it rounds alike on every host; a float32 one was 1.3e-3 off the IPU's
    weights on an AVX512-FP16/AMX host), from the same initial weights, accumulating the same
    way (``set_gradient_accumulation_options``)."""
    import keras
    import tensorflow as tf
    from tensorflow.keras import optimizers
    from tensorflow.python.data.ops.dataset_ops import Dataset
    from tensorflow.python.ipu import config, ipu_strategy, utils

    def train(model, on_ipu: bool):
        if on_ipu:
            pipeline_calls(model)
        else:
            model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=8)
        model.compile(steps_per_execution=16, loss="sparse_categorical_crossentropy",
                      optimizer=optimizers.SGD(0.01))
        return model.fit(_training_data(tf, Dataset, 64, seed), steps_per_epoch=16, epochs=2,
                         verbose=0).history["loss"]

    from keras_util import float64_twin

    keras.utils.set_random_seed(seed)
    reference = float64_twin(lambda: build(False), build(False))  # the seed's weights, in float64
    cpu_loss = train(reference, False)
    cfg = config.IPUConfig()
    cfg.allow_recompute = True
    cfg.selection_order = config.SelectionOrder.ZIGZAG
    cfg.auto_select_ipus = 4
    with _configured(cfg):
        utils.move_variable_initialization_to_cpu()
        strategy = ipu_strategy.IPUStrategy()
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = build(True)
            ipu_loss = train(model, True)
        report = [r for r in strategy.reports if "stages=4" in r.name]
        run.true("the program ran as a 4-stage pipeline with recomputation",
                 bool(report) and any(s["recomputation"] for s in report[-1].details.get("stages", [])),
                 [r.name for r in strategy.reports])
    run.losses("History loss", ipu_loss, cpu_loss)
    run.arrays("weights", model.get_weights(), reference.get_weights())


def example_training_pipelining(run: Run) -> None:
    """tech note training_pipelining.py: a functional model in four ``ipu.PipelineStage``
    scopes (convolutions, then Flatten and Dense in the last), 4 IPUs, recomputation on."""
    import tensorflow as tf
    from tensorflow.keras import ipu, layers

    def pixel_classifier(stages: bool):
        def stage(i):
            return ipu.PipelineStage(i) if stages else contextlib.nullcontext()

        picture = layers.Input(shape=(6, 6, 3), dtype=tf.float32, batch_size=2)
        with stage(0):
            y = layers.Conv2D(4, 1, activation="relu")(picture)
        with stage(1):
            y = layers.Conv2D(4, 1, activation="relu")(y)
        with stage(2):
            y = layers.Conv2D(3, 1)(y)
        with stage(3):
            y = layers.Flatten()(y)
            logits = layers.Dense(10)(y)
        return tf.keras.Model(picture, logits)

    def pipeline_calls(model):
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=8)

    _train_like_tech_note(run, pixel_classifier, pipeline_calls, seed=11)


def example_training_pipelining_sequential(run: Run) -> None:
    """tech note training_pipelining_sequential.py: a Sequential model without an Input,
    ``set_pipelining_options`` then ``set_pipeline_stage_assignment([0, 1, 2, 3, 3])``."""
    import tensorflow as tf
    from tensorflow.keras import layers

    def stacked(stages: bool):
        model = tf.keras.Sequential([layers.Conv2D(4, 1, activation="relu"),
                                     layers.Conv2D(3, 1, activation="relu"),
                                     layers.Conv2D(3, 1), layers.Flatten(), layers.Dense(10)])
        model.build((2, 6, 6, 3))
        return model

    def pipeline_calls(model):
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=8)
        model.set_pipeline_stage_assignment([0, 1, 2, 3, 3])

    _train_like_tech_note(run, stacked, pipeline_calls, seed=12)


def example_recompute_lstm(run: Run) -> None:
    """feature_examples/tensorflow2/recomputation_checkpoints/recompute_lstm.py: one
    ``PopnnLSTM`` (``return_state=True``) run over slices of the sequence (``Lambda``), the
    state between slices through ``ipu_layers.RecomputationCheckpoint()``; stage 0 the LSTM,
    stage 1 a Dense (``tf.keras.ipu.PipelineStage``), both on IPU 0 (``device_mapping=[0,
    0]``), ``ipu.pipelining_ops.PipelineSchedule.Sequential`` and
    ``RecomputationMode.RecomputeAndBackpropagateInterleaved``, ``allow_recompute``,
    ``set_infeed_queue_options(prefetch_depth=1)``, fit on a constant dataset. Smaller: 12
    time steps of 4 features, 2 checkpoints, 6 units. The CPU reference: the same model
    with Keras's LSTM (what PopnnLSTM is here) and the same accumulation."""
    import ipu_tensorflow_addons.keras.layers as ipu_layers
    import keras
    import tensorflow as tf
    from tensorflow.python import ipu

    seq_len, checkpoints, features, units = 12, 2, 4, 6

    def split_lstm_model(stages: bool):
        def stage(i):
            return tf.keras.ipu.PipelineStage(i) if stages else contextlib.nullcontext()

        def split_lstm(inputs):
            lstm_layer = ipu_layers.PopnnLSTM(units, return_state=True)
            out_slices = []
            initial_state = None
            for i in range(checkpoints + 1):
                begin = i * seq_len // (checkpoints + 1)
                end = (i + 1) * seq_len // (checkpoints + 1)
                seq_slice = tf.keras.layers.Lambda(lambda x, b=0, e=0: x[:, b:e, :],
                                                   arguments={"b": begin, "e": end})(inputs)
                output, out_h, out_c = lstm_layer(seq_slice, initial_state=initial_state)
                if i != checkpoints:
                    out_h, out_c = ipu_layers.RecomputationCheckpoint()([out_h, out_c])
                initial_state = (out_h, out_c)
                out_slices.append(output)
            return tf.keras.layers.Concatenate(axis=1)(out_slices)

        input_layer = tf.keras.layers.Input(shape=(seq_len, features))
        with stage(0):
            x = split_lstm(input_layer)
        with stage(1):
            x = tf.keras.layers.Dense(1)(x)
        return tf.keras.Model(inputs=input_layer, outputs=x)

    def dataset():
        rng = np.random.default_rng(4)
        data = tf.constant(rng.uniform(size=(seq_len, features)).astype(np.float32))
        label = tf.constant(0.2, shape=[1])
        return tf.data.Dataset.from_tensors((data, label)).repeat(32).batch(4, drop_remainder=True)

    keras.utils.set_random_seed(13)
    reference = split_lstm_model(False)
    reference.compile(tf.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    reference.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4)
    cpu_loss = reference.fit(dataset(), verbose=0).history["loss"]

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.allow_recompute = True
    with _configured(cfg):
        strategy = ipu.ipu_strategy.IPUStrategy()
        keras.utils.set_random_seed(13)
        with strategy.scope():
            model = split_lstm_model(True)
            model.compile(tf.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=4,
                pipeline_schedule=ipu.pipelining_ops.PipelineSchedule.Sequential,
                device_mapping=[0, 0],
                recomputation_mode=ipu.pipelining_ops.RecomputationMode
                .RecomputeAndBackpropagateInterleaved)
            model.set_infeed_queue_options(prefetch_depth=1)
            ipu_loss = model.fit(dataset(), verbose=0).history["loss"]
        report = [r for r in strategy.reports if "stages=2" in r.name]
        run.true("2 stages on one IPU", bool(report) and report[-1].details.get("ipus_per_replica") == 1,
                 [r.name for r in strategy.reports])
    run.losses("History loss", ipu_loss, cpu_loss)
    run.arrays("weights", model.get_weights(), reference.get_weights())


EXAMPLES = {name[len("example_"):]: fn for name, fn in sorted(globals().items())
            if name.startswith("example_")}


# -- the subprocess and its tests --------------------------------------------------------------


def main(names: list[str]) -> None:
    import test_graphcore_examples as gcex

    import tf_ipu  # noqa: F401  (the one added line)

    gcex.EXAMPLES = EXAMPLES  # _run_one looks examples up there
    with tempfile.TemporaryDirectory(prefix="gcpx_") as scratch:
        tempfile.tempdir = scratch
        for name in names or list(EXAMPLES):
            _run_one(name)


@pytest.fixture(scope="module")
def results(device_server, request):
    import server_util as su

    here = os.path.abspath(__file__)
    names = sorted({item.callspec.params["name"] for item in request.session.items
                    if os.path.abspath(str(item.fspath)) == here and hasattr(item, "callspec")
                    and "name" in item.callspec.params})
    env = su.child_env(TF_IPU_SERVER=device_server, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, here, *names], capture_output=True, text=True,
                          env=env, timeout=900, cwd=tempfile.gettempdir())
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("GCEX "):
            record = json.loads(line[5:])
            found[record["name"]] = record
    return found, done


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_pipelined_example_matches_cpu(results, name):
    _matches(results, name)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_pipelined_example_runs_as_graphcore_wrote_it(results, name):
    record = _result(results, name)
    assert record["ok"], record.get("error")
    assert record["gaps"] == {}, record["gaps"]


if __name__ == "__main__":
    main(sys.argv[1:])


# -- recomputation checkpoints and nested models (in this process) ----------------------------

_RNG = np.random.default_rng(21)
_X = _RNG.normal(size=(64, 12)).astype("float32")
_Y = _RNG.normal(size=(64, 3)).astype("float32")


def _distance(got, want) -> float:
    from keras_util import rel_l2

    return max(rel_l2(a, b) for a, b in zip(got, want, strict=True))


def _checkpointed(checkpoint: bool, stages: bool, width: int = 64):
    """Stage 0: three tanh Dense layers, the second's output checkpointed (or not); stage 1:
    the output layer."""
    import contextlib

    import keras
    from ipu_tensorflow_addons.keras.layers import RecomputationCheckpoint

    def stage(i):
        return keras.ipu.PipelineStage(i) if stages else contextlib.nullcontext()

    inputs = keras.Input((12,))
    with stage(0):
        x = keras.layers.Dense(width, activation="tanh")(inputs)
        x = keras.layers.Dense(width, activation="tanh")(x)
        if checkpoint:
            x = RecomputationCheckpoint()(x)
        x = keras.layers.Dense(width, activation="tanh")(x)
    with stage(1):
        x = keras.layers.Dense(3)(x)
    return keras.Model(inputs, x)


def _cpu_reference(build, initial, lr: float, batch: int):
    import keras

    model = build()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    model.fit(_X, _Y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def test_a_recomputation_checkpoint_is_the_identity_outside_pipelines(ipu_system):
    """Graphcore removes checkpoints where they do not apply: eager, in a function, with
    gradients, and in a model that is not pipelined (trained under IPUStrategy as on the CPU,
    its IR unmarked)."""
    import keras
    import tensorflow as tf
    from tensorflow.python import ipu

    import tf_ipu
    from device_server.protocol import ir_pb2
    from tf_ipu import runtime

    x = tf.constant(_X[:4])
    out = ipu.pipelining_ops.recomputation_checkpoint({"a": x, "b": [x * 2.0]}, name="keep")
    assert sorted(out) == ["a", "b"] and isinstance(out["b"], list)
    np.testing.assert_array_equal(out["b"][0].numpy(), _X[:4] * 2.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(ipu.ops.pipelining_ops.recomputation_checkpoint(tf.tanh(x)) ** 2)
    with tf.GradientTape() as plain_tape:
        plain_tape.watch(x)
        plain = tf.reduce_sum(tf.tanh(x) ** 2)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), plain_tape.gradient(plain, x).numpy())
    traced = tf.function(lambda v: ipu.pipelining_ops.recomputation_checkpoint(v + 1.0),
                         jit_compile=True)
    np.testing.assert_array_equal(traced(x).numpy(), _X[:4] + 1.0)

    keras.utils.set_random_seed(3)
    initial = _checkpointed(False, False).get_weights()
    want = _cpu_reference(lambda: _checkpointed(False, False), initial, 0.05, batch=8)
    with tf_ipu.IPUStrategy().scope():
        model = _checkpointed(True, False)
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    model.fit(_X, _Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _distance(model.get_weights(), want) <= 1e-5
    entry = runtime.get_runtime()._programs[-1]
    module = ir_pb2.Module.FromString(entry.program)
    instrs = [i for c in module.computations for i in c.instructions]
    assert any("tf_ipu_recomputation_checkpoint" in i.source_op for i in instrs)
    assert not any("recomputation_checkpoint" in i.attrs for i in instrs)


def test_checkpoints_stash_more_and_recompute_less_with_the_same_results(ipu_system):
    """RecomputeAndBackpropagateInterleaved, Grouped, recomputation on: the checkpointed
    value is marked in the IR (its forward reshape, in stage 0), the weights are those of
    the same model without the checkpoint and of the CPU at the effective batch ('mean');
    the tile model stashes the checkpoint beside stage 0's input (more bytes) and recomputes
    from it: the layer that made it runs once (fewer cycles). RecomputeThenBackpropagate
    ignores it; the Interleaved schedule refuses RecomputeAndBackpropagateInterleaved."""
    import keras
    from keras_util import attached_ipus
    from tensorflow.python import ipu

    import tf_ipu
    from device_server.protocol import ir_pb2
    from tf_ipu import runtime

    modes = ipu.pipelining_ops.RecomputationMode
    keras.utils.set_random_seed(4)
    initial = _checkpointed(False, False).get_weights()
    want = _cpu_reference(lambda: _checkpointed(False, False), initial, 0.05, batch=32)
    weights, modules = {}, {}
    with attached_ipus(ipu_system, 2, recompute=True):
        for checkpoint in (False, True):
            with tf_ipu.IPUStrategy().scope():
                model = _checkpointed(checkpoint, True)
                model.set_weights(initial)
                model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                              steps_per_execution=8)
                model.set_pipelining_options(
                    gradient_accumulation_steps_per_replica=8,
                    gradient_accumulation_reduction_method="mean",
                    recomputation_mode=modes.RecomputeAndBackpropagateInterleaved)
            model.fit(_X, _Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
            weights[checkpoint] = model.get_weights()
            entry = [e for e in runtime.get_runtime()._programs if e.pipeline][-1]
            modules[checkpoint] = ir_pb2.Module.FromString(entry.program)
    assert _distance(weights[True], want) <= 1e-4
    assert _distance(weights[True], weights[False]) <= 1e-6
    marked = [i for c in modules[True].computations for i in c.instructions
              if "recomputation_checkpoint" in i.attrs]
    assert len(marked) == 1 and marked[0].opcode == "reshape"
    assert marked[0].attrs["pipeline_stage"].i == 0
    assert not any("recomputation_checkpoint" in i.attrs
                   for c in modules[False].computations for i in c.instructions)

    def stage0(checkpoint: bool, mode) -> dict:
        with tf_ipu.IPUStrategy().scope():
            model = _checkpointed(checkpoint, True, width=256)
            model.compile(optimizer="sgd", loss="mse")
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=8,
                                         recomputation_mode=mode)
        est = tf_ipu.estimate(model, 16, training=True, recomputation=True, ipu_version="ipu2")
        return est.stages[0]

    plain = stage0(False, modes.RecomputeAndBackpropagateInterleaved)
    kept = stage0(True, modes.RecomputeAndBackpropagateInterleaved)
    ignored = stage0(True, modes.RecomputeThenBackpropagate)
    assert plain["recomputation"] and kept["recomputation"]
    assert plain["recompute_cycles"] == plain["forward_cycles"] > 0
    # The checkpoint (16 x 256 float32) is stashed with the stage's input ...
    assert kept["checkpoint_bytes"] >= plain["checkpoint_bytes"] + 16 * 256 * 4
    # ... and the layer that made it is not recomputed: the first Dense still is (the second's
    # kernel gradient reads its output), and the third (its own backward reads its output);
    # the second, 256 x 256 like the third, is about 2/5 of stage 0's forward.
    assert 0.5 * plain["recompute_cycles"] < kept["recompute_cycles"] \
        < 0.75 * plain["recompute_cycles"]
    assert (ignored["checkpoint_bytes"], ignored["recompute_cycles"]) == \
        (plain["checkpoint_bytes"], plain["recompute_cycles"])
    with tf_ipu.IPUStrategy().scope():
        model = _checkpointed(True, True)
        with pytest.raises(ValueError, match=r"the Interleaved pipeline schedule does not "
                                              r"support recomputation_mode="
                                              r"RecomputeAndBackpropagateInterleaved"):
            model.set_pipelining_options(
                gradient_accumulation_steps_per_replica=8,
                pipeline_schedule=ipu.pipelining_ops.PipelineSchedule.Interleaved,
                recomputation_mode=modes.RecomputeAndBackpropagateInterleaved)


def _with_nested(stages: bool):
    """A functional model calling a nested Sequential between two of its own layers."""
    import keras

    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(8, activation="tanh")], name="inner_block")
    inputs = keras.Input((12,))
    x = keras.layers.Dense(8, activation="tanh", name="first")(inputs)
    x = inner(x)
    x = keras.layers.Dense(3, name="last")(x)
    return keras.Model(inputs, x, name="with_nested")


def test_a_nested_model_over_two_stages_trains_as_one_device(ipu_system):
    """Graphcore's nested assignments: ``get_pipeline_stage_assignment()`` gives the nested
    Sequential a FunctionalNestedModelPipelineStageAssignment holding its layers'; each
    layer gets a stage (the nested model's first layer in stage 0, its second in 1), set
    back, printed; training matches the CPU at the effective batch, each Dense's matmuls
    in its stage. An int for the nested model puts all of it in one stage."""
    import keras
    from keras_util import attached_ipus

    import tf_ipu
    from device_server.protocol import ir_pb2
    from tf_ipu import runtime

    keras.utils.set_random_seed(6)
    initial = _with_nested(False).get_weights()
    want = _cpu_reference(lambda: _with_nested(False), initial, 0.05, batch=16)
    printed: list[str] = []
    with attached_ipus(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            model = _with_nested(True)
            model.set_weights(initial)
            assignments = model.get_pipeline_stage_assignment()
            assert [type(a).__name__ for a in assignments] == [
                "FunctionalLayerPipelineStageAssignment",
                "FunctionalNestedModelPipelineStageAssignment",
                "FunctionalLayerPipelineStageAssignment"]
            nested = assignments[1]
            assert nested.is_nested_model and nested.nested_model.name == "inner_block"
            inner = nested.pipeline_stage_assignments
            assert [type(a).__name__ for a in inner] == ["SequentialLayerPipelineStageAssignment"] * 2
            assignments[0].pipeline_stage = 0
            inner[0].pipeline_stage = 0
            inner[1].pipeline_stage = 1
            assignments[2].pipeline_stage = 1
            model.set_pipeline_stage_assignment(assignments)
            model.print_pipeline_stage_assignment_summary(print_fn=printed.append)
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                         gradient_accumulation_reduction_method="mean")
        again = model.get_pipeline_stage_assignment()
        assert [a.pipeline_stage for a in again[1].pipeline_stage_assignments] == [0, 1]
        model.fit(_X, _Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
        entry = [e for e in runtime.get_runtime()._programs if e.pipeline][-1]
    assert _distance(weights, want) <= 1e-4
    assert any("inner_block (nested model)" in line for line in printed), printed
    inner_names = [layer.name for layer in model.get_layer("inner_block").layers]
    expected = {"first": 0, inner_names[0]: 0, inner_names[1]: 1, "last": 1}
    module = ir_pb2.Module.FromString(entry.program)
    seen = set()
    for comp in module.computations:
        for instr in comp.instructions:
            if instr.opcode != "dot":
                continue
            for name, stage in expected.items():
                if re.search(rf"/{name}(_\d+)?/", instr.source_op):  # TF's unique scopes
                    assert instr.attrs["pipeline_stage"].i == stage, (instr.source_op, stage)
                    seen.add(name)
    assert seen == set(expected), seen
    with tf_ipu.IPUStrategy().scope():
        model.set_pipeline_stage_assignment([0, 1, 1])  # the whole nested model in stage 1
    got = model.get_pipeline_stage_assignment()
    assert [a.pipeline_stage for a in got[1].pipeline_stage_assignments] == [1, 1]
    with pytest.raises(ValueError, match=r"1 stages given for 2 layers of inner_block"):
        got[1].pipeline_stage_assignments.pop()
        model.set_pipeline_stage_assignment(got)
