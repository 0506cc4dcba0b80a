"""The builders of published models in ``tf_ipu.models`` (issue 24, point 4's cases): U-Net
(``unet``), ViT (``vit``), GPT-2 (``gpt2``) and Graphcore's EfficientNet-GN
(``efficientnet_gn``).

- Full-size parameter counts, built on the host only (nothing traced for the device; the
  transformers at full width with 1 and 2 layers, then counted for all their layers), against
  the published figures, within 1% of the rounded figure:
  - ViT-B/16: 86M (Dosovitskiy et al., ICLR 2021, Table 1, "ViT-Base ... 86M");
  - GPT-2 small 124M and medium 355M with OpenAI's 50257-token vocabulary (Hugging Face's
    ``gpt2`` and ``gpt2-medium`` model cards; exactly 124,439,808 and 354,823,168 in
    ``transformers``' ``GPT2LMHeadModel``, which we match to the weight);
  - U-Net 572x572x1, 2 classes: recounted here from the layer list of the paper's Figure 1
    (Ronneberger et al., MICCAI 2015: 23 convolutions), the "about 31M" usually quoted.
- Structure as Graphcore's applications publish it (graphcore/examples @ 3cc8f81): the U-Net's
  crop sizes (392, 200, 104, 56) and 388x388 output (``model.py``); the pipeline placements
  (``set_pipeline_stages``, ``parallelize``, ``GPT2Wrapper``); EfficientNet-B4-G16's grouped
  convolutions and its split layer.
- Reduced models train one step under ``IPUStrategy`` (the emulator, FP32) and match the same
  step of plain Keras on the CPU: loss within 1e-5 relative, every updated weight within 1e-5
  relative L2, and every weight's change within 1e-3 relative L2 of the CPU's change (the
  change is a difference of nearly equal numbers: FP32 rounding of the weights themselves is
  1e-7 of the weight, up to ~1e-4 of a small change). GPT-2 also trains as Graphcore places
  it, a 5-stage pipeline on 2 IPUs whose first and last stage share the tied embedding on
  IPU 0.

Time: about 40 s on 2 cores at load average 0.3 (the four one-step tests about 22 s, the
pipeline 7 s); several times that on a loaded machine.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tf_ipu
from tests.keras_util import attached_ipus, rel_l2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# -- full-size parameter counts ------------------------------------------------------------


def _paper_unet_params() -> int:
    """The U-Net of Ronneberger et al.'s Figure 1, counted from its layer list: per level two
    3x3 convolutions (64, 128, 256, 512, 1024 channels), four 2x2 up-convolutions halving the
    channels, two 3x3 convolutions after each concatenation, a final 1x1 to 2 classes."""
    def conv(k: int, cin: int, cout: int) -> int:
        return k * k * cin * cout + cout

    chans, total, cin = [64, 128, 256, 512, 1024], 0, 1
    for c in chans:
        total += conv(3, cin, c) + conv(3, c, c)
        cin = c
    for c in reversed(chans[:-1]):
        total += conv(2, 2 * c, c) + conv(3, 2 * c, c) + conv(3, c, c)
    return total + conv(1, 64, 2)


def _count(build, layers: int, layer_prefix: str = "") -> tuple[int, int]:
    """The parameters of ``build(layers)`` and of its layers named ``{layer_prefix}...``."""
    keras.mixed_precision.set_global_policy("float16")  # half the host memory of the weights
    try:
        model = build(layers)
        one = sum(int(np.prod(w.shape)) for w in model.weights
                  if layer_prefix and w.path.startswith(layer_prefix))
        return model.count_params(), one
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()


@pytest.mark.parametrize("name,build,layers,prefix,published", [
    ("vit-b16", lambda n: tf_ipu.models.vit(layers=n), 12, "layer_0_", 86e6),
    ("gpt2-small", lambda n: tf_ipu.models.gpt2(n, vocab=50257), 12, "h_0_", 124e6),
    ("gpt2-medium", lambda n: tf_ipu.models.gpt2(n, 1024, 16, vocab=50257), 24, "h_0_", 355e6),
])
def test_full_size_transformer_parameter_counts(name, build, layers, prefix, published) -> None:
    """The full-size count from the full-width model with one layer (every layer has the same
    weights): its parameters plus ``layers - 1`` times its layer's. Building all 12 or 24
    layers would initialize up to 355M weights for nothing."""
    total, one = _count(build, 1, prefix)
    count = total + (layers - 1) * one
    assert abs(count - published) <= 0.01 * published, f"{name}: {count:,} vs {published:,.0f}"
    if name.startswith("gpt2"):  # transformers' GPT2LMHeadModel, to the weight
        assert count == {"gpt2-small": 124_439_808, "gpt2-medium": 354_823_168}[name]


def test_full_size_unet_parameter_count() -> None:
    count, _ = _count(lambda _: tf_ipu.models.unet(), 0)
    assert count == _paper_unet_params() == 31_030_658


# -- structure as published ----------------------------------------------------------------


def test_unet_crops_output_and_stages() -> None:
    from tf_ipu.models.unet import unet, unet_pipeline_stages

    model = unet()
    assert model.output.shape == (None, 388, 388, 2)
    crops = [model.get_layer(n).output.shape[1] for n in
             ("central_crop_ipu", "central_crop_ipu_1", "central_crop_ipu_2", "central_crop_ipu_3")]
    assert crops == [392, 200, 104, 56]  # Graphcore's model.py crop_sizes
    stages = unet_pipeline_stages(model)
    by_name = {a.layer.name: s for a, s in zip(model.get_pipeline_stage_assignment(), stages,
                                               strict=True)}
    assert by_name["encoder_block_1_maxpooling"] == 0 and by_name["encoder_block_2_conv_0"] == 1
    assert by_name["decoder_block_0_transpose"] == 1 and by_name["decoder_block_0_concat"] == 2
    assert by_name["decoder_block_2_transpose"] == 2 and by_name["logits"] == 3
    # The three crops set_pipeline_stages forces; the fourth falls in the stage current at its
    # place in the layer order, as in the application (which does not name it).
    assert (by_name["central_crop_ipu"], by_name["central_crop_ipu_1"],
            by_name["central_crop_ipu_2"]) == (0, 0, 1)
    with pytest.raises(ValueError, match="odd side"):
        unet((100, 100, 1))


def test_gpt2_and_vit_placement_and_tied_head() -> None:
    from tf_ipu.models.gpt2 import gpt2, gpt2_pipeline_stages
    from tf_ipu.models.vit import vit, vit_pipeline_stages

    g = gpt2(4, 32, 4, 16, 50, dropout=0.0)
    assert len(g.get_layer("wte").weights) == 1 and g.output.shape == (None, 16, 50)
    stages, ipus = gpt2_pipeline_stages(g, [0, 2, 2])
    assert ipus == [0, 1, 1, 1, 2, 2, 0]  # wte, wpe, 4 layers, LM head (tied, IPU 0)
    names = [a.layer.name for a in g.get_pipeline_stage_assignment()]
    assert [s for n, s in zip(names, stages, strict=True) if n == "wte"] == [0, 6]
    assert stages[names.index("ln_f")] == 5
    with pytest.raises(ValueError, match="places 3 layers"):
        gpt2_pipeline_stages(g, [0, 1, 2])
    v = vit(image_size=32, patch=8, layers=4, hidden=32, heads=4, mlp=64, classes=10)
    stages = vit_pipeline_stages(v, [1, 1, 1, 1])
    names = [a.layer.name for a in v.get_pipeline_stage_assignment()]
    assert stages[names.index("patch_embedding")] == 0 and stages[names.index("classifier")] == 3
    assert stages[names.index("layer_2_checkpoint")] == 2
    assert sum(n.endswith("_checkpoint") for n in names) == 4


def test_efficientnet_b4_g16_gn_layout() -> None:
    """B4's widths with one or two blocks per stage (the full 32 blocks differ only in count:
    timm's depth rule, ceil(repeats x 1.8), is checked on its own)."""
    import math
    import sys

    from tf_ipu.models.efficientnet_gn import efficientnet_gn

    module = sys.modules["tf_ipu.models.efficientnet_gn"]
    assert [math.ceil(st[1] * module.VARIANTS["b4"][1]) for st in module.STAGES] == [2, 4, 4, 6, 6, 8, 2]
    model = efficientnet_gn("b4", input_size=64, repeats=(1, 2, 1, 2, 1, 1, 1), checkpoints=[1])
    assert efficientnet_gn("b4", repeats=(1,) * 7).input.shape == (None, 380, 380, 3)
    dw = [layer for layer in model.layers if layer.name.endswith("_conv_dw")]
    assert len(dw) == 9
    for layer in dw:  # group dim 16: in_channels // 16 groups, at least one
        assert layer.groups == max(layer.input.shape[-1] // 16, 1), layer.name
    # expand 4 of the inputs (24, 32; 32; 56, 112; 112; 160; 272), the ds block not expanding
    assert [layer.filters for layer in dw] == [48, 96, 128, 128, 224, 448, 448, 640, 1088]
    assert model.get_layer("conv_head").filters == 1792
    assert model.get_layer("blocks_3_0_bn2").groups == 4
    assert [n for n in (layer.name for layer in model.layers) if n.startswith("add")] == \
        ["add", "add_1", "add_1_checkpoint"]
    with pytest.raises(ValueError, match="lacks"):
        efficientnet_gn("b0", input_size=32, repeats=(1,) * 7, checkpoints=[0])


# -- a training step under IPUStrategy against CPU Keras -----------------------------------


def _small(name: str):
    if name == "unet":
        return (lambda: tf_ipu.models.unet((44, 44, 1), filters=(4, 8, 16), dropout=0.0),
                (2, 44, 44, 1), "unet")
    if name == "vit":
        return (lambda: tf_ipu.models.vit(image_size=16, patch=8, layers=2, hidden=16, heads=2,
                                          mlp=32, classes=5, dropout=0.0), (2, 16, 16, 3), "sparse")
    if name == "gpt2":
        return lambda: tf_ipu.models.gpt2(2, 16, 2, 8, 20, dropout=0.0), (2, 8), "lm"
    return (lambda: tf_ipu.models.efficientnet_gn("b0", input_size=16, classes=5, drop_path=0.0,
                                                  dropout=0.0, repeats=(1, 2, 0, 0, 0, 0, 0),
                                                  checkpoints=[0]),
            (2, 16, 16, 3), "sparse")


def _data(shape: tuple[int, ...], kind: str, seed: int = 0, out_side: int = 0):
    """Inputs and labels: token ids, images with class labels, or one-hot masks of
    ``out_side`` x ``out_side`` (the U-Net's output)."""
    rng = np.random.default_rng(seed)
    if kind == "lm":
        x = rng.integers(0, 20, shape).astype(np.int32)
        return x, rng.integers(0, 20, shape).astype(np.int32)
    x = rng.normal(size=shape).astype(np.float32)
    if kind == "unet":
        y = keras.utils.to_categorical(rng.integers(0, 2, (shape[0], out_side, out_side)), 2)
        return x, y.astype(np.float32)
    return x, rng.integers(0, 5, (shape[0],)).astype(np.int32)


def _loss(kind: str):
    from tf_ipu.models.gpt2 import lm_loss
    from tf_ipu.models.unet import dice_ce_loss

    return {"unet": dice_ce_loss, "lm": lm_loss(serialized_seq_len=4),
            "sparse": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}[kind]


def _compare(ipu: keras.Model, ref: keras.Model, before: list[np.ndarray], l_ipu: float,
             l_ref: float) -> None:
    """Loss within 1e-5 relative; each weight within 1e-5 relative L2, plus an absolute floor
    of 1e-8 RMS for weights whose gradient is zero in exact arithmetic (the attention's key
    bias: softmax ignores a shift of every score in a row), whose step is FP32 rounding noise
    (~1e-9 here); each weight's change within 1e-3 relative L2 of the CPU's, where the change
    is more than that noise."""
    assert abs(l_ipu - l_ref) <= 1e-5 * abs(l_ref), (l_ipu, l_ref)
    moved = 0
    for w_ipu, w_ref, w0, v in zip(ipu.get_weights(), ref.get_weights(), before, ref.weights,
                                   strict=True):
        err, floor = np.linalg.norm(w_ipu - w_ref), 1e-8 * np.sqrt(w_ref.size)
        assert err <= 1e-5 * np.linalg.norm(w_ref) + floor, f"{v.path}: {err} from the CPU's"
        if np.linalg.norm(w_ref - w0) > 1e-6 * np.sqrt(w_ref.size):
            moved += 1
            assert rel_l2(w_ipu - w0, w_ref - w0) <= 1e-3, f"{v.path} change: {rel_l2(w_ipu - w0, w_ref - w0)}"
    assert moved >= len(before) // 2  # the step trained the model


@pytest.mark.parametrize("name", ["unet", "vit", "gpt2", "efficientnet_gn"])
def test_reduced_model_trains_one_step_like_cpu(ipu_system, name) -> None:
    build, shape, kind = _small(name)
    keras.utils.set_random_seed(3)
    ref = build()
    x, y = _data(shape, kind, out_side=ref.output.shape[1] or 0)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(kind))
    with tf_ipu.IPUStrategy().scope():
        ipu = build()
        ipu.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(kind))
    before = ref.get_weights()
    ipu.set_weights(before)
    l_ref = ref.train_on_batch(x, y)
    l_ipu = ipu.train_on_batch(x, y)
    _compare(ipu, ref, before, float(l_ipu), float(l_ref))


def test_gpt2_pipeline_with_tied_head_trains_like_cpu(ipu_system) -> None:
    """Graphcore's placement at a reduced size: wte (IPU 0), wpe (IPU 1), 2 decoder layers on
    IPU 1, the tied LM head back on IPU 0; 2 micro-batches of 2 (mean) against one CPU step
    of 4."""
    from tf_ipu.models.gpt2 import gpt2_pipeline_stages

    build, _, kind = _small("gpt2")
    x, y = _data((4, 8), kind, seed=1)
    keras.utils.set_random_seed(5)
    ref = build()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(kind))
    before = ref.get_weights()
    with attached_ipus(ipu_system, 2, recompute=True):
        with tf_ipu.IPUStrategy().scope():
            ipu = build()
            ipu.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(kind), steps_per_execution=2)
            ipu.set_weights(before)
            _, ipus = gpt2_pipeline_stages(ipu, [0, 2])
            ipu.set_pipelining_options(gradient_accumulation_steps_per_replica=2,
                                       gradient_accumulation_reduction_method="mean",
                                       device_mapping=ipus)
        hist = ipu.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    l_ref = float(ref.train_on_batch(x, y))
    _compare(ipu, ref, before, float(np.mean(hist.history["loss"])), l_ref)
