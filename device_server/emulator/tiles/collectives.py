"""Planning of the collectives of replicated programs (the ring's figures: replication.py).

    custom-call tf_ipu_all_reduce  one "all-reduce" step whose ``link`` cycles are the ring's
                                   time for the operands' bytes; in place; one ring chunk of
                                   receive buffer per tile; one replica: a view
    replica_sync                   a sync across the replicas' IPUs (each call, each trip of
                                   the device loop)
    implied_all_reduce             the gradients' all-reduce a training step lowered without
                                   one implies, once per call at its end
"""

from __future__ import annotations

from device_server.emulator.tiles.irinfo import (
    backend_config,
    layer_name,
    leaf_shapes,
    shape_elems,
    shape_itemsize,
)
from device_server.emulator.tiles.plan import Bcast, Buf, CompPlan, Step, Value
from device_server.emulator.tiles.replication import all_reduce_seconds
from device_server.emulator.tiles.state import PlannerState
from device_server.protocol import ir_pb2

__all__ = ["CollectivePlanning"]


class CollectivePlanning(PlannerState):
    """All-reduces and syncs across replicas."""

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
        for v, shape in zip(ops, leaf_shapes(instr.shape), strict=False):
            elems, item = max(1, shape_elems(shape)), max(1, shape_itemsize(shape))
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
        reduction = backend_config(instr) or "sum"
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
