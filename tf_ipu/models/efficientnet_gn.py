"""Graphcore's EfficientNet variant with grouped convolutions and group normalization
("EfficientNet-B4-G16-GN") with Keras layers.

    model = efficientnet_gn("b4")                 # 380x380, expand ratio 4, group dim 16, GN(4)
    small = efficientnet_gn("b0", input_size=64, classes=10)

It is not ``keras.applications.EfficientNetB4``: Graphcore's PopTorch CNN application
(graphcore/examples ``vision/cnns/pytorch`` at commit 3cc8f81f13728dd8c17d0d3c8d2fc1549b159485)
builds timm's EfficientNet (``models/implementations/efficientnet.py``, timm 0.5.4 per
``requirements.txt``) and changes it (``train/configs.yml``, ``efficientnet-g16-gn-pod16-base``):

* the expand ratio of the inverted-residual blocks is 4, not 6 (``efficientnet_expand_ratio``);
* every depthwise convolution (``conv_dw``) becomes a grouped convolution with
  ``in_channels // 16`` groups, at least 1 (``efficientnet_group_dim: 16``);
* every BatchNorm2d becomes a GroupNorm of 4 groups, epsilon 1e-3 (``norm_type: group``,
  ``norm_num_groups: 4``, ``norm_eps: 0.001``; ``models/models.py`` swaps the layer type);
* the input is 380x380 for B4 (``models/factory.py``'s ``available_models``).

The rest is timm's EfficientNet (our own code, following its published layout): a 3x3/2 stem
convolution, seven stages (``ds_r1_k3_s1_e1_c16``, ``ir_r2_k3_s2_c24``, ``ir_r2_k5_s2_c40``,
``ir_r3_k3_s2_c80``, ``ir_r3_k5_s1_c112``, ``ir_r4_k5_s2_c192``, ``ir_r1_k3_s1_c320``, each
with squeeze-and-excitation at 0.25 of the block's input channels), channels times the width
multiplier rounded to multiples of 8, repeats times the depth multiplier rounded up (B0: 1.0,
1.0; B4: 1.4, 1.8), a 1x1 head convolution to 1280 x width channels, global average pooling,
dropout (B0 0.2, B4 0.4) and the classifier. Activations are swish (SiLU); a block whose
stride is 1 and whose input and output channels agree adds its input (after drop-path,
rate 0.2 x block index / blocks). Convolutions have no bias; the SE convolutions do.
Under a float16 policy the group norms are :class:`~tf_ipu.models.HalfGroupNormalization`
(FP16 activation, FP32 statistics): the application converts the model with ``model.half()``
after swapping in ``torch.nn.GroupNorm`` (``models/models.py``), PopTorch lowers it to PopART's
GroupNormalization, whose opx computes popnn's statistics with FLOAT partials on the FP16
activation and keeps that FP16 input for the backward pass (graphcore/popart
``willow/src/popx/op/groupnormx.cpp``); Keras's ``GroupNormalization`` would compute the layer in
FP32 and keep FP32 copies. The application's ``enable_fast_groupnorm`` (PopLibs' strided channel
grouping) puts other channels in a group; the sizes are the same.
Differences: Keras's "same" padding puts the odd padding of a strided convolution on the
bottom/right where PyTorch pads both sides (shapes agree).

Layer names follow timm's module paths: ``blocks_{stage}_{block}_{conv_pw|bn1|conv_dw|bn2|se|
conv_pwl|bn3}``, the residual adds named ``add``, ``add_1``, ... in order, as PopTorch's traced
graph names them (the config's ``recompute_checkpoints`` and ``pipeline_splits`` name them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import keras
from keras import layers

from tf_ipu.models.normalization import HalfGroupNormalization

#: timm's EfficientNet stages: (block type, repeats, kernel, stride, channels); "ds" blocks
#: (depthwise-separable) do not expand, "ir" blocks (inverted residual) by ``expand_ratio``.
STAGES = (("ds", 1, 3, 1, 16), ("ir", 2, 3, 2, 24), ("ir", 2, 5, 2, 40), ("ir", 3, 3, 2, 80),
          ("ir", 3, 5, 1, 112), ("ir", 4, 5, 2, 192), ("ir", 1, 3, 1, 320))
#: width and depth multipliers, dropout rate and input size per variant (``en_params`` and
#: ``available_models`` in Graphcore's application).
VARIANTS = {"b0": (1.0, 1.0, 0.2, 224), "b4": (1.4, 1.8, 0.4, 380)}


def _round_channels(channels: int, multiplier: float, divisor: int = 8) -> int:
    """timm's ``round_channels``: ``channels * multiplier`` to a multiple of ``divisor``,
    never below 90% of it."""
    if not multiplier:
        return channels
    v = channels * multiplier
    out = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * v else out


def _norm(x: keras.KerasTensor, groups: int, name: str) -> keras.KerasTensor:
    half = keras.mixed_precision.global_policy().compute_dtype == "float16"
    norm = HalfGroupNormalization if half else layers.GroupNormalization
    return norm(groups=groups, epsilon=1e-3, name=name)(x)


def _se(x: keras.KerasTensor, reduced: int, name: str) -> keras.KerasTensor:
    s = layers.GlobalAveragePooling2D(keepdims=True, name=f"{name}_pool")(x)
    s = layers.Conv2D(reduced, 1, activation="swish", name=f"{name}_conv_reduce")(s)
    s = layers.Conv2D(x.shape[-1], 1, activation="sigmoid", name=f"{name}_conv_expand")(s)
    return layers.Multiply(name=f"{name}_gate")([x, s])


def efficientnet_gn(
    variant: str = "b4",
    *,
    input_size: int | None = None,
    classes: int = 1000,
    expand_ratio: int = 4,
    group_dim: int = 16,
    norm_groups: int = 4,
    drop_path: float = 0.2,
    dropout: float | None = None,
    repeats: Sequence[int] | None = None,
    checkpoints: Sequence[int] = (),
    input_layers: Sequence[keras.layers.Layer] = (),
    input_dtype: str = "float32",
    name: str | None = None,
) -> keras.Model:
    """Graphcore's EfficientNet-``variant``-G``group_dim``-GN classifier (module docstring):
    images ``(batch, s, s, 3)`` -> ``(batch, classes)`` logits. ``drop_path``: the largest
    stochastic-depth rate; ``dropout``: the classifier's dropout (None: the variant's);
    ``repeats``: blocks per stage instead of the variant's (a reduced test model; 0 leaves a
    stage out). ``checkpoints``: the residual
    adds (0-based, PopTorch's ``add``, ``add_1``, ...) followed by a ``RecomputationCheckpoint``
    (named ``add_{k}_checkpoint``). ``input_layers``: layers applied to the images first (for
    example a ``Rescaling`` of 8-bit images), with ``input_dtype`` the images' dtype.

    Raises:
        ValueError: an unknown variant, or a checkpoint naming an add the network lacks.
    """
    if variant not in VARIANTS:
        raise ValueError(f"efficientnet_gn: variant must be one of {sorted(VARIANTS)}. "
                         f"Received: {variant!r}")
    width, depth, variant_dropout, size = VARIANTS[variant]
    dropout = variant_dropout if dropout is None else float(dropout)
    size = int(input_size or size)
    inputs = keras.Input((size, size, 3), dtype=input_dtype, name="images")
    x = inputs
    for layer in input_layers:
        x = layer(x)
    stem = _round_channels(32, width)
    x = layers.Conv2D(stem, 3, strides=2, padding="same", use_bias=False, name="conv_stem")(x)
    x = layers.Activation("swish", name="act1")(_norm(x, norm_groups, "bn1"))
    if repeats is None:
        repeats = [int(math.ceil(r * depth)) for _, r, *_ in STAGES]
    elif len(repeats) != len(STAGES) or min(repeats) < 0:
        raise ValueError(f"efficientnet_gn: repeats must be {len(STAGES)} counts >= 0. "
                         f"Received: {list(repeats)}")
    repeats = [int(r) for r in repeats]
    total, index, adds = sum(repeats), 0, 0
    wanted = set(int(k) for k in checkpoints)
    if wanted:
        from tf_ipu.graphcore.addons.keras.layers.recomputation import RecomputationCheckpoint
    for s, ((kind, _, kernel, stride, out), count) in enumerate(zip(STAGES, repeats, strict=True)):
        out = _round_channels(out, width)
        for b in range(count):
            p, cin = f"blocks_{s}_{b}", int(x.shape[-1])
            st = stride if b == 0 else 1
            shortcut = x
            mid = cin if kind == "ds" else cin * expand_ratio
            h = x
            if kind == "ir":
                h = layers.Conv2D(mid, 1, use_bias=False, name=f"{p}_conv_pw")(h)
                h = layers.Activation("swish", name=f"{p}_act1")(_norm(h, norm_groups, f"{p}_bn1"))
            dw_norm = f"{p}_bn1" if kind == "ds" else f"{p}_bn2"
            h = layers.Conv2D(mid, kernel, strides=st, padding="same", use_bias=False,
                              groups=max(mid // group_dim, 1), name=f"{p}_conv_dw")(h)
            h = layers.Activation("swish", name=f"{p}_act{1 if kind == 'ds' else 2}")(
                _norm(h, norm_groups, dw_norm))
            h = _se(h, max(1, round(cin * 0.25)), f"{p}_se")
            h = layers.Conv2D(out, 1, use_bias=False, name=f"{p}_conv_{'pw' if kind == 'ds' else 'pwl'}")(h)
            h = _norm(h, norm_groups, f"{p}_bn{2 if kind == 'ds' else 3}")
            if st == 1 and cin == out:
                rate = drop_path * index / total
                if rate > 0:
                    h = layers.Dropout(rate, noise_shape=(None, 1, 1, 1), name=f"{p}_drop_path")(h)
                add = "add" if adds == 0 else f"add_{adds}"
                h = layers.Add(name=add)([h, shortcut])
                if adds in wanted:
                    h = RecomputationCheckpoint(name=f"{add}_checkpoint")(h)
                    wanted.discard(adds)
                adds += 1
            x = h
            index += 1
    if wanted:
        raise ValueError(f"efficientnet_gn: checkpoints {sorted(wanted)} name residual adds the "
                         f"network lacks (it has {adds}: 0 .. {adds - 1})")
    x = layers.Conv2D(_round_channels(1280, width), 1, use_bias=False, name="conv_head")(x)
    x = layers.Activation("swish", name="act2")(_norm(x, norm_groups, "bn2"))
    x = layers.GlobalAveragePooling2D(name="global_pool")(x)
    x = layers.Dropout(dropout, name="head_dropout")(x)
    logits = layers.Dense(classes, name="classifier")(x)
    return keras.Model(inputs, logits, name=name or f"efficientnet_{variant}_g{group_dim}_gn")
