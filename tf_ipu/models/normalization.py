"""Batch normalization that keeps FP16 activations in FP16, as the IPU's fused batch norm does.

    Keras's BatchNormalization (mixed_float16):   x16 -> cast -> x32 -> (x32 - mean) * ... -> cast -> y16
                                                   (FP32 copies of the activation, kept for the backward)
    HalfBatchNormalization:                         x16 -> y16 = x16 * scale16 + shift16
                                                   statistics in FP32: mean, var <- reduce(cast(x16))
                                                   (the cast is read once by each reduction, never kept)

Keras 3 upcasts a float16 input to float32 for the whole layer and casts the result back, so
a float16 network holds FP32 copies of its activations (and of ``x - mean``) for the backward
pass: double the bytes of the FP16 activations they come from. Graphcore's CNN applications
normalize FP16 activations with the fused batch norm (``tf.compat.v1.layers.
batch_normalization(fused=True)`` in the TF1 ResNet-50 of the MLPerf submissions; PopTorch's
``nn.BatchNorm2d`` on a ``.half()`` model), which the IPU runs as popnn's batch norm: the
activation stays FP16 and only the per-channel statistics are FP32. This layer writes that in
the model: the moments are FP32 reductions of the FP16 input (their gradient recomputes the
cast instead of keeping it), the per-channel scale and shift are computed in FP32 and applied
to the FP16 activation in FP16.

For inputs that are not float16 it is Keras's BatchNormalization. The bench's MLPerf ResNet-50
(``bench/bench_mlperf.py``) and the verdict table's FP16 ResNet-50 cases use it.

Example:
    >>> from tf_ipu.models import HalfBatchNormalization, half_batch_norm
    >>> model = half_batch_norm(keras.applications.ResNet50(weights=None))
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

__all__ = ["HalfBatchNormalization", "half_batch_norm"]


def _moments(x: tf.Tensor, axes: list[int]) -> tuple[tf.Tensor, tf.Tensor]:
    """FP32 mean and (biased) variance of the FP16 ``x`` over ``axes``; the gradient reads
    ``x`` again (a cast made again in the backward, not an FP32 copy kept for it)."""

    @tf.custom_gradient
    def moments(x: tf.Tensor) -> Any:
        x32 = tf.cast(x, tf.float32)
        mean = tf.reduce_mean(x32, axes)
        var = tf.maximum(tf.reduce_mean(tf.square(tf.cast(x, tf.float32)), axes) - tf.square(mean), 0.0)

        def grad(d_mean: tf.Tensor, d_var: tf.Tensor) -> tf.Tensor:
            count = tf.cast(tf.size(x) // tf.size(mean), tf.float32)
            dx = (d_mean + 2.0 * d_var * (tf.cast(x, tf.float32) - mean)) / count
            return tf.cast(dx, x.dtype)

        return (mean, var), grad

    return moments(x)


class HalfBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` that normalizes a float16 input in float16 with
    float32 statistics (see the module docstring); the same weights, arguments and moving
    statistics as Keras's layer. Masks and batch renormalization are not supported."""

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if inputs.dtype != tf.float16 or mask is not None or self.renorm:
            return super().call(inputs, training=training, mask=mask)
        axis = self.axis if isinstance(self.axis, int) else self.axis[0]
        axis = axis % len(inputs.shape)
        axes = [d for d in range(len(inputs.shape)) if d != axis]
        def f32(v: Any) -> tf.Tensor:  # a variable's stored value, never autocast to float16
            return tf.cast(v.value, tf.float32)

        if training and self.trainable:
            mean, var = _moments(inputs, axes)
            self.moving_mean.assign(f32(self.moving_mean) * self.momentum + mean * (1.0 - self.momentum))
            self.moving_variance.assign(f32(self.moving_variance) * self.momentum + var * (1.0 - self.momentum))
        else:
            mean, var = f32(self.moving_mean), f32(self.moving_variance)
        scale = tf.math.rsqrt(var + self.epsilon)
        if self.scale:
            scale = scale * f32(self.gamma)
        shift = -mean * scale
        if self.center:
            shift = shift + f32(self.beta)
        shape = [1] * len(inputs.shape)
        shape[axis] = -1
        return inputs * tf.reshape(tf.cast(scale, tf.float16), shape) + tf.reshape(tf.cast(shift, tf.float16), shape)


def half_batch_norm(model: keras.Model) -> keras.Model:
    """A copy of the functional ``model`` with every ``BatchNormalization`` replaced by a
    :class:`HalfBatchNormalization` of the same configuration and weights."""

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        if type(layer) is keras.layers.BatchNormalization:
            return HalfBatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    out = keras.models.clone_model(model, clone_function=clone)
    out.set_weights(model.get_weights())
    return out
