"""tf_ipu.onnx on models made by tools no one here wrote, against onnxruntime (CPU, FP32), and
the GPU roofline (tf_ipu/onnx/gpu_roofline.py).

- keras.applications.ResNet50 (weights=None, 64x64, batch 1) and a transformer encoder (2
  blocks of keras.layers.MultiHeadAttention, LayerNormalization and a GELU feed-forward,
  hidden 64), both exported with tf2onnx 1.17.0 (bench/onnx_models.py): max |ours -
  onnxruntime| <= 1e-4 x max |onnxruntime| (FP32; sums in another order over 50 layers).
- onnx's light real-architecture models squeezenet and shufflenet with random weights
  (bench/onnx_models.py light_model, seeded), the logits (the input of the final Softmax)
  compared: same tolerance. The bench runs all nine.
- system="c2": the replicas run on a server hosting a C2 card; a server of another system
  is refused, naming both.
- The roofline: its arithmetic on a graph small enough to count by hand, and that its check
  against NVIDIA's published V100 rows is computed (not how close it is).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tf_ipu.onnx as tox
from bench import onnx_models
from tf_ipu.onnx import gpu_roofline as gr

RTOL_OF_MAX = 1e-4


pytestmark = pytest.mark.usefixtures("onnx_server")  # conftest: the shared server


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.ir_version = 10  # onnxruntime 1.31 reads IR <= 13; onnx 1.23 writes 14
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    scale = float(np.abs(ref).max())
    err = float(np.abs(got.astype(np.float64) - ref).max())
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert scale > 0 and err <= RTOL_OF_MAX * scale, f"{what}: max |diff| {err:.3g} vs max |ref| {scale:.3g}"


def test_keras_resnet50_from_tf2onnx_agrees_with_onnxruntime():
    pytest.importorskip("tensorflow")
    model = onnx_models.resnet50_onnx(image_size=64, seed=3)
    assert sum(n.op_type == "Conv" for n in model.graph.node) == 53
    name = model.graph.input[0].name
    x = np.random.default_rng(4).random((1, 64, 64, 3), np.float32)
    m = tox.load(model, batch_size=1)
    (ref,) = _ort(model, {name: x})
    _close(next(iter(m.run({name: x}).values())), ref, "ResNet50")
    assert m.estimate.cycles > 0


def _encoder(seq_len: int = 16, vocab: int = 100, hidden: int = 64, heads: int = 4, blocks: int = 2):
    """BERT-style encoder blocks of keras.layers (MultiHeadAttention, LayerNormalization, Dense
    with tanh-approximated GELU: Keras 3's exact GELU uses TensorFlow's Erfc, which tf2onnx
    1.17 cannot convert)."""
    import keras
    from keras import layers

    ids = keras.Input((seq_len,), dtype="int32", name="input_ids")
    x = layers.Embedding(vocab, hidden)(ids)
    for _ in range(blocks):
        a = layers.MultiHeadAttention(heads, hidden // heads)(x, x)
        x = layers.LayerNormalization(epsilon=1e-12)(layers.Add()([x, a]))
        h = layers.Dense(4 * hidden, activation=lambda t: keras.activations.gelu(t, approximate=True))(x)
        x = layers.LayerNormalization(epsilon=1e-12)(layers.Add()([x, layers.Dense(hidden)(h)]))
    return keras.Model(ids, x)


def test_keras_transformer_encoder_from_tf2onnx_agrees_with_onnxruntime():
    pytest.importorskip("tensorflow")
    import keras

    keras.utils.set_random_seed(5)
    model = onnx_models.keras_to_onnx(_encoder(), (16,), input_name="input_ids", dtype="int32")
    ops = {n.op_type for n in model.graph.node}
    assert {"MatMul", "Softmax", "Gather", "Tanh"} <= ops, ops
    ids = np.random.default_rng(6).integers(0, 100, (2, 16)).astype(np.int32)
    m = tox.load(model, batch_size=2)
    (ref,) = _ort(model, {"input_ids": ids})
    _close(next(iter(m.run({"input_ids": ids}).values())), ref, "transformer encoder")


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_light_real_architecture_with_random_weights_agrees_with_onnxruntime(name):
    model = onnx_models.with_logits(onnx_models.light_model(name, seed=7))
    onnx.checker.check_model(model)
    consts = [n for n in model.graph.node if n.op_type == "ConstantOfShape"]
    assert not consts  # every constant-filled weight was replaced
    conv_w = next(t for t in model.graph.initializer if len(t.dims) == 4)
    assert numpy_helper.to_array(conv_w).std() > 0  # random, not one repeated value
    inp = model.graph.input[0]
    x = np.random.default_rng(8).standard_normal([d.dim_value for d in inp.type.tensor_type.shape.dim]).astype(
        np.float32)
    got = tox.load(model).run({inp.name: x})
    refs = _ort(model, {inp.name: x})
    assert len(got) == len(refs) == 2  # probabilities and logits
    for (out, g), r in zip(got.items(), refs, strict=True):
        _close(g, r, f"{name}:{out}")


def _tiny_cnn(opset: int = 17) -> onnx.ModelProto:
    """Conv 3->8 (3x3, pad 1) on [N, 3, 8, 8], Relu, Reshape to [N, 512], MatMul [512, 10]."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((512, 10)).astype(np.float32), "fc"),
             numpy_helper.from_array(np.array([-1, 512], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]),
             helper.make_node("MatMul", ["f", "fc"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "tiny", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", opset)])


def test_roofline_arithmetic():
    gpu = gr.GpuSpec("toy", fp16_tensor_flops=1e12, fp32_flops=1e11, memory_bytes_per_s=1e9, launch_s=1e-6)
    e = gr.estimate(_tiny_cnn(), 2, "fp32", gpu)
    conv, relu, reshape, matmul = e.nodes
    out = 2 * 8 * 8 * 8  # N x C_out x H x W
    assert conv.flops == 2 * out * 3 * 3 * 3
    assert conv.bytes == 4 * (2 * 3 * 8 * 8 + 8 * 3 * 3 * 3 + out)
    assert conv.seconds == pytest.approx(max(conv.flops / 1e11, conv.bytes / 1e9) + 1e-6)
    assert relu.flops == out and relu.bytes == 4 * 2 * out and relu.bound == "memory"
    assert reshape.seconds == 0 and reshape.bound == "free"  # a view: no kernel, no launch
    assert matmul.flops == 2 * 2 * 10 * 512
    assert e.kernels == 3 and e.launch_s == pytest.approx(3e-6)
    assert e.latency_s == pytest.approx(conv.seconds + relu.seconds + matmul.seconds)
    assert e.throughput == pytest.approx(2 / e.latency_s)
    # fp16: half the bytes, matrix products at the Tensor Core peak, the others at FP32's
    h = gr.estimate(_tiny_cnn(), 2, "fp16", gpu)
    assert h.nodes[0].bytes == conv.bytes / 2
    assert h.nodes[0].seconds == pytest.approx(max(conv.flops / 1e12, conv.bytes / 2 / 1e9) + 1e-6)
    # efficiency scales both roofs, not the launch
    half = gr.estimate(_tiny_cnn(), 2, "fp32", gpu.with_efficiency(0.5))
    assert half.nodes[0].seconds == pytest.approx(2 * (conv.seconds - 1e-6) + 1e-6)
    with pytest.raises(ValueError):
        gpu.with_efficiency(0.0)
    assert gr.V100_SXM2.fp16_tensor_flops == 125e12 and "datasheet" in gr.V100_SXM2.sources["fp32_flops"]
    assert "ASSUMPTION" in gr.V100_SXM2.sources["launch_s"]


def test_roofline_check_and_fit_against_nvidia_rows_are_computed():
    from bench.calibration.table import load_measurements

    rows = [r for r in load_measurements() if r.source == "nvidia-dle-rnxt101" and r.chip == "V100"]
    published = gr.published_from_rows(rows)
    assert {p.precision for p in published} == {"fp16", "fp32"}
    assert {p.batch_size for p in published} >= {1, 8, 64}
    assert all(p.metric in ("throughput", "latency_s") and p.value > 0 for p in published)
    b1 = next(p for p in published if p.batch_size == 1 and p.precision == "fp32" and p.metric == "latency_s")
    assert b1.value == pytest.approx(21.02e-3)  # the README's FP32 batch-1 latency, in seconds
    # the check on a stand-in graph (the bench runs it on ResNeXt-101): one point per row
    model = _tiny_cnn()
    ests = [gr.estimate(model, b, p) for b, p in sorted({(p.batch_size, p.precision) for p in published})]
    c = gr.check(ests, published)
    assert len(c.points) == len(published)
    p0 = c.points[0]
    assert p0.ratio == pytest.approx(p0.model / p0.published.value)
    assert c.typical_error == pytest.approx(math.exp(np.mean([abs(math.log(p.ratio)) for p in c.points])))
    fit = gr.fit_efficiency(model, published)
    assert 0 < fit.gpu.efficiency <= 1 and "in-sample" in fit.gpu.fitted
    assert fit.check.typical_error <= fit.before.typical_error + 1e-9


def test_system_c2_runs_the_replicas_on_a_c2_card(device_server):
    model = _tiny_cnn()
    model.ir_version = 10
    x = np.random.default_rng(9).standard_normal((4, 3, 8, 8)).astype(np.float32)
    tox.set_default_server(None)
    try:
        m = tox.load(model, batch_size=4, replicas=2, system="c2")
        assert m.ipu_version == "ipu1" and m._session.client.session.system == "c2"
        (ref,) = _ort(model, {"x": x})
        np.testing.assert_allclose(m.run({"x": x})["y"], ref, rtol=1e-4, atol=1e-4)
        assert m.estimate.replicas == 2
        with pytest.raises(ValueError, match="hosts plain IPUs"):
            tox.load(model, batch_size=4, replicas=2, system="c2", server=device_server)
        with pytest.raises(ValueError, match="ipu1"):
            tox.load(model, batch_size=4, replicas=2, system="c2", ipu_version="ipu2")
        with pytest.raises(ValueError, match="2 IPUs"):
            tox.load(model, batch_size=4, replicas=4, system="c2")
    finally:
        tox.set_default_server(device_server)
