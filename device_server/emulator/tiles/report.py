"""The estimate of one program on one IPU preset, built from its tile plan and memory profile.

    plan_module (planner.py) + profile_memory (memory.py) --> Estimate
      .cycles / .seconds / .latency_s / .throughput      per call (one step, or N in a loop)
      .peak_tile_bytes / .tile_bytes_limit / .fits        the fullest tile against its SRAM
      .within_margin / .margin_bytes / .refused           over it, within MEMORY_MARGIN or not
      .to_dict() / .to_json() / .save_html(path)          the report (html.py renders it)
      .oom_message()                                       Poplar's out-of-memory message

Cycles are device cycles (supersteps: compute + sync + exchange, slowest tile each) plus the
host transfers of streamed arguments and results, converted at the preset's clock, so that
``seconds == cycles / clock_hz``; ``device_cycles`` leaves the host link out.

A replicated program (``replicas`` > 1, ``replication.py``) is the program of one replica:
memory, cycles and time are those of each IPU (every replica runs the same program at once),
with its all-reduces over the IPU-Links (``all_reduce_cycles``), the replicas' syncs
(``replica_sync_cycles``) and its share of the system's host links added, serially:

    cycles = device_cycles + all_reduce_cycles + replica_sync_cycles + host_cycles
    throughput = replicas x items_per_call / seconds   (items_per_call: per replica)

Verdicts (docs/tile_model.md, "Memory per tile"): ``fits`` is ``peak_tile_bytes <=
tile_bytes_limit``, nothing else. Over it by at most ``MEMORY_MARGIN`` of the tile
(``margin_bytes``) is ``within_margin``: compile goes on with a warning, as the model's error
may be that large; beyond it the program is ``refused`` (OutOfMemoryError at compile). When
the tile model itself fails, ``estimate_module`` raises :class:`TileModelError` naming the
instruction, or (``on_failure="report"``, as compile asks) returns an estimate whose ``fits``
is None, with no figures and the failure in ``failure`` and ``notes``.
"""

from __future__ import annotations

import json
import logging
import math
import typing
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from device_server.emulator import calibration
from device_server.emulator.arch import Target
from device_server.emulator.cancel import RunStopped
from device_server.emulator.errors import TileModelError, describe, layer_of
from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles.irinfo import stage_of
from device_server.emulator.tiles.mapping import (
    TileMapping,
    check_variable_mapping,
    variable_mappings,
)
from device_server.emulator.tiles.memory import (
    CATEGORIES,
    MemoryProfile,
    liveness_trace,
    memory_schedule,
    profile_memory,
)
from device_server.emulator.tiles.pipeline import (
    PIPELINE_ASSUMPTIONS,
    Placement,
    estimate_pipeline,
    phases,
    placement,
    recomputed_instructions,
    stage_groups,
)
from device_server.emulator.tiles.plan import ModulePlan, Step
from device_server.emulator.tiles.planner import plan_module
from device_server.emulator.tiles.proportions import StageProportions
from device_server.emulator.tiles.recompute import Recomputation, again_cycles, checkpoint_makers
from device_server.emulator.tiles.replication import (
    GCL_STEP_OVERHEAD_S,
    host_link_load,
    replication,
)
from device_server.emulator.tiles.state import LiveFn
from device_server.protocol import ir_pb2

__all__ = ["ASSUMPTIONS", "MEMORY_MARGIN", "Estimate", "TileModelError", "estimate_module",
           "estimate_plan"]

#: The one margin allowed for the tile model's error in memory, as a share of a tile's SRAM,
#: declared before the verdicts were scored (docs/tile_model.md, "Memory per tile"): a program
#: whose fullest tile is over its SRAM by at most this much still compiles and runs, with a
#: warning; it does not *fit* (``Estimate.fits`` is False, ``within_margin`` True).
MEMORY_MARGIN = 0.05

ASSUMPTIONS = (
    "BSP: every superstep is exchange, sync, compute; each phase costs as much as its slowest tile",
    "dot/convolution: the fastest split over tiles found by a search (AMP rate, operands rounded "
    "up to the AMP's channel groups; serial passes when temporaries exceed "
    "available_memory_proportion of a tile)",
    "element-wise ops follow their operands' mapping; single-use chains on one mapping are fused "
    "into one compute set and their intermediates are not stored",
    "compute: up to 6 workers per tile share its issue slots (fewer pieces of work run slower); "
    "per tile the larger of arithmetic at the unit's rate and memory traffic at its bandwidth",
    "exchange: busiest tile's bytes in or out at the exchange rate plus a fixed overhead; one "
    "send reaches every tile that needs the data",
    "reductions: local reduction, then partials exchanged to the owners (two stages above 32 "
    "contributing tiles per result)",
    "memory: variables, arguments, constants, code and vertex state always live; tensors live "
    "from definition to last use; instruction temporaries at their point only",
    "updated variables are written in place; host transfers (arguments in, non-variable results "
    "out) are not overlapped with compute",
    "tensors are laid out linearly with at least min_bytes_per_tile per tile",
    "schedule: each computation's instructions run in the order of least peak memory found by "
    "list schedulers (reverse and forward, a depth-first order) or HLO order; the schedule "
    "changes memory only: a superstep costs the same wherever it runs",
)

# Added to the assumptions of a replicated program's estimate.
REPLICA_ASSUMPTIONS = (
    "replicas: the program is one replica's; memory and time are per IPU, every replica "
    "running the same program at once",
    "all-reduce: one unidirectional ring over the replicas' IPUs, the faster of ascending id "
    "order and the ladder's (even ids up, odd ids down), "
    "2 (R - 1) steps of B / R bytes at the slowest ring arrow's bandwidth (a path of several "
    "hops at its slowest hop's, shared evenly by the arrows crossing it the same way), each "
    "step paying its path's hop latencies, the external sync and "
    f"{GCL_STEP_OVERHEAD_S * 1e6:g} us of GCL step overhead (assumption); its additions are hidden "
    "under the transfers",
    "replica sync: one external sync per call and per trip of a loop of the entry computation "
    "(the device loop): on-chip sync plus the round trip of the longest hop path between replicas",
    "host links: replicas sharing a host link share its bandwidth; a call waits for the most "
    "loaded one",
    "all-reduces, replica syncs and host transfers are serial with compute (nothing overlaps them)",
)
# Added when the replicas span several Pod64s (their all-reduce crosses GW-Links).
POD_ASSUMPTIONS = (
    "replicas across Pod64s: GCL's hierarchical all-reduce, a reduce-scatter on each pod's "
    "IPU-Link ring, the shards all-reduced across the pods over the GW-Links (syncless), an "
    "all-gather on each pod's ring; the GW-Link stage moves 2 (P - 1) / P x B bytes per pod at "
    "its replicas' share of their machines' GW-Link bandwidth (hardware.py's named figures), "
    "paying a GW-Link latency and the GCL step overhead per step",
)

