"""Graphcore's IPU Keras layers (``ipu_tensorflow_addons.keras.layers``) against their Keras
counterparts.

On the CPU: forward outputs within 1e-5 relative L2 of the Keras layer holding the same
weights, and gradients (of the inputs and of every weight) within 1e-5; configs round-trip.
Under ``tf_ipu.IPUStrategy``: the IMDB example's shape (Embedding, LSTM, Dense; small sizes)
trained by ``fit`` matches the same Keras model trained on the CPU (1e-4 relative on the
History losses, 1e-3 relative L2 on the weights), and a model of the other layers predicts
and takes a training step as the CPU does (1e-5 on predictions, 1e-4 on weights).
"""

from __future__ import annotations

import logging
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ipu
from tests.keras_util import rel_l2
from tf_ipu import notices
from tf_ipu.graphcore import addons

RTOL = 1e-5


@pytest.fixture(scope="module")
def gl():
    """``ipu_tensorflow_addons.keras.layers``, installed."""
    assert addons.install()
    from ipu_tensorflow_addons.keras import layers

    return layers


@pytest.fixture
def warnings_log(caplog):
    """Fresh once-per-process notices; the records of the ``tf_ipu`` logger."""
    notices._forget()
    caplog.set_level(logging.WARNING, logger="tf_ipu")
    yield caplog
    notices._forget()


def _close(actual, expected, rtol: float = RTOL, what: str = "") -> None:
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, (what, a.shape, e.shape)
        assert rel_l2(a, e) <= rtol, f"{what}: rel L2 {rel_l2(a, e)}"


