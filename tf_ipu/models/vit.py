"""Vision Transformer (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021) with
Keras layers, as Graphcore's PopTorch ViT fine-tunes it.

    model = vit()                                    # ViT-B/16, 224x224, 1000 classes: 86.6M weights
    small = vit(image_size=32, patch=8, layers=2, hidden=32, heads=4, mlp=64, classes=10)
    vit_pipeline_stages(model, [3, 3, 3, 3])         # Graphcore's layers_per_ipu

Published definition followed (our own code, no lines copied): graphcore/examples
``vision/vit/pytorch`` at commit 3cc8f81f13728dd8c17d0d3c8d2fc1549b159485. Fine-tuning
(``finetune.py``) builds ``models/pipeline_model.py``'s ``PipelinedViTForImageClassification``,
Hugging Face's ``ViTForImageClassification`` placed on the IPUs:

* embeddings: a ``patch`` x ``patch`` convolution with stride ``patch`` (with bias) to
  ``hidden`` channels, flattened to ``(batch, patches, hidden)``; a learned class token in
  front; a learned position embedding added; dropout (``hidden_dropout_prob``);
* ``layers`` pre-LN encoder layers (:func:`pre_ln_block`): ``x + Dropout(Attention(LN(x)))``
  then ``x + Dropout(Dense(hidden)(gelu(Dense(mlp)(LN(x)))))``, LayerNorm epsilon 1e-6
  (``configs.yml``'s ``layer_norm_eps``), exact (erf) GELU, attention-probability dropout
  ``attention_probs_dropout_prob`` (0 in the configs);
* a final LayerNorm and a dense classifier on the class token (no pooler).

Placement (``parallelize``): the embeddings on IPU 0, encoder layer ``i`` on the IPU that
``layers_per_ipu`` gives it, the final LayerNorm and the classifier on IPU 3; with
``poptorch.AutoStage.SameAsIpu`` (``ipu_options.py``) one pipeline stage per IPU. With
``recompute_checkpoint_every_layer`` a forward hook marks every encoder layer's output as a
recomputation checkpoint (``models/utils.py``'s ``recomputation_checkpoint``): here
``checkpoints="every_layer"``, a ``RecomputationCheckpoint`` after each layer. The configs'
``recompute_mid_layers`` is read only by the pre-training model (``models/modules.py``'s
``Block``), not by the Hugging Face model fine-tuning uses.

Precision: the application runs the model in FP16 (``.half()``, "16.16"), attention softmax
included, so the attention is ``FP16Attention`` (``tf_ipu/models/bert.py``), whose scores and
probabilities stay in the compute dtype.

Parameter count: 86,567,656 for ViT-B/16 with 1000 classes (the paper's Table 1: ViT-Base,
86M).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import layers, ops

from tf_ipu.models.bert import FP16Attention, PositionEmbedding


@keras.saving.register_keras_serializable(package="tf_ipu")
class ClassToken(layers.Layer):
    """Puts a learned ``(hidden,)`` token in front of the sequence: ``(batch, n, hidden)`` ->
    ``(batch, n + 1, hidden)``."""

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.token = self.add_weight(shape=(1, 1, int(input_shape[-1])), initializer="zeros",
                                     name="token")

    def call(self, x: Any) -> Any:
        token = ops.cast(self.token, x.dtype)
        return ops.concatenate([ops.broadcast_to(token, (ops.shape(x)[0], 1, x.shape[-1])), x], axis=1)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        n = input_shape[1]
        return (input_shape[0], None if n is None else n + 1, input_shape[2])


def pre_ln_block(x: keras.KerasTensor, heads: int, mlp: int, name: str, *, epsilon: float,
                 dropout: float, attention_dropout: float, causal: bool = False,
                 fp16_softmax: bool = True,
                 initializer: Any = "glorot_uniform") -> keras.KerasTensor:
    """One pre-LN transformer layer (ViT's and GPT-2's): ``x + Dropout(Attention(LN(x)))``,
    then ``x + Dropout(Dense(hidden)(gelu(Dense(mlp)(LN(x)))))``. Layers are named
    ``{name}_norm_1``, ``{name}_attention``, ``{name}_attention_dropout``,
    ``{name}_attention_add``, ``{name}_norm_2``, ``{name}_mlp_1``, ``{name}_mlp_2``,
    ``{name}_mlp_dropout``, ``{name}_output`` (the layer's output: the second add).
    ``causal``: each position attends to itself and the positions before it."""
    hidden = int(x.shape[-1])
    if hidden % heads:
        raise ValueError(f"{name}: hidden ({hidden}) must be a multiple of heads ({heads})")
    attention = FP16Attention if fp16_softmax else layers.MultiHeadAttention
    h = layers.LayerNormalization(epsilon=epsilon, name=f"{name}_norm_1")(x)
    h = attention(heads, hidden // heads, dropout=attention_dropout, kernel_initializer=initializer,
                  name=f"{name}_attention")(h, h, use_causal_mask=causal)
    h = layers.Dropout(dropout, name=f"{name}_attention_dropout")(h)
    x = layers.Add(name=f"{name}_attention_add")([x, h])
    h = layers.LayerNormalization(epsilon=epsilon, name=f"{name}_norm_2")(x)
    h = layers.Dense(mlp, activation="gelu", kernel_initializer=initializer, name=f"{name}_mlp_1")(h)
    h = layers.Dense(hidden, kernel_initializer=initializer, name=f"{name}_mlp_2")(h)
    h = layers.Dropout(dropout, name=f"{name}_mlp_dropout")(h)
    return layers.Add(name=f"{name}_output")([x, h])


def vit(
    image_size: int = 224,
    patch: int = 16,
    layers: int = 12,  # shadows the keras.layers module in this function only
    hidden: int = 768,
    heads: int = 12,
    mlp: int = 3072,
    classes: int = 1000,
    *,
    channels: int = 3,
    dropout: float = 0.1,
    attention_dropout: float = 0.0,
    epsilon: float = 1e-6,
    fp16_softmax: bool = True,
    checkpoints: str | None = "every_layer",
    name: str = "vit",
) -> keras.Model:
    """ViT image classifier: ``(batch, image_size, image_size, channels)`` -> ``(batch,
    classes)`` logits (module docstring). ``checkpoints``: ``"every_layer"`` puts a
    ``RecomputationCheckpoint`` on each encoder layer's output (``layer_{i}_checkpoint``),
    None none.

    Raises:
        ValueError: ``image_size`` not a multiple of ``patch``, ``hidden`` not a multiple of
            ``heads``, or another ``checkpoints`` value.
    """
    from keras import layers as kl

    if image_size % patch:
        raise ValueError(f"vit: image_size ({image_size}) must be a multiple of patch ({patch})")
    if checkpoints not in (None, "every_layer"):
        raise ValueError(f"vit: checkpoints must be 'every_layer' or None. Received: {checkpoints!r}")
    if checkpoints:
        from tf_ipu.graphcore.addons.keras.layers.recomputation import RecomputationCheckpoint
    patches = (image_size // patch) ** 2
    images = keras.Input((image_size, image_size, channels), name="pixel_values")
    x = kl.Conv2D(hidden, patch, strides=patch, name="patch_embedding")(images)
    x = kl.Reshape((patches, hidden), name="patches")(x)
    x = ClassToken(name="class_token")(x)
    x = PositionEmbedding(patches + 1, name="position_embedding")(x)
    x = kl.Dropout(dropout, name="embedding_dropout")(x)
    for i in range(layers):
        x = pre_ln_block(x, heads, mlp, f"layer_{i}", epsilon=epsilon, dropout=dropout,
                         attention_dropout=attention_dropout, fp16_softmax=fp16_softmax)
        if checkpoints:
            x = RecomputationCheckpoint(name=f"layer_{i}_checkpoint")(x)
    x = kl.LayerNormalization(epsilon=epsilon, name="final_norm")(x)
    cls = kl.Lambda(lambda t: t[:, 0, :], name="class_output")(x)
    logits = kl.Dense(classes, name="classifier")(cls)
    return keras.Model(images, logits, name=name)


def vit_pipeline_stages(model: keras.Model, layers_per_ipu: Sequence[int]) -> list[int]:
    """Sets and returns the pipeline stage of each layer call of a :func:`vit` model as
    ``PipelinedViTForImageClassification.parallelize`` places it with one stage per IPU: the
    embeddings in stage 0, encoder layer ``i`` in the stage of its IPU (``layers_per_ipu``),
    the final LayerNorm and the classifier in the last stage.

    Raises:
        ValueError: ``layers_per_ipu`` does not place the model's encoder layers.
    """
    import re

    ipu_of = [ipu for ipu, n in enumerate(layers_per_ipu) for _ in range(int(n))]
    names = [a.layer.name for a in model.get_pipeline_stage_assignment()]
    count = len({m.group(1) for n in names if (m := re.match(r"layer_(\d+)_", n))})
    if count != len(ipu_of):
        raise ValueError(f"vit_pipeline_stages: layers_per_ipu {list(layers_per_ipu)} places "
                         f"{len(ipu_of)} layers; {model.name} has {count}")
    stages, last = [], len(layers_per_ipu) - 1
    for n in names:
        m = re.match(r"layer_(\d+)_", n)
        stages.append(ipu_of[int(m.group(1))] if m else
                      last if n in ("final_norm", "class_output", "classifier") else 0)
    model.set_pipeline_stage_assignment(stages)
    return stages
