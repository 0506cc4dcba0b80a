"""End to end: Keras fit/evaluate/predict under IPUStrategy against plain TF on CPU.

Tolerances (issue 2): per-epoch losses within 1e-4 relative; final weights within 1e-3
relative L2; one Adam step within 1e-4 per weight tensor; predictions within 1e-5 relative
L2. The emulator follows XLA's semantics, the CPU reference does not, so rounding differs.
"""

from __future__ import annotations

import logging
import math

import keras
import numpy as np
import pytest

import tf_ipu
from tests.keras_util import classification_data, mlp, rel_l2, small_cnn


@pytest.fixture(scope="module")
def strategy(ipu_system):
    return tf_ipu.IPUStrategy()


def _executions() -> int:
    return int(tf_ipu.get_runtime().client.counters().get("executions", 0))


def _pair(build, strategy, optimizer_fn, loss, steps_per_execution, seed=1, metrics=None):
    """The same model twice from the same initial weights: on CPU and under IPUStrategy."""
    keras.utils.set_random_seed(seed)
    ref = build()
    ref.compile(optimizer=optimizer_fn(), loss=loss, metrics=metrics)
    with strategy.scope():
        ipu = build()
        ipu.compile(
            optimizer=optimizer_fn(), loss=loss, metrics=metrics,
            steps_per_execution=steps_per_execution,
        )
    ipu.set_weights(ref.get_weights())
    return ref, ipu


def _sgd():
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


@pytest.mark.parametrize("build,shape", [(mlp, (16,)), (small_cnn, (8, 8, 4))],
                         ids=["mlp", "small_cnn"])
def test_fit_matches_cpu(strategy, build, shape):
    x, y = classification_data(100, shape)  # 100 = 6 batches of 16 + one of 4
    ref, ipu = _pair(build, strategy, _sgd, "sparse_categorical_crossentropy", 4,
                     metrics=["accuracy"])
    h_ref = ref.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    h_ipu = ipu.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    for epoch, (a, b) in enumerate(zip(h_ipu.history["loss"], h_ref.history["loss"], strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), f"epoch {epoch}: loss {a} vs CPU {b}"
    assert h_ipu.history["accuracy"] == pytest.approx(h_ref.history["accuracy"], abs=0.011)
    for w_ipu, w_ref, v in zip(ipu.get_weights(), ref.get_weights(), ref.weights, strict=True):
        assert rel_l2(w_ipu, w_ref) <= 1e-3, f"{v.path}: rel L2 {rel_l2(w_ipu, w_ref)}"
    # Training did something: the loss fell.
    assert h_ipu.history["loss"][-1] < h_ipu.history["loss"][0]


def test_adam_step_matches_cpu(strategy):
    x, y = classification_data(32, (16,))
    ref, ipu = _pair(mlp, strategy, lambda: keras.optimizers.Adam(1e-2),
                     "sparse_categorical_crossentropy", 1)
    ref.train_on_batch(x, y)
    ipu.train_on_batch(x, y)
    for w_ipu, w_ref, v in zip(ipu.get_weights(), ref.get_weights(), ref.weights, strict=True):
        assert rel_l2(w_ipu, w_ref) <= 1e-4, f"{v.path}: rel L2 {rel_l2(w_ipu, w_ref)}"
    ref_opt = [np.asarray(v) for v in ref.optimizer.variables]
    ipu_opt = [np.asarray(v) for v in ipu.optimizer.variables]
    for a, b in zip(ipu_opt, ref_opt, strict=True):
        assert rel_l2(a, b) <= 1e-4


def test_predict_and_evaluate_match_cpu(strategy):
    x, y = classification_data(50, (8, 8, 4), seed=3)
    ref, ipu = _pair(small_cnn, strategy, _sgd, "sparse_categorical_crossentropy", 4,
                     metrics=["accuracy"])
    p_ref = ref.predict(x, batch_size=8, verbose=0)
    p_ipu = ipu.predict(x, batch_size=8, verbose=0)  # 6 full batches + a batch of 2
    assert p_ipu.shape == p_ref.shape
    assert rel_l2(p_ipu, p_ref) <= 1e-5
    e_ref = ref.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    e_ipu = ipu.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert e_ipu["loss"] == pytest.approx(e_ref["loss"], rel=1e-5)
    assert e_ipu["accuracy"] == pytest.approx(e_ref["accuracy"], abs=1e-6)
    single = ipu.predict_on_batch(x[:8])
    assert rel_l2(single, p_ref[:8]) <= 1e-5


@pytest.mark.parametrize("n", [1, 4, 16])
def test_device_calls_per_epoch(strategy, n):
    steps = 10
    x, y = classification_data(16 * steps, (16,))
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      steps_per_execution=n)
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # compile outside count
    batches = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(batch)

    before = _executions()
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[Count()])
    calls = _executions() - before
    assert calls == 2 * math.ceil(steps / n)
    assert len(hist.history["loss"]) == 2
    # Callbacks run once per device call, as Keras does with steps_per_execution.
    assert len(batches) == 2 * math.ceil(steps / n)


