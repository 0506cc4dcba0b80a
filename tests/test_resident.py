"""Weights stay on the device: host reads fetch them on demand, host writes reach the device,
nothing crosses the wire that the host did not ask for, updates happen in place, and the
device loop holds the step once.

Tolerances as in the end-to-end tests: losses within 1e-4 relative, weights within 1e-3
relative L2 of the same training on CPU.
"""

from __future__ import annotations

import grpc
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ipu
from device_server.protocol import device_pb2, device_pb2_grpc
from tests.keras_util import classification_data, mlp, rel_l2, small_cnn
from tf_ipu.lowering.program import lower_function


@pytest.fixture(scope="module")
def strategy(ipu_system):
    return tf_ipu.IPUStrategy()


def _pair(strategy, spe, build=mlp, optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9)):
    keras.utils.set_random_seed(3)
    ref = build()
    ref.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy",
                steps_per_execution=spe)
    with strategy.scope():
        ipu = build()
        ipu.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy",
                    steps_per_execution=spe)
    ipu.set_weights(ref.get_weights())
    return ref, ipu


def _close(got, want, what):
    assert len(got) == len(want), what
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_l2(a, b) <= 1e-3, f"{what}[{k}]: rel L2 {rel_l2(a, b)}"


def _server(rt):
    return rt.client.counters()


