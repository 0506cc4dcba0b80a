"""onnx's backend interface over tf_ipu.onnx, so that onnx's conformance tests
(``onnx.backend.test.BackendTest``) run on the emulated IPU.

    BackendTest ── prepare(model, "CPU") ──> TfIpuBackendRep ── run([arrays]) ──> outputs
                                               compiled per input shapes (and per value of
                                               inputs the model needs at load time, e.g. a
                                               Reshape shape given as an input)

"CPU" is the only device name answered: it is where onnx's tests say a backend runs; here it
means the host that talks to the device server. Results come from the emulator's kernels;
neither onnxruntime nor onnx.reference is imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from tf_ipu.onnx.importer import NeedsInputValue
from tf_ipu.onnx.loader import prepare_model, read_model
from tf_ipu.onnx.model import OnnxModel, load
from tf_ipu.onnx.shapes import model_inputs


class TfIpuBackendRep(BackendRep):
    """A prepared model: compiled for the shapes (and load-time values) it is run with."""

    def __init__(self, model: onnx.ModelProto, options: Mapping[str, Any]) -> None:
        self.model = model
        self.options = dict(options)
        self.input_names = [v.name for v in model_inputs(model.graph)]
        self.output_names = [o.name for o in model.graph.output]
        self.value_inputs: list[str] = []  # inputs compiled in by value
        self._compiled: dict[tuple, OnnxModel] = {}
        static = all(v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape") and all(
            d.HasField("dim_value") for d in v.type.tensor_type.shape.dim) for v in model_inputs(model.graph))
        if static:
            try:
                self._compile({}, {})  # refusals surface at prepare
            except NeedsInputValue as e:
                self.value_inputs.append(e.input_name)  # compiled at run, with its value

    def _compile(self, shapes: Mapping[str, tuple[int, ...]], values: Mapping[str, np.ndarray]) -> OnnxModel:
        key = (tuple(sorted(shapes.items())),
               tuple((k, v.dtype.str, v.shape, v.tobytes()) for k, v in sorted(values.items())))
        if key not in self._compiled:
            self._compiled[key] = load(self.model, input_shapes=dict(shapes) or None,
                                       input_values=dict(values) or None, **self.options)
        return self._compiled[key]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, Mapping):
            feeds = {k: np.asarray(v) for k, v in inputs.items()}
        else:
            arrays = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            feeds = {n: np.asarray(a) for n, a in zip(self.input_names, arrays, strict=False)}
        shapes = {k: tuple(v.shape) for k, v in feeds.items() if k not in self.value_inputs}
        values = {k: feeds[k] for k in self.value_inputs if k in feeds}
        while True:
            try:
                m = self._compile(shapes, values)
                break
            except NeedsInputValue as e:
                if e.input_name in values or e.input_name not in feeds:
                    raise
                self.value_inputs.append(e.input_name)
                shapes.pop(e.input_name, None)
                values[e.input_name] = feeds[e.input_name]
        out = m.run({k: v for k, v in feeds.items() if k not in values})
        return tuple(out[n] for n in self.output_names)


class TfIpuBackend(Backend):
    """``onnx.backend.base.Backend`` on the emulated IPU (``tf_ipu.onnx.load`` underneath).

    Keyword arguments of ``prepare``/``run_model`` go to ``load`` (``ipu_version``,
    ``precision``, ``server``, ...).
    """

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> TfIpuBackendRep:
        proto, name = read_model(model)
        proto = prepare_model(proto, repr(name))
        return TfIpuBackendRep(proto, kwargs)

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[np.ndarray, ...]:
        """Runs one node on ``inputs`` (a model of that node alone)."""
        arrays = [np.asarray(a) for a in inputs]
        names = [n for n in node.input if n]
        graph_inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                                           a.shape) for n, a in zip(names, arrays, strict=False)]
        outputs = []
        for k, n in enumerate(o for o in node.output if o):
            if outputs_info and k < len(outputs_info):
                dt, shape = outputs_info[k]
                outputs.append(onnx.helper.make_tensor_value_info(
                    n, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape))
            else:
                outputs.append(onnx.helper.make_empty_tensor_value_info(n))
        graph = onnx.helper.make_graph([node], "node", graph_inputs, outputs)
        domain = node.domain or ""
        opset = kwargs.pop("opset_version", None) or onnx.defs.onnx_opset_version()
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(domain, opset)])
        return cls.run_model(model, dict(zip(names, arrays, strict=False)), device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return str(device).upper().startswith("CPU")


prepare = TfIpuBackend.prepare
run_model = TfIpuBackend.run_model
run_node = TfIpuBackend.run_node
supports_device = TfIpuBackend.supports_device
