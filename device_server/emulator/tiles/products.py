"""Planning of ``dot`` and ``convolution``: the instruction as a grouped matrix product.

    dot:          G (batch dims) x M (lhs free) x N (rhs free) x K (contracted)
    convolution:  G = feature x batch group counts, M = batch x output positions,
                  N = output channels per group, K = input channels per group, window (halo);
                  a weight-update convolution (window covering most of its input) is a plain
                  product over channels x window
    -> matmul.plan_matmul (the search over splits) -> one superstep per serial pass, and a
       reduction of FP32 partials when K is split; unmapped weights laid out for the plan
"""

from __future__ import annotations

import dataclasses

import numpy as np

from device_server.emulator.tiles.irinfo import (
    attr_int,
    attr_ints,
    is_floating,
    layer_name,
    shape_elems,
    shape_itemsize,
)
from device_server.emulator.tiles.matmul import (
    MatmulPlan,
    MatmulProblem,
    Rearrangement,
    linear_operand,
    plan_matmul,
    plan_rearranged,
)
from device_server.emulator.tiles.plan import Bcast, Buf, CompPlan, Value
from device_server.emulator.tiles.state import PlannerState
from device_server.protocol import ir_pb2

__all__ = ["ProductPlanning"]


class ProductPlanning(PlannerState):
    """``dot`` and ``convolution`` instructions."""

    # -- matrix products and convolutions ----------------------------------------------
    def _matmul_problem(self, instr: ir_pb2.Instruction, ops: list[Value]) -> MatmulProblem:
        a_shape = self._operand_shape(instr, 0)
        b_shape = self._operand_shape(instr, 1)
        a_bytes = shape_elems(a_shape) * shape_itemsize(a_shape)
        b_bytes = shape_elems(b_shape) * shape_itemsize(b_shape)
        item = max(shape_itemsize(a_shape), shape_itemsize(b_shape))
        floating = is_floating(a_shape) and is_floating(b_shape)
        out_item = shape_itemsize(instr.shape)
        if instr.opcode == "dot":
            ad, bd = list(a_shape.dims), list(b_shape.dims)
            lb, lc = attr_ints(instr, "lhs_batch_dimensions"), attr_ints(instr, "lhs_contracting_dimensions")
            rb, rc = attr_ints(instr, "rhs_batch_dimensions"), attr_ints(instr, "rhs_contracting_dimensions")
            G = int(np.prod([ad[d] for d in lb], dtype=np.int64)) if lb else 1
            K = int(np.prod([ad[d] for d in lc], dtype=np.int64)) if lc else 1
            M = int(np.prod([ad[d] for d in range(len(ad)) if d not in lb and d not in lc], dtype=np.int64))
            N = int(np.prod([bd[d] for d in range(len(bd)) if d not in rb and d not in rc], dtype=np.int64))
            return MatmulProblem(max(1, G), max(1, M), max(1, N), max(1, K), 1, a_bytes, b_bytes,
                                 0.0, item, out_item, floating)
        ad, kd, od = list(a_shape.dims), list(b_shape.dims), list(instr.shape.dims)
        fgc = max(1, attr_int(instr, "feature_group_count", 1))
        bgc = max(1, attr_int(instr, "batch_group_count", 1))
        G = fgc * bgc
        kin = kd[attr_int(instr, "kernel_input_feature_dimension", 0)] if kd else 1
        kout = kd[attr_int(instr, "kernel_output_feature_dimension", 0)] if kd else 1
        kspatial = attr_ints(instr, "kernel_spatial_dimensions")
        window = int(np.prod([kd[d] for d in kspatial], dtype=np.int64)) if kspatial else 1
        ob = od[attr_int(instr, "output_batch_dimension", 0)] if od else 1
        ospatial = attr_ints(instr, "output_spatial_dimensions")
        positions = int(np.prod([od[d] for d in ospatial], dtype=np.int64)) if ospatial else 1
        ispatial = attr_ints(instr, "input_spatial_dimensions")
        dil = attr_ints(instr, "window_dilation")
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

    def _matmul(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        problem = self._matmul_problem(instr, ops)
        # Parameters no one has laid out yet are laid out for this plan (Poplar's createWeights).
        unmapped = [isinstance(v, Buf) and v.mapping is None and v.ctx is None for v in ops[:2]]
        if any(unmapped):
            problem = dataclasses.replace(problem, a_local=unmapped[0], b_local=unmapped[1])
        if self.partials_types.get(instr.opcode) == "half" and problem.floating and problem.itemsize <= 2:
            problem = dataclasses.replace(problem, partials_bytes=2)  # FP16 partials
        # Variables mapped linearly (variable_mapping="linear"): poplin may rearrange them first.
        linear = [linear_operand(v.mapping if isinstance(v, Buf) and v.ctx is None else None, v.itemsize,
                                 instr, n, self._operand_shape(instr, n).dims) for n, v in enumerate(ops[:2])]
        plan, copy = (plan_rearranged(problem, t, self.memory_proportion_of(instr), linear) if any(linear)
                      else (plan_matmul(problem, t, self.memory_proportion_of(instr)), Rearrangement()))
        for v, fresh in zip(ops[:2], unmapped, strict=True):
            if fresh:
                v.mapping = self.alloc.spread(v.elements, plan.tiles)
        out = self.new_buf(ctx, instr, instr.shape, k, self.alloc.spread(max(1, shape_elems(instr.shape)), plan.tiles))
        m = out.mapping
        send = 0.0
        for v in ops[:2]:
            src = v if isinstance(v, Buf) else (v.src if isinstance(v, Bcast) else None)
            if src is not None:
                send = max(send, self.mapping_of(src).max_elements * src.itemsize)
        # The busiest sender bounds the exchange too (an operand held on few tiles).
        exchange = max(plan.exchange_cycles, send / t.exchange_bytes_per_cycle_per_tile
                       + plan.passes * t.exchange_overhead_cycles) + copy.exchange_cycles
        flops = problem.flops
        unit = "AMP" if plan.amp else "vector"
        s1 = self.step(ctx, instr, "matmul", m, plan.compute_cycles / plan.passes,
                       exchange / plan.passes, flops / plan.passes, k, repeat=plan.passes,
                       recv=(plan.recv_bytes_per_tile + copy.recv_bytes_per_tile) / plan.passes,
                       src_bytes_per_tile=max(1.0, send), codelet=f"{instr.opcode}-{unit}")
        steps = [s1]
        if plan.pk > 1:
            s2 = self.step(ctx, instr, "reduce", m, plan.reduce_compute_cycles,
                           plan.reduce_exchange_cycles - t.sync_cycles, 0.0, k,
                           recv=plan.reduce_recv_bytes_per_tile,
                           src_bytes_per_tile=plan.reduce_recv_bytes_per_tile / max(1, plan.pk - 1),
                           codelet="reduce-partials")
            steps.append(s2)
        temp = plan.temp_bytes_per_tile + copy.bytes_per_tile
        ctx.points[k].temps.append((m, temp))
        self.record(instr, m, steps, temp, "; ".join(filter(None, (plan.describe(), copy.describe()))))
        if not plan.fits_budget:
            self.notes.append(self._budget_note(instr, plan))
        return out

    def _budget_note(self, instr: ir_pb2.Instruction, plan: MatmulPlan) -> str:
        """What the plan of a product did when its temporaries did not fit the proportion
        (Poplar warns "unable to meet memory target" and plans again)."""
        sram = self.t.sram_bytes_per_tile
        what = f"'{instr.name}' ({layer_name(instr) or instr.opcode})"
        share = f"availableMemoryProportion {plan.memory_proportion:g}"
        if plan.memory_proportion == 0.0:
            return (f"{what}: {share}: planned for the least temporary memory "
                    f"({plan.temp_bytes_per_tile:,.0f} bytes per tile, {plan.passes} serial passes)")
        if plan.budget_bytes > 0:
            return (f"{what}: no split keeps its temporaries within {share} of a tile "
                    f"({plan.memory_proportion * sram:,.0f} bytes); planned as Poplar does with the "
                    f"bound doubled, within {plan.budget_bytes / sram:.2g} of a tile "
                    f"({plan.temp_bytes_per_tile:,.0f} bytes per tile)")
        return (f"{what}: no split keeps its temporaries within {share} of a tile, nor within "
                f"the whole tile; planned for the least temporary memory "
                f"({plan.temp_bytes_per_tile:,.0f} bytes per tile)")