def test_fewer_steps_than_steps_per_execution_run_only_those(strategy, caplog):
    """Graphcore's Keras lowers ``steps_per_execution`` to the steps a call is asked for,
    with a warning (graphcore/keras, keras/ipu/extensions/data_adapter.py): predict(steps=2)
    on a repeated dataset gives 2 batches of predictions in one device call (Keras 3 on the
    CPU would run 10 steps, 20 batches); evaluate(steps=2) and fit(steps_per_epoch=2) run 2
    steps, as the CPU does with one step per execution."""
    import tensorflow as tf

    x, y = classification_data(96, (16,), seed=11)  # 12 batches of 8
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True).repeat()
    ref, ipu = _pair(mlp, strategy, _sgd, "sparse_categorical_crossentropy", 10)
    with caplog.at_level(logging.WARNING, logger="tf_ipu"):
        before = _executions()
        got = ipu.predict(data.map(lambda a, b: a), steps=2, verbose=0)
        assert _executions() - before == 1
    assert got.shape == (16, 4)
    assert rel_l2(got, ref.predict(x[:16], verbose=0)) <= 1e-5
    lowered = [r.getMessage() for r in caplog.records if "lowered" in r.getMessage()]
    assert len(lowered) == 1, lowered
    assert f"{ipu.name}.predict: steps_per_execution is 10" in lowered[0]
    assert "only 2 step(s)" in lowered[0]
    assert ipu.steps_per_execution == 10  # the model's own, after the call
    lowered_fn = ipu.predict_function
    assert lowered_fn.steps_per_execution == 2

    e_ipu = ipu.evaluate(data, steps=2, verbose=0, return_dict=True)
    e_ref = ref.evaluate(data, steps=2, verbose=0, return_dict=True)
    assert e_ipu["loss"] == pytest.approx(e_ref["loss"], rel=1e-5)

    batches = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(batch)

    before = _executions()
    h_ipu = ipu.fit(data, steps_per_epoch=2, epochs=2, verbose=0, callbacks=[Count()])
    assert _executions() - before == 2  # one call of 2 steps per epoch
    assert batches == [1, 1]
    h_ref = ref.fit(data, steps_per_epoch=2, epochs=2, verbose=0)
    np.testing.assert_allclose(h_ipu.history["loss"], h_ref.history["loss"], rtol=1e-4)
    for a, b in zip(ipu.get_weights(), ref.get_weights(), strict=True):
        assert rel_l2(a, b) <= 1e-3
    # The full steps per execution again when the data has them; the lowered function (and
    # its compiled programs) is kept for the next call of 2 steps.
    full = ipu.predict(x, batch_size=8, verbose=0)
    assert ipu.predict_function.steps_per_execution == 10
    assert ipu.predict_function.siblings[2] is lowered_fn
    assert rel_l2(full, ref.predict(x, batch_size=8, verbose=0)) <= 1e-5


def test_host_reads_and_writes_reach_the_device(strategy, tmp_path):
    x, y = classification_data(64, (16,))
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      steps_per_execution=4)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # Host read after a device call: evaluate on the host copy agrees with device predict.
    w = model.get_weights()
    keras.utils.set_random_seed(0)
    cpu = mlp()
    cpu.set_weights(w)
    assert rel_l2(model.predict(x, verbose=0), cpu.predict(x, verbose=0)) <= 1e-5
    # Host write: zero the weights; the device must see it before its next call.
    model.set_weights([np.zeros_like(a) for a in w])
    p = model.predict(x, batch_size=16, verbose=0)
    np.testing.assert_allclose(p, np.full_like(p, 0.25), rtol=1e-6)
    # assign() of a single variable, and a learning-rate change between fits.
    model.set_weights(w)
    model.optimizer.learning_rate.assign(0.0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), w, strict=True):
        np.testing.assert_array_equal(a, b)  # lr 0: nothing moved
    # save_weights / load_weights round trip sees the device's last values.
    model.optimizer.learning_rate.assign(0.1)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    trained = model.get_weights()
    model.set_weights(w)
    model.load_weights(path)
    p_loaded = model.predict(x, verbose=0)
    cpu.set_weights(trained)
    assert rel_l2(p_loaded, cpu.predict(x, verbose=0)) <= 1e-5


