"""The tile model: per-tile plans, memory, BSP cycles and reports for IR modules.

    IR module
      -> planner.plan_module     every instruction: output tile mapping (mapping.py), supersteps
                                 (compute / sync / exchange, cycles.py), temporaries, by the
                                 opcode planners: elementwise.py, movement.py, products.py
                                 (dot/convolution; the search over splits: matmul.py),
                                 reductions.py, problems.py, control.py (loops.py: trip
                                 counts), collectives.py; IR facts: irinfo.py; the plan's
                                 data: plan.py; shared state and helpers: state.py
      -> memory.profile_memory   always-live + peak not-always-live bytes on every tile, in
                                 the memory-aware order of each computation (schedule.py:
                                 list schedulers; liveness.py: live ranges in an order)
      -> pipeline.py             pipelined programs: each stage on its IPU, memory per IPU,
                                 the slots of the schedule, sends over the system's links
      -> report.Estimate         cycles, seconds, throughput, fits, top ops, timeline, JSON
      -> html.render_html        a self-contained HTML page (inline SVG)
    replicated programs: replication.py (ring all-reduce over the system's IPU-Links, the
    replicas' syncs, shared host links), passed as estimate_module(..., replicas, system, ipu_ids);
    pipelines as estimate_module(..., pipeline_stages, stage_ipus, ipus_per_replica,
    pipeline_schedule, micro_batches, recomputation)

The compiler calls :func:`estimate_module` once per compile (``Executable.estimate``); nothing
is cached or computed at run time. The model, its parameters (all fields of
``arch.Target``) and its assumptions are described in docs/tile_model.md.
"""

from device_server.emulator.tiles.mapping import Allocator, TileMapping
from device_server.emulator.tiles.planner import ModulePlan, plan_module
from device_server.emulator.tiles.replication import Replication, replication
from device_server.emulator.tiles.report import Estimate, estimate_module, estimate_plan

__all__ = ["Allocator", "Estimate", "ModulePlan", "Replication", "TileMapping", "estimate_module",
           "estimate_plan", "plan_module", "replication"]
