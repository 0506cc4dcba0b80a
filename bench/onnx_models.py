"""ONNX models made by tools no one here wrote, for the ONNX benchmarks (bench/bench_onnx.py)
and tests (tests/test_onnx_models.py).

    keras_to_onnx(model, (224, 224, 3))   tf2onnx (1.17.0, pinned in requirements.txt):
                                          tf2onnx.convert.from_function on a tf.function
                                          wrapping the model (inference), leading dim symbolic
    resnext101_onnx()                     ResNeXt-101 32x4d from tf_ipu/models/resnext.py
    resnet50_onnx()                       keras.applications.ResNet50(weights=None)
    LIGHT_MODELS, light_model(name, seed) onnx's light real-architecture models (the graphs of
                                          test_resnet50, ... shipped in onnx's wheel) with
                                          random weights, seeded (see light_model)

Grouped convolutions: Keras 3 runs ``Conv2D(groups=G)`` through a ``tf.function(jit_compile=
True)`` (TensorFlow's CPU kernels lack grouped convolutions), which tf2onnx 1.17 leaves in the
graph as an opaque ``StatefulPartitionedCall``. The export traces the same convolution as
TensorFlow's own ``Conv2D`` op (its input has G times the kernel's input channels), which
tf2onnx maps to ONNX ``Conv`` with ``group=G``; nothing runs in TensorFlow, so its CPU kernels
are never needed. The model's weights and layers are unchanged.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: the opset the exports use (tf2onnx 1.17 writes up to 18; tf_ipu.onnx reads 7..28)
OPSET = 17


@contextlib.contextmanager
def _grouped_conv_as_tf_conv2d() -> Iterator[None]:
    """Keras' TensorFlow backend traces grouped convolutions without its XLA wrapper."""
    import tensorflow as tf
    from keras.src.backend.tensorflow import nn as tf_nn

    original = tf_nn.conv

    def conv(inputs: Any, kernel: Any, strides: Any = 1, padding: str = "valid",
             data_format: Any = None, dilation_rate: Any = 1) -> Any:
        from keras.src import backend

        fmt = backend.standardize_data_format(data_format)
        channels = inputs.shape[-1] if fmt == "channels_last" else inputs.shape[1]
        if channels == kernel.shape[-2] or len(inputs.shape) != 4:
            return original(inputs, kernel, strides, padding, data_format, dilation_rate)
        return tf.nn.convolution(inputs, kernel, strides, padding.upper(),
                                 data_format="NHWC" if fmt == "channels_last" else "NCHW",
                                 dilations=dilation_rate)

    tf_nn.conv = conv
    try:
        yield
    finally:
        tf_nn.conv = original


def keras_to_onnx(model: Any, input_shape: Sequence[int], *, input_name: str = "input",
                  opset: int = OPSET, dtype: str = "float32") -> Any:
    """``model`` (Keras, one input of ``input_shape`` without the batch dimension) as an
    ``onnx.ModelProto`` of its inference function; the batch dimension stays symbolic."""
    import tensorflow as tf
    import tf2onnx

    spec = (tf.TensorSpec((None, *input_shape), getattr(tf, dtype), name=input_name),)
    fn = tf.function(lambda x: model(x, training=False))
    with _grouped_conv_as_tf_conv2d():
        proto, _ = tf2onnx.convert.from_function(fn, input_signature=spec, opset=opset)
    opaque = [n.name for n in proto.graph.node if n.op_type in ("StatefulPartitionedCall", "PartitionedCall")]
    if opaque:
        raise RuntimeError(f"tf2onnx left {len(opaque)} TensorFlow function call(s) in the graph: {opaque[:3]}")
    return proto


def resnext101_onnx(image_size: int = 224, seed: int = 0) -> Any:
    """ResNeXt-101 32x4d (tf_ipu/models/resnext.py, random weights seeded) as ONNX."""
    import keras

    from tf_ipu.models.resnext import resnext

    keras.utils.set_random_seed(seed)
    net = resnext(depth=101, cardinality=32, width=4, input_shape=(image_size, image_size, 3))
    return keras_to_onnx(net, (image_size, image_size, 3))


