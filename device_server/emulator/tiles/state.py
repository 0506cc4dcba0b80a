"""The planner's state and the helpers every opcode planner uses.

    PlannerState: module, target (T tiles), allocator (linear layouts), records per
                  instruction (OpRecord), code and exchange-code bytes per tile, codelets,
                  loops, notes, collectives
      mapping_of / new_buf / out_value   buffers for results (laid out linearly by default)
      use(ctx, value, k)                 extends live ranges to program point k
      step(...)                          a superstep on a run of tiles (+ its code bytes)
      record(...)                        what was decided for an instruction

The opcode planners (``elementwise.py``, ``movement.py``, ``products.py``, ``reductions.py``,
``problems.py``, ``control.py``, ``collectives.py``) are mixins of this class; ``planner.py``
composes them, walks the computations and sends each instruction to its planner (a mixin
may call another's methods through that composed planner).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from device_server.emulator.arch import Target
from device_server.emulator.tiles.irinfo import (
    PLUMBING_OPS,
    STAGE_ATTR,
    TRANSCENDENTAL_OPS,
    attr_int,
    layer_name,
    shape_elems,
    shape_itemsize,
)
from device_server.emulator.tiles.mapping import Allocator, TileMapping
from device_server.emulator.tiles.plan import (
    Bcast,
    Buf,
    CompPlan,
    OpRecord,
    Step,
    Value,
    value_leaves,
)
from device_server.emulator.tiles.proportions import StageProportions
from device_server.emulator.tiles.replication import Replication
from device_server.protocol import ir_pb2

__all__ = ["LiveFn", "PlannerState"]

LiveFn = Callable[[ir_pb2.Computation], list[ir_pb2.Instruction]]


class PlannerState:
    """What every opcode planner shares: the module, the target, the allocator, the records
    and the always-live code figures, with the helpers that make buffers and supersteps."""

    def __init__(self, module: ir_pb2.Module, target: Target, live: LiveFn,
                 kinds: dict[int, str] | None, mappings: dict[str, TileMapping] | None,
                 replication: Replication | None = None, stages: int = 1) -> None:
        self.module = module
        self.rep = replication if replication is not None and replication.replicated else None
        self.collectives: list[dict[str, Any]] = []
        self.t = target
        self.T = target.tiles_per_ipu
        self.live = live
        self.comps = {c.id: c for c in module.computations}
        self.kinds = kinds or {}
        self.overrides = mappings or {}
        self.ops: dict[str, OpRecord] = {}
        self.constants: list[Buf] = []
        # Per pipeline stage (one IPU each; one stage unless pipelined): its tiles' layouts,
        # code and exchange code. ``alloc``, ``code``, ``exch_code`` and ``codelets`` are
        # those of the stage of the instruction being planned (``enter_stage``).
        self.stages = max(1, int(stages))
        self.stage = 0
        self.stage_alloc = [Allocator(self.T, target.min_bytes_per_tile) for _ in range(self.stages)]
        self.stage_code = [np.zeros(self.T) for _ in range(self.stages)]
        self.stage_exch_code = [np.zeros(self.T) for _ in range(self.stages)]
        self.stage_codelets: list[dict[tuple[str, int], np.ndarray]] = [{} for _ in range(self.stages)]
        self.alloc = self.stage_alloc[0]
        self.code = self.stage_code[0]
        self.exch_code = self.stage_exch_code[0]
        self.codelets = self.stage_codelets[0]
        self.loops: list[dict[str, Any]] = []
        self.notes: list[str] = []
        # opcode ("dot", "convolution") -> PopLibs' availableMemoryProportion for its plans
        # (plan_module's memory_proportions; an opcode not named: the preset's).
        self.memory_proportions: dict[str, float] = {}
        # Per pass of a pipeline stage (PipelineStageOptions): replaces memory_proportions there.
        self.stage_proportions = StageProportions()
        # Opcode -> PopLibs' partialsType of its products, "float" or "half" (plan_module's
        # partials_types; an opcode not named: "float").
        self.partials_types: dict[str, str] = {}
        self.scalar_cost_cache: dict[int, float] = {}
        self.aliased_params = {int(a.parameter_number) for a in module.aliases}
        self._shapes = {i.id: i.shape for c in module.computations for i in c.instructions}
        self.eff: dict[int, int] = {}

    # -- helpers ------------------------------------------------------------------------
    def enter_stage(self, instr: ir_pb2.Instruction) -> None:
        """Plans what follows on the IPU of ``instr``'s pipeline stage (its ``pipeline_stage``
        attribute; not pipelined: always stage 0)."""
        if self.stages == 1:
            return
        s = attr_int(instr, STAGE_ATTR, 0)
        if not 0 <= s < self.stages:
            raise ValueError(f"instruction {instr.name!r} ({instr.source_op or instr.opcode}) is "
                             f"in pipeline stage {s}, but the program has {self.stages} stages "
                             f"(0 .. {self.stages - 1}).")
        if s != self.stage:
            self.stage = s
            self.alloc = self.stage_alloc[s]
            self.code = self.stage_code[s]
            self.exch_code = self.stage_exch_code[s]
            self.codelets = self.stage_codelets[s]

    def memory_proportion_of(self, instr: ir_pb2.Instruction) -> float | None:
        """PopLibs' availableMemoryProportion ``instr`` (a dot or convolution) is planned with:
        its stage's for its pass if one was given (``proportions.py``), else the program's for
        its opcode, else None (the preset's)."""
        own = self.stage_proportions.of(instr)
        return own if own is not None else self.memory_proportions.get(instr.opcode)

    def mapping_of(self, buf: Buf) -> TileMapping:
        if buf.mapping is None:
            buf.mapping = self.alloc.linear(buf.elements, buf.itemsize)
        return buf.mapping

    def whole(self) -> TileMapping:
        return TileMapping(0, self.T, self.T, self.T)

    def new_buf(self, ctx: CompPlan, instr: ir_pb2.Instruction, shape: ir_pb2.Shape, k: int,
                mapping: TileMapping | None = None) -> Buf:
        b = Buf(instr, shape_itemsize(shape), max(1, shape_elems(shape)), "activation", ctx, k, mapping)
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
        """Point ``k`` of ``ctx`` reads ``value``: its buffers live until then at least."""
        uses = ctx.points[k].uses
        for leaf in value_leaves(value):
            b = leaf if isinstance(leaf, Buf) else leaf.src
            if b is not None:
                uses.append(b)
                if b.ctx is ctx and b.last < k:
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
        self.codelet((codelet or kind, shape_itemsize(instr.shape)), rng)
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
                if i.opcode in PLUMBING_OPS:
                    continue
                if i.called_computations:
                    cost += sum(self.scalar_cost(c) for c in i.called_computations)
                elif i.opcode in TRANSCENDENTAL_OPS:
                    cost += self.t.flops_per_transcendental
                else:
                    cost += 1.0
        cost = max(1.0, cost)
        self.scalar_cost_cache[comp_id] = cost
        return cost

    def _operand_shape(self, instr: ir_pb2.Instruction, n: int) -> ir_pb2.Shape:
        return self._shapes[instr.operands[n]]

    def plan_comp(self, comp_id: int, args: list[Value], caller: ir_pb2.Instruction) -> CompPlan:
        """Plans a called computation with ``args`` bound to its parameters (``planner.py``)."""
        raise NotImplementedError