def _grads(layer, x, time_major_output: bool = False, **kwargs):
    """The output and the gradients of sum(output * fixed weights) for ``x`` and the weights
    (the first output taken batch-major)."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, **kwargs)
        first = tf.nest.flatten(out)[0]
        if time_major_output:
            first = tf.transpose(first, (1, 0, 2))
        w = tf.constant(np.random.default_rng(9).standard_normal(first.shape), first.dtype)
        loss = tf.reduce_sum(first * w)
    return out, tape.gradient(loss, [x, *layer.trainable_variables])


def _match(ours, theirs, x, x_theirs=None, time_major_output: bool = False, **kwargs):
    """The outputs and gradients of ``ours`` and of the Keras layer ``theirs`` given ``ours``'
    weights."""
    x_theirs = x if x_theirs is None else x_theirs
    out, grads = _grads(ours, x, time_major_output, **kwargs)
    theirs.build(np.shape(x_theirs))
    theirs.set_weights(ours.get_weights())
    ref, ref_grads = _grads(theirs, x_theirs, **kwargs)
    return out, ref, grads, ref_grads


# ---------------------------------------------------------------------------------- install


def test_install_maps_graphcore_module_names(gl):
    import ipu_tensorflow_addons
    import ipu_tensorflow_addons.keras.layers.rnn as rnn
    from ipu_tensorflow_addons.keras.layers import normalization

    assert ipu_tensorflow_addons is addons and ipu_tensorflow_addons.keras.layers is gl
    assert rnn.PopnnLSTM is gl.LSTM is gl.PopnnLSTM and gl.GRU is gl.PopnnGRU
    assert normalization.GroupNorm is gl.GroupNormalization
    assert gl.LayerNorm is gl.LayerNormalization and gl.InstanceNorm is gl.InstanceNormalization
    for absent in ("CTCLoss", "CTCInferenceLayer", "CTCPredictionsLayer", "EffectiveTransformer"):
        assert not hasattr(gl, absent)  # absent, not a placeholder
    assert addons.install()  # again: harmless


def test_install_leaves_a_real_package_alone(gl, monkeypatch, tmp_path):
    other = types.ModuleType("ipu_tensorflow_addons")
    monkeypatch.setitem(sys.modules, "ipu_tensorflow_addons", other)
    assert not addons.install() and sys.modules["ipu_tensorflow_addons"] is other
    # Installed but not imported yet (Graphcore's wheel on the path): not shadowed either.
    monkeypatch.delitem(sys.modules, "ipu_tensorflow_addons")
    (tmp_path / "ipu_tensorflow_addons").mkdir()
    (tmp_path / "ipu_tensorflow_addons" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not addons.install() and "ipu_tensorflow_addons" not in sys.modules


# ---------------------------------------------------------------------------------- Embedding


def test_embedding_matches_keras(gl, warnings_log):
    ids = np.random.default_rng(0).integers(0, 40, (4, 6)).astype("int32")
    ids[:, -2:] = 0
    ours = gl.Embedding(40, 8, mask_zero=True, serialization_factor=4)
    out = ours(ids)
    theirs = keras.layers.Embedding(40, 8, mask_zero=True)
    theirs.build(ids.shape)
    theirs.set_weights(ours.get_weights())
    _close(out, theirs(ids), what="embedding")
    np.testing.assert_array_equal(ours.compute_mask(ids), theirs.compute_mask(ids))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ours(ids) ** 2)
    with tf.GradientTape() as ref_tape:
        ref_loss = tf.reduce_sum(theirs(ids) ** 2)
    _close(tf.convert_to_tensor(tape.gradient(loss, ours.embeddings)),
           tf.convert_to_tensor(ref_tape.gradient(ref_loss, theirs.embeddings)), what="grad")
    assert sum("Embedding(serialization_factor)" in r.getMessage()
               for r in warnings_log.records) == 1
    with pytest.raises(ValueError, match=r"\(3\) must divide `input_dim` \(40\)"):
        gl.Embedding(40, 8, serialization_factor=3)


# ---------------------------------------------------------------------------------- LSTM / GRU


def _seq(time_major: bool, batch: int = 3, steps: int = 5, features: int = 4, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((batch, steps, features)).astype("float32")
    return (np.transpose(x, (1, 0, 2)), x) if time_major else (x, x)


def _batch_major(out, time_major: bool, return_sequences: bool):
    first = tf.nest.flatten(out)
    if time_major and return_sequences:
        first[0] = tf.transpose(first[0], (1, 0, 2))
    return first


LSTM_CASES = {
    "last_output": {},
    "sequences_and_state": {"return_sequences": True, "return_state": True},
    "time_major_sequences": {"time_major": True, "return_sequences": True},
    "time_major_state": {"time_major": True, "return_state": True, "unit_forget_bias": False},
}


@pytest.mark.parametrize("case", list(LSTM_CASES))
def test_lstm_matches_keras_with_the_same_weights(gl, case):
    kwargs = LSTM_CASES[case]
    time_major = kwargs.get("time_major", False)
    x, x_keras = _seq(time_major)
    keras.utils.set_random_seed(1)
    ours = gl.LSTM(6, bias_initializer="random_normal", **kwargs)
    keras_kwargs = {k: v for k, v in kwargs.items() if k != "time_major"}
    theirs = keras.layers.LSTM(6, **keras_kwargs)
    sequences = kwargs.get("return_sequences", False)
    out, ref, grads, ref_grads = _match(ours, theirs, x, x_keras, time_major and sequences)
    _close(_batch_major(out, time_major, sequences), ref,
           what=f"{case} outputs")
    if time_major:
        grads[0] = tf.transpose(grads[0], (1, 0, 2))
    _close(grads, ref_grads, what=f"{case} gradients")
    # Graphcore's names for Keras's weights: [in, 4u], [u, 4u], [4u].
    assert ours.kernel.shape == (4, 24) and ours.recurrent_kernel.shape == (6, 24)
    assert ours.biases.shape == (24,) and ours.num_units == 6


@pytest.mark.parametrize("reset_after,time_major", [(True, False), (False, True)],
                         ids=["reset_after", "reset_before_time_major"])
def test_gru_matches_keras_with_the_same_weights(gl, reset_after, time_major):
    x, x_keras = _seq(time_major, seed=2)
    keras.utils.set_random_seed(2)
    ours = gl.GRU(5, reset_after=reset_after, time_major=time_major, return_sequences=True,
                  return_state=True, bias_initializer="random_normal")
    theirs = keras.layers.GRU(5, reset_after=reset_after, return_sequences=True,
                              return_state=True)
    out, ref, grads, ref_grads = _match(ours, theirs, x, x_keras, time_major)
    _close(_batch_major(out, time_major, True), ref, what="outputs")
    if time_major:
        grads[0] = tf.transpose(grads[0], (1, 0, 2))
    _close(grads, ref_grads, what="gradients")
    assert ours.biases.shape == ((2, 15) if reset_after else (15,))


@pytest.mark.parametrize("layer", ["LSTM", "GRU"])
def test_rnn_loop_reads_its_weights_once(gl, layer):
    """The recurrence captures the weights read once before the loop (PopLibs' kernel takes them
    as operands): its body reads no variable, so TF's while-loop gradient stacks no per-step
    copy of the kernels (``[steps, in, gates * units]``, which PopnnLSTM never holds); it stacks
    the step's input, states and gates only."""
    rnn = getattr(gl, layer)(6, return_state=True)
    x = tf.constant(_seq(False)[0])
    rnn(x)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(o) for o in tf.nest.flatten(rnn(x, training=True))])
        return tape.gradient(loss, rnn.trainable_variables)

    graph = step.get_concrete_function(x).graph
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert loops
    for op in loops:
        body = graph._get_function(op.get_attr("body").name).definition
        assert not [n.name for n in body.node_def if n.op == "ReadVariableOp"]
    # The stacks TF's gradient fills (one per value the backward reads, per step).
    stacked = [tuple(tf.get_static_value(op.inputs[0]).tolist())
               for op in graph.get_operations()
               if op.type == "EmptyTensorList" and "accumulator" in op.name]
    assert stacked, "no per-step stash: the loop was not differentiated"
    weights = {tuple(w.shape) for w in rnn.trainable_variables}
    assert not weights & set(stacked), (weights, stacked)
    assert set(stacked) <= {(3, 4), (3, 6)}, stacked  # [batch, features], [batch, units]


