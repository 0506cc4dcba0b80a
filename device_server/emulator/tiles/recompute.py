"""Recomputation: which forward tensors the backward pass makes again instead of keeping them,
and their live ranges then (docs/tile_model.md, "Recomputation").

    forward    x ─> a ─> b ─> c ─> [ck1] ─> d ─> e ─> [ck2] ─> ...      ck: checkpoints (kept)
    backward   ... made again from ck1: d, e ─> grad(e), grad(d)
                   made again from x:   a, b, c ─> grad(c), grad(b), grad(a)

    a recomputed tensor is live [made, its last forward read]
                        and again [its segment's recompute point, its last backward read]

Two policies, as Graphcore's recomputation works (graphcore/tensorflow ``RecomputationMode``,
``IPUConfig.allow_recompute``):

* **segments**: a pipeline stage that is recomputed (``pipeline.py``: a stage with
  micro-batches in flight, or any stage with recomputation checkpoints, which Graphcore honours
  in ``RecomputeAndBackpropagateInterleaved``, one-stage pipelines included). Its forward is
  cut at its checkpoints into segments (the stage's input opens the first); the backward of a
  segment starts by making the segment again from the checkpoint before it, so the segment's
  tensors that the backward reads are live again from the first backward read of any of them.
  Checkpoints, stage inputs (a tensor another stage's forward reads), results and tensors
  made by instructions with effects (feeds, random numbers, custom calls) are kept.
* **cheap** (``allow_recompute`` on a program without a pipeline, where Graphcore pattern-
  matches instructions to recompute): an element-wise result (a cast, an activation) the
  backward reads is made again at each backward read from operands that are live there
  anyway (kept for the backward, parameters, constants), instead of being kept.

The transients of recomputation itself (what a segment makes that no backward reads) are not
counted: they die as they do in the forward pass.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from device_server.emulator.tiles.irinfo import ELEMENTWISE_OPS, RNG_OPS, VIEW_OPS, stage_of
from device_server.emulator.tiles.liveness import ORDERED_OPS, Liveness
from device_server.emulator.tiles.plan import Buf, CompPlan
from device_server.protocol import ir_pb2

__all__ = ["CHECKPOINT_ATTR", "Recomputation", "checkpoint_makers", "again_cycles", "recomputed_liveness"]

#: IR attribute of an instruction whose value is a recomputation checkpoint (docs/ir.md).
CHECKPOINT_ATTR = "recomputation_checkpoint"

# Instructions whose results are never made again: effects, random numbers, loop plumbing.
_KEPT_OPS = ORDERED_OPS | RNG_OPS | {"parameter", "constant", "tuple", "get-tuple-element"}
# Cheap to make again from operands that are live anyway (the ``cheap`` policy).
_CHEAP_OPS = ELEMENTWISE_OPS | {"convert", "broadcast", "select", "clamp", "compare", "maximum",
                                "minimum", "add", "subtract", "multiply", "divide"}


def _root(by_id: Mapping[int, ir_pb2.Instruction], i: ir_pb2.Instruction) -> ir_pb2.Instruction:
    """The instruction that makes the value ``i`` views (through reshapes, copies, ...)."""
    while i.opcode in VIEW_OPS and i.operands and i.operands[0] in by_id:
        i = by_id[i.operands[0]]
    return i


def checkpoint_makers(comp: ir_pb2.Computation) -> set[str]:
    """Names of the instructions that make the values ``comp`` marks as recomputation
    checkpoints (``recomputation_checkpoint``, seen through views)."""
    by_id = {i.id: i for i in comp.instructions}
    return {_root(by_id, i).name for i in comp.instructions
            if CHECKPOINT_ATTR in i.attrs and i.attrs[CHECKPOINT_ATTR].flag}


@dataclass
class Recomputation:
    """What is recomputed: ``policy`` "segments" for the ``stages`` given (None: every stage),
    or "cheap"; ``phase`` per instruction name ("forward", "backward", "update"), as
    ``pipeline.phases`` gives it; ``stages`` the program's stage count."""

    policy: str
    phase: Mapping[str, str]
    recomputed_stages: frozenset[int] | None = None
    stages: int = 1
    #: instructions run again, and how many times per run of their computation: given (the
    #: segments of a program that is not pipelined), or found as the ``cheap`` policy sweeps
    again: dict[str, int] = field(default_factory=dict)
    #: (computation, order) -> (that order, its ranges under recomputation): the same order
    #: of a computation is swept again for each IPU of a pipeline (``wrap``).
    _done: dict[tuple[int, int], tuple[Liveness, Liveness]] = field(
        default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.policy not in ("segments", "cheap"):
            raise ValueError(f"recomputation policy must be 'segments' or 'cheap', not {self.policy!r}")

    def wrap(self, live_of: Callable[[CompPlan], Liveness]) -> Callable[[CompPlan], Liveness]:
        """``live_of`` with each computation's live ranges under recomputation (memoized, also
        across calls: what an order gives depends on the computation and the order only)."""
        memo: dict[int, Liveness] = {}

        def of(ctx: CompPlan) -> Liveness:
            if id(ctx) not in memo:
                live = live_of(ctx)
                key = (id(ctx), id(live))
                if key not in self._done:  # (``live`` is kept with it: its id is not reused)
                    out = hoisted(ctx, live, self) if self.policy == "segments" else live
                    self._done[key] = (live, recomputed_liveness(ctx, out, self))
                memo[id(ctx)] = self._done[key][1]
            return memo[id(ctx)]

        return of


def _stage(instr: ir_pb2.Instruction, S: int) -> int:
    return min(max(stage_of(instr), 0), S - 1)


def hoisted(ctx: CompPlan, live: Liveness, rec: Recomputation) -> Liveness:
    """``live`` with backward work of a recomputed stage that last reads forward tensors (a
    weight gradient's matmul: the layer's input with the gradient of its output) run as soon
    as its operands exist, where that ends more bytes than it makes. A schedule made without
    recomputation in view has no reason to run it early: to it, those tensors are live from
    the forward pass whatever it does, so it may leave it after the next layers' backward;
    remade, they would then stay live across them. Poplar's scheduler, which sees the
    remaking, runs it when its gradient is ready.

    What only the weight update reads (a weight gradient) is not counted as made: a
    pipeline adds each micro-batch's weight gradient to its accumulator, created once per
    variable and live across the pipeline, as soon as it is made (graphcore/tensorflow
    ``ipu/ops/op_util.py``, ``accumulate_gradients``: ``gradient_accumulator_create``, then
    ``gradient_accumulator_add_with_scale``), so running it early holds nothing new there.
    (Counted, a weight gradient as large as the remade tensor it ends, e.g. BERT-Large's
    ``[1024, 4096]`` kernel against its GELU product over 1,024 tokens, was a tie that left
    it at the end of the stage's backward.)"""
    points = ctx.points
    n = len(live.order)
    phase = rec.phase
    S = max(rec.stages, 1)
    pos = {pi: k for k, pi in enumerate(live.order)}
    last_read: dict[int, int] = {}
    for k, pi in enumerate(live.order):
        for b in points[pi].uses:
            last_read[id(b)] = k
    outlive: dict[int, list[Buf]] = {}  # per point: what it makes that outlives it
    for b, first, end in live.ranges:
        if end > first:
            outlive.setdefault(b.born, []).append(b)
    readers: dict[int, set[int]] = {}
    for k, pi in enumerate(live.order):
        for b in points[pi].uses:
            readers.setdefault(id(b), set()).add(k)

    def accumulated(b: Buf) -> bool:
        """Read by the weight update only: added to its accumulator as it is made."""
        rs = readers.get(id(b), ())
        return bool(rs) and all(phase.get(points[live.order[r]].instr.name) == "update" for r in rs)

    def movable(k: int) -> bool:
        p = points[live.order[k]]
        return (phase.get(p.instr.name, "forward") == "backward" and not p.subs
                and p.instr.opcode not in _KEPT_OPS
                and (rec.recomputed_stages is None or _stage(p.instr, S) in rec.recomputed_stages))

    target = [float(k) for k in range(n)]
    taken: set[int] = set()
    moved = 0
    for k in range(n):
        if k in taken or not movable(k):
            continue
        # The chain: k, and while all a member makes is read by one point only, that point
        # (a reduction's convert, then the reduction, then its cast back).
        chain = [k]
        while len(chain) < 4:
            outs = outlive.get(live.order[chain[-1]], [])
            nxt = {r for b in outs for r in readers.get(id(b), ())}
            if len(nxt) != 1 or not outs:
                break
            j = nxt.pop()
            if j <= chain[-1] or j in taken or not movable(j):
                break
            chain.append(j)
        inside = {live.order[c] for c in chain}
        ends = 0.0
        ready = -1
        for c in chain:
            p = points[live.order[c]]
            for b in p.uses:
                if b.born in inside:
                    continue
                if b.kind == "activation" and last_read.get(id(b)) == c:
                    ends += b.nbytes
                if b.kind == "activation":  # (what it reads through fused producers
                    # included: they store nothing, only the stored tensors order it)
                    ready = max(ready, pos.get(b.born, -1))
        made = sum(b.nbytes for b in outlive.get(live.order[chain[-1]], []) if not accumulated(b))
        if ends > made and ready < k - 1:
            for c in chain:
                target[c] = ready + 0.5
            taken.update(chain)
            moved += 1
    key = [(target[k], k) for k in range(n)]
    if not moved:
        return live
    order = [live.order[k] for _, k in sorted(key)]
    new = {pi: k for k, pi in enumerate(order)}
    last: dict[int, int] = {}
    for k, pi in enumerate(order):
        for b in points[pi].uses:
            last[id(b)] = k
    ranges = []
    for b, first, end in live.ranges:
        f = new.get(b.born, first)
        ranges.append((b, f, end if end >= n else max(last.get(id(b), f), f)))
    return Liveness(order, ranges, live.scheduler)


def recomputed_liveness(ctx: CompPlan, live: Liveness, rec: Recomputation) -> Liveness:
    """``live`` with the ranges of the tensors ``rec`` recomputes split in two (see module
    docstring); the order is unchanged."""
    n = len(live.order)
    points = ctx.points
    phase = rec.phase
    S = max(rec.stages, 1)
    # Per buffer: positions of its forward readers and of its later (backward, update) readers,
    # and the stages whose forward reads it.
    # A backward instruction that reads no gradient (no tensor the backward or the update
    # made: a ReLU's mask, the loss's derivative from the forward's outputs, a batch norm's
    # ``x - mean`` in its gradient) is forward work under recomputation: Poplar runs it when
    # the backward needs it, after the remaking, wherever the order being swept put it (a
    # scheduler free to run it as soon as its operands exist puts it right after the forward
    # pass). It counts as run, and its operands as read, where the first instruction that is
    # not such work needs its result (``needed``). Within one TF op, a backward instruction
    # that reads such work of the same op is such work too. An "update" instruction is such
    # work when it reads forward activations or "update" work of this kind, and nothing else
    # the backward made (a custom gradient's computations, which no "gradient_tape/" name
    # marks).
    # (Its operands, not the buffers it reads: a gradient fused into a chain is not stored.)
    by_id = {i.id: i for i in ctx.comp.instructions}

    early_ids: set[int] = set()
    for ins in ctx.comp.instructions:  # operands first
        ph = phase.get(ins.name, "forward")
        if ph == "forward" or (rec.recomputed_stages is not None
                               and _stage(ins, S) not in rec.recomputed_stages):
            continue
        ops = [by_id[o] for o in ins.operands if o in by_id]
        if rec.policy != "segments":  # cheap: made again at each read, nothing moved
            if ph == "backward" and all(phase.get(o.name, "forward") == "forward" for o in ops):
                early_ids.add(ins.id)
        elif ph == "backward":
            # Reads nothing the backward made, but in the TF op it is part of (an op's several
            # instructions: RsqrtGrad's y^3 before it multiplies by dy). Not across TF ops:
            # the loss's gradient itself is made from forward values alone.
            if all(phase.get(o.name, "forward") == "forward"
                   or (o.id in early_ids and o.source_op == ins.source_op) for o in ops):
                early_ids.add(ins.id)
        elif all(phase.get(o.name, "forward") == "forward"
                 or (o.id in early_ids and phase.get(o.name) == "update") for o in ops) and any(
                o.id in early_ids or o.opcode not in _KEPT_OPS for o in ops):
            early_ids.add(ins.id)  # an "update" chain from forward activations alone
    early = {p.instr.name for p in points if p.instr.id in early_ids}
    at = {points[pi].instr.id: k for k, pi in enumerate(live.order)}
    users: dict[int, list[int]] = {}
    for ins in ctx.comp.instructions:
        for o in ins.operands:
            users.setdefault(o, []).append(ins.id)
    # needed[i]: the first position where work that is not early needs the value of i (users
    # come after their operands: one pass from the end).
    needed: dict[int, int] = {}
    for ins in reversed(ctx.comp.instructions):
        found = [at[u] if u in at and by_id[u].name not in early else needed.get(u)
                 for u in users.get(ins.id, ())]
        found = [k for k in found if k is not None]
        if found:
            needed[ins.id] = min(found)

    def forward_work(name: str) -> bool:
        return phase.get(name, "forward") == "forward" or name in early

    fwd: dict[int, list[int]] = {}      # reads by forward work (early backward included)
    early_reads: dict[int, list[int]] = {}
    late: dict[int, list[int]] = {}
    grad_reads: dict[int, list[int]] = {}   # the late reads by the backward pass itself
    fwd_stages: dict[int, set[int]] = {}
    runs_at: dict[str, int] = {}        # early work: where it counts as run
    for k, pi in enumerate(live.order):
        p = points[pi]
        if p.instr.name in early and rec.policy == "segments":
            k = runs_at[p.instr.name] = max(k, needed.get(p.instr.id, k))
        for b in p.uses:
            if p.instr.name in early:
                early_reads.setdefault(id(b), []).append(k)
            if forward_work(p.instr.name):
                fwd.setdefault(id(b), []).append(k)
                fwd_stages.setdefault(id(b), set()).add(_stage(p.instr, S))
            else:
                late.setdefault(id(b), []).append(k)
                if phase.get(p.instr.name, "forward") == "backward":
                    grad_reads.setdefault(id(b), []).append(k)
    if not late:
        return live
    held = checkpoint_makers(ctx.comp)

    def candidate(b: Buf, first: int, last: int) -> bool:
        ins = b.instr
        return (b.kind == "activation" and last < n and id(b) in late and forward_work(ins.name)
                and ins.opcode not in _KEPT_OPS and ins.name not in held
                and not (fwd_stages.get(id(b), set()) - {_stage(ins, S)}))  # a stage input

    # Early work moved to where it counts as run: its result is made there, and its operands
    # are live until then.
    moved: list[tuple[Buf, int, int]] = []
    for b, first, last in live.ranges:
        if last < n and id(b) in early_reads:
            last = max(last, *early_reads[id(b)])
        if b.instr.name in runs_at:
            first = max(first, min(runs_at[b.instr.name], last))
        moved.append((b, first, last))
    ranges: list[tuple[Buf, int, int]] = []
    again: dict[str, int] = {}
    if rec.policy == "segments":
        cuts: dict[int, list[int]] = {}
        for k, p in enumerate(points):
            if p.instr.name in held:
                cuts.setdefault(_stage(p.instr, S), []).append(k)
        chosen: list[tuple[Buf, int, int, tuple[int, int]]] = []
        start: dict[tuple[int, int], int] = {}
        for b, first, last in moved:
            s = _stage(b.instr, S)
            if (b.instr.name not in runs_at and (rec.recomputed_stages is None
                                                 or s in rec.recomputed_stages)
                    and candidate(b, first, last)):
                seg = (s, bisect.bisect_left(sorted(cuts.get(s, ())), b.born))
                chosen.append((b, first, last, seg))
                start[seg] = min(start.get(seg, n), min(grad_reads.get(id(b), [n])))
            else:
                ranges.append((b, first, last))
        for b, first, last, seg in chosen:
            # Live through the forward pass to its last forward read; made again where its
            # segment's backward starts (the first read of any of the segment's tensors by
            # the backward pass), or where it is read after the forward pass (by the weight
            # update, or by early work, a mask, where that counts as run), if sooner.
            ahead = set(early_reads.get(id(b), ()))
            lf = max([k for k in fwd.get(id(b), ()) if k not in ahead], default=first)
            r = min([start[seg], min(late[id(b)]), *(k for k in ahead if k > lf)])
            if first < r and r > lf + 1:
                ranges += [(b, first, lf), (b, r, last)]
            else:
                ranges.append((b, first, last))
    else:
        spans = {b.instr.id: (first, last) for b, first, last in moved}
        made_again: set[int] = set()

        def available(oid: int, until: int) -> bool:
            ins = by_id.get(oid)
            if ins is None:
                return False
            root = _root(by_id, ins)
            if root.opcode in ("parameter", "constant", "get-tuple-element", "iota"):
                return True
            span = spans.get(root.id)
            return span is not None and root.id not in made_again and span[1] >= until

        for b, first, last in moved:
            ins = b.instr
            reads = late.get(id(b), [])
            if (candidate(b, first, last) and ins.opcode in _CHEAP_OPS and ins.operands
                    and all(available(o, max(reads)) for o in ins.operands)):
                lf = max(fwd.get(id(b), [first]))
                made_again.add(ins.id)
                ranges.append((b, first, lf))
                ranges += [(b, k, k) for k in sorted(set(reads))]
                again[ins.name] = len(set(reads))
            else:
                ranges.append((b, first, last))
    rec.again.update(again)
    return Liveness(live.order, ranges, live.scheduler)


def again_cycles(steps: Iterable, names: Mapping[str, int]) -> float:
    """The cycles recomputation adds to a program that is not pipelined: each instruction run
    again as many times as ``names`` says, at its planned cycles, times the trips of the loops
    around it."""
    if not names:
        return 0.0
    total = 0.0

    def visit(steps: Iterable, mult: float) -> None:
        nonlocal total
        for st in steps:
            if st.name in names:
                total += (st.compute + st.exchange + st.sync) * mult * names[st.name]
            for child in st.children:
                visit(child.steps, mult * st.repeat)

    visit(steps, 1.0)
    return total
