"""Writes IR (``protos/device_server/protocol/ir.proto``, contract in docs/ir.md): one
``Comp`` per computation of a module, with numpy-style helpers on top of the opcodes.

    importer ──Val (host constant | IR value)──> Comp.use / Comp.op / Comp.binary ...
                                                  └─> ir_pb2.Module (entry first)

A ``Val`` is what an ONNX tensor name stands for while importing: its dtype and static shape,
and either a value known on the host (``const``: shape arithmetic, weights) or the id of the
instruction computing it in one computation. Host constants become ``constant``
instructions where an instruction needs them (once per computation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_server.protocol import dtypes, ir_pb2


@dataclass(eq=False)
class Val:
    """One tensor while importing: dtype, static shape, and a host value or an IR value."""

    dtype: np.dtype
    shape: tuple[int, ...]
    const: np.ndarray | None = None
    comp: Comp | None = None
    id: int = -1

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @staticmethod
    def of(value: Any, dtype: Any = None) -> Val:
        a = np.asarray(value, dtype=dtype, order="C")
        return Val(a.dtype, tuple(int(d) for d in a.shape), const=a)


def shape_of(dtype: Any, dims: Sequence[int]) -> ir_pb2.Shape:
    return ir_pb2.Shape(dtype=dtypes.from_numpy(np.dtype(dtype)), dims=[int(d) for d in dims])


def _literal(a: np.ndarray) -> ir_pb2.Literal:
    a = np.asarray(a, order="C")
    data = a.astype(np.uint8).tobytes() if a.dtype == np.bool_ else a.tobytes()
    return ir_pb2.Literal(shape=shape_of(a.dtype, a.shape), data=data)


def _compare_type(dtype: np.dtype) -> str:
    if dtype.kind in "fc" or dtype.name == "bfloat16":
        return "FLOAT"
    return "UNSIGNED" if dtype.kind in "ub" else "SIGNED"


def lowest(dtype: np.dtype) -> Any:
    """The identity of ``max`` for ``dtype``."""
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return -np.inf
    if dtype.kind == "b":
        return False
    return np.iinfo(dtype).min


def highest(dtype: np.dtype) -> Any:
    """The identity of ``min`` for ``dtype``."""
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return np.inf
    if dtype.kind == "b":
        return True
    return np.iinfo(dtype).max


class ModuleBuilder:
    """A module under construction; computations get ids in creation order."""

    def __init__(self, name: str) -> None:
        self.module = ir_pb2.Module(name=name, frontend="onnx")
        self._reducers: dict[tuple[str, str], int] = {}
        self._names = 0
        self._ids = 0

    def next_id(self) -> int:
        """Instruction ids are unique in the module (the tile model keys shapes by id)."""
        self._ids += 1
        return self._ids - 1

    def computation(self, name: str) -> Comp:
        return Comp(self, len(self.module.computations), name)

    def unique(self, base: str) -> str:
        self._names += 1
        return f"{base}.{self._names}"

    def reducer(self, kind: str, dtype: np.dtype) -> int:
        """A computation ``(a, b) -> a <kind> b`` on scalars of ``dtype`` (cached)."""
        key = (kind, np.dtype(dtype).str)
        if key not in self._reducers:
            comp = self.computation(f"{kind}_{np.dtype(dtype).name}")
            a = comp.parameter(0, dtype, ())
            b = comp.parameter(1, dtype, ())
            comp.root(comp.op(kind, [a, b], dtype, ()))
            self._reducers[key] = comp.cid
        return self._reducers[key]

    def finish(self, entry: Comp) -> ir_pb2.Module:
        self.module.entry_computation_id = entry.cid
        comps = sorted(self.module.computations, key=lambda c: c.id != entry.cid)
        del self.module.computations[:]
        self.module.computations.extend(comps)
        return self.module


class Comp:
    """One computation: instructions in order, operands first."""

    def __init__(self, mb: ModuleBuilder, cid: int, name: str) -> None:
        self.mb = mb
        self.cid = cid
        self.proto = mb.module.computations.add(id=cid, name=name)
        self._consts: dict[int, Val] = {}
        #: The ONNX node being imported: written into source_op / source_type.
        self.source: tuple[str, str] = ("", "")
        self.params: dict[int, Val] = {}
        self._index: dict[int, int] = {}  # instruction id -> position in the computation

    # -- raw instructions ----------------------------------------------------------------
    def _add(self, opcode: str, operands: Sequence[Val], shape: ir_pb2.Shape,
             called: Sequence[int] = (), attrs: dict[str, Any] | None = None) -> int:
        operand_ids = [self.use(v).id for v in operands]  # may add constants first
        iid = self.mb.next_id()
        index = len(self.proto.instructions)
        self._index[iid] = index
        ins = self.proto.instructions.add(
            id=iid, name=self.mb.unique(f"{self.proto.name}.{opcode}"), opcode=opcode, shape=shape,
            operands=operand_ids, called_computations=list(called),
            source_op=self.source[0], source_type=self.source[1],
        )
        for key, value in (attrs or {}).items():
            a = ins.attrs[key]
            if isinstance(value, bool):
                a.flag = value
            elif isinstance(value, (int, np.integer)):
                a.i = int(value)
            elif isinstance(value, (float, np.floating)):
                a.f = float(value)
            elif isinstance(value, str):
                a.s = value
            elif isinstance(value, bytes):
                a.b = value
            elif isinstance(value, np.ndarray):
                a.literal.CopyFrom(_literal(value))
            elif all(isinstance(x, str) for x in value) and len(value):
                a.strings.values.extend(value)
            else:
                a.ints.SetInParent()
                a.ints.values.extend(int(x) for x in value)
        return iid

    def op(self, opcode: str, operands: Sequence[Val], dtype: Any, dims: Sequence[int],
           called: Sequence[int] = (), **attrs: Any) -> Val:
        """An array-valued instruction of ``dtype[dims]``."""
        iid = self._add(opcode, operands, shape_of(dtype, dims), called, attrs)
        return Val(np.dtype(dtype), tuple(int(d) for d in dims), comp=self, id=iid)

    def tuple_op(self, opcode: str, operands: Sequence[Val], shapes: Sequence[tuple[Any, Sequence[int]]],
                 called: Sequence[int] = (), **attrs: Any) -> Val:
        """A tuple-valued instruction; ``shapes`` are its elements' (dtype, dims)."""
        shape = ir_pb2.Shape(is_tuple=True, tuple_shapes=[shape_of(d, s) for d, s in shapes])
        iid = self._add(opcode, operands, shape, called, attrs)
        return Val(np.dtype(np.void), (), comp=self, id=iid)

    def tuple_shape(self, vals: Sequence[Val]) -> ir_pb2.Shape:
        return ir_pb2.Shape(is_tuple=True, tuple_shapes=[shape_of(v.dtype, v.shape) for v in vals])

    def parameter(self, number: int, dtype: Any, dims: Sequence[int], source_type: str = "",
                  source_op: str = "") -> Val:
        iid = self._add("parameter", [], shape_of(dtype, dims))
        ins = self.proto.instructions[self._index[iid]]
        ins.parameter_number = number
        ins.source_type = source_type
        ins.source_op = source_op
        v = Val(np.dtype(dtype), tuple(int(d) for d in dims), comp=self, id=iid)
        self.params[number] = v
        return v

    def tuple_parameter(self, number: int, vals: Sequence[Val]) -> list[Val]:
        """A tuple parameter shaped like ``vals``, and one get-tuple-element per element."""
        iid = self._add("parameter", [], self.tuple_shape(vals))
        self.proto.instructions[self._index[iid]].parameter_number = number
        t = Val(np.dtype(np.void), (), comp=self, id=iid)
        return [self.gte(t, k, v.dtype, v.shape) for k, v in enumerate(vals)]

    def gte(self, t: Val, index: int, dtype: Any, dims: Sequence[int]) -> Val:
        return self.op("get-tuple-element", [t], dtype, dims, index=index)

    def tuple(self, vals: Sequence[Val]) -> Val:
        iid = self._add("tuple", vals, self.tuple_shape(vals))
        return Val(np.dtype(np.void), (), comp=self, id=iid)

    def root(self, v: Val) -> None:
        self.proto.root_id = self.use(v).id

    def use(self, v: Val) -> Val:
        """``v`` as a value of this computation (a host constant becomes a ``constant``)."""
        if v.comp is self:
            return v
        if v.const is None:
            raise ValueError("internal: a value of another computation was used directly")
        key = id(v)
        if key not in self._consts:
            iid = self._add("constant", [], shape_of(v.dtype, v.shape), attrs={"value": v.const})
            self._consts[key] = Val(v.dtype, v.shape, comp=self, id=iid)
            self._consts[key]._keep = v  # type: ignore[attr-defined]  (id() stays unique)
        return self._consts[key]

    def constant(self, value: Any, dtype: Any) -> Val:
        return self.use(Val.of(value, dtype))

    # -- numpy-style helpers -------------------------------------------------------------
    def convert(self, v: Val, dtype: Any) -> Val:
        dtype = np.dtype(dtype)
        if v.dtype == dtype:
            return v
        if v.const is not None and v.const.size <= 1:
            return Val.of(v.const.astype(dtype))
        return self.op("convert", [v], dtype, v.shape)

    def reshape(self, v: Val, dims: Sequence[int]) -> Val:
        dims = tuple(int(d) for d in dims)
        if v.shape == dims:
            return v
        if v.const is not None:
            return Val.of(v.const.reshape(dims))
        return self.op("reshape", [v], v.dtype, dims)

    def transpose(self, v: Val, perm: Sequence[int]) -> Val:
        perm = [int(p) for p in perm]
        if perm == list(range(v.rank)):
            return v
        return self.op("transpose", [v], v.dtype, [v.shape[p] for p in perm], permutation=perm)

    def broadcast_in_dim(self, v: Val, dims: Sequence[int], mapping: Sequence[int]) -> Val:
        """XLA's broadcast: operand dim i becomes result dim ``mapping[i]``."""
        if tuple(dims) == v.shape and list(mapping) == list(range(v.rank)):
            return v
        return self.op("broadcast", [v], v.dtype, dims, dimensions=list(mapping))

    def broadcast_to(self, v: Val, dims: Sequence[int]) -> Val:
        """numpy's broadcast_to."""
        dims = tuple(int(d) for d in dims)
        if v.shape == dims:
            return v
        offset = len(dims) - v.rank
        keep = [i for i, d in enumerate(v.shape) if d == dims[offset + i]]
        squeezed = self.reshape(v, [v.shape[i] for i in keep])
        return self.broadcast_in_dim(squeezed, dims, [offset + i for i in keep])

    def scalar(self, value: Any, dtype: Any, dims: Sequence[int] = ()) -> Val:
        """A constant of ``dtype`` broadcast to ``dims``."""
        c = self.constant(np.asarray(value).astype(dtype), dtype)
        return self.broadcast_in_dim(c, dims, []) if len(dims) else c

    def binary(self, opcode: str, a: Val, b: Val, dtype: Any = None) -> Val:
        """An element-wise binary op with numpy broadcasting."""
        dims = np.broadcast_shapes(a.shape, b.shape)
        a2, b2 = self.broadcast_to(a, dims), self.broadcast_to(b, dims)
        return self.op(opcode, [a2, b2], dtype or a.dtype, dims)

    def compare(self, direction: str, a: Val, b: Val) -> Val:
        dims = np.broadcast_shapes(a.shape, b.shape)
        return self.op("compare", [self.broadcast_to(a, dims), self.broadcast_to(b, dims)],
                       np.bool_, dims, direction=direction, compare_type=_compare_type(a.dtype))

    def unary(self, opcode: str, v: Val) -> Val:
        return self.op(opcode, [v], v.dtype, v.shape)

    def select(self, pred: Val, on_true: Val, on_false: Val) -> Val:
        dims = np.broadcast_shapes(pred.shape, on_true.shape, on_false.shape)
        return self.op("select", [self.broadcast_to(pred, dims), self.broadcast_to(on_true, dims),
                                  self.broadcast_to(on_false, dims)], on_true.dtype, dims)

    def reduce(self, v: Val, axes: Sequence[int], kind: str, init: Any) -> Val:
        """Reduces ``axes`` away with the scalar computation ``kind`` (add, maximum, ...)."""
        axes = sorted({int(a) for a in axes})
        if not axes:
            return v
        dims = [d for i, d in enumerate(v.shape) if i not in axes]
        return self.op("reduce", [v, self.constant(np.asarray(init).astype(v.dtype), v.dtype)],
                       v.dtype, dims, called=[self.mb.reducer(kind, v.dtype)], dimensions=axes)

    def slice(self, v: Val, start: Sequence[int], limit: Sequence[int],
              strides: Sequence[int] | None = None) -> Val:
        strides = list(strides or [1] * v.rank)
        dims = [max(0, -(-(hi - lo) // s)) for lo, hi, s in zip(start, limit, strides, strict=True)]
        if list(start) == [0] * v.rank and list(dims) == list(v.shape):
            return v
        return self.op("slice", [v], v.dtype, dims, start_indices=list(start),
                       limit_indices=list(limit), strides=strides)

    def concatenate(self, vals: Sequence[Val], axis: int) -> Val:
        if len(vals) == 1:
            return vals[0]
        dims = list(vals[0].shape)
        dims[axis] = sum(v.shape[axis] for v in vals)
        return self.op("concatenate", list(vals), vals[0].dtype, dims, dimension=axis)

    def dot_general(self, a: Val, b: Val, lc: Sequence[int], rc: Sequence[int],
                    lb: Sequence[int] = (), rb: Sequence[int] = (), dtype: Any = None) -> Val:
        batch = [a.shape[i] for i in lb]
        lfree = [d for i, d in enumerate(a.shape) if i not in lc and i not in lb]
        rfree = [d for i, d in enumerate(b.shape) if i not in rc and i not in rb]
        return self.op("dot", [a, b], dtype or a.dtype, batch + lfree + rfree,
                       lhs_contracting_dimensions=list(lc), rhs_contracting_dimensions=list(rc),
                       lhs_batch_dimensions=list(lb), rhs_batch_dimensions=list(rb))


@dataclass
class Window:
    """A window over every dimension of an operand (reduce-window, convolution)."""

    size: list[int]
    strides: list[int]
    pad_low: list[int]
    pad_high: list[int]
    dilation: list[int] = field(default_factory=list)

    def attrs(self) -> dict[str, Any]:
        n = len(self.size)
        return {"window_size": self.size, "window_strides": self.strides,
                "padding_low": self.pad_low, "padding_high": self.pad_high,
                "base_dilation": [1] * n, "window_dilation": self.dilation or [1] * n,
                "window_reversal": [0] * n}
