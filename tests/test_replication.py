"""Replication: Keras ``fit``/``evaluate``/``predict`` and ``strategy.run`` on R replicas.

Graphcore's semantics (tf_ipu/replication.py, docs/porting.md): ``batch_size`` is per
replica, replica r takes batches r, r+R, ...; the optimizer sums the replicas' gradients, so
R replicas at learning rate lr/R train as one device at batch R x batch_size and rate lr.
Reference: plain Keras on the CPU at that effective batch; weights within 1e-4 relative L2
(FP32), losses within 1e-4 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
from keras_util import attached_ipus

RNG = np.random.default_rng(3)
X = RNG.normal(size=(96, 6)).astype("float32")
Y = RNG.normal(size=(96, 2)).astype("float32")


def replicas(cfg, count: int):
    """The process's IPU system with ``count`` IPUs (one replica each) for the block."""
    return attached_ipus(cfg, count)


def _model():
    import keras

    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)])


def _distance(got, want) -> float:
    return max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, want, strict=True))


def _cpu(initial, lr: float, batch_size: int, epochs: int = 2):
    import keras

    model = _model()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    history = model.fit(X, Y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


@pytest.mark.parametrize("count", [2, 4])
def test_replicated_fit_trains_as_one_device_at_the_effective_batch(ipu_system, count, caplog):
    import logging

    import keras

    import tf_ipu

    initial = _model().get_weights()
    cpu, cpu_loss = _cpu(initial, 0.1, batch_size=4 * count)
    with replicas(ipu_system, count):
        strategy = tf_ipu.IPUStrategy()
        assert strategy.replication_factor == count
        assert strategy.num_replicas_in_sync == 1  # as Graphcore's IPUStrategy reports
        with strategy.scope():
            model = _model()
            model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.SGD(0.1 / count), loss="mse",
                          steps_per_execution=4)
            model.set_replication_options(replicated_metric_reduction_method="MEAN")
        with caplog.at_level(logging.INFO, logger="tf_ipu"):
            history = model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
        iterations = int(model.optimizer.iterations.numpy())
        report = [r for r in strategy.reports if f"replicas={count}" in r.name][-1]
    assert _distance(weights, cpu.get_weights()) <= 1e-4
    # The estimate is per IPU and charges the gradients' all-reduce over the IPU-Links.
    assert report.replicas == count and 0 < report.all_reduce_share < 1
    assert f"x {count} replicas on " in report.summary()
    assert iterations == int(cpu.optimizer.iterations.numpy()) == 2 * 96 // (4 * count)
    # The replicas' mean of each replica's mean loss is the loss over all their batches.
    np.testing.assert_allclose(history.history["loss"], cpu_loss, rtol=1e-4)
    assert any(f"effective batch {4 * count} = batch 4 x gradient accumulation 1 (sum) x "
               f"replicas {count}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("method, lr_factor", [("mean", 1.0), ("sum", 3.0)])
def test_replicas_with_gradient_accumulation(ipu_system, method, lr_factor):
    """2 replicas x 3 accumulated micro-batches of 4: 'mean' is one update of batch 24;
    'sum' is 3 times that update."""
    import keras

    import tf_ipu

    initial = _model().get_weights()
    cpu, _ = _cpu(initial, 0.06 * lr_factor, batch_size=24)
    with replicas(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            model = _model()
            model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.SGD(0.06 / 2), loss="mse",
                          steps_per_execution=6)
            model.set_gradient_accumulation_options(
                gradient_accumulation_steps_per_replica=3,
                gradient_accumulation_reduction_method=method)
        model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
    assert _distance(weights, cpu.get_weights()) <= 1e-4


@pytest.mark.parametrize("count", [2, 4])
def test_predict_returns_every_sample_in_dataset_order(ipu_system, count):

    import tf_ipu

    initial = _model().get_weights()
    cpu = _model()
    cpu.set_weights(initial)
    x = X[:30]  # 8 batches of 4, the last of 2: calls of 3 batches shared out among replicas
    want = cpu.predict(x, batch_size=4, verbose=0)
    with replicas(ipu_system, count):
        with tf_ipu.IPUStrategy().scope():
            model = _model()
            model.set_weights(initial)
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
        got = model.predict(x, batch_size=4, verbose=0)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method, want", [("NONE", 3.0), ("SUM", 5.0), ("MEAN", 2.5),
                                          ("LIST", [2.0, 3.0])])
