"""The emulator's cost and memory estimate of a module on an IPU target.

The estimate comes from the tile model (``device_server/emulator/tiles``, docs/tile_model.md):
every instruction is planned onto tiles (mappings, supersteps, exchanges), memory is profiled
per tile over the schedule, and cycles are counted per superstep on the slowest tile. This
module keeps the names the compiler and the server use.

    est = estimate_module(module, live, target)   # Estimate: cycles, seconds, bytes per tile
    est.fits, est.oom_message(), est.to_dict(), est.save_html("report.html")
    est = estimate_module(module, live, target, replicas=4, system=hardware.get_system("bow2000"))
    est.all_reduce_cycles, est.all_reduce_share, est.ring   # replicated: per IPU + collectives
    est = estimate_module(module, live, target, pipeline_stages=2, micro_batches=8)
    est.ipus, est.stages, est.pipeline_timeline             # pipelined: memory per IPU, slots
"""

from __future__ import annotations

from device_server.emulator.tiles.loops import while_trip_count
from device_server.emulator.tiles.report import ASSUMPTIONS, Estimate, estimate_module
from device_server.emulator.tiles.state import LiveFn

__all__ = ["ASSUMPTIONS", "Estimate", "LiveFn", "estimate_module", "while_trip_count"]
