"""What an operator's handler sees of one ONNX node (``Ctx``): its inputs as ``Val``s, its
attributes, the opset, the computation to write into, and errors that name the node.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from tf_ipu.onnx.errors import UnsupportedOnnxError
from tf_ipu.onnx.ir_builder import Comp, Val


class NeedsInputValue(UnsupportedOnnxError):
    """A node needs the value of a model input at load time (e.g. Reshape's shape given as an
    input): the backend then compiles per value of ``input_name``."""

    def __init__(self, message: str, input_name: str, **where: Any) -> None:
        self.input_name = input_name
        super().__init__(message, **where)


class Ctx:
    """What a handler sees of one node."""

    def __init__(self, imp: Any, node: onnx.NodeProto, comp: Comp, inputs: list[Val | None],
                 opset: int) -> None:
        self.imp, self.node, self.comp, self.inputs, self.opset = imp, node, comp, inputs, opset
        self.attrs = {a.name: a for a in node.attribute}

    @property
    def float_type(self) -> np.dtype:
        return self.imp.float_type

    def where(self) -> dict[str, Any]:
        return {"node": self.node.name, "op_type": self.node.op_type,
                "domain": self.node.domain or "ai.onnx", "opset": self.opset}

    def describe(self) -> str:
        name = f"{self.node.name!r} " if self.node.name else f"(unnamed, output {self.node.output[0]!r}) "
        return f"node {name}({self.node.op_type}, domain {self.node.domain or 'ai.onnx'}, opset {self.opset})"

    def refuse(self, why: str, dtype: str = "") -> UnsupportedOnnxError:
        return UnsupportedOnnxError(f"ONNX {self.describe()}: {why}", dtype=dtype, **self.where())

    def attr(self, name: str, default: Any = None) -> Any:
        a = self.attrs.get(name)
        if a is None:
            return default
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, onnx.TensorProto):
            return self.imp.tensor_value(v, f"attribute {name!r} of {self.describe()}")
        if isinstance(v, list) and v and isinstance(v[0], bytes):
            return [x.decode() for x in v]
        return v

    def has(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] is not None

    def input(self, i: int) -> Val:
        if not self.has(i):
            raise self.refuse(f"input {i} is required")
        v = self.inputs[i]
        assert v is not None
        return v

    def const(self, i: int, what: str) -> np.ndarray | None:
        """The host value of input ``i`` (None if absent); it must be known at load time."""
        if not self.has(i):
            return None
        v = self.inputs[i]
        assert v is not None
        if v.const is not None:
            return v.const
        name = self.node.input[i]
        if name in self.imp.input_names:
            raise NeedsInputValue(
                f"ONNX {self.describe()}: its {what} (input {i}, {name!r}) is a model input; its "
                f"value must be known when the model is compiled: give it with "
                f"input_values={{{name!r}: ...}}.", name, **self.where())
        raise self.refuse(f"its {what} (input {i}, {name!r}) must be computable from shapes and "
                          "initializers at load time; here it depends on run-time data")

    def one_value(self, value: Any, what: str) -> Any:
        """The single element of ``value`` (a scalar or a one-element tensor); anything else
        is refused naming ``what``."""
        flat = np.asarray(value).reshape(-1)
        if flat.size != 1:
            raise self.refuse(f"its {what} must hold one value, not {flat.size}")
        return flat[0]

    def axis(self, axis: int, rank: int, what: str = "axis") -> int:
        if not -rank <= axis < max(rank, 1):
            raise self.refuse(f"{what} {axis} is out of range for rank {rank}")
        return axis % rank if rank else 0
