"""Gradient accumulation (Graphcore's ``model.set_gradient_accumulation_options``) on one IPU.

Reference: plain Keras on the CPU at the same effective batch. With "mean" (and
"running_mean"), 4 accumulated micro-batches of 8 make the update of one batch of 32, so the
weights match within 1e-4 relative L2 (FP32); "sum" adds the 4 gradients, 4 times the mean
update, so it matches the CPU run whose learning rate is 4 times larger.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

RNG = np.random.default_rng(0)
X = RNG.normal(size=(128, 6)).astype("float32")
Y = RNG.normal(size=(128, 2)).astype("float32")


def _model():
    import keras

    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)])


def _cpu_reference(initial, learning_rate: float, batch_size: int, optimizer: str = "sgd"):
    import keras

    model = _model()
    model.set_weights(initial)
    opt = (keras.optimizers.SGD(learning_rate) if optimizer == "sgd"
           else keras.optimizers.Adam(learning_rate))
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(X, Y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history["loss"]


def _distance(got, want) -> float:
    return max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("method, optimizer, cpu_lr_factor", [
    ("mean", "sgd", 1.0), ("running_mean", "sgd", 1.0), ("sum", "sgd", 4.0), ("mean", "adam", 1.0),
])
def test_accumulation_matches_the_cpu_at_the_same_effective_batch(ipu_system, caplog, method,
                                                                  optimizer, cpu_lr_factor):
    import keras

    import tf_ipu

    initial = _model().get_weights()
    lr = 0.05 if optimizer == "sgd" else 0.01
    want, _ = _cpu_reference(initial, lr * cpu_lr_factor, batch_size=32, optimizer=optimizer)
    with tf_ipu.IPUStrategy().scope():
        model = _model()
        model.set_weights(initial)
        opt = keras.optimizers.SGD(lr) if optimizer == "sgd" else keras.optimizers.Adam(lr)
        model.compile(optimizer=opt, loss="mse", steps_per_execution=8)
        model.set_gradient_accumulation_options(
            gradient_accumulation_steps_per_replica=4,
            gradient_accumulation_reduction_method=method)
    with caplog.at_level(logging.INFO, logger="tf_ipu"):
        model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _distance(model.get_weights(), want) <= 1e-4
    assert int(model.optimizer.iterations) == 8  # weight updates: 2 epochs x 16 steps / 4
    assert any(f"effective batch 32 = batch 8 x gradient accumulation 4 ({method}) x replicas 1"
               in r.getMessage() for r in caplog.records)


def test_bad_accumulation_numbers_say_which_number_to_change_to_what(ipu_system):
    import keras

    import tf_ipu

    with tf_ipu.IPUStrategy().scope():
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=6)
    with pytest.raises(ValueError, match="reduction_method must be one of 'sum', 'mean'"):
        model.set_gradient_accumulation_options(4, gradient_accumulation_reduction_method="max")
    with pytest.raises(ValueError, match="must be an int >= 1"):
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=0)
    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4)
    with pytest.raises(ValueError, match=r"steps_per_execution \(6\) must be a multiple of "
                       r"gradient_accumulation_steps_per_replica \(4\).*steps_per_execution=4 "
                       r"or 8, or set gradient_accumulation_steps_per_replica to one of 1, 2, 3, 6"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    with tf_ipu.IPUStrategy().scope():
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=8)
    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4)
    with pytest.raises(ValueError, match=r"this device call has 7 steps .* make the steps of "
                                         r"an epoch .* a multiple of 4"):
        model.fit(X[:120], Y[:120], batch_size=8, epochs=1, verbose=0)


def test_keras_own_accumulation_of_models_that_never_set_options_is_left_alone(ipu_system):
    import keras

    import tf_ipu  # noqa: F401  (the Keras integration is installed)

    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), loss="mse")
    model.fit(X[:32], Y[:32], batch_size=8, epochs=1, verbose=0)
    assert model.optimizer.gradient_accumulation_steps == 2


@pytest.mark.parametrize("method", ["sum", "mean", "running_mean"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "float16-sgd"])
def test_guard_k_steps_update_once_with_the_reduced_gradients(ipu_system, method, optimizer):
    """The guard of the accumulation built on Keras's private optimizer internals
    (``tf_ipu/accumulation.py``): behaviour only, no attribute names. After k = 3 steps of
    ``fit`` with ``set_gradient_accumulation_options(3, method)``, on the CPU, the weights
    equal those of the same optimizer applied ONCE to the sum ("sum") or the mean ("mean",
    "running_mean") of the k micro-batches' gradients, computed here with a GradientTape;
    after k - 1 steps nothing has moved. Tolerance: 1e-5 relative L2 (FP32; float16-sgd: a
    LossScaleOptimizer over FP16 activations, 2e-3). A failure names the Keras version: its
    internals changed under tf_ipu."""
    import keras
    import tensorflow as tf

    import tf_ipu  # noqa: F401  (Graphcore's model methods)

    k, batch = 3, 8
    make_optimizer = {
        "sgd": lambda: keras.optimizers.SGD(0.05), "float16-sgd": lambda: keras.optimizers.SGD(0.05),
        "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01)}[optimizer]
    policy = keras.mixed_precision.global_policy()
    if optimizer == "float16-sgd":
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        initial = _model().get_weights()
        model = _model()
        model.set_weights(initial)
        model.compile(optimizer=make_optimizer(), loss="mse")
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=k,
                                                gradient_accumulation_reduction_method=method)
        model.fit(X[:batch * (k - 1)], Y[:batch * (k - 1)], batch_size=batch, shuffle=False, verbose=0)
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), initial, strict=True))
        model.fit(X[batch * (k - 1):batch * k], Y[batch * (k - 1):batch * k], batch_size=batch,
                  shuffle=False, verbose=0)
        # The reference: one plain optimizer step on the reduced gradients.
        ref = _model()
        ref.set_weights(initial)
        grads = []
        for i in range(k):
            with tf.GradientTape() as tape:
                out = ref(X[i * batch:(i + 1) * batch], training=True)
                loss = tf.reduce_mean(tf.square(tf.cast(out, tf.float32) - Y[i * batch:(i + 1) * batch]))
            grads.append([tf.cast(g, tf.float32) for g in tape.gradient(loss, ref.trainable_variables)])
        reduced = [tf.add_n(gs) / (1.0 if method == "sum" else k) for gs in zip(*grads, strict=True)]
        reference_optimizer = make_optimizer()
        reference_optimizer.apply_gradients(zip(reduced, ref.trainable_variables, strict=True))
    finally:
        keras.mixed_precision.set_global_policy(policy)
    tol = 2e-3 if optimizer == "float16-sgd" else 1e-5
    why = (f"Keras {keras.__version__}: gradient accumulation ({method}, {optimizer}) no longer "
           f"behaves as tf_ipu/accumulation.py expects of Keras's optimizer internals")
    assert moved == 0.0, f"{why}: the weights moved before the k-th step ({moved:.2e})"
    got = _distance(model.get_weights(), ref.get_weights())
    assert got <= tol, f"{why}: {got:.2e} from one update with the {method} of the gradients"