def resnet50_onnx(image_size: int = 224, seed: int = 0) -> Any:
    """keras.applications.ResNet50 (weights=None, seeded) as ONNX."""
    import keras

    keras.utils.set_random_seed(seed)
    net = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3))
    return keras_to_onnx(net, (image_size, image_size, 3))


#: onnx's model tests of real architectures (``test_<name>``), as its wheel ships them
LIGHT_MODELS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
                "squeezenet", "vgg19", "zfnet512")


def light_model_path(name: str) -> Path:
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"


def light_model(name: str, seed: int = 0) -> Any:
    """onnx's light model ``name`` with every float weight replaced by seeded random values.

    The light models hold their weights as ``ConstantOfShape`` nodes (one value repeated) and
    a few float initializers; each becomes an initializer of the same shape: tensors of 2 or
    more dimensions ~ N(0, 2 / fan_in) (fan_in: the product of the dimensions after the first
    for convolution kernels, the contracted dimension for Gemm/MatMul weights), vectors and
    scalars (biases, batch-norm scale/shift/mean/variance) ~ U(0.5, 1.5), so that variances
    stay positive. The model is otherwise onnx's (IR version set to 10 for onnxruntime).
    """
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(light_model_path(name))
    g = model.graph
    rng = np.random.default_rng(seed)
    consumers: dict[str, tuple[str, int, bool]] = {}
    for node in g.node:
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        for k, i in enumerate(node.input):
            consumers.setdefault(i, (node.op_type, k, trans_b))

    def values(tensor_name: str, shape: Sequence[int], dtype: Any) -> Any:
        shape = tuple(int(d) for d in shape)
        if len(shape) >= 2:
            op, _, trans_b = consumers.get(tensor_name, ("", 0, False))
            if op in ("Gemm", "MatMul") and len(shape) == 2:
                fan_in = shape[1] if op == "Gemm" and trans_b else shape[0]
            else:
                fan_in = math.prod(shape[1:])
            v = rng.standard_normal(shape) * math.sqrt(2.0 / max(1, fan_in))
        else:
            v = rng.uniform(0.5, 1.5, shape)
        return v.astype(dtype)

    shapes = {t.name: numpy_helper.to_array(t) for t in g.initializer if t.data_type == onnx.TensorProto.INT64}
    new_inits, kept_nodes = [], []
    for node in g.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if (node.op_type == "ConstantOfShape" and node.input and node.input[0] in shapes and value is not None
                and value.data_type == onnx.TensorProto.FLOAT):
            new_inits.append(numpy_helper.from_array(values(node.output[0], shapes[node.input[0]], np.float32),
                                                     node.output[0]))
        else:
            kept_nodes.append(node)
    for i, t in enumerate(g.initializer):
        if t.data_type == onnx.TensorProto.FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(values(t.name, t.dims, np.float32), t.name))
    del g.node[:]
    g.node.extend(kept_nodes)
    g.initializer.extend(new_inits)
    weights = {t.name for t in g.initializer}
    used = {i for n in g.node for i in n.input}
    keep = [t for t in g.initializer if t.name in used or t.name in {o.name for o in g.output}]
    del g.initializer[:]
    g.initializer.extend(keep)
    inputs = [v for v in g.input if v.name not in weights]
    del g.input[:]
    g.input.extend(inputs)  # IR >= 4: weights are not graph inputs
    model.ir_version = 10
    return model


def with_logits(model: Any) -> Any:
    """``model`` with the input of each Softmax that makes a graph output added as an output
    too (a saturated softmax hides differences in the logits)."""
    import onnx

    outputs = {o.name for o in model.graph.output}
    wanted = [n.input[0] for n in model.graph.node
              if n.op_type == "Softmax" and n.output[0] in outputs and n.input[0] not in outputs]
    if wanted:
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
        for name in dict.fromkeys(wanted):
            model.graph.output.append(inferred[name])
    return model
