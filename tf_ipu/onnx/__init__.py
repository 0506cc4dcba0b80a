"""tf_ipu.onnx: ONNX models on the emulated IPU, without TensorFlow.

    tf_ipu.onnx.load(path | ModelProto, batch_size=, input_shapes=, precision=, ipu_version=,
                     replicas=, system=)  ->  OnnxModel: .run({name: array}) -> {name: array}, .estimate
      loader.py     read, check, opset (older than 7: onnx's version converter)
      shapes.py     symbolic dimensions fixed (batch size, input_shapes)
      importer.py   nodes -> IR (docs/ir.md); fold.py: shape subgraphs on the host;
                    ops_*.py: one handler per operator (registry.py); ir_builder.py
      device.py     sessions on the device server (embedded by default)
      model.py      OnnxModel: compile, run, estimate
      backend.py    onnx.backend.base.Backend (onnx's conformance tests run through it)
      __main__.py   python -m tf_ipu.onnx model.onnx --batch-sizes 1,2,4 --html report.html
      gpu_roofline.py  a GPU's roofline on the same ONNX graph (V100 by default), for
                    IPU/GPU comparisons (imported on its own: tf_ipu.onnx.gpu_roofline)

docs/onnx.md lists the supported operators. Every result is computed by the emulator's
kernels on the device server; nothing runs through onnxruntime or onnx.reference.
"""

from __future__ import annotations

from tf_ipu.onnx.device import set_default_server
from tf_ipu.onnx.errors import OnnxError, OnnxInputError, OnnxLoadError, UnsupportedOnnxError
from tf_ipu.onnx.model import OnnxModel, load
from tf_ipu.onnx.registry import OPS

__all__ = ["OPS", "OnnxError", "OnnxInputError", "OnnxLoadError", "OnnxModel", "UnsupportedOnnxError",
           "load", "set_default_server"]
