"""The plan's data: values, supersteps, program points, computation and module plans.

    Value    = Buf (a stored tensor: mapping, kind, live range born..last in program points)
             | Bcast (a broadcast view of a Buf, or a replicated scalar) | tuple of values
    Step     one BSP superstep (or ``repeat`` identical ones): compute / exchange / sync /
             link cycles of the slowest tile; loops and calls hold their callees' CompPlans
    Point    one program point (a live instruction): its temporaries and called computations
    CompPlan one computation at one call site: points, buffers, steps, root value
    ModulePlan the entry's CompPlan plus what is always live (parameters, constants, code)

The planner (``planner.py`` and its opcode modules) fills these in; ``memory.py`` and
``schedule.py`` read the points and buffers, ``report.py`` the steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_server.emulator.arch import Target
from device_server.emulator.tiles.irinfo import layer_name, stage_of
from device_server.emulator.tiles.mapping import TileMapping
from device_server.emulator.tiles.replication import Replication
from device_server.protocol import ir_pb2

__all__ = ["Bcast", "Buf", "CompPlan", "EwGroup", "ModulePlan", "OpRecord", "Point", "Step",
           "Value", "value_leaves"]


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
        self.inplace = False        # written over another buffer (an updated variable over
                                    # its parameter, a loop's stash update over the loop state)
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


def value_leaves(v: Value) -> Iterator[Buf | Bcast]:
    if isinstance(v, (tuple, list)):
        for x in v:
            yield from value_leaves(x)
    elif v is not None:
        yield v


class Step:
    """One BSP superstep (or ``repeat`` identical ones): cycles of the slowest tile."""

    __slots__ = ("name", "opcode", "layer", "kind", "compute", "exchange", "sync", "tiles",
                 "flops", "repeat", "order", "children", "ew", "link", "link_bytes", "stage")

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
        self.ew: EwGroup | None = None
        # Between IPUs (replicated programs): cycles of an all-reduce over the IPU-Links or of
        # a sync across the replicas' IPUs ("all-reduce" / "replica-sync" steps), and the bytes
        # each replica sends into the all-reduce.
        self.link = 0.0
        self.link_bytes = 0.0
        self.stage = stage_of(instr)     # its pipeline stage (0 unless pipelined)

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
class EwGroup:
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
    uses: list[Buf] = field(default_factory=list)  # buffers it reads (for the scheduler)


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
    # (new value, parameter) of each updated variable written over its parameter: every
    # read of the parameter comes first (a constraint on the schedule)
    overwrites: list[tuple[Buf, Buf]] = field(default_factory=list)
    # Pipelined programs: per stage (its IPU) the code and exchange code per tile;
    # ``code_bytes`` / ``exchange_code_bytes`` are their sums (all stages on one chip).
    stages: int = 1
    stage_code_bytes: list[np.ndarray] = field(default_factory=list)
    stage_exchange_code_bytes: list[np.ndarray] = field(default_factory=list)

    def op(self, name: str) -> OpRecord:
        """The record of the instruction called ``name``."""
        if name not in self.ops:
            raise KeyError(f"no planned instruction named {name!r}")
        return self.ops[name]
