"""Gradient accumulation with sparse gradients: an ``Embedding``'s gradient is a
``tf.IndexedSlices`` (issue 26, point 2).

Reference, computed here with plain Keras on the CPU and no tf_ipu accumulation: for each
weight update, the gradients of the k micro-batches taken with a ``GradientTape`` (the
Embedding's made dense), reduced by their sum ("sum", Graphcore's default) or their mean
("mean", "running_mean"), and applied once by the same optimizer, as
``tests/test_accumulation.py`` builds it. Tolerance: 1e-5 relative L2 on every weight
(FP32, two weight updates). SGD with momentum carries the first update into the second, and
"sum" moves the weights k times as far as "mean", so a wrong reduction is far outside it.

The tutorial script below makes the API calls of Graphcore's embeddings tutorial (imdb.py) with
a pipelined model on 2 IPUs (and the default "sum"); its CPU reference is plain Keras's own
accumulation (``gradient_accumulation_steps``, a mean) of k times the loss: the mean of k
gradients of k x loss is the sum of the k gradients. Tolerance 1e-4 (losses relative, weights
relative L2).
"""

from __future__ import annotations

import contextlib

import keras_util as ku
import numpy as np
import pytest

K = 4  # micro-batches per weight update
BATCH = 8
VOCAB, LENGTH = 40, 6
RNG = np.random.default_rng(26)
X = RNG.integers(0, VOCAB, size=(2 * K * BATCH, LENGTH)).astype("int32")
Y = RNG.integers(0, 3, size=(2 * K * BATCH,)).astype("int32")


def _model():
    import keras

    return keras.Sequential([keras.Input((LENGTH,), dtype="int32"),
                             keras.layers.Embedding(VOCAB, 4),
                             keras.layers.GlobalAveragePooling1D(),
                             keras.layers.Dense(3)])


def _optimizer():
    import keras

    return keras.optimizers.SGD(0.5, momentum=0.9)


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _distance(got, want) -> float:
    return max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
               for a, b in zip(got, want, strict=True))


def _reference(initial, method: str):
    """Plain Keras on the CPU: per update, one optimizer step on the reduced gradients of K
    micro-batches; also says that the Embedding's gradient was an IndexedSlices."""
    import tensorflow as tf

    model = _model()
    model.set_weights(initial)
    optimizer = _optimizer()
    loss_fn = _loss()
    sparse = False
    for update in range(len(X) // (K * BATCH)):
        grads = []
        for i in range(K):
            rows = slice((update * K + i) * BATCH, (update * K + i + 1) * BATCH)
            with tf.GradientTape() as tape:
                loss = loss_fn(Y[rows], model(X[rows], training=True))
            step = tape.gradient(loss, model.trainable_variables)
            sparse = sparse or any(isinstance(g, tf.IndexedSlices) for g in step)
            grads.append([tf.convert_to_tensor(g) for g in step])
        reduced = [tf.add_n(gs) / (1.0 if method == "sum" else K) for gs in zip(*grads, strict=True)]
        optimizer.apply_gradients(zip(reduced, model.trainable_variables, strict=True))
    return model.get_weights(), sparse


@pytest.mark.parametrize("pipelined", [False, True], ids=["accumulation", "pipelined"])
@pytest.mark.parametrize("method", ["sum", "mean", "running_mean"])
def test_embedding_gradients_accumulate_as_on_the_cpu(ipu_system, method, pipelined):
    import tf_ipu

    initial = _model().get_weights()
    want, sparse = _reference(initial, method)
    assert sparse, "the reference's Embedding gradient is no longer an IndexedSlices"
    with tf_ipu.IPUStrategy().scope():
        model = _model()
        model.set_weights(initial)
        model.compile(optimizer=_optimizer(), loss=_loss(), steps_per_execution=2 * K)
        if pipelined:  # two stages on the one IPU
            model.set_pipeline_stage_assignment([0, 1, 1])
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=K,
                                         gradient_accumulation_reduction_method=method,
                                         device_mapping=[0, 0])
        else:
            model.set_gradient_accumulation_options(
                gradient_accumulation_steps_per_replica=K,
                gradient_accumulation_reduction_method=method)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 2  # 2 x K steps, one update per K
    assert _distance(model.get_weights(), want) <= 1e-5


