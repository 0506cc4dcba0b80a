"""Pipelined programs: each stage on its IPU; memory per IPU and the pipeline's time.

    a replica = P IPUs (ipus_per_replica); stage s runs on IPU stage_ipus[s] of its replica
    (several stages may share one); replica r on ipu_ids[r P : (r + 1) P]. The program is one
    replica's, every instruction tagged with its stage (``pipeline_stage``); it is planned
    once, each instruction on its stage's IPU (layouts, code: planner.plan_module(stages=S)).

    per stage s, from the plan's supersteps (docs/tile_model.md, "Pipelines"):
      F_s   forward cycles of one micro-batch      (not a gradient, needs none)
      B_s   backward cycles of one micro-batch     ("gradient_tape/..."; + gradient accumulation)
      U_s   cycles of one weight update            (needs a gradient; inside the accumulation's
                                                    conditional it runs once per update)
      sends bytes stage s sends another IPU per micro-batch, forwards (F) and backwards (B)
    the schedule places F_s(i), B_s(i) of micro-batch i (of M) in slots:
      grouped:      F at i + s,        B at i + 2(S-1) - s    (an IPU runs F and B in a slot)
      interleaved:  F at 2i + s,       B at 2i + 2S - 1 - s   (one pass per slot)
      sequential:   F at 2Si + s,      B at 2Si + 2S - 1 - s  (one stage at a time)
      no backward (inference): F at i + s (sequential: Si + s)
    slot cycles = max over IPUs of the passes it runs (stages sharing an IPU add up)
                + max over those passes' sends of bytes / slowest hop + hop latencies
                  (system.path between the stages' IPUs, replication.transfer_seconds)
                + one sync across the replica's IPUs (none on one IPU)
    per weight update = sum of slot cycles + max over IPUs of sum U_s
                      + max over IPUs of the all-reduces of its stages' gradients over the
                        ring of the IPUs holding them in every replica (replicas > 1)
    per call: N micro-batches (the device loop's trips; 1 without one) = N / M updates
    grouped, M >> S:  per update / M -> max over IPUs of (F + B) + sends + sync

    memory per IPU = its stages' variables, inputs, constants, code and exchange code
      + the peak of the tensors its stages make or receive (one micro-batch; a received
        tensor is a copy live as long as the original), in the whole program's schedule
      + sum over its stages of (k_s - 1) x stash_s, per tile
    k_s     micro-batches in flight at stage s (forward run, backward not yet): from the slots,
            grouped 2(S-1-s)+1, interleaved S-s, sequential 1 (at most M)
    stash_s tensors stage s keeps from its forward for its backward (made by a forward, read
            by stage s's backward); with recomputation (stages with k_s > 1): the stage's
            input checkpoint instead (what its forward reads from other stages and the
            streamed inputs; with recomputation checkpoints, those the stage reads again),
            and B_s += F_s (the forward runs again before the backward). PopTorch runs
            consecutive blocks on one IPU as one stage (its builders merge them,
            tf_ipu.models.gpt2.merge_consecutive_stages); k_s is then PopART's stash size
      optimizer state offloaded (variables only the weight update reads; Streaming Memory,
            system.streaming_memory_bytes_per_s): per tile max(total - state, always-live
            rest + state / shards) (streamed in only for the update, when nothing is
            stashed); U_s / shards + 2 x state / shards / bandwidth per update. "auto": only
            on an IPU that does not fit otherwise. shards: replicas with sharding, else 1

Everything assumed is named in ``PIPELINE_ASSUMPTIONS`` and docs/tile_model.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_server.emulator.arch import Target
from device_server.emulator.tiles.irinfo import VIEW_OPS, layer_name, stage_of
from device_server.emulator.tiles.liveness import stored
from device_server.emulator.tiles.memory import CATEGORIES, IpuView, MemoryProfile, profile_memory
from device_server.emulator.tiles.memory import Schedule as MemorySchedule
from device_server.emulator.tiles.plan import Buf, CompPlan, ModulePlan, Point, Step
from device_server.emulator.tiles.recompute import Recomputation, checkpoint_makers
from device_server.emulator.tiles.replication import (
    Replication,
    all_reduce_seconds,
    check_ipu_ids,
    external_sync_seconds,
    host_link_load,
    ring_over,
    transfer_seconds,
)
from device_server.protocol import DEVICE_LOOP_NAME, hardware, ir_pb2

__all__ = ["PIPELINE_ASSUMPTIONS", "SCHEDULES", "Placement", "estimate_pipeline", "in_flight",
           "phases", "placement", "recomputed_instructions", "slots", "stage_groups"]

SCHEDULES = ("grouped", "interleaved", "sequential")
# Bounds on what a pipeline's timeline lays out (one entry per stage pass): far above any
# published configuration (MLPerf BERT: 4 stages x a few thousand micro-batches a step), and
# low enough that a request cannot make the planner allocate gigabytes.
MAX_PIPELINE_STAGES = 1024
MAX_STAGE_PASSES = 1 << 22   # pipeline_stages x micro_batches

PIPELINE_ASSUMPTIONS = (
    "pipeline: each stage on its IPU; one micro-batch's program planned once, each "
    "instruction on its stage's IPU; per stage its forward (F), backward (B, with gradient "
    "accumulation) and weight-update (U) cycles from the plan",
    "pipeline slots: grouped runs F and B of different micro-batches in one slot, interleaved "
    "one pass per slot, sequential one stage at a time; a slot costs its busiest IPU, its "
    "slowest inter-IPU send and one sync across the replica's IPUs; nothing overlaps",
    "inter-stage sends: each tensor a stage reads from another IPU's stage crosses once per "
    "micro-batch over system.path at its slowest hop's bandwidth plus the hops' latencies; "
    "sends in one slot do not share links",
    "pipeline memory: one micro-batch's working set per IPU (the whole program's schedule) "
    "plus (k - 1) more stashes per stage, k the micro-batches in flight there; recomputation "
    "stashes the stage's input checkpoint and runs its forward again before the backward "
    "(with recomputation checkpoints: stashes those its stage reads again too, and runs "
    "again only what a backward read needs from the latest checkpoint)",
    "pipelined replicas: each IPU all-reduces its stages' gradients over the ring of the IPUs "
    "holding them once per weight update; host transfers over the replicas' first IPUs' links",
    "optimizer state (variables only the weight update reads) offloaded: off the IPU except "
    "during the weight update, when no stash is live; read and written once per update over "
    "the system's Streaming Memory bandwidth, not overlapped; sharded over R replicas: 1/R "
    "of it and of the update's compute on each, the gradients' all-reduce unchanged "
    "(reduce-scatter and all-gather move the same bytes)",
)


# ------------------------------------------------------------------------------ placement


@dataclass(frozen=True)
class Placement:
    """Where a pipelined program runs (made and checked by :func:`placement`)."""

    stages: int
    stage_ipus: tuple[int, ...]      # per stage: its IPU within the replica
    ipus_per_replica: int
    replicas: int
    system: hardware.System
    ipu_ids: tuple[int, ...]         # replicas x ipus_per_replica, replica by replica
    schedule: str
    micro_batches: int
    recomputation: bool
    offload: str = "auto"            # optimizer state in Streaming Memory: "auto", "on", "off"
    sharding: bool = False           # optimizer state sharded over the replicas

    def ipu_id(self, replica: int, ipu: int) -> int:
        """The system's IPU that runs IPU ``ipu`` of replica ``replica``."""
        return self.ipu_ids[replica * self.ipus_per_replica + ipu]

    def holders(self, ipu: int) -> tuple[int, ...]:
        """IPU ``ipu`` of every replica (the ring its gradients are all-reduced over)."""
        return tuple(self.ipu_id(r, ipu) for r in range(self.replicas))

    def used_ipus(self) -> list[int]:
        """The IPUs of a replica that run at least one stage, ascending."""
        return sorted(set(self.stage_ipus))

    def describe(self) -> str:
        mapping = ", ".join(f"stage {s} on IPU {i}" for s, i in enumerate(self.stage_ipus))
        return (f"{self.stages} stages ({mapping}) over {self.ipus_per_replica} IPU(s) per "
                f"replica, {self.replicas} replica(s) on {self.system.name} IPUs "
                f"{', '.join(map(str, self.ipu_ids))}; {self.schedule}, {self.micro_batches} "
                f"micro-batch(es) per weight update" + (", recomputation" if self.recomputation else "")
                + (", optimizer state offloaded" if self.offload == "on" else "")
                + (", optimizer state sharded over the replicas" if self.sharding else ""))