def test_rnn_initial_state_stateful_and_seeds(gl):
    x, _ = _seq(True, batch=2)
    h0 = np.random.default_rng(3).standard_normal((2, 6)).astype("float32")
    c0 = np.random.default_rng(4).standard_normal((2, 6)).astype("float32")
    ours = gl.LSTM(6, time_major=True, return_state=True, seed=7)
    out = ours(x, initial_state=[h0, c0])
    theirs = keras.layers.LSTM(6, return_state=True)
    theirs.build((2, 5, 4))
    theirs.set_weights(ours.get_weights())
    _close(out, theirs(np.transpose(x, (1, 0, 2)), initial_state=[h0, c0]), what="state")
    # ``seed`` seeds the initializers: the same weights twice.
    again = gl.LSTM(6, time_major=True, seed=7)
    again.build(x.shape)
    _close(again.get_weights(), ours.get_weights(), rtol=0.0, what="seeded weights")
    # Stateful, time-major: the batch is axis 1; the second call starts from the first's end.
    stateful = gl.GRU(4, stateful=True, time_major=True)
    first, second = stateful(x), stateful(x)
    ref = keras.layers.GRU(4, stateful=True)
    ref.build((2, 5, 4))
    ref.set_weights(stateful.get_weights())
    xb = np.transpose(x, (1, 0, 2))
    _close([first, second], [ref(xb), ref(xb)], what="stateful")


def test_rnn_dropout_seed_gives_reproducible_masks(gl):
    x, _ = _seq(False, batch=4, steps=6, features=8)

    def run(dropout_seed):
        layer = gl.LSTM(5, dropout=0.5, dropout_seed=dropout_seed, kernel_initializer="ones",
                        recurrent_initializer="zeros")
        return [np.asarray(layer(x, training=True)) for _ in range(2)]

    a, b, c = run([3, 4]), run([3, 4]), run([5, 6])
    _close(a, b, rtol=0.0, what="same dropout_seed")
    assert not np.allclose(a[0], c[0]) and not np.allclose(a[0], a[1])  # new mask per call
    inference = gl.LSTM(5, dropout=0.5, dropout_seed=[3, 4])
    assert rel_l2(inference(x), inference(x, training=False)) == 0.0


def test_rnn_planning_arguments_are_accepted_and_warned_once(gl, warnings_log):
    for _ in range(2):
        gl.LSTM(4, partials_dtype=tf.float16, available_memory_proportion_fwd=0.3,
                options={"availableMemoryProportion": 0.3}, implementation=1)
        gl.GRU(4, options_bwd={"partialsType": "half"})
        gl.LSTM(4, partials_dtype=tf.float32, available_memory_proportion_bwd=-1)  # defaults
    said = [r.getMessage() for r in warnings_log.records]
    for subject in ("PopnnLSTM(partials_dtype)", "PopnnLSTM(available_memory_proportion_fwd)",
                    "PopnnLSTM(options)", "PopnnLSTM(implementation)", "PopnnGRU(options_bwd)"):
        assert sum(subject in m for m in said) == 1, (subject, said)
    assert len(said) == 5, said
    assert all("has no effect on the emulated IPU" in m for m in said)
    with pytest.raises(ValueError, match="partials_dtype"):
        gl.LSTM(4, partials_dtype="int32")