# -- Graphcore's embeddings tutorial, pipelined ------------------------------------------------
# A script of our own making the API calls of graphcore/examples
# tutorials/feature_examples/tensorflow2/embeddings/imdb.py, commit
# 2d8b565326ef6ba730492ad8badd984b067645bc (the same file is in graphcore/tutorials
# feature_examples/tensorflow2/embeddings/): ipu_tensorflow_addons' Embedding and
# LSTM(dropout), PipelineStage scopes, set_pipelining_options(
# gradient_accumulation_steps_per_replica=...) with its default "sum", Adam,
# steps_per_execution, fit on a repeated dataset with steps_per_epoch, 2 IPUs. Small sizes, and
# made-up reviews instead of imdb.load_data (no network here). (imdb_sequential.py makes the
# same calls with set_pipeline_stage_assignment on a Sequential model: the pipelined case of
# the test above.)


def _tutorial(on_ipu: bool):
    """Trains the tutorial's model; returns (model, History losses). On the CPU (``on_ipu``
    False) it is plain Keras without the PipelineStage scopes (they need an IPUStrategy, as on
    Graphcore's): accumulation by the optimizer's own ``gradient_accumulation_steps`` (a mean)
    of k x the loss, i.e. the sum of the gradients, and XLA so that the dropout masks are drawn
    as on the IPU."""
    import tensorflow as tf
    from ipu_tensorflow_addons.keras.layers import LSTM, Embedding
    from tensorflow.keras.layers import Dense, Input
    from tensorflow.keras.optimizers import Adam
    from tensorflow.python import ipu

    max_features = 300
    minibatch_size = 8
    gradient_accumulation_steps_per_replica = 4
    maxlen = 12

    def get_dataset():  # the tutorial downloads IMDB
        return ku.imdb_like_dataset(7, max_features, minibatch_size, maxlen)

    def get_model():
        stage = tf.keras.ipu.PipelineStage if on_ipu else (lambda _: contextlib.nullcontext())
        # Graphcore writes Input(shape=(80), ...): Keras 3 needs a tuple.
        input_layer = Input(shape=(maxlen,), dtype=tf.int32, batch_size=minibatch_size)
        with stage(0):
            x = Embedding(max_features, 16)(input_layer)
        with stage(1):
            x = LSTM(16, dropout=0.2)(x)
            x = Dense(1, activation="sigmoid")(x)
        return tf.keras.Model(input_layer, x)

    tf.keras.utils.set_random_seed(3)
    if not on_ipu:
        k = gradient_accumulation_steps_per_replica
        model = get_model()
        bce = tf.keras.losses.BinaryCrossentropy()
        model.compile(steps_per_execution=8, jit_compile=True,
                      loss=lambda y, p: k * bce(y, p),
                      optimizer=Adam(0.005, gradient_accumulation_steps=k))
        history = model.fit(get_dataset(), steps_per_epoch=16, epochs=2, verbose=0)
        return model, [v / k for v in history.history["loss"]]

    cfg = ipu.config.IPUConfig()
    cfg.auto_select_ipus = 2
    cfg.configure_ipu_system()
    strategy = ipu.ipu_strategy.IPUStrategy()
    with strategy.scope():
        model = get_model()
        model.set_pipelining_options(
            gradient_accumulation_steps_per_replica=gradient_accumulation_steps_per_replica)
        model.compile(steps_per_execution=8, loss="binary_crossentropy", optimizer=Adam(0.005))
        history = model.fit(get_dataset(), steps_per_epoch=16, epochs=2, verbose=0)
    return model, history.history["loss"]


def test_the_embeddings_tutorial_pipelined_matches_cpu_keras(ipu_system, device_server,
                                                             monkeypatch):
    """History losses within 1e-4 relative, weights within 1e-4 relative L2 (FP32; LSTM and
    Adam over 8 updates)."""
    monkeypatch.setenv("TF_IPU_SERVER", device_server)  # the tutorial's IPUConfig() finds it
    reference, cpu_loss = _tutorial(on_ipu=False)
    try:
        model, ipu_loss = _tutorial(on_ipu=True)
    finally:
        ipu_system.configure_ipu_system()  # the suite's one-IPU system again
    assert int(model.optimizer.iterations) == 2 * 16 // 4
    np.testing.assert_allclose(ipu_loss, cpu_loss, rtol=1e-4)
    assert _distance(model.get_weights(), reference.get_weights()) <= 1e-4