_log = logging.getLogger(__name__)
_TIMELINE_LIMIT = 1500
_TOP_OPS = 40


@dataclass
class Estimate:
    """Cycles, time and memory of one call of a program on a target (see module docstring)."""

    ipu_version: str
    tiles_per_ipu: int
    clock_hz: float
    cycles: int
    seconds: float
    peak_tile_bytes: int
    tile_bytes_limit: int
    total_bytes: int
    # peak_tile_bytes <= tile_bytes_limit; None: unknown (the tile model failed: ``failure``).
    fits: bool | None
    target: str = ""
    always_live_bytes: int = 0
    peak_temporary_bytes: int = 0
    flops: float = 0.0
    supersteps: int = 0
    per_iteration_loops: int = 0
    assumptions: tuple[str, ...] = ASSUMPTIONS
    largest_arrays: list[str] = field(default_factory=list)
    program: str = ""
    device_cycles: int = 0
    compute_cycles: int = 0
    exchange_cycles: int = 0
    sync_cycles: int = 0
    host_cycles: int = 0
    host_bytes_in: int = 0
    host_bytes_out: int = 0
    peak_tile: int = 0
    items_per_call: int = 0
    preset: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, list[int]] = field(default_factory=dict)
    contributors: list[dict[str, Any]] = field(default_factory=list)
    by_layer: list[list[Any]] = field(default_factory=list)
    top_ops: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    loops: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The calibration classes with >= 10% of the cycles, with their held-out error (None:
    # uncalibrated); device_server/emulator/calibration.py, docs/tile_model.md "Calibration".
    expected_error: list[dict[str, Any]] = field(default_factory=list)
    sweep: list[dict[str, Any]] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)
    # Replication (docs/tile_model.md, "Replicas and collectives"): the figures above are
    # those of one replica = one IPU; these say how many run and what joins them.
    replicas: int = 1
    system: str = ""                     # the system's name ("" without one)
    ipu_ids: list[int] = field(default_factory=list)   # the replicas' IPUs, one each
    all_reduce_cycles: int = 0           # every all-reduce of the call, over the IPU-Links
    all_reduce_bytes: int = 0            # bytes each replica puts into them per call
    all_reduces: int = 0                 # all-reduces executed per call (loops counted)
    replica_sync_cycles: int = 0         # syncs across the replicas' IPUs
    replica_syncs: int = 0               # syncs per call (1 + device-loop trips)
    collectives: list[dict[str, Any]] = field(default_factory=list)  # each all-reduce
    ring: dict[str, Any] = field(default_factory=dict)       # Ring.to_dict()
    host_link: dict[str, Any] = field(default_factory=dict)  # the most loaded host link
    # The schedule (docs/tile_model.md, "The schedule"): the memory figures above are those of
    # the memory-aware order of every computation; these are HLO emission order's.
    memory_order: str = ""               # "scheduled", or "hlo" where that was no worse
    hlo_order_peak_tile_bytes: int = 0   # the fullest tile in HLO order
    hlo_order_peak_tile: int = 0
    schedulers: dict[str, int] = field(default_factory=dict)  # computations by winning order
    # Pipelines (docs/tile_model.md, "Pipelines"): one replica spans ipus_per_replica IPUs;
    # peak_tile / peak_tile_bytes / memory / contributors above are the fullest IPU's
    # (peak_ipu); cycles are the pipeline's; compute/exchange/sync_cycles the stages' work.
    pipeline_stages: int = 1
    pipeline_schedule: str = ""          # "grouped", "interleaved", "sequential"
    micro_batches: int = 1               # per weight update
    recomputation: bool = False
    ipus_per_replica: int = 1
    stage_ipus: list[int] = field(default_factory=list)       # per stage: IPU of the replica
    micro_batches_per_call: int = 0
    weight_updates_per_call: float = 0.0
    pipeline_cycles_per_update: int = 0  # ramp-up + steady state + ramp-down + update
    # A pipeline's all-reduces per weight update (each replica, every stage's gradients):
    # all_reduces = this x weight_updates_per_call, rounded (0 for a one-micro-batch call).
    all_reduces_per_update: int = 0
    peak_ipu: int = 0                    # the replica's IPU with the fullest tile
    stages: list[dict[str, Any]] = field(default_factory=list)   # per stage: cycles, stash, ...
    ipus: list[dict[str, Any]] = field(default_factory=list)     # per IPU: memory, stages
    pipeline_timeline: list[dict[str, Any]] = field(default_factory=list)  # slots x passes
    pipeline_transfers: list[dict[str, Any]] = field(default_factory=list)
    # Verdicts (module docstring): the margin allowed beside ``fits``, and a failure.
    within_margin: bool = False          # over tile_bytes_limit by at most margin_bytes
    margin_bytes: int = 0                # MEMORY_MARGIN of a tile's SRAM, in bytes
    failure: str = ""                    # the tile model's failure (then fits is None)
    # tf_ipu.max_batch_size's table (largest micro-batch per option), for the HTML report.
    max_batch: dict[str, Any] = field(default_factory=dict)
    # The liveness view (docs/tile_model.md, "Memory per tile"): the fullest tile's bytes at
    # every program point of the entry computation ({} when not made); see ``_liveness``.
    liveness: dict[str, Any] = field(default_factory=dict)

    # -- verdicts -------------------------------------------------------------------------
    @property
    def fit_known(self) -> bool:
        """False when the tile model failed and nothing was counted (``fits`` is None)."""
        return self.fits is not None

    @property
    def over_bytes(self) -> int:
        """Bytes of the fullest tile beyond its SRAM (0 when it fits or is unknown)."""
        return max(0, self.peak_tile_bytes - self.tile_bytes_limit) if self.fit_known else 0

    @property
    def refused(self) -> bool:
        """True when compile refuses the program (OutOfMemoryError unless allow_out_of_memory):
        over the tile's SRAM by more than the margin. Unknown fits are never refused."""
        return self.fits is False and not self.within_margin

    def where_peak(self) -> str:
        """"tile 12" or, pipelined, "tile 12 of IPU 1 (IPU id 1, pipeline stage 1)"."""
        if self.pipeline_stages <= 1:
            return f"tile {self.peak_tile}"
        row = next((d for d in self.ipus if d.get("ipu") == self.peak_ipu), {})
        stages = row.get("stages", [])
        return (f"tile {self.peak_tile} of IPU {self.peak_ipu} (IPU id {row.get('ipu_id', self.peak_ipu)}"
                + (f", pipeline stage{'s' if len(stages) != 1 else ''} "
                   f"{', '.join(map(str, stages))}" if stages else "") + ")")

    def margin_message(self) -> str:
        """The warning of a program over capacity within the margin ("" otherwise)."""
        if not self.within_margin:
            return ""
        return (f"{self.program or 'the program'}: over tile memory within the tile model's "
                f"{MEMORY_MARGIN:.0%} margin: {self.where_peak()} holds {self.peak_tile_bytes:,} B, "
                f"{self.over_bytes:,} B over its {self.tile_bytes_limit:,} B ({self.target}; the "
                f"margin allows {self.margin_bytes:,} B). It compiles and runs here; on an IPU it "
                "may not fit.")

    # -- derived figures ------------------------------------------------------------------
    @property
    def latency_s(self) -> float:
        """Seconds per call (one step unless the program loops over several)."""
        return self.seconds

    @property
    def throughput(self) -> float:
        """Items per second of all replicas (``replicas x items_per_call / seconds``, items
        per call counted per replica); calls per second when the number of items per call
        is unknown (a call runs every replica once)."""
        if self.seconds <= 0:
            return 0.0
        if not self.items_per_call:
            return 1.0 / self.seconds
        return max(1, self.replicas) * self.items_per_call / self.seconds

    @property
    def all_reduce_share(self) -> float:
        """The all-reduces' share of the call's cycles (0..1)."""
        return self.all_reduce_cycles / self.cycles if self.cycles > 0 else 0.0

    @property
    def all_reduce_links(self) -> list[str]:
        """The kinds of link the all-reduces cross: ``["IPU-Links"]``, or ``["IPU-Links",
        "GW-Links"]`` when the replicas span several Pod64s; [] without replicas."""
        if not self.ring:
            return []
        return list(self.ring.get("links", ["IPU-Links"]))

    @property
    def all_reduce_gw_cycles(self) -> float:
        """The all-reduces' cycles on the GW-Links between Pod64s (0 within one pod):
        2 (P - 1) / P x all_reduce_bytes / the ring's GW-Link bytes/s + 2 (P - 1) GW steps per
        all-reduce (replication.all_reduce_parts; for a pipeline, every stage's bytes on the
        first stage IPU's ring: an upper bound; its all-reduces per call are
        ``all_reduces_per_update`` x ``weight_updates_per_call``), at most ``all_reduce_cycles``."""
        gw = self.ring.get("gw") if self.ring else None
        count = (self.all_reduces_per_update * self.weight_updates_per_call
                 if self.all_reduces_per_update else float(self.all_reduces))
        if not gw or not count:
            return 0.0
        p = len(gw["pods"])
        seconds = (2 * (p - 1) / p * self.all_reduce_bytes / gw["bytes_per_s"]
                   + count * 2 * (p - 1) * gw["step_latency_s"])
        return min(float(self.all_reduce_cycles), seconds * self.clock_hz)

    @property
    def device_seconds(self) -> float:
        """Seconds on the device alone (no host transfers)."""
        return self.device_cycles / self.clock_hz

    @property
    def efficiency(self) -> float:
        """FLOPs over the preset's FP16 AMP peak for the same time (0..1)."""
        peak = self.preset.get("amp_fp16_flops_per_cycle_per_tile", 0) * self.tiles_per_ipu
        return self.flops / (peak * self.device_cycles) if peak and self.device_cycles else 0.0

    # -- output -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able), with the derived figures."""
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        d["latency_s"] = self.latency_s
        d["throughput"] = self.throughput
        d["device_seconds"] = self.device_seconds
        d["all_reduce_share"] = self.all_reduce_share
        d["all_reduce_links"] = self.all_reduce_links
        d["all_reduce_gw_cycles"] = self.all_reduce_gw_cycles
        return d

    def to_json(self, indent: int | None = None) -> str:
        """The report as JSON."""
        return json.dumps(self.to_dict(), indent=indent, default=_jsonable)

    @classmethod
    def from_dict(cls, d: Any) -> Estimate:
        """The estimate that ``to_dict`` (or ``dataclasses.asdict``) described, e.g. read
        back from the executable cache on disk. Every field must be there with a value of
        its declared kind (JSON's: a tuple field may come as a list, a float as an int); the
        derived figures (``latency_s``, ...) are ignored.

        Raises:
            ValueError: naming the first field that is missing, unknown or of a wrong kind.
        """
        if not isinstance(d, dict):
            raise ValueError(f"an estimate must be a JSON object. Received: {type(d).__name__}")
        hints = _field_kinds()
        unknown = sorted(set(d) - set(hints) - set(_DERIVED))
        if unknown:
            raise ValueError(f"estimate: unknown fields {unknown[:5]}")
        values: dict[str, Any] = {}
        for name, kind in hints.items():
            if name not in d:
                raise ValueError(f"estimate: field {name!r} is missing")
            v = d[name]
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if not any(_of_kind(v, k) for k in kinds):
                spelled = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"estimate: field {name!r} must be {spelled}, "
                                 f"received {type(v).__name__}")
            values[name] = tuple(v) if kind is tuple else v  # an int float stays as it was
        return cls(**values)

    def save_html(self, path: str) -> str:
        """Writes the self-contained HTML report to ``path``; returns the path."""
        from device_server.emulator.tiles.html import save_html

        return save_html(self.to_dict(), path)

    def __repr__(self) -> str:
        """One line (the dataclass's own repr would print every per-tile array)."""
        return f"<Estimate {self.summary()}>"

    def _repr_html_(self) -> str:
        """The HTML report, for notebooks (Jupyter displays it in place of the repr)."""
        from device_server.emulator.tiles.html import render_html

        return render_html(self.to_dict())

    def summary(self) -> str:
        """One line: time, throughput, memory (and the replicas with their all-reduces)."""
        if self.fits is None:
            return (f"{self.program or 'program'} on {self.target}: no estimate, fit unknown "
                    f"({self.failure or 'the tile model failed'})")
        items = f", {self.throughput:,.1f} items/s" if self.items_per_call else ""
        replicas = ""
        if self.replicas > 1:
            replicas = (f" x {self.replicas} replicas on {self.system} IPUs "
                        f"{_ids_text(self.ipu_ids)} (per IPU below)")
            if self.all_reduces or self.all_reduces_per_update:
                replicas += (f"; all-reduce {self.all_reduce_bytes:,} B per replica, "
                             f"{self.all_reduce_cycles / self.clock_hz * 1e3:.3f} ms = "
                             f"{self.all_reduce_share:.1%} of the call, over "
                             f"{' and '.join(self.all_reduce_links)}")
                if self.all_reduce_gw_cycles:
                    replicas += (f" ({self.all_reduce_gw_cycles / self.clock_hz * 1e3:.3f} ms on "
                                 f"the GW-Links between {len(self.ring['gw']['pods'])} Pod64s)")
        if self.pipeline_stages > 1:
            replicas += (f", {self.pipeline_stages}-stage {self.pipeline_schedule} pipeline over "
                         f"{self.ipus_per_replica} IPUs, {self.micro_batches} micro-batch(es) per "
                         f"update (memory of IPU {self.peak_ipu} below)")
        return (f"{self.program or 'program'} on {self.target}{replicas}: {self.cycles:,} "
                f"cycles = {self.seconds * 1e3:.3f} ms{items}; peak tile {self.peak_tile} "
                f"{self.peak_tile_bytes:,} B of {self.tile_bytes_limit:,} B"
                f"{verdict_text(self)}")

    def oom_message(self, top: int = 6) -> str:
        """Poplar-style out-of-memory message naming the tile, the bytes, the limit, and the
        largest tensors and Keras layers on that tile."""
        where = ""
        if self.pipeline_stages > 1:
            row = next((d for d in self.ipus if d.get("ipu") == self.peak_ipu), {})
            stages = row.get("stages", [])
            where = (f" IPU {self.peak_ipu} of the replica (IPU id {row.get('ipu_id', self.peak_ipu)}, "
                     f"pipeline stage{'s' if len(stages) != 1 else ''} "
                     f"{', '.join(map(str, stages))}),")
        lines = [
            f"Out of memory on{where} tile {self.peak_tile}: {self.peak_tile_bytes} bytes used but "
            f"tiles only have {self.tile_bytes_limit} bytes ({self.target}, "
            f"{self.tiles_per_ipu} tiles)."
        ]
        items = []
        for c in self.contributors[:top]:
            layer = f", Keras layer '{c['layer']}'" if c.get("layer") else ""
            if self.pipeline_stages > 1 and c.get("stage", -1) >= 0:
                layer = f", stage {c['stage']}{layer}"
            op = f" ({c['opcode']})" if c.get("opcode") else ""
            items.append(f"'{c['name']}'{op} {c['bytes']:,} B [{c['kind']}{layer}]")
        if items:
            lines.append(f"Largest on tile {self.peak_tile}: " + "; ".join(items) + ".")
        if self.by_layer:
            layers = "; ".join(f"{name} {nbytes:,} B" for name, nbytes in self.by_layer[:top])
            lines.append(f"By Keras layer on tile {self.peak_tile}: {layers}.")
        if self.pipeline_stages > 1:
            over = [f"IPU {d['ipu']} (stages {', '.join(map(str, d['stages']))}) "
                    f"{d['peak_tile_bytes']:,} B on tile {d['peak_tile']}"
                    for d in self.ipus if not d.get("fits", True)]
            lines.append("Over the limit: " + "; ".join(over) + ".")
        if self.margin_bytes:
            lines.append(f"{self.over_bytes:,} B over is {'within' if self.within_margin else 'beyond'}"
                         f" the tile model's {MEMORY_MARGIN:.0%} margin ({self.margin_bytes:,} B).")
        lines.append(f"In all: {self.total_bytes:,} bytes on {self.tiles_per_ipu} tiles "
                     f"{'of every IPU ' if self.pipeline_stages > 1 else ''}"
                     f"({self.always_live_bytes:,} always live). Set allow_out_of_memory to "
                     "compile anyway and inspect the report.")
        return " ".join(lines)


