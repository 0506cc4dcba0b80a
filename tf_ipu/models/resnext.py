"""ResNeXt (Xie et al., "Aggregated Residual Transformations for Deep Neural Networks", 2017)
with Keras layers: bottleneck blocks whose 3x3 convolution is grouped (``Conv2D(groups=...)``).

    model = resnext(depth=101, cardinality=32, width=4)        # ResNeXt-101 32x4d, 224x224
    small = resnext(blocks=(1, 1, 1, 1), input_shape=(32, 32, 3), classes=10)

Layout (channels last): a 7x7/2 stem convolution (64) with BatchNormalization and ReLU, a
3x3/2 max pool, then four stages of bottleneck blocks. A block of stage ``i`` (0-based) has
``cardinality * width * 2**i`` inner channels and ``256 * 2**i`` output channels:
1x1 conv -> BN -> ReLU -> 3x3 grouped conv (``cardinality`` groups, stride 2 in the first block
of stages 1-3) -> BN -> ReLU -> 1x1 conv -> BN, added to the shortcut (a 1x1 conv + BN where
the shape changes, else the identity), then ReLU. Global average pooling and a dense
classifier (logits unless ``classifier_activation`` is given). Convolutions have no bias
(each feeds a BatchNormalization). Layer names follow ``keras.applications.ResNet50``
(``conv2_block1_2_conv``...).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import layers

BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
BN_EPSILON = 1.001e-5


def _bn(x: keras.KerasTensor, name: str) -> keras.KerasTensor:
    return layers.BatchNormalization(axis=-1, epsilon=BN_EPSILON, name=name)(x)


def _block(x: keras.KerasTensor, inner: int, out: int, stride: int, cardinality: int,
           name: str) -> keras.KerasTensor:
    if stride != 1 or x.shape[-1] != out:
        shortcut = layers.Conv2D(out, 1, strides=stride, use_bias=False, name=f"{name}_0_conv")(x)
        shortcut = _bn(shortcut, f"{name}_0_bn")
    else:
        shortcut = x
    h = layers.Conv2D(inner, 1, use_bias=False, name=f"{name}_1_conv")(x)
    h = layers.Activation("relu", name=f"{name}_1_relu")(_bn(h, f"{name}_1_bn"))
    if stride != 1:
        h = layers.ZeroPadding2D(1, name=f"{name}_2_pad")(h)
    h = layers.Conv2D(inner, 3, strides=stride, padding="same" if stride == 1 else "valid",
                      groups=cardinality, use_bias=False, name=f"{name}_2_conv")(h)
    h = layers.Activation("relu", name=f"{name}_2_relu")(_bn(h, f"{name}_2_bn"))
    h = layers.Conv2D(out, 1, use_bias=False, name=f"{name}_3_conv")(h)
    h = _bn(h, f"{name}_3_bn")
    h = layers.Add(name=f"{name}_add")([shortcut, h])
    return layers.Activation("relu", name=f"{name}_out")(h)


def resnext(
    depth: int = 101,
    cardinality: int = 32,
    width: int = 4,
    input_shape: Sequence[int] = (224, 224, 3),
    classes: int = 1000,
    *,
    blocks: Sequence[int] | None = None,
    classifier_activation: str | None = None,
    name: str | None = None,
) -> keras.Model:
    """A ResNeXt-``depth`` ``cardinality``x``width``d classifier (a functional Keras model).

    ``depth`` picks the blocks per stage (50, 101 or 152); ``blocks`` overrides them (four
    counts, e.g. ``(1, 1, 1, 1)`` for a small test model). ``width`` is the channels per group
    in the first stage (4 in "32x4d"). Weights are Keras' default initializers (random).
    """
    if blocks is None:
        if depth not in BLOCKS:
            raise ValueError(f"resnext: depth must be one of {sorted(BLOCKS)} (or pass blocks=), got {depth}")
        blocks = BLOCKS[depth]
    blocks = tuple(int(b) for b in blocks)
    if len(blocks) != 4 or min(blocks) < 1:
        raise ValueError(f"resnext: blocks must be four positive counts, got {blocks}")
    inputs = keras.Input(tuple(input_shape), name="input")
    x = layers.ZeroPadding2D(3, name="conv1_pad")(inputs)
    x = layers.Conv2D(64, 7, strides=2, use_bias=False, name="conv1_conv")(x)
    x = layers.Activation("relu", name="conv1_relu")(_bn(x, "conv1_bn"))
    x = layers.ZeroPadding2D(1, name="pool1_pad")(x)
    x = layers.MaxPooling2D(3, strides=2, name="pool1_pool")(x)
    for stage, count in enumerate(blocks):
        inner = cardinality * width * 2**stage
        out = 256 * 2**stage
        for b in range(count):
            stride = 2 if stage > 0 and b == 0 else 1
            x = _block(x, inner, out, stride, cardinality, f"conv{stage + 2}_block{b + 1}")
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    outputs = layers.Dense(classes, activation=classifier_activation, name="predictions")(x)
    if name is None:
        stem = f"resnext{depth}" if blocks == BLOCKS.get(depth) else "resnext_" + "_".join(map(str, blocks))
        name = f"{stem}_{cardinality}x{width}d"
    return keras.Model(inputs, outputs, name=name)
