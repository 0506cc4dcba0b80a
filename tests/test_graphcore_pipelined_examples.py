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
- graphcore/keras keras/ipu/docs/exporting_pipelined_model_example.py,
  exporting_pipelined_model_preprocessing_postprocessing_example.py and
  exporting_pipelined_model_preprocessing_postprocessing_cpu_example.py (pipelined Keras
  models exported with ``model.export_for_ipu_serving``): ``example_exporting_pipelined_model``
  (``_ipu_processing``, ``_cpu_processing``)
- graphcore/tensorflow tensorflow/compiler/plugin/poplar/docs/exporting_pipelined_model_example.py,
  exporting_pipelined_model_preprocessing_postprocessing_example.py and
  exporting_pipelined_model_preprocessing_postprocessing_cpu_example.py, their TF2 versions
  (stage functions exported with ``ipu.serving.export_pipeline``):
  ``example_export_pipeline`` (``_ipu_processing``, ``_cpu_processing``)
- (the Keras tutorial's completed_demo_pipelining.py and keras/ipu/docs example7..9 run in
  tests/test_graphcore_examples.py)

The exporting examples' SavedModels are then loaded by ONE fresh process (``_LOADER``: only
``import tf_ipu``, nothing configured) after the examples ran; it attaches the IPUs each
pipeline needs and serves it, compared with the same computation on the CPU (plain Keras, or
the stage functions in plain TF) within ``EXPORT_TOLERANCE`` (1e-6 relative L2):
``test_exported_example_serves_in_a_fresh_process``. The examples' host preprocessing steps
draw uniform samples for words other than "graphcore": their documented calls are checked
for the range those give, and the fresh process is fed "graphcore" everywhere.

Not here: inspecting_tensors/mnist.py's pipelined models (its OutfeedOptimizer outfeeds
accumulated gradients through a ``tf.compat.v1`` optimizer wrapper), ipu_estimator's
cifar10_ipu_pipeline_estimator.py (``tf.compat.v1`` estimator), popdist_inference.py
(PopDist); the TF1 versions of graphcore/tensorflow's exporting examples (``tf.Session``).

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


# -- exporting pipelines for serving (Graphcore's user guides' exporting_pipelined_*) ----------

#: The exports the examples made, each loaded and called by ONE fresh process after the
#: examples ran (``main``: ``_LOADER``), which prints a ``GCLOAD`` line per export.
_FRESH: list[dict] = []
#: Served values against the CPU's: relative L2 (the ops are float32 adds, multiplies, abs
#: and sums of small integers and uniform samples: exact on both sides up to summation order).
EXPORT_TOLERANCE = 1e-6


def _serve_fresh(name: str, path: str, feed: dict, want, layout: list) -> None:
    """Queues the export at ``path`` for the fresh process: called with ``feed`` (by input
    name), its first output must be ``want`` (computed on the CPU here) within
    ``EXPORT_TOLERANCE``, its program laid out as ``layout`` ([stages, stage IPUs, replicas,
    IPUs]), and the process must have attached those IPUs by itself."""
    _FRESH.append({"name": name, "path": path, "layout": layout,
                   "want": np.asarray(want, np.float64).tolist(),
                   "feed": {k: (np.asarray(v).tolist(), "str" if np.asarray(v).dtype.kind
                                in "US" else str(np.asarray(v).dtype)) for k, v in feed.items()}})


def _saved_model_directory() -> str:
    """The example's ``saved_model_directory`` (theirs is ./my_saved_model_ipu/0NN): new."""
    return os.path.join(tempfile.mkdtemp(prefix="gcpx_saved_model_"), "model")


