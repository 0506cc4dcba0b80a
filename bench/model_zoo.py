"""A sweep over real architectures: does every model XLA compiles run on the emulator, and agree?

Per model, at reduced sizes (a few seconds each), two functions are lowered with the
project's path (``tf_ipu.lowering.program.lower_function``: ``tf.function(jit_compile=True)``
-> HLO -> IR), compiled with ``device_server.emulator.compile_module`` for ipu2 and run with
``Executable.run`` on the host values of their arguments, variables and constants:

- ``forward``: ``model(x, training=False)``;
- ``train``: one ``model.train_step((x, y))``, the model compiled with ``SGD(1e-5,
  momentum=0.9)`` and sparse categorical cross-entropy on the logits (like
  ``tests/test_models.py``). From zero momentum the step leaves ``-learning_rate * gradient``
  in each momentum, so the momenta compare the gradients.

Models (``--list``):

- ``keras.applications`` (``weights=None``, ``classes=10``, ``classifier_activation=None``,
  the smallest input each allows, batch 2): DenseNet121, InceptionV3, InceptionResNetV2,
  NASNetMobile, ConvNeXtTiny, EfficientNetV2B0, MobileNetV3Small, MobileNet, VGG16,
  ResNet50V2 (Keras 3 has no RegNet);
- hand-built Keras models for other layer families: recurrent (stacked LSTM, bidirectional
  GRU, SimpleRNN, Embedding + masked GRU, Masking + BiLSTM + unrolled LSTM, ConvLSTM2D,
  TimeDistributed + LSTM, Conv1D + BiGRU under ``tf.nn.ctc_loss``); convolutional (Conv1D,
  Conv3D + pooling, a U-Net, separable/depthwise, strided/dilated/grouped/transposed
  convolutions and pools, ``channels_first``, a DCGAN generator, pixel shuffle and resizes);
  attention (a ViT block, a causal GPT decoder, Attention/AdditiveAttention/masked MHA,
  ``keras.ops.einsum`` + EinsumDense, FNet's FFT mixing); a ``tf.signal`` audio front end;
  a GNN (gather + unsorted segment sum/mean/max); ``tf.while_loop``/``cond``/``scan``/
  ``map_fn`` in a layer; two layers of assorted ops (cumsum, top_k, sort, bucketize,
  extract_patches, LRN, lgamma, int8 matmul, bincount, approx_max_k, ...); NMS
  (forward only); fake quantization (QAT); ``add_loss`` losses and regularizers;
  ``mixed_bfloat16``/``mixed_float16`` (loss-scaled) and pure bfloat16/float16 CNNs;
- every Keras optimizer on an MLP (Adam with accuracy metrics, AdamW, RMSprop, Adagrad,
  Adadelta, Adamax, Nadam, Lion, Adafactor, Ftrl, SGD with Nesterov and clipping);
- random models that keep their randomness (``random``): Dropout/SpatialDropout/
  GaussianNoise/..., augmentation layers, a transformer with attention dropout, categorical
  sampling. The emulator draws XLA's own bits (``kernels/rng.py``), so these compare like the
  rest; TF without XLA draws others, so they have no noise floor (the "tf" column is 0).

Left out, with the reason: bicubic, lanczos and antialiased resizes (no XLA kernel: XLA-FAIL),
``ResizeArea`` and nearest-neighbour resize in training (no gradient, no XLA gradient kernel),
RandomTranslation/Rotation/Zoom (``ImageProjectiveTransformV3``: no XLA kernel),
``tf.image.crop_and_resize`` (no XLA kernel); bilinear upscales XLA CPU itself gets wrong
(TF 2.21: 4 -> 12 gives ``[0, 0, 3.3, 6.7, 20, 13.3, ...]`` for ``[0, 10, 20, 30]``; 12 -> 20
too; the emulator and TF without XLA agree on the right values); RandomCrop in training (its
crop has a run-time size, which TF's XLA ResizeBilinear reads past: XLA leaves that padding
unspecified, XLA CPU reads the buffer's old content, the emulator zeros).

Weights: Keras' initializers, then biases, normalization offsets/scales and moving statistics
drawn at random (so inference-mode normalization is not the identity); Dropout rates set to 0
(except in the random models).

Printed per model and part: ``OK``, ``MISMATCH`` (the worst relative L2 error
``|emulator - xla| / |xla|`` over the outputs, the loss, the updated variables and the
gradients), ``UNSUPPORTED`` (the lowering's or the emulator's message), ``CRASH`` (any other
exception, with its message) or ``XLA-FAIL`` (XLA itself cannot compile it: out of scope);
then the emulator and XLA times (best of 2 after a warm-up) and their ratio. Tolerance: 1e-4,
or, where float32 itself is that far off, 10x the distance between XLA and TensorFlow without
XLA on the same inputs (the "tf" column; it is the float32 noise floor: deep random networks
amplify rounding differences, see ``tests/test_models.py``). Gradients that are zero in exact
arithmetic (a bias feeding a normalization, whose gradient is below 1e-4 of its kernel's or
scale's) are rounding noise and not compared.

``f32-noisy``: that floor is above 1e-3, so float32 decides nothing (at batch 2 and the
smallest inputs, BatchNormalization of 2-8 values per channel, ``E[x^2] - E[x]^2`` variances
and ReLU boundaries amplify rounding to O(1) gradient differences between any two float32
implementations). The model is then rebuilt in float64 (``keras.config.set_floatx``) and
compared again with tolerance 1e-7 (or 10x its own floor); that line decides the result.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/model_zoo.py [--only NAME ...] [--part forward|train]
    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/model_zoo.py --list
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

RTOL = 1e-4
RTOL_F64 = 1e-7        # the same comparison of a model built in float64
NOISY = 1e-3           # a float32 noise floor above this: float32 decides nothing, float64 does
LEARNING_RATE = 1e-5
NOISE_FACTOR = 10.0  # tolerance: max(RTOL, NOISE_FACTOR * |tf - xla|)


# -------------------------------------------------------------------------------- models


@dataclass
class Spec:
    title: str
    build: Callable[[], Any]                            # -> keras.Model (outputs: logits)
    inputs: Callable[[np.random.Generator], np.ndarray]
    labels: Callable[[np.random.Generator, np.ndarray], np.ndarray] | None = None  # default: (batch,) in [0, 10)
    float64: bool = True  # may be rebuilt in float64 when float32 is inconclusive (not the mixed policies)
    optimizer: Callable[[], Any] | None = None          # default SGD(LEARNING_RATE, momentum=0.9)
    loss: Callable[[], Any] | None = None               # default sparse categorical cross-entropy on logits
    metrics: Callable[[], list[Any]] | None = None
    random: bool = False  # keeps its dropout: compares XLA's random bits too
    parts: tuple[str, ...] = ("forward", "train")


def _image(size: int, batch: int = 2, channels: int = 3) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal((batch, size, size, channels)).astype(np.float32)


def _normal(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal(shape).astype(np.float32)


def _app(name: str, size: int, **kwargs: Any) -> Callable[[], Any]:
    def build() -> Any:
        import keras

        ctor = getattr(keras.applications, name)
        return ctor(weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None, **kwargs)

    return build


def _sequential(*layers: Any, input_shape: tuple[int, ...], dtype: str = "float32") -> Any:
    import keras

    inp = keras.Input(input_shape, dtype=dtype)
    x = inp
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


def _lstm() -> Any:
    from keras import layers as L

    return _sequential(L.LSTM(16, return_sequences=True), L.LSTM(16), L.Dense(10), input_shape=(12, 8))


def _gru_bidirectional() -> Any:
    from keras import layers as L

    return _sequential(L.Bidirectional(L.GRU(16, return_sequences=True)), L.GlobalAveragePooling1D(), L.Dense(10),
                       input_shape=(12, 8))


def _simple_rnn() -> Any:
    from keras import layers as L

    return _sequential(L.SimpleRNN(16, return_sequences=True), L.SimpleRNN(16, go_backwards=True), L.Dense(10),
                       input_shape=(10, 8))


def _text_gru() -> Any:
    from keras import layers as L

    return _sequential(L.Embedding(200, 16, mask_zero=True), L.GRU(16), L.Dense(10), input_shape=(16,),
                       dtype="int32")


def _text_ids(rng: np.random.Generator) -> np.ndarray:
    ids = rng.integers(1, 200, (4, 16)).astype(np.int32)
    for k, n in enumerate((16, 11, 5, 9)):  # right-padded sequences of different lengths
        ids[k, n:] = 0
    return ids


def _conv1d() -> Any:
    from keras import layers as L

    return _sequential(L.Conv1D(16, 5, activation="relu"), L.MaxPooling1D(2), L.Conv1D(16, 3, dilation_rate=2,
                       padding="causal", activation="relu"), L.BatchNormalization(), L.GlobalMaxPooling1D(),
                       L.Dense(10), input_shape=(64, 4))


def _conv3d() -> Any:
    from keras import layers as L

    return _sequential(L.Conv3D(8, 3, padding="same", activation="relu"), L.MaxPooling3D(2),
                       L.Conv3D(16, 3, strides=(1, 2, 2), activation="relu"), L.BatchNormalization(),
                       L.AveragePooling3D(2, padding="same"), L.GlobalAveragePooling3D(), L.Dense(10),
                       input_shape=(8, 16, 16, 2))


def _unet() -> Any:
    import keras
    from keras import layers as L

    inp = keras.Input((32, 32, 3))
    c1 = L.Conv2D(8, 3, padding="same", activation="relu")(inp)
    p1 = L.MaxPooling2D()(c1)
    c2 = L.Conv2D(16, 3, padding="same", activation="relu")(p1)
    p2 = L.MaxPooling2D()(c2)
    b = L.Conv2D(32, 3, padding="same", activation="relu")(p2)
    u2 = L.Conv2DTranspose(16, 3, strides=2, padding="same")(b)
    c3 = L.Conv2D(16, 3, padding="same", activation="relu")(L.Concatenate()([u2, c2]))
    u1 = L.UpSampling2D(interpolation="nearest")(c3)
    c4 = L.Conv2D(8, 3, padding="same", activation="relu")(L.Concatenate()([u1, c1]))
    u0 = L.UpSampling2D(interpolation="bilinear")(L.Conv2DTranspose(8, 2, strides=2)(p2))
    out = L.Conv2D(10, 1)(L.Add()([c4, L.Cropping2D(((1, 1), (0, 2)))(L.ZeroPadding2D(((0, 2), (1, 1)))(u0))]))
    return keras.Model(inp, out)


def _separable() -> Any:
    from keras import layers as L

    return _sequential(L.SeparableConv2D(16, 3, padding="same", depth_multiplier=2), L.BatchNormalization(),
                       L.ReLU(6.0), L.DepthwiseConv2D(3, strides=2, padding="same"), L.SeparableConv2D(
                           32, 3, dilation_rate=2, activation="swish"), L.GlobalAveragePooling2D(), L.Dense(10),
                       input_shape=(24, 24, 3))


def _vit() -> Any:
    import keras
    from keras import layers as L

    class PositionEmbedding(L.Layer):
        def build(self, shape: Any) -> None:
            self.pos = self.add_weight(shape=(1, shape[1], shape[2]), initializer="random_normal")

        def call(self, x: Any) -> Any:
            return x + self.pos

    inp = keras.Input((32, 32, 3))
    x = L.Conv2D(32, 8, strides=8)(inp)                         # 4x4 patches of 8x8
    x = L.Reshape((16, 32))(x)
    x = PositionEmbedding()(x)
    for _ in range(2):
        h = L.LayerNormalization(epsilon=1e-6)(x)
        h = L.MultiHeadAttention(4, 8)(h, h)
        x = L.Add()([x, h])
        h = L.LayerNormalization(epsilon=1e-6)(x)
        h = L.Dense(64, activation="gelu")(h)
        h = L.Dense(32)(h)
        x = L.Add()([x, h])
    x = L.LayerNormalization(epsilon=1e-6)(x)
    out = L.Dense(10)(L.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out)


def _gpt() -> Any:
    import keras
    from keras import layers as L

    inp = keras.Input((16,), dtype="int32")
    x = L.Embedding(100, 32)(inp)
    positions = L.Embedding(16, 32)(keras.ops.arange(16)[None, :])
    x = x + positions
    for _ in range(2):
        h = L.LayerNormalization()(x)
        h = L.MultiHeadAttention(4, 8)(h, h, use_causal_mask=True)
        x = x + h
        h = L.LayerNormalization()(x)
        x = x + L.Dense(32)(L.Dense(64, activation=keras.activations.gelu)(h))
    out = L.Dense(10)(L.LayerNormalization()(x))           # per-token logits
    return keras.Model(inp, out)


def _audio() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class LogMel(L.Layer):
        def call(self, wave: Any) -> Any:
            stft = tf.signal.stft(wave, frame_length=256, frame_step=128, fft_length=256)
            power = tf.math.square(tf.math.abs(stft))
            mel = tf.signal.linear_to_mel_weight_matrix(32, 129, 8000, 20.0, 4000.0)
            return tf.math.log(tf.tensordot(power, mel, 1) + 1e-6)[..., None]

    inp = keras.Input((4000,))
    x = LogMel()(inp)
    x = L.Conv2D(8, 3, activation="relu")(x)
    x = L.MaxPooling2D()(x)
    x = L.Conv2D(16, 3, activation="relu")(x)
    return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(x)))


def _einsum() -> Any:
    import keras
    from keras import layers as L

    class Bilinear(L.Layer):
        def build(self, shape: Any) -> None:
            self.w = self.add_weight(shape=(4, shape[-1], shape[-1]), initializer="glorot_uniform")

        def call(self, x: Any) -> Any:
            scores = keras.ops.einsum("bid,hde,bje->bhij", x, self.w, x) / 4.0
            attn = keras.ops.softmax(scores, axis=-1)
            return keras.ops.einsum("bhij,bjd->bid", attn, x) + keras.ops.einsum("bid,hde->bie", x, self.w)

    inp = keras.Input((10, 16))
    x = Bilinear()(inp)
    x = L.EinsumDense("btd,de->bte", output_shape=(10, 24), bias_axes="e")(x)
    return keras.Model(inp, L.Dense(10)(L.Flatten()(x)))


def _time_distributed() -> Any:
    from keras import layers as L

    return _sequential(L.TimeDistributed(L.Conv2D(8, 3, strides=2, activation="relu")),
                       L.TimeDistributed(L.GlobalAveragePooling2D()), L.LSTM(16), L.Dense(10),
                       input_shape=(6, 16, 16, 3))


def _conv_lstm() -> Any:
    from keras import layers as L

    return _sequential(L.ConvLSTM2D(8, 3, padding="same", return_sequences=True), L.BatchNormalization(),
                       L.ConvLSTM2D(8, 3), L.GlobalAveragePooling2D(), L.Dense(10), input_shape=(5, 12, 12, 2))


def _misc_cnn() -> Any:
    import keras
    from keras import layers as L

    norm = L.Normalization(mean=[0.5, 0.4, 0.3], variance=[0.2, 0.3, 0.4])
    return _sequential(L.Resizing(24, 24, interpolation="bilinear"), norm, L.ZeroPadding2D(((1, 2), (2, 1))),
                       L.Conv2D(16, 3), L.GroupNormalization(4), L.PReLU(), L.Cropping2D(((1, 0), (0, 1))),
                       L.AveragePooling2D(3, strides=2, padding="same"), L.Conv2D(16, 3, activation="elu"),
                       L.LayerNormalization(), L.LeakyReLU(0.1), L.UnitNormalization(), L.Flatten(),
                       L.Dense(32, activation=keras.activations.hard_swish), L.Dense(10),
                       input_shape=(20, 20, 3))


def _mixed(policy: str) -> Callable[[], Any]:
    def build() -> Any:
        import keras
        from keras import layers as L

        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            model = _sequential(L.Conv2D(16, 3, activation="relu"), L.BatchNormalization(), L.MaxPooling2D(),
                                L.Conv2D(32, 3, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(32),
                                L.LayerNormalization(), L.Dense(10, dtype="float32"), input_shape=(16, 16, 3))
        finally:
            keras.config.set_dtype_policy(previous)
        return model

    return build


def _mlp() -> Any:
    from keras import layers as L

    return _sequential(L.Dense(32, activation="relu"), L.BatchNormalization(), L.Dense(32, activation="tanh"),
                       L.Dense(10), input_shape=(16,))


def _optimizer(name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        import keras

        return getattr(keras.optimizers, name)(learning_rate=1e-3, **kwargs)

    return make


def _gnn() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    edges = np.random.default_rng(1).integers(0, 12, (2, 40))

    class MessagePassing(L.Layer):
        def __init__(self, units: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.dense = L.Dense(units)

        def call(self, h: Any) -> Any:  # h: (batch, nodes, features)
            src, dst = tf.constant(edges[0]), tf.constant(edges[1])
            msg = tf.gather(self.dense(h), src, axis=1)               # (batch, edges, units)
            t = tf.transpose(msg, (1, 0, 2))
            total = tf.math.unsorted_segment_sum(t, dst, 12)
            mean = tf.math.unsorted_segment_mean(t, dst, 12)
            most = tf.math.unsorted_segment_max(t, dst, 12)
            most = tf.where(tf.math.is_finite(most), most, tf.zeros_like(most))
            return tf.nn.relu(tf.transpose(total + mean + most, (1, 0, 2)))

    inp = keras.Input((12, 8))
    x = MessagePassing(16)(MessagePassing(16)(inp))
    pooled = keras.ops.concatenate([keras.ops.mean(x, 1), keras.ops.max(x, 1)], -1)
    return keras.Model(inp, L.Dense(10)(pooled))


def _super_resolution() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class PixelShuffle(L.Layer):
        def call(self, x: Any) -> Any:
            return tf.nn.depth_to_space(x, 2)

    class SpaceToDepth(L.Layer):
        def call(self, x: Any) -> Any:
            return tf.nn.space_to_depth(x, 2)

    inp = keras.Input((16, 16, 3))
    x = L.Conv2D(16, 3, padding="same", activation="relu")(inp)
    x = PixelShuffle()(L.Conv2D(12, 3, padding="same")(x))                         # 32x32x3
    # (no XLA kernel: ResizeBicubic, ScaleAndTranslate (lanczos, antialias), ResizeNearestNeighborGrad;
    # no gradient: ResizeArea; XLA CPU itself miscomputes some bilinear upscales, e.g. 12 -> 20, 4 -> 12)
    x = L.Resizing(24, 24, interpolation="bilinear")(x)
    x = L.Resizing(24, 24, interpolation="bilinear")(SpaceToDepth()(x))          # 12x12x12 -> 24x24
    x = L.Resizing(16, 16, interpolation="bilinear", crop_to_aspect_ratio=True)(x)
    x = L.Conv2D(16, 3, activation="relu")(x)
    return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(x)))


def _attention_layers() -> Any:
    import keras
    from keras import layers as L

    inp = keras.Input((10, 16))
    q = L.Dense(16)(inp)
    mask = keras.ops.cast(keras.ops.tril(keras.ops.ones((10, 10))), "bool")[None]
    a = L.Attention(use_scale=True, score_mode="concat")([q, inp])
    b = L.AdditiveAttention()([q, inp])
    c = L.MultiHeadAttention(2, 8, value_dim=4, output_shape=16)(q, inp, attention_mask=mask)
    d = L.Softmax(axis=-1)(L.Dense(10)(inp))
    x = L.Concatenate()([a, b, c, d])
    x = L.Permute((2, 1))(x)
    x = L.Dense(10, activation="gelu")(x)                                       # token mixing (MLP-Mixer)
    return keras.Model(inp, L.Dense(10)(L.Flatten()(L.Permute((2, 1))(x))))


def _extra_losses() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class AuxLosses(L.Layer):
        def call(self, x: Any) -> Any:
            p = tf.nn.sigmoid(x)
            self.add_loss(1e-2 * keras.losses.Huber()(tf.zeros_like(x), x))
            self.add_loss(1e-2 * keras.losses.BinaryFocalCrossentropy(from_logits=True)(tf.ones_like(x), x))
            self.add_loss(1e-2 * keras.losses.KLDivergence()(tf.nn.softmax(x * 0.5), tf.nn.softmax(x)))
            self.add_loss(1e-2 * keras.losses.CosineSimilarity()(tf.ones_like(x), x))
            self.add_loss(1e-2 * keras.losses.LogCosh()(tf.zeros_like(x), x))
            self.add_loss(1e-2 * keras.losses.Poisson()(tf.ones_like(p), p))
            self.add_loss(1e-2 * keras.losses.CategoricalHinge()(tf.one_hot(tf.zeros(tf.shape(x)[:1], tf.int32), 10),
                                                                  x))
            return x

    inp = keras.Input((16,))
    x = L.Dense(32, activation="selu")(inp)
    x = L.Dense(10, kernel_regularizer=keras.regularizers.L1L2(1e-3, 1e-3), activity_regularizer="l2")(x)
    return keras.Model(inp, AuxLosses()(x))


def _ops_misc() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class Misc(L.Layer):
        def call(self, x: Any) -> Any:  # x: (batch, 12, 8)
            c = tf.math.cumsum(x, axis=1) + tf.math.cumsum(x, axis=1, reverse=True, exclusive=True)
            c = c + 0.1 * tf.math.cumprod(tf.nn.sigmoid(x), axis=1)
            top, idx = tf.math.top_k(x[:, :, 0], k=4)
            srt = tf.sort(x, axis=1, direction="DESCENDING")
            order = tf.argsort(x[:, :, 1], axis=1, stable=True)
            g = tf.gather(x, order, axis=1, batch_dims=1)
            arg = tf.one_hot(tf.argmax(x, axis=-1), 8)
            rolled = tf.roll(x, shift=3, axis=1)
            rev = tf.reverse_sequence(x, tf.constant([12, 5, 7, 9][: 4]), seq_axis=1, batch_axis=0)
            lse = tf.math.reduce_logsumexp(x, axis=-1, keepdims=True)
            std = tf.math.reduce_std(x, axis=1, keepdims=True)
            band = tf.linalg.band_part(tf.ones((12, 12)), -1, 0)
            causal = tf.einsum("ij,bjd->bid", band, x)
            norm = tf.linalg.norm(x, axis=-1, keepdims=True)
            clipped = tf.clip_by_value(x, -0.5, 0.5) + tf.clip_by_norm(x, 1.0, axes=[-1])
            bucket = tf.cast(tf.raw_ops.Bucketize(input=x, boundaries=[-1.0, 0.0, 1.0]), tf.float32)
            tiled = tf.tile(tf.reduce_mean(x, 1, keepdims=True), [1, 12, 1])
            sel = tf.where(x > 0, x, 0.1 * tf.square(x))
            extra = tf.reduce_sum(top, -1)[:, None, None] + tf.cast(tf.reduce_sum(idx), tf.float32) * 1e-3
            return tf.concat([c, srt, g, arg, rolled, rev, lse + std + norm, causal, clipped, bucket, tiled, sel],
                             -1) + extra

    inp = keras.Input((12, 8))
    return keras.Model(inp, L.Dense(10)(L.Flatten()(Misc()(L.Dense(8)(inp)))))


def _transposed_convs() -> Any:
    import keras
    from keras import layers as L

    inp = keras.Input((8, 8, 8, 2))
    x = L.Conv3DTranspose(4, 3, strides=2, padding="same")(inp)
    x = L.ZeroPadding3D(1)(L.UpSampling3D(1)(x))
    x = L.Conv3D(4, 3, strides=2, activation="relu")(x)                       # (8, 8, 8, 4)
    y = L.Reshape((64, 32))(x)
    y = L.Conv1DTranspose(8, 5, strides=2, dilation_rate=1, padding="valid")(y)
    y = L.UpSampling1D(2)(L.Cropping1D((1, 2))(y))
    y = L.AveragePooling1D(4)(L.Conv1D(8, 3, strides=2, padding="same", groups=2)(y))
    return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(y)))


def _dcgan_generator() -> Any:
    from keras import layers as L

    return _sequential(L.Dense(4 * 4 * 32, use_bias=False), L.BatchNormalization(), L.LeakyReLU(0.2),
                       L.Reshape((4, 4, 32)), L.Conv2DTranspose(16, 4, strides=2, padding="same", use_bias=False),
                       L.BatchNormalization(), L.LeakyReLU(0.2), L.Conv2DTranspose(3, 4, strides=2, padding="same",
                                                                                   activation="tanh"),
                       L.Conv2D(8, 3, strides=2, padding="same"), L.LeakyReLU(0.2), L.Flatten(), L.Dense(10),
                       input_shape=(16,))


def _fnet() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class FourierMixing(L.Layer):
        def call(self, x: Any) -> Any:
            return tf.math.real(tf.signal.fft2d(tf.cast(x, tf.complex64)))

    class SpectralFilter(L.Layer):
        def call(self, x: Any) -> Any:
            f = tf.signal.rfft(tf.transpose(x, (0, 2, 1)))
            return tf.transpose(tf.signal.irfft(f * tf.cast(tf.range(9) < 5, tf.complex64)), (0, 2, 1))

    inp = keras.Input((16, 32))
    x = inp
    for _ in range(2):
        x = L.LayerNormalization()(x + FourierMixing()(x))
        x = L.LayerNormalization()(x + L.Dense(32)(L.Dense(64, activation="gelu")(x)))
    x = x + SpectralFilter()(x)
    return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(x)))


def _fake_quant() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class FakeQuant(L.Layer):
        def build(self, shape: Any) -> None:
            self.lo = self.add_weight(shape=(), initializer=keras.initializers.Constant(-1.0))
            self.hi = self.add_weight(shape=(), initializer=keras.initializers.Constant(1.0))

        def call(self, x: Any) -> Any:
            return tf.quantization.fake_quant_with_min_max_vars(x, self.lo, self.hi, num_bits=8)

    class FakeQuantChannels(L.Layer):
        def call(self, x: Any) -> Any:
            return tf.quantization.fake_quant_with_min_max_args(x, -2.0, 2.0, num_bits=4, narrow_range=True)

    inp = keras.Input((12, 12, 3))
    x = FakeQuant()(inp)
    x = FakeQuantChannels()(L.Conv2D(8, 3, activation="relu")(x))
    return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(FakeQuant()(x))))


def _pure_policy(policy: str) -> Callable[[], Any]:
    def build() -> Any:
        from keras import layers as L

        return _sequential(L.Conv2D(8, 3, activation="relu", dtype=policy), L.BatchNormalization(dtype=policy),
                           L.GlobalAveragePooling2D(dtype=policy), L.Dense(16, activation="gelu", dtype=policy),
                           L.LayerNormalization(dtype=policy), L.Dense(10, dtype="float32"),
                           input_shape=(12, 12, 3), dtype=policy)

    return build


def _bilstm_masked() -> Any:
    import keras
    from keras import layers as L

    inp = keras.Input((10, 8))
    x = L.Masking(0.0)(inp)
    x = L.Bidirectional(L.LSTM(12, return_sequences=True), merge_mode="sum")(x)
    seq, h, c = L.LSTM(12, return_sequences=True, return_state=True, unroll=True)(x)
    g = L.GRU(12, reset_after=False, activation="relu", recurrent_activation="hard_sigmoid")(seq)
    return keras.Model(inp, L.Dense(10)(L.Concatenate()([h, c, g])))


def _masked_sequences(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((4, 10, 8)).astype(np.float32)
    for k, n in enumerate((10, 7, 3, 8)):
        x[k, n:] = 0.0
    return x


def _ctc() -> Any:
    from keras import layers as L

    return _sequential(L.Conv1D(16, 3, padding="same", activation="relu"), L.Bidirectional(L.GRU(8,
                       return_sequences=True)), L.Dense(6), input_shape=(20, 4))


def _ctc_labels(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    labels = rng.integers(1, 5, (x.shape[0], 6)).astype(np.int32)
    labels[1, 4:] = 0
    labels[2, 2:] = 0
    return labels


def _ctc_loss() -> Any:
    import keras
    import tensorflow as tf

    class CTC(keras.losses.Loss):
        def call(self, y_true: Any, y_pred: Any) -> Any:
            y_true = tf.cast(y_true, tf.int32)
            label_length = tf.reduce_sum(tf.cast(y_true > 0, tf.int32), -1)
            logit_length = tf.fill(tf.shape(y_pred)[:1], tf.shape(y_pred)[1])
            return tf.nn.ctc_loss(y_true, y_pred, label_length, logit_length, logits_time_major=False,
                                  blank_index=0)

    return CTC()


def _metrics() -> list[Any]:
    import keras

    return [keras.metrics.SparseCategoricalAccuracy(), keras.metrics.SparseTopKCategoricalAccuracy(3)]


def _dropout() -> Any:
    from keras import layers as L

    return _sequential(L.Conv2D(8, 3, activation="relu"), L.SpatialDropout2D(0.2), L.GaussianNoise(0.1),
                       L.Conv2D(16, 3), L.GlobalAveragePooling2D(), L.Dropout(0.5), L.GaussianDropout(0.2),
                       L.AlphaDropout(0.1), L.Dense(10), input_shape=(12, 12, 3))


def _augmentation() -> Any:
    from keras import layers as L

    # RandomTranslation/Rotation/Zoom: ImageProjectiveTransformV3, which XLA cannot compile.
    # RandomCrop: its crop has a run-time size and TF's XLA ResizeBilinear then reads past it
    # (its sampling uses the bound); XLA leaves that padding unspecified and differs from the
    # emulator there (XLA: the buffer's old content, the emulator: zeros). Not compared.
    return _sequential(L.RandomFlip(), L.RandomContrast(0.2), L.RandomBrightness(0.1),
                       L.RandomGrayscale(0.5), L.Conv2D(8, 3, activation="relu"),
                       L.GlobalAveragePooling2D(), L.Dense(10), input_shape=(16, 16, 3))


def _transformer_dropout() -> Any:
    import keras
    from keras import layers as L

    inp = keras.Input((16,), dtype="int32")
    x = L.Embedding(100, 32)(inp)
    h = L.MultiHeadAttention(4, 8, dropout=0.1)(x, x)
    x = L.LayerNormalization()(x + L.Dropout(0.1)(h))
    h = L.Dropout(0.1)(L.Dense(32)(L.Dense(64, activation="gelu")(x)))
    x = L.LayerNormalization()(x + h)
    return keras.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(x)))


def _control_flow() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class Refine(L.Layer):
        def build(self, shape: Any) -> None:
            self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="orthogonal")

        def call(self, x: Any) -> Any:  # x: (batch, time, features)
            def cond(i: Any, h: Any) -> Any:  # a data-dependent trip count, at most 5
                return tf.reduce_mean(tf.abs(h)) > 0.05

            def body(i: Any, h: Any) -> Any:
                return i + 1, 0.5 * tf.tanh(tf.einsum("btf,fg->btg", h, self.w))

            _, h = tf.while_loop(cond, body, (0, x), maximum_iterations=5)
            h = tf.cond(tf.reduce_sum(x) > 0, lambda: h * 2.0, lambda: h - 1.0)
            s = tf.scan(lambda a, t: 0.9 * a + t, tf.transpose(h, (1, 0, 2)))
            m = tf.map_fn(lambda row: tf.reduce_max(row, 0), h)
            return tf.transpose(s, (1, 0, 2)) + m[:, None, :]

    inp = keras.Input((6, 8))
    return keras.Model(inp, L.Dense(10)(L.Flatten()(Refine()(L.Dense(8)(inp)))))


def _ops_misc2() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class Misc2(L.Layer):
        def call(self, x: Any) -> Any:  # x: (batch, 8, 8, 4)
            patches = tf.image.extract_patches(x, [1, 3, 3, 1], [1, 2, 2, 1], [1, 1, 1, 1], "SAME")  # (b,4,4,36)
            lrn = tf.nn.local_response_normalization(x, depth_radius=2)
            sp = tf.nn.softplus(x)
            special = tf.math.lgamma(sp + 1.0) + tf.math.digamma(sp + 1.0) + tf.math.erfinv(tf.tanh(x) * 0.9)
            special += tf.math.xlogy(sp, sp + 1.0) + tf.math.log_sigmoid(x) + tf.math.bessel_i0e(x)
            prod = tf.reduce_prod(tf.sigmoid(x) + 0.5, axis=[1, 2])
            q = tf.cast(tf.clip_by_value(tf.round(x * 20.0), -127, 127), tf.int8)
            imat = tf.cast(tf.linalg.matmul(tf.reshape(q, (-1, 8, 32)), tf.reshape(q, (-1, 32, 8)),
                                            output_type=tf.int32), tf.float32) * 1e-4
            ints = tf.cast(tf.math.floormod(tf.cast(q, tf.int32), 7) - tf.math.floordiv(tf.cast(q, tf.int32), 5),
                           tf.float32)
            bits = tf.cast(tf.bitwise.bitwise_xor(tf.cast(q, tf.int32), 0x55) & 0x0F, tf.float32)
            counts = tf.raw_ops.DenseBincount(input=tf.reshape(tf.clip_by_value(tf.cast(q, tf.int32), 0, 9), (-1, 256)),
                                              size=10, weights=tf.zeros([0]))
            amin = tf.cast(tf.argmin(x, axis=-1), tf.float32)
            anyp = tf.cast(tf.reduce_any(x > 2.0, axis=-1), tf.float32)
            top = tf.math.approx_max_k(tf.reshape(x, (-1, 256)), 5)[0]
            parts = (patches, lrn, special, prod, imat, ints, bits, counts, amin, anyp, top)
            sizes = (576, 256, 256, 4, 64, 256, 256, 10, 64, 64, 5)
            flat = [tf.reshape(t, (-1, n)) for t, n in zip(parts, sizes, strict=True)]
            return tf.concat(flat, -1)

    inp = keras.Input((8, 8, 4))
    return keras.Model(inp, L.Dense(10)(Misc2()(L.Conv2D(4, 1)(inp))))


def _detection() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class Detect(L.Layer):
        def call(self, x: Any) -> Any:  # x: (batch, 16 anchors, 5): box deltas + score logit
            boxes = tf.concat([tf.sigmoid(x[..., :2]) * 0.5, tf.sigmoid(x[..., :2]) * 0.5 + 0.1
                               + 0.4 * tf.sigmoid(x[..., 2:4])], -1)
            scores = tf.sigmoid(x[..., 4])
            idx, valid = tf.image.non_max_suppression_padded(boxes, scores, 6, iou_threshold=0.5,
                                                             score_threshold=0.2, pad_to_max_output_size=True)
            picked = tf.gather(scores, idx, batch_dims=1) * tf.cast(tf.sequence_mask(valid, 6), tf.float32)
            # (tf.image.crop_and_resize: CropAndResize has no XLA kernel)
            return tf.concat([picked, tf.cast(valid, tf.float32)[:, None]], -1)

    inp = keras.Input((16, 5))
    return keras.Model(inp, L.Dense(10)(Detect()(L.Dense(5)(inp))))


def _categorical() -> Any:
    import keras
    import tensorflow as tf
    from keras import layers as L

    class Sample(L.Layer):
        def build(self, shape: Any) -> None:
            self.seed = self.add_weight(shape=(2,), dtype="int32", initializer="ones", trainable=False)

        def call(self, logits: Any, training: bool = False) -> Any:
            draws = tf.random.stateless_categorical(logits, 8, self.seed)
            gumbel = -tf.math.log(-tf.math.log(tf.random.stateless_uniform(tf.shape(logits), self.seed + 1,
                                                                             1e-6, 1.0)))
            soft = tf.nn.softmax((logits + gumbel) / 0.5)
            return soft + tf.reduce_mean(tf.one_hot(draws, 10), 1)

    inp = keras.Input((16,))
    return keras.Model(inp, Sample()(L.Dense(10)(inp)))


def _conv_zoo() -> Any:
    import keras
    from keras import layers as L

    inp = keras.Input((17, 19, 6))
    a = L.Conv2D(8, (2, 4), strides=(3, 2), padding="same")(inp)                        # even kernel, same
    b = L.Conv2D(8, 3, dilation_rate=(2, 3), padding="same", groups=2)(inp)
    c = L.DepthwiseConv2D((3, 2), strides=2, depth_multiplier=3, padding="valid")(inp)
    d = L.Conv2DTranspose(8, (3, 4), strides=(2, 3), padding="valid", output_padding=(1, 2))(a)
    e = L.Conv2DTranspose(8, 3, dilation_rate=2, padding="valid")(inp)
    f = L.MaxPooling2D((3, 2), strides=(2, 3), padding="same")(inp)
    g = L.AveragePooling2D(4, strides=1, padding="same")(inp)
    h = L.Conv1D(8, 5, strides=3, padding="same")(L.Reshape((17 * 19, 6))(inp))
    i = L.Conv3D(4, (2, 3, 1), strides=(1, 2, 2), padding="same", groups=2)(L.Reshape((17, 19, 3, 2))(inp))
    # (x3 bilinear upsampling: XLA CPU itself is wrong, e.g. [0, 10, 20, 30] -> ..., 6.67, 20, 13.3, ...)
    j = L.UpSampling2D((2, 4), interpolation="bilinear")(L.MaxPooling2D(4)(inp))
    k = L.MaxPooling3D((2, 2, 3), strides=(1, 2, 2), padding="same")(L.Reshape((17, 19, 6, 1))(inp))
    outs = [L.GlobalAveragePooling2D()(t) for t in (a, b, c, d, e, f, g, j)]
    outs += [L.GlobalMaxPooling1D()(h), L.GlobalAveragePooling3D()(i), L.GlobalMaxPooling3D()(k)]
    return keras.Model(inp, L.Dense(10)(L.Concatenate()(outs)))


def _channels_first() -> Any:
    from keras import layers as L

    f = "channels_first"
    return _sequential(L.Conv2D(8, 3, padding="same", data_format=f), L.BatchNormalization(axis=1),
                       L.ReLU(), L.MaxPooling2D(2, data_format=f), L.DepthwiseConv2D(3, data_format=f),
                       L.Conv2DTranspose(8, 2, strides=2, data_format=f), L.AveragePooling2D(2, data_format=f),
                       L.UpSampling2D(2, data_format=f), L.GlobalAveragePooling2D(data_format=f), L.Dense(10),
                       input_shape=(3, 16, 16))


def _per_token_labels(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    return rng.integers(0, 10, x.shape[:2]).astype(np.int32)


def _per_pixel_labels(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    return rng.integers(0, 10, x.shape[:3]).astype(np.int32)


MODELS: dict[str, Spec] = {
    "densenet121": Spec("DenseNet121 32x32", _app("DenseNet121", 32), _image(32)),
    "inception_v3": Spec("InceptionV3 75x75", _app("InceptionV3", 75), _image(75)),
    "inception_resnet_v2": Spec("InceptionResNetV2 75x75", _app("InceptionResNetV2", 75), _image(75)),
    "nasnet_mobile": Spec("NASNetMobile 32x32", _app("NASNetMobile", 32), _image(32)),
    "convnext_tiny": Spec("ConvNeXtTiny 32x32", _app("ConvNeXtTiny", 32), _image(32)),
    "efficientnet_v2_b0": Spec("EfficientNetV2B0 32x32", _app("EfficientNetV2B0", 32), _image(32)),
    "mobilenet_v3_small": Spec("MobileNetV3Small 32x32", _app("MobileNetV3Small", 32), _image(32)),
    "mobilenet": Spec("MobileNet (v1) 32x32", _app("MobileNet", 32), _image(32)),
    "vgg16": Spec("VGG16 32x32", _app("VGG16", 32), _image(32)),
    "resnet50_v2": Spec("ResNet50V2 32x32", _app("ResNet50V2", 32), _image(32)),
    "lstm": Spec("LSTM x2 (return_sequences)", _lstm, _normal(4, 12, 8)),
    "gru_bidirectional": Spec("Bidirectional GRU", _gru_bidirectional, _normal(4, 12, 8)),
    "simple_rnn": Spec("SimpleRNN x2 (go_backwards)", _simple_rnn, _normal(4, 10, 8)),
    "text_gru": Spec("Embedding(mask_zero) + GRU", _text_gru, _text_ids),
    "conv1d": Spec("Conv1D + GlobalMaxPooling1D", _conv1d, _normal(4, 64, 4)),
    "conv3d": Spec("Conv3D + MaxPooling3D", _conv3d, _normal(2, 8, 16, 16, 2)),
    "unet": Spec("U-Net (Conv2DTranspose, UpSampling2D)", _unet, _image(32), _per_pixel_labels),
    "separable": Spec("SeparableConv2D + DepthwiseConv2D", _separable, _image(24)),
    "vit": Spec("ViT block (MHA, LayerNorm, GELU)", _vit, _image(32)),
    "gpt": Spec("GPT decoder (causal MHA)", _gpt, lambda rng: rng.integers(0, 100, (4, 16)).astype(np.int32),
                _per_token_labels),
    "audio": Spec("tf.signal STFT + log-mel + CNN", _audio, _normal(2, 4000)),
    "einsum": Spec("keras.ops.einsum + EinsumDense", _einsum, _normal(4, 10, 16)),
    "time_distributed": Spec("TimeDistributed(Conv2D) + LSTM", _time_distributed, _normal(2, 6, 16, 16, 3)),
    "conv_lstm": Spec("ConvLSTM2D", _conv_lstm, _normal(2, 5, 12, 12, 2)),
    "misc_cnn": Spec("Resizing/Normalization/GroupNorm/PReLU...", _misc_cnn, _image(20)),
    "mixed_bfloat16": Spec("CNN, mixed_bfloat16 policy", _mixed("mixed_bfloat16"), _image(16),
                           float64=False),
    "mixed_float16": Spec("CNN, mixed_float16 (loss scaling)", _mixed("mixed_float16"), _image(16),
                          float64=False),
    "opt_adam": Spec("MLP + Adam (+ accuracy metrics)", _mlp, _normal(8, 16), optimizer=_optimizer("Adam"),
                     metrics=_metrics),
    "opt_adamw": Spec("MLP + AdamW (amsgrad, clipnorm)", _mlp, _normal(8, 16),
                      optimizer=_optimizer("AdamW", amsgrad=True, clipnorm=1.0)),
    "opt_rmsprop": Spec("MLP + RMSprop (centered, momentum)", _mlp, _normal(8, 16),
                        optimizer=_optimizer("RMSprop", centered=True, momentum=0.5)),
    "opt_adagrad": Spec("MLP + Adagrad", _mlp, _normal(8, 16), optimizer=_optimizer("Adagrad")),
    "opt_adadelta": Spec("MLP + Adadelta", _mlp, _normal(8, 16), optimizer=_optimizer("Adadelta")),
    "opt_adamax": Spec("MLP + Adamax", _mlp, _normal(8, 16), optimizer=_optimizer("Adamax")),
    "opt_nadam": Spec("MLP + Nadam", _mlp, _normal(8, 16), optimizer=_optimizer("Nadam")),
    "opt_lion": Spec("MLP + Lion", _mlp, _normal(8, 16), optimizer=_optimizer("Lion")),
    "opt_adafactor": Spec("MLP + Adafactor", _mlp, _normal(8, 16), optimizer=_optimizer("Adafactor")),
    "opt_ftrl": Spec("MLP + Ftrl", _mlp, _normal(8, 16), optimizer=_optimizer("Ftrl", l1_regularization_strength=0.01)),
    "opt_sgd_nesterov": Spec("MLP + SGD nesterov, global_clipnorm", _mlp, _normal(8, 16),
                             optimizer=_optimizer("SGD", momentum=0.9, nesterov=True, global_clipnorm=0.5)),
    "gnn": Spec("GNN (gather, unsorted_segment_sum/mean/max)", _gnn, _normal(4, 12, 8)),
    "super_resolution": Spec("depth_to_space/space_to_depth, resizes", _super_resolution, _image(16)),
    "attention_layers": Spec("Attention/AdditiveAttention/masked MHA/Permute", _attention_layers,
                             _normal(4, 10, 16)),
    "extra_losses": Spec("add_loss: Huber, focal, KLD, ...; regularizers", _extra_losses, _normal(8, 16)),
    "ops_misc": Spec("cumsum/top_k/sort/argsort/roll/bucketize/...", _ops_misc, _normal(4, 12, 8)),
    "transposed_convs": Spec("Conv3DTranspose, Conv1DTranspose, grouped Conv1D", _transposed_convs,
                             _normal(2, 8, 8, 8, 2)),
    "dcgan_generator": Spec("DCGAN generator (Conv2DTranspose, BN)", _dcgan_generator, _normal(4, 16)),
    "fnet": Spec("FNet (fft2d mixing, rfft/irfft filter)", _fnet, _normal(4, 16, 32)),
    "fake_quant": Spec("fake_quant_with_min_max_vars/args (QAT)", _fake_quant, _image(12)),
    "bfloat16": Spec("CNN, pure bfloat16 layers", _pure_policy("bfloat16"), _image(12), float64=False),
    "float16": Spec("CNN, pure float16 layers", _pure_policy("float16"), _image(12), float64=False),
    "bilstm_masked": Spec("Masking + BiLSTM + unrolled LSTM + GRU v1", _bilstm_masked, _masked_sequences),
    "dropout": Spec("Dropout/SpatialDropout/GaussianNoise/... (active)", _dropout, _image(12), random=True),
    "augmentation": Spec("RandomFlip/Translation/Rotation/Zoom/...", _augmentation, _image(16), random=True),
    "transformer_dropout": Spec("Transformer with attention dropout", _transformer_dropout,
                                lambda rng: rng.integers(0, 100, (4, 16)).astype(np.int32), random=True),
    "control_flow": Spec("tf.while_loop/cond/scan/map_fn in a layer", _control_flow, _normal(4, 6, 8)),
    "ops_misc2": Spec("extract_patches/LRN/lgamma/int8 matmul/bincount/...", _ops_misc2, _image(8, 2, 4)),
    "detection": Spec("non_max_suppression_padded", _detection, _normal(2, 16, 5),
                      parts=("forward",)),
    "categorical": Spec("stateless_categorical, Gumbel-softmax", _categorical, _normal(4, 16), random=True),
    "conv_zoo": Spec("strided/dilated/grouped/transposed convs, pools", _conv_zoo, _normal(2, 17, 19, 6)),
    "channels_first": Spec("CNN with data_format=channels_first", _channels_first, _normal(2, 3, 16, 16)),
    "ctc": Spec("Conv1D + BiGRU, tf.nn.ctc_loss", _ctc, _normal(4, 20, 4), _ctc_labels, loss=_ctc_loss),
}


# ------------------------------------------------------------------------------ comparing


def _rel(a: np.ndarray, e: np.ndarray) -> float:
    a = np.asarray(a, np.float64)
    e = np.asarray(e, np.float64)
    if a.shape != e.shape:
        return float("inf")
    finite = np.isfinite(e)
    if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(a[~finite], e[~finite]):
        return float("inf")
    a, e = a[finite], e[finite]
    n = float(np.linalg.norm(e))
    d = float(np.linalg.norm(a - e))
    return d / n if n else d


def _prepare(model: Any, rng: np.random.Generator, keep_dropout: bool = False) -> None:
    """Random biases and normalization parameters (as tests/test_models.py); no dropout."""
    import keras

    for layer in [] if keep_dropout else model._flatten_layers():
        if isinstance(layer, keras.layers.Dropout | keras.layers.SpatialDropout2D):
            layer.rate = 0.0
        for attr in ("dropout", "recurrent_dropout"):  # RNN cells
            if getattr(layer, attr, 0):
                setattr(layer, attr, 0.0)
    for v in model.variables:
        if not v.trainable and "moving" not in v.path:
            continue
        leaf = v.path.rpartition("/")[2]
        shape = tuple(v.shape)
        dtype = v.dtype
        if leaf in ("gamma", "moving_variance"):
            v.assign(rng.uniform(0.5, 1.5, shape).astype(dtype))
        elif leaf in ("beta", "bias", "moving_mean"):
            v.assign((0.1 * rng.standard_normal(shape)).astype(dtype))


def _noise_only(path: str, grads: dict[str, np.ndarray]) -> bool:
    layer, _, leaf = path.rpartition("/")
    if leaf not in ("bias", "beta"):
        return False
    for sibling in ("kernel", "gamma", "depthwise_kernel", "pointwise_kernel"):
        if f"{layer}/{sibling}" in grads:
            g = np.asarray(grads[f"{layer}/{sibling}"], np.float64)
            return bool(np.linalg.norm(np.asarray(grads[path], np.float64)) <= 1e-4 * np.linalg.norm(g))
    return False


@dataclass
class Result:
    status: str = ""
    errors: dict[str, tuple[float, float]] | None = None   # group -> (emulator vs XLA, tf vs XLA)
    worst: str = ""
    t_emu: float = 0.0
    t_xla: float = 0.0
    message: str = ""


def _classify(e: BaseException) -> str:
    from device_server.emulator.errors import UnsupportedOpError

    try:
        from tf_ipu.lowering.hlo_to_ir import HloConversionError
    except ImportError:  # pragma: no cover
        HloConversionError = ValueError  # noqa: N806
    if isinstance(e, UnsupportedOpError | HloConversionError):
        return "UNSUPPORTED"
    return "CRASH"


def run_part(name: str, part: str, float64: bool = False) -> Result:
    import keras
    import tensorflow as tf

    from device_server.emulator import CompileOptions, compile_module, get_target
    from tf_ipu.lowering.program import lower_function

    spec = MODELS[name]
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    if float64:  # the global policy, once read, no longer follows floatx: set both
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
    try:
        model = spec.build()
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    _prepare(model, rng, spec.random)
    x = spec.inputs(rng)
    x = tf.constant(x.astype(np.float64) if float64 and x.dtype == np.float32 else x)
    y = tf.constant(spec.labels(rng, x.numpy()) if spec.labels else rng.integers(0, 10, x.shape[0]).astype(np.int32))
    momentum_of: dict[int, str] = {}
    if part == "train":
        optimizer = spec.optimizer() if spec.optimizer else keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)
        loss = spec.loss() if spec.loss else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=optimizer, loss=loss, metrics=spec.metrics() if spec.metrics else None)
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # LossScaleOptimizer
        model.optimizer.build(model.trainable_variables)
        if isinstance(inner, keras.optimizers.SGD) and inner.momentums:
            momentum_of = {id(m.value.handle): v.path
                           for v, m in zip(model.trainable_variables, inner.momentums, strict=True)}

        def fn(x: tf.Tensor, y: tf.Tensor) -> Any:
            return model.train_step((x, y))

        args = [x, y]
    else:
        def fn(x: tf.Tensor) -> Any:
            return model(x, training=False)

        args = [x]

    res = Result()
    xla = tf.function(fn, jit_compile=True, autograph=False)
    plain = tf.function(fn, jit_compile=False, autograph=False)
    try:
        xla.get_concrete_function(*args)
        xla.experimental_get_compiler_ir(*args)(stage="hlo")
    except Exception as e:  # noqa: BLE001 - XLA's own refusal: out of scope
        res.status, res.message = "XLA-FAIL", _first_line(e)
        return res
    try:
        lowered = lower_function(fn, [tf.TensorSpec(a.shape, a.dtype) for a in args], f"{name}_{part}")
        assert lowered.module is not None
        params = [np.asarray(a.numpy(), order="C") for a in args]
        variables, constants = iter(lowered.variables), iter(lowered.constants)
        var_of_param: dict[int, Any] = {}
        for kind in lowered.captured_kinds:
            if kind == "var":
                var = next(variables)
                var_of_param[len(params)] = var
                params.append(np.asarray(var.read_value().numpy(), order="C"))
            else:
                params.append(np.asarray(next(constants).numpy(), order="C"))
        exe = compile_module(lowered.module, get_target("ipu2"), CompileOptions(allow_out_of_memory=True))
        got = exe.run(params)
    except Exception as e:  # noqa: BLE001
        res.status, res.message = _classify(e), _first_line(e)
        if res.status == "CRASH":
            res.message = _crash_site(e) + res.message
        return res

    def results(f: Any) -> list[np.ndarray]:
        for k, var in var_of_param.items():  # every run starts from the same variable values
            var.assign(params[k])
        flat = dict(enumerate(np.asarray(t.numpy()) for t in tf.nest.flatten(f(*args))))
        for out, var in lowered.updates:
            flat[out] = np.asarray(var.read_value().numpy())
        return [flat[k] for k in sorted(flat)]

    expected = results(xla)
    try:
        reference = results(plain)
    except Exception:  # noqa: BLE001 - TF's own kernels may not run it (e.g. NCHW convolutions on CPU)
        reference = expected
    groups: dict[str, list[tuple[str, float, float]]] = {}

    def floor_of(r: np.ndarray, e: np.ndarray) -> float:
        # TensorFlow without XLA draws other random bits than XLA: no noise floor from it
        return 0.0 if spec.random else _rel(r, e)

    n_results = lowered.num_results
    update_of = dict(lowered.updates)
    grads: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for k, (g, e, r) in enumerate(zip(got, expected, reference, strict=True)):
        if not np.issubdtype(e.dtype, np.inexact) and e.dtype.name not in ("bfloat16",):
            groups.setdefault("ints", []).append((str(k), 0.0 if np.array_equal(g, e) else float("inf"), 0.0))
            continue
        if k < n_results:
            group, label = ("loss" if part == "train" else "outputs"), f"result {k}"
        else:
            var = update_of[k]
            path = momentum_of.get(id(var.handle))
            if path is not None:
                grads[path] = (g, e, r)
                continue
            group, label = "variables", getattr(var, "path", var.name)
        groups.setdefault(group, []).append((label, _rel(g, e), floor_of(r, e)))
    reference_grads = {p: e for p, (_, e, _) in grads.items()}
    for path, (g, e, r) in grads.items():
        if not _noise_only(path, reference_grads):
            groups.setdefault("gradients", []).append((path, _rel(g, e), floor_of(r, e)))

    res.errors = {}
    failing = []
    for group, items in groups.items():
        worst = max(items, key=lambda t: t[1])
        floor = max(t[2] for t in items)
        res.errors[group] = (worst[1], floor)
        rtol = RTOL_F64 if float64 else RTOL
        tol = max(rtol, NOISE_FACTOR * floor)
        bad = [t for t in items if not t[1] <= max(rtol, NOISE_FACTOR * t[2], tol if group == "gradients" else 0)]
        if bad:
            failing.append(f"{group} {max(bad, key=lambda t: t[1])[0]} {max(t[1] for t in bad):.1e}")
    res.status = "MISMATCH" if failing else "OK"
    res.message = "; ".join(failing)

    t_emu, t_xla = [], []
    for _ in range(2):
        for times, run in ((t_emu, lambda: exe.run(params)), (t_xla, lambda: [t.numpy() for t in
                                                                              tf.nest.flatten(xla(*args))])):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    res.t_emu, res.t_xla = min(t_emu), min(t_xla)
    return res


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:400] if text else type(e).__name__


def _crash_site(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "/device_server/" in f.filename or "/tf_ipu/" in f.filename]
    f = (ours or tb)[-1] if (ours or tb) else None
    return f"[{os.path.relpath(f.filename)}:{f.lineno}] " if f else ""


def _print(name: str, part: str, r: Result, wall: float, verbose: bool) -> None:
    if r.errors:
        group, (err, floor) = max(r.errors.items(), key=lambda kv: kv[1][0])
        errs = f"{err:.1e} | {floor:.1e} ({group})"
    else:
        errs = ""
    times = (f"{r.t_emu * 1e3:9.1f} {r.t_xla * 1e3:8.1f} {r.t_emu / r.t_xla:5.1f}x"
             if r.t_xla else f"{'':9} {'':8} {'':6}")
    print(f"  {name:22} {part:9} {r.status:12} {errs:28} {times}" + (f"  [{wall:.0f} s]" if wall else ""), flush=True)
    if r.message:
        print(f"  {'':22} -> {r.message}", flush=True)
    if verbose and r.errors:
        print(f"  {'':22}    " + ", ".join(f"{g} {e:.1e}|{f:.1e}" for g, (e, f) in r.errors.items()))


def main(only: list[str] | None = None, parts: list[str] | None = None, verbose: bool = False) -> int:
    import tensorflow as tf

    threads = tf.config.threading.get_intra_op_parallelism_threads() or "one per CPU"
    print(f"  {os.cpu_count()} CPUs; emulator: OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
          f"; XLA: TF intra-op threads {threads}")
    print(f"  {'model':22} {'part':9} {'result':12} {'worst rel. err (emu | tf)':28} {'emu ms':>9} "
          f"{'XLA ms':>8} {'ratio':>6}")
    bad = 0
    for name in only or MODELS:
        for part in [p for p in parts or ("forward", "train") if p in MODELS[name].parts]:
            t0 = time.perf_counter()
            try:
                r = run_part(name, part)
            except Exception as e:  # noqa: BLE001 - building the model or the harness itself
                r = Result("CRASH", message=_crash_site(e) + _first_line(e))
                if verbose:
                    traceback.print_exc()
            floor = max((f for _, f in (r.errors or {}).values()), default=0.0)
            r64 = None
            if r.status in ("OK", "MISMATCH") and floor > NOISY and MODELS[name].float64:
                r.status = "f32-noisy"
                try:  # float32 is chaotic here (XLA and TF disagree): the float64 build decides
                    r64 = run_part(name, part, float64=True)
                except Exception as e:  # noqa: BLE001
                    r64 = Result("CRASH", message=_crash_site(e) + _first_line(e))
            wall = time.perf_counter() - t0
            _print(name, part, r, wall, verbose)
            if r64 is not None:
                _print("", "  float64", r64, 0.0, verbose)
                r = r64
            bad += r.status != "OK"
    return bad


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), metavar="NAME")
    parser.add_argument("--part", nargs="*", choices=("forward", "train"))
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="every group's errors; tracebacks")
    a = parser.parse_args()
    if a.list:
        for k, s in MODELS.items():
            print(f"  {k:22} {s.title}")
        sys.exit(0)
    sys.exit(1 if main(a.only, a.part, a.verbose) else 0)
