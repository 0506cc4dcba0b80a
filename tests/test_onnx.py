"""tf_ipu.onnx: ONNX models on the emulated IPU, checked against onnxruntime (CPU) as the
reference.

Tolerances: FP32 programs agree with onnxruntime within rtol 1e-4, atol 1e-5 (MobileNetV2:
atol 1e-4 on logits of order 1, a different order of summation over 50 layers); FP16
programs within atol 2e-2 on outputs of order 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tf_ipu.onnx as tox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("onnx_server")  # conftest: the shared server


def _reference(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _w(rng, *shape, scale=0.3):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def small_cnn(rng: np.random.Generator, opset: int = 17) -> onnx.ModelProto:
    """Conv + BatchNorm + Relu + MaxPool + Conv(group) + GlobalAveragePool + Flatten + Gemm +
    Softmax, with a symbolic batch dimension and a Shape/Gather/Concat/Reshape subgraph."""
    x = helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 12, 12])
    y = helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 5])
    inits = [
        numpy_helper.from_array(_w(rng, 8, 3, 3, 3), "w1"), numpy_helper.from_array(_w(rng, 8), "b1"),
        numpy_helper.from_array(np.abs(_w(rng, 8)) + 0.5, "scale"), numpy_helper.from_array(_w(rng, 8), "bias"),
        numpy_helper.from_array(_w(rng, 8), "mean"), numpy_helper.from_array(np.abs(_w(rng, 8)) + 0.5, "var"),
        numpy_helper.from_array(_w(rng, 16, 2, 3, 3), "w2"),
        numpy_helper.from_array(_w(rng, 5, 16), "fc"), numpy_helper.from_array(_w(rng, 5), "fcb"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"], epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], group=4, strides=[2, 2], auto_pad="SAME_UPPER"),
        helper.make_node("Sigmoid", ["c2"], ["s2"]),
        helper.make_node("GlobalAveragePool", ["s2"], ["g"]),
        helper.make_node("Shape", ["g"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus1"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["g", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"], transB=1, alpha=2.0),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(nodes, "small_cnn", [x], [y], inits)
    return _model(graph, opset)


def _model(graph: onnx.GraphProto, opset: int) -> onnx.ModelProto:
    """A model of IR version 10 (what onnxruntime 1.31 reads; onnx 1.23 writes 14)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def control_flow_model(rng: np.random.Generator) -> onnx.ModelProto:
    """If on a run-time condition (the sum of x), and a Loop of 3 steps carrying a value and
    scanning its per-step values."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info("branch", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("carried", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("scanned", TensorProto.FLOAT, [3, 2, 3])]
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["v_in", "half"], ["hv"]),
         helper.make_node("Add", ["hv", "fi"], ["v_out"]),
         helper.make_node("Add", ["v_out", "x"], ["scan"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("scan", TensorProto.FLOAT, [2, 3])])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["branch"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trips", "", "branch"], ["carried", "scanned"], body=body),
    ]
    inits = [numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(np.int64(3), "trips"),
             numpy_helper.from_array(np.float32(0.5), "half")]
    graph = helper.make_graph(nodes, "control_flow", [x], outs, inits)
    return _model(graph, 17)


def test_small_cnn_agrees_with_onnxruntime():
    rng = np.random.default_rng(0)
    model = small_cnn(rng)
    m = tox.load(model, batch_size=4)
    x = rng.standard_normal((4, 3, 12, 12)).astype(np.float32)
    got = m.run({"image": x})["probs"]
    (ref,) = _reference(model, {"image": x})
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert m.estimate.cycles > 0 and m.estimate.fits, m.estimate.summary()
    assert m.estimate.ipu_version == "ipu2"
    assert "Shape" in m.program.op_types  # folded on the host: no instruction computes it
    assert not any(i.source_type == "Shape" for c in m.program.module.computations for i in c.instructions)


def test_control_flow_agrees_with_onnxruntime():
    rng = np.random.default_rng(1)
    model = control_flow_model(rng)
    m = tox.load(model)
    opcodes = {i.opcode for c in m.program.module.computations for i in c.instructions}
    assert {"conditional", "while"} <= opcodes
    for sign in (1.0, -1.0):
        x = (np.abs(rng.standard_normal((2, 3))) * sign).astype(np.float32)
        got = m.run({"x": x})
        ref = _reference(model, {"x": x})
        for name, r in zip(["branch", "carried", "scanned"], ref, strict=True):
            np.testing.assert_allclose(got[name], r, rtol=1e-5, atol=1e-6, err_msg=name)


def test_fp16_on_request():
    rng = np.random.default_rng(2)
    model = small_cnn(rng)
    m = tox.load(model, batch_size=2, precision="fp16", ipu_version="ipu1")
    dtypes_ = {i.shape.dtype for i in m.program.module.computations[0].instructions if i.opcode == "convolution"}
    from device_server.protocol import ir_pb2

    assert dtypes_ == {ir_pb2.F16}
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    got = m.run({"image": x})["probs"]
    assert got.dtype == np.float32
    (ref,) = _reference(model, {"image": x})
    np.testing.assert_allclose(got, ref, atol=2e-2)
    assert m.estimate.ipu_version == "ipu1"


def test_replicas_split_the_batch():
    rng = np.random.default_rng(3)
    model = small_cnn(rng)
    m = tox.load(model, batch_size=6, replicas=2)
    x = rng.standard_normal((6, 3, 12, 12)).astype(np.float32)
    got = m.run({"image": x})["probs"]
    (ref,) = _reference(model, {"image": x})
    assert got.shape == (6, 5)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert m.estimate.replicas == 2
    with pytest.raises(tox.OnnxLoadError, match="divisible by 4"):
        tox.load(model, batch_size=6, replicas=4)


def test_fault_injected_into_one_opcode_changes_the_output():
    rng = np.random.default_rng(4)
    model = small_cnn(rng)
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    good = tox.load(model, batch_size=2).run({"image": x})["probs"]
    bad = tox.load(model, batch_size=2, fault_inject_opcode="convolution").run({"image": x})["probs"]
    (ref,) = _reference(model, {"image": x})
    np.testing.assert_allclose(good, ref, rtol=1e-4, atol=1e-5)
    assert np.abs(bad - ref).max() > 1e-4


def test_errors_name_what_the_user_wrote(tmp_path):
    rng = np.random.default_rng(5)
    model = small_cnn(rng)
    path = tmp_path / "cnn.onnx"
    data = model.SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(tox.OnnxLoadError, match="cut.onnx"):
        tox.load(tmp_path / "cut.onnx", batch_size=1)
    (tmp_path / "junk.onnx").write_bytes(b"\x00\x01not a model at all\xff" * 10)
    with pytest.raises(tox.OnnxLoadError, match="junk.onnx"):
        tox.load(tmp_path / "junk.onnx", batch_size=1)
    with pytest.raises(tox.OnnxLoadError, match="batch_size="):
        tox.load(model)
    path.write_bytes(data)
    m = tox.load(path, batch_size=2)
    assert m.name == "cnn"
    x = np.zeros((2, 3, 12, 12), np.float32)
    with pytest.raises(tox.OnnxInputError, match="'picture'"):
        m.run({"picture": x})
    with pytest.raises(tox.OnnxInputError, match=r"missing"):
        m.run({})
    with pytest.raises(tox.OnnxInputError, match=r"float64.*float32"):
        m.run({"image": x.astype(np.float64)})
    with pytest.raises(tox.OnnxInputError, match=r"\[3, 3, 12, 12\].*\[2, 3, 12, 12\]"):
        m.run({"image": np.zeros((3, 3, 12, 12), np.float32)})
    # an unsupported operator: node, op_type, domain, opset
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    bad.graph.node[2].op_type = "Hardmax"  # in opset 17, not mapped (in Relu's slot)
    bad.graph.node[2].name = "activation_1"
    with pytest.raises(tox.UnsupportedOnnxError) as info:
        tox.load(bad, batch_size=1)
    msg = str(info.value)
    assert "'activation_1'" in msg and "Hardmax" in msg and "ai.onnx" in msg and "opset 17" in msg
    assert (info.value.node, info.value.op_type, info.value.opset) == ("activation_1", "Hardmax", 17)
    # an attribute value with no mapping
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    gelu = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"], approximate="sigmoid", name="g1")],
                             "gelu", [xi], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(tox.UnsupportedOnnxError, match=r"'g1' \(Gelu, domain ai.onnx, opset 20\).*sigmoid"):
        tox.load(_model(gelu, 20))
    # a data type no IPU has
    f8 = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E4M3FN, name="c8")],
                           "f8", [xi], [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [2])])
    with pytest.raises(tox.UnsupportedOnnxError, match="'c8'.*FLOAT8E4M3FN") as info:
        tox.load(_model(f8, 19))
    assert info.value.dtype == "FLOAT8E4M3FN"
    # the server is unaffected: the good model still runs
    assert m.run({"image": x})["probs"].shape == (2, 5)


def test_old_opsets_go_through_the_version_converter():
    rng = np.random.default_rng(6)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Softmax", ["r"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "old", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 6)])
    model.ir_version = 3
    m = tox.load(model)
    assert m.opset == 7
    xv = rng.standard_normal((2, 4)).astype(np.float32)
    e = np.exp(np.maximum(xv, 0))
    np.testing.assert_allclose(m.run({"x": xv})["y"], e / e.sum(1, keepdims=True), rtol=1e-5)
    newer = helper.make_model(helper.make_graph(nodes, "new", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 99)])
    with pytest.raises(tox.OnnxLoadError, match="opset 99"):
        tox.load(newer)


def test_mobilenet_v2_from_tf2onnx_agrees_with_onnxruntime():
    tf = pytest.importorskip("tensorflow")
    import keras
    import tf2onnx

    keras.utils.set_random_seed(7)
    net = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)
    spec = (tf.TensorSpec((None, 32, 32, 3), tf.float32, name="image"),)
    fn = tf.function(lambda x: net(x, training=False))
    model, _ = tf2onnx.convert.from_function(fn, input_signature=spec, opset=17)
    input_name = model.graph.input[0].name
    m = tox.load(model, batch_size=2)
    x = np.random.default_rng(8).random((2, 32, 32, 3), np.float32)
    got = list(m.run({input_name: x}).values())[0]
    (ref,) = _reference(model, {input_name: x})
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4)
    assert m.estimate.cycles > 0


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from onnx import TensorProto, helper
    import tf_ipu.onnx
    from tf_ipu.onnx.backend import TfIpuBackend

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    model = helper.make_model(helper.make_graph([helper.make_node("Tanh", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    xv = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    (out,) = TfIpuBackend.run_model(model, [xv])
    assert np.allclose(out, np.tanh(xv), atol=1e-6), out
    out = tf_ipu.onnx.load(model).run({"x": xv})["y"]
    assert np.allclose(out, np.tanh(xv), atol=1e-6), out
    loaded = [m for m in ("tensorflow", "keras", "onnxruntime", "onnx.reference") if m in sys.modules]
    print("LOADED", loaded)
""")


def test_onnx_front_end_imports_neither_tensorflow_nor_a_reference_runtime(device_server):
    env = {**os.environ, "TF_IPU_SERVER": device_server,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout, proc.stdout


def test_cli_sweeps_batch_sizes_and_writes_the_report(tmp_path, device_server, capsys):
    from tf_ipu.onnx.__main__ import main

    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(np.random.default_rng(9)), path)
    html = tmp_path / "report.html"
    assert main([str(path), "--ipu-version", "ipu1", "--batch-sizes", "1,4", "--html", str(html),
                 "--server", device_server]) == 0
    out = capsys.readouterr().out
    assert "batch     1:" in out and "batch     4:" in out and "on ipu1" in out
    assert "Batch-size sweep" in html.read_text()