def _power_of_two(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def placement(stages: int, stage_ipus: Iterable[int], ipus_per_replica: int, replicas: int,
              system: hardware.System | str | None, ipu_ids: Iterable[int], target: Target,
              schedule: str = "grouped", micro_batches: int = 1,
              recomputation: bool = False, offload: str | bool | None = "auto",
              sharding: bool = False) -> Placement:
    """The checked placement of a pipelined program (``ipus_per_replica`` 0: the IPUs the
    stages name, rounded up to a power of two, as Graphcore rounds). ``ipu_ids``: every IPU
    of every replica, replica by replica, or each replica's first IPU (its IPUs are then that
    one and the next ``ipus_per_replica - 1``); empty: the system's first IPUs.

    ``offload`` (Graphcore's ``offload_weight_update_variables``): the optimizer state (the
    variables only the weight update reads) lives in the system's Streaming Memory and is
    streamed in and out at each weight update: "on" (True), "off" (False), or "auto" (None:
    only on an IPU that does not fit otherwise, where the system has Streaming Memory).
    ``sharding`` (``replicated_optimizer_state_sharding``): each replica holds and updates
    1/replicas of the offloaded state.

    Raises:
        ValueError: naming the numbers: a stage count below 1, ``stage_ipus`` not one IPU per
            stage or naming an IPU the replica lacks, an unknown schedule, micro-batches
            below 1, more IPUs than the system has, ``ipu_ids`` not one distinct IPU of the
            system per replica IPU, a system of another IPU version, or offload "on" on a
            system without Streaming Memory.
    """
    for name, v in (("pipeline_stages", stages), ("replicas", replicas),
                    ("micro_batches", micro_batches), ("ipus_per_replica", ipus_per_replica)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "ipus_per_replica" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'ipus_per_replica' else 1}. "
                             f"Received: {name}={v!r}")
    if stages > MAX_PIPELINE_STAGES:
        raise ValueError(f"pipeline_stages must be at most {MAX_PIPELINE_STAGES}. Received: "
                         f"pipeline_stages={stages}")
    if stages * micro_batches > MAX_STAGE_PASSES:
        raise ValueError(
            f"pipeline_stages x micro_batches must be at most {MAX_STAGE_PASSES:,} (the passes "
            f"of one weight update the timeline lays out). Received: {stages} x "
            f"{micro_batches:,} = {stages * micro_batches:,}")
    mapping = tuple(int(i) for i in stage_ipus or ()) or tuple(range(stages))
    if len(mapping) != stages:
        raise ValueError(f"stage_ipus (device_mapping) must name one IPU per pipeline stage: "
                         f"{len(mapping)} IPU(s) {list(mapping)} for {stages} stages.")
    if min(mapping) < 0:
        raise ValueError(f"stage_ipus (device_mapping) must name IPUs >= 0. Received: {list(mapping)}")
    per = ipus_per_replica or _power_of_two(max(mapping) + 1)
    for s, i in enumerate(mapping):
        if i >= per:
            raise ValueError(
                f"pipeline stage {s} is mapped to IPU {i} of its replica, but a replica has "
                f"{per} IPU{'s' if per != 1 else ''} (ipus_per_replica={per}): stage_ipus "
                f"(device_mapping) {list(mapping)} may name IPUs 0 .. {per - 1}, or give each "
                f"replica {_power_of_two(max(mapping) + 1)} IPUs.")
    kind = str(schedule or "grouped").lower()
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {', '.join(SCHEDULES)}. "
                         f"Received: {schedule!r}")
    need = replicas * per
    ids = tuple(int(i) for i in ipu_ids or ())
    if isinstance(system, str):
        system = hardware.get_system(system) if system else None
    if system is None:
        system = hardware.plain_system(max(need, max(ids, default=-1) + 1), target.name)
    if system.ipu_version != target.name:
        raise ValueError(
            f"system {system.name!r} has {system.product} IPUs ({system.ipu_version}); the program "
            f"is compiled for {target.product} ({target.name}).")
    if need > system.num_ipus:
        raise ValueError(
            f"{replicas} replica(s) of {per} IPUs need {need} IPUs, but system {system.name!r} "
            f"has {system.num_ipus}.")
    if ids and len(ids) == replicas and per > 1:
        # Each replica's first IPU: its IPUs are that one and the next ones.
        ids = tuple(first + j for first in ids for j in range(per))
    if ids:
        if len(ids) != need:
            raise ValueError(f"ipu_ids must name {per} IPU(s) per replica ({need} for {replicas} "
                             f"replica(s)), or each replica's first IPU. Received {len(ids)}: "
                             f"{list(ids)}")
        check_ipu_ids(ids, system)
    else:
        ids = tuple(range(need))
    mode = {True: "on", False: "off", None: "auto"}.get(offload, offload)  # type: ignore[call-overload]
    mode = str(mode or "auto").lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"offload_weight_update_variables must be True, False or None (auto). "
                         f"Received: {offload!r}")
    if mode == "on" and not system.streaming_memory_bytes:
        with_memory = sorted(n for n, s in hardware.SYSTEMS.items() if s.streaming_memory_bytes)
        raise ValueError(
            f"offload_weight_update_variables=True needs Streaming Memory, which system "
            f"{system.name!r} ({system.description}) does not have; systems with it: "
            f"{', '.join(with_memory)}. Set it to False or None (auto).")
    if sharding and mode == "off":
        raise ValueError("replicated_optimizer_state_sharding shards the offloaded optimizer "
                         "state: it needs offload_weight_update_variables True or None (auto), "
                         "not False.")
    return Placement(stages, mapping, per, replicas, system, ids, kind, micro_batches,
                     bool(recomputation), mode, bool(sharding))


