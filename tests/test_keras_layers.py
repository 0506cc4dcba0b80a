"""Layer coverage: every layer family issue 2 names, forward and backward, on the emulator
against plain TF on CPU (one optimizer step from identical weights, tolerance 1e-4 relative
L2 per weight tensor; predictions 1e-5)."""

from __future__ import annotations

import time

import keras
import numpy as np
import pytest

import tf_ipu
from tests.keras_util import rel_l2


def _text_model(dropout: float) -> keras.Model:
    inp = keras.Input((12,), dtype="int32")
    h = keras.layers.Embedding(50, 16, name="embed")(inp)
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.Dropout(dropout, name="drop")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(24, activation="gelu", name="dense_gelu")(h)
    out = keras.layers.Dense(5, name="logits")(h)
    out = keras.layers.Softmax(name="softmax")(out)
    return keras.Model(inp, out, name="text")


def _image_model() -> keras.Model:
    inp = keras.Input((10, 10, 3))
    # No bias before BatchNorm: its gradient is rounding noise, which Adam scales up.
    h = keras.layers.Conv2D(6, 3, strides=2, padding="valid", use_bias=False,
                            name="conv_strided")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="dw")(h)
    h = keras.layers.MaxPooling2D(2, strides=1, name="maxpool")(h)
    h = keras.layers.AveragePooling2D(2, name="avgpool")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    out = keras.layers.Dense(3, activation="sigmoid", name="head")(h)
    return keras.Model(inp, out, name="image")


CASES = {
    "embedding_layernorm_adamw_sparse_ce": (
        lambda: _text_model(0.0),
        lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
        "sparse_categorical_crossentropy",
        ["sparse_categorical_accuracy"],
        lambda rng: (rng.integers(0, 50, (16, 12)).astype("int32"), rng.integers(0, 5, 16)),
    ),
    "conv_bn_depthwise_pool_adam_binary_ce": (
        _image_model,
        lambda: keras.optimizers.Adam(1e-2),
        "binary_crossentropy",
        ["binary_accuracy"],
        lambda rng: (
            rng.standard_normal((16, 10, 10, 3)).astype("float32"),
            rng.integers(0, 2, (16, 3)).astype("float32"),
        ),
    ),
    "text_sgd_categorical_ce": (
        lambda: _text_model(0.0),
        lambda: keras.optimizers.SGD(0.1, momentum=0.5, nesterov=True),
        "categorical_crossentropy",
        ["categorical_accuracy"],
        lambda rng: (
            rng.integers(0, 50, (16, 12)).astype("int32"),
            np.eye(5, dtype="float32")[rng.integers(0, 5, 16)],
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layers_step_matches_cpu(ipu_system, case):
    build, opt, loss, metrics, data = CASES[case]
    x, y = data(np.random.default_rng(0))
    keras.utils.set_random_seed(2)
    ref = build()
    ref.compile(optimizer=opt(), loss=loss, metrics=metrics)
    strategy = tf_ipu.IPUStrategy()
    with strategy.scope():
        ipu = build()
        ipu.compile(optimizer=opt(), loss=loss, metrics=metrics, steps_per_execution=2)
    ipu.set_weights(ref.get_weights())
    np.testing.assert_allclose(
        rel_l2(ipu.predict(x, verbose=0), ref.predict(x, verbose=0)), 0.0, atol=1e-5
    )
    l_ref = ref.train_on_batch(x, y, return_dict=True)
    l_ipu = ipu.train_on_batch(x, y, return_dict=True)
    assert l_ipu["loss"] == pytest.approx(l_ref["loss"], rel=1e-5)
    for w_ipu, w_ref, v in zip(ipu.get_weights(), ref.get_weights(), ref.weights, strict=True):
        assert rel_l2(w_ipu, w_ref) <= 1e-4, f"{case} {v.path}: {rel_l2(w_ipu, w_ref)}"


def test_dropout_trains_and_is_random(ipu_system):
    """Dropout runs the RNG on the device: training losses differ from rate 0, inference
    (dropout off) matches the CPU exactly as without dropout."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (64, 12)).astype("int32")
    y = rng.integers(0, 5, 64)
    strategy = tf_ipu.IPUStrategy()
    losses = {}
    for rate in (0.0, 0.5):
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = _text_model(rate)
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                          steps_per_execution=4)
        hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        losses[rate] = hist.history["loss"]
        assert all(np.isfinite(losses[rate]))
        cpu = _text_model(rate)
        cpu.set_weights(model.get_weights())
        assert rel_l2(model.predict(x, verbose=0), cpu.predict(x, verbose=0)) <= 1e-5
    assert losses[0.5] != losses[0.0]


def test_unreachable_server_fails_fast(ipu_system):
    cfg = tf_ipu.IPUConfig()
    cfg.server_address = "127.0.0.1:9"  # discard port: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(tf_ipu.errors.DeviceUnavailableError) as info:
        cfg.configure_ipu_system()
    assert time.monotonic() - t0 < 10.0
    assert "127.0.0.1:9" in str(info.value)
    # The process's working connection is untouched.
    assert tf_ipu.get_runtime().client.address == ipu_system.server_address
    assert tf_ipu.get_runtime().client.healthy()