_DERIVED = ("latency_s", "throughput", "device_seconds", "all_reduce_share", "all_reduce_links",
            "all_reduce_gw_cycles")  # to_dict's computed figures


def _ids_text(ids: Any) -> str:
    """IPU ids, runs of consecutive ids as ``a-b`` (``0-63,128``)."""
    out: list[str] = []
    ids = [int(i) for i in ids]
    start = 0
    for n in range(1, len(ids) + 1):
        if n == len(ids) or ids[n] != ids[n - 1] + 1:
            run = ids[start:n]
            out.append(",".join(map(str, run)) if len(run) < 3 else f"{run[0]}-{run[-1]}")
            start = n
    return ",".join(out)


def _of_kind(v: Any, kind: type) -> bool:
    """Whether ``v`` (read from JSON) is a value of a field of type ``kind``."""
    if kind is bool:
        return isinstance(v, bool)
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind in (list, tuple):
        return isinstance(v, (list, tuple))
    return isinstance(v, kind)


def verdict_text(est: Any) -> str:
    """" (DOES NOT FIT)", " (over by N B, within the 5% margin)", " (fit unknown: ...)" or ""
    for an Estimate (or anything with its verdict fields)."""
    if est.fits is None:
        return " (FIT UNKNOWN: the tile model failed)"
    if est.fits:
        return ""
    if getattr(est, "within_margin", False):
        over = est.peak_tile_bytes - est.tile_bytes_limit
        return f" (DOES NOT FIT: {over:,} B over, within the {MEMORY_MARGIN:.0%} margin)"
    return " (DOES NOT FIT)"


