"""``tf_ipu.models.HalfGroupNormalization``: group norm on FP16 activations with FP32 statistics
(PopART's GroupNormalization, popnn's group norm with FLOAT partials), against Keras's
GroupNormalization, which computes a float16 input in float32.

- Numerics: the output, the input's gradient and the weights' gradients match Keras's layer
  computed in float32 on the same FP16-representable input within FP16 rounding: 4 units of
  FP16's 2^-11 relative step, relative L2 (~2e-3; the output is one FP16 multiply-add of
  FP32-computed scale and shift, each rounded once to FP16; the gradients add a few FP16
  roundings), for channels-last and channels-first inputs.
- Precision: the output is float16, and every activation-sized tensor that the backward pass
  reads from the forward pass is float16 (Keras's layer keeps float32 ones; checked on the same
  graph analysis, so the check can fail).
- Float32: under a float32 policy the layer is Keras's (1e-6).
- The EfficientNet-GN builder uses it under a float16 policy only.
"""

from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ipu.models import HalfGroupNormalization

FP16_STEP = 2.0 ** -11


@pytest.fixture()
def float16_policy() -> Iterator[None]:
    """Layers made in the test compute in float16 (Keras's "float16" policy), restored after."""
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(policy)


def _fp16_steps(got: np.ndarray, want: np.ndarray) -> float:
    """Relative L2 distance of ``got`` from the reference ``want``, in units of FP16's step."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want)) / FP16_STEP


def _weighted(layer: keras.layers.Layer, channels: int, rng: np.random.Generator) -> keras.layers.Layer:
    layer.gamma.assign(rng.uniform(0.5, 1.5, channels).astype(np.float32))
    layer.beta.assign((0.1 * rng.standard_normal(channels)).astype(np.float32))
    return layer


def _run(layer: keras.layers.Layer, x: tf.Tensor, dy: np.ndarray) -> dict[str, np.ndarray]:
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float64) * dy)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma.value, layer.beta.value])
    return {"y": y.numpy(), "dx": dx.numpy(), "dgamma": dgamma.numpy(), "dbeta": dbeta.numpy()}


@pytest.mark.parametrize("shape,axis", [((4, 6, 6, 16), -1), ((4, 12, 5, 5), 1)])
def test_matches_keras_group_norm_in_float32_within_fp16_rounding(float16_policy, shape, axis) -> None:
    rng = np.random.default_rng(0)
    x16 = (rng.standard_normal(shape) * 3 + 1).astype(np.float16)
    dy = rng.standard_normal(shape)
    channels = shape[axis]
    # The reference: Keras's layer in float32 on the same (FP16-representable) values.
    reference = keras.layers.GroupNormalization(groups=4, axis=axis, epsilon=1e-3, dtype="float32")
    reference.build(shape)
    half = HalfGroupNormalization(groups=4, axis=axis, epsilon=1e-3)
    half.build(shape)
    assert half.compute_dtype == "float16"
    want = _run(_weighted(reference, channels, np.random.default_rng(1)), tf.constant(x16.astype(np.float32)), dy)
    got = _run(_weighted(half, channels, np.random.default_rng(1)), tf.constant(x16), dy)
    assert got["y"].dtype == np.float16 and got["dx"].dtype == np.float16
    for name in ("y", "dx", "dgamma", "dbeta"):
        assert _fp16_steps(got[name], want[name]) <= 4, (name, _fp16_steps(got[name], want[name]))


def _saved_from_forward(layer: keras.layers.Layer, shape: tuple[int, ...]) -> list[tuple[str, tf.DType]]:
    """The activation-sized tensors that the backward pass of ``layer`` reads from its forward
    pass: in the traced step, outputs of ops made before ``tape.gradient`` (the forward, the
    input excepted) read by ops made by it (the backward)."""
    forward: set[str] = set()

    @tf.function
    def step(x: tf.Tensor, dy: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        forward.update(op.name for op in tf.compat.v1.get_default_graph().get_operations())
        return tape.gradient(y, x, output_gradients=dy)

    spec = tf.TensorSpec(shape, tf.float16)
    graph = step.get_concrete_function(spec, spec).graph
    size = int(np.prod(shape))
    saved = set()
    for op in graph.get_operations():
        if op.name in forward:
            continue
        for t in op.inputs:
            if (t.op.name in forward and t.op.type != "Placeholder" and t.shape.is_fully_defined()
                    and t.shape.num_elements() == size):
                saved.add((t.name, t.dtype))
    return sorted(saved, key=lambda s: s[0])


def test_backward_reads_only_float16_activations(float16_policy) -> None:
    shape = (2, 8, 8, 16)
    half = HalfGroupNormalization(groups=4)
    keras_layer = keras.layers.GroupNormalization(groups=4)
    for layer in (half, keras_layer):
        layer.build(shape)
    ours, theirs = _saved_from_forward(half, shape), _saved_from_forward(keras_layer, shape)
    assert ours and all(dtype == tf.float16 for _, dtype in ours), ours
    # The same analysis finds Keras's layer keeping float32 copies (so the check above can fail).
    assert any(dtype == tf.float32 for _, dtype in theirs), theirs
    assert half(tf.zeros(shape, tf.float16)).dtype == tf.float16


def test_float32_policy_is_keras_group_norm() -> None:
    rng = np.random.default_rng(2)
    x = tf.constant((rng.standard_normal((3, 5, 5, 12)) * 2).astype(np.float32))
    dy = rng.standard_normal((3, 5, 5, 12))
    ours, theirs = HalfGroupNormalization(groups=3, epsilon=1e-3), keras.layers.GroupNormalization(groups=3)
    for layer in (ours, theirs):
        layer.build(x.shape)
        _weighted(layer, 12, np.random.default_rng(3))
    got, want = _run(ours, x, dy), _run(theirs, x, dy)
    for name in ("y", "dx", "dgamma", "dbeta"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert HalfGroupNormalization.from_config(ours.get_config()).get_config() == ours.get_config()


def test_efficientnet_gn_builder_uses_it_under_float16_only(float16_policy) -> None:
    from tf_ipu.models import efficientnet_gn

    def norms(model: keras.Model) -> set[type]:
        return {type(layer) for layer in model.layers if isinstance(layer, keras.layers.GroupNormalization)}

    half = efficientnet_gn("b0", input_size=32, classes=5, repeats=(1, 1, 0, 0, 0, 0, 0))
    assert norms(half) == {HalfGroupNormalization}
    keras.mixed_precision.set_global_policy("float32")
    full = efficientnet_gn("b0", input_size=32, classes=5, repeats=(1, 1, 0, 0, 0, 0, 0))
    assert norms(full) == {keras.layers.GroupNormalization}