# ------------------------------------------------------------------------------ schedules


def slots(schedule: str, stages: int, micro_batches: int, backward: bool = True
          ) -> list[list[tuple[int, int, str]]]:
    """The passes of each slot: ``(stage, micro-batch, "F" | "B")`` (see module docstring)."""
    S, M = stages, micro_batches
    at: list[tuple[int, int, int, str]] = []
    for i in range(M):
        for s in range(S):
            if not backward:
                at.append((S * i + s if schedule == "sequential" else i + s, s, i, "F"))
                continue
            if schedule == "grouped":
                f, b = i + s, i + 2 * (S - 1) - s
            elif schedule == "interleaved":
                f, b = 2 * i + s, 2 * i + 2 * S - 1 - s
            else:
                f, b = 2 * S * i + s, 2 * S * i + 2 * S - 1 - s
            at += [(f, s, i, "F"), (b, s, i, "B")]
    out: list[list[tuple[int, int, str]]] = [[] for _ in range(max(t for t, *_ in at) + 1)]
    for t, s, i, kind in sorted(at, key=lambda e: (e[0], e[3] != "F", e[1])):
        out[t].append((s, i, kind))
    return out


def in_flight(timeline: list[list[tuple[int, int, str]]], stages: int) -> list[int]:
    """Per stage: the most micro-batches whose forward has run and backward not finished."""
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for t, passes in enumerate(timeline):
        for s, i, kind in passes:
            (first if kind == "F" else last)[(s, i)] = t
    k = [1] * stages
    for s in range(stages):
        spans = [(first[(s, i)], last.get((s, i), first[(s, i)])) for (st, i) in first if st == s]
        if spans:
            k[s] = max(sum(1 for a, b in spans if a <= t <= b) for t in range(len(timeline)))
    return k


# ------------------------------------------------------------------------------ phases


_GRADIENT_MARKS = ("gradient_tape/", "gradients/")


def _is_gradient(source_op: str) -> bool:
    return any(source_op.startswith(m) or f"/{m}" in source_op for m in _GRADIENT_MARKS)


# Instructions that only rearrange their operands (made of constants if their operands are).
_CONSTANT_PLUMBING = frozenset({"broadcast", "tuple", "get-tuple-element", "reshape", "bitcast",
                                "copy", "convert", "concatenate", "pad", "slice", "transpose"})


def phases(module: ir_pb2.Module) -> dict[str, str]:
    """Per instruction name: "backward" (a gradient: "gradient_tape/..." op names), "update"
    (not a gradient but needs one: the optimizer, gradient accumulation) or "forward"; a
    called computation's parameters take the phase of the instruction that calls it."""
    comps = {c.id: c for c in module.computations}
    out: dict[str, str] = {}
    done: set[int] = set()

    def visit(comp_id: int, caller_phase: str) -> None:
        if comp_id in done or comp_id not in comps:
            return
        done.add(comp_id)
        phase: dict[int, str] = {}
        const: set[int] = set()  # made of constants alone (no data: not a gradient, whatever its name)
        for instr in comps[comp_id].instructions:
            if instr.opcode in ("constant", "iota") or (
                    instr.opcode in _CONSTANT_PLUMBING and instr.operands
                    and all(o in const for o in instr.operands)):
                const.add(instr.id)
            # A gradient is a gradient op with data: TF's empty stacks for a loop's backward,
            # handed to the forward loop that fills them, keep the forward loop forward.
            if _is_gradient(instr.source_op) and instr.id not in const:
                p = "backward"
            elif instr.opcode == "parameter":
                p = caller_phase
            elif any(phase.get(o) in ("backward", "update") for o in instr.operands):
                p = "update"
            else:
                p = "forward"
            phase[instr.id] = p
        # What only the weight update consumes runs with it (a momentum's decay, which
        # needs no gradient itself): "update" too, users before operands.
        users: dict[int, list[int]] = {}
        for instr in comps[comp_id].instructions:
            for o in instr.operands:
                users.setdefault(o, []).append(instr.id)
        root = comps[comp_id].root_id
        for instr in reversed(comps[comp_id].instructions):
            if (phase[instr.id] == "forward" and instr.opcode != "parameter" and instr.id != root
                    and users.get(instr.id)
                    and all(phase[u] == "update" for u in users[instr.id])):
                phase[instr.id] = "update"
        for instr in comps[comp_id].instructions:
            p = out[instr.name] = phase[instr.id]
            for c in instr.called_computations:
                visit(c, p)

    visit(module.entry_computation_id, "forward")
    return out