class _KernelReads(keras.callbacks.Callback):
    """Reads a kernel in every on_train_batch_end (a host read between device calls)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.layers[0].kernel.numpy().copy())


@pytest.mark.parametrize("spe", [1, 8])
def test_every_host_read_sees_the_last_device_call(strategy, spe, tmp_path):
    x, y = classification_data(160, (16,), seed=11)  # 10 batches of 16
    ref, ipu = _pair(strategy, spe)
    fit = dict(batch_size=16, epochs=3, shuffle=False, verbose=0, validation_data=(x[:32], y[:32]))
    cb_ref, cb_ipu = _KernelReads(), _KernelReads()

    def callbacks(model, cb, tag):
        return [cb,
                keras.callbacks.ModelCheckpoint(str(tmp_path / f"{tag}.weights.h5"),
                                                save_weights_only=True),
                keras.callbacks.ModelCheckpoint(str(tmp_path / f"{tag}-b.keras"), save_freq=3),
                # val_loss falls, so "max" keeps epoch 0 as the best: training stops after
                # epoch 1 and the weights of epoch 0 come back (read, then written).
                keras.callbacks.EarlyStopping("val_loss", patience=1, restore_best_weights=True,
                                              mode="max")]

    h_ref = ref.fit(x, y, callbacks=callbacks(ref, cb_ref, "ref"), **fit).history
    h_ipu = ipu.fit(x, y, callbacks=callbacks(ipu, cb_ipu, "ipu"), **fit).history
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(h_ipu[key], h_ref[key], rtol=1e-4, err_msg=key)
    assert len(h_ipu["loss"]) == len(h_ref["loss"]) == 2  # EarlyStopping stopped both
    # A kernel read in on_train_batch_end, once per device call: the last call's value.
    assert len(cb_ipu.seen) == len(cb_ref.seen) == 2 * -(-10 // spe)
    _close(cb_ipu.seen, cb_ref.seen, "kernel in on_train_batch_end")
    # get_weights, a layer's kernel, after EarlyStopping restored the best weights.
    _close(ipu.get_weights(), ref.get_weights(), "get_weights")
    _close([ipu.layers[2].kernel.numpy()], [ref.layers[2].kernel.numpy()], "kernel.numpy()")
    # Checkpoints written by the callbacks (at epoch ends and every 3 batches).
    for tag_file in ("{}.weights.h5",):
        a, b = mlp(), mlp()
        a.load_weights(str(tmp_path / tag_file.format("ipu")))
        b.load_weights(str(tmp_path / tag_file.format("ref")))
        _close(a.get_weights(), b.get_weights(), "ModelCheckpoint weights")
    a = keras.models.load_model(str(tmp_path / "ipu-b.keras"))
    b = keras.models.load_model(str(tmp_path / "ref-b.keras"))
    _close(a.get_weights(), b.get_weights(), "ModelCheckpoint(save_freq=3) model")
    _close(a.optimizer.variables, b.optimizer.variables, "ModelCheckpoint optimizer state")
    # save_weights, model.save, evaluate after fit, a SavedModel export.
    ipu.save_weights(str(tmp_path / "w.weights.h5"))
    ipu.save(str(tmp_path / "m.keras"))
    c = mlp()
    c.load_weights(str(tmp_path / "w.weights.h5"))
    _close(c.get_weights(), ref.get_weights(), "save_weights")
    _close(keras.models.load_model(str(tmp_path / "m.keras")).get_weights(), ref.get_weights(),
           "model.save")
    e_ref = ref.evaluate(x, y, batch_size=16, verbose=0)
    e_ipu = ipu.evaluate(x, y, batch_size=16, verbose=0)
    assert e_ipu == pytest.approx(e_ref, rel=1e-4)
    ipu.export(str(tmp_path / "saved"))
    loaded = tf.saved_model.load(str(tmp_path / "saved"))
    served = loaded.serve(tf.constant(x[:8]))
    assert rel_l2(served.numpy(), ref.predict(x[:8], verbose=0)) <= 1e-3


def test_host_writes_reach_the_device_without_comparing_bytes(strategy):
    x, y = classification_data(64, (16,), seed=5)
    ref, ipu = _pair(strategy, 4, optimizer=lambda: keras.optimizers.SGD(0.1))
    rt = tf_ipu.get_runtime()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (1 + epoch))
    fit = dict(batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[schedule])
    before = rt.counters()
    h_ipu = ipu.fit(x, y, **fit).history
    h_ref = ref.fit(x, y, **fit).history
    np.testing.assert_allclose(h_ipu["loss"], h_ref["loss"], rtol=1e-4)
    np.testing.assert_allclose(h_ipu["learning_rate"], h_ref["learning_rate"], rtol=1e-6)
    # set_weights and assign() between fits reach the device.
    zeros = [np.zeros_like(w) for w in ref.get_weights()]
    ipu.set_weights(zeros)
    ref.set_weights(zeros)
    ipu.layers[0].kernel.assign(np.full((16, 32), 0.01, "float32"))
    ref.layers[0].kernel.assign(np.full((16, 32), 0.01, "float32"))
    ipu.optimizer.learning_rate.assign(0.5)
    ref.optimizer.learning_rate.assign(0.5)
    ipu.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    _close(ipu.get_weights(), ref.get_weights(), "after host writes")
    assert rt.counters()["host_bytes_compared"] == before["host_bytes_compared"]


def test_a_call_the_host_does_not_read_sends_no_variables_back(strategy):
    x, y = classification_data(16, (16,), seed=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256),
                                  keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.train_on_batch(x, y)  # compiles, uploads
    rt = tf_ipu.get_runtime()
    var_bytes = sum(v.numpy().nbytes for v in model.variables + model.optimizer.variables)
    host0, server0 = rt.counters(), _server(rt)
    for _ in range(3):
        model.train_on_batch(x, y)
    host1, server1 = rt.counters(), _server(rt)
    counters_reply = _server(rt)["bytes_out"] - server1["bytes_out"]  # what one GetCounters adds
    assert host1["device_calls"] - host0["device_calls"] == 3
    for key in ("host_bytes_compared", "variable_bytes_refreshed"):
        assert host1[key] == host0[key], key
    # Only what the host wrote goes up: train_on_batch resets the loss tracker (a few scalars).
    assert host1["variable_bytes_uploaded"] - host0["variable_bytes_uploaded"] < 256
    sent_back = server1["bytes_out"] - server0["bytes_out"] - counters_reply
    # Each reply: the loss and, per updated variable, dtype and dims without data.
    assert sent_back < 3 * 512, f"{sent_back} bytes came back for 3 calls ({var_bytes} B of state)"
    # Updated in place: no new buffers for the session's variables.
    assert server1["variable_buffers_allocated"] == server0["variable_buffers_allocated"]
    assert server1["variable_bytes_updated_in_place"] - server0["variable_bytes_updated_in_place"] \
        >= 3 * 16 * 256 * 4
    # The first host read fetches the device's values (and only once).
    kernel = model.layers[0].kernel.numpy()
    again = model.layers[0].kernel.numpy()
    np.testing.assert_array_equal(kernel, again)
    host2 = rt.counters()
    assert host2["variable_bytes_refreshed"] - host1["variable_bytes_refreshed"] == kernel.nbytes


def test_a_lost_session_names_the_step_the_host_holds(strategy, ipu_system):
    x, y = classification_data(32, (16,), seed=4)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      steps_per_execution=2)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # 2 steps an epoch: step 4 at the end
    held = [w.copy() for w in model.get_weights()]
    model.train_on_batch(x[:16], y[:16])  # step 5 stays on the device
    rt = tf_ipu.get_runtime()
    with grpc.insecure_channel(ipu_system.server_address) as channel:
        device_pb2_grpc.DeviceServiceStub(channel).CloseSession(
            device_pb2.SessionRef(session_id=rt.client.session_id), timeout=5)
    with pytest.raises(tf.errors.DataLossError, match=r"step 4 \(end of epoch 2\)"):
        model.train_on_batch(x[:16], y[:16])
    # From then on the host's copies (step 4) are the truth, and training goes on from them.
    _close(model.get_weights(), held, "host copies after the loss")
    model.train_on_batch(x[:16], y[:16])
    assert int(model.optimizer.iterations.numpy()) == 5


def test_weights_that_cannot_be_read_back_at_a_close_are_named_at_the_next_call(
        strategy, ipu_system, monkeypatch, caplog):
    """A reconfigure or shutdown reads the device-only values back first; if that fails, the
    error is logged, and the next device call raises (once) naming the variables and the step
    the host's copies hold, instead of training on from older weights without a word."""
    x, y = classification_data(32, (16,), seed=5)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      steps_per_execution=2)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # step 2 (end of epoch 1) on the host
    held = [w.copy() for w in model.get_weights()]
    model.train_on_batch(x[:16], y[:16])  # step 3 stays on the device
    rt = tf_ipu.get_runtime()

    def unreadable(keys, guarded=True):
        raise ConnectionError("the server went away")

    with monkeypatch.context() as m:
        m.setattr(rt, "_refresh_keys", unreadable)
        with caplog.at_level("ERROR", logger="tf_ipu"):
            rt._disconnect()  # what a new configuration or shutdown does
    assert "could not read the device's variables back" in caplog.text
    assert "step 2 (end of epoch 1)" in caplog.text
    with pytest.raises(tf.errors.DataLossError, match=r"could not be read back.*step 2 \(end of epoch 1\)"):
        model.train_on_batch(x[:16], y[:16])
    _close(model.get_weights(), held, "host copies after the failed read-back")
    model.train_on_batch(x[:16], y[:16])  # said once: training goes on from the host's copies

    # A new configuration raises at once, unless IPUConfig.device_connection.allow_stale_weights.
    for allowed in (False, True):
        model.train_on_batch(x[:16], y[:16])  # a newer value on the device again
        with monkeypatch.context() as m:
            m.setattr(rt, "_refresh_keys", unreadable)
            m.setattr(ipu_system.device_connection, "allow_stale_weights", allowed)
            rt._config_key = None  # a configuration that must reconnect
            if allowed:
                ipu_system.configure_ipu_system()
            else:
                with pytest.raises(tf_ipu.errors.DeviceStateLostError, match=r"could not be read back.*"
                                   r"The host holds the weights of step 2 \(end of epoch 1\)"):
                    ipu_system.configure_ipu_system()
        model.train_on_batch(x[:16], y[:16])  # then on from the host's copies, without a word more