# ---------------------------------------------------------------------------------- Dropout


def test_dropout_matches_keras_and_takes_graphcore_seeds(gl, warnings_log):
    x = np.random.default_rng(0).standard_normal((100, 100)).astype("float32")
    # No seed, or Keras's integer seed: keras.layers.Dropout's masks, call after call.
    for seed in (None, 11):
        keras.utils.set_random_seed(5)
        ours = gl.Dropout(0.3, seed=seed)
        keras.utils.set_random_seed(5)
        theirs = keras.layers.Dropout(0.3, seed=seed)
        for _ in range(2):
            _close(ours(x, training=True), theirs(x, training=True), rtol=0.0, what=str(seed))
        np.testing.assert_array_equal(ours(x, training=False), x)
    # Graphcore's pair: keep rate 1 - rate, kept values scaled by 1 / (1 - rate).
    ones = np.ones((200, 100), "float32")
    for rate in (0.1, 0.5, 0.9):
        out = np.asarray(gl.Dropout(rate, seed=[42, 42], ref=False)(ones, training=True))
        kept = out[out != 0]
        assert abs(kept.size / ones.size - (1 - rate)) < 0.02, (rate, kept.size)
        np.testing.assert_allclose(kept, 1 / (1 - rate), rtol=1e-6)
    first = gl.Dropout(0.5, seed=[42, 42])(x, training=True)
    _close(gl.Dropout(0.5, seed=np.array([42, 42]))(x, training=True), first, rtol=0.0)
    # noise_shape: one mask for every row.
    rows = np.asarray(gl.Dropout(0.5, noise_shape=(1, 100), seed=[1, 2])(ones, training=True))
    assert (rows == rows[:1]).all()
    assert sum("Dropout(ref)" in r.getMessage() for r in warnings_log.records) == 1
    with pytest.raises(ValueError, match=r"range \[0, 1\), but was 1"):
        gl.Dropout(1.0)
    with pytest.raises(ValueError, match="pair of integers"):
        gl.Dropout(0.5, seed=[1, 2, 3])


# ---------------------------------------------------------------------------------- norms


def _strided_order(channels: int, groups: int) -> np.ndarray:
    """Channel order that makes PopLibs' strided groups (c % groups) contiguous."""
    return np.array([g + groups * j for g in range(groups) for j in range(channels // groups)])


class _Reordered:
    """A layer applied to the channels in ``order``, its outputs put back in place."""

    def __init__(self, inner, order: np.ndarray) -> None:
        self.inner, self.order, self.inverse = inner, order, np.argsort(order)

    @property
    def trainable_variables(self):
        return self.inner.trainable_variables

    def __call__(self, x):
        return tf.gather(self.inner(tf.gather(x, self.order, axis=-1)), self.inverse, axis=-1)


def test_layer_norm_matches_keras(gl):
    x = np.random.default_rng(0).standard_normal((3, 4, 6)).astype("float32") * 3 + 1
    for axis in (-1, [1, 2]):
        ours = gl.LayerNorm(axis=axis, beta_initializer="random_normal",
                            gamma_initializer="random_normal")
        out, ref, grads, ref_grads = _match(ours, keras.layers.LayerNormalization(axis=axis), x)
        _close(out, ref, what=f"axis {axis}")
        _close(grads, ref_grads, what=f"axis {axis} gradients")


def test_group_and_instance_norm_match_keras_group_norm(gl):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 5, 5, 12)) * 2 + 1).astype("float32")
    init = {"beta_initializer": "random_normal", "gamma_initializer": "random_normal"}
    # Contiguous groups: keras.layers.GroupNormalization itself.
    ours = gl.GroupNorm(groups=3, strided_channel_grouping=False, **init)
    out, ref, grads, ref_grads = _match(ours, keras.layers.GroupNormalization(groups=3), x)
    _close(out, ref, what="contiguous")
    _close(grads, ref_grads, what="contiguous gradients")
    # Channels first (channels_axis=1).
    xc = np.transpose(x, (0, 3, 1, 2))
    ours = gl.GroupNorm(groups=4, channels_axis=1, strided_channel_grouping=False, **init)
    out, ref, _, _ = _match(ours, keras.layers.GroupNormalization(groups=4, axis=1), xc)
    _close(out, ref, what="channels first")
    # PopLibs' strided groups (the default): Keras's on channels reordered so that each
    # strided group is contiguous, with gamma and beta reordered alike.
    order = _strided_order(12, 3)
    inverse = np.argsort(order)
    ours = gl.GroupNorm(groups=3, **init)
    out, grads = _grads(ours, x)
    theirs = _Reordered(keras.layers.GroupNormalization(groups=3), order)
    theirs.inner.build(x.shape)
    theirs.inner.set_weights([w[order] for w in ours.get_weights()])
    ref, ref_grads = _grads(theirs, x)
    _close(out, ref, what="strided")
    _close(grads, [ref_grads[0]] + [tf.gather(g, inverse) for g in ref_grads[1:]],
           what="strided gradients")
    # Instance norm: one group per channel.
    ours = gl.InstanceNorm(**init)
    out, ref, grads, ref_grads = _match(ours, keras.layers.GroupNormalization(groups=12), x)
    _close(out, ref, what="instance")
    _close(grads, ref_grads, what="instance gradients")
    # Defaults: ones and zeros (an untrained layer only normalizes).
    plain = gl.GroupNorm(groups=2)
    plain.build(x.shape)
    np.testing.assert_array_equal(plain.gamma, np.ones(12))
    with pytest.raises(ValueError, match=r"number of groups \(5\) must divide .* \(12\)"):
        gl.GroupNorm(groups=5)(x)


