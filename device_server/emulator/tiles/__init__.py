"""The tile model: per-tile plans, memory, BSP cycles and reports for IR modules.

    IR module
      -> planner.plan_module     every instruction: output tile mapping (mapping.py), supersteps
                                 (compute / sync / exchange, cycles.py), temporaries; dot and
                                 convolution by a search over splits (matmul.py); loops by trip
                                 count (loops.py)
      -> memory.profile_memory   always-live + peak not-always-live bytes on every tile
      -> report.Estimate         cycles, seconds, throughput, fits, top ops, timeline, JSON
      -> html.render_html        a self-contained HTML page (inline SVG)
    replicated programs: replication.py (ring all-reduce over the system's IPU-Links, the
    replicas' syncs, shared host links), passed as estimate_module(..., replicas, system, ipu_ids)

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