def _field_kinds() -> dict[str, type | tuple[type, ...]]:
    """Each field of ``Estimate`` and the Python type of its values (``list[str]`` -> list;
    ``bool | None`` -> (bool, NoneType))."""
    hints = typing.get_type_hints(Estimate)
    out: dict[str, type | tuple[type, ...]] = {}
    for f in fields(Estimate):
        hint = hints[f.name]
        args = typing.get_args(hint)
        if type(None) in args:  # an optional scalar
            out[f.name] = tuple(typing.get_origin(a) or a for a in args)
        else:
            out[f.name] = typing.get_origin(hint) or hint
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


# ------------------------------------------------------------------------------ assembly


def _walk(steps: Iterable[Step], mult: int, out: list[dict[str, Any]],
          agg: dict[str, dict[str, Any]], depth: int = 0) -> None:
    for s in steps:
        reps = s.repeat * mult
        own = s.compute + s.exchange + s.sync + s.link
        if s.kind in ("loop", "call"):
            if s.kind == "loop":
                out.append({"kind": "loop", "name": s.name, "layer": s.layer, "trips": s.repeat,
                            "depth": depth})
            for child in s.children:
                _walk(child.steps, reps, out, agg, depth + 1)
            if own <= 0:
                continue
        members = s.ew.members if s.ew is not None else 1
        out.append({"kind": s.kind, "name": s.name, "opcode": s.opcode, "layer": s.layer,
                    "compute": round(s.compute, 1), "exchange": round(s.exchange, 1),
                    "sync": round(s.sync, 1), "link": round(s.link, 1), "repeat": reps,
                    "tiles": s.tiles, "depth": depth, "fused": members})
        a = agg.get(s.name)
        if a is None:
            a = agg[s.name] = {"name": s.name, "opcode": s.opcode, "layer": s.layer, "kind": s.kind,
                               "cycles": 0.0, "compute": 0.0, "exchange": 0.0, "sync": 0.0,
                               "link": 0.0, "supersteps": 0, "flops": 0.0, "tiles": s.tiles,
                               "fused": members}
        a["cycles"] += own * reps
        a["compute"] += s.compute * reps
        a["exchange"] += s.exchange * reps
        a["sync"] += s.sync * reps
        a["link"] += s.link * reps
        a["supersteps"] += reps
        a["flops"] += s.flops * reps