# ---------------------------------------------------------------------------------- dense


@pytest.mark.parametrize("dimension,shape", [("input_columns", (8, 6)),
                                             ("input_rows_kernel_columns", (8, 6)),
                                             ("kernel_rows", (2, 4, 6))])
def test_serial_dense_matches_dense(gl, dimension, shape):
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    ours = gl.SerialDense(10 if dimension != "kernel_rows" else 12, serialization_factor=2,
                          serialization_dimension=dimension, activation="tanh",
                          bias_initializer="random_normal")
    theirs = keras.layers.Dense(ours.units, activation="tanh")
    out, ref, grads, ref_grads = _match(ours, theirs, x)
    _close(out, ref, what=dimension)
    _close(grads, ref_grads, what=f"{dimension} gradients")


def test_serial_dense_checks_its_arguments(gl):
    with pytest.raises(ValueError, match="serialization_dimension"):
        gl.SerialDense(4, 2, "rows")
    with pytest.raises(ValueError, match=r"\(3\) must divide units \(4\)"):
        gl.SerialDense(4, 3, "kernel_rows")
    with pytest.raises(ValueError, match=r"\(4\) must divide the inputs' last dimension \(6\)"):
        gl.SerialDense(4, 4, "input_rows_kernel_columns")(np.ones((2, 6), "float32"))
    with pytest.raises(ValueError, match=r"\(4\) must divide the inputs' rows \(6\)"):
        gl.SerialDense(4, 4, "input_columns")(np.ones((6, 2), "float32"))


def test_dense_is_keras_dense_and_takes_the_fp8_arguments(gl, warnings_log):
    x = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")
    ours = gl.Dense(5, activation="relu", kernel_scale=3, bias_initializer="random_normal")
    out, ref, grads, ref_grads = _match(ours, keras.layers.Dense(5, activation="relu"), x)
    _close(out, ref, what="dense")
    _close(grads, ref_grads, what="dense gradients")
    gl.Dense(5, kernel_scale=2)
    assert sum("Dense(kernel_scale)" in r.getMessage() for r in warnings_log.records) == 1
    with pytest.raises(ValueError, match=r"\[-32, 31\]"):
        gl.Dense(5, kernel_scale=40)


# ---------------------------------------------------------------------------------- identities


def test_identity_layers(gl, warnings_log):
    x = np.arange(6, dtype="float32").reshape(2, 3)
    for layer in (gl.RecomputationCheckpoint(), gl.AssumeEqualAcrossReplicas(inplace=True)):
        np.testing.assert_array_equal(layer(x), x)
        nested = layer([x, 2 * x])
        np.testing.assert_array_equal(nested[1], 2 * x)
    inp = keras.Input((3,))
    out = gl.AssumeEqualAcrossReplicas()(gl.RecomputationCheckpoint()(inp))
    assert tuple(out.shape) == (None, 3)
    assert sum("AssumeEqualAcrossReplicas(inplace)" in r.getMessage()
               for r in warnings_log.records) == 1


# ---------------------------------------------------------------------------------- config


