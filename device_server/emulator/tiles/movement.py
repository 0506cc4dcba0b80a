"""Planning of data movement: constants, views, broadcasts, operand exchange, moves.

    constant      <= 64 B: replicated where used (a Bcast); larger: laid out linearly, always live
    view          reshape, bitcast, copy, ...: the operand's buffer itself (no superstep)
    broadcast     a Bcast view: each consumer receives the distinct elements it needs
    _inflow       bytes an operand must travel for a result's mapping: (fullest receiver,
                  busiest sender); nothing when the layouts agree
    move          transpose, slice, concatenate, pad, reverse, gather, dynamic-slice: the
                  result laid out linearly, every tile receives its part, an on-tile copy;
                  scatter and dynamic-update-slice in place on the operand's mapping; on a
                  sliceable buffer (a loop's stash, mapping.Allocator.sliceable) a slice is
                  spread over all its tiles: an update sends each tile its part, and a
                  dynamic-slice of one slice stays where it is (an on-tile copy)
"""

from __future__ import annotations

import math

from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles.irinfo import attr_ints, shape_elems, shape_itemsize
from device_server.emulator.tiles.mapping import TileMapping
from device_server.emulator.tiles.plan import Bcast, Buf, CompPlan, Value
from device_server.emulator.tiles.state import PlannerState
from device_server.protocol import ir_pb2

__all__ = ["MovementPlanning"]

# Constants up to this size are replicated on the tiles that use them (not mapped, no exchange).
_REPLICATED_CONSTANT_BYTES = 64


class MovementPlanning(PlannerState):
    """Constants, views, broadcasts, the exchange of operands and data movement."""

    def _constant(self, ctx: CompPlan, instr: ir_pb2.Instruction, k: int) -> Value:
        size = shape_elems(instr.shape) * shape_itemsize(instr.shape)
        if instr.shape.is_tuple or size <= _REPLICATED_CONSTANT_BYTES:
            return Bcast(None, max(1, shape_elems(instr.shape)), shape_itemsize(instr.shape))
        b = Buf(instr, shape_itemsize(instr.shape), shape_elems(instr.shape), "constant", None, k)
        b.mapping = self.overrides.get(instr.name) or self.alloc.linear(b.elements, b.itemsize)
        self.constants.append(b)
        return b

    @staticmethod
    def _view(v: Value, instr: ir_pb2.Instruction) -> Value:
        if isinstance(v, Bcast):
            return Bcast(v.src, max(1, shape_elems(instr.shape)), v.itemsize)
        return v

    def _broadcast(self, v: Value, instr: ir_pb2.Instruction) -> Value:
        out = max(1, shape_elems(instr.shape))
        if isinstance(v, Bcast):
            return Bcast(v.src, out, shape_itemsize(instr.shape))
        if isinstance(v, Buf) and v.elements == out:
            return v
        return Bcast(v if isinstance(v, Buf) else None, out, shape_itemsize(instr.shape))

    @staticmethod
    def _trivial_transpose(instr: ir_pb2.Instruction, v: Value) -> bool:
        perm = attr_ints(instr, "permutation")
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

    # -- data movement ------------------------------------------------------------------
    def _move(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        op = instr.opcode
        self.use(ctx, ops, k)
        out_elems = max(1, shape_elems(instr.shape))
        item = max(1, shape_itemsize(instr.shape))
        in_place = op in ("dynamic-update-slice", "scatter") and isinstance(ops[0], Buf) \
            and ops[0].elements == out_elems
        mapping = self.mapping_of(ops[0]) if in_place else None
        # One slice of a sliceable buffer, read where it lies (each tile its part of it).
        sliced = not in_place and op == "dynamic-slice" and isinstance(ops[0], Buf) \
            and self.mapping_of(ops[0]).slices > 1 \
            and out_elems * self.mapping_of(ops[0]).slices <= ops[0].elements
        if sliced:
            src = self.mapping_of(ops[0])
            mapping = TileMapping(src.first, max(1, min(src.tiles, out_elems)), out_elems, src.total_tiles)
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
            # A sliceable buffer holds part of every slice on each tile: the update's
            # elements go to all its tiles. Else they land on the tiles of one run.
            per_tile = math.ceil(upd_elems / m.tiles) if m.slices > 1 else upd_elems
            recv = min(per_tile, e) * item
            if op == "scatter":
                recv += min(per_tile, e) * 4  # indices travel with the updates
            if m.slices > 1:  # the buffer itself sends nothing: only the update travels
                send = max([self.mapping_of(b).max_elements * b.itemsize for b in
                            (v if isinstance(v, Buf) else v.src if isinstance(v, Bcast) else None
                             for v in ops[1:]) if b is not None], default=0.0)
            work = recv
            tiles_rng = m
        elif sliced:
            recv = send = 0.0  # each tile copies its part of the slice: no exchange
            work = 2.0 * e * item
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
