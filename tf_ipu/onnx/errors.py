"""Errors of the ONNX front end: each names what the user wrote (the file, the node, the
input) so that a refusal says what to change.

    OnnxError (ValueError)
     |- OnnxLoadError        the file or ModelProto cannot be read (malformed, truncated,
     |                       opset out of range, failed version conversion)
     |- UnsupportedOnnxError an operator, attribute or data type the importer does not map
     |                       (names node, op_type, domain, opset)
     '- OnnxInputError       run() got a missing/unknown input or a wrong shape or dtype
"""

from __future__ import annotations


class OnnxError(ValueError):
    """Base class of the ONNX front end's errors."""


class OnnxLoadError(OnnxError):
    """The model cannot be read."""


class UnsupportedOnnxError(OnnxError):
    """An operator, attribute or data type the importer does not map onto the IR.

    Attributes:
        node: the node's name ("" if unnamed), op_type, domain, opset: where.
        dtype: the ONNX data type name when a data type is what is refused (e.g. "FLOAT8E4M3FN").
    """

    def __init__(self, message: str, node: str = "", op_type: str = "", domain: str = "",
                 opset: int = 0, dtype: str = "") -> None:
        self.node, self.op_type, self.domain, self.opset, self.dtype = node, op_type, domain, opset, dtype
        super().__init__(message)


class OnnxInputError(OnnxError):
    """run() was given inputs that do not match the model."""