def _is_device_loop(instr: ir_pb2.Instruction | None) -> bool:
    return instr is not None and instr.opcode == "while" and \
        instr.source_op.rsplit("/", 1)[-1].startswith(DEVICE_LOOP_NAME)


# ------------------------------------------------------------------------------ costs


@dataclass
class _Leaf:
    name: str
    stage: int
    phase: str
    in_conditional: bool
    cycles: float
    link_bytes: float
    kind: str


def _leaves(steps: Iterable[Step], mult: float, in_cond: bool, phase: dict[str, str]
            ) -> Iterator[_Leaf]:
    for s in steps:
        own = s.compute + s.exchange + s.sync
        p = phase.get(s.name, "forward")
        if s.kind in ("all-reduce", "replica-sync"):
            yield _Leaf(s.name, s.stage, p, in_cond, 0.0, s.link_bytes * mult, s.kind)
            continue
        if own:
            yield _Leaf(s.name, s.stage, p, in_cond, own * mult, 0.0, s.kind)
        if s.children:
            cond = in_cond or s.opcode == "conditional"
            for child in s.children:
                yield from _leaves(child.steps, mult * s.repeat, cond, phase)


@dataclass
class _StageCosts:
    forward: float = 0.0        # per micro-batch
    backward: float = 0.0       # per micro-batch, gradient accumulation included
    update: float = 0.0         # per weight update
    all_reduce_mb: list[float] = field(default_factory=list)      # bytes, per micro-batch
    all_reduce_update: list[float] = field(default_factory=list)  # bytes, per weight update
    per_update_names: set[str] = field(default_factory=set)       # its all-reduces run per update


def _costs(plan: ModulePlan, module: ir_pb2.Module, phase: dict[str, str], S: int
           ) -> tuple[list[_StageCosts], float, int]:
    """Per stage costs (see module docstring), the call's own cycles outside the device loop,
    and the micro-batches a call runs."""
    instrs = {i.name: i for c in module.computations for i in c.instructions}
    loop = next((s for s in plan.entry.steps if s.kind == "loop" and _is_device_loop(instrs.get(s.name))),
                None)
    if loop is not None:
        # One trip: the loop step's own cycles and its children's, not times its trips.
        body: list[_Leaf] = []
        for child in loop.children:
            body += list(_leaves(child.steps, 1.0, False, phase))
        own = loop.compute + loop.exchange + loop.sync
        if own:
            body.append(_Leaf(loop.name, loop.stage, phase.get(loop.name, "forward"), False, own, 0.0,
                              "loop"))
        outside = [s for s in plan.entry.steps if s is not loop]
        extra = sum(x.cycles for x in _leaves(outside, 1.0, False, phase))
        micro = max(0, int(loop.repeat))
    else:
        body, extra, micro = list(_leaves(plan.entry.steps, 1.0, False, phase)), 0.0, 1
    costs = [_StageCosts() for _ in range(S)]
    cond_updates = any(x.phase == "update" and x.in_conditional for x in body)
    for x in body:
        c = costs[min(max(x.stage, 0), S - 1)]
        per_update = x.phase == "update" and (x.in_conditional or not cond_updates)
        if x.kind == "all-reduce":
            (c.all_reduce_update if per_update else c.all_reduce_mb).append(x.link_bytes)
            if per_update:
                c.per_update_names.add(x.name)
        elif x.kind == "replica-sync":
            continue
        elif per_update:
            c.update += x.cycles
        elif x.phase == "forward":
            c.forward += x.cycles
        else:
            c.backward += x.cycles
    return costs, extra, micro


# ------------------------------------------------------------------------------ memory


def _plans(ctx: CompPlan) -> Iterator[CompPlan]:
    yield ctx
    for p in ctx.points:
        for alts in p.subs:
            for c in alts:
                yield from _plans(c)


# Memory categories live from start to end (the rest, activations and temporaries, come and go).
_ALWAYS_LIVE = ("variables", "inputs", "constants", "code and vertex state", "exchange code")

# Instructions whose operands are read by the computations they call, not by themselves.
_PASSES_ON = frozenset({"while", "call", "conditional"})


@dataclass
class _Traffic:
    """Who reads what: per buffer id, the (stage, phase) of the points reading it."""

    readers: dict[int, set[tuple[int, str]]]
    bufs: list[Buf]                   # every stored buffer of every computation
    points: list[tuple[int, int]]     # (id(point), stage)


def _traffic(plan: ModulePlan, phase: dict[str, str], S: int) -> _Traffic:
    readers: dict[int, set[tuple[int, str]]] = {}
    bufs: list[Buf] = []
    points: list[tuple[int, int]] = []
    seen: set[int] = set()
    for ctx in _plans(plan.entry):
        if id(ctx) in seen:
            continue
        seen.add(id(ctx))
        bufs += stored(ctx)
        for p in ctx.points:
            st = min(stage_of(p.instr), S - 1)
            points.append((id(p), st))
            if p.instr.opcode in _PASSES_ON:
                continue  # hands its operands to what it calls, whose points read them
            ph = phase.get(p.instr.name, "forward")
            for b in p.uses:
                readers.setdefault(id(b), set()).add((st, ph))
    return _Traffic(readers, bufs, points)


