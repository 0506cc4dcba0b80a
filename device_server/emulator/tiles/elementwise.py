"""Planning of element-wise instructions, their fusion, generators and generic tuple ops.

    out = op(a, b, ...)   the mapping of the first operand of the output's size (else linear);
                          other operands exchanged in (``_inflow``), broadcasts bring each tile
                          the elements it needs; vector rate, FLOPs per element from the opcode
    fusion:   a = f(x); b = g(a, y)  with  a used only by g, on the same mapping
              -> one compute set (EwGroup) for f and g; a is never stored; x, y live until g
    iota, rng*: generated in place on the result's linear mapping
    other tuple-shaped ops: one compute set over their results
"""

from __future__ import annotations

from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles.irinfo import TRANSCENDENTAL_OPS, shape_elems, shape_itemsize
from device_server.emulator.tiles.plan import Bcast, Buf, CompPlan, EwGroup, Value, value_leaves
from device_server.emulator.tiles.state import PlannerState
from device_server.protocol import ir_pb2

__all__ = ["ElementwisePlanning"]


class ElementwisePlanning(PlannerState):
    """Element-wise instructions (with fusion), generators and generic tuple ops."""

    # -- element-wise -------------------------------------------------------------------
    def _elementwise(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        out_elems = max(1, shape_elems(instr.shape))
        out_item = shape_itemsize(instr.shape)
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
        elif op in TRANSCENDENTAL_OPS:
            per = t.flops_per_transcendental
        else:
            per = 1.0
        self.use(ctx, ops, k)
        # Fusion into the compute set that produced an operand.
        group: EwGroup | None = None
        fused_input: Buf | None = None
        for v in ops:
            if (isinstance(v, Buf) and v.group is not None and v.ctx is ctx and v.group.ew is not None
                    and self.eff.get(v.producer, 2) == 1 and v.group.ew.mapping.same_as(mapping)
                    and (self.stages == 1 or v.group.stage == self.stage)):  # never across IPUs
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
            uses = ctx.points[k].uses
            for b in group.inputs:  # the chain runs here: its inputs live until now
                uses.append(b)
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
        group = EwGroup(step, mapping, per, mem, max(1, out_item), recv, send, inputs)
        step.ew = group
        self._ew_cost(group)
        out.group = step
        if recv:
            ctx.points[k].temps.append((mapping, recv))
        self.record(instr, mapping, [step], recv)
        return out

    def _ew_cost(self, g: EwGroup) -> None:
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
        leaves = [b for b in value_leaves(out) if isinstance(b, Buf)]
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
        bufs = [b for b in value_leaves(out) if isinstance(b, Buf)]
        total = sum(b.elements for b in bufs)
        m = bufs[0].mapping if bufs else self.whole()
        e = max((b.mapping.max_elements for b in bufs), default=1) * max(1, len(bufs))
        compute = cyc.compute_cycles(self.t, e, e * 4, self.t.vector_fp32_flops_per_cycle_per_tile,
                                     cyc.worker_pieces(self.t, e, 4))
        s = self.step(ctx, instr, "element-wise", m, compute, 0.0, float(total), k)
        self.record(instr, m, [s])
        return out
