"""Ordering a computation's instructions to reduce the memory they keep live.

    Graph: nodes (program points, in a valid order) that make and read buffers
      preds[v]   nodes that must run before v (operands; side effects in their order)
      maker[b]   the node that makes buffer b; size[b] its bytes; kept[b]: live to the end
      reads[v]   buffers v reads (b is live from maker[b] to its last reader)
      temp[v]    bytes live only while v runs (exchange buffers, partials, callees' peaks)

    live bytes at node v = buffers made and still to be read (v's own included) + temp[v]
    peak(order) = max over the order of the live bytes;  schedule(graph) -> a low-peak order

One algorithm at every size (no search): list schedulers with a memory-pressure rule, as
XLA's and Poplar's are, run side by side, and the order with the lowest peak (``evaluate``:
the scalar peak unless the caller measures otherwise, e.g. per tile) is kept:

* **reverse** (the main one): the order is built from the end. At each step, of the nodes
  whose successors are all placed, the one that opens the fewest bytes net is placed before
  them: the bytes of the buffers it reads that nothing placed reads yet (they become live
  here, going backwards), minus the bytes of its own buffers that are live (they end here);
  ties: the fewest bytes live while it runs, then the latest in the given order. Going
  backwards, a node's figure is exact when it becomes ready (all readers of what it makes
  are placed), which the forward rule cannot know;
* **list**: the same rule forwards, XLA's list scheduler: of the ready nodes, the one that
  adds the fewest bytes net (bytes it makes minus the buffers it reads last);
* **dfs**: a depth-first post-order from the results: each node after its predecessors,
  the predecessor with the largest need - size first (Liu's rule for trees: a node's need
  is the peak of its predecessors' subgraphs in that order, plus its own bytes);
* **hlo**: the given order (HLO emission order), so that the schedule is never worse.

Each is O((nodes + reads) log nodes). The optimum is NP-hard in general;
``tests/test_tile_scheduler.py`` measures the scheduler against it (found by exhaustive
search) on random graphs of 10 to 14 nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEDULERS", "Graph", "dfs_schedule", "grouped", "list_schedule", "peak", "positions",
           "reverse_schedule", "schedule"]


@dataclass
class Graph:
    """A computation to order (see module docstring); node numbers are positions in the
    order the graph was given in, which must be valid (predecessors first). ``preds`` and
    ``reads`` are made sorted and free of repeats."""

    preds: list[list[int]]
    maker: list[int]
    reads: list[list[int]]
    size: list[float]
    temp: list[float]
    kept: list[bool]

    def __post_init__(self) -> None:
        self.preds = [sorted(set(p)) for p in self.preds]
        self.reads = [sorted(set(r)) for r in self.reads]
        n = len(self.preds)
        self.makes: list[list[int]] = [[] for _ in range(n)]    # per node: buffers it makes
        for b, v in enumerate(self.maker):
            self.makes[v].append(b)
        self.readers: list[list[int]] = [[] for _ in self.size]  # per buffer: its readers
        for v, bs in enumerate(self.reads):
            for b in bs:
                self.readers[b].append(v)
        self.succs: list[list[int]] = [[] for _ in range(n)]    # per node: nodes after it
        for v, ps in enumerate(self.preds):
            for p in ps:
                self.succs[p].append(v)

    @property
    def nodes(self) -> int:
        return len(self.preds)


def grouped(graph: Graph, order: Sequence[int], key: Sequence[int]) -> list[int]:
    """``order`` (valid) stably sorted by each node's ``key``: groups that run one after the
    other (pipeline stages). A node a lower group needs joins that group (its key lowered to
    its successors' least), so the result is valid too."""
    least = list(key)
    for v in reversed(order):
        for s in graph.succs[v]:
            if least[s] < least[v]:
                least[v] = least[s]
    return sorted(order, key=lambda v: least[v])


def positions(graph: Graph, order: Sequence[int]) -> tuple[list[int], list[int]]:
    """Where each node runs in ``order``, and the position of each buffer's last use (the
    end of the order for a buffer kept to the end)."""
    end = len(order)
    pos = [0] * graph.nodes
    for n, v in enumerate(order):
        pos[v] = n
    last = [end if graph.kept[b] else pos[v] for b, v in enumerate(graph.maker)]
    for v, bs in enumerate(graph.reads):
        for b in bs:
            if pos[v] > last[b]:
                last[b] = pos[v]
    return pos, last


def peak(graph: Graph, order: Sequence[int]) -> float:
    """The most bytes live at one node of ``order`` (see module docstring)."""
    end = len(order)
    pos, last = positions(graph, order)
    delta = [0.0] * (end + 2)
    for b, v in enumerate(graph.maker):
        delta[pos[v]] += graph.size[b]
        delta[last[b] + 1] -= graph.size[b]
    live = best = 0.0
    for n, v in enumerate(order):
        live += delta[n]
        best = max(best, live + graph.temp[v])
    return best


def reverse_schedule(graph: Graph) -> list[int]:
    """The reverse list scheduler's order (see module docstring)."""
    n = graph.nodes
    makes, readers, succs = graph.makes, graph.readers, graph.succs
    preds, reads = graph.preds, graph.reads
    opened = list(graph.kept)                  # live at the nodes placed so far
    waiting = [len(s) for s in succs]
    placed = [False] * n

    def key(v: int) -> tuple[float, float, int]:
        opens = sum(graph.size[b] for b in reads[v] if not opened[b])
        own = sum(graph.size[b] for b in makes[v])
        closes = sum(graph.size[b] for b in makes[v] if opened[b])
        return opens - closes, opens + own + graph.temp[v], -v

    heap = [(*key(v), v) for v in range(n) if waiting[v] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        net, during, neg, v = heapq.heappop(heap)
        if placed[v] or (net, during, neg) != key(v):
            continue  # a stale entry: v was pushed again with its new figures
        placed[v] = True
        order.append(v)
        for b in reads[v]:
            if not opened[b]:
                opened[b] = True
                for r in readers[b]:
                    if not placed[r] and waiting[r] == 0:
                        heapq.heappush(heap, (*key(r), r))
        for p in preds[v]:
            waiting[p] -= 1
            if waiting[p] == 0:
                heapq.heappush(heap, (*key(p), p))
    if len(order) != n:
        raise ValueError("the graph has a cycle: no order runs every node")
    order.reverse()
    return order


def list_schedule(graph: Graph) -> list[int]:
    """The forward list scheduler's order (see module docstring)."""
    n = graph.nodes
    makes, readers, succs, reads = graph.makes, graph.readers, graph.succs, graph.reads
    made = [sum(graph.size[b] for b in bs) for bs in makes]
    during = [made[v] + graph.temp[v] for v in range(n)]
    left = [len(r) for r in readers]          # readers of each buffer not yet scheduled
    waiting = [len(p) for p in graph.preds]
    freed = [0.0] * n                          # bytes a node would free if it ran now
    for b, rs in enumerate(readers):
        if len(rs) == 1 and not graph.kept[b]:
            freed[rs[0]] += graph.size[b]
    heap: list[tuple[float, float, int]] = []
    for v in range(n):
        if waiting[v] == 0:
            heapq.heappush(heap, (made[v] - freed[v], during[v], v))
    done = [False] * n
    order: list[int] = []
    while heap:
        net, _, v = heapq.heappop(heap)
        if done[v] or net != made[v] - freed[v]:
            continue  # a stale entry: v was pushed again with its new figure
        done[v] = True
        order.append(v)
        for b in reads[v]:
            left[b] -= 1
            if left[b] == 1 and not graph.kept[b]:
                last = next(r for r in readers[b] if not done[r])
                freed[last] += graph.size[b]
                if waiting[last] == 0:
                    heapq.heappush(heap, (made[last] - freed[last], during[last], last))
        for s in succs[v]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(heap, (made[s] - freed[s], during[s], s))
    if len(order) != n:
        raise ValueError("the graph has a cycle: no order runs every node")
    return order


def dfs_schedule(graph: Graph) -> list[int]:
    """The depth-first post-order (see module docstring)."""
    n = graph.nodes
    makes, preds, succs = graph.makes, graph.preds, graph.succs
    own = [sum(graph.size[b] for b in makes[v]) for v in range(n)]
    need = [0.0] * n
    for v in range(n):  # the given order is topological: predecessors first
        held = top = 0.0
        for p in sorted(preds[v], key=lambda p: own[p] - need[p]):
            top = max(top, held + need[p])
            held += own[p]
        need[v] = max(top, held + own[v] + graph.temp[v])
    visited = [False] * n
    order: list[int] = []
    for root in reversed(range(n)):
        if succs[root] or visited[root]:
            continue
        stack = [(root, False)]
        while stack:
            v, expanded = stack.pop()
            if expanded:
                order.append(v)
                continue
            if visited[v]:
                continue
            visited[v] = True
            stack.append((v, True))
            # Pushed in reverse, so that the largest need - size is visited (and done) first.
            for p in sorted(preds[v], key=lambda p: (need[p] - own[p], -p)):
                if not visited[p]:
                    stack.append((p, False))
    return order


SCHEDULERS: dict[str, Callable[[Graph], list[int]]] = {
    "reverse": reverse_schedule, "list": list_schedule, "dfs": dfs_schedule,
}


def schedule(graph: Graph, evaluate: Callable[[list[int]], Any] | None = None,
             within: float = 0.0, arrange: Callable[[list[int]], list[int]] | None = None
             ) -> tuple[list[int], str]:
    """The order of the lowest peak (see module docstring) by ``evaluate`` (lower is
    better; default :func:`peak`), and the name of the scheduler that made it ("reverse",
    "list", "dfs" or "hlo": the given order). With ``within`` > 0, ``evaluate`` (a costly
    measure) only sees the orders whose scalar peak is within that factor of the lowest
    (HLO order always). ``arrange`` rewrites every candidate (HLO order's too) before it is
    measured: the constraints of a program the graph does not hold (pipeline stages)."""
    orders = {"hlo": list(range(graph.nodes))}
    for name, make in SCHEDULERS.items():
        orders[name] = make(graph)
    if arrange is not None:
        orders = {name: arrange(order) for name, order in orders.items()}
    if evaluate is None:
        scores = {name: peak(graph, order) for name, order in orders.items()}
    else:
        if within > 0:
            scalar = {name: peak(graph, order) for name, order in orders.items()}
            bound = within * min(scalar.values())
            orders = {name: order for name, order in orders.items()
                      if name == "hlo" or scalar[name] <= bound}
        seen: dict[tuple[int, ...], Any] = {}
        scores = {}
        for name, order in orders.items():
            key = tuple(order)
            if key not in seen:
                seen[key] = evaluate(order)
            scores[name] = seen[key]
    best = "hlo"
    for name in orders:
        if scores[name] < scores[best]:
            best = name
    return orders[best], best
