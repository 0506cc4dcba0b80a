"""Planning of ``sort`` and of batches of independent problems (linear algebra, FFT, top-k).

    sort:   each row (the sorted dimension) on one tile, rows spread over tiles;
            n log2 n comparisons per row on one worker
    cholesky, triangular-solve, fft, topk, custom-call Qr / Householder product / Eigh:
            problems (matrices, transforms, rows) spread over tiles; a problem needing more
            than 1/8 of a tile, or faster split, runs on a group of tiles in stages (one per
            column or row, or log2(group) rounds): the group size with the fewest cycles wins
"""

from __future__ import annotations

import math

import numpy as np

from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles.irinfo import (
    attr_int,
    attr_ints,
    attr_str,
    leaf_shapes,
    shape_elems,
    shape_itemsize,
)
from device_server.emulator.tiles.mapping import TileMapping
from device_server.emulator.tiles.plan import Buf, CompPlan, Value
from device_server.emulator.tiles.state import PlannerState
from device_server.protocol import ir_pb2

__all__ = ["ProblemPlanning"]

# A problem is split over more tiles when its data would take more than this share of a tile.
_PROBLEM_TILE_SHARE = 0.125


class ProblemPlanning(PlannerState):
    """``sort`` and batches of independent problems."""

    # -- sort ---------------------------------------------------------------------------
    def _sort(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        shape = leaf_shapes(instr.shape)[0]
        dims = [int(d) for d in shape.dims] or [1]
        dim = attr_int(instr, "dimension", len(dims) - 1)
        row = dims[dim] if dim < len(dims) else 1
        elems = max(1, shape_elems(shape))
        rows = max(1, elems // max(1, row))
        tiles = min(self.T, rows)
        row_bytes = sum(row * shape_itemsize(s) for s in leaf_shapes(instr.shape))
        per_tile_rows = math.ceil(rows / tiles)
        rng = self.alloc.spread(rows, tiles)
        out_parts = []
        for s in (instr.shape.tuple_shapes if instr.shape.is_tuple else [instr.shape]):
            b = Buf(instr, shape_itemsize(s), max(1, shape_elems(s)), "activation", ctx, k,
                    TileMapping(rng.first, rng.tiles, max(1, shape_elems(s)), self.T))
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
        total = max(1, shape_elems(shape))
        if op in ("cholesky", "triangular-solve"):
            m = max(1, dims[-1])
            batch = max(1, total // (m * m))
            if op == "cholesky":
                flops = m ** 3 / 3.0 + m * self.t.flops_per_transcendental
                return batch, float(m * m), flops, m, f"{batch} {m} x {m} matrices"
            rhs = max(1, shape_elems(instr.shape) // (batch * m))
            return batch, float(m * m + m * rhs), float(m * m * rhs), m, \
                f"{batch} {m} x {m} solves with {rhs} right-hand sides"
        if op == "custom-call":
            return self._custom_problem(instr, dims, total)
        if op == "fft":
            lengths = attr_ints(instr, "fft_length", (dims[-1],))
            n = max(1, int(np.prod(lengths, dtype=np.int64)))
            real = attr_str(instr, "fft_type") in ("RFFT", "IRFFT")
            rows = max(1, total // max(1, int(np.prod(dims[-len(lengths):], dtype=np.int64))))
            flops = (2.5 if real else 5.0) * n * max(1.0, math.log2(n))
            return rows, float(n), flops, 0, f"{rows} transforms of {n}"
        n = max(1, dims[-1])  # topk: a selection of k in each row
        rows = max(1, total // n)
        return rows, float(n), n * math.log2(max(2, attr_int(instr, "k", 1))), 0, f"{rows} rows of {n}"

    def _custom_problem(self, instr: ir_pb2.Instruction, dims: list[int],
                        total: int) -> tuple[int, float, float, int, str]:
        """``_problem_figures`` of a linear-algebra custom-call on ``a [..., m, n]``. FLOPs
        (LAPACK Working Note 41): Householder QR ``2 m n^2 - 2/3 n^3`` (m >= n; ``4/3 n^3``
        square) plus a square root per column; forming Q from k reflectors
        ``4 m n k - 2 (m + n) k^2 + 4/3 k^3``; a symmetric eigendecomposition with vectors
        ``9 n^3``. One stage per column (QR, Q) or per row (Jacobi sweeps) when split."""
        target = attr_str(instr, "custom_call_target")
        m, n = (dims[-2], dims[-1]) if len(dims) >= 2 else (1, dims[-1])
        m, n = max(1, m), max(1, n)
        batch = max(1, total // (m * n))
        if target == "Qr":
            big, small = max(m, n), min(m, n)
            flops = 2.0 * big * small ** 2 - 2.0 * small ** 3 / 3 + small * self.t.flops_per_transcendental
            return batch, float(m * n), flops, small, f"{batch} {m} x {n} QR factorizations"
        if target == "Eigh":
            return batch, float(2 * n * n), 9.0 * n ** 3, n, f"{batch} {n} x {n} eigendecompositions"
        rk = min(n, max(1, shape_elems(self._operand_shape(instr, 1)) // batch))  # Householder product
        flops = 4.0 * m * n * rk - 2.0 * (m + n) * rk ** 2 + 4.0 * rk ** 3 / 3
        return batch, float(m * n), flops, rk, f"{batch} {m} x {n} products of {rk} reflectors"

    def _problems(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        self.use(ctx, ops, k)
        problems, per_elems, per_flops, panels, what = self._problem_figures(instr)
        item = max(1, shape_itemsize(self._operand_shape(instr, 0)))
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
        codelet = attr_str(instr, "custom_call_target") or instr.opcode  # one per target
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
        for shape in leaf_shapes(instr.shape):
            elems = max(1, shape_elems(shape))
            b = Buf(instr, shape_itemsize(shape), elems, "activation", ctx, k,
                    TileMapping(rng.first, rng.tiles, elems, self.T))
            ctx.bufs.append(b)
            parts.append(b)
        out: Value = tuple(parts) if instr.shape.is_tuple else parts[0]
        ctx.points[k].temps.append((rng, recv + stage_bytes))
        where = "one tile each" if split == 1 else f"{split} tiles each in {stages} stages"
        self.record(instr, rng, steps, recv + stage_bytes, f"{what} on {rng.tiles} tile(s), {where}")
        return out
