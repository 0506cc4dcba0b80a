"""Fixes the model's symbolic dimensions, so that every shape the importer sees is static.

    graph input  x: float[N, seq, 3]   (N, seq: dim_param; or an unknown dim)
      input_shapes={"x": (8, 128, 3)}   the whole shape of an input, or
      input_shapes={"seq": 128}         the size of a named symbolic dimension
      batch_size=8                      the leading dimension, where it is symbolic
    -> InputSpec("x", float32, (8, 128, 3))

A dimension still unknown after that is an error naming the input, the dimension and its
symbol. A given shape that contradicts a static dimension of the model is one too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from tf_ipu.onnx import dtypes
from tf_ipu.onnx.errors import OnnxLoadError, UnsupportedOnnxError


@dataclass(frozen=True)
class InputSpec:
    """One input of the model as run() takes it."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def __repr__(self) -> str:
        return f"{self.name}: {self.dtype}{list(self.shape)}"


def model_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs that are not initializers (IR < 4 lists weights as inputs too)."""
    inits = {t.name for t in graph.initializer}
    return [v for v in graph.input if v.name not in inits]


def tensor_dtype(info: onnx.ValueInfoProto, what: str) -> np.dtype:
    kind = info.type.WhichOneof("value")
    if kind != "tensor_type":
        raise UnsupportedOnnxError(
            f"{what} {info.name!r} is a {kind or 'value of no type'}; only tensors are supported "
            "(sequences, maps and optionals are not).")
    elem = info.type.tensor_type.elem_type
    dt = dtypes.to_numpy(elem)
    if dt is None:
        name = dtypes.type_name(elem)
        raise UnsupportedOnnxError(f"{what} {info.name!r} has data type {name}, which the IPU does not have.",
                                   dtype=name)
    return dt


def fix_inputs(graph: onnx.GraphProto, batch_size: int | None,
               input_shapes: Mapping[str, Sequence[int] | int] | None) -> list[InputSpec]:
    """The model's inputs with static shapes (see the module docstring)."""
    given = dict(input_shapes or {})
    inputs = model_inputs(graph)
    names = {v.name for v in inputs}
    symbols = {d.dim_param for v in inputs if v.type.HasField("tensor_type")
               for d in v.type.tensor_type.shape.dim if d.dim_param}
    unknown = [k for k in given if k not in names and k not in symbols]
    if unknown:
        raise OnnxLoadError(
            f"input_shapes names {unknown}, which is neither an input of the model "
            f"({sorted(names)}) nor one of its symbolic dimensions ({sorted(symbols)}).")
    specs = []
    for v in inputs:
        dt = tensor_dtype(v, "Input")
        tt = v.type.tensor_type
        if v.name in given:
            shape = given[v.name]
            if isinstance(shape, int):
                raise OnnxLoadError(f"input_shapes[{v.name!r}] must be a shape (a sequence of ints), not {shape}.")
            shape = tuple(int(d) for d in shape)
            if tt.HasField("shape"):
                model_dims = tt.shape.dim
                if len(model_dims) != len(shape):
                    raise OnnxLoadError(
                        f"input_shapes[{v.name!r}] = {list(shape)} has rank {len(shape)}; the model's "
                        f"input {v.name!r} has rank {len(model_dims)}.")
                for i, (d, s) in enumerate(zip(model_dims, shape, strict=True)):
                    if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != s:
                        raise OnnxLoadError(
                            f"input_shapes[{v.name!r}] = {list(shape)} sets dimension {i} to {s}; "
                            f"the model fixes it at {d.dim_value}.")
            specs.append(InputSpec(v.name, dt, shape))
            continue
        if not tt.HasField("shape"):
            raise OnnxLoadError(f"Input {v.name!r} has no shape in the model: give it with "
                                f"input_shapes={{{v.name!r}: (...)}}.")
        dims = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.dim_param and isinstance(given.get(d.dim_param), int):
                dims.append(int(given[d.dim_param]))
            elif i == 0 and batch_size is not None:
                dims.append(int(batch_size))
            else:
                symbol = f" ({d.dim_param!r})" if d.dim_param else ""
                hint = "batch_size=" if i == 0 else f"input_shapes={{{(d.dim_param or v.name)!r}: ...}}"
                raise OnnxLoadError(
                    f"Input {v.name!r}: dimension {i}{symbol} is symbolic; give its size with {hint}.")
        specs.append(InputSpec(v.name, dt, tuple(dims)))
    return specs