def _views(plan: ModulePlan, where: Placement, traffic: _Traffic) -> dict[int, IpuView]:
    S = where.stages
    views = {i: IpuView(i, tuple(s for s in range(S) if where.stage_ipus[s] == i), set(), set())
             for i in where.used_ipus()}
    for pid, st in traffic.points:
        views[where.stage_ipus[st]].points.add(pid)
    for b in traffic.bufs + plan.params + plan.constants:
        own = where.stage_ipus[min(stage_of(b.instr), S - 1)]
        read = traffic.readers.get(id(b))
        # A variable lives where the stages reading it run (an entry parameter handed to
        # the device loop is tagged with the loop's stage, not its readers').
        if b.ctx is not None or b.kind == "constant" or (b.kind == "variable" and not read):
            views[own].bufs.add(id(b))
        for st, _ in traffic.readers.get(id(b), ()):
            views[where.stage_ipus[st]].bufs.add(id(b))
        if b.ctx is None and b.kind == "argument" and not traffic.readers.get(id(b)):
            views[own].bufs.add(id(b))
    return views


def _stash(plan: ModulePlan, traffic: _Traffic, phase: dict[str, str], S: int, T: int
           ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per stage, per tile: what it stashes for its backward, and what it stashes instead when
    recomputed: its input checkpoint (what its forward reads from other stages, and the
    streamed inputs) plus its recomputation checkpoints (``_recomputation``)."""
    stash = [np.zeros(T) for _ in range(S)]
    ckpt = [np.zeros(T) for _ in range(S)]
    comps = {id(b.ctx.comp): b.ctx.comp for b in traffic.bufs if b.ctx is not None}
    kept = set().union(*(_recomputation(c, phase, S)[0] for c in comps.values()))
    args = [b for b in plan.params if b.kind == "argument"]
    for b in traffic.bufs + args:
        if b.mapping is None:
            continue
        made = "forward" if b.ctx is None else phase.get(b.instr.name, "forward")
        if made != "forward":
            continue
        src = -1 if b.ctx is None else min(stage_of(b.instr), S - 1)
        reads = traffic.readers.get(id(b), set())
        # A checkpoint is stashed where its own stage reads it again; one that only another
        # stage reads (a stage's last, sent on) is stashed there, as that stage's input, not
        # twice. PopART: a tensor consumed only by the copy to the next IPU appears in one
        # stage and gets no stash (graphcore/popart willow/src/transforms/pipeline.cpp,
        # getStashCandidateTensors: "There is no need to stash a tensor that only appears in
        # 1 stage", full recompute stashing "the inputs to an IPU" and checkpoints).
        if b.ctx is not None and b.instr.name in kept and any(st == src for st, _ in reads):
            b.mapping.add_to(ckpt[src], b.itemsize)
        for s in {st for st, _ in reads}:
            if (s, "backward") in reads:
                b.mapping.add_to(stash[s], b.itemsize)
            if (s, "forward") in reads and src != s:
                b.mapping.add_to(ckpt[s], b.itemsize)
    return stash, ckpt


def _recomputation(comp: ir_pb2.Computation, phase: dict[str, str], S: int
                   ) -> tuple[set[str], dict[int, set[str]]]:
    """Recomputation checkpoints of one computation (``recomputation_checkpoint`` marks, seen
    through views to the instruction that makes the value): the names of the checkpointed
    values' makers, and per stage with a checkpoint the forward instructions its
    recomputation runs again: those a backward read reaches through forward operands without
    crossing a checkpointed value, a parameter or another stage's instruction (recomputation
    starts again from the latest checkpoint, as Graphcore's RecomputeAndBackpropagateInterleaved)."""
    by_id = {i.id: i for i in comp.instructions}

    def root(i: ir_pb2.Instruction) -> ir_pb2.Instruction:
        while i.opcode in VIEW_OPS and i.operands and i.operands[0] in by_id:
            i = by_id[i.operands[0]]
        return i

    names = checkpoint_makers(comp)
    if not names:
        return set(), {}
    marks = [i for i in comp.instructions if i.name in names]
    held = {i.id for i in marks}
    again: dict[int, set[str]] = {min(stage_of(i), S - 1): set() for i in marks}
    todo = [(o, -1) for i in comp.instructions if phase.get(i.name) == "backward" for o in i.operands]
    seen: set[tuple[int, int]] = set()
    while todo:
        oid, stage = todo.pop()
        ins = by_id.get(oid)
        if (oid, stage) in seen or ins is None:
            continue
        seen.add((oid, stage))
        s = min(stage_of(ins), S - 1)
        if (ins.opcode == "parameter" or phase.get(ins.name, "forward") != "forward"
                or root(ins).id in held or (stage >= 0 and s != stage)):
            continue
        if s in again:
            again[s].add(ins.name)
        todo.extend((o, s) for o in ins.operands)
    return {by_id[h].name for h in held}, again


def stage_groups(module: ir_pb2.Module, S: int) -> Callable[[Point], int]:
    """Per program point, its place in one micro-batch's run on the IPUs, as Poplar runs a
    pipeline's stages (each a program of its own): the forwards in stage order, then the
    backwards in reverse, then the weight update (``memory.memory_schedule``'s ``group``)."""
    phase = phases(module)

    def group(p: Point) -> int:
        ph = phase.get(p.instr.name, "forward")
        s = min(max(stage_of(p.instr), 0), S - 1)
        return s if ph == "forward" else 2 * S - 1 - s if ph == "backward" else 2 * S

    return group


def recomputed_instructions(module: ir_pb2.Module, phase: dict[str, str], S: int
                            ) -> dict[int, set[str]]:
    """Per stage cut by recomputation checkpoints, the names of the forward instructions its
    recomputation runs again (``_recomputation``), with what they call."""
    again: dict[int, set[str]] = {}
    for comp in module.computations:
        for s, names in _recomputation(comp, phase, S)[1].items():
            again.setdefault(s, set()).update(names)
    comps = {c.id: c for c in module.computations}
    called = {i.name: list(i.called_computations) for c in module.computations for i in c.instructions}
    for names in again.values():  # a recomputed call, loop or reduce runs what it calls again
        work = [c for n in list(names) for c in called.get(n, ())]
        while work:
            comp = comps.get(work.pop())
            for i in comp.instructions if comp is not None else ():
                if i.name not in names:
                    names.add(i.name)
                    work.extend(i.called_computations)
    return again


def _recompute_cycles(plan: ModulePlan, module: ir_pb2.Module, phase: dict[str, str],
                      costs: list[_StageCosts], S: int) -> list[float]:
    """Per stage, the cycles its recomputation adds to a micro-batch's backward: its whole
    forward, or with recomputation checkpoints only the forward instructions
    ``_recomputation`` names (and what they call), at their planned cycles."""
    out = [c.forward for c in costs]
    again = recomputed_instructions(module, phase, S)
    if not again:
        return out
    totals = dict.fromkeys(again, 0.0)

    def visit(steps: Iterable[Step], mult: float, loop_body: bool) -> None:
        for st in steps:
            device_loop = st.kind == "loop" and not loop_body and st.name in loops
            s = min(max(st.stage, 0), S - 1)
            if s in again and st.name in again[s] and phase.get(st.name, "forward") == "forward":
                totals[s] += (st.compute + st.exchange + st.sync) * mult
            for child in st.children:
                visit(child.steps, mult if device_loop else mult * st.repeat, loop_body or device_loop)

    loops = {i.name for c in module.computations for i in c.instructions if _is_device_loop(i)}
    visit(plan.entry.steps, 1.0, False)
    for s, total in totals.items():
        out[s] = min(out[s], total)
    return out


def _optimizer_state(plan: ModulePlan, phase: dict[str, str], S: int, T: int) -> list[np.ndarray]:
    """Per stage, per tile: its optimizer state, the variables only its weight update reads
    (momenta, Adam's moments; not the weights, which its forward reads, nor the gradient
    accumulators, which every micro-batch's backward adds to: with gradient accumulation the
    weight update is the ``conditional`` that runs once per update)."""
    reads: dict[int, set[tuple[str, bool, int]]] = {}  # buffer -> (phase, in a conditional, stage)
    seen: set[tuple[int, bool]] = set()

    def walk(ctx: CompPlan, in_cond: bool) -> None:
        if (id(ctx), in_cond) in seen:
            return
        seen.add((id(ctx), in_cond))
        for p in ctx.points:
            inner = in_cond or p.instr.opcode == "conditional"
            for alts in p.subs:
                for c in alts:
                    walk(c, inner)
            if p.instr.opcode in _PASSES_ON:
                continue
            for b in p.uses:
                reads.setdefault(id(b), set()).add((phase.get(p.instr.name, "forward"), in_cond,
                                                    min(stage_of(p.instr), S - 1)))

    walk(plan.entry, False)
    conditional_updates = any(ph == "update" and c for r in reads.values() for ph, c, _ in r)
    state = [np.zeros(T) for _ in range(S)]
    for b in plan.params:
        if b.kind != "variable" or b.mapping is None:
            continue
        r = reads.get(id(b), set())
        if r and all(ph == "update" and (c or not conditional_updates) for ph, c, _ in r):
            # On the IPU of the stage whose update reads it (the first, for a shared scalar).
            b.mapping.add_to(state[min(st for _, _, st in r)], b.itemsize)
    return state


def _sends(traffic: _Traffic, phase: dict[str, str], where: Placement
           ) -> dict[tuple[int, str], dict[int, float]]:
    """Bytes per micro-batch each stage sends, by the phase that makes them and the IPU of
    the replica that receives them: {(stage, "F" | "B" | "U"): {ipu: bytes}}."""
    S = where.stages
    out: dict[tuple[int, str], dict[int, float]] = {}
    for b in traffic.bufs:
        src = min(stage_of(b.instr), S - 1)
        ipu = where.stage_ipus[src]
        kind = {"forward": "F", "backward": "B"}.get(phase.get(b.instr.name, "forward"), "U")
        for dst in {where.stage_ipus[st] for st, _ in traffic.readers.get(id(b), ())} - {ipu}:
            d = out.setdefault((src, kind), {})
            d[dst] = d.get(dst, 0.0) + float(b.nbytes)
    return out


# ------------------------------------------------------------------------------ assembly


_TIMELINE_SLOTS = 1024


def estimate_pipeline(plan: ModulePlan, module: ir_pb2.Module, where: Placement,
                      memory: MemorySchedule | None = None,
                      implied_all_reduce_bytes: int = 0) -> dict[str, Any]:
    """The figures of a pipelined program (see module docstring): the Estimate fields that
    differ from a one-IPU program's, as a dict (``report.estimate_plan`` applies them)."""
    t = plan.target
    S, M, R = where.stages, where.micro_batches, where.replicas
    T = t.tiles_per_ipu
    clock = t.clock_hz
    phase = phases(module)
    costs, extra, micro = _costs(plan, module, phase, S)
    backward = any(c.backward > 0 for c in costs)
    timeline = slots(where.schedule, S, M, backward)
    k = in_flight(timeline, S) if backward else [1] * S
    # Every stage but the last is recomputed (its backward runs after other stages' work:
    # with micro-batches in flight it stashes its input instead of its activations; in the
    # Sequential schedule, k = 1, its activations are not live across the other stages), and
    # so is any stage recomputation checkpoints cut (RecomputeAndBackpropagateInterleaved:
    # the backward remakes one segment at a time, which bounds the stage's own liveness).
    marked = {s for c in module.computations for s in _recomputation(c, phase, S)[1]}
    recompute = [where.recomputation and backward and (s < S - 1 or s in marked)
                 and costs[s].backward > 0 for s in range(S)]
    rec = Recomputation("segments", phase, frozenset(s for s in range(S) if recompute[s]), S) \
        if any(recompute) else None
    F = [c.forward for c in costs]
    again = _recompute_cycles(plan, module, phase, costs, S)  # per stage, when recomputed
    B = [c.backward + (again[s] if recompute[s] else 0.0) for s, c in enumerate(costs)]
    U = [c.update for c in costs]
    traffic = _traffic(plan, phase, S)
    sends = _sends(traffic, phase, where)
    system = where.system
    used = where.used_ipus()
    replica0 = tuple(where.ipu_id(0, i) for i in used)
    sync_cycles = external_sync_seconds(system, replica0, t) * clock if len(used) > 1 else 0.0

    def send_cycles(stage: int, kind: str) -> float:
        src = where.ipu_id(0, where.stage_ipus[stage])
        return max((transfer_seconds(system, src, where.ipu_id(0, dst), nbytes) * clock
                    for dst, nbytes in sends.get((stage, kind), {}).items()), default=0.0)

    slot_rows = []
    slot_total = 0.0
    for n, passes in enumerate(timeline):
        work: dict[int, float] = {}
        for s, _, kind in passes:
            ipu = where.stage_ipus[s]
            work[ipu] = work.get(ipu, 0.0) + (F[s] if kind == "F" else B[s])
        compute = max(work.values(), default=0.0)
        transfer = max((send_cycles(s, kind) for s, _, kind in passes), default=0.0)
        cycles = compute + transfer + sync_cycles
        slot_total += cycles
        if n < _TIMELINE_SLOTS:
            slot_rows.append({"slot": n, "cycles": round(cycles, 1), "compute": round(compute, 1),
                              "transfer": round(transfer, 1), "sync": round(sync_cycles, 1),
                              "passes": [[s, i, kind] for s, i, kind in passes]})
    per_ipu_update = {i: sum(U[s] for s in range(S) if where.stage_ipus[s] == i) for i in used}
    # Memory per IPU.
    views = _views(plan, where, traffic)
    stash, ckpt = _stash(plan, traffic, phase, S, T)
    state = _optimizer_state(plan, phase, S, T) if backward else [np.zeros(T)] * S
    shards = R if where.sharding and R > 1 else 1
    streaming = system.streaming_memory_bytes_per_s
    ipus = []
    profiles: dict[int, tuple[MemoryProfile, np.ndarray]] = {}
    offloaded: dict[int, float] = {}
    moved: dict[int, np.ndarray] = {}      # per IPU, per tile: the bytes offloaded
    offload_notes: list[str] = []
    for i in used:
        view = views[i]
        prof = profile_memory(plan, view=view, schedule=memory, recompute=rec)
        extra_bytes = np.zeros(T)
        held = np.zeros(T)
        for s in view.stages:
            if backward and k[s] > 1:
                extra_bytes += (k[s] - 1) * (ckpt[s] if recompute[s] else stash[s])
            held += state[s]
        total = prof.total + extra_bytes
        offload = held.sum() > 0 and streaming > 0 and (
            where.offload == "on" or (where.offload == "auto" and total.max() > t.sram_bytes_per_tile))
        if offload:
            # Off the IPU but during the weight update, when no activation or stash is live:
            # then its shard is streamed in beside what is always live, and back out.
            always = sum(prof.categories[c] for c in _ALWAYS_LIVE)
            total = np.maximum(prof.total - held + extra_bytes, always - held + held / shards)
            offloaded[i] = float(held.sum())
            stream = 2 * held.sum() / shards / streaming * clock
            per_ipu_update[i] = per_ipu_update[i] / shards + stream
            why = "as asked" if where.offload == "on" else "automatic: it does not fit otherwise"
            offload_notes.append(
                f"optimizer state of IPU {i}: {held.sum():,.0f} B in Streaming Memory ({why})"
                + (f", 1/{shards} of it on each replica" if shards > 1 else "")
                + f", streamed in and out at each weight update at "
                f"{streaming / 1e9:g} GB/s: {stream / clock * 1e3:.3f} ms")
        tile = int(np.argmax(total))
        profiles[i] = (prof, extra_bytes)
        off = held if offload else np.zeros(T)
        moved[i] = off
        ipus.append({
            "ipu": i, "ipu_id": where.ipu_id(0, i), "stages": list(view.stages),
            "peak_tile": tile, "peak_tile_bytes": int(math.ceil(total[tile])),
            "fits": bool(total[tile] <= t.sram_bytes_per_tile),
            "always_live_bytes": int(prof.always_live_bytes),
            "stash_bytes": int(round(extra_bytes.sum())),
            "optimizer_state_bytes": int(round(held.sum())),
            "offloaded_bytes": int(round(offloaded.get(i, 0.0))),
            "total_bytes": int(prof.always_live_bytes + prof.peak_not_always_live_bytes
                               + extra_bytes.sum()),
            "hlo_order_peak_tile_bytes": int(prof.hlo_order_peak_bytes + extra_bytes.max()),
            "bytes_by_category": {c: int(round(prof.categories[c].sum()
                                               + (extra_bytes.sum() if c == "activations" else 0)
                                               - (off.sum() if c == "variables" else 0)))
                                  for c in CATEGORIES},
            "at_peak_tile": {c: int(round(prof.categories[c][tile]
                                          + (extra_bytes[tile] if c == "activations" else 0)
                                          - (off[tile] if c == "variables" else 0)))
                             for c in CATEGORIES},
            "tile_bytes": [int(round(x)) for x in total],
        })
    if where.sharding and not offloaded:
        offload_notes.append("replicated_optimizer_state_sharding: nothing sharded, as no "
                             "optimizer state is offloaded" + (" (one replica)" if R == 1 else ""))
    update_cycles = max(per_ipu_update.values(), default=0.0) + max(
        (send_cycles(s, "U") for s in range(S)), default=0.0)
    # All-reduces: each IPU of a replica over the ring of that IPU in every replica.
    stage_var_bytes = [0.0] * S
    for b in plan.params:
        if b.kind == "variable":
            stage_var_bytes[min(stage_of(b.instr), S - 1)] += b.nbytes
    rings = {i: ring_over(system, where.holders(i), t) for i in used} if R > 1 else {}
    ar_update: dict[int, float] = {i: 0.0 for i in used}
    ar_mb: dict[int, float] = {i: 0.0 for i in used}
    ar_bytes_update = [0.0] * S
    ar_count = 0.0
    has_all_reduce = any(c.all_reduce_update or c.all_reduce_mb for c in costs)
    for s, c in enumerate(costs):
        ipu = where.stage_ipus[s]
        per_update = list(c.all_reduce_update)
        if R > 1 and not has_all_reduce and implied_all_reduce_bytes > 0 and sum(stage_var_bytes):
            per_update.append(implied_all_reduce_bytes * stage_var_bytes[s] / sum(stage_var_bytes))
        ar_bytes_update[s] = sum(per_update) + M * sum(c.all_reduce_mb)
        ar_count += len(per_update) + M * len(c.all_reduce_mb)
        if R > 1:
            ar_update[ipu] += sum(all_reduce_seconds(rings[ipu], R, nb) for nb in per_update) * clock
            ar_mb[ipu] += sum(all_reduce_seconds(rings[ipu], R, nb) for nb in c.all_reduce_mb) * clock
    all_reduce_update = max(ar_update.values(), default=0.0) + M * max(ar_mb.values(), default=0.0)
    per_update = slot_total + update_cycles + all_reduce_update
    updates = micro / M
    device = updates * (slot_total + update_cycles) + extra
    all_reduce = updates * all_reduce_update
    replica_sync = external_sync_seconds(system, where.ipu_ids, t) * clock if R > 1 else 0.0
    first_ipus = tuple(where.ipu_id(r, where.stage_ipus[0]) for r in range(R))
    load = host_link_load(Replication(R, system, first_ipus, t), plan.host_bytes_in,
                          plan.host_bytes_out, device_seconds=device / clock)  # prefetched
    host = load.seconds * clock

    worst = max(ipus, key=lambda d: d["peak_tile_bytes"])
    prof, extra_bytes = profiles[worst["ipu"]]
    tile = worst["peak_tile"]
    stage_names = {i.name: stage_of(i) for c in module.computations for i in c.instructions}
    contributors = []
    for c in prof.contributors:
        d = c.to_dict()
        d["stage"] = min(stage_names.get(c.name, 0), S - 1) if c.name in stage_names else -1
        contributors.append(d)
    for s in worst["stages"]:
        if backward and k[s] > 1:
            held = (k[s] - 1) * (ckpt[s] if recompute[s] else stash[s])[tile]
            if held:
                what = "input checkpoints" if recompute[s] else "stashed activations"
                contributors.append({"bytes": int(round(held)), "name": f"({what} of stage {s}: "
                                     f"{k[s] - 1} more micro-batch(es))", "opcode": "", "layer": "",
                                     "kind": "activations", "where": "", "stage": s})
    contributors.sort(key=lambda c: -c["bytes"])
    by_layer: dict[str, int] = {}
    for c in contributors:
        key = c["layer"] or f"({c['kind']})"
        by_layer[key] = by_layer.get(key, 0) + c["bytes"]
    layers_of: dict[int, list[str]] = {s: [] for s in range(S)}
    for c in module.computations:
        for instr in c.instructions:
            name = layer_name(instr)
            st = min(stage_of(instr), S - 1)
            if name and name not in layers_of[st]:
                layers_of[st].append(name)
    stage_rows = []
    for s in range(S):
        c = costs[s]
        sent = {kind: sum(sends.get((s, kind), {}).values()) for kind in ("F", "B")}
        stage_rows.append({
            "stage": s, "ipu": where.stage_ipus[s], "ipu_id": where.ipu_id(0, where.stage_ipus[s]),
            "forward_cycles": round(c.forward, 1), "backward_cycles": round(c.backward, 1),
            "recompute_cycles": round(again[s] if recompute[s] else 0.0, 1),
            "update_cycles": round(c.update, 1), "in_flight": int(k[s]),
            "recomputation": bool(recompute[s]),
            "stash_bytes": int(round(stash[s].sum())), "checkpoint_bytes": int(round(ckpt[s].sum())),
            "sends_forward_bytes": int(sent["F"]), "sends_backward_bytes": int(sent["B"]),
            "all_reduce_bytes": int(round(ar_bytes_update[s])),
            "layers": layers_of[s][:40],
        })
    transfers = []
    for (s, kind), dsts in sorted(sends.items()):
        for dst, nbytes in sorted(dsts.items()):
            a, b = where.ipu_id(0, where.stage_ipus[s]), where.ipu_id(0, dst)
            transfers.append({"stage": s, "phase": kind, "from_ipu": where.stage_ipus[s], "to_ipu": dst,
                              "path": list(system.path(a, b)), "bytes": int(nbytes),
                              "seconds": transfer_seconds(system, a, b, nbytes)})
    return {
        "profile": prof, "orders": {d["ipu"]: profiles[d["ipu"]][0].order for d in ipus},
        "device_cycles": device, "all_reduce_cycles": all_reduce, "replica_sync_cycles": replica_sync,
        "host_cycles": host, "host_link": load.to_dict(), "per_update_cycles": per_update,
        "updates_per_call": updates, "micro_batches_per_call": micro,
        "ipus": ipus, "peak_ipu": worst["ipu"], "peak_tile": tile,
        "peak_tile_bytes": worst["peak_tile_bytes"], "fits": all(d["fits"] for d in ipus),
        "hlo_order_peak_tile_bytes": max(d["hlo_order_peak_tile_bytes"] for d in ipus),
        "memory": {c: [int(round(x + (extra_bytes[n] if c == "activations" else 0.0)
                                 - (moved[worst["ipu"]][n] if c == "variables" else 0.0)))
                       for n, x in enumerate(prof.categories[c])] for c in CATEGORIES},
        "offloaded_bytes": int(round(sum(offloaded.values()))),
        "offload_notes": offload_notes,
        "optimizer_state_shards": shards,
        "contributors": contributors, "by_layer": sorted(([n, b] for n, b in by_layer.items()),
                                                         key=lambda kv: -kv[1]),
        "always_live_bytes": sum(d["always_live_bytes"] for d in ipus),
        "total_bytes": sum(d["total_bytes"] for d in ipus),
        "stages": stage_rows, "timeline": slot_rows, "transfers": transfers,
        "truncated": len(timeline) > _TIMELINE_SLOTS,
        "all_reduces": int(round(updates * ar_count)) if R > 1 else 0,   # per call
        "all_reduces_per_update": int(round(ar_count)) if R > 1 else 0,  # each replica's
        "per_update_all_reduces": sorted(set().union(*(c.per_update_names for c in costs))),
        "all_reduce_bytes": int(round(updates * sum(ar_bytes_update))) if R > 1 else 0,
        "rings": {str(i): r.to_dict() for i, r in rings.items()},
    }