def test_checkpoint_callback_sees_device_weights(strategy, tmp_path):
    x, y = classification_data(64, (16,))
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      steps_per_execution=2)
    path = str(tmp_path / "ckpt.weights.h5")
    cb = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    final = model.get_weights()
    keras.utils.set_random_seed(0)
    cpu = mlp()
    cpu.load_weights(path)
    for a, b in zip(cpu.get_weights(), final, strict=True):
        np.testing.assert_array_equal(a, b)


def test_unsupported_op_names_opcode_and_layer(strategy):
    cfg = tf_ipu.get_runtime().config
    old = cfg.debug.refuse_opcodes
    cfg.debug.refuse_opcodes = ("dot",)
    try:
        cfg.configure_ipu_system()
        with strategy.scope():
            model = mlp()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        x, y = classification_data(16, (16,))
        with pytest.raises(tf_ipu.errors.UnsupportedOpError) as info:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        msg = str(info.value)
        assert "dot" in msg and "dense_" in msg, msg
    finally:
        cfg.debug.refuse_opcodes = old
        cfg.configure_ipu_system()


def test_fault_injection_changes_losses(strategy):
    """The server does the arithmetic: perturbing one opcode changes what fit reports."""
    x, y = classification_data(64, (16,))

    def losses():
        keras.utils.set_random_seed(5)
        with strategy.scope():
            model = mlp()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                          steps_per_execution=4)
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]

    clean = losses()
    cfg = tf_ipu.get_runtime().config
    cfg.debug.fault_inject_opcode = "multiply"
    try:
        cfg.configure_ipu_system()
        faulty = losses()
    finally:
        cfg.debug.fault_inject_opcode = ""
        cfg.configure_ipu_system()
    assert clean == losses()  # repeatable without the fault
    assert all(abs(a - b) > 1e-6 * abs(b) for a, b in zip(faulty, clean, strict=True)), (faulty, clean)


def test_validation_data_and_sample_weights_match_cpu(strategy):
    x, y = classification_data(96, (16,), seed=7)
    sw = np.linspace(0.5, 1.5, 96).astype("float32")
    ref, ipu = _pair(mlp, strategy, _sgd, "sparse_categorical_crossentropy", 4,
                     metrics=["accuracy"])
    kw = dict(batch_size=16, epochs=2, shuffle=False, verbose=0,
              validation_data=(x[:40], y[:40]), sample_weight=sw)
    h_ref = ref.fit(x, y, **kw).history
    h_ipu = ipu.fit(x, y, **kw).history
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(h_ipu[key], h_ref[key], rtol=1e-4, err_msg=key)
    assert h_ipu["val_accuracy"] == pytest.approx(h_ref["val_accuracy"], abs=1e-6)


def test_out_of_memory_when_predict_compiles_names_tile_and_layer(strategy):
    """With 16 tiles, ~6 MB of weights fit a GC200's SRAM (16 x 624 KiB) but not a GC2's
    (16 x 256 KiB): predict fails at compile time with Poplar's message, then works."""
    cfg = tf_ipu.get_runtime().config
    x = np.random.default_rng(0).standard_normal((4, 1024)).astype("float32")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1024,)), keras.layers.Dense(1536, name="wide_dense")], name="wide"
        )
    try:
        cfg.ipu_model.version = "ipu1"
        cfg.ipu_model.tiles_per_ipu = 16
        cfg.configure_ipu_system()
        with pytest.raises(tf_ipu.errors.OutOfMemoryError) as info:
            model.predict(x, verbose=0)
        msg = str(info.value)
        assert "Out of memory on tile" in msg and "262144 bytes" in msg, msg
        assert "wide_dense" in msg, msg
        cfg.ipu_model.version = "ipu2"
        cfg.configure_ipu_system()
        out = model.predict(x, verbose=0)
        keras.utils.set_random_seed(0)
        np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-5, atol=1e-5)
        assert tf_ipu.get_runtime().reports[-1].tiles_per_ipu == 16
    finally:
        cfg.ipu_model.version = "ipu2"
        cfg.ipu_model.tiles_per_ipu = 0
        cfg.configure_ipu_system()
