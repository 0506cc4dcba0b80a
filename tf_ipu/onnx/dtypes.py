"""ONNX element types and the numpy dtypes the IR carries (docs/onnx.md, "Data types").

Types no IPU has (8-bit, 4-bit and 2-bit floats and integers, E8M0 scales) and strings are
refused by name; ``NO_IPU_TYPES`` lists the former, which the conformance test counts apart.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto

_NUMPY: dict[int, np.dtype] = {
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.INT8: np.dtype(np.int8),
    TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.INT16: np.dtype(np.int16),
    TensorProto.INT32: np.dtype(np.int32),
    TensorProto.INT64: np.dtype(np.int64),
    TensorProto.BOOL: np.dtype(np.bool_),
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.DOUBLE: np.dtype(np.float64),
    TensorProto.UINT32: np.dtype(np.uint32),
    TensorProto.UINT64: np.dtype(np.uint64),
    TensorProto.COMPLEX64: np.dtype(np.complex64),
    TensorProto.COMPLEX128: np.dtype(np.complex128),
    TensorProto.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}
_ONNX: dict[np.dtype, int] = {v: k for k, v in _NUMPY.items()}

#: ONNX types no IPU computes in (refused cleanly; the conformance list counts them apart).
NO_IPU_TYPES = frozenset(
    name for name in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "UINT4",
                      "INT4", "FLOAT4E2M1", "FLOAT8E8M0", "UINT2", "INT2")
    if hasattr(TensorProto, name)
)


def type_name(elem_type: int) -> str:
    """ONNX's name of an element type, e.g. ``FLOAT16``."""
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"data type #{elem_type}"


def to_numpy(elem_type: int) -> np.dtype | None:
    """The numpy dtype of an ONNX element type, or None if the IR has none."""
    return _NUMPY.get(elem_type)


def to_onnx(dtype: np.dtype) -> int:
    return _ONNX[np.dtype(dtype)]


def is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"
