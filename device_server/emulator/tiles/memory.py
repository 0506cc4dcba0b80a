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

The sweep walks the program points once with a per-tile running total (numpy vectors over
the tiles) and keeps, for every tile, its peak and the point where it happens, so that the
largest contributors on the fullest tile can be named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from device_server.emulator.tiles.planner import Buf, CompPlan, ModulePlan, layer_name

__all__ = ["CATEGORIES", "Contributor", "MemoryProfile", "profile_memory"]

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
    at: np.ndarray        # per tile: the point of the peak
    chip_peak: float      # largest sum over tiles at one point


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

    def by_layer(self) -> list[tuple[str, int]]:
        """Contributors on the peak tile summed by Keras layer, largest first."""
        sums: dict[str, int] = {}
        for c in self.contributors:
            key = c.layer or f"({c.kind})"
            sums[key] = sums.get(key, 0) + c.bytes
        return sorted(sums.items(), key=lambda kv: -kv[1])


def _sweep(ctx: CompPlan, T: int, memo: dict[int, _Sweep]) -> _Sweep:
    key = id(ctx)
    if key in memo:
        return memo[key]
    n = len(ctx.points)
    births: list[list[Buf]] = [[] for _ in range(n + 2)]
    deaths: list[list[Buf]] = [[] for _ in range(n + 2)]
    for b in ctx.bufs:
        if b.ctx is not ctx or b.fused or b.inplace or b.mapping is None:
            continue
        births[min(b.born, n)].append(b)
        deaths[min(b.last, n) + 1].append(b)
    run = np.zeros(T)
    peak = np.zeros(T)
    pact = np.zeros(T)
    ptmp = np.zeros(T)
    at = np.zeros(T, dtype=np.int64)
    chip = 0.0
    for k in range(n + 1):
        for b in deaths[k]:
            b.mapping.add_to(run, -b.itemsize)
        for b in births[k]:
            b.mapping.add_to(run, b.itemsize)
        act = run
        tmp = None
        if k < n:
            p = ctx.points[k]
            if p.temps or p.subs:
                tmp = np.zeros(T)
                for m, nbytes in p.temps:
                    m.covers(tmp, nbytes)
                extra_act = None
                for alts in p.subs:
                    subs = [_sweep(c, T, memo) for c in alts]
                    if not subs:
                        continue
                    best = subs[0]
                    s_tot, s_act, s_tmp = best.total, best.act, best.tmp
                    for other in subs[1:]:
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
    result = _Sweep(peak, pact, ptmp, at, chip)
    memo[key] = result
    return result


def _contributors(ctx: CompPlan, T: int, tile: int, point: int, memo: dict[int, _Sweep],
                  where: str, out: list[Contributor]) -> None:
    """Tensors and temporaries on ``tile`` at ``point`` of ``ctx`` (recursing into calls)."""
    for b in ctx.bufs:
        if b.ctx is not ctx or b.fused or b.inplace or b.mapping is None:
            continue
        if b.born <= point <= b.last:
            nb = b.mapping.elements_on(tile) * b.itemsize
            if nb:
                out.append(Contributor(int(nb), b.instr.name, b.instr.opcode, layer_name(b.instr),
                                       "activations", where))
    if point >= len(ctx.points):
        return
    p = ctx.points[point]
    for m, nbytes in p.temps:
        if (tile - m.first) % m.total_tiles < m.tiles:
            out.append(Contributor(int(nbytes), p.instr.name, p.instr.opcode, layer_name(p.instr),
                                   "temporaries", where))
    for alts in p.subs:
        if not alts:
            continue
        best = max(alts, key=lambda c: _sweep(c, T, memo).total[tile])
        sw = _sweep(best, T, memo)
        _contributors(best, T, tile, int(sw.at[tile]), memo, best.name, out)


def profile_memory(plan: ModulePlan, top: int = 12) -> MemoryProfile:
    """The memory profile of a planned module (see module docstring)."""
    T = plan.target.tiles_per_ipu
    cats: dict[str, np.ndarray] = {c: np.zeros(T) for c in CATEGORIES}
    for b in plan.params:
        if b.mapping is None:
            continue
        b.mapping.add_to(cats["inputs" if b.kind == "argument" else "variables"], b.itemsize)
    for b in plan.constants:
        b.mapping.add_to(cats["constants"], b.itemsize)
    cats["code and vertex state"] += plan.code_bytes
    cats["exchange code"] += plan.exchange_code_bytes
    memo: dict[int, _Sweep] = {}
    sw = _sweep(plan.entry, T, memo)
    cats["activations"] += sw.act
    cats["temporaries"] += sw.tmp
    always = sum(cats[c] for c in CATEGORIES[:5])
    total = always + sw.total
    tile = int(np.argmax(total))
    contributors: list[Contributor] = []
    for b in plan.params + plan.constants:
        nb = b.mapping.elements_on(tile) * b.itemsize if b.mapping is not None else 0
        if nb:
            kind = "constants" if b.kind == "constant" else ("inputs" if b.kind == "argument" else "variables")
            contributors.append(Contributor(int(nb), b.instr.name, b.instr.opcode, layer_name(b.instr), kind))
    for c in ("code and vertex state", "exchange code"):
        if cats[c][tile]:
            contributors.append(Contributor(int(cats[c][tile]), f"({c})", "", "", c))
    _contributors(plan.entry, T, tile, int(sw.at[tile]), memo, "", contributors)
    contributors.sort(key=lambda c: -c.bytes)
    return MemoryProfile(
        categories=cats, total=total, peak_tile=tile, peak_bytes=int(np.ceil(total[tile])),
        always_live_bytes=int(always.sum()), peak_not_always_live_bytes=int(sw.chip_peak),
        contributors=contributors[: max(top, 1) * 4],
    )
