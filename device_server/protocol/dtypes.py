"""Conversions between numpy arrays and the wire/IR types (``ir_pb2.DType``, ``Tensor``).

Everything crosses the wire as raw little-endian bytes plus a dtype and dims: no pickle.
``fill_tensor`` encodes and ``from_tensor`` decodes, for the client and the server alike.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from device_server.protocol import device_pb2, ir_pb2

_TO_NUMPY: dict[int, np.dtype] = {
    ir_pb2.PRED: np.dtype(np.bool_),
    ir_pb2.S8: np.dtype(np.int8),
    ir_pb2.S16: np.dtype(np.int16),
    ir_pb2.S32: np.dtype(np.int32),
    ir_pb2.S64: np.dtype(np.int64),
    ir_pb2.U8: np.dtype(np.uint8),
    ir_pb2.U16: np.dtype(np.uint16),
    ir_pb2.U32: np.dtype(np.uint32),
    ir_pb2.U64: np.dtype(np.uint64),
    ir_pb2.F16: np.dtype(np.float16),
    ir_pb2.BF16: np.dtype(ml_dtypes.bfloat16),
    ir_pb2.F32: np.dtype(np.float32),
    ir_pb2.F64: np.dtype(np.float64),
    ir_pb2.C64: np.dtype(np.complex64),
    ir_pb2.C128: np.dtype(np.complex128),
}
_FROM_NUMPY: dict[np.dtype, int] = {v: k for k, v in _TO_NUMPY.items()}


class DTypeError(ValueError):
    """A dtype that has no wire representation."""


def to_numpy(dtype: int) -> np.dtype:
    """Returns the numpy dtype of an ``ir_pb2.DType`` value."""
    try:
        return _TO_NUMPY[dtype]
    except KeyError:
        raise DTypeError(f"Unsupported element type {ir_pb2.DType.Name(dtype) if dtype in ir_pb2.DType.values() else dtype}.") from None


def from_numpy(dtype: np.dtype | type) -> int:
    """Returns the ``ir_pb2.DType`` value of a numpy dtype."""
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise DTypeError(f"No wire type for numpy dtype {np.dtype(dtype)}.") from None


def dtype_name(dtype: int) -> str:
    """Returns the IR spelling of a dtype, e.g. ``"F32"``."""
    return ir_pb2.DType.Name(dtype) if dtype in ir_pb2.DType.values() else f"dtype#{dtype}"


def fill_tensor(tensor: device_pb2.Tensor, array: Any, with_data: bool = True) -> None:
    """Packs an array into a wire ``Tensor`` that is already part of a message (row-major,
    little-endian; building a Tensor and appending it would copy the data once more: ~13 ms
    per 4 MiB). ``with_data=False`` sends dtype and dims only (a value that stays on the
    device). The one encoder of the protocol: the client and the server both use it.
    Raises ``DTypeError`` for a dtype the wire does not have."""
    a = np.asarray(array, order="C")
    dt = a.dtype
    if dt.byteorder == ">":
        a = a.astype(dt.newbyteorder("<"))
        dt = a.dtype
    code = _FROM_NUMPY.get(dt)
    tensor.dtype = from_numpy(dt) if code is None else code
    tensor.dims.extend(a.shape)
    if with_data:
        tensor.data = a.tobytes()


def to_tensor(array: np.ndarray) -> device_pb2.Tensor:
    """Packs a numpy array into a new wire ``Tensor`` (see ``fill_tensor``)."""
    tensor = device_pb2.Tensor()
    fill_tensor(tensor, array)
    return tensor


def from_tensor(tensor: device_pb2.Tensor, *, what: str = "tensor") -> np.ndarray:
    """Unpacks a wire ``Tensor``; raises ``ValueError`` naming ``what`` if its size is off."""
    dt = _TO_NUMPY.get(tensor.dtype)
    if dt is None:
        dt = to_numpy(tensor.dtype)  # raises DTypeError
    dims = tuple(tensor.dims)  # Python ints already
    if dims and min(dims) < 0:
        raise ValueError(f"{what}: negative dimension in dims={list(dims)}.")
    count = 1
    for d in dims:
        count *= d
    expected = count * dt.itemsize
    data = tensor.data  # each read of a bytes field is a copy: read it once
    if len(data) != expected:
        raise ValueError(
            f"{what}: {dtype_name(tensor.dtype)}{list(dims)} needs {expected} bytes, "
            f"received {len(data)}."
        )
    a = np.frombuffer(data, dtype=dt)
    return a if len(dims) == 1 else a.reshape(dims)
