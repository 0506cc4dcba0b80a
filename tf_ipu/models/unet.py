"""U-Net (Ronneberger, Fischer and Brox, "U-Net: Convolutional Networks for Biomedical Image
Segmentation", MICCAI 2015) with Keras layers, as Graphcore's TF2 U-Net builds it.

    model = unet()                                   # 572x572x1 -> 388x388x2 logits, ~31M weights
    small = unet((92, 92, 1), filters=(4, 8, 16))    # a reduced test model
    unet_pipeline_stages(model)                      # Graphcore's 4 stages, one per IPU

Published definition followed (our own code, no lines copied): graphcore/examples
``vision/unet_medical/tensorflow2/model.py`` and ``model_utils.py`` at commit
3cc8f81f13728dd8c17d0d3c8d2fc1549b159485 (the paper's network):

* encoder: per level ``i``, two unpadded ("valid") 3x3 convolutions with ReLU
  (``encoder_block_{i}_conv_0/1``, He-normal initializer), then, except at the bottom level, a
  central crop of the activation kept for the skip connection and a 2x2 max pool
  (``encoder_block_{i}_maxpooling``); the bottom level ends in a dropout
  (``encoder_block_{n}_IPU_dropout``, rate 0.5 in the application);
* decoder: per level, a 2x2 transposed convolution with stride 2 and ReLU
  (``decoder_block_{i}_transpose``), concatenated with the skip connection cropped to its
  size, then two valid 3x3 convolutions with ReLU (``decoder_block_{i}_conv_0/1``);
* a 1x1 convolution to ``classes`` logits (no activation).

The crops: Graphcore's application crops with a custom op (``CentralCropIpu``, a copy of the
central window, "without inplacing") when the model spans several IPUs and with
``tf.image.central_crop`` on one IPU; both are a slice of the central window, here Keras's
``Cropping2D``, named ``central_crop_ipu``, ``central_crop_ipu_1``, ... as Keras names the
application's layers, so that ``unet_pipeline_stages`` can follow ``set_pipeline_stages``. The
crop sizes follow from the input size (572: 392, 200, 104, 56, the application's list).

Parameter count: 31,030,658 at 572x572x1 and 2 classes (filters 64 .. 1024): the sum of the 23
convolutions of the paper's Figure 1 (the "about 31M" usually quoted for the paper's U-Net);
``tests/test_model_builders.py`` recounts it from the figure's layer list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import layers

FILTERS = (64, 128, 256, 512, 1024)


def _double_conv(x: keras.KerasTensor, filters: int, name: str) -> keras.KerasTensor:
    for k in range(2):
        x = layers.Conv2D(filters, 3, activation="relu", kernel_initializer="he_normal",
                          name=f"{name}_conv_{k}")(x)
    return x


def _sizes(side: int, levels: int) -> tuple[list[int], list[int]]:
    """Per encoder level, the side of its output before pooling; per decoder level, the side
    of its upsampled input (what the skip is cropped to). Raises ValueError when a pooled
    side is odd or a side reaches zero."""
    enc = []
    for i in range(levels):
        side -= 4
        if side < 1:
            raise ValueError(f"unet: the input side is too small for {levels} levels")
        enc.append(side)
        if i < levels - 1:
            if side % 2:
                raise ValueError(f"unet: level {i} has an odd side ({side}) before its 2x2 pooling;"
                                 f" choose an input side s with (s - 4) even at every level "
                                 f"(572, 188, 92, ...)")
            side //= 2
    dec = []
    for _ in range(levels - 1):
        side *= 2
        dec.append(side)
        side -= 4
        if side < 1:
            raise ValueError("unet: the input side is too small for the decoder")
    return enc, dec


def unet(
    input_shape: Sequence[int] = (572, 572, 1),
    filters: Sequence[int] = FILTERS,
    classes: int = 2,
    *,
    dropout: float = 0.5,
    name: str = "unet",
) -> keras.Model:
    """Ronneberger's U-Net: ``(batch, s, s, c)`` images -> ``(batch, s', s', classes)`` logits
    (``s' = 388`` for ``s = 572``). ``filters`` gives the channels of each level, top to
    bottom (its length is the number of levels); ``dropout`` the rate of the bottom level's
    dropout.

    Raises:
        ValueError: a non-square input, fewer than 2 levels, or an input side that a 2x2
            pooling would halve unevenly (the message names the level and side).
    """
    filters = [int(f) for f in filters]
    if len(filters) < 2:
        raise ValueError(f"unet: filters must name at least 2 levels. Received: {filters}")
    if len(input_shape) != 3 or input_shape[0] != input_shape[1]:
        raise ValueError(f"unet: input_shape must be (side, side, channels). Received: "
                         f"{tuple(input_shape)}")
    enc_sides, dec_sides = _sizes(int(input_shape[0]), len(filters))
    inputs = keras.Input(tuple(input_shape), name="image")
    x, skips = inputs, []
    bottom = len(filters) - 1
    for i, f in enumerate(filters):
        conv = _double_conv(x, f, f"encoder_block_{i}")
        if i == bottom:
            x = layers.Dropout(dropout, name=f"encoder_block_{i}_IPU_dropout")(conv)
        else:
            crop = (enc_sides[i] - dec_sides[bottom - 1 - i]) // 2
            suffix = f"_{i}" if i else ""
            skips.append(layers.Cropping2D(crop, name=f"central_crop_ipu{suffix}")(conv))
            x = layers.MaxPooling2D(2, name=f"encoder_block_{i}_maxpooling")(conv)
    for i, f in enumerate(filters[-2::-1]):
        up = layers.Conv2DTranspose(f, 2, strides=2, padding="same", activation="relu",
                                    name=f"decoder_block_{i}_transpose")(x)
        merged = layers.Concatenate(axis=-1, name=f"decoder_block_{i}_concat")([up, skips.pop()])
        x = _double_conv(merged, f, f"decoder_block_{i}")
    logits = layers.Conv2D(classes, 1, kernel_initializer="he_normal", name="logits")(x)
    return keras.Model(inputs, logits, name=name)


def unet_pipeline_stages(model: keras.Model) -> list[int]:
    """The pipeline stage of each layer call of ``model`` (a :func:`unet` of 5 levels) as
    Graphcore's ``set_pipeline_stages`` assigns them (``model_utils.py``): stage 0 up to and
    including ``encoder_block_1_maxpooling``, stage 1 up to ``decoder_block_0_transpose``,
    stage 2 up to ``decoder_block_2_transpose``, stage 3 the rest; the crops
    ``central_crop_ipu`` and ``central_crop_ipu_1`` in stage 0 and ``central_crop_ipu_2`` in
    stage 1 (crop first, then send the smaller tensor down the pipeline). Sets them on the
    model (``set_pipeline_stage_assignment``) and returns them."""
    splits = {"encoder_block_1_maxpooling": 1, "decoder_block_0_transpose": 2,
              "decoder_block_2_transpose": 3}
    forced = {"central_crop_ipu": 0, "central_crop_ipu_1": 0, "central_crop_ipu_2": 1}
    stages, stage = [], 0
    names = [a.layer.name for a in model.get_pipeline_stage_assignment()]
    missing = sorted(set(splits) - set(names))
    if missing:
        raise ValueError(f"unet_pipeline_stages: {model.name} has no layers {missing} (a 5-level "
                         f"unet() is needed)")
    for name in names:
        stages.append(forced.get(name, stage))
        stage = splits.get(name, stage)
    model.set_pipeline_stage_assignment(stages)
    return stages


def dice_ce_loss(y_true: Any, y_pred: Any) -> Any:
    """The application's training loss (``losses.py``, ``dice_ce_loss``): softmax
    cross-entropy plus the Dice loss of the softmax, both in FP32 on the flattened
    ``(batch, pixels, classes)`` one-hot labels and logits (cast first, as it casts)."""
    from keras import ops

    classes = y_pred.shape[-1]
    labels = ops.reshape(ops.cast(y_true, "float32"), (ops.shape(y_pred)[0], -1, classes))
    logits = ops.reshape(ops.cast(y_pred, "float32"), (ops.shape(y_pred)[0], -1, classes))
    ce = ops.mean(keras.losses.categorical_crossentropy(labels, logits, from_logits=True))
    probs = ops.softmax(logits, axis=-1)
    inter = ops.sum(probs * labels, axis=1)
    union = ops.sum(probs * probs + labels * labels, axis=1)
    dice = ops.mean((2.0 * inter + 1e-6) / (union + 1e-6), axis=0)
    return ce + ops.mean(1.0 - dice)