def _keras_pipelined_export(run: Run, name: str, variant: str) -> None:
    """graphcore/keras keras/ipu/docs' three exporting_pipelined_model examples (see their
    wrappers below): a functional model in PipelineStage scopes with
    ``set_pipelining_options(device_mapping=...)``, ``compile(steps_per_execution=16)``,
    ``model.export_for_ipu_serving(dir[, preprocessing_step, postprocessing_step])``, the
    returned function called as the example does. The CPU reference: the same model built
    without stages in plain Keras, outside the strategy."""
    import keras
    import tensorflow as tf
    from tensorflow.python import ipu

    saved_model_directory = _saved_model_directory()
    batch_size = 1
    input_shape = (batch_size, 6 if variant == "cpu" else 4)
    iterations = 16
    ipus = 4 if variant == "ipu" else 2

    preprocessing_step_signature = (tf.TensorSpec(shape=input_shape, dtype=tf.string),
                                    tf.TensorSpec(shape=input_shape, dtype=tf.string))
    postprocessing_step_signature = (tf.TensorSpec(shape=input_shape, dtype=np.float32),)

    @tf.function(input_signature=preprocessing_step_signature)
    def preprocessing_step(lhs_input, rhs_input):  # the _cpu_ example's, on the host
        def transform_fn(value):
            return tf.constant(1.0) if value == "graphcore" else tf.random.uniform(
                shape=tuple(), dtype=np.float32)

        def transform_string(value):
            return tf.stack([tf.stack([transform_fn(elem) for elem in tf.unstack(rank1)])
                             for rank1 in tf.unstack(value)])

        return transform_string(lhs_input), transform_string(rhs_input)

    @tf.function(input_signature=postprocessing_step_signature)
    def postprocessing_step(model_result):
        return tf.abs(model_result)

    def ipu_preprocessing_step(lhs_input, rhs_input):  # the other example's, on the IPU
        abs_layer = keras.layers.Lambda(tf.abs)
        return abs_layer(lhs_input), abs_layer(rhs_input)

    def ipu_postprocessing(model_result):
        reduce_layer = keras.layers.Lambda(tf.reduce_sum)
        return reduce_layer(model_result)

    def build(stages: bool):
        def stage(i):
            return keras.ipu.PipelineStage(i) if stages else contextlib.nullcontext()

        input1 = keras.layers.Input(shape=input_shape[1:], batch_size=batch_size,
                                    name="input_1")
        input2 = keras.layers.Input(shape=input_shape[1:], batch_size=batch_size,
                                    name="input_2")
        if variant == "ipu":
            with stage(0):
                # Graphcore passes input1_ph twice (input_2 is not used): as written.
                lhs, rhs = ipu_preprocessing_step(input1, input1)
            with stage(1):
                x = keras.layers.Multiply()([lhs, rhs])
            with stage(2):
                x = keras.layers.Add()([x, rhs])
            with stage(3):
                x = ipu_postprocessing(x)
        else:
            with stage(0):
                x = keras.layers.Multiply()([input1, input2])
            with stage(1):
                x = keras.layers.Add()([x, input2])
        model = keras.Model(inputs=[input1, input2], outputs=x)
        if stages:
            model.set_pipelining_options(device_mapping=list(range(ipus)))
        model.build([input_shape, input_shape])
        return model

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = ipus
    if variant != "plain":
        cfg.device_connection.enable_remote_buffers = True
        cfg.device_connection.type = ipu.config.DeviceConnectionType.ON_DEMAND
    reference = build(False)
    with _configured(cfg):
        strategy = ipu.ipu_strategy.IPUStrategy()
        with strategy.scope():
            model = build(True)
            model.compile(steps_per_execution=iterations)
        if variant == "cpu":
            runtime_func = model.export_for_ipu_serving(
                saved_model_directory, preprocessing_step=preprocessing_step,
                postprocessing_step=postprocessing_step)
        else:
            runtime_func = model.export_for_ipu_serving(saved_model_directory)
        strategy = ipu.ipu_strategy.IPUStrategy()
        with strategy.scope():
            if variant == "cpu":
                input1_data = tf.constant(
                    ["graphcore", "red", "blue", "yellow", "graphcore", "purple"],
                    shape=input_shape, dtype=tf.string)
                input2_data = tf.constant(
                    ["apple", "banana", "graphcore", "orange", "pineapple", "graphcore"],
                    shape=input_shape, dtype=tf.string)
                out = np.asarray(runtime_func(input1_data, input2_data)).ravel()
                # |x*y + y|, x and y 1 for a "graphcore", else U[0, 1): y = 1 (positions 2, 5)
                # gives x + 1 in [1, 2); x = 1 (0, 4) gives 2y; the others x*y + y in [0, 2).
                run.true("served values: |x*y + y| of 1s and uniform samples",
                         out.shape == (6,) and np.all(out[[2, 5]] >= 1.0) and np.all(out < 2.0)
                         and np.all(out >= 0.0), out)
                everywhere = tf.constant("graphcore", shape=input_shape)
                served = [np.asarray(runtime_func(everywhere, everywhere))]
                ones = np.ones(input_shape, np.float32)
                inputs = [(ones, ones)]  # x = y = 1 everywhere
                feed = {"lhs_input": np.full(input_shape, "graphcore"),
                        "rhs_input": np.full(input_shape, "graphcore")}
            else:
                served, inputs = [], []
                for i in range(iterations):
                    input1_data = np.ones(input_shape, dtype=np.float32) * i
                    input2_data = np.ones(input_shape, dtype=np.float32) * 2
                    served.append(np.asarray(runtime_func(input1_data, input2_data)))
                    inputs.append((input1_data, input2_data))
                feed = {"input_1": np.ones(input_shape, np.float32) * -3,
                        "input_2": np.ones(input_shape, np.float32) * 5}
        report = [r for r in strategy.reports if "export_for_ipu_serving" in r.name]
        run.true(f"exported as a pipeline of {ipus} stages on {ipus} IPUs",
                 bool(report) and (report[-1].stages, report[-1].ipus) == (ipus, ipus),
                 [r.name for r in strategy.reports])
    # The CPU reference, outside the strategy: plain Keras (with the host steps' abs).
    post = np.abs if variant == "cpu" else np.asarray
    expected = [post(reference.predict(list(pair), verbose=0)) for pair in inputs]
    run.arrays("served values, 'graphcore' everywhere (x = y = 1)" if variant == "cpu"
               else f"served values ({iterations} calls)", served, expected, EXPORT_TOLERANCE)
    if variant == "cpu":
        want = expected[0]
    else:
        want = reference.predict([feed["input_1"], feed["input_2"]], verbose=0)
    _serve_fresh(name, saved_model_directory, feed, want,
                 [ipus, list(range(ipus)), 1, ipus])