@pytest.mark.parametrize("build,shape", [(mlp, (16,)), (small_cnn, (8, 8, 4))],
                         ids=["mlp", "small_cnn"])
def test_the_device_loop_holds_the_step_once(strategy, build, shape):
    x, y = classification_data(32, shape)
    with strategy.scope():
        model = build()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      steps_per_execution=8)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    (lowered, _), = model.train_function._programs.values()
    alone = lower_function(
        lambda a, b: model.train_step((a, b)),
        [tf.TensorSpec((4, *shape), tf.float32), tf.TensorSpec((4,), tf.int64)], "step",
    )

    assert work_instructions(lowered.module) <= 1.1 * work_instructions(alone.module), (
        work_instructions(lowered.module), work_instructions(alone.module))


def work_instructions(module) -> int:
    """Instructions that compute something: not parameters, tuples, tuple elements,
    constants, nor reshapes and copies that keep the shape (XLA's return-value plumbing,
    which the emulator forwards without running anything and a loop repeats per
    loop-carried variable)."""
    n = 0
    for comp in module.computations:
        by_id = {i.id: i for i in comp.instructions}
        for i in comp.instructions:
            if i.opcode in ("parameter", "get-tuple-element", "tuple", "constant"):
                continue
            if i.opcode in ("reshape", "copy", "bitcast") and len(i.operands) == 1 \
                    and by_id[i.operands[0]].shape == i.shape:
                continue
            n += 1
    return n


