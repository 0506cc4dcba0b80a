"""Memory per tile: always-live bytes plus the peak of not-always-live bytes over the schedule.

* **Always live** (for the whole program, on the tiles their mapping or code covers):
  variables and streamed arguments (entry parameters), constants, code and vertex state
  (control code and one vertex per compute set on each tile it uses, code of each vertex
  type once per tile), exchange code (per exchange and per tile received from).
* **Not always live**: every other tensor from the program point that makes it to its last use
  (intermediates of fused element-wise chains are never stored; updated variables are written
  over their parameters), plus the temporaries of one instruction live only at its point
  (exchange receive buffers, partial sums). A called computation (loop body, branch, callee)
  adds its own peak at the point of the call.

The order of the points is a schedule (``liveness.Liveness`` per computation):

    profile_memory(plan)                the memory-aware schedule: every computation, callees
                                        first, ordered by schedule.schedule, the candidate
                                        orders compared by their exact per-tile sweep
                                        (max over tiles of always-live + peak, then the sum)
    profile_memory(plan, order="hlo")   HLO emission order (the planner's born / last)

and the scheduled profile is kept only if its fullest tile holds no more than HLO order's
(``MemoryProfile.order`` says which was kept; ``hlo_order_peak_bytes`` is HLO order's).

A pipelined program's IPU (``IpuView``, made by ``pipeline.py``) counts only what that IPU
holds: the parameters, constants, code and exchange code of its stages, the tensors its
stages make or read (a tensor another IPU's stage makes is received into a copy, live as
long as the original), and its stages' temporaries; the order is the whole program's.

The sweep walks the points once in their order with a per-tile running total (numpy vectors
over the tiles) and keeps, for every tile, its peak and the position where it happens, so
that the largest contributors on the fullest tile can be named.

``liveness_trace(plan, profile)`` walks the same order again for one tile (the fullest) in
scalars, counting as the sweep does, and keeps the bytes at every program point of the entry
computation (the HTML report's liveness view): its maximum is that tile's peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from device_server.emulator import cancel
from device_server.emulator.tiles.irinfo import layer_name, stage_of
from device_server.emulator.tiles.liveness import Liveness, graph_of, hlo_liveness, liveness
from device_server.emulator.tiles.mapping import TileMapping
from device_server.emulator.tiles.plan import Buf, CompPlan, ModulePlan, Point
from device_server.emulator.tiles.recompute import Recomputation
from device_server.emulator.tiles.schedule import grouped, schedule

__all__ = ["CATEGORIES", "Contributor", "IpuView", "LivenessTrace", "MemoryProfile", "Schedule",
           "liveness_trace", "memory_schedule", "profile_memory"]

CATEGORIES = ("variables", "inputs", "constants", "code and vertex state", "exchange code",
              "activations", "temporaries")


@dataclass
class Contributor:
    """Bytes one tensor (or kind of code) holds on one tile."""

    bytes: int
    name: str
    opcode: str
    layer: str
    kind: str        # a CATEGORIES entry
    where: str = ""  # the computation, for tensors inside called computations

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass
class _Sweep:
    total: np.ndarray     # per tile: peak not-always-live bytes
    act: np.ndarray       # ... of which tensors
    tmp: np.ndarray       # ... of which instruction temporaries
    at: np.ndarray        # per tile: the position of the peak
    chip_peak: float      # largest sum over tiles at one position


@dataclass
class IpuView:
    """What one IPU of a pipelined program holds (see module docstring): the ids of its
    buffers (entry parameters and constants included) and of its program points, and the
    stages it runs."""

    ipu: int
    stages: tuple[int, ...]
    bufs: set[int]
    points: set[int]


@dataclass
class Schedule:
    """The memory-aware order of every computation of a plan (``memory_schedule``)."""

    chosen: dict[int, Liveness]          # id(CompPlan) -> its order
    wins: dict[str, int]                 # computations by the scheduler whose order won
    memo: dict[int, _Sweep]              # the whole program's sweeps in those orders
    hlo: dict[int, Liveness] | None = None  # HLO order arranged as the schedule's (grouped)


@dataclass
class MemoryProfile:
    """Bytes per tile by category (each tile at its own peak) and the fullest tile."""

    categories: dict[str, np.ndarray]
    total: np.ndarray
    peak_tile: int
    peak_bytes: int
    always_live_bytes: int
    peak_not_always_live_bytes: int   # chip-wide, at the point where the sum is largest
    contributors: list[Contributor] = field(default_factory=list)  # on the peak tile
    order: str = "hlo"                # "hlo": emission order; "scheduled": memory-aware
    hlo_order_peak_bytes: int = 0     # the fullest tile's bytes in HLO order
    hlo_order_peak_tile: int = 0
    schedulers: dict[str, int] = field(default_factory=dict)  # computations by winning order
    orders: Callable[[CompPlan], Liveness] | None = None      # the order kept, per computation
    view: IpuView | None = None       # the IPU profiled (None: the whole program)

    def by_layer(self) -> list[tuple[str, int]]:
        """Contributors on the peak tile summed by Keras layer, largest first."""
        sums: dict[str, int] = {}
        for c in self.contributors:
            key = c.layer or f"({c.kind})"
            sums[key] = sums.get(key, 0) + c.bytes
        return sorted(sums.items(), key=lambda kv: -kv[1])


LiveOf = Callable[[CompPlan], Liveness]
# Candidate orders whose chip-wide peak is more than this factor above the best one's are not
# swept per tile (the sweep is the costly part); HLO order always is.
_WITHIN = 1.05


class _Sweeper:
    """Sweeps computations in the orders ``live_of`` gives, seeing what ``view`` holds (all:
    None), each computation once."""

    def __init__(self, T: int, live_of: LiveOf, view: IpuView | None = None,
                 memo: dict[int, _Sweep] | None = None) -> None:
        self.T = T
        self.live_of = live_of
        self.view = view
        self.memo: dict[int, _Sweep] = {} if memo is None else memo

    def __call__(self, ctx: CompPlan) -> _Sweep:
        key = id(ctx)
        if key not in self.memo:
            self.memo[key] = self.sweep(ctx, self.live_of(ctx))
        return self.memo[key]

    def sweep(self, ctx: CompPlan, live: Liveness) -> _Sweep:
        """The per-tile sweep of ``ctx`` with its points in ``live.order``."""
        T, view = self.T, self.view
        n = len(live.order)
        births: list[list[Buf]] = [[] for _ in range(n + 2)]
        deaths: list[list[Buf]] = [[] for _ in range(n + 2)]
        for b, first, last in live.ranges:
            if view is None or id(b) in view.bufs:
                births[first].append(b)
                deaths[last + 1].append(b)
        run = np.zeros(T)
        peak = np.zeros(T)
        pact = np.zeros(T)
        ptmp = np.zeros(T)
        at = np.zeros(T, dtype=np.int64)
        chip = 0.0
        points = ctx.points
        for k in range(n + 1):
            if not k & 255:
                cancel.checkpoint("sweeping tile memory")  # a Compile's client may cancel it
            for b in deaths[k]:
                b.mapping.add_to(run, -b.itemsize)
            p = points[live.order[k]] if k < n else None
            temps = p.temps if p is not None and (view is None or id(p) in view.points) else ()
            subs = p.subs if p is not None else ()
            if not births[k] and not temps and not subs and k:
                continue  # nothing was added here: no tile can be at a new peak
            for b in births[k]:
                b.mapping.add_to(run, b.itemsize)
            act = run
            tmp = None
            if temps or subs:
                tmp = np.zeros(T)
                for m, nbytes in temps:
                    m.covers(tmp, nbytes)
                extra_act = None
                for alts in subs:
                    sweeps = [self(c) for c in alts]
                    if not sweeps:
                        continue
                    best = sweeps[0]
                    s_tot, s_act, s_tmp = best.total, best.act, best.tmp
                    for other in sweeps[1:]:
                        pick = other.total > s_tot
                        s_tot = np.where(pick, other.total, s_tot)
                        s_act = np.where(pick, other.act, s_act)
                        s_tmp = np.where(pick, other.tmp, s_tmp)
                    extra_act = s_act if extra_act is None else extra_act + s_act
                    tmp += s_tmp
                if extra_act is not None:
                    act = run + extra_act
            cur = act if tmp is None else act + tmp
            s = float(cur.sum())
            if s > chip:
                chip = s
            mask = cur > peak
            if mask.any():
                peak[mask] = cur[mask]
                pact[mask] = act[mask]
                ptmp[mask] = 0.0 if tmp is None else tmp[mask]
                at[mask] = k
        return _Sweep(peak, pact, ptmp, at, chip)

    def contributors(self, ctx: CompPlan, tile: int, at: int, where: str,
                     out: list[Contributor]) -> None:
        """Tensors and temporaries on ``tile`` at position ``at`` of ``ctx``'s order
        (recursing into calls)."""
        view = self.view
        live = self.live_of(ctx)
        for b, first, last in live.ranges:
            if first <= at <= last and (view is None or id(b) in view.bufs):
                nb = b.mapping.elements_on(tile) * b.itemsize
                if nb:
                    out.append(Contributor(int(nb), b.instr.name, b.instr.opcode,
                                           layer_name(b.instr), "activations", where))
        if at >= len(live.order):
            return
        p = ctx.points[live.order[at]]
        if view is None or id(p) in view.points:
            for m, nbytes in p.temps:
                if (tile - m.first) % m.total_tiles < m.tiles:
                    out.append(Contributor(int(nbytes), p.instr.name, p.instr.opcode,
                                           layer_name(p.instr), "temporaries", where))
        for alts in p.subs:
            if not alts:
                continue
            best = max(alts, key=lambda c: self(c).total[tile])
            self.contributors(best, tile, int(self(best).at[tile]), best.name, out)


def memory_schedule(plan: ModulePlan, base: np.ndarray | None = None,
                    group: Callable[[Point], int] | None = None) -> Schedule:
    """The memory-aware order of every computation of ``plan`` (see module docstring),
    compared with ``base`` (the always-live bytes per tile; default: none) added. ``group``:
    per program point, a group the order must run in ascending order where the graph allows
    it (a pipeline's stages: forwards, backwards in reverse, the update; ``pipeline.py``),
    applied to every candidate order, HLO order's too."""
    T = plan.target.tiles_per_ipu
    base = np.zeros(T) if base is None else base
    hlo: dict[int, Liveness] | None = {} if group is not None else None
    chosen: dict[int, Liveness] = {}
    wins: dict[str, int] = {}
    sweeper = _Sweeper(T, lambda c: chosen[id(c)])

    def visit(ctx: CompPlan) -> None:
        if id(ctx) in chosen:
            return
        chosen[id(ctx)] = hlo_liveness(ctx)  # recursion guard
        for p in ctx.points:
            for alts in p.subs:
                for c in alts:
                    visit(c)
        callee = [sum(max((sweeper(c).chip_peak for c in alts), default=0.0) for alts in p.subs)
                  for p in ctx.points]
        graph, bufs = graph_of(ctx, callee, plan.overwrites if ctx is plan.entry else ())
        sweeps: dict[tuple[int, ...], _Sweep] = {}
        arrange = None
        if group is not None:
            key = [group(p) for p in ctx.points]

            def arrange(order: list[int]) -> list[int]:
                return grouped(graph, order, key)

            hlo[id(ctx)] = liveness(graph, bufs, arrange(list(range(len(ctx.points)))), "hlo")

        def evaluate(order: list[int]) -> tuple[float, float]:
            sw = sweeper.sweep(ctx, liveness(graph, bufs, order, ""))
            sweeps[tuple(order)] = sw
            tot = base + sw.total
            return float(tot.max()), float(tot.sum())

        order, name = schedule(graph, evaluate, within=_WITHIN, arrange=arrange)
        chosen[id(ctx)] = liveness(graph, bufs, order, name)
        sweeper.memo[id(ctx)] = sweeps[tuple(order)]
        wins[name] = wins.get(name, 0) + 1

    visit(plan.entry)
    return Schedule(chosen, wins, sweeper.memo, hlo)


def _always_live(plan: ModulePlan, view: IpuView | None) -> tuple[dict[str, np.ndarray], list[Buf]]:
    """Always-live bytes per tile by category, and the parameters and constants counted."""
    T = plan.target.tiles_per_ipu
    cats: dict[str, np.ndarray] = {c: np.zeros(T) for c in CATEGORIES}
    held = [b for b in plan.params + plan.constants
            if b.mapping is not None and (view is None or id(b) in view.bufs)]
    for b in held:
        kind = "constants" if b.kind == "constant" else "inputs" if b.kind == "argument" else "variables"
        b.mapping.add_to(cats[kind], b.itemsize)
    if view is None:
        cats["code and vertex state"] += plan.code_bytes
        cats["exchange code"] += plan.exchange_code_bytes
    else:
        for s in view.stages:
            cats["code and vertex state"] += plan.stage_code_bytes[s]
            cats["exchange code"] += plan.stage_exchange_code_bytes[s]
    return cats, held


def profile_memory(plan: ModulePlan, top: int = 12, *, order: str = "scheduled",
                   view: IpuView | None = None, schedule: Schedule | None = None,
                   recompute: Recomputation | None = None) -> MemoryProfile:
    """The memory profile of a planned module (of one IPU of it: ``view``) with its points
    in ``order``: "scheduled" (the memory-aware schedule, or HLO order where that is no
    worse) or "hlo" (see module docstring). ``schedule``: ``memory_schedule(plan)``, if made
    already (a pipelined program's IPUs share it). ``recompute``: the forward tensors the
    backward makes again (``recompute.py``) are live only while the forward reads them and
    again from their recomputation, in either order."""
    if order not in ("scheduled", "hlo"):
        raise ValueError(f"order must be 'scheduled' or 'hlo', not {order!r}")
    T = plan.target.tiles_per_ipu
    cats, held = _always_live(plan, view)
    always = sum(cats[c] for c in CATEGORIES[:5])
    hlo: dict[int, Liveness] = {}

    def hlo_of(c: CompPlan) -> Liveness:
        if id(c) not in hlo:
            arranged = schedule.hlo if schedule is not None and schedule.hlo is not None else {}
            hlo[id(c)] = arranged.get(id(c)) or hlo_liveness(c)
        return hlo[id(c)]

    sweeper = _Sweeper(T, hlo_of if recompute is None else recompute.wrap(hlo_of), view)
    sw = sweeper(plan.entry)
    hlo_total = always + sw.total
    hlo_tile = int(np.argmax(hlo_total))
    kept, wins = "hlo", {}
    if order == "scheduled":
        if schedule is None:
            schedule = memory_schedule(plan, always)
        wins = schedule.wins
        chosen = schedule.chosen

        def chosen_of(c: CompPlan) -> Liveness:
            return chosen[id(c)]

        memo = dict(schedule.memo) if view is None and recompute is None else None
        mine = _Sweeper(T, chosen_of if recompute is None else recompute.wrap(chosen_of), view, memo)
        ssw = mine(plan.entry)
        if float((always + ssw.total).max()) <= float(hlo_total.max()):
            kept, sw, sweeper = "scheduled", ssw, mine
    cats["activations"] += sw.act
    cats["temporaries"] += sw.tmp
    total = always + sw.total
    tile = int(np.argmax(total))
    contributors: list[Contributor] = []
    for b in held:
        nb = b.mapping.elements_on(tile) * b.itemsize
        if nb:
            kind = "constants" if b.kind == "constant" else ("inputs" if b.kind == "argument" else "variables")
            contributors.append(Contributor(int(nb), b.instr.name, b.instr.opcode, layer_name(b.instr), kind))
    for c in ("code and vertex state", "exchange code"):
        if cats[c][tile]:
            contributors.append(Contributor(int(cats[c][tile]), f"({c})", "", "", c))
    sweeper.contributors(plan.entry, tile, int(sw.at[tile]), "", contributors)
    contributors.sort(key=lambda c: -c.bytes)
    return MemoryProfile(
        categories=cats, total=total, peak_tile=tile, peak_bytes=int(np.ceil(total[tile])),
        always_live_bytes=int(always.sum()), peak_not_always_live_bytes=int(sw.chip_peak),
        contributors=contributors[: max(top, 1) * 4], order=kept, schedulers=dict(wins),
        hlo_order_peak_bytes=int(np.ceil(hlo_total[hlo_tile])), hlo_order_peak_tile=hlo_tile,
        orders=sweeper.live_of, view=view,
    )


# ------------------------------------------------------------------------------ liveness trace

#: Phases of the points in a liveness trace, by ``pipeline.phases``' names.
_PHASE_LETTER = {"forward": "F", "backward": "B", "update": "U"}


@dataclass
class LivenessTrace:
    """One tile's bytes at every program point of the entry computation, in the order the
    profile kept (``liveness_trace``). ``points`` holds at most ``max_points`` of them (each
    the fullest of a run of ``bucket`` consecutive positions): ``(position, bytes, name,
    opcode, Keras layer, pipeline stage, phase)``, phase "F", "B", "U" or "" (not known); the
    last position is the end of the program (its results live), named "(end)"."""

    tile: int
    positions: int                       # the entry's points + its end
    bucket: int                          # positions per kept point (1: every one)
    always_live: dict[str, int]          # always-live bytes on the tile by category
    always_live_bytes: float             # ... their sum (every position holds them)
    extra_bytes: float                   # constant over the steps (a pipeline's stash)
    offloaded_bytes: float               # always-live bytes off the tile during the steps
    points: list[tuple[int, int, str, str, str, int, str]]
    peak_position: int
    peak_bytes: int
    peak_not_always_live_bytes: float    # of which live tensors and temporaries
    top: list[Contributor]               # tensors and temporaries live at the peak
    phase_starts: dict[str, int] = field(default_factory=dict)  # first position of each phase
    order: str = "hlo"

    def to_dict(self) -> dict[str, object]:
        """Plain data (JSON-able); ``points`` as lists."""
        peak = next((p for p in self.points if p[0] == self.peak_position), None)
        return {
            "tile": self.tile, "positions": self.positions, "bucket": self.bucket,
            "order": self.order,
            "always_live": dict(self.always_live),
            "always_live_bytes": int(math.ceil(self.always_live_bytes)),
            "extra_bytes": int(round(self.extra_bytes)),
            "offloaded_bytes": int(round(self.offloaded_bytes)),
            "points": [list(p) for p in self.points],
            "peak": {"position": self.peak_position, "bytes": self.peak_bytes,
                     "not_always_live_bytes": int(math.ceil(self.peak_not_always_live_bytes)),
                     "name": peak[2] if peak else "", "opcode": peak[3] if peak else "",
                     "layer": peak[4] if peak else "", "stage": peak[5] if peak else 0,
                     "phase": peak[6] if peak else ""},
            "top": [c.to_dict() for c in self.top],
            "phase_starts": dict(self.phase_starts),
        }


class _TileWalk:
    """``_Sweeper.sweep`` for one tile in scalars, in the same arithmetic (so that its peak is
    the sweep's to the last bit), keeping the bytes at every position."""

    def __init__(self, tile: int, live_of: LiveOf, view: IpuView | None) -> None:
        self.tile = tile
        self.live_of = live_of
        self.view = view
        self.memo: dict[int, tuple[float, float, float]] = {}

    def peak(self, ctx: CompPlan) -> tuple[float, float, float]:
        """(peak, tensors at it, temporaries at it) of ``ctx`` on the tile."""
        key = id(ctx)
        if key not in self.memo:
            self.memo[key] = self.walk(ctx)[1]
        return self.memo[key]

    @staticmethod
    def _covers(m: TileMapping, tile: int) -> bool:
        """Whether a temporary on ``m``'s run of tiles is on ``tile`` (as ``covers`` adds)."""
        return (tile - m.first) % m.total_tiles < m.tiles

    def walk(self, ctx: CompPlan) -> tuple[list[float], tuple[float, float, float], int]:
        """The not-always-live bytes on the tile at each position of ``ctx``'s order (its
        points, then its end), its (peak, tensors, temporaries) and the peak's position (the
        first position at the peak, as the sweep's ``at``)."""
        tile, view = self.tile, self.view
        live = self.live_of(ctx)
        n = len(live.order)
        born = [0] * (n + 2)
        dead = [0] * (n + 2)
        for b, first, last in live.ranges:
            if view is None or id(b) in view.bufs:
                nb = b.mapping.elements_on(tile) * b.itemsize
                if nb:
                    born[first] += nb
                    dead[last + 1] += nb
        run = 0
        peak = pact = ptmp = 0.0
        at = 0
        trace: list[float] = []
        points = ctx.points
        for k in range(n + 1):
            run += born[k] - dead[k]
            p = points[live.order[k]] if k < n else None
            temps = p.temps if p is not None and (view is None or id(p) in view.points) else ()
            subs = p.subs if p is not None else ()
            act = float(run)
            cur = act
            tmp = 0.0
            if temps or subs:
                for m, nbytes in temps:
                    if self._covers(m, tile):
                        tmp += nbytes
                extra_act: float | None = None
                for alts in subs:
                    if not alts:
                        continue
                    s_tot, s_act, s_tmp = self.peak(alts[0])
                    for c in alts[1:]:
                        o_tot, o_act, o_tmp = self.peak(c)
                        if o_tot > s_tot:
                            s_tot, s_act, s_tmp = o_tot, o_act, o_tmp
                    extra_act = s_act if extra_act is None else extra_act + s_act
                    tmp += s_tmp
                if extra_act is not None:
                    act = run + extra_act
                cur = act + tmp
            trace.append(cur)
            if cur > peak:
                peak, pact, ptmp, at = cur, act, tmp, k
        return trace, (peak, pact, ptmp), at


def liveness_trace(plan: ModulePlan, profile: MemoryProfile, tile: int | None = None, *,
                   max_points: int = 2000, phase: Mapping[str, str] | None = None,
                   extra_bytes: float = 0.0, offloaded_bytes: float = 0.0,
                   top: int = 20) -> LivenessTrace:
    """``tile``'s bytes (default: the profile's fullest) at every program point of the entry
    computation of ``plan``, in the order ``profile`` kept (``profile.orders``, recomputation
    included; of the IPU ``profile.view``): the tile's always-live bytes plus, at each point,
    the buffers live there, the point's temporaries and the peak on the tile of what it calls,
    as the sweep counts them; minus ``offloaded_bytes`` and plus ``extra_bytes`` (constant over
    the steps: a pipeline's stash). Down-sampled to at most ``max_points`` points (the fullest
    of each run of consecutive positions, so the peak is kept). ``phase``: per instruction
    name, "forward", "backward" or "update" (``pipeline.phases``). ``top``: how many of the
    tensors and temporaries live at the peak to name.

    Its maximum is the tile's peak: ``profile.total[tile]`` (+ ``extra_bytes`` -
    ``offloaded_bytes``), rounded up as ``peak_bytes`` is."""
    if profile.orders is None:
        raise ValueError("the memory profile has no order (made by profile_memory?)")
    T = plan.target.tiles_per_ipu
    tile = profile.peak_tile if tile is None else int(tile)
    if not 0 <= tile < T:
        raise ValueError(f"tile {tile} is not one of the {T} tiles")
    always_cats = {c: float(profile.categories[c][tile]) for c in CATEGORIES[:5]}
    always = sum(profile.categories[c] for c in CATEGORIES[:5])[tile]  # as profile_memory sums
    walker = _TileWalk(tile, profile.orders, profile.view)
    values, (_, _, _), at = walker.walk(plan.entry)
    live = profile.orders(plan.entry)
    entry = plan.entry.points
    phase = phase or {}

    def total(v: float) -> float:
        t = always + v
        if offloaded_bytes:
            t = t - offloaded_bytes
        return t + extra_bytes if extra_bytes else t

    def meta(k: int) -> tuple[str, str, str, int, str]:
        if k >= len(live.order):
            return "(end)", "", "", -1, ""
        instr = entry[live.order[k]].instr
        return (instr.name, instr.opcode, layer_name(instr), stage_of(instr),
                _PHASE_LETTER.get(phase.get(instr.name, ""), ""))

    n = len(values)
    bucket = max(1, math.ceil(n / max(1, max_points)))
    kept: list[tuple[int, int, str, str, str, int, str]] = []
    for start in range(0, n, bucket):
        k = max(range(start, min(n, start + bucket)), key=lambda j: values[j])  # the first max
        kept.append((k, int(math.ceil(total(values[k]))), *meta(k)))
    starts: dict[str, int] = {}
    if phase:
        for k in range(n - 1):
            letter = meta(k)[4]
            if letter and letter not in starts:
                starts[letter] = k
    found: list[Contributor] = []
    _Sweeper(T, profile.orders, profile.view).contributors(plan.entry, tile, at, "", found)
    found.sort(key=lambda c: -c.bytes)
    return LivenessTrace(
        tile=tile, positions=n, bucket=bucket,
        always_live={c: int(round(v)) for c, v in always_cats.items() if v},
        always_live_bytes=float(always), extra_bytes=float(extra_bytes),
        offloaded_bytes=float(offloaded_bytes), points=kept, peak_position=at,
        peak_bytes=int(math.ceil(total(values[at]))), peak_not_always_live_bytes=values[at],
        top=found[: max(top, 0)], phase_starts=starts, order=profile.order,
    )