def example_exporting_pipelined_model(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/exporting_pipelined_model_example.py (commit
    0956895696c2dec81abe57ce5b3f97db7e0d1662): Multiply in stage 0, Add in stage 1, on 2
    IPUs, exported, the returned function called 16 times."""
    _keras_pipelined_export(run, "exporting_pipelined_model", "plain")


def example_exporting_pipelined_model_ipu_processing(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/
    exporting_pipelined_model_preprocessing_postprocessing_example.py (commit
    b11e14993924d22a146dadd80fa2059ecd8f221e): abs (Lambda layers) in stage 0, the model in
    stages 1 and 2, a reduce_sum Lambda in stage 3, on 4 IPUs; ON_DEMAND, remote buffers."""
    _keras_pipelined_export(run, "exporting_pipelined_model_ipu_processing", "ipu")


def example_exporting_pipelined_model_cpu_processing(run: Run) -> None:
    """graphcore/keras keras/ipu/docs/
    exporting_pipelined_model_preprocessing_postprocessing_cpu_example.py (commit
    b11e14993924d22a146dadd80fa2059ecd8f221e): the 2-stage model exported with a host
    preprocessing_step (strings to 1 or a uniform sample) and postprocessing_step (abs)."""
    _keras_pipelined_export(run, "exporting_pipelined_model_cpu_processing", "cpu")


def _stages_on_cpu(stages, x):
    """Graphcore's stage functions one after the other in plain TF on the CPU."""
    import tensorflow as tf

    with tf.device("/CPU:0"):
        for stage in stages:
            x = stage(x)
    return np.asarray(x)


def example_export_pipeline(run: Run) -> None:
    """graphcore/tensorflow tensorflow/compiler/plugin/poplar/docs/
    exporting_pipelined_model_example.py (commit 1cf0f28ff7cbcea783a75553791156e68225ba8a,
    the TF2 version): ``serving.export_pipeline([stage1, stage2], dir, iterations=16,
    device_mapping=[0, 1], input_signature=...)`` on 2 IPUs, called 16 times."""
    import tensorflow as tf
    from tensorflow.python.ipu import ipu_strategy, serving
    from tensorflow.python.ipu.config import IPUConfig

    saved_model_directory = _saved_model_directory()

    def stage1(x):
        return x * 2

    def stage2(x):
        return x + 3

    cfg = IPUConfig()
    cfg.auto_select_ipus = 2
    input_shape = (4,)
    input_signature = (tf.TensorSpec(shape=input_shape, dtype=np.float32),)
    iterations = 16
    with _configured(cfg):
        runtime_func = serving.export_pipeline([stage1, stage2], saved_model_directory,
                                               iterations=iterations, device_mapping=[0, 1],
                                               input_signature=input_signature)
        strategy = ipu_strategy.IPUStrategy()
        with strategy.scope():
            served, expected = [], []
            for i in range(iterations):
                input_data = np.ones(input_shape, dtype=np.float32) * i
                served.append(np.asarray(runtime_func(input_data)))
                expected.append(_stages_on_cpu([stage1, stage2], input_data))
    run.arrays(f"served values ({iterations} calls: 3 .. 33)", served, expected,
               EXPORT_TOLERANCE)
    run.true("numbers from 3 to 33, as the example says",
             [float(v[0]) for v in served] == [3.0 + 2 * i for i in range(iterations)], served)
    x = np.arange(4, dtype=np.float32) - 1.5
    _serve_fresh("export_pipeline", saved_model_directory, {"x": x},
                 _stages_on_cpu([stage1, stage2], x), [2, [0, 1], 1, 2])


def example_export_pipeline_ipu_processing(run: Run) -> None:
    """graphcore/tensorflow tensorflow/compiler/plugin/poplar/docs/
    exporting_pipelined_model_preprocessing_postprocessing_example.py (commit
    66ba44cd45f5eeb0a94dcdb61ea8ae51afac6a95): abs, x2, +3 and reduce_sum as four stages on
    4 IPUs (``predict_step_signature``), ON_DEMAND, called with -i for i < 8."""
    import tensorflow as tf
    from tensorflow.python.ipu import config, ipu_strategy, serving

    saved_model_directory = _saved_model_directory()

    def preprocessing_stage(x):
        return tf.abs(x)

    def stage1(x):
        return x * 2

    def stage2(x):
        return x + 3

    def postprocessing_stage(x):
        return tf.reduce_sum(x)

    cfg = config.IPUConfig()
    cfg.auto_select_ipus = 4
    cfg.device_connection.enable_remote_buffers = True
    cfg.device_connection.type = config.DeviceConnectionType.ON_DEMAND
    input_shape = (4,)
    predict_step_signature = (tf.TensorSpec(shape=input_shape, dtype=np.float32),)
    iterations = 8
    predict_step = [preprocessing_stage, stage1, stage2, postprocessing_stage]
    with _configured(cfg):
        runtime_func = serving.export_pipeline(predict_step, saved_model_directory,
                                               iterations=iterations,
                                               device_mapping=[0, 1, 2, 3],
                                               predict_step_signature=predict_step_signature)
        strategy = ipu_strategy.IPUStrategy()
        with strategy.scope():
            served, expected = [], []
            for i in range(iterations):
                input_data = np.ones(input_shape, dtype=np.float32) * (-1.0 * i)
                served.append(np.asarray(runtime_func(input_data)))
                expected.append(_stages_on_cpu(predict_step, input_data))
    run.arrays(f"served values ({iterations} calls)", served, expected, EXPORT_TOLERANCE)
    x = np.array([-2.5, 1.0, 0.25, -4.0], np.float32)
    _serve_fresh("export_pipeline_ipu_processing", saved_model_directory, {"x": x},
                 _stages_on_cpu(predict_step, x), [4, [0, 1, 2, 3], 1, 4])


def example_export_pipeline_cpu_processing(run: Run) -> None:
    """graphcore/tensorflow tensorflow/compiler/plugin/poplar/docs/
    exporting_pipelined_model_preprocessing_postprocessing_cpu_example.py (commit
    66ba44cd45f5eeb0a94dcdb61ea8ae51afac6a95): strings to 1 ("graphcore") or a uniform
    sample in a host preprocessing_step, x2 and +3 as two stages on 2 IPUs, abs in a host
    postprocessing_step; every signature given."""
    import tensorflow as tf
    from tensorflow.python.ipu import config, ipu_strategy, serving

    saved_model_directory = _saved_model_directory()

    @tf.function
    def preprocessing_step(x):
        def transform_fn(value):
            return tf.constant(1.0) if value == "graphcore" else tf.random.uniform(
                shape=tuple())

        return tf.stack([transform_fn(elem) for elem in tf.unstack(x)])

    def stage1(x):
        return x * 2

    def stage2(x):
        return x + 3

    @tf.function
    def postprocessing_step(x):
        return tf.abs(x)

    cfg = config.IPUConfig()
    cfg.auto_select_ipus = 2
    cfg.device_connection.enable_remote_buffers = True
    cfg.device_connection.type = config.DeviceConnectionType.ON_DEMAND
    input_shape = (6,)
    predict_step_signature = (tf.TensorSpec(shape=input_shape, dtype=np.float32),)
    preprocessing_step_signature = (tf.TensorSpec(shape=input_shape, dtype=tf.string),)
    postprocessing_step_signature = (tf.TensorSpec(shape=input_shape, dtype=np.float32),)
    iterations = 10
    predict_step = [stage1, stage2]
    with _configured(cfg):
        runtime_func = serving.export_pipeline(
            predict_step, saved_model_directory, iterations=iterations, device_mapping=[0, 1],
            predict_step_signature=predict_step_signature,
            preprocessing_step=preprocessing_step,
            preprocessing_step_signature=preprocessing_step_signature,
            postprocessing_step=postprocessing_step,
            postprocessing_step_signature=postprocessing_step_signature)
        strategy = ipu_strategy.IPUStrategy()
        with strategy.scope():
            first = np.asarray(runtime_func(tf.constant(
                ["graphcore", "is", "the", "best", "AI", "company"], dtype=tf.string)))
            second = np.asarray(runtime_func(tf.constant(
                ["make", "new", "AI", "breakthroughs", "with", "IPUS"], dtype=tf.string)))
    # "graphcore" -> 1 * 2 + 3 = 5; any other word -> 2u + 3, u uniform in [0, 1).
    run.true("served values: 5 for 'graphcore', in [3, 5) for the other words",
             first.shape == (6,) and first[0] == 5.0 and np.all((first[1:] >= 3.0)
                                                                  & (first[1:] < 5.0))
             and np.all((second >= 3.0) & (second < 5.0)), [first, second])
    words = np.array(["graphcore"] * 6)
    _serve_fresh("export_pipeline_cpu_processing", saved_model_directory, {"x": words},
                 np.abs(_stages_on_cpu(predict_step, np.ones(input_shape, np.float32))),
                 [2, [0, 1], 1, 2])


#: The fresh process: only ``import tf_ipu`` (pointed at the device server by
#: $TF_IPU_SERVER), nothing configured; loads each export and calls its signature.
_LOADER = """
import json, sys
import numpy as np
import tensorflow as tf
import tf_ipu
from tf_ipu.serving import read_requirements
runtime = tf_ipu.get_runtime()
for job in json.loads(sys.argv[1]):
    record = {"name": job["name"]}
    try:
        loaded = tf.saved_model.load(job["path"])
        feed = {k: tf.constant(np.asarray(v, dtype=None if d == "str" else d))
                for k, (v, d) in job["feed"].items()}
        result = loaded.signatures["serving_default"](**feed)
        program = read_requirements(job["path"])["programs"][0]["program"]
        report = [r for r in runtime.reports if r.name == program][-1]
        record.update(output=result["output_0"].numpy().tolist(),
                      attached=len(runtime.client.attachment.ipu_ids),
                      report=[report.stages, list(report.details.get("stage_ipus") or [0]),
                              report.replicas, report.ipus])
    except Exception as e:  # noqa: BLE001
        record["error"] = f"{type(e).__name__}: {e}"[-3000:]
    print("GCLOAD " + json.dumps(record), flush=True)
"""


def _load_in_fresh_process() -> None:
    """Runs ``_LOADER`` on the queued exports; prints its GCLOAD lines (each with what the
    export must give), or one per export saying why the process failed."""
    if not _FRESH:
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _LOADER, json.dumps(_FRESH)], env=env,
                          capture_output=True, text=True, timeout=600)
    loaded = {}
    for line in done.stdout.splitlines():
        if line.startswith("GCLOAD "):
            record = json.loads(line[len("GCLOAD "):])
            loaded[record["name"]] = record
    for job in _FRESH:
        record = loaded.get(job["name"]) or {
            "name": job["name"],
            "error": f"the fresh process (exit {done.returncode}) reported nothing: "
                     f"{done.stderr[-3000:]}"}
        record.update(want=job["want"], layout=job["layout"])
        print("GCLOAD " + json.dumps(record), flush=True)
    _FRESH.clear()


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
        _load_in_fresh_process()  # the exports the examples made, in one fresh process


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
    for line in done.stdout.splitlines():  # after the examples: their exports, loaded afresh
        if line.startswith("GCLOAD "):
            record = json.loads(line[len("GCLOAD "):])
            if record["name"] in found:
                found[record["name"]]["fresh_process"] = record
    return found, done


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_pipelined_example_matches_cpu(results, name):
    _matches(results, name)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_pipelined_example_runs_as_graphcore_wrote_it(results, name):
    record = _result(results, name)
    assert record["ok"], record.get("error")
    assert record["gaps"] == {}, record["gaps"]


EXPORTS = [n for n in EXAMPLES if n.startswith(("exporting_pipelined", "export_pipeline"))]


@pytest.mark.parametrize("name", EXPORTS)
def test_exported_example_serves_in_a_fresh_process(results, name):
    """The example's export, loaded by a process that only imported tf_ipu and configured
    nothing: it attached the IPUs the pipeline needs, ran it laid out as exported, and
    served what the CPU computes (``EXPORT_TOLERANCE`` relative L2)."""
    record = _result(results, name)
    assert record["ok"], record.get("error")
    fresh = record.get("fresh_process")
    assert fresh is not None, "the example queued no export for the fresh process"
    assert "error" not in fresh, fresh["error"]
    stages, stage_ipus, replicas, ipus = fresh["layout"]
    assert fresh["report"] == [stages, stage_ipus, replicas, ipus]
    assert fresh["attached"] >= ipus
    got = np.asarray(fresh["output"], np.float64)
    want = np.asarray(fresh["want"], np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.linalg.norm(got - want) <= EXPORT_TOLERANCE * max(np.linalg.norm(want), 1.0), \
        (got, want)


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