def _cap_timeline(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most ``_TIMELINE_LIMIT`` entries: runs of consecutive supersteps are merged evenly."""
    steps = [e for e in entries if e["kind"] != "loop"]
    if len(steps) <= _TIMELINE_LIMIT:
        return entries
    per = math.ceil(len(steps) / _TIMELINE_LIMIT)
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []

    def flush() -> None:
        if not run:
            return
        first = run[0]
        merged = {**first, "repeat": 1, "fused": sum(e.get("fused", 1) for e in run)}
        for k in ("compute", "exchange", "sync", "link"):
            merged[k] = round(sum(e.get(k, 0.0) * e.get("repeat", 1) for e in run), 1)
        if len(run) > 1:
            merged["name"] = f"{first['name']} (+{len(run) - 1} more)"
            merged["kind"] = "merged"
        out.append(merged)
        run.clear()

    for e in entries:
        if e["kind"] == "loop":
            flush()
            out.append(e)
            continue
        run.append(e)
        if len(run) >= per:
            flush()
    flush()
    return out


@dataclass
class PipelineRun:
    """What ``estimate_plan`` needs to size a pipelined plan (``estimate_module`` makes it)."""

    module: ir_pb2.Module
    where: Placement
    implied_all_reduce_bytes: int = 0


def estimate_plan(plan: ModulePlan, program: str = "", pipeline: PipelineRun | None = None,
                  recompute: Recomputation | None = None,
                  module: ir_pb2.Module | None = None) -> Estimate:
    """The :class:`Estimate` of a planned module (pipelined: ``pipeline``, pipeline.py; a
    program that is not, recomputed as ``recompute`` says: ``recomputation_of``). ``module``
    (the planned one, optional) names the forward, backward and update phases of the
    liveness view's points."""
    t: Target = plan.target
    pipe: dict[str, Any] = {}
    again = 0.0
    if pipeline is None:
        mem: MemoryProfile = profile_memory(plan, recompute=recompute)
        if recompute is not None:
            again = again_cycles(plan.entry.steps, recompute.again)
    else:
        order = memory_schedule(plan, group=stage_groups(pipeline.module, pipeline.where.stages))
        pipe = estimate_pipeline(plan, pipeline.module, pipeline.where, order,
                                 pipeline.implied_all_reduce_bytes)
        mem = pipe["profile"]
    compute, exchange, sync, _ = plan.entry.totals()
    compute += again  # what recomputation runs again (forward work: counted as compute)
    device = int(math.ceil(compute + exchange + sync))
    rep = plan.replication
    if rep is None:
        host_s = cyc.host_seconds(t, plan.host_bytes_in, plan.host_bytes_out)
        host_link: dict[str, Any] = {}
    else:
        load = host_link_load(rep, plan.host_bytes_in, plan.host_bytes_out,
                              device_seconds=device / t.clock_hz)  # prefetched
        host_s, host_link = load.seconds, load.to_dict()
    host_cycles = int(math.ceil(host_s * t.clock_hz))
    links = plan.entry.link_totals()
    ar_cycles, ar_bytes, ar_count = links.get("all-reduce", [0.0, 0.0, 0.0])
    sync_cycles, _, syncs = links.get("replica-sync", [0.0, 0.0, 0.0])
    all_reduce_cycles = int(math.ceil(ar_cycles))
    replica_sync_cycles = int(math.ceil(sync_cycles))
    total_cycles = device + all_reduce_cycles + replica_sync_cycles + host_cycles
    timeline: list[dict[str, Any]] = []
    agg: dict[str, dict[str, Any]] = {}
    _walk(plan.entry.steps, 1, timeline, agg)
    top = sorted(agg.values(), key=lambda a: -a["cycles"])
    for a in top:
        for k in ("cycles", "compute", "exchange", "sync", "link"):
            a[k] = round(a[k], 1)
    layers: dict[str, dict[str, Any]] = {}
    for a in top:
        key = a["layer"] or "(no layer)"
        L = layers.setdefault(key, {"layer": key, "cycles": 0.0, "flops": 0.0, "supersteps": 0})
        L["cycles"] += a["cycles"]
        L["flops"] += a["flops"]
        L["supersteps"] += a["supersteps"]
    assumptions = list(ASSUMPTIONS)
    if pipeline is not None:
        assumptions.extend(PIPELINE_ASSUMPTIONS)
    unknown = sum(1 for lp in plan.loops if lp["kind"] == "unknown")
    for lp in plan.loops:
        if lp["note"]:
            assumptions.append(lp["note"])
    if rep is not None and rep.replicated:
        assumptions.extend(REPLICA_ASSUMPTIONS)
        if rep.ring is not None and rep.ring.gw is not None:
            assumptions.extend(POD_ASSUMPTIONS)
    collectives = [{**c, "executions": int(agg[c["name"]]["supersteps"]) if c["name"] in agg else 0}
                   for c in plan.collectives]
    peak_not_always = mem.peak_not_always_live_bytes
    contributors = [c.to_dict() for c in mem.contributors]
    est = Estimate(
        ipu_version=t.ipu_version,
        tiles_per_ipu=t.tiles_per_ipu,
        clock_hz=t.clock_hz,
        cycles=total_cycles,
        seconds=total_cycles / t.clock_hz,
        peak_tile_bytes=mem.peak_bytes,
        tile_bytes_limit=t.sram_bytes_per_tile,
        total_bytes=int(mem.always_live_bytes + peak_not_always),
        fits=mem.peak_bytes <= t.sram_bytes_per_tile,
        target=f"{t.product} ({t.name})",
        always_live_bytes=int(mem.always_live_bytes),
        peak_temporary_bytes=int(peak_not_always),
        flops=float(plan.flops),
        supersteps=int(plan.entry.supersteps()),
        per_iteration_loops=unknown,
        assumptions=tuple(assumptions),
        largest_arrays=[f"{c.bytes} B on tile {mem.peak_tile} for '{c.name}'"
                        + (f" (Keras layer '{c.layer}')" if c.layer else "")
                        for c in mem.contributors[:10]],
        program=program,
        device_cycles=device,
        compute_cycles=int(round(compute)),
        exchange_cycles=int(round(exchange)),
        sync_cycles=int(round(sync)),
        host_cycles=host_cycles,
        host_bytes_in=plan.host_bytes_in,
        host_bytes_out=plan.host_bytes_out,
        peak_tile=mem.peak_tile,
        preset=t.to_dict(),
        memory={c: [int(round(x)) for x in mem.categories[c]] for c in CATEGORIES},
        contributors=contributors,
        by_layer=[[name, int(b)] for name, b in mem.by_layer()],
        top_ops=top[:_TOP_OPS],
        layers=sorted(({**v, "cycles": round(v["cycles"], 1)} for v in layers.values()),
                      key=lambda v: -v["cycles"]),
        timeline=_cap_timeline(timeline),
        loops=plan.loops,
        notes=plan.notes,
        replicas=rep.replicas if rep is not None else 1,
        system=rep.system.name if rep is not None and rep.system is not None else "",
        ipu_ids=list(rep.ipu_ids) if rep is not None else [],
        all_reduce_cycles=all_reduce_cycles,
        all_reduce_bytes=int(round(ar_bytes)),
        all_reduces=int(round(ar_count)),
        replica_sync_cycles=replica_sync_cycles,
        replica_syncs=int(round(syncs)),
        collectives=collectives,
        ring=rep.ring.to_dict() if rep is not None and rep.ring is not None else {},
        host_link=host_link,
        memory_order=mem.order,
        hlo_order_peak_tile_bytes=mem.hlo_order_peak_bytes,
        hlo_order_peak_tile=mem.hlo_order_peak_tile,
        schedulers=dict(mem.schedulers),
    )
    if pipeline is not None:
        _apply_pipeline(est, pipe, pipeline.where, t)
    est.liveness = _liveness(plan, est, mem, pipe, pipeline.module if pipeline is not None
                             else module, recompute)
    judge_memory(est)
    est.expected_error = calibration.expected_error(class_shares(est, agg.values()))
    line = calibration.describe(est.expected_error)
    if line:
        est.notes = [*est.notes, line]
    return est


#: The liveness view keeps at most this many program points (the fullest of each run).
LIVENESS_POINTS = 2000


def _liveness(plan: ModulePlan, est: Estimate, mem: MemoryProfile, pipe: dict[str, Any],
              module: ir_pb2.Module | None, recompute: Recomputation | None) -> dict[str, Any]:
    """``Estimate.liveness``: ``memory.liveness_trace`` of the fullest tile (of the fullest
    IPU of a pipeline, whose stash is constant over the steps), as plain data:

        tile, ipu, stages (the IPU's), positions (program points + the end), bucket
        (positions per kept point), order ("scheduled" / "hlo"), always_live ({category:
        bytes}), always_live_bytes, extra_bytes (a pipeline's stash on the tile),
        offloaded_bytes (optimizer state off the tile during the steps), points ([position,
        bytes, name, opcode, layer, stage, phase "F"/"B"/"U"/""], at most LIVENESS_POINTS),
        peak ({position, bytes, not_always_live_bytes, name, opcode, layer, stage, phase}),
        top (the tensors and temporaries live at the peak, as ``contributors``),
        phase_starts ({"F"/"B"/"U": first position}), notes.

    A failure here is logged and leaves a note: the view never changes an estimate."""
    try:
        if recompute is not None:
            phase: dict[str, str] | None = dict(recompute.phase)
        else:
            phase = phases(module) if module is not None else None
        tile, ipu = mem.peak_tile, 0
        extra = offloaded = 0.0
        stages: list[int] = []
        notes: list[str] = []
        if pipe:
            tile, ipu = int(pipe["peak_tile"]), int(pipe["peak_ipu"])
            stages = list(mem.view.stages) if mem.view is not None else []
            # The stash and the offloaded optimizer state on the tile, as pipeline.py added
            # them into the fullest IPU's categories (whole bytes; the profile's, unrounded).
            extra = float(round(est.memory["activations"][tile] - mem.categories["activations"][tile]))
            offloaded = float(round(mem.categories["variables"][tile] - est.memory["variables"][tile]))
        trace = liveness_trace(plan, mem, tile, max_points=LIVENESS_POINTS, phase=phase,
                               extra_bytes=extra, offloaded_bytes=offloaded)
        if pipe and len(stages) < est.pipeline_stages:
            notes.append(f"IPU {ipu} (pipeline stage{'s' if len(stages) != 1 else ''} "
                         f"{', '.join(map(str, stages))}): the whole program's points in its order; "
                         "this IPU computes only its stages' (at the others it holds what they "
                         "send it)")
        if extra:
            notes.append(f"{extra:,.0f} B of micro-batches stashed for the backward pass on this "
                         "tile, constant over the steps (counted at every point)")
        if offloaded:
            notes.append(f"{offloaded:,.0f} B of optimizer state offloaded from this tile (in "
                         "Streaming Memory during the steps, streamed in at the weight update)")
        if trace.peak_bytes != est.peak_tile_bytes:
            notes.append(f"the tile's peak ({est.peak_tile_bytes:,} B) is not during these steps "
                         f"(their largest: {trace.peak_bytes:,} B)"
                         + (": the weight update, with its offloaded optimizer state streamed in"
                            if offloaded else ""))
        return {**trace.to_dict(), "ipu": ipu, "stages": stages, "notes": notes}
    except Exception as e:  # noqa: BLE001 - a view must not change the estimate
        _log.warning("liveness view of %s not made: %s", est.program or "the program", e, exc_info=e)
        est.notes = [*est.notes, f"no liveness view: {type(e).__name__}: {e}"]
        return {}


def judge_memory(est: Estimate) -> Estimate:
    """Sets ``est``'s verdict from its fullest tile: ``fits`` (peak <= SRAM), ``margin_bytes``
    (``MEMORY_MARGIN`` of the tile's SRAM) and ``within_margin`` (over by at most that), with
    the warning in its notes when within. Returns ``est``."""
    est.margin_bytes = int(est.tile_bytes_limit * MEMORY_MARGIN)
    est.fits = est.peak_tile_bytes <= est.tile_bytes_limit
    est.within_margin = (not est.fits
                         and est.peak_tile_bytes <= est.tile_bytes_limit + est.margin_bytes)
    line = est.margin_message()
    if line and line not in est.notes:
        est.notes = [*est.notes, line]
    return est


def class_shares(est: Estimate, ops: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Each calibration class's share of the estimate's cycles: compute by the class of the
    op doing it, exchange and sync phases, collectives on the links, host transfers."""
    cycles: dict[str, float] = {}
    for a in ops:
        cls = calibration.class_of_opcode(str(a.get("opcode", "")))
        cycles[cls] = cycles.get(cls, 0.0) + float(a.get("compute", 0.0))
        cycles["exchange"] = cycles.get("exchange", 0.0) + float(a.get("exchange", 0.0))
        cycles["sync"] = cycles.get("sync", 0.0) + float(a.get("sync", 0.0))
        cycles["collective"] = cycles.get("collective", 0.0) + float(a.get("link", 0.0))
    cycles["host_link"] = float(est.host_cycles)
    total = sum(cycles.values())
    return {k: v / total for k, v in cycles.items() if v > 0} if total > 0 else {}


def _apply_pipeline(est: Estimate, pipe: dict[str, Any], where: Placement, t: Target) -> None:
    """Puts a pipelined program's figures (``pipeline.estimate_pipeline``) into ``est``."""
    device = int(math.ceil(pipe["device_cycles"]))
    all_reduce = int(math.ceil(pipe["all_reduce_cycles"]))
    sync = int(math.ceil(pipe["replica_sync_cycles"]))
    host = int(math.ceil(pipe["host_cycles"]))
    est.device_cycles, est.all_reduce_cycles, est.replica_sync_cycles = device, all_reduce, sync
    est.host_cycles = host
    est.cycles = device + all_reduce + sync + host
    est.seconds = est.cycles / t.clock_hz
    est.host_link = pipe["host_link"]
    est.replica_syncs = 1 if where.replicas > 1 else 0
    est.all_reduces, est.all_reduce_bytes = pipe["all_reduces"], pipe["all_reduce_bytes"]
    est.all_reduces_per_update = pipe["all_reduces_per_update"]
    per_update = set(pipe["per_update_all_reduces"])
    calls = pipe["updates_per_call"], pipe["micro_batches_per_call"]
    est.collectives = [{**c, "executions": calls[0] if c["name"] in per_update else calls[1]}
                       for c in est.collectives] if where.replicas > 1 else []
    est.ring = pipe["rings"].get(str(where.stage_ipus[0]), {}) if where.replicas > 1 else {}
    est.replicas = where.replicas
    est.system = where.system.name
    est.ipu_ids = list(where.ipu_ids)
    for name in ("peak_tile", "peak_tile_bytes", "fits", "memory", "contributors", "by_layer",
                 "always_live_bytes", "total_bytes", "hlo_order_peak_tile_bytes", "peak_ipu", "ipus",
                 "stages"):
        setattr(est, name, pipe[name])
    est.peak_temporary_bytes = max(0, est.total_bytes - est.always_live_bytes)
    est.hlo_order_peak_tile = 0
    est.memory_order = "scheduled" if all(o == "scheduled" for o in pipe["orders"].values()) else "hlo"
    est.largest_arrays = [f"{c['bytes']} B on tile {est.peak_tile} of IPU {est.peak_ipu} for "
                          f"'{c['name']}'" + (f" (Keras layer '{c['layer']}')" if c.get("layer") else "")
                          for c in est.contributors[:10]]
    est.pipeline_stages = where.stages
    est.pipeline_schedule = where.schedule
    est.micro_batches = where.micro_batches
    est.recomputation = where.recomputation
    est.ipus_per_replica = where.ipus_per_replica
    est.stage_ipus = list(where.stage_ipus)
    est.micro_batches_per_call = int(pipe["micro_batches_per_call"])
    est.weight_updates_per_call = float(pipe["updates_per_call"])
    est.pipeline_cycles_per_update = int(math.ceil(pipe["per_update_cycles"]))
    est.pipeline_timeline = pipe["timeline"]
    est.pipeline_transfers = pipe["transfers"]
    est.notes = list(est.notes) + [f"pipelined: {where.describe()}"] + pipe["offload_notes"] + (
        [f"the pipeline timeline shows its first {len(est.pipeline_timeline)} slots"]
        if pipe["truncated"] else [])


def estimate_module(module: ir_pb2.Module, live: LiveFn | None, target: Target, *,
                    param_kinds: dict[int, str] | None = None,
                    mappings: dict[str, TileMapping] | None = None,
                    replicas: int = 1, system: Any = None, ipu_ids: Iterable[int] = (),
                    implied_all_reduce_bytes: int = 0, pipeline_stages: int = 1,
                    stage_ipus: Iterable[int] = (), ipus_per_replica: int = 0,
                    pipeline_schedule: str = "grouped", micro_batches: int = 1,
                    recomputation: bool = False, optimizer_state_offload: str | bool | None = "auto",
                    optimizer_state_sharding: bool = False,
                    memory_proportions: Mapping[str, float] | None = None,
                    partials_types: Mapping[str, str] | None = None,
                    stage_memory_proportions: Iterable[tuple[str, int, str, float]] = (),
                    variable_mapping: str = "consumer",
                    on_failure: str = "raise") -> Estimate:
    """Plans ``module`` for ``target`` and estimates one call (see ``plan_module`` for the
    arguments; ``memory_proportions``: PopLibs' availableMemoryProportion of ``"dot"`` and
    ``"convolution"`` plans; ``partials_types``: their partialsType, "float" or "half";
    ``stage_memory_proportions``: (phase, stage, kind, proportion) entries of a pipeline's
    ``PipelineStageOptions``, which replace ``memory_proportions`` in that pass of that stage;
    ``variable_mapping``: "consumer" (variables laid out for their first consumer) or "linear"
    (``poputil::mapTensorLinearly``; ``mapping.variable_mappings``, ``mappings`` still win)).

    ``replicas`` copies of the program run at once on ``ipu_ids`` (default: the first
    ``replicas``) of ``system`` (a ``protocol.hardware.System``; None: ``plain_system`` IPUs
    of the target's version), as ``CompileOptions`` says; see ``replication.py``.

    Pipelined (``pipeline_stages`` S > 1; every instruction's ``pipeline_stage`` attribute
    names its stage): stage s runs on IPU ``stage_ipus[s]`` (default s) of each replica's
    ``ipus_per_replica`` IPUs (0: the IPUs the stages name, rounded up to a power of two);
    replica r on ``ipu_ids[r * P:(r + 1) * P]``; ``pipeline_schedule`` "grouped",
    "interleaved" or "sequential", ``micro_batches`` per weight update, ``recomputation``,
    ``optimizer_state_offload`` ("auto", "on", "off") and ``optimizer_state_sharding``
    (Graphcore's offload_weight_update_variables and replicated_optimizer_state_sharding);
    see ``pipeline.py``.

    A failure of the model itself (a bug, an IR shape it does not know) raises
    :class:`TileModelError` naming the instruction being planned (``on_failure="raise"``, the
    default), or (``on_failure="report"``: compile, which a failure must never stop) is logged
    as a warning and returns an estimate with the fit unknown: ``fits`` None, no figures
    (cycles 0), the message in ``failure`` and ``notes``.

    Raises:
        TileModelError: the tile model failed (``on_failure="raise"``), naming the program and
            the instruction, the original exception chained.
        ValueError: a replication the system cannot run (more replicas than IPUs, ``ipu_ids``
            not one IPU per replica, IPUs of another version), a pipeline placement it cannot
            (a stage mapped to an IPU the replica lacks, more IPUs than the system has, ...)
            or an instruction in a stage beyond ``pipeline_stages``, naming the numbers.
    """
    if on_failure not in ("raise", "report"):
        raise ValueError(f"on_failure must be 'raise' or 'report'. Received: {on_failure!r}")
    if check_variable_mapping(variable_mapping) == "linear":
        mappings = {**variable_mappings(module, target.vector_bytes, target.min_bytes_per_tile,
                                        target.tiles_per_ipu, param_kinds), **(mappings or {})}
    run: PipelineRun | None = None
    if pipeline_stages != 1:
        where = placement(pipeline_stages, stage_ipus, ipus_per_replica, replicas, system,
                          ipu_ids, target, pipeline_schedule, micro_batches, recomputation,
                          optimizer_state_offload, optimizer_state_sharding)
        _check_stages(module, pipeline_stages)
        first = tuple(where.ipu_id(r, where.stage_ipus[0]) for r in range(where.replicas))
        rep = replication(where.replicas, where.system, first, target)
        run = PipelineRun(module, where, implied_all_reduce_bytes)
    else:
        rep = replication(replicas, system, tuple(ipu_ids or ()), target)
    try:
        plan = plan_module(module, target, live, param_kinds=param_kinds, mappings=mappings,
                           replication=rep if rep.system is not None else None,
                           implied_all_reduce_bytes=0 if run else implied_all_reduce_bytes,
                           stages=pipeline_stages if run else 1,
                           memory_proportions=memory_proportions, partials_types=partials_types,
                           stage_memory_proportions=stage_memory_proportions)
        est = estimate_plan(plan, module.name, run,
                            recomputation_of(module) if run is None and recomputation else None,
                            module)
        if memory_proportions:  # PopLibs' availableMemoryProportion the products were planned with
            est.context["available_memory_proportion"] = {
                str(k): float(v) for k, v in sorted(memory_proportions.items())}
        if stage_memory_proportions:  # PipelineStageOptions: per stage and pass
            est.context["stage_available_memory_proportion"] = StageProportions.of_entries(
                stage_memory_proportions, max(1, pipeline_stages)).context(pipeline_stages)
        if variable_mapping == "linear":
            est.context["variable_mapping"] = "linear (poputil::mapTensorLinearly)"
        half = sorted(k for k, v in (partials_types or {}).items() if str(v).lower() == "half")
        if half:
            est.context["half_partials"] = half
        return est
    except RunStopped:  # a cancelled Compile (cancel.checkpoint): not a tile model failure
        raise
    except Exception as e:  # noqa: BLE001 - raised as TileModelError, or reported
        error = tile_model_error(module.name, e)
        if on_failure == "raise":
            raise error from e
        _log.warning("%s", error, exc_info=e)
        return Estimate(
            ipu_version=target.ipu_version, tiles_per_ipu=target.tiles_per_ipu,
            clock_hz=target.clock_hz, cycles=0, seconds=0.0, peak_tile_bytes=0,
            tile_bytes_limit=target.sram_bytes_per_tile, total_bytes=0, fits=None,
            target=f"{target.product} ({target.name})", program=module.name,
            preset=target.to_dict(), replicas=rep.replicas,
            system=rep.system.name if rep.system is not None else "", ipu_ids=list(rep.ipu_ids),
            margin_bytes=int(target.sram_bytes_per_tile * MEMORY_MARGIN), failure=str(error),
            notes=[f"fit unknown, no figures: {error}"],
        )


def tile_model_error(program: str, e: BaseException) -> TileModelError:
    """The :class:`TileModelError` for exception ``e`` raised by the tile model on ``program``:
    it names the IR instruction being planned when it failed (the innermost frame of ``e``'s
    traceback holding one, preferring a local named ``instr``: the planners' name for it) and
    the function that raised (not chained here: ``raise ... from e``)."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    instr = None
    for frame in reversed(frames):  # innermost first
        if isinstance(frame.f_locals.get("instr"), ir_pb2.Instruction):
            instr = frame.f_locals["instr"]
            break
    if instr is None:
        instr = next((v for frame in reversed(frames) for v in frame.f_locals.values()
                      if isinstance(v, ir_pb2.Instruction)), None)
    where = ""
    if frames:
        code = frames[-1].f_code
        path = code.co_filename.replace("\\", "/")
        short = "/".join(path.split("/")[-2:])
        where = f" (raised in {short}, {code.co_name})"
    what = (f"while planning {describe(instr)}" if instr is not None
            else "outside any one instruction")
    message = (f"The tile model failed on program {program!r} {what}: {type(e).__name__}: {e}"
               f"{where}. No figure of this program was estimated (a limit or bug of the tile "
               "model, docs/tile_model.md; please report it with the program).")
    if instr is None:
        return TileModelError(message, program)
    return TileModelError(message, program, instr.name, instr.opcode,
                          layer_of(instr.source_op) if instr.source_op else "")


def recomputation_of(module: ir_pb2.Module) -> Recomputation:
    """How a program that is not pipelined is recomputed (``allow_recompute``; docs/tile_model.md,
    "Recomputation"): a one-stage pipeline's program cut by recomputation checkpoints remakes
    its segments (``RecomputeAndBackpropagateInterleaved``); any other, the cheap element-wise
    results its backward reads."""
    phase = phases(module)
    if any(checkpoint_makers(c) for c in module.computations):
        names = set().union(*recomputed_instructions(module, phase, 1).values())
        return Recomputation("segments", phase, again=dict.fromkeys(names, 1))
    return Recomputation("cheap", phase)


def _check_stages(module: ir_pb2.Module, stages: int) -> None:
    """ValueError for an instruction whose ``pipeline_stage`` is not one of the stages."""
    for comp in module.computations:
        for instr in comp.instructions:
            s = stage_of(instr)
            if not 0 <= s < stages:
                raise ValueError(
                    f"instruction {instr.name!r} ({instr.source_op or instr.opcode}) is in pipeline "
                    f"stage {s}, but the program has {stages} stages (0 .. {stages - 1}): give "
                    f"pipeline_stages={s + 1} or fix the stage assignment.")
