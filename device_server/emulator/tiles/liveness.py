"""Live ranges of a computation's stored buffers under an order of its program points.

    CompPlan: points (instructions, the buffers each reads, temporaries, callees) and buffers
      (born at a point, read at points, results kept to the end)
        |
        |  graph_of(ctx, callee_bytes)                      schedule.Graph to be ordered:
        |    predecessors = operands (within the computation)
        |                 + side effects in their program order (custom calls, feeds, rng)
        |                 + every read of a variable before its update written over it
        v
      Liveness(order, ranges): order = points in execution order; ranges = per stored
        buffer (first, last) positions: first = its maker's, last = its last reader's
        (the end for results)

``hlo_liveness`` is the emission order, the planner's own ``born`` / ``last``; ``memory.py``
sweeps any Liveness per tile, and chooses the scheduled one per computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from device_server.emulator.tiles.plan import Buf, CompPlan
from device_server.emulator.tiles.schedule import Graph, positions

__all__ = ["ORDERED_OPS", "Liveness", "graph_of", "hlo_liveness", "liveness", "stored"]

# Instructions with effects beyond their result keep their program order among themselves.
ORDERED_OPS = frozenset({"custom-call", "infeed", "outfeed", "send", "send-done", "recv",
                         "recv-done", "rng", "rng-get-and-update-state", "after-all"})


@dataclass
class Liveness:
    """An order of a computation's points and its stored buffers' live ranges (positions in
    that order, inclusive; ``last == len(order)``: live to the end)."""

    order: list[int]
    ranges: list[tuple[Buf, int, int]]
    scheduler: str = "hlo"


def stored(ctx: CompPlan) -> list[Buf]:
    """The buffers ``ctx`` stores (not fused away, not written over a parameter, laid out)."""
    return [b for b in ctx.bufs
            if b.ctx is ctx and not b.fused and not b.inplace and b.mapping is not None]


def hlo_liveness(ctx: CompPlan) -> Liveness:
    """The emission order: the planner's ``born`` and ``last``."""
    n = len(ctx.points)
    return Liveness(list(range(n)), [(b, min(b.born, n), min(b.last, n)) for b in stored(ctx)])


def _effectful(ctx: CompPlan, memo: dict[int, bool]) -> list[bool]:
    """Per point of ``ctx``: whether it (or a computation it calls) has effects."""
    out = []
    for p in ctx.points:
        e = p.instr.opcode in ORDERED_OPS
        if not e:
            for alts in p.subs:
                for c in alts:
                    if id(c) not in memo:
                        memo[id(c)] = False  # recursion guard
                        memo[id(c)] = any(_effectful(c, memo))
                    e = e or memo[id(c)]
        out.append(e)
    return out


def graph_of(ctx: CompPlan, callee_bytes: Sequence[float],
             overwrites: Sequence[tuple[Buf, Buf]] = ()) -> tuple[Graph, list[Buf]]:
    """The scheduling graph of ``ctx`` (see module docstring) and its buffers (buffer ``i``
    of the graph is the ``i``-th). Sizes are bytes over the whole chip; a point's temporary
    bytes are its temporaries' on all their tiles plus ``callee_bytes[point]`` (the peak of
    what it calls)."""
    points = ctx.points
    n = len(points)
    index = {p.instr.id: k for k, p in enumerate(points)}
    preds: list[list[int]] = []
    for k, p in enumerate(points):
        preds.append(sorted({index[o] for o in p.instr.operands if o in index and index[o] < k}))
    last_effect = -1
    for k, e in enumerate(_effectful(ctx, {})):
        if e:
            if last_effect >= 0:
                preds[k].append(last_effect)
            last_effect = k
    bufs = stored(ctx)
    number = {id(b): i for i, b in enumerate(bufs)}
    reads = [sorted({number[id(b)] for b in p.uses if id(b) in number}) for p in points]
    # An update written over its parameter runs after every read of the old value (reads
    # the emission order puts after it are left alone: the edges all point forwards).
    if overwrites:
        readers: dict[int, list[int]] = {id(param): [] for _, param in overwrites}
        for r, p in enumerate(points):
            for b in p.uses:
                if id(b) in readers:
                    readers[id(b)].append(r)
        for new, param in overwrites:
            k = new.born
            if new.ctx is ctx and 0 <= k < n:
                preds[k].extend(r for r in dict.fromkeys(readers[id(param)]) if r < k)
    temp = [sum(m.tiles * nb for m, nb in p.temps) + float(callee_bytes[k])
            for k, p in enumerate(points)]
    graph = Graph(preds=preds, maker=[min(b.born, max(0, n - 1)) for b in bufs], reads=reads,
                  size=[float(b.nbytes) for b in bufs], temp=temp, kept=[b.last >= n for b in bufs])
    return graph, bufs


def liveness(graph: Graph, bufs: Sequence[Buf], order: Sequence[int], scheduler: str) -> Liveness:
    """The live ranges of ``bufs`` (the graph's buffers) when the points run in ``order``."""
    pos, last = positions(graph, order)
    return Liveness(list(order), [(buf, pos[graph.maker[i]], last[i]) for i, buf in enumerate(bufs)],
                    scheduler)
