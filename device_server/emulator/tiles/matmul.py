"""Planning matrix products and convolutions over tiles: a small search over splits.

Both are treated as a grouped matrix product (as Poplar's convolution planner does): ``G``
independent groups (dot batch dimensions; convolution feature or batch groups) of an
``M x K`` by ``K x N`` product, where for a convolution ``M`` is output batch x output
positions, ``N`` the output channels of a group and ``K`` the kernel's input channels of a
group times its window (only the channel part may be split over tiles).

A weight-update convolution (whose window covers most of its input, as XLA writes the
gradient of a convolution's kernel) is a plain matrix product over ``K = channels x window``,
as Poplar plans it. A plan splits ``G, M, N, K`` over ``pg * pm * pn * pk`` tiles. Each tile then

1. receives its share of the operands in the exchange (the input rows and weight columns it
   needs; a convolution's input share is widened by the window's halo);
2. runs the AMP on ``g x m x n x k``, rounded up to the AMP's channel groups
   (``amp_*_input_channels`` / ``amp_*_output_channels``), or the vector unit when that is
   faster (depthwise convolutions, integer products);
3. if ``pk > 1``, sends its partial sums to the tiles that own the output, which add them
   (one more superstep). Partials are FP32 (PopLibs' ``partialsType`` "float", the default),
   or FP16 for FP16 operands planned with ``partialsType`` "half" (half the partials' bytes
   on a tile and in the reduction's exchange).

Operands that are entry parameters not yet laid out (weights, mostly) are laid out for the plan,
as Poplar creates a matmul's weights: each tile already holds its part of the blocks it uses
and receives only the copies other tiles hold.

If a tile's operands and partials exceed ``available_memory_proportion`` of its memory, the
plan runs in ``sk`` serial passes over ``K`` (and ``sn`` over ``N``), each a superstep with its
own exchange, as Poplar's serial splits do. The search evaluates every combination of splits
from a geometric grid at once with numpy and keeps the fastest that fits.

An operand mapped linearly over the tiles (a variable under ``variable_mapping="linear"``,
as a Poplar program maps it with ``poputil::mapTensorLinearly``) is not in the plan's layout.
poplin's convolution (which ``poplin::matMul`` calls, graphcore/poplibs lib/poplin/MatMul.cpp
``matMulImpl``) then rearranges it when the plan broadcasts it to more than 7 tiles
(lib/poplin/Convolution.cpp: ``inViewMaxBroadcastDests`` / ``weightViewMaxBroadcastDests``,
``rearrangeActs`` / ``rearrangeWeights``): it creates a new tensor in the plan's layout
(``createInputImpl`` / ``createWeightsImpl``, "actsRearranged" / "weightsRearranged") and copies
the operand into it before the product. A matrix product's input is broadcast to the tiles
of its N split (``outChanSplit``), its weights to those of its M split (``batchSplit``). It
rearranges an operand too when the plan groups its channels (the AMP's input channels) and
the operand's detected grouping is 1 (its channels, the contraction, are not its innermost,
contiguous dimension: the usual ``[K, N]`` rhs of a dot, an ``HWIO`` kernel).
:func:`plan_rearranged` plans such a product: the plan is made for the operands in its own
layout (``a_local`` / ``b_local``, as poplin's planner assumes); an operand it rearranges
(:class:`Rearrangement`: the copy, ``bytes / tiles`` on each of the plan's tiles, live while
the product runs, and the exchange that fills it) stays local; any other is read straight
from its linear layout (planned with the operand not local, as any operand laid out
elsewhere).

The proportion is PopLibs' ``availableMemoryProportion`` (``plan_matmul``'s
``memory_proportion``; the preset's 0.6 when not given): a lower one leaves fewer candidates,
so the plan holds fewer temporaries per tile and costs as many cycles or more. When no split
fits it, Poplar warns and plans again with the bound doubled; so does the search here, up to
the whole tile, and then keeps the split with the least temporary memory (``fits_budget`` is
False). A proportion of 0 asks for the least temporary memory at once, as in PopLibs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from device_server.emulator.arch import Target
from device_server.emulator.tiles.irinfo import attr_int, attr_ints
from device_server.emulator.tiles.mapping import TileMapping
from device_server.protocol import ir_pb2

__all__ = ["MAX_BROADCAST_DESTS", "LinearOperand", "MatmulPlan", "MatmulProblem", "Rearrangement",
           "linear_operand", "plan_matmul", "plan_rearranged"]

# poplin copies an operand not in the plan's layout into a new tensor in it when the plan
# broadcasts it to more tiles than this (lib/poplin/Convolution.cpp, inViewMaxBroadcastDests
# and weightViewMaxBroadcastDests, both 7).
MAX_BROADCAST_DESTS = 7

# The fewest output channels an AMP vertex computes per group: PopLibs' AMP candidates use
# 8 or 16 conv units with partialChansPerGroup 8 or 16 (graphcore/poplibs@7eac0f26
# lib/poplin/ConvVertexType.cpp getConvVertexAMPCandidates).
_AMP_MIN_PARTIAL_CHANS = 8

_SERIAL_N = np.array([1, 2, 4, 8, 16, 32, 64], dtype=np.float64)


@dataclass(frozen=True)
class MatmulProblem:
    """One grouped matrix product (see module docstring)."""

    groups: int
    m: int
    n: int
    k: int                # contraction that may be split over tiles (input channels)
    window: int           # contraction kept on one tile (kernel window elements; 1 for dot)
    a_bytes: int          # all of the input / lhs operand
    b_bytes: int          # all of the weights / rhs operand
    halo: float           # extra share of an image's input a tile needs (conv window overlap)
    itemsize: int         # operand element size (2: the FP16 AMP)
    out_itemsize: int
    floating: bool        # float operands (the AMP does not take integers)
    images: int = 1       # M = images x positions: a tile with fewer rows than an image's
                          # positions needs part of one image (plus the halo)
    a_local: bool = False  # the input is laid out for this plan (a parameter mapped by it)
    b_local: bool = False  # the weights are laid out for this plan
    partials_bytes: int = 4  # bytes of a partial sum: 4 (FP32, PopLibs' default partialsType
                             # "float"; 32-bit integer accumulators), 2 (FP16 operands with
                             # partialsType "half")

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k * self.window


@dataclass(frozen=True)
class MatmulPlan:
    """The chosen split and what it costs (cycles of the slowest tile, per phase)."""

    pg: int
    pm: int
    pn: int
    pk: int
    sk: int
    sn: int
    tiles: int
    compute_cycles: float      # all passes
    exchange_cycles: float     # all passes
    sync_cycles: float
    reduce_compute_cycles: float
    reduce_exchange_cycles: float
    recv_bytes_per_tile: float  # operands received by the busiest tile over all passes
    reduce_recv_bytes_per_tile: float  # partials received by the busiest tile (all N passes)
    temp_bytes_per_tile: float  # operand buffers + partials live at once on a tile
    amp: bool
    fits_budget: bool          # planned within memory_proportion of a tile
    memory_proportion: float = 0.6   # the availableMemoryProportion planned for
    budget_bytes: float = 0.0        # temporaries per tile the chosen plan was held to (0: least)

    @property
    def passes(self) -> int:
        return self.sk * self.sn

    @property
    def cycles(self) -> float:
        return (self.compute_cycles + self.exchange_cycles + self.sync_cycles
                + self.reduce_compute_cycles + self.reduce_exchange_cycles)

    def describe(self) -> str:
        serial = f", serial {self.sk}x{self.sn}" if self.passes > 1 else ""
        unit = "AMP" if self.amp else "vector"
        return (f"split G{self.pg} M{self.pm} N{self.pn} K{self.pk} on {self.tiles} tiles"
                f"{serial} ({unit})")


def _grid(dim: int, cap: int, ratio: float = 1.25) -> np.ndarray:
    """Split counts to try for a dimension of size ``dim`` on at most ``cap`` tiles."""
    top = max(1, min(dim, cap))
    vals = {1, top}
    x = 1.0
    while x < top:
        vals.add(int(round(x)))
        x *= ratio
    p = 1
    while p < top:
        vals.add(p)
        p *= 2
    # Splits that cut dim into equal pieces near the top end.
    for q in (2, 3, 4, 6, 8):
        if dim // q >= 1 and dim // q <= top:
            vals.add(-(-dim // q))
    return np.array(sorted(v for v in vals if 1 <= v <= top), dtype=np.float64)


def _ceil(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    return np.ceil(np.asarray(a, dtype=np.float64) / b)


@functools.lru_cache(maxsize=4096)
def plan_matmul(problem: MatmulProblem, target: Target,
                memory_proportion: float | None = None) -> MatmulPlan:
    """The fastest split of ``problem`` over ``target``'s tiles whose temporaries fit
    ``memory_proportion`` of a tile (None: the preset's ``available_memory_proportion``);
    else, as Poplar replans, within twice, four times ... that share, up to a whole tile;
    else the split with the least temporary memory (``fits_budget`` False)."""
    t = target
    proportion = t.available_memory_proportion if memory_proportion is None else float(memory_proportion)
    if not 0.0 <= proportion <= 1.0:
        raise ValueError(f"memory_proportion must be in [0, 1] (availableMemoryProportion). "
                         f"Received: {memory_proportion!r}")
    T = t.tiles_per_ipu
    G, M, N, K, W = problem.groups, problem.m, problem.n, problem.k, problem.window
    pg, pm, pn, pk = np.meshgrid(_grid(G, T, 2.0), _grid(M, T), _grid(N, T), _grid(K, T),
                                 indexing="ij", copy=False)
    tiles = pg * pm * pn * pk
    ok = tiles <= T
    pg, pm, pn, pk, tiles = (a[ok][:, None] for a in (pg, pm, pn, pk, tiles))
    sn = _SERIAL_N[None, :]
    g, m, n, k = _ceil(G, pg), _ceil(M, pm), _ceil(N, pn), _ceil(K, pk)
    half = problem.itemsize <= 2
    kg = t.amp_fp16_input_channels if half else t.amp_fp32_input_channels
    ng = t.amp_fp16_output_channels if half else t.amp_fp32_output_channels
    # The AMP's peak times the share of it an inner loop sustains (fitted to measured ceilings).
    amp_rate = (t.amp_fp16_flops_per_cycle_per_tile * t.amp_fp16_efficiency if half
                else t.amp_fp32_flops_per_cycle_per_tile * t.amp_fp32_efficiency)
    vec_rate = t.vector_fp16_flops_per_cycle_per_tile if half else t.vector_fp32_flops_per_cycle_per_tile
    vec_work = 2.0 * g * m * n * k * W / vec_rate
    if problem.floating:
        amp_work = 2.0 * g * m * (_ceil(n, ng) * ng) * (_ceil(k, kg) * kg) * W / amp_rate
        use_amp = amp_work <= vec_work
        work = np.where(use_amp, amp_work, vec_work)
    else:
        use_amp = np.zeros_like(vec_work, dtype=bool)
        work = vec_work
    workers = t.worker_threads_per_tile
    occupancy = np.minimum(workers, g * m) / workers
    work = work / occupancy

    a_per_group = problem.a_bytes / max(1, G)
    b_per_group = problem.b_bytes / max(1, G)
    images = max(1, min(problem.images, M))
    positions = M / images
    share_a = np.where(m >= positions, m / M, np.minimum(1.0, m / positions + problem.halo) / images)
    recv_a = g * a_per_group * share_a * (k / K)
    recv_b = g * b_per_group * (n / N) * (k / K)
    # An operand laid out for this plan (as Poplar creates weights for their matmul) already
    # holds on each tile its share of the blocks that tile uses: only the copies travel.
    if problem.b_local:
        recv_b = recv_b * (pm - 1) / pm
    if problem.a_local:
        recv_a = recv_a * (pn - 1) / pn
    acc = float(problem.partials_bytes)
    # poplin zero-pads a group's output channels to the plan's partialChansPerGroup
    # (Convolution.cpp convolutionPreprocess), 8 or 16 for every AMP candidate on Mk2
    # (ConvVertexType.cpp): the AMP's partials hold at least n rounded up to 8.
    amp_n = _ceil(n, min(_AMP_MIN_PARTIAL_CHANS, ng)) * min(_AMP_MIN_PARTIAL_CHANS, ng)
    partials = g * m * np.where(use_amp, amp_n, n) * acc
    reduce = pk > 1

    red_recv = np.where(reduce, (pk - 1) / pk * partials, 0.0)
    # What the plan also lays out on each of its tiles (not temporaries, but the same tile):
    # the result, and the operands laid out for it. Below the preset's proportion, a plan is
    # preferred only if they fit beside its temporaries: else a small proportion would pile
    # the product onto a few tiles, whose local operands need no temporaries. (At the preset's
    # proportion and above, the search is the calibrated one, unchanged.)
    held = (G * M * N * problem.out_itemsize + (problem.a_bytes if problem.a_local else 0)
            + (problem.b_bytes if problem.b_local else 0)) / tiles
    sram = float(t.sram_bytes_per_tile)
    check_held = proportion < t.available_memory_proportion

    def solve(budget: float, roomy: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sk, memory per tile, feasible) for every candidate and serial N split; ``roomy``:
        only those whose layouts (``held``) fit the tile beside their temporaries."""
        ops = recv_a + recv_b / sn
        # The reduction of one N pass holds its partials and what it receives.
        red_mem = np.where(reduce, (partials + red_recv) / sn, 0.0)
        # One pass, no FP32 partial buffer unless the K split needs one.
        mem1 = ops + np.where(reduce, partials / sn, 0.0)
        room = budget - partials / sn
        sk = np.where(mem1 <= budget, 1.0,
                      np.where(room > 0, np.ceil(ops / np.maximum(room, 1e-9)), np.inf))
        sk = np.maximum(sk, 1.0)
        mem = np.maximum(np.where(sk > 1, ops / sk + partials / sn, mem1), red_mem)
        feasible = (sk <= k * W) & np.isfinite(sk) & (mem <= budget)
        if roomy:
            feasible &= mem + held <= sram
        return sk, mem, feasible

    # Poplar's bounds: the proportion's share of the tile, then doubled while nothing fits
    # (here up to the whole tile: a plan beyond it cannot run); 0: the least memory at once.
    budgets: list[float] = []
    budget = proportion * sram
    while 0.0 < budget < sram:
        budgets.append(budget)
        budget *= 2.0
    if proportion > 0.0:
        budgets.append(sram)
    budget = 0.0
    for roomy in ((True, False) if check_held else (False,)):
        for budget in budgets:
            sk, mem, feasible = solve(budget, roomy)
            if feasible.any():
                break
        if not budgets or feasible.any():
            break
    fits_budget = bool(budgets) and budget == budgets[0]
    least = not budgets
    if least:  # proportion 0: every candidate at its most serial passes over K
        ops = recv_a + recv_b / sn
        sk = np.broadcast_to(np.maximum(1.0, k * W), ops.shape)
        mem = np.maximum(np.where(sk > 1, ops / sk + partials / sn, ops + np.where(reduce, partials / sn, 0.0)),
                         np.where(reduce, (partials + red_recv) / sn, 0.0))
        feasible = np.zeros(ops.shape, dtype=bool)
    passes = sk * sn
    exchange_bytes = recv_a * sn + recv_b
    exch = exchange_bytes / t.exchange_bytes_per_cycle_per_tile + passes * t.exchange_overhead_cycles
    sync = passes * t.sync_cycles
    compute = work + passes * (t.vertex_overhead_cycles + t.matmul_pass_overhead_cycles)
    red_pieces = np.minimum(workers, np.maximum(1.0, g * m * n / pk / 2))
    red_compute = np.where(
        reduce, (pk - 1) / pk * g * m * n / (t.vector_fp32_flops_per_cycle_per_tile * red_pieces / workers)
        + t.vertex_overhead_cycles, 0.0)
    red_exch = np.where(reduce, t.exchange_overhead_cycles + red_recv / t.exchange_bytes_per_cycle_per_tile
                        + t.sync_cycles, 0.0)
    total = compute + exch + sync + red_compute + red_exch
    total_b = np.broadcast_to(total, sk.shape)
    if feasible.any():
        flat = int(np.argmin(np.where(feasible, total_b, np.inf)))
    elif least:  # the least temporary memory (of the plans whose layouts fit); the fewest cycles
        over = np.broadcast_to(mem + held > sram, sk.shape).ravel()
        flat = int(np.lexsort((total_b.ravel(), np.broadcast_to(mem, sk.shape).ravel(), over))[0])
    else:  # nothing fits even a whole tile: the least memory (the memory model reports it)
        fits_budget, budget = False, 0.0
        score = np.where(np.isfinite(sk), mem, np.inf)
        if not np.isfinite(score).any():
            score = np.broadcast_to(recv_a + recv_b / sn + partials / sn, sk.shape)
            sk = np.full_like(sk, k * W)
        flat = int(np.argmin(score))
    i, j = np.unravel_index(flat, sk.shape)

    def at(a: np.ndarray) -> float:
        a = np.broadcast_to(a, sk.shape)
        return float(a[i, j])

    temp = at(mem)
    return MatmulPlan(
        pg=int(at(pg)), pm=int(at(pm)), pn=int(at(pn)), pk=int(at(pk)),
        sk=int(min(at(sk), 1e9)), sn=int(at(sn)), tiles=int(at(tiles)),
        compute_cycles=at(compute), exchange_cycles=at(exch), sync_cycles=at(sync),
        reduce_compute_cycles=at(red_compute), reduce_exchange_cycles=at(red_exch),
        recv_bytes_per_tile=at(exchange_bytes), reduce_recv_bytes_per_tile=at(red_recv),
        temp_bytes_per_tile=temp, amp=bool(at(use_amp)) if problem.floating else False,
        fits_budget=fits_budget and math.isfinite(at(sk)),
        memory_proportion=proportion, budget_bytes=budget,
    )


@dataclass(frozen=True)
class LinearOperand:
    """An operand of a product mapped linearly (``mapping.poputil_linear``): its mapping, the
    bytes of an element and the grouping of its channels (contraction) that poplin detects
    (``linear_operand``)."""

    mapping: TileMapping
    itemsize: int
    grouping: int

    @property
    def fullest_tile_bytes(self) -> float:
        return float(self.mapping.max_elements * self.itemsize)


def linear_operand(mapping: TileMapping | None, itemsize: int, instr: ir_pb2.Instruction, n: int,
                   dims: Sequence[int]) -> LinearOperand | None:
    """Operand ``n`` (0: input / lhs, 1: weights / rhs) of the dot or convolution ``instr``,
    of shape ``dims``, if ``mapping`` is a linear one (else None), with the channel grouping
    poputil's ``detectInnermostGrouping`` (lib/poputil/VarStructure.cpp) finds in it: the
    channels (contraction) the product reads run contiguously only if they are the
    operand's innermost dimensions (row-major); then the grouping is the gcd of their
    number and the largest piece of the first run of them that one tile holds, else 1."""
    if mapping is None or not mapping.linear:
        return None
    rank = len(dims)
    if instr.opcode == "dot":
        names = ("lhs_contracting_dimensions", "rhs_contracting_dimensions")
        channels = sorted(attr_ints(instr, names[n]))
    else:
        names = ("input_feature_dimension", "kernel_input_feature_dimension")
        channels = [attr_int(instr, names[n], 0)]
    if not channels or channels != list(range(rank - len(channels), rank)):
        return LinearOperand(mapping, itemsize, 1)
    run = int(np.prod([dims[d] for d in channels], dtype=np.int64))
    counts = mapping.counts if mapping.counts is not None else np.full(
        mapping.tiles, mapping.elements // mapping.tiles, np.int64)
    ends = np.cumsum(counts)
    pieces = np.minimum(ends, run) - np.minimum(ends - counts, run)
    return LinearOperand(mapping, itemsize, math.gcd(int(pieces.max()), max(1, run)))


@dataclass(frozen=True)
class Rearrangement:
    """The operands poplin copies into the plan's layout before a product (see module
    docstring): which (``a``: the input / lhs, ``b``: the weights / rhs), the copies' bytes on
    each of the plan's tiles (live while the product runs) and the exchange that fills them
    (cycles, bytes each tile receives)."""

    a: bool = False
    b: bool = False
    bytes_per_tile: float = 0.0
    exchange_cycles: float = 0.0
    recv_bytes_per_tile: float = 0.0

    def describe(self) -> str:
        which = " and ".join(n for n, on in (("input", self.a), ("weights", self.b)) if on)
        return f"{which} rearranged into the plan's layout ({self.bytes_per_tile:,.0f} B a tile)" \
            if which else ""


def plan_rearranged(problem: MatmulProblem, target: Target, memory_proportion: float | None,
                    linear: Sequence[LinearOperand | None]) -> tuple[MatmulPlan, Rearrangement]:
    """``plan_matmul`` for a product whose operands (input, weights) may be mapped linearly
    (``linear``: their ``linear_operand``, or None). Without one, ``plan_matmul(problem)`` and
    no rearrangement. Else (module docstring): the plan for the linear operands in its own
    layout; poplin copies one into it (Convolution.cpp, ``rearrangeActs`` /
    ``rearrangeWeights``) when the plan broadcasts it to more than ``MAX_BROADCAST_DESTS``
    tiles (the input to its N split, the weights to its M split) or when the plan groups
    channels (the AMP) and the operand's detected grouping is 1. A copy is the
    :class:`Rearrangement` (its exchange one superstep: each of the plan's tiles receives its
    share of the copies, the fullest linear tile sends its share); an operand not copied is
    read from its linear layout (the plan made again with it not local)."""
    a_lin, b_lin = (op is not None for op in linear[:2])
    if not (a_lin or b_lin):
        return plan_matmul(problem, target, memory_proportion), Rearrangement()
    local = dataclasses.replace(problem, a_local=problem.a_local or a_lin,
                                b_local=problem.b_local or b_lin)
    plan = plan_matmul(local, target, memory_proportion)

    def copied(op: LinearOperand | None, dests: int) -> bool:
        return op is not None and (dests > MAX_BROADCAST_DESTS or (plan.amp and op.grouping == 1))

    a, b = copied(linear[0], plan.pn), copied(linear[1], plan.pm)
    if (a, b) != (a_lin, b_lin):  # an operand read from its linear layout: not local
        kept = dataclasses.replace(problem, a_local=problem.a_local or a, b_local=problem.b_local or b)
        plan = plan_matmul(kept, target, memory_proportion)
    if not (a or b):
        return plan, Rearrangement()
    per_tile = ((problem.a_bytes if a else 0) + (problem.b_bytes if b else 0)) / plan.tiles
    send = sum(op.fullest_tile_bytes for op, on in zip(linear[:2], (a, b), strict=True)
               if on and op is not None)
    cycles = (max(per_tile, send) / target.exchange_bytes_per_cycle_per_tile
              + target.exchange_overhead_cycles + target.sync_cycles)
    return plan, Rearrangement(a, b, per_tile, cycles, per_tile)
