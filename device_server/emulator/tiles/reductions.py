"""Planning of reductions: ``reduce``, windows (pooling and its gradient), batch norm.

    reduce:  stage 0  every tile reduces what it holds -> FP32 partials
             stage 1  partials travel to the tiles owning the results (a second stage when
                      more than 32 tiles contribute to each result: fan-in sqrt(n) twice)
    reduce-window / select-and-scatter: the window's input exchanged in, vector work per
             element x window
    batch-norm-training / -grad: per-feature partial sums (2 per feature) reduced to their
             owners as above, moments sent back, then element-wise work on the operand's
             mapping; batch-norm-inference: element-wise only
"""

from __future__ import annotations

import math

import numpy as np

from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles.irinfo import (
    attr_int,
    attr_ints,
    is_floating,
    leaf_shapes,
    shape_elems,
    shape_itemsize,
)
from device_server.emulator.tiles.plan import Bcast, Buf, CompPlan, Value, value_leaves
from device_server.emulator.tiles.state import PlannerState
from device_server.protocol import ir_pb2

__all__ = ["ReductionPlanning"]

# A reduction whose results each gather partials from more tiles than this runs two stages.
_REDUCE_FANIN = 32
# Partial sums of floating-point reductions and products are FP32.
_ACC_BYTES = 4


class ReductionPlanning(PlannerState):
    """``reduce``, ``reduce-window``, ``select-and-scatter`` and ``batch-norm-*``."""

    # -- reductions ---------------------------------------------------------------------
    def _reduce(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        n_in = max(1, len(ops) // 2)
        src = ops[0]
        in_shape = self._operand_shape(instr, 0)
        dims = [int(d) for d in in_shape.dims]
        in_elems = max(1, shape_elems(in_shape))
        in_item = max(1, shape_itemsize(in_shape))
        out_leaf = leaf_shapes(instr.shape)[0]
        out_elems = max(1, shape_elems(out_leaf))
        reduced = set(attr_ints(instr, "dimensions"))
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
        acc = _ACC_BYTES if is_floating(in_shape) else in_item
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
        first = next((b for b in value_leaves(out) if isinstance(b, Buf)), None)
        self.record(instr, first.mapping if first else None, steps, temp,
                    f"{1 + stage} stage(s), {contributors:.0f} partial(s) per result")
        return out

    # -- windows ------------------------------------------------------------------------
    def _window(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        window = int(np.prod(attr_ints(instr, "window_size", (1,)), dtype=np.int64))
        out = self.out_value(ctx, instr, k)
        leaves = [b for b in value_leaves(out) if isinstance(b, Buf)]
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

    def _batch_norm(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        """Element-wise work on the operand's mapping; training and grad first reduce
        per-feature partial sums across tiles and send the moments back to every tile."""
        t = self.t
        self.use(ctx, ops, k)
        op = instr.opcode
        in_shape = self._operand_shape(instr, 0)
        elems = max(1, shape_elems(in_shape))
        item = max(1, shape_itemsize(in_shape))
        dims = [int(d) for d in in_shape.dims] or [1]
        fi = attr_int(instr, "feature_index", len(dims) - 1)
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
        leaves = leaf_shapes(instr.shape)
        parts = [Buf(instr, shape_itemsize(leaves[0]), elems, "activation", ctx, k, m)]
        for shape in leaves[1:]:
            parts.append(self.new_buf(ctx, instr, shape, k))
        ctx.bufs.append(parts[0])
        out: Value = tuple(parts) if instr.shape.is_tuple else parts[0]
        self.record(instr, m, steps, temp, f"{features} feature(s) over {m.tiles} tile(s)")
        return out