def test_donated_variables_are_updated_in_their_buffers(ipu_system):
    """Executable.run(args, donated): the fused update of each aliased weight writes into
    the parameter's array (the output *is* that array) and gives the same bits as a run
    without donation; nothing is written when nothing is donated."""
    from device_server.emulator import compile_module, get_target

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).standard_normal((8, 512)).astype("float32")
    y = np.arange(8, dtype="int64")
    model.train_on_batch(x, y)
    lowered = lower_function(lambda a, b: model.train_step((a, b)),
                             [tf.TensorSpec(x.shape, tf.float32), tf.TensorSpec(y.shape, tf.int64)],
                             "sgd_step")
    exe = compile_module(lowered.module, get_target("ipu2"))
    args = [x, y] + [v.numpy().copy() for v in lowered.variables] + \
        [c.numpy() for c in lowered.constants]
    kernels = [n for o, n in exe.aliases.items() if args[n].ndim == 2]
    assert len(kernels) == 2
    before = [a.copy() for a in args]
    plain = exe.run(args)
    for a, b in zip(args, before, strict=True):
        np.testing.assert_array_equal(a, b)  # nothing donated: the arguments are untouched
    donated = exe.run(args, sorted(exe.aliases.values()))
    for o, n in exe.aliases.items():
        np.testing.assert_array_equal(donated[o], plain[o])
        if n in kernels:
            assert donated[o] is args[n], f"parameter {n} was not updated in place"
    assert not np.array_equal(args[kernels[0]], before[kernels[0]])