def _all_layers_model(gl) -> keras.Model:
    ids = keras.Input((6,), dtype="int32", name="ids")
    h = gl.Embedding(30, 8, serialization_factor=2, name="embed")(ids)
    h = gl.LayerNorm(name="ln")(h)
    h = gl.GRU(8, return_sequences=True, reset_after=False, name="gru")(h)
    h = gl.Dropout(0.25, seed=[1, 2], name="drop")(h)
    h = gl.RecomputationCheckpoint(name="ckpt")(h)
    h = gl.LSTM(8, return_sequences=True, name="lstm")(h)
    h = keras.layers.Reshape((6, 4, 2))(h)
    h = gl.GroupNorm(groups=2, name="gn")(h)
    h = keras.layers.Activation("tanh")(h)  # else the next norm cancels gn's offset
    h = gl.InstanceNorm(name="inorm")(h)
    h = keras.layers.Flatten()(h)
    h = gl.AssumeEqualAcrossReplicas(name="equal")(h)
    h = gl.Dense(8, activation="tanh", name="dense")(h)
    out = gl.SerialDense(4, 2, "kernel_rows", name="head")(h)
    return keras.Model(ids, out, name="graphcore_layers")


def test_configs_round_trip_and_models_save(gl, tmp_path):
    keras.utils.set_random_seed(0)
    model = _all_layers_model(gl)
    for layer in model.layers:
        config = layer.get_config()
        assert type(layer).from_config(config).get_config() == config, layer.name
    ids = np.random.default_rng(0).integers(0, 30, (4, 6)).astype("int32")
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.get_layer("lstm")) is gl.LSTM
    _close(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0), rtol=0.0)


# ---------------------------------------------------------------------------------- IPUStrategy


@pytest.fixture(scope="module")
def strategy(ipu_system):
    return tf_ipu.IPUStrategy()


def _imdb(embedding, lstm, vocab: int = 200, maxlen: int = 10) -> keras.Model:
    """Graphcore's IMDB example's shape (Embedding(20000, 128), LSTM(128), Dense(1)), small."""
    return keras.Sequential([keras.Input((maxlen,), dtype="int32"), embedding(vocab, 8),
                             lstm(8), keras.layers.Dense(1, activation="sigmoid")])


def test_imdb_example_fit_under_ipu_strategy_matches_cpu(gl, strategy):
    rng = np.random.default_rng(0)
    x = rng.integers(1, 200, (64, 10)).astype("int32")
    y = (x[:, :5].mean(axis=1) > 100).astype("float32")
    keras.utils.set_random_seed(3)
    ref = _imdb(keras.layers.Embedding, keras.layers.LSTM)
    ref.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
    with strategy.scope():
        model = _imdb(gl.Embedding, gl.LSTM)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                      steps_per_execution=2)
    model.set_weights(ref.get_weights())  # Keras's weight layout, as Graphcore's
    h_ref = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    before = tf_ipu.get_runtime().client.counters().get("executions", 0)
    h_ipu = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    # 4 steps an epoch, 2 a device call: 4 calls (and the steps ran on the device).
    assert tf_ipu.get_runtime().client.counters().get("executions", 0) - before == 4
    for a, b in zip(h_ipu.history["loss"], h_ref.history["loss"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (h_ipu.history, h_ref.history)
    for w, w_ref, v in zip(model.get_weights(), ref.get_weights(), ref.weights, strict=True):
        assert rel_l2(w, w_ref) <= 1e-3, f"{v.path}: {rel_l2(w, w_ref)}"
    assert h_ipu.history["loss"][-1] < h_ipu.history["loss"][0]


def test_other_layers_under_ipu_strategy_match_cpu(gl, strategy):
    ids = np.random.default_rng(1).integers(0, 30, (8, 6)).astype("int32")
    y = np.random.default_rng(2).integers(0, 4, 8)
    keras.utils.set_random_seed(4)
    ref = _all_layers_model(gl)
    ref.get_layer("drop").rate = 0.0  # the device's random bits are XLA's, not TF's kernels'
    ref.compile(optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with strategy.scope():
        model = _all_layers_model(gl)
        model.get_layer("drop").rate = 0.0
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.set_weights(ref.get_weights())
    assert rel_l2(model.predict(ids, batch_size=8, verbose=0),
                  ref.predict(ids, batch_size=8, verbose=0)) <= 1e-5
    loss = model.train_on_batch(ids, y)
    ref_loss = ref.train_on_batch(ids, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for w, w_ref, v in zip(model.get_weights(), ref.get_weights(), ref.weights, strict=True):
        assert rel_l2(w, w_ref) <= 1e-4, f"{v.path}: {rel_l2(w, w_ref)}"
