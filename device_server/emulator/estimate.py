"""A first, analytical cost and memory estimate of a module on an IPU target.

Model (deliberately simple; a later tile mapping replaces it):

* every instruction is one BSP superstep spread evenly over all tiles in use;
* compute cycles = FLOPs / (rate x tiles), where the rate is the AMP (matrix) rate for ``dot``
  and ``convolution`` (FP16 rate for 16-bit inputs, FP32 otherwise) and the vector rate for
  everything else; transcendental functions count several FLOPs per element;
* memory cycles = bytes read + written / (tile memory bandwidth x tiles); a step takes the
  larger of compute and memory cycles (roofline), plus one vertex overhead, one global sync;
* ops that rearrange data between tiles (dot, convolution, reductions, transposes, gathers,
  ...) also pay one exchange: fixed overhead + operand bytes / (exchange bandwidth x tiles);
* views (reshape, broadcast, transpose, slice, tuple plumbing) and constants cost no cycles;
* ``while``: cycles of one iteration (condition + body) times the trip count when it is a
  constant-bounded counting loop, otherwise **one** iteration (the estimate then says
  ``per_iteration_loops`` > 0 and lists the assumption); ``conditional``: the costliest
  branch; ``call``: the callee;
* memory: parameters and constants are always live; temporaries are live from their
  definition to their last use (views extend their source's life); the total is always-live
  bytes plus the largest sum of temporaries live at one program point (including the peak
  inside called computations), spread evenly over the tiles. ``fits`` compares that per-tile
  figure with the tile's SRAM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from device_server.emulator.arch import Target
from device_server.emulator.errors import describe
from device_server.protocol import dtypes, ir_pb2

__all__ = ["Estimate", "estimate_module", "while_trip_count"]

_FREE = frozenset(
    {
        "parameter", "constant", "tuple", "get-tuple-element", "reshape", "bitcast",
        "broadcast", "transpose", "slice", "reverse", "opt-barrier", "after-all",
        "add-dependency", "get-dimension-size", "copy",
    }
)
# Views: no new buffer, the result refers to its operands' buffers.
_VIEWS = frozenset(
    {
        "tuple", "get-tuple-element", "reshape", "bitcast", "broadcast", "transpose", "slice",
        "reverse", "opt-barrier", "add-dependency",
    }
)
_TRANSCENDENTAL = frozenset(
    {
        "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "sqrt",
        "rsqrt", "cbrt", "tanh", "sine", "cosine", "tan", "atan2", "power", "erf", "divide",
        "remainder",
    }
)
FLOPS_PER_TRANSCENDENTAL = 8.0  # assumption: a few vector instructions per element
_EXCHANGING = frozenset(
    {
        "dot", "convolution", "reduce", "reduce-window", "select-and-scatter", "transpose",
        "concatenate", "pad", "gather", "scatter", "dynamic-slice", "dynamic-update-slice",
        "sort", "map",
    }
)

ASSUMPTIONS = (
    "each instruction is one superstep spread evenly over all tiles",
    "dot/convolution at the AMP peak rate; other arithmetic at the vector rate",
    "roofline: max(compute, tile memory traffic) per superstep",
    "data-rearranging ops pay one exchange of their operands",
    "memory: always-live parameters/constants + peak live temporaries, spread evenly",
)


@dataclass
class Estimate:
    """Cycles, time and memory of one run of a module on a target (see module docstring)."""

    ipu_version: str
    tiles_per_ipu: int
    clock_hz: float
    cycles: int
    seconds: float
    peak_tile_bytes: int
    tile_bytes_limit: int
    total_bytes: int
    fits: bool
    target: str = ""
    always_live_bytes: int = 0
    peak_temporary_bytes: int = 0
    flops: float = 0.0
    supersteps: int = 0
    per_iteration_loops: int = 0
    assumptions: tuple[str, ...] = ASSUMPTIONS
    largest_arrays: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        """Plain-data form (JSON-able)."""
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        return d

    def oom_message(self) -> str:
        """Poplar-style out-of-memory message."""
        big = "; ".join(self.largest_arrays[:5]) or "none"
        return (
            f"Out of memory on tile 0: {self.peak_tile_bytes} bytes used but tiles only have "
            f"{self.tile_bytes_limit} bytes ({self.target}, {self.tiles_per_ipu} tiles; "
            f"{self.total_bytes} bytes in total = {self.always_live_bytes} always live + "
            f"{self.peak_temporary_bytes} peak temporaries, spread evenly over the tiles). "
            f"Largest arrays: {big}. Set allow_out_of_memory to compile anyway."
        )


def _elems(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple:
        return sum(_elems(s) for s in shape.tuple_shapes)
    return int(np.prod(shape.dims, dtype=np.int64)) if shape.dims else 1


def _bytes(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple:
        return sum(_bytes(s) for s in shape.tuple_shapes)
    if shape.dtype == ir_pb2.TOKEN:
        return 0
    return _elems(shape) * dtypes.to_numpy(shape.dtype).itemsize


def _itemsize(shape: ir_pb2.Shape) -> int:
    if shape.is_tuple or shape.dtype == ir_pb2.TOKEN:
        return 4
    return dtypes.to_numpy(shape.dtype).itemsize


LiveFn = Callable[[ir_pb2.Computation], list[ir_pb2.Instruction]]


class _Walker:
    def __init__(self, module: ir_pb2.Module, live: LiveFn, target: Target) -> None:
        self.module = module
        self.live = live
        self.t = target
        self.comps = {c.id: c for c in module.computations}
        self.cost_cache: dict[int, tuple[float, float, int]] = {}
        self.temp_cache: dict[int, int] = {}
        self.per_iteration_loops = 0
        self.always_live = 0
        self.largest: list[tuple[int, str]] = []

    # ---- cycles
    def instr_cycles(self, instr: ir_pb2.Instruction, shapes: dict[int, ir_pb2.Shape],
                     by_id: dict[int, ir_pb2.Instruction]) -> tuple[float, float, int]:
        """(cycles, flops, supersteps) of one instruction."""
        t = self.t
        op = instr.opcode
        if op == "while":
            cond, body = (self.comp_cost(c) for c in instr.called_computations[:2])
            trips = while_trip_count(self.module, instr, by_id)
            if trips is None:
                self.per_iteration_loops += 1
                trips = 1
            return ((cond[0] + body[0]) * trips, (cond[1] + body[1]) * trips,
                    (cond[2] + body[2]) * trips)
        if op == "call":
            return self.comp_cost(instr.called_computations[0])
        if op == "conditional":
            costs = [self.comp_cost(c) for c in instr.called_computations]
            return max(costs) if costs else (0.0, 0.0, 0)
        if op in _FREE:
            return 0.0, 0.0, 0
        out_elems = _elems(instr.shape)
        in_bytes = sum(_bytes(shapes[o]) for o in instr.operands if o in shapes)
        touched = in_bytes + _bytes(instr.shape)
        tiles = t.tiles_per_ipu
        sixteen = any(_itemsize(shapes[o]) <= 2 for o in instr.operands if o in shapes)
        if op in ("dot", "convolution"):
            flops = 2.0 * out_elems * self._contraction(instr, shapes)
            rate = t.amp_fp16_flops_per_cycle_per_tile if sixteen else t.amp_fp32_flops_per_cycle_per_tile
        else:
            per = FLOPS_PER_TRANSCENDENTAL if op in _TRANSCENDENTAL else 1.0
            elems = max(out_elems, sum(_elems(shapes[o]) for o in instr.operands if o in shapes))
            if op == "sort":
                per *= max(1.0, math.log2(max(out_elems, 2)))
            flops = per * elems
            rate = t.vector_fp16_flops_per_cycle_per_tile if sixteen else t.vector_fp32_flops_per_cycle_per_tile
        compute = flops / (rate * tiles)
        memory = touched / (t.memory_bytes_per_cycle_per_tile * tiles)
        cycles = max(compute, memory) + t.vertex_overhead_cycles + t.sync_cycles
        if op in _EXCHANGING:
            cycles += t.exchange_overhead_cycles + in_bytes / (t.exchange_bytes_per_cycle_per_tile * tiles)
        return cycles, flops, 1

    @staticmethod
    def _contraction(instr: ir_pb2.Instruction, shapes: dict[int, ir_pb2.Shape]) -> float:
        """Multiply-adds per output element of a dot or convolution."""
        if len(instr.operands) < 2 or instr.operands[1] not in shapes:
            return 1.0
        rhs = shapes[instr.operands[1]]
        if instr.opcode == "dot":
            dims = instr.attrs["rhs_contracting_dimensions"].ints.values if "rhs_contracting_dimensions" in instr.attrs else []
            return float(np.prod([rhs.dims[d] for d in dims], dtype=np.float64)) if dims else 1.0
        a = instr.attrs
        kof = a["kernel_output_feature_dimension"].i if "kernel_output_feature_dimension" in a else len(rhs.dims) - 1
        per = _elems(rhs) / max(1, rhs.dims[kof] if rhs.dims else 1)
        # With batch_group_count (weight gradients), the "kernel" is the output gradient and
        # each output element still sums rhs_elems / output_features products.
        return float(per)

    def comp_cost(self, comp_id: int) -> tuple[float, float, int]:
        if comp_id in self.cost_cache:
            return self.cost_cache[comp_id]
        comp = self.comps[comp_id]
        live = self.live(comp)
        shapes = {i.id: i.shape for i in live}
        by_id = {i.id: i for i in live}
        total = (0.0, 0.0, 0)
        for instr in live:
            c = self.instr_cycles(instr, shapes, by_id)
            total = (total[0] + c[0], total[1] + c[1], total[2] + c[2])
        self.cost_cache[comp_id] = total
        return total

    # ---- memory
    def peak_temporaries(self, comp_id: int, entry: bool) -> int:
        """Largest sum of live temporaries in one computation (always-live counted apart)."""
        if comp_id in self.temp_cache:
            return self.temp_cache[comp_id]
        comp = self.comps[comp_id]
        live = self.live(comp)
        pos = {i.id: k for k, i in enumerate(live)}
        buffers: dict[int, list[int]] = {}   # instruction id -> buffer ids it refers to
        size: dict[int, int] = {}            # buffer id -> bytes
        born: dict[int, int] = {}
        last: dict[int, int] = {}
        by_id = {i.id: i for i in live}
        for k, instr in enumerate(live):
            op = instr.opcode
            if op in ("parameter", "constant"):
                b = _bytes(instr.shape)
                if entry or op == "constant":
                    self.always_live += b
                    self._note(b, instr)
                buffers[instr.id] = []  # always live (or owned by the caller)
                continue
            if op in _VIEWS:
                if op == "get-tuple-element" and by_id[instr.operands[0]].opcode == "tuple":
                    idx = instr.attrs["index"].i if "index" in instr.attrs else 0
                    src = by_id[instr.operands[0]].operands[idx]
                    buffers[instr.id] = list(buffers.get(src, []))
                else:
                    buffers[instr.id] = [b for o in instr.operands for b in buffers.get(o, [])]
            else:
                buffers[instr.id] = [instr.id]
                size[instr.id] = _bytes(instr.shape)
                born[instr.id] = k
                last[instr.id] = k
                if entry:
                    self._note(size[instr.id], instr)
            for o in instr.operands:
                for b in buffers.get(o, []):
                    last[b] = max(last.get(b, k), k)
        end = len(live)
        for b in buffers.get(comp.root_id, []):
            last[b] = end
        delta = [0] * (end + 2)
        for b, s in size.items():
            delta[born[b]] += s
            delta[last[b] + 1] -= s
        peak = running = 0
        for k in range(end + 1):
            running += delta[k]
            extra = 0
            if k < end and live[k].called_computations:
                extra = max(self.peak_temporaries(c, False) for c in live[k].called_computations)
            peak = max(peak, running + extra)
        _ = pos
        self.temp_cache[comp_id] = peak
        return peak

    def _note(self, nbytes: int, instr: ir_pb2.Instruction) -> None:
        self.largest.append((nbytes, f"{nbytes} B for {describe(instr)}"))


def while_trip_count(module: ir_pb2.Module, instr: ir_pb2.Instruction,
                     by_id: dict[int, ir_pb2.Instruction]) -> int | None:
    """Trip count of a counting ``while`` (``i = c0; while i < bound: i += step``) whose
    start, bound and step are constants, else ``None``."""
    comps = {c.id: c for c in module.computations}
    if len(instr.called_computations) < 2 or not instr.operands:
        return None
    cond, body = comps.get(instr.called_computations[0]), comps.get(instr.called_computations[1])
    init = by_id.get(instr.operands[0])
    if cond is None or body is None or init is None or init.opcode != "tuple":
        return None

    def const_of(i: ir_pb2.Instruction | None) -> int | None:
        if i is None or i.opcode != "constant" or i.shape.dims or i.shape.is_tuple:
            return None
        lit = i.attrs["value"].literal
        dt = dtypes.to_numpy(lit.shape.dtype)
        if dt.kind not in "iu":
            return None
        return int(np.frombuffer(lit.data, dtype=dt)[0])

    def strip(c: ir_pb2.Computation, i: ir_pb2.Instruction) -> ir_pb2.Instruction:
        ids = {x.id: x for x in c.instructions}
        while i.opcode in ("reshape", "copy", "convert") and i.operands:
            i = ids[i.operands[0]]
        return i

    def gte_index(c: ir_pb2.Computation, i: ir_pb2.Instruction) -> int | None:
        ids = {x.id: x for x in c.instructions}
        i = strip(c, i)
        if i.opcode == "get-tuple-element" and ids[i.operands[0]].opcode == "parameter":
            return int(i.attrs["index"].i) if "index" in i.attrs else 0
        return None

    # Find the compare at the root of the condition (through a call wrapper and 1-tuples).
    c = cond
    ids = {x.id: x for x in c.instructions}
    root = strip(c, ids[c.root_id])
    for _ in range(4):
        if root.opcode == "get-tuple-element":
            src = ids[root.operands[0]]
            if src.opcode == "call":
                c = comps[src.called_computations[0]]
                ids = {x.id: x for x in c.instructions}
                root = strip(c, ids[c.root_id])
                continue
        if root.opcode == "tuple" and len(root.operands) == 1:
            root = strip(c, ids[root.operands[0]])
            continue
        break
    if root.opcode != "compare":
        return None
    direction = root.attrs["direction"].s if "direction" in root.attrs else ""
    a, b = (ids[o] for o in root.operands)
    ia, ib = gte_index(c, a), gte_index(c, b)
    init_elems = [by_id.get(o) for o in init.operands]

    def value(i: ir_pb2.Instruction, idx: int | None) -> int | None:
        if idx is not None:
            return const_of(init_elems[idx]) if idx < len(init_elems) else None
        return const_of(strip(c, i))

    if direction in ("GT", "GE"):
        a, b, ia, ib = b, a, ib, ia
        direction = "LT" if direction == "GT" else "LE"
    if direction not in ("LT", "LE") or ia is None:
        return None
    start, bound = value(a, ia), value(b, ib)
    if start is None or bound is None:
        return None
    # The body must add a constant step to element ia.
    bids = {x.id: x for x in body.instructions}
    broot = bids[body.root_id]
    if broot.opcode != "tuple" or ia >= len(broot.operands):
        return None
    upd = strip(body, bids[broot.operands[ia]])
    if upd.opcode != "add":
        return None
    x, y = (strip(body, bids[o]) for o in upd.operands)
    if gte_index(body, x) != ia:
        x, y = y, x
    step = const_of(y)
    if gte_index(body, x) != ia or not step or step <= 0:
        return None
    span = bound - start + (1 if direction == "LE" else 0)
    return max(0, -(-span // step))


def estimate_module(module: ir_pb2.Module, live: LiveFn, target: Target) -> Estimate:
    """Estimates one run of ``module`` on ``target`` (``live`` gives each computation's live
    instructions in program order)."""
    w = _Walker(module, live, target)
    cycles, flops, steps = w.comp_cost(module.entry_computation_id)
    temps = w.peak_temporaries(module.entry_computation_id, True)
    total = w.always_live + temps
    per_tile = -(-total // max(1, target.tiles_per_ipu))
    w.largest.sort(key=lambda x: -x[0])
    assumptions = ASSUMPTIONS
    if w.per_iteration_loops:
        assumptions = (*ASSUMPTIONS, f"{w.per_iteration_loops} while loop(s) without a constant "
                       "trip count are counted as one iteration")
    whole_cycles = int(math.ceil(cycles))
    return Estimate(
        ipu_version=target.ipu_version,
        tiles_per_ipu=target.tiles_per_ipu,
        clock_hz=target.clock_hz,
        cycles=whole_cycles,
        seconds=whole_cycles / target.clock_hz,
        peak_tile_bytes=int(per_tile),
        tile_bytes_limit=target.sram_bytes_per_tile,
        total_bytes=int(total),
        fits=per_tile <= target.sram_bytes_per_tile,
        target=f"{target.product} ({target.name})",
        always_live_bytes=int(w.always_live),
        peak_temporary_bytes=int(temps),
        flops=float(flops),
        supersteps=int(steps),
        per_iteration_loops=w.per_iteration_loops,
        assumptions=assumptions,
        largest_arrays=[s for _, s in w.largest[:10]],
    )