def test_evaluate_reduces_metrics_across_replicas_as_asked(ipu_system, method, want):
    """Graphcore's example: x = 0, y = 1, 2, 3, 4 in batches of 1 on 2 replicas: replica 0
    takes y = 1, 3 (MAE 2), replica 1 takes y = 2, 4 (MAE 3)."""
    import keras

    import tf_ipu

    x = np.zeros((4, 1), np.float32)
    y = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    with replicas(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
                1, kernel_initializer="zeros", use_bias=False, trainable=False)])
            model.compile(loss="mae", steps_per_execution=2)
            if method == "LIST":  # the enum, as Graphcore's code spells it
                method = keras.ipu.ReplicatedMetricReductionMethod.LIST
            model.set_replication_options(replicated_metric_reduction_method=method)
        got = model.evaluate(x, y, batch_size=1, verbose=0)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6)


def test_batchnorm_statistics_stay_per_replica(ipu_system):
    """Replica 0 sees batches around 0, replica 1 batches around 5: replica 0's moving mean
    (the one host reads see, as on Graphcore) follows its own batches only."""
    import keras

    import tf_ipu

    rng = np.random.default_rng(1)
    batches = [rng.normal(loc=5.0 * (k % 2), size=(4, 3)).astype(np.float32) for k in range(8)]
    x = np.concatenate(batches)
    y = np.zeros((32, 3), np.float32)
    with replicas(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            bn = keras.layers.BatchNormalization(momentum=0.5)
            model = keras.Sequential([keras.Input((3,)), bn])
            model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", steps_per_execution=2)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        moving_mean = bn.moving_mean.numpy()
    own = np.zeros(3, np.float32)
    for b in batches[0::2]:  # replica 0's batches
        own = 0.5 * own + 0.5 * b.mean(axis=0)
    shared = np.zeros(3, np.float32)
    for b in batches:
        shared = 0.5 * shared + 0.5 * b.mean(axis=0)
    np.testing.assert_allclose(moving_mean, own, rtol=1e-5, atol=1e-6)
    assert np.abs(moving_mean - shared).max() > 0.5


def test_strategy_run_feeds_replicas_round_robin_and_all_reduces(ipu_system):
    """Replica r takes element r of the infeed; the replica context's all-reduce sums
    across replicas (Graphcore's cross-replica sum); the result is replica 0's."""
    import tensorflow as tf

    import tf_ipu

    data = tf.data.Dataset.from_tensor_slices(np.arange(8, dtype=np.float32).reshape(8, 1))
    with replicas(ipu_system, 4):
        strategy = tf_ipu.IPUStrategy()
        with strategy.scope():
            iterator = iter(data)

            def step(it):
                value = next(it)
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value), \
                    ctx.all_reduce(tf.distribute.ReduceOp.MEAN, value)

            total, mean = strategy.run(step, args=(iterator,))
            again, _ = strategy.run(step, args=(iterator,))
    assert float(total.numpy()[0]) == 0 + 1 + 2 + 3
    assert float(mean.numpy()[0]) == pytest.approx(1.5)
    assert float(again.numpy()[0]) == 4 + 5 + 6 + 7


def test_bad_replica_numbers_name_the_numbers_and_the_fix(ipu_system):

    import tf_ipu

    cfg = ipu_system
    cfg.auto_select_ipus = 16  # the test server has 8 IPUs
    try:
        with pytest.raises(tf_ipu.errors.InvalidArgumentError,
                           match=r"16 IPUs asked for .*hosts 8: ask for at most 8"):
            cfg.configure_ipu_system()
    finally:
        cfg.auto_select_ipus = 1
        cfg.configure_ipu_system()
    with replicas(cfg, 2):
        with tf_ipu.IPUStrategy().scope():
            model = _model()
            model.compile(optimizer="sgd", loss="mse", steps_per_execution=1)
        with pytest.raises(ValueError, match=r"steps_per_epoch=1 .* 2 replicas.*steps_per_epoch=2"):
            model.fit(X, Y, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
        with pytest.raises(ValueError, match=r"train_on_batch got 1 batch\(es\) for 2 replicas"):
            model.train_on_batch(X[:4], Y[:4])


def test_replicas_draw_dropout_masks_of_their_own(ipu_system):
    """Every replica holds a copy of Dropout's seed generator; each still draws its own masks
    (its seed is offset by its index), as Graphcore's replicas do from their own hardware
    generators: the same batch on 2 replicas gives 2 different outputs."""
    import keras
    import tensorflow as tf

    import tf_ipu

    with replicas(ipu_system, 2):
        strategy = tf_ipu.IPUStrategy()
        with strategy.scope():
            drop = keras.layers.Dropout(0.5, seed=7)
            ones = tf.ones([64])

            @tf.function
            def step():
                masked = drop(ones, training=True)
                ctx = tf.distribute.get_replica_context()
                both = ctx.all_reduce(tf.distribute.ReduceOp.SUM, masked)
                return masked, both

            masked, both = strategy.run(step)
    masked, both = masked.numpy(), both.numpy()
    other = both - masked  # replica 1's mask
    assert set(np.unique(masked)) <= {0.0, 2.0} and set(np.unique(other)) <= {0.0, 2.0}
    assert not np.array_equal(masked, other)
