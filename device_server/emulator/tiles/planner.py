"""The tile planner: every IR instruction gets a tile mapping for its output and a plan.

    IR module --plan_module--> ModulePlan
      per computation (CompPlan): program points (one per live instruction) with the buffers
      born there, the temporaries live only there and the called computations' peaks;
      supersteps (Step: compute / sync / exchange cycles of the slowest tile, repeated in loops)

How each kind of instruction is planned:

* **element-wise** ops follow their operands' mapping (the first operand of the output's size
  sets it); operands laid out otherwise, and broadcast operands, are exchanged in first. A
  chain of element-wise ops where each result feeds only the next one on the same mapping is
  *fused* into one compute set (what XLA's fusion and Poplar's expression fusion do): one
  superstep, and the intermediate results are never stored.
* **dot** and **convolution** are planned by a search over splits (``matmul.py``).
* **reduce** runs in stages: each tile reduces what it holds, then partials travel to the
  tiles owning the result (in two stages when many tiles contribute to each result).
* **transpose, slice, concatenate, pad, reverse, gather, scatter, dynamic-(update-)slice** move
  data: the result is laid out linearly and every tile receives its part in an exchange.
  ``reshape``, ``bitcast``, ``dynamic-reshape``, ``set-dimension-size``, ``copy`` and
  ``broadcast`` are views (no superstep; a consumer of a broadcast receives the broadcast
  elements it needs). Scalars and small constants are replicated on every tile that uses
  them. A dynamic dimension is planned at its bound (what Poplar allocates).
* **reduce-window / select-and-scatter** (pooling and its gradient): the window's input is
  exchanged in, then vector work per output (or input) element times the window.
* **sort** keeps each row (the elements along the sorted dimension) on one tile.
* **cholesky, triangular-solve, fft, topk** and the linear-algebra **custom-call** targets
  (``Qr``, ``ProductOfElementaryHouseholderReflectors``, ``Eigh``) are batches of independent
  problems (matrices, transforms, rows): each problem runs on one tile, or on a group of
  tiles in sequential stages (a column, a row or a radix pass each, with one exchange per
  stage) when it would not fit in an eighth of a tile or when splitting it is faster; the
  group size with the fewest cycles wins.
* **batch-norm-*** work like element-wise ops on the operand's mapping, plus (training and
  grad) a reduction of per-feature partial sums across tiles and their return to every tile.
* **while** plans its condition and body once and repeats their supersteps by the trip count
  (``loops.py``); **call** plans the callee in place; **conditional** costs its costliest branch.
* **custom-call** ``tf_ipu_all_reduce`` of a replicated program is a ring all-reduce over the
  system's IPU-Links (``replication.py``): one step whose ``link`` cycles are the ring's time;
  with one replica it is a view of its operands (nothing beyond a copy). With several
  replicas every call, and every trip of a loop of the entry computation (the device loop),
  also pays a sync across the replicas' IPUs. ``tf_ipu_replica_id`` is a scalar.

Entry parameters are *variables* (resident on the device), *arguments* (streamed from the host
each call) or *constants*; the lowering says which in ``source_type``, else a parameter whose
new value is an output (an alias) is a variable and any other an argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_server.emulator.arch import Target
from device_server.emulator.errors import layer_of
from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles.loops import TripCount, loop_trip_count
from device_server.emulator.tiles.mapping import Allocator, TileMapping
from device_server.emulator.tiles.matmul import MatmulPlan, MatmulProblem, plan_matmul
from device_server.emulator.tiles.replication import Replication, all_reduce_seconds
from device_server.protocol import (
    HOST_TARGETS,
    REPLICA_ID_TARGET,
    REPLICA_TARGETS,
    dtypes,
    ir_pb2,
)

__all__ = ["Buf", "CompPlan", "ModulePlan", "OpRecord", "Step", "layer_name", "plan_module"]

LiveFn = Callable[[ir_pb2.Computation], list[ir_pb2.Instruction]]

# Views: the result is (part of) the operand's buffer, no superstep.
_SAME = frozenset({"reshape", "bitcast", "copy", "opt-barrier", "add-dependency",
                   "set-dimension-size", "dynamic-reshape"})
_TINY = frozenset({"after-all", "partition-id", "replica-id", "get-dimension-size"})
_MOVES = frozenset({"transpose", "slice", "concatenate", "pad", "reverse", "dynamic-slice",
                    "dynamic-update-slice", "gather", "scatter"})
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "sqrt", "rsqrt",
    "cbrt", "tanh", "sine", "cosine", "tan", "atan2", "power", "erf", "divide", "remainder",
})
_PLUMBING = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "reshape",
                       "bitcast", "copy", "broadcast", "convert"})
_RNG = frozenset({"rng", "rng-bit-generator", "rng-get-and-update-state"})
# Batches of independent problems (matrices, transforms, rows), planned by ``_problems``.
_PROBLEMS = frozenset({"cholesky", "triangular-solve", "fft", "topk"})
# custom-call targets planned the same way (other targets fall back to one compute set).
_CUSTOM_PROBLEMS = frozenset({"Qr", "ProductOfElementaryHouseholderReflectors", "Eigh"})
_BATCH_NORM = frozenset({"batch-norm-training", "batch-norm-inference", "batch-norm-grad"})
# A problem is split over more tiles when its data would take more than this share of a tile.
_PROBLEM_TILE_SHARE = 0.125
_ELEMENTWISE = frozenset({
    "abs", "negate", "sign", "exponential", "exponential-minus-one", "log", "log-plus-one",
    "logistic", "sqrt", "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "erf", "is-finite", "not", "popcnt",
    "count-leading-zeros", "clz", "real", "imag", "add", "subtract", "multiply", "divide",
    "remainder", "power", "maximum", "minimum", "atan2", "and", "or", "xor", "shift-left",
    "shift-right-logical", "shift-right-arithmetic", "complex", "compare", "select", "clamp",
    "convert", "bitcast-convert", "reduce-precision", "map",
})
# Constants up to this size are replicated on the tiles that use them (not mapped, no exchange).
_REPLICATED_CONSTANT_BYTES = 64
# A reduction whose results each gather partials from more tiles than this runs two stages.
_REDUCE_FANIN = 32
# Partial sums of floating-point reductions and products are FP32.
_ACC_BYTES = 4


def layer_name(instr: ir_pb2.Instruction) -> str:
    """The Keras layer of an instruction (of a variable parameter: the variable's layer)."""
    if instr.opcode == "parameter" and instr.source_type == "variable":
        parts = [p for p in instr.source_op.split("/") if p]
        return parts[-2] if len(parts) >= 2 else ""
    return layer_of(instr.source_op) if instr.source_op else ""


def _elems(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple:
        return sum(_elems(s) for s in shape.tuple_shapes)
    n = 1
    for d in shape.dims:
        n *= int(d)
    return n


def _itemsize(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple or shape.dtype in (ir_pb2.TOKEN, ir_pb2.DTYPE_INVALID):
        return 0
    return dtypes.to_numpy(shape.dtype).itemsize


def _floating(shape: ir_pb2.Shape) -> bool:
    return shape.dtype in (ir_pb2.F16, ir_pb2.BF16, ir_pb2.F32, ir_pb2.F64, ir_pb2.C64, ir_pb2.C128)


def _leaf_shapes(shape: ir_pb2.Shape) -> list[ir_pb2.Shape]:
    if shape.is_tuple:
        return [leaf for s in shape.tuple_shapes for leaf in _leaf_shapes(s)]
    return [shape]


def _ints(instr: ir_pb2.Instruction, name: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    if name not in instr.attrs:
        return default
    v = instr.attrs[name]
    if v.WhichOneof("value") == "ints":
        return tuple(int(x) for x in v.ints.values)
    if v.WhichOneof("value") == "i":
        return (int(v.i),)
    return default


def _attr_str(instr: ir_pb2.Instruction, name: str, default: str = "") -> str:
    if name not in instr.attrs:
        return default
    v = instr.attrs[name]
    return v.s if v.WhichOneof("value") == "s" else default


def _backend_config(instr: ir_pb2.Instruction) -> str:
    if "backend_config" not in instr.attrs:
        return ""
    v = instr.attrs["backend_config"]
    kind = v.WhichOneof("value")
    raw = v.s if kind == "s" else v.b.decode("utf-8", "replace") if kind == "b" else ""
    return raw.strip()


def _int(instr: ir_pb2.Instruction, name: str, default: int = 0) -> int:
    if name not in instr.attrs:
        return default
    v = instr.attrs[name]
    return int(v.i) if v.WhichOneof("value") == "i" else default


# ------------------------------------------------------------------------------ values


class Buf:
    """A materialized tensor: its mapping and (for not-always-live ones) its live range."""

    __slots__ = ("instr", "itemsize", "elements", "mapping", "kind", "ctx", "born", "last",
                 "fused", "inplace", "group", "producer")

    def __init__(self, instr: ir_pb2.Instruction, itemsize: int, elements: int, kind: str,
                 ctx: CompPlan | None, born: int, mapping: TileMapping | None = None) -> None:
        self.instr = instr
        self.itemsize = itemsize
        self.elements = elements
        self.mapping = mapping
        self.kind = kind            # "variable", "argument", "constant", "activation"
        self.ctx = ctx              # owning computation plan; None: always live
        self.born = born
        self.last = born
        self.fused = False          # an intermediate of a fused element-wise chain: not stored
        self.inplace = False        # an updated variable written over its parameter
        self.group: Step | None = None  # the fused compute set that produces it
        self.producer = instr.id

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize

    def __repr__(self) -> str:
        return f"Buf({self.instr.name}, {self.kind}, {self.nbytes} B, {self.mapping})"


class Bcast:
    """A broadcast view of ``src`` (``None``: a scalar or small constant, replicated)."""

    __slots__ = ("src", "elements", "itemsize")

    def __init__(self, src: Buf | None, elements: int, itemsize: int) -> None:
        self.src = src
        self.elements = elements
        self.itemsize = itemsize


Value = Any  # Buf | Bcast | tuple of values


def _leaves(v: Value) -> Iterator[Buf | Bcast]:
    if isinstance(v, (tuple, list)):
        for x in v:
            yield from _leaves(x)
    elif v is not None:
        yield v


# ------------------------------------------------------------------------- plan records


class Step:
    """One BSP superstep (or ``repeat`` identical ones): cycles of the slowest tile."""

    __slots__ = ("name", "opcode", "layer", "kind", "compute", "exchange", "sync", "tiles",
                 "flops", "repeat", "order", "children", "ew", "link", "link_bytes")

    def __init__(self, instr: ir_pb2.Instruction, kind: str, compute: float, exchange: float,
                 sync: float, tiles: int, flops: float, order: int, repeat: int = 1) -> None:
        self.name = instr.name
        self.opcode = instr.opcode
        self.layer = layer_name(instr)
        self.kind = kind
        self.compute = compute
        self.exchange = exchange
        self.sync = sync
        self.tiles = tiles
        self.flops = flops
        self.repeat = repeat
        self.order = order
        self.children: list[CompPlan] = []   # loops and calls: the called computations' plans
        self.ew: _EwGroup | None = None
        # Between IPUs (replicated programs): cycles of an all-reduce over the IPU-Links or of
        # a sync across the replicas' IPUs ("all-reduce" / "replica-sync" steps), and the bytes
        # each replica sends into the all-reduce.
        self.link = 0.0
        self.link_bytes = 0.0

    def __repr__(self) -> str:
        rep = f" x{self.repeat}" if self.repeat != 1 else ""
        return (f"Step({self.name}, {self.kind}{rep}: compute {self.compute:,.0f}, exchange "
                f"{self.exchange:,.0f}, sync {self.sync:,.0f} cycles on {self.tiles} tiles)")

    @property
    def cycles(self) -> float:
        """Cycles of one repetition, including called computations."""
        own = self.compute + self.exchange + self.sync + self.link
        return own + sum(c.cycles for c in self.children)

    def link_totals(self) -> dict[str, list[float]]:
        """Per kind of step with ``link`` cycles ("all-reduce", "replica-sync"): [cycles,
        bytes, executions] of all repetitions, including children."""
        out: dict[str, list[float]] = {}
        if self.link or self.link_bytes:
            out[self.kind] = [self.link, self.link_bytes, 1.0]
        for child in self.children:
            _add_totals(out, child.link_totals())
        for v in out.values():
            for n in range(3):
                v[n] *= self.repeat
        return out

    def totals(self) -> tuple[float, float, float, float]:
        """(compute, exchange, sync, flops) of all repetitions, including children."""
        c, e, s, f = self.compute, self.exchange, self.sync, self.flops
        for child in self.children:
            cc, ee, ss, ff = child.totals()
            c, e, s, f = c + cc, e + ee, s + ss, f + ff
        r = self.repeat
        return c * r, e * r, s * r, f * r


@dataclass
class _EwGroup:
    """A fused element-wise compute set being built (per-tile figures of its fullest tile)."""

    step: Step
    mapping: TileMapping
    flops: float = 0.0        # per element of the mapping
    mem_bytes: float = 0.0    # per element
    itemsize: int = 4
    recv: float = 0.0         # bytes received by the fullest tile
    send: float = 0.0
    inputs: list[Buf] = field(default_factory=list)
    members: int = 1


@dataclass
class Point:
    """One program point of a computation: a live instruction."""

    instr: ir_pb2.Instruction
    temps: list[tuple[TileMapping, float]] = field(default_factory=list)  # (tiles, bytes each)
    subs: list[list[CompPlan]] = field(default_factory=list)  # alternatives: max over each list


class CompPlan:
    """The plan of one computation (for one call site)."""

    def __init__(self, comp: ir_pb2.Computation, caller: ir_pb2.Instruction | None) -> None:
        self.comp = comp
        self.name = comp.name
        self.caller = caller
        self.points: list[Point] = []
        self.bufs: list[Buf] = []
        self.steps: list[Step] = []
        self.root: Value = None

    @property
    def cycles(self) -> float:
        return sum(s.cycles * s.repeat for s in self.steps)

    def totals(self) -> tuple[float, float, float, float]:
        c = e = s = f = 0.0
        for step in self.steps:
            cc, ee, ss, ff = step.totals()
            c, e, s, f = c + cc, e + ee, s + ss, f + ff
        return c, e, s, f

    def link_totals(self) -> dict[str, list[float]]:
        """:meth:`Step.link_totals` of all its steps."""
        out: dict[str, list[float]] = {}
        for step in self.steps:
            _add_totals(out, step.link_totals())
        return out

    def supersteps(self) -> int:
        n = 0
        for s in self.steps:
            n += s.repeat * ((1 if s.kind not in ("loop", "call") else 0)
                             + sum(c.supersteps() for c in s.children))
        return n


def _add_totals(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    for kind, v in more.items():
        acc = into.setdefault(kind, [0.0, 0.0, 0.0])
        for n in range(3):
            acc[n] += v[n]


@dataclass
class OpRecord:
    """What the planner decided for one instruction (for tests and reports): the tile mapping
    of its output (``None``: replicated or a broadcast view), its supersteps and temporaries."""

    name: str
    opcode: str
    layer: str
    mapping: TileMapping | None
    steps: list[Step]
    temp_bytes_per_tile: float = 0.0
    plan: str = ""
    buf: Buf | None = None   # for views and parameters: the buffer whose mapping they share

    @property
    def cycles(self) -> float:
        return sum(s.cycles * s.repeat for s in self.steps)


@dataclass
class ModulePlan:
    """A planned module: the entry computation's plan and the always-live figures."""

    target: Target
    entry: CompPlan
    ops: dict[str, OpRecord]
    params: list[Buf]                 # entry parameters, by parameter number
    constants: list[Buf]
    code_bytes: np.ndarray            # per tile: control code, vertex state, codelets
    exchange_code_bytes: np.ndarray   # per tile
    host_bytes_in: int
    host_bytes_out: int
    loops: list[dict[str, Any]]
    notes: list[str]
    flops: float
    replication: Replication | None = None   # None: one replica, the target's host link
    collectives: list[dict[str, Any]] = field(default_factory=list)  # each all-reduce planned

    def op(self, name: str) -> OpRecord:
        """The record of the instruction called ``name``."""
        if name not in self.ops:
            raise KeyError(f"no planned instruction named {name!r}")
        return self.ops[name]


# ------------------------------------------------------------------------------ planner


class _Planner:
    def __init__(self, module: ir_pb2.Module, target: Target, live: LiveFn,
                 kinds: dict[int, str] | None, mappings: dict[str, TileMapping] | None,
                 replication: Replication | None = None) -> None:
        self.module = module
        self.rep = replication if replication is not None and replication.replicated else None
        self.collectives: list[dict[str, Any]] = []
        self.t = target
        self.T = target.tiles_per_ipu
        self.live = live
        self.comps = {c.id: c for c in module.computations}
        self.alloc = Allocator(self.T, target.min_bytes_per_tile)
        self.kinds = kinds or {}
        self.overrides = mappings or {}
        self.ops: dict[str, OpRecord] = {}
        self.constants: list[Buf] = []
        self.code = np.zeros(self.T)
        self.exch_code = np.zeros(self.T)
        self.codelets: dict[tuple[str, int], np.ndarray] = {}
        self.loops: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.scalar_cost_cache: dict[int, float] = {}
        self.aliased_params = {int(a.parameter_number) for a in module.aliases}
        self._shapes = {i.id: i.shape for c in module.computations for i in c.instructions}
        self.eff: dict[int, int] = {}

    # -- helpers ------------------------------------------------------------------------
    def mapping_of(self, buf: Buf) -> TileMapping:
        if buf.mapping is None:
            buf.mapping = self.alloc.linear(buf.elements, buf.itemsize)
        return buf.mapping

    def whole(self) -> TileMapping:
        return TileMapping(0, self.T, self.T, self.T)

    def new_buf(self, ctx: CompPlan, instr: ir_pb2.Instruction, shape: ir_pb2.Shape, k: int,
                mapping: TileMapping | None = None) -> Buf:
        b = Buf(instr, _itemsize(shape), max(1, _elems(shape)), "activation", ctx, k, mapping)
        if b.mapping is None:
            b.mapping = self.alloc.linear(b.elements, b.itemsize)
        ctx.bufs.append(b)
        return b

    def out_value(self, ctx: CompPlan, instr: ir_pb2.Instruction, k: int,
                  mapping: TileMapping | None = None) -> Value:
        """Fresh buffer(s) for the instruction's result (a tuple for tuple shapes)."""
        if instr.shape.is_tuple:
            return tuple(self._shape_bufs(ctx, instr, s, k) for s in instr.shape.tuple_shapes)
        return self.new_buf(ctx, instr, instr.shape, k, mapping)

    def _shape_bufs(self, ctx: CompPlan, instr: ir_pb2.Instruction, shape: ir_pb2.Shape, k: int) -> Value:
        if shape.is_tuple:
            return tuple(self._shape_bufs(ctx, instr, s, k) for s in shape.tuple_shapes)
        if shape.dtype == ir_pb2.TOKEN:
            return Bcast(None, 1, 0)
        return self.new_buf(ctx, instr, shape, k)

    def use(self, ctx: CompPlan, value: Value, k: int) -> None:
        for leaf in _leaves(value):
            b = leaf if isinstance(leaf, Buf) else leaf.src
            if b is not None and b.ctx is ctx and b.last < k:
                b.last = k

    def codelet(self, key: tuple[str, int], rng: TileMapping) -> None:
        cov = self.codelets.get(key)
        if cov is None:
            cov = self.codelets[key] = np.zeros(self.T)
        for a, b, _ in rng._runs():
            cov[a:b] = 1.0

    def step(self, ctx: CompPlan, instr: ir_pb2.Instruction, kind: str, rng: TileMapping,
             compute: float, exchange: float, flops: float, k: int, *, repeat: int = 1,
             recv: float = 0.0, src_bytes_per_tile: float = 0.0, codelet: str = "") -> Step:
        """Records a superstep on the tiles of ``rng`` (and its code and exchange code)."""
        s = Step(instr, kind, compute, exchange, float(self.t.sync_cycles), rng.tiles, flops, k, repeat)
        ctx.steps.append(s)
        t = self.t
        rng.covers(self.code, t.compute_set_control_bytes + t.vertex_state_bytes)
        self.codelet((codelet or kind, _itemsize(instr.shape)), rng)
        if exchange > 0 and recv > 0:
            sources = 1.0 if src_bytes_per_tile <= 0 else min(self.T, math.ceil(recv / src_bytes_per_tile))
            rng.covers(self.exch_code, t.exchange_code_bytes + t.exchange_code_bytes_per_source * sources)
        return s

    def record(self, instr: ir_pb2.Instruction, mapping: TileMapping | None, steps: list[Step],
               temp: float = 0.0, plan: str = "") -> None:
        self.ops[instr.name] = OpRecord(instr.name, instr.opcode, layer_name(instr), mapping,
                                        steps, temp, plan)

    def scalar_cost(self, comp_id: int) -> float:
        """FLOPs per element of a scalar computation (reducer, comparator, map function)."""
        if comp_id in self.scalar_cost_cache:
            return self.scalar_cost_cache[comp_id]
        self.scalar_cost_cache[comp_id] = 1.0  # recursion guard
        comp = self.comps.get(comp_id)
        cost = 0.0
        if comp is not None:
            for i in comp.instructions:
                if i.opcode in _PLUMBING:
                    continue
                if i.called_computations:
                    cost += sum(self.scalar_cost(c) for c in i.called_computations)
                elif i.opcode in _TRANSCENDENTAL:
                    cost += self.t.flops_per_transcendental
                else:
                    cost += 1.0
        cost = max(1.0, cost)
        self.scalar_cost_cache[comp_id] = cost
        return cost

    # -- computations -------------------------------------------------------------------
    def plan_entry(self) -> tuple[CompPlan, list[Buf]]:
        comp = self.comps[self.module.entry_computation_id]
        ctx = CompPlan(comp, None)
        params: dict[int, Buf] = {}
        self._plan_body(ctx, params=None, entry_params=params)
        return ctx, [params[n] for n in sorted(params)]

    def plan_comp(self, comp_id: int, args: list[Value], caller: ir_pb2.Instruction) -> CompPlan:
        comp = self.comps[comp_id]
        ctx = CompPlan(comp, caller)
        self._plan_body(ctx, params=args, entry_params=None)
        return ctx

    def _consumers(self, live: list[ir_pb2.Instruction], root_id: int) -> dict[int, int]:
        """Consumers of each value, looking through views (for fusion)."""
        users: dict[int, list[int]] = {}
        by_id = {}
        for i in live:
            by_id[i.id] = i
            for o in set(i.operands):
                users.setdefault(o, []).append(i.id)
        eff: dict[int, int] = {}
        for i in reversed(live):
            n = 1 if i.id == root_id else 0
            for u in users.get(i.id, ()):
                n += eff.get(u, 1) if by_id[u].opcode in _SAME else 1
            eff[i.id] = n
        return eff

    def _plan_body(self, ctx: CompPlan, params: list[Value] | None,
                   entry_params: dict[int, Buf] | None) -> None:
        comp = ctx.comp
        live = self.live(comp)
        self.eff = self._consumers(live, comp.root_id)
        eff = self.eff
        values: dict[int, Value] = {}
        for k, instr in enumerate(live):
            ctx.points.append(Point(instr))
            op = instr.opcode
            if op == "parameter":
                n = instr.parameter_number
                if entry_params is not None:
                    values[instr.id] = entry_params[n] = self._entry_param(instr)
                else:
                    values[instr.id] = params[n] if params is not None and n < len(params) else \
                        self.out_value(ctx, instr, k)
                continue
            ops = [values[o] for o in instr.operands]
            self.eff = eff
            values[instr.id] = self._plan_instr(ctx, instr, ops, k)
        ctx.root = values[comp.root_id]
        for instr in live:  # views, parameters, constants: the mapping of what they refer to
            if instr.name not in self.ops:
                leaf = next(_leaves(values.get(instr.id)), None)
                if isinstance(leaf, Buf):
                    what = f"{leaf.kind} parameter" if instr.opcode == "parameter" else \
                        "constant" if instr.opcode == "constant" else f"view of '{leaf.instr.name}'"
                    rec = OpRecord(instr.name, instr.opcode, layer_name(instr), leaf.mapping, [], 0.0, what)
                    rec.buf = leaf
                else:
                    what = "replicated where used" if leaf is None or leaf.src is None else \
                        f"broadcast of '{leaf.src.instr.name}'"
                    rec = OpRecord(instr.name, instr.opcode, layer_name(instr), None, [], 0.0, what)
                self.ops[instr.name] = rec
        end = len(live)
        for leaf in _leaves(ctx.root):
            b = leaf if isinstance(leaf, Buf) else leaf.src
            if b is not None and b.ctx is ctx:
                b.last = end
                b.fused = False  # results are stored
        ctx.steps.sort(key=lambda s: s.order)

    def _entry_param(self, instr: ir_pb2.Instruction) -> Buf:
        n = instr.parameter_number
        kind = self.kinds.get(n) or (instr.source_type if instr.source_type in
                                     ("argument", "variable", "constant") else "")
        if not kind:
            kind = "variable" if n in self.aliased_params else "argument"
        b = Buf(instr, _itemsize(instr.shape), max(1, _elems(instr.shape)), kind, None, 0)
        if instr.name in self.overrides:
            b.mapping = self.overrides[instr.name]
        return b

    # -- one instruction ----------------------------------------------------------------
    def _plan_instr(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        op = instr.opcode
        if op == "constant":
            return self._constant(ctx, instr, k)
        if op == "tuple":
            return tuple(ops)
        if op == "get-tuple-element":
            v = ops[0]
            idx = _int(instr, "index", 0)
            return v[idx] if isinstance(v, tuple) and idx < len(v) else v
        if op in _SAME:
            return self._view(ops[0], instr)
        if op in _TINY or instr.shape.dtype == ir_pb2.TOKEN:
            return Bcast(None, 1, _itemsize(instr.shape))
        if op == "custom-call" and _attr_str(instr, "custom_call_target") in REPLICA_TARGETS:
            if _attr_str(instr, "custom_call_target") == REPLICA_ID_TARGET:
                return Bcast(None, 1, _itemsize(instr.shape))
            return self._all_reduce(ctx, instr, ops, k)
        if op == "broadcast":
            return self._broadcast(ops[0], instr)
        if op == "transpose" and self._trivial_transpose(instr, ops[0]):
            return self._view(ops[0], instr)
        if op in ("dot", "convolution"):
            return self._matmul(ctx, instr, ops, k)
        if op == "reduce":
            return self._reduce(ctx, instr, ops, k)
        if op in ("reduce-window", "select-and-scatter"):
            return self._window(ctx, instr, ops, k)
        if op == "sort":
            return self._sort(ctx, instr, ops, k)
        if op in _PROBLEMS or (op == "custom-call"
                               and _attr_str(instr, "custom_call_target") in _CUSTOM_PROBLEMS):
            return self._problems(ctx, instr, ops, k)
        if op in _BATCH_NORM:
            return self._batch_norm(ctx, instr, ops, k)
        if op in _MOVES:
            return self._move(ctx, instr, ops, k)
        if op == "while":
            return self._while(ctx, instr, ops, k)
        if op == "call":
            return self._call(ctx, instr, ops, k)
        if op == "conditional":
            return self._conditional(ctx, instr, ops, k)
        if op in _RNG or op == "iota":
            return self._generate(ctx, instr, ops, k)
        if op not in _ELEMENTWISE:
            self.notes.append(f"opcode '{op}' has no planner of its own: planned as "
                              f"{'one compute set' if instr.shape.is_tuple else 'element-wise'}")
        if instr.shape.is_tuple:  # variadic ops without a planner of their own
            return self._generic_tuple(ctx, instr, ops, k)
        return self._elementwise(ctx, instr, ops, k)

    def _constant(self, ctx: CompPlan, instr: ir_pb2.Instruction, k: int) -> Value:
        size = _elems(instr.shape) * _itemsize(instr.shape)
        if instr.shape.is_tuple or size <= _REPLICATED_CONSTANT_BYTES:
            return Bcast(None, max(1, _elems(instr.shape)), _itemsize(instr.shape))
        b = Buf(instr, _itemsize(instr.shape), _elems(instr.shape), "constant", None, k)
        b.mapping = self.overrides.get(instr.name) or self.alloc.linear(b.elements, b.itemsize)
        self.constants.append(b)
        return b

    @staticmethod
    def _view(v: Value, instr: ir_pb2.Instruction) -> Value:
        if isinstance(v, Bcast):
            return Bcast(v.src, max(1, _elems(instr.shape)), v.itemsize)
        return v

    def _broadcast(self, v: Value, instr: ir_pb2.Instruction) -> Value:
        out = max(1, _elems(instr.shape))
        if isinstance(v, Bcast):
            return Bcast(v.src, out, _itemsize(instr.shape))
        if isinstance(v, Buf) and v.elements == out:
            return v
        return Bcast(v if isinstance(v, Buf) else None, out, _itemsize(instr.shape))

    @staticmethod
    def _trivial_transpose(instr: ir_pb2.Instruction, v: Value) -> bool:
        perm = _ints(instr, "permutation")
        dims = list(instr.shape.dims)
        moved = [p for i, p in enumerate(perm) if dims and i < len(dims) and dims[i] != 1]
        return moved == sorted(moved) or isinstance(v, Bcast)

    def _materialize(self, ctx: CompPlan, v: Value, instr: ir_pb2.Instruction, k: int) -> Value:
        """A real buffer for every leaf (loop state cannot be a view)."""
        if isinstance(v, tuple):
            return tuple(self._materialize(ctx, x, instr, k) for x in v)
        if isinstance(v, Bcast):
            b = Buf(instr, max(1, v.itemsize), v.elements, "activation", ctx, k)
            b.mapping = self.alloc.linear(b.elements, b.itemsize)
            ctx.bufs.append(b)
            return b
        return v

    # -- exchange of operands into a mapping ---------------------------------------------
    def _inflow(self, v: Value, mapping: TileMapping, out_elems: int) -> tuple[float, float]:
        """(bytes the fullest tile of ``mapping`` receives, bytes the busiest sender sends)
        for operand ``v`` to be available where the output elements are."""
        per_tile = mapping.max_elements
        if isinstance(v, Bcast):
            if v.src is None:
                return 0.0, 0.0
            src = v.src
            m = self.mapping_of(src)
            if src.elements >= out_elems and m.same_as(mapping):
                return 0.0, 0.0
            need = min(src.nbytes, per_tile * src.itemsize)
            return float(need), float(m.max_elements * src.itemsize)
        if isinstance(v, Buf):
            m = self.mapping_of(v)
            if m.same_as(mapping) or (m.tiles == 1 and mapping.tiles == 1 and m.first == mapping.first):
                return 0.0, 0.0
            share = per_tile * v.elements / max(1, out_elems)
            need = min(float(v.nbytes), share * v.itemsize)
            return need, float(m.max_elements * v.itemsize)
        return 0.0, 0.0

    # -- element-wise -------------------------------------------------------------------
    def _elementwise(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        out_elems = max(1, _elems(instr.shape))
        out_item = _itemsize(instr.shape)
        anchor = next((v for v in ops if isinstance(v, Buf) and v.elements == out_elems), None)
        if anchor is not None:
            mapping = self.mapping_of(anchor)
        else:
            mapping = self.alloc.linear(out_elems, max(1, out_item))
        for v in ops:
            if isinstance(v, Buf) and v.mapping is None and v.elements == out_elems:
                v.mapping = mapping
        op = instr.opcode
        if op == "map" and instr.called_computations:
            per = self.scalar_cost(instr.called_computations[0])
        elif op in _TRANSCENDENTAL:
            per = t.flops_per_transcendental
        else:
            per = 1.0
        self.use(ctx, ops, k)
        # Fusion into the compute set that produced an operand.
        group: _EwGroup | None = None
        fused_input: Buf | None = None
        for v in ops:
            if (isinstance(v, Buf) and v.group is not None and v.ctx is ctx and v.group.ew is not None
                    and self.eff.get(v.producer, 2) == 1 and v.group.ew.mapping.same_as(mapping)):
                group, fused_input = v.group.ew, v
                break
        recv = send = 0.0
        mem = float(out_item)
        inputs = []
        for v in ops:
            if v is fused_input:
                continue
            r, s = self._inflow(v, mapping, out_elems)
            recv += r
            send = max(send, s)
            if isinstance(v, Buf):
                mem += v.itemsize * v.elements / out_elems
                inputs.append(v)
            elif isinstance(v, Bcast) and v.src is not None:
                mem += v.itemsize
                inputs.append(v.src)
        out = Buf(instr, out_item, out_elems, "activation", ctx, k, mapping)
        ctx.bufs.append(out)
        if group is not None:
            assert fused_input is not None
            fused_input.fused = True
            group.flops += per
            group.mem_bytes += mem - fused_input.itemsize  # the intermediate is not stored
            group.recv += recv
            group.send = max(group.send, send)
            group.inputs.extend(inputs)
            group.members += 1
            group.itemsize = min(group.itemsize, max(1, out_item))
            for b in group.inputs:
                if b.ctx is ctx and b.last < k:
                    b.last = k
            step = group.step
            step.order = k
            self._ew_cost(group)
            out.group = step
            if recv:
                ctx.points[k].temps.append((mapping, recv))
            self.record(instr, mapping, [], recv, f"fused into {step.name}")
            return out
        step = self.step(ctx, instr, "element-wise", mapping, 0.0, 0.0, 0.0, k, recv=recv,
                         src_bytes_per_tile=send, codelet=op)
        group = _EwGroup(step, mapping, per, mem, max(1, out_item), recv, send, inputs)
        step.ew = group
        self._ew_cost(group)
        out.group = step
        if recv:
            ctx.points[k].temps.append((mapping, recv))
        self.record(instr, mapping, [step], recv)
        return out

    def _ew_cost(self, g: _EwGroup) -> None:
        t = self.t
        e = g.mapping.max_elements
        rate = cyc.vector_rate(t, g.itemsize)
        pieces = cyc.worker_pieces(t, e, g.itemsize)
        g.step.compute = cyc.compute_cycles(t, g.flops * e, g.mem_bytes * e, rate, pieces)
        g.step.exchange = cyc.exchange_cycles(t, g.recv, g.send)
        g.step.flops = g.flops * g.mapping.elements

    # -- generators ---------------------------------------------------------------------
    def _generate(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        out = self.out_value(ctx, instr, k)
        leaves = [b for b in _leaves(out) if isinstance(b, Buf)]
        big = max(leaves, key=lambda b: b.nbytes) if leaves else None
        if big is None:
            return out
        m = big.mapping
        e = m.max_elements
        per = 1.0 if instr.opcode == "iota" else 2.0  # hardware PRNG: a couple of instructions
        compute = cyc.compute_cycles(t, per * e, e * big.itemsize, cyc.vector_rate(t, big.itemsize),
                                     cyc.worker_pieces(t, e, big.itemsize))
        s = self.step(ctx, instr, "element-wise", m, compute, 0.0, per * big.elements, k,
                      codelet=instr.opcode)
        self.record(instr, m, [s])
        return out

    def _generic_tuple(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        self.use(ctx, ops, k)
        out = self.out_value(ctx, instr, k)
        bufs = [b for b in _leaves(out) if isinstance(b, Buf)]
        total = sum(b.elements for b in bufs)
        m = bufs[0].mapping if bufs else self.whole()
        e = max((b.mapping.max_elements for b in bufs), default=1) * max(1, len(bufs))
        compute = cyc.compute_cycles(self.t, e, e * 4, self.t.vector_fp32_flops_per_cycle_per_tile,
                                     cyc.worker_pieces(self.t, e, 4))
        s = self.step(ctx, instr, "element-wise", m, compute, 0.0, float(total), k)
        self.record(instr, m, [s])
        return out

    # -- data movement ------------------------------------------------------------------
    def _move(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        op = instr.opcode
        self.use(ctx, ops, k)
        out_elems = max(1, _elems(instr.shape))
        item = max(1, _itemsize(instr.shape))
        in_place = op in ("dynamic-update-slice", "scatter") and isinstance(ops[0], Buf) \
            and ops[0].elements == out_elems
        mapping = self.mapping_of(ops[0]) if in_place else None
        out = self.new_buf(ctx, instr, instr.shape, k, mapping)
        m = out.mapping
        e = m.max_elements
        send = 0.0
        for v in ops:
            src = v if isinstance(v, Buf) else (v.src if isinstance(v, Bcast) else None)
            if src is not None:
                send = max(send, self.mapping_of(src).max_elements * src.itemsize)
        if in_place:
            upd = ops[1] if op == "dynamic-update-slice" else ops[-1]
            upd_elems = upd.elements if isinstance(upd, (Buf, Bcast)) else 1
            touched = min(m.tiles, max(1, math.ceil(upd_elems / max(1, e))))
            recv = min(upd_elems, e) * item if touched else 0.0
            if op == "scatter":
                recv += min(upd_elems, e) * 4  # indices travel with the updates
            work = recv
            tiles_rng = m
        else:
            recv = float(e * item)
            if op == "gather" and len(ops) > 1 and isinstance(ops[1], (Buf, Bcast)):
                idx = ops[1]
                recv += min(idx.elements * idx.itemsize, e * idx.itemsize)
            work = 2.0 * e * item
            tiles_rng = m
        compute = cyc.compute_cycles(t, 0.0, work, 1.0, cyc.worker_pieces(t, e, item))
        exchange = cyc.exchange_cycles(t, recv, send)
        s = self.step(ctx, instr, "exchange", tiles_rng, compute, exchange, 0.0, k,
                      recv=recv, src_bytes_per_tile=send, codelet="copy")
        ctx.points[k].temps.append((m, recv))
        self.record(instr, m, [s], recv)
        return out

    # -- matrix products and convolutions ----------------------------------------------
    def _matmul_problem(self, instr: ir_pb2.Instruction, ops: list[Value]) -> MatmulProblem:
        a_shape = self._operand_shape(instr, 0)
        b_shape = self._operand_shape(instr, 1)
        a_bytes = _elems(a_shape) * _itemsize(a_shape)
        b_bytes = _elems(b_shape) * _itemsize(b_shape)
        item = max(_itemsize(a_shape), _itemsize(b_shape))
        floating = _floating(a_shape) and _floating(b_shape)
        out_item = _itemsize(instr.shape)
        if instr.opcode == "dot":
            ad, bd = list(a_shape.dims), list(b_shape.dims)
            lb, lc = _ints(instr, "lhs_batch_dimensions"), _ints(instr, "lhs_contracting_dimensions")
            rb, rc = _ints(instr, "rhs_batch_dimensions"), _ints(instr, "rhs_contracting_dimensions")
            G = int(np.prod([ad[d] for d in lb], dtype=np.int64)) if lb else 1
            K = int(np.prod([ad[d] for d in lc], dtype=np.int64)) if lc else 1
            M = int(np.prod([ad[d] for d in range(len(ad)) if d not in lb and d not in lc], dtype=np.int64))
            N = int(np.prod([bd[d] for d in range(len(bd)) if d not in rb and d not in rc], dtype=np.int64))
            return MatmulProblem(max(1, G), max(1, M), max(1, N), max(1, K), 1, a_bytes, b_bytes,
                                 0.0, item, out_item, floating)
        ad, kd, od = list(a_shape.dims), list(b_shape.dims), list(instr.shape.dims)
        fgc = max(1, _int(instr, "feature_group_count", 1))
        bgc = max(1, _int(instr, "batch_group_count", 1))
        G = fgc * bgc
        kin = kd[_int(instr, "kernel_input_feature_dimension", 0)] if kd else 1
        kout = kd[_int(instr, "kernel_output_feature_dimension", 0)] if kd else 1
        kspatial = _ints(instr, "kernel_spatial_dimensions")
        window = int(np.prod([kd[d] for d in kspatial], dtype=np.int64)) if kspatial else 1
        ob = od[_int(instr, "output_batch_dimension", 0)] if od else 1
        ospatial = _ints(instr, "output_spatial_dimensions")
        positions = int(np.prod([od[d] for d in ospatial], dtype=np.int64)) if ospatial else 1
        ispatial = _ints(instr, "input_spatial_dimensions")
        dil = _ints(instr, "window_dilation")
        halo = 0.0
        coverage = 1.0
        for n, (di, dk) in enumerate(zip(ispatial, kspatial, strict=False)):
            d = dil[n] if n < len(dil) else 1
            extent = (kd[dk] - 1) * d + 1
            halo += (extent - 1) / max(1, ad[di])
            coverage *= min(1.0, extent / max(1, ad[di]))
        if coverage > 0.25:
            # A weight-update convolution: a matrix product over channels x window.
            return MatmulProblem(G, max(1, ob * positions), max(1, kout // G), max(1, kin * window), 1,
                                 a_bytes, b_bytes, 0.0, item, out_item, floating, images=max(1, ob))
        return MatmulProblem(G, max(1, ob * positions), max(1, kout // G), max(1, kin), max(1, window),
                             a_bytes, b_bytes, min(1.0, halo), item, out_item, floating,
                             images=max(1, ob))

    def _operand_shape(self, instr: ir_pb2.Instruction, n: int) -> ir_pb2.Shape:
        return self._shapes[instr.operands[n]]

    def _matmul(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        problem = self._matmul_problem(instr, ops)
        # Parameters no one has laid out yet are laid out for this plan (Poplar's createWeights).
        unmapped = [isinstance(v, Buf) and v.mapping is None and v.ctx is None for v in ops[:2]]
        if any(unmapped):
            problem = dataclasses.replace(problem, a_local=unmapped[0], b_local=unmapped[1])
        plan: MatmulPlan = plan_matmul(problem, t)
        for v, fresh in zip(ops[:2], unmapped, strict=True):
            if fresh:
                v.mapping = self.alloc.spread(v.elements, plan.tiles)
        out = self.new_buf(ctx, instr, instr.shape, k, self.alloc.spread(max(1, _elems(instr.shape)), plan.tiles))
        m = out.mapping
        send = 0.0
        for v in ops[:2]:
            src = v if isinstance(v, Buf) else (v.src if isinstance(v, Bcast) else None)
            if src is not None:
                send = max(send, self.mapping_of(src).max_elements * src.itemsize)
        # The busiest sender bounds the exchange too (an operand held on few tiles).
        exchange = max(plan.exchange_cycles, send / t.exchange_bytes_per_cycle_per_tile
                       + plan.passes * t.exchange_overhead_cycles)
        flops = problem.flops
        unit = "AMP" if plan.amp else "vector"
        s1 = self.step(ctx, instr, "matmul", m, plan.compute_cycles / plan.passes,
                       exchange / plan.passes, flops / plan.passes, k, repeat=plan.passes,
                       recv=plan.recv_bytes_per_tile / plan.passes,
                       src_bytes_per_tile=max(1.0, send), codelet=f"{instr.opcode}-{unit}")
        steps = [s1]
        if plan.pk > 1:
            s2 = self.step(ctx, instr, "reduce", m, plan.reduce_compute_cycles,
                           plan.reduce_exchange_cycles - t.sync_cycles, 0.0, k,
                           recv=plan.reduce_recv_bytes_per_tile,
                           src_bytes_per_tile=plan.reduce_recv_bytes_per_tile / max(1, plan.pk - 1),
                           codelet="reduce-partials")
            steps.append(s2)
        ctx.points[k].temps.append((m, plan.temp_bytes_per_tile))
        self.record(instr, m, steps, plan.temp_bytes_per_tile, plan.describe())
        if not plan.fits_budget:
            self.notes.append(f"'{instr.name}' ({layer_name(instr) or instr.opcode}): no split keeps "
                              f"its temporaries within available_memory_proportion of a tile")
        return out

    # -- reductions ---------------------------------------------------------------------
    def _reduce(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        n_in = max(1, len(ops) // 2)
        src = ops[0]
        in_shape = self._operand_shape(instr, 0)
        dims = [int(d) for d in in_shape.dims]
        in_elems = max(1, _elems(in_shape))
        in_item = max(1, _itemsize(in_shape))
        out_leaf = _leaf_shapes(instr.shape)[0]
        out_elems = max(1, _elems(out_leaf))
        reduced = set(_ints(instr, "dimensions"))
        per = self.scalar_cost(instr.called_computations[0]) / n_in if instr.called_computations else 1.0
        if isinstance(src, Buf):
            m_in = self.mapping_of(src)
            recv0 = 0.0
        else:  # a broadcast: reduce it where it is produced
            m_in = self.alloc.linear(in_elems, in_item)
            recv0 = self._inflow(src, m_in, in_elems)[0]
        inner = 1
        for d in reversed(range(len(dims))):
            if d not in reduced:
                break
            inner *= dims[d]
        e = m_in.max_elements
        partials = min(out_elems, math.ceil(e / max(1, inner)) + 1)
        acc = _ACC_BYTES if _floating(in_shape) else in_item
        steps = []
        c1 = cyc.compute_cycles(t, per * e * n_in, e * in_item * n_in, cyc.vector_rate(t, in_item),
                                cyc.worker_pieces(t, e, in_item))
        s = self.step(ctx, instr, "reduce", m_in, c1, cyc.exchange_cycles(t, recv0), per * in_elems * n_in,
                      k, recv=recv0, codelet="reduce")
        steps.append(s)
        temp = partials * acc * n_in + recv0
        ctx.points[k].temps.append((m_in, partials * acc * n_in + recv0))
        contributors = max(1.0, m_in.tiles * partials / out_elems)
        stage = 0
        if contributors > 1:
            fanins = [contributors] if contributors <= _REDUCE_FANIN else \
                [math.ceil(math.sqrt(contributors)), math.ceil(contributors / math.ceil(math.sqrt(contributors)))]
            remaining = contributors
            for fan in fanins:
                stage += 1
                left = max(1.0, math.ceil(remaining / fan))
                results = out_elems * left
                rng = self.alloc.linear(int(results), acc)
                share = rng.max_elements
                recv = share * fan * acc * n_in
                c = cyc.compute_cycles(t, share * fan * per * n_in, recv, cyc.vector_rate(t, acc),
                                       cyc.worker_pieces(t, share, acc))
                s = self.step(ctx, instr, "reduce", rng, c, cyc.exchange_cycles(t, recv, partials * acc * n_in),
                              results * fan * per * n_in, k, recv=recv,
                              src_bytes_per_tile=partials * acc, codelet="reduce")
                steps.append(s)
                ctx.points[k].temps.append((rng, recv))
                temp = max(temp, recv)
                remaining = left
        out = self.out_value(ctx, instr, k)
        first = next((b for b in _leaves(out) if isinstance(b, Buf)), None)
        self.record(instr, first.mapping if first else None, steps, temp,
                    f"{1 + stage} stage(s), {contributors:.0f} partial(s) per result")
        return out

    # -- windows ------------------------------------------------------------------------
    def _window(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        window = int(np.prod(_ints(instr, "window_size", (1,)), dtype=np.int64))
        out = self.out_value(ctx, instr, k)
        leaves = [b for b in _leaves(out) if isinstance(b, Buf)]
        m = leaves[0].mapping if leaves else self.whole()
        e = m.max_elements
        item = max(1, leaves[0].itemsize if leaves else 4)
        per = self.scalar_cost(instr.called_computations[0]) if instr.called_computations else 1.0
        if instr.opcode == "select-and-scatter":
            per += self.scalar_cost(instr.called_computations[1]) if len(instr.called_computations) > 1 else 1.0
        recv = 0.0
        send = 0.0
        for v in ops[: max(1, len(ops) // 2)] if instr.opcode == "reduce-window" else ops[:2]:
            if isinstance(v, (Buf, Bcast)):
                elems = v.elements
                recv += min(elems * v.itemsize, e * v.itemsize * max(1.0, elems / max(1, m.elements)))
                src = v if isinstance(v, Buf) else v.src
                if src is not None:
                    send = max(send, self.mapping_of(src).max_elements * src.itemsize)
        compute = cyc.compute_cycles(t, e * window * per, e * window * item, cyc.vector_rate(t, item),
                                     cyc.worker_pieces(t, e, item))
        s = self.step(ctx, instr, "window", m, compute, cyc.exchange_cycles(t, recv, send),
                      float(m.elements * window * per), k, recv=recv, src_bytes_per_tile=send,
                      codelet=instr.opcode)
        ctx.points[k].temps.append((m, recv))
        self.record(instr, m, [s], recv)
        return out

    # -- sort ---------------------------------------------------------------------------
    def _sort(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        shape = _leaf_shapes(instr.shape)[0]
        dims = [int(d) for d in shape.dims] or [1]
        dim = _int(instr, "dimension", len(dims) - 1)
        row = dims[dim] if dim < len(dims) else 1
        elems = max(1, _elems(shape))
        rows = max(1, elems // max(1, row))
        tiles = min(self.T, rows)
        row_bytes = sum(row * _itemsize(s) for s in _leaf_shapes(instr.shape))
        per_tile_rows = math.ceil(rows / tiles)
        rng = self.alloc.spread(rows, tiles)
        out_parts = []
        for s in (instr.shape.tuple_shapes if instr.shape.is_tuple else [instr.shape]):
            b = Buf(instr, _itemsize(s), max(1, _elems(s)), "activation", ctx, k,
                    TileMapping(rng.first, rng.tiles, max(1, _elems(s)), self.T))
            ctx.bufs.append(b)
            out_parts.append(b)
        out: Value = tuple(out_parts) if instr.shape.is_tuple else out_parts[0]
        per = self.scalar_cost(instr.called_computations[0]) if instr.called_computations else 1.0
        compares = row * max(1.0, math.log2(max(row, 2)))
        workers = min(t.worker_threads_per_tile, per_tile_rows)
        compute = cyc.compute_cycles(t, per_tile_rows * compares * per,
                                     per_tile_rows * compares * row_bytes / max(1, row),
                                     t.vector_fp32_flops_per_cycle_per_tile, workers)
        recv = per_tile_rows * row_bytes
        send = 0.0
        for v in ops:
            if isinstance(v, Buf):
                send = max(send, self.mapping_of(v).max_elements * v.itemsize)
        s = self.step(ctx, instr, "sort", rng, compute, cyc.exchange_cycles(t, recv, send),
                      rows * compares * per, k, recv=recv, src_bytes_per_tile=send, codelet="sort")
        ctx.points[k].temps.append((rng, recv))
        self.record(instr, out_parts[0].mapping, [s], recv, f"{rows} row(s) of {row} on {tiles} tile(s)")
        return out

    # -- batches of independent problems -------------------------------------------------
    def _problem_figures(self, instr: ir_pb2.Instruction) -> tuple[int, float, float, int, str]:
        """(problems, elements per problem, FLOPs per problem, panels, what). A problem with
        panels, split over tiles, runs one stage per panel (column or row) and shares that
        panel with its group; the others (transforms, selections) exchange each tile's share
        once per halving of the group."""
        op = instr.opcode
        shape = self._operand_shape(instr, 0)
        dims = [int(d) for d in shape.dims] or [1]
        total = max(1, _elems(shape))
        if op in ("cholesky", "triangular-solve"):
            m = max(1, dims[-1])
            batch = max(1, total // (m * m))
            if op == "cholesky":
                flops = m ** 3 / 3.0 + m * self.t.flops_per_transcendental
                return batch, float(m * m), flops, m, f"{batch} {m} x {m} matrices"
            rhs = max(1, _elems(instr.shape) // (batch * m))
            return batch, float(m * m + m * rhs), float(m * m * rhs), m, \
                f"{batch} {m} x {m} solves with {rhs} right-hand sides"
        if op == "custom-call":
            return self._custom_problem(instr, dims, total)
        if op == "fft":
            lengths = _ints(instr, "fft_length", (dims[-1],))
            n = max(1, int(np.prod(lengths, dtype=np.int64)))
            real = _attr_str(instr, "fft_type") in ("RFFT", "IRFFT")
            rows = max(1, total // max(1, int(np.prod(dims[-len(lengths):], dtype=np.int64))))
            flops = (2.5 if real else 5.0) * n * max(1.0, math.log2(n))
            return rows, float(n), flops, 0, f"{rows} transforms of {n}"
        n = max(1, dims[-1])  # topk: a selection of k in each row
        rows = max(1, total // n)
        return rows, float(n), n * math.log2(max(2, _int(instr, "k", 1))), 0, f"{rows} rows of {n}"

    def _custom_problem(self, instr: ir_pb2.Instruction, dims: list[int],
                        total: int) -> tuple[int, float, float, int, str]:
        """``_problem_figures`` of a linear-algebra custom-call on ``a [..., m, n]``. FLOPs
        (LAPACK Working Note 41): Householder QR ``2 m n^2 - 2/3 n^3`` (m >= n; ``4/3 n^3``
        square) plus a square root per column; forming Q from k reflectors
        ``4 m n k - 2 (m + n) k^2 + 4/3 k^3``; a symmetric eigendecomposition with vectors
        ``9 n^3``. One stage per column (QR, Q) or per row (Jacobi sweeps) when split."""
        target = _attr_str(instr, "custom_call_target")
        m, n = (dims[-2], dims[-1]) if len(dims) >= 2 else (1, dims[-1])
        m, n = max(1, m), max(1, n)
        batch = max(1, total // (m * n))
        if target == "Qr":
            big, small = max(m, n), min(m, n)
            flops = 2.0 * big * small ** 2 - 2.0 * small ** 3 / 3 + small * self.t.flops_per_transcendental
            return batch, float(m * n), flops, small, f"{batch} {m} x {n} QR factorizations"
        if target == "Eigh":
            return batch, float(2 * n * n), 9.0 * n ** 3, n, f"{batch} {n} x {n} eigendecompositions"
        rk = min(n, max(1, _elems(self._operand_shape(instr, 1)) // batch))  # Householder product
        flops = 4.0 * m * n * rk - 2.0 * (m + n) * rk ** 2 + 4.0 * rk ** 3 / 3
        return batch, float(m * n), flops, rk, f"{batch} {m} x {n} products of {rk} reflectors"

    def _problems(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        problems, per_elems, per_flops, panels, what = self._problem_figures(instr)
        item = max(1, _itemsize(self._operand_shape(instr, 0)))
        per_bytes = per_elems * item
        rate = cyc.vector_rate(t, item)
        budget = max(1.0, t.sram_bytes_per_tile * _PROBLEM_TILE_SHARE)
        need = min(self.T, max(1, math.ceil(per_bytes / budget)))  # tiles one problem needs

        def cost(split: int) -> tuple[float, float, float, int, float]:
            """(cycles, compute, bytes in, stages, bytes per stage) with ``split`` tiles each."""
            groups = max(1, min(problems, self.T // split))
            per_group = math.ceil(problems / groups)
            work = per_group * per_flops / split
            recv = per_group * per_bytes / split
            compute = cyc.compute_cycles(t, work, work * item / 2, rate,
                                         min(t.worker_threads_per_tile, per_group * split))
            total = compute + cyc.exchange_cycles(t, recv) + t.sync_cycles
            stages, stage_bytes = 0, 0.0
            if split > 1:
                if panels:
                    stages = panels
                    stage_bytes = per_group * per_bytes / stages
                else:
                    stages = math.ceil(math.log2(split))
                    stage_bytes = recv
                total += stages * (t.sync_cycles + cyc.exchange_cycles(t, stage_bytes, stage_bytes))
            return total, compute, recv, stages, stage_bytes

        splits = []
        split = need
        while True:
            splits.append(split)
            if split >= self.T or split * problems >= 2 * self.T:
                break
            split = min(self.T, split * 2)
        split = min(splits, key=lambda sp: cost(sp)[0])
        _, compute, recv, stages, stage_bytes = cost(split)
        groups = max(1, min(problems, self.T // split))
        rng = self.alloc.spread(groups * split, groups * split)
        send = 0.0
        for v in ops:
            if isinstance(v, Buf):
                send = max(send, self.mapping_of(v).max_elements * v.itemsize)
        flops = problems * per_flops
        codelet = _attr_str(instr, "custom_call_target") or instr.opcode  # one per target
        if not stages:
            steps = [self.step(ctx, instr, "linalg", rng, compute, cyc.exchange_cycles(t, recv, send),
                               flops, k, recv=recv, src_bytes_per_tile=send, codelet=codelet)]
        else:
            steps = [
                self.step(ctx, instr, "exchange", rng, 0.0, cyc.exchange_cycles(t, recv, send), 0.0, k,
                          recv=recv, src_bytes_per_tile=send, codelet="copy"),
                self.step(ctx, instr, "linalg", rng, compute / stages,
                          cyc.exchange_cycles(t, stage_bytes, stage_bytes), flops / stages, k,
                          repeat=stages, recv=stage_bytes, src_bytes_per_tile=stage_bytes,
                          codelet=codelet),
            ]
        parts = []
        for shape in _leaf_shapes(instr.shape):
            elems = max(1, _elems(shape))
            b = Buf(instr, _itemsize(shape), elems, "activation", ctx, k,
                    TileMapping(rng.first, rng.tiles, elems, self.T))
            ctx.bufs.append(b)
            parts.append(b)
        out: Value = tuple(parts) if instr.shape.is_tuple else parts[0]
        ctx.points[k].temps.append((rng, recv + stage_bytes))
        where = "one tile each" if split == 1 else f"{split} tiles each in {stages} stages"
        self.record(instr, rng, steps, recv + stage_bytes, f"{what} on {rng.tiles} tile(s), {where}")
        return out

    def _batch_norm(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        """Element-wise work on the operand's mapping; training and grad first reduce
        per-feature partial sums across tiles and send the moments back to every tile."""
        t = self.t
        self.use(ctx, ops, k)
        op = instr.opcode
        in_shape = self._operand_shape(instr, 0)
        elems = max(1, _elems(in_shape))
        item = max(1, _itemsize(in_shape))
        dims = [int(d) for d in in_shape.dims] or [1]
        fi = _int(instr, "feature_index", len(dims) - 1)
        features = max(1, dims[fi] if fi < len(dims) else 1)
        x = ops[0]
        m = self.mapping_of(x) if isinstance(x, Buf) and x.elements == elems \
            else self.alloc.linear(elems, item)
        e = m.max_elements
        local_features = min(features, e)
        # (partial sums per feature, FLOPs per element reducing, FLOPs per element normalizing)
        stats, reduce_flops, ew_flops = {
            "batch-norm-training": (2, 3.0, 3.0),
            "batch-norm-inference": (0, 0.0, 3.0),
            "batch-norm-grad": (2, 4.0, 6.0),
        }[op]
        vectors = len(ops) - 1 - (op == "batch-norm-grad")
        vec_recv = local_features * item * vectors  # scale, offset, moments for this tile's features
        rate = cyc.vector_rate(t, item)
        pieces = cyc.worker_pieces(t, e, item)
        steps = []
        temp = float(vec_recv)
        if stats:
            c1 = cyc.compute_cycles(t, reduce_flops * e, e * item * (1 + (op == "batch-norm-grad")), rate, pieces)
            steps.append(self.step(ctx, instr, "reduce", m, c1, cyc.exchange_cycles(t, vec_recv), reduce_flops * elems,
                                   k, recv=vec_recv, codelet="reduce"))
            # Partials of each statistic travel to its owner, in two stages from many tiles.
            contributors = max(1.0, m.tiles * local_features / features)
            fanins = [contributors] if contributors <= _REDUCE_FANIN else \
                [math.ceil(math.sqrt(contributors)), math.ceil(contributors / math.ceil(math.sqrt(contributors)))]
            remaining = contributors
            sent = local_features * stats * _ACC_BYTES
            for fan in fanins:
                left = max(1.0, math.ceil(remaining / fan))
                owners = self.alloc.linear(int(features * stats * left), _ACC_BYTES)
                recv = owners.max_elements * fan * _ACC_BYTES
                c2 = cyc.compute_cycles(t, owners.max_elements * fan, recv, cyc.vector_rate(t, _ACC_BYTES),
                                        cyc.worker_pieces(t, owners.max_elements, _ACC_BYTES))
                steps.append(self.step(ctx, instr, "reduce", owners, c2, cyc.exchange_cycles(t, recv, sent),
                                       features * stats * left * fan, k, recv=recv, src_bytes_per_tile=sent,
                                       codelet="reduce"))
                ctx.points[k].temps.append((owners, recv))
                temp = max(temp, recv)
                sent = owners.max_elements * _ACC_BYTES
                remaining = left
            back = local_features * stats * _ACC_BYTES
        else:
            back = float(vec_recv)
        c3 = cyc.compute_cycles(t, (ew_flops + t.flops_per_transcendental * local_features / e) * e,
                                e * item * (2 + (op == "batch-norm-grad")), rate, pieces)
        steps.append(self.step(ctx, instr, "element-wise", m, c3, cyc.exchange_cycles(t, back), ew_flops * elems,
                               k, recv=back, codelet=op))
        ctx.points[k].temps.append((m, temp))
        leaves = _leaf_shapes(instr.shape)
        parts = [Buf(instr, _itemsize(leaves[0]), elems, "activation", ctx, k, m)]
        for shape in leaves[1:]:
            parts.append(self.new_buf(ctx, instr, shape, k))
        ctx.bufs.append(parts[0])
        out: Value = tuple(parts) if instr.shape.is_tuple else parts[0]
        self.record(instr, m, steps, temp, f"{features} feature(s) over {m.tiles} tile(s)")
        return out

    # -- control flow -------------------------------------------------------------------
    def _while(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        state = self._materialize(ctx, ops[0], instr, k)
        self.use(ctx, state, k)
        by_id = {i.id: i for i in ctx.comp.instructions}
        trips: TripCount = loop_trip_count(self.module, instr, by_id)
        cond_id, body_id = instr.called_computations[0], instr.called_computations[1]
        saved = self.eff
        cond = self.plan_comp(cond_id, [state], instr)
        body = self.plan_comp(body_id, [state], instr)
        self.eff = saved
        # The body's new state is copied into the loop's state buffers at the end of a trip.
        copy_bytes = 0.0
        state_leaves = list(_leaves(state))
        for old, new in zip(state_leaves, _leaves(body.root), strict=False):
            if new is not old and isinstance(old, Buf):
                copy_bytes = max(copy_bytes, self.mapping_of(old).max_elements * old.itemsize)
        if ctx.caller is None:  # the device loop: each step syncs the replicas
            self.replica_sync(body, f"replica sync of {instr.name}", len(body.points))
        loop = Step(instr, "loop", 0.0, 0.0, 0.0, self.T, 0.0, k, repeat=max(0, trips.trips))
        loop.children = [cond, body]
        if copy_bytes:
            loop.compute = cyc.compute_cycles(t, 0.0, 2 * copy_bytes, 1.0, t.worker_threads_per_tile)
            loop.sync = float(t.sync_cycles)
        ctx.steps.append(loop)
        ctx.points[k].subs.append([cond, body])
        self.loops.append({"name": instr.name, "trips": trips.trips, "kind": trips.kind,
                           "note": trips.note, "cycles_per_trip": loop.cycles})
        if trips.note:
            self.notes.append(trips.note)
        self.record(instr, None, [loop], 0.0, f"{trips.trips} trip(s) ({trips.kind})")
        return state

    def _call(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        self.use(ctx, ops, k)
        saved = self.eff
        callee = self.plan_comp(instr.called_computations[0], list(ops), instr)
        self.eff = saved
        step = Step(instr, "call", 0.0, 0.0, 0.0, self.T, 0.0, k)
        step.children = [callee]
        ctx.steps.append(step)
        ctx.points[k].subs.append([callee])
        for leaf in _leaves(callee.root):  # results now belong to the caller
            if isinstance(leaf, Buf) and leaf.ctx is callee:
                leaf.ctx, leaf.born, leaf.last, leaf.fused = ctx, k, k, False
                ctx.bufs.append(leaf)
        self.record(instr, None, [step])
        return callee.root

    def _conditional(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        self.use(ctx, ops, k)
        saved = self.eff
        branches = [self.plan_comp(c, [ops[1 + n]] if 1 + n < len(ops) else [], instr)
                    for n, c in enumerate(instr.called_computations)]
        self.eff = saved
        step = Step(instr, "call", 0.0, 0.0, float(self.t.sync_cycles), self.T, 0.0, k)
        if branches:
            step.children = [max(branches, key=lambda b: b.cycles)]
        ctx.steps.append(step)
        ctx.points[k].subs.append(branches)
        out = self.out_value(ctx, instr, k)
        self.record(instr, None, [step], 0.0, f"costliest of {len(branches)} branch(es)")
        return out

    # -- replicas -----------------------------------------------------------------------
    def _all_reduce(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        """``tf_ipu_all_reduce``: a ring all-reduce over the replicas' IPUs, in place (as
        GCL's cross-replica all-reduce of gradients runs: the result is the operand's buffer);
        each tile holds one ring chunk (1/R of its share) of receive buffer meanwhile. The
        additions of each step run on the tiles while the next chunk travels and are not
        charged (the links are far slower). One replica: the operands themselves (a view)."""
        if self.rep is None:
            return tuple(ops) if instr.shape.is_tuple else (ops[0] if ops else Bcast(None, 1, 0))
        rep = self.rep
        assert rep.ring is not None
        self.use(ctx, ops, k)
        outs: list[Buf] = []
        nbytes = 0
        temp = 0.0
        for v, shape in zip(ops, _leaf_shapes(instr.shape), strict=False):
            elems, item = max(1, _elems(shape)), max(1, _itemsize(shape))
            if isinstance(v, Buf) and v.elements == elems and v.itemsize == item:
                m = self.mapping_of(v)
                outs.append(v)  # in place
            else:
                m = self.alloc.linear(elems, item)
                b = Buf(instr, item, elems, "activation", ctx, k, m)
                ctx.bufs.append(b)
                outs.append(b)
            nbytes += elems * item
            chunk = m.max_elements * item / rep.replicas   # one ring chunk per tile
            ctx.points[k].temps.append((m, chunk))
            temp = max(temp, chunk)
        if not outs:
            return Bcast(None, 1, 0)
        seconds = all_reduce_seconds(rep.ring, rep.replicas, nbytes)
        step = self.step(ctx, instr, "all-reduce", outs[0].mapping, 0.0, 0.0, 0.0, k,
                         codelet="all-reduce")
        step.sync = 0.0
        step.link = seconds * self.t.clock_hz
        step.link_bytes = float(nbytes)
        reduction = _backend_config(instr) or "sum"
        self.collectives.append({
            "name": instr.name, "layer": layer_name(instr), "reduction": reduction,
            "bytes": nbytes, "seconds": seconds, "cycles": step.link,
        })
        self.record(instr, outs[0].mapping, [step], temp,
                    f"ring all-reduce ({reduction}) of {nbytes:,} B per replica over "
                    f"{rep.replicas} replicas: {seconds * 1e6:,.2f} us")
        return tuple(outs) if instr.shape.is_tuple else outs[0]

    def replica_sync(self, ctx: CompPlan, what: str, order: int) -> Step | None:
        """A sync across the replicas' IPUs appended to ``ctx`` (None: one replica)."""
        if self.rep is None:
            return None
        instr = ir_pb2.Instruction(name=what, opcode="replica-sync")
        step = Step(instr, "replica-sync", 0.0, 0.0, 0.0, self.T, 0.0, order)
        step.link = self.rep.external_sync_s * self.t.clock_hz
        ctx.steps.append(step)
        return step

    def implied_all_reduce(self, ctx: CompPlan, nbytes: int) -> None:
        """An all-reduce of ``nbytes`` per replica that the module does not contain, at the
        end of ``ctx`` (no memory: its data exist anyway)."""
        assert self.rep is not None and self.rep.ring is not None
        seconds = all_reduce_seconds(self.rep.ring, self.rep.replicas, nbytes)
        instr = ir_pb2.Instruction(name="implied all-reduce", opcode="custom-call")
        step = Step(instr, "all-reduce", 0.0, 0.0, 0.0, self.T, 0.0, len(ctx.points))
        step.link = seconds * self.t.clock_hz
        step.link_bytes = float(nbytes)
        ctx.steps.append(step)
        self.collectives.append({"name": instr.name, "layer": "", "reduction": "sum",
                                 "bytes": nbytes, "seconds": seconds, "cycles": step.link,
                                 "implied": True})
        self.notes.append(f"an all-reduce of {nbytes:,} B per replica that the program does not "
                          "contain is charged once per call (the replicas' gradient sum)")


def live_instructions(comp: ir_pb2.Computation) -> list[ir_pb2.Instruction]:
    """The instructions the root depends on (and every parameter), in program order: the
    compiler's dead code elimination, for modules planned without compiling them."""
    by_id = {i.id: i for i in comp.instructions}
    needed = {comp.root_id} | {
        i.id for i in comp.instructions
        if i.opcode == "custom-call" and _attr_str(i, "custom_call_target") in HOST_TARGETS | REPLICA_TARGETS
    }
    for instr in reversed(comp.instructions):
        if instr.id in needed:
            needed.update(instr.operands)
    return [i for i in comp.instructions if i.id in needed or i.opcode == "parameter"] if by_id else []


def plan_module(module: ir_pb2.Module, target: Target, live: LiveFn | None = None, *,
                param_kinds: dict[int, str] | None = None,
                mappings: dict[str, TileMapping] | None = None,
                replication: Replication | None = None,
                implied_all_reduce_bytes: int = 0) -> ModulePlan:
    """Plans ``module`` for ``target`` (see module docstring).

    Args:
        module: the IR module.
        target: the IPU preset (``arch.get_target``).
        live: each computation's live instructions in program order (the compiler's dead
            code elimination); by default :func:`live_instructions`.
        param_kinds: entry parameter number -> "argument" | "variable" | "constant",
            overriding what the module says.
        mappings: instruction name -> :class:`TileMapping` for entry parameters and
            constants (to study a given layout, e.g. a tensor on one tile).
        replication: the replicas running the program (``replication.replication``); None
            or one replica: a single-IPU program.
        implied_all_reduce_bytes: bytes per replica of an all-reduce the replicated run
            implies but the module does not contain (a training step lowered without its
            cross-replica gradient sum), charged once per call at the end of the program.

    Returns:
        The :class:`ModulePlan`.
    """
    planner = _Planner(module, target, live or live_instructions, param_kinds, mappings, replication)
    entry, params = planner.plan_entry()
    if planner.rep is not None:
        planner.replica_sync(entry, "replica sync of the call", -1)
        entry.steps.insert(0, entry.steps.pop())  # at the start of the call
        if implied_all_reduce_bytes > 0:
            planner.implied_all_reduce(entry, int(implied_all_reduce_bytes))
    for b in params:
        planner.mapping_of(b)
    for rec in planner.ops.values():
        if rec.mapping is None and rec.buf is not None:
            rec.mapping = rec.buf.mapping
    code = planner.code
    for cov in planner.codelets.values():
        code = code + cov * target.codelet_bytes
    # Host transfers: arguments in; results that are not updated variables out.
    host_in = sum(b.nbytes for b in params if b.kind == "argument")
    root_instr = next(i for i in entry.comp.instructions if i.id == entry.comp.root_id)
    aliased = {int(a.output_index) for a in module.aliases}
    host_out = 0
    for n, shape in enumerate(_leaf_shapes(root_instr.shape)):
        if n not in aliased and shape.dtype != ir_pb2.TOKEN:
            host_out += _elems(shape) * _itemsize(shape)
    # Updated variables are written over their parameters (in place).
    root_leaves = list(_leaves(entry.root))
    for n in aliased:
        if n < len(root_leaves) and isinstance(root_leaves[n], Buf) and root_leaves[n].ctx is entry:
            root_leaves[n].inplace = True
    flops = entry.totals()[3]
    return ModulePlan(target, entry, planner.ops, params, planner.constants, code,
                      planner.exch_code, int(host_in), int(host_out), planner.loops,
                      list(dict.fromkeys(planner.notes)), flops, replication, planner.collectives)
