"""IR shapes and literals as numpy values: the vocabulary every stage of the emulator shares.

    ir_pb2.Shape   --_shape_of-->        (np.dtype, dims)   (None, () for tuples and tokens)
                   --_leaves-->          the array shapes of a (nested) tuple shape
    ir_pb2.Literal --literal_to_value--> a read-only array (or tuple of them)
    a value        --_freeze-->          the same, read-only;  --_nbytes--> its bytes

``_fits`` says whether an array's shape is a value of a shape with dynamic dimensions (at
most the bound there, equal elsewhere).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from device_server.emulator.errors import InvalidProgramError
from device_server.protocol import dtypes, ir_pb2

__all__ = ["literal_to_value"]


def _shape_of(shape: ir_pb2.Shape) -> tuple[np.dtype | None, tuple[int, ...]]:
    if shape.is_tuple or shape.dtype == ir_pb2.TOKEN:
        return None, ()
    return dtypes.to_numpy(shape.dtype), tuple(int(d) for d in shape.dims)


def _leaves(shape: ir_pb2.Shape) -> list[ir_pb2.Shape]:
    if shape.is_tuple:
        return [leaf for s in shape.tuple_shapes for leaf in _leaves(s)]
    return [shape]


def _fits(shape: tuple[int, ...], bounds: tuple[int, ...], flags: tuple[bool, ...]) -> bool:
    """Whether an array of ``shape`` is a value of a shape with these bounds and dynamic
    dimensions (a dynamic dimension's size is at most its bound, a static one's is equal)."""
    return len(shape) == len(bounds) and all(
        n == b or (dy and n <= b) for n, b, dy in zip(shape, bounds, flags, strict=True)
    )


def literal_to_value(lit: ir_pb2.Literal, what: str = "literal") -> Any:
    """A read-only numpy array (or a tuple of them) holding an IR literal's value."""
    if lit.shape.is_tuple:
        return tuple(literal_to_value(e, what) for e in lit.tuple_elements)
    if lit.shape.dtype == ir_pb2.TOKEN:
        return ()
    dt = dtypes.to_numpy(lit.shape.dtype)
    dims = tuple(int(d) for d in lit.shape.dims)
    count = int(np.prod(dims, dtype=np.int64))
    if len(lit.data) != count * dt.itemsize:
        raise InvalidProgramError(
            f"{what}: {dtypes.dtype_name(lit.shape.dtype)}{list(dims)} needs "
            f"{count * dt.itemsize} bytes, literal has {len(lit.data)}."
        )
    arr = np.frombuffer(lit.data, dtype=dt.newbyteorder("<")).astype(dt, copy=False).reshape(dims)
    arr.flags.writeable = False
    return arr


def _freeze(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.view()
        value.flags.writeable = False
    elif isinstance(value, tuple):
        value = tuple(_freeze(v) for v in value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, tuple):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0))
