"""``tf_ipu.models.HalfBatchNormalization``: batch norm on FP16 activations with FP32 statistics
(Graphcore's fused batch norm), against Keras's BatchNormalization, which computes a float16
input in float32.

- Numerics: the output, the input's gradient and the weights' gradients match Keras's layer
  (float64 on the CPU, from the same FP16 input) within FP16 rounding: 4 units of FP16's
  2^-11 relative step (the output is one FP16 multiply-add of FP32-computed scale and shift,
  each rounded once to FP16; the gradients add a few FP16 roundings more), relative L2.
- Moving statistics: updated as Keras's layer updates them (FP32, 1e-6).
- Memory: a training step of an FP16 CNN holds fewer bytes on its fullest tile with it than
  with Keras's layer (no FP32 copies of the activations kept for the backward pass).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ipu.models import HalfBatchNormalization, half_batch_norm

FP16_STEP = 2.0 ** -11


@pytest.fixture()
def float16_policy():
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float16")
    yield
    keras.mixed_precision.set_global_policy(before)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _run(layer: keras.layers.Layer, x: tf.Tensor, dy: np.ndarray) -> dict[str, np.ndarray]:
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(tf.cast(y, tf.float64) * dy)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma.value, layer.beta.value])
    return {"y": y.numpy(), "dx": dx.numpy(), "dgamma": dgamma.numpy(), "dbeta": dbeta.numpy(),
            "moving_mean": layer.moving_mean.numpy(), "moving_variance": layer.moving_variance.numpy()}


def test_matches_keras_batch_norm_within_fp16_rounding(float16_policy) -> None:
    rng = np.random.default_rng(0)
    x = tf.constant((rng.standard_normal((8, 6, 6, 16)) * 3 + 1).astype(np.float16))
    dy = rng.standard_normal((8, 6, 6, 16))
    gamma = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    beta = (0.1 * rng.standard_normal(16)).astype(np.float32)
    got = {}
    for cls in (keras.layers.BatchNormalization, HalfBatchNormalization):
        layer = cls()
        layer.build(x.shape)
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
        got[cls.__name__] = _run(layer, x, dy)
    want, half = got["BatchNormalization"], got["HalfBatchNormalization"]
    assert half["y"].dtype == np.float16
    for name in ("y", "dx", "dgamma", "dbeta"):
        assert _rel(half[name], want[name]) <= 4 * FP16_STEP, name
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(half[name], want[name], rtol=1e-6, atol=1e-7)
    # Inference reads the moving statistics, as Keras's layer does.
    inference = HalfBatchNormalization()
    inference.build(x.shape)
    reference = keras.layers.BatchNormalization()
    reference.build(x.shape)
    mean, variance = rng.standard_normal(16).astype(np.float32), rng.uniform(0.5, 2, 16).astype(np.float32)
    for layer in (inference, reference):
        layer.moving_mean.assign(mean)
        layer.moving_variance.assign(variance)
    assert _rel(inference(x, training=False).numpy(), reference(x, training=False).numpy()) <= 4 * FP16_STEP


def test_float32_inputs_are_keras_batch_norm() -> None:
    x = tf.constant(np.random.default_rng(1).standard_normal((4, 3, 3, 5)).astype(np.float32))
    a, b = HalfBatchNormalization(), keras.layers.BatchNormalization()
    np.testing.assert_array_equal(a(x, training=True).numpy(), b(x, training=True).numpy())


def test_fp16_training_step_holds_less_on_its_fullest_tile(float16_policy) -> None:
    import tf_ipu

    def cnn() -> keras.Model:
        inputs = keras.Input((32, 32, 16))
        y = inputs
        for i in range(3):
            y = keras.layers.Conv2D(32, 3, padding="same", name=f"conv{i}")(y)
            y = keras.layers.BatchNormalization(name=f"bn{i}")(y)
            y = keras.layers.ReLU()(y)
        y = keras.layers.GlobalAveragePooling2D()(y)
        return keras.Model(inputs, keras.layers.Dense(10, dtype="float32")(y))

    peaks = {}
    for name, model in (("keras", cnn()), ("half", half_batch_norm(cnn()))):
        assert sum(isinstance(layer, HalfBatchNormalization) for layer in model.layers) == (3 if name == "half" else 0)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        peaks[name] = tf_ipu.estimate(model, 32, training=True, ipu_version="ipu2", tiles_per_ipu=64).peak_tile_bytes
    assert peaks["half"] < 0.9 * peaks["keras"], peaks