def test_a_weight_gradient_is_computed_inside_its_update(ipu_system):
    """``w - lr * x.T @ dy``: the product is computed a block of rows at a time inside the
    fused update (never whole), with XLA's result."""
    from device_server.emulator import compile_module, get_target

    def update(x, dy, w):
        return w - 0.1 * tf.matmul(x, dy, transpose_a=True)

    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s).astype("float32") for s in ((8, 512), (8, 512), (512, 512))]
    specs = [tf.TensorSpec(a.shape, tf.float32) for a in args]
    lowered = lower_function(update, specs, "update")
    exe = compile_module(lowered.module, get_target("ipu2"))
    source = exe._program.source
    assert "_m(" not in source, source  # no whole product: it went into the fused step
    (got,) = exe.run(args)
    want = tf.function(update, jit_compile=True)(*args).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_infeed_prefetch_overlaps_a_slow_pipeline_with_the_same_results(strategy):
    """set_infeed_queue_options(prefetch_depth=1): the next call's batches are pulled while
    the device runs this call (shown by the pull and a device call running at the same
    time, not by a wall time), and training gives the same bits as without it."""
    import time

    x, y = classification_data(96, (16,), seed=9)

    def slow(a, b):
        time.sleep(0.02)  # a slow source: 20 ms a batch
        return a, b

    def data():
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        return ds.map(lambda a, b: tf.py_function(slow, [a, b], (tf.float32, tf.int64)))

    results = []
    for depth in (0, 1):
        ref, ipu = _pair(strategy, 2)
        ipu.set_infeed_queue_options(prefetch_depth=depth)
        history = ipu.fit(data().map(lambda a, b: (tf.ensure_shape(a, [None, 16]),
                                                   tf.ensure_shape(b, [None]))),
                          epochs=2, verbose=0).history
        results.append((history["loss"], ipu.get_weights(), ipu.train_function.pulls_overlapped))
    (loss0, w0, overlapped0), (loss1, w1, overlapped1) = results
    assert overlapped0 == 0 and overlapped1 >= 1, (overlapped0, overlapped1)
    assert loss0 == loss1
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="prefetch_depth must be an int >= 0"):
        ipu.set_infeed_queue_options(prefetch_depth=-1)


def test_tf_checkpoint_save_and_restore_cross_the_device(strategy, tmp_path):
    """tf.train.Checkpoint reads the device's values when it saves (the eager reads of its
    serialization) and its restore is a host write that the next device call sees."""
    x, y = classification_data(32, (16,), seed=6)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    model.train_on_batch(x, y)  # the device holds newer values than the host now
    ckpt = tf.train.Checkpoint(model=model)
    path = ckpt.write(str(tmp_path / "ckpt"))
    saved = [w.copy() for w in model.get_weights()]
    model.train_on_batch(x, y)
    assert any(rel_l2(a, b) > 1e-6 for a, b in zip(model.get_weights(), saved, strict=True))
    ckpt.read(path).assert_existing_objects_matched()
    keras.utils.set_random_seed(0)
    cpu = mlp()
    cpu.set_weights(saved)
    assert rel_l2(model.predict(x, verbose=0), cpu.predict(x, verbose=0)) <= 1e-5


def test_device_pull_feeds_the_loop_while_it_runs_with_the_same_results(strategy):
    """set_infeed_queue_options(device_pull=True): the device loop pulls each batch from an
    infeed during the call while the host pulls and pushes the next ones (shown by pulls
    made while the device call was in flight), with the same bits as the stacked infeed;
    an epoch's smaller last batch ends a call's feed and runs as its own program."""
    import time

    x, y = classification_data(120, (16,), seed=11)  # 7 batches of 16, then one of 8

    def slow(a, b):
        time.sleep(0.02)  # a slow source: 20 ms a batch
        return a, b

    def data():
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        ds = ds.map(lambda a, b: tf.py_function(slow, [a, b], (tf.float32, tf.int64)))
        return ds.map(lambda a, b: (tf.ensure_shape(a, [None, 16]), tf.ensure_shape(b, [None])))

    results = []
    for pull in (False, True):
        ref, ipu = _pair(strategy, 8)
        ipu.set_infeed_queue_options(device_pull=pull)
        history = ipu.fit(data(), epochs=2, verbose=0).history
        evaluated = ipu.evaluate(data(), verbose=0)
        results.append((history["loss"], evaluated, ipu.get_weights(),
                        ipu.train_function.pulls_overlapped, ipu.train_function.device_calls))
    (loss0, ev0, w0, overlapped0, calls0), (loss1, ev1, w1, overlapped1, calls1) = results
    assert overlapped0 == 0 and overlapped1 >= 2, (overlapped0, overlapped1)
    assert calls0 == calls1 == 4  # per epoch: 7 full batches in one call, the last in another
    assert loss0 == loss1 and ev0 == ev1
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)
