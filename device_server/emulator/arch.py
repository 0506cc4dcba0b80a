"""IPU architecture presets (GC2 / GC200 / Bow) for the emulator's cost and memory model.

Every figure is a named field so that a wrong one can be corrected in one place (the chips'
names and tile counts, and the multi-IPU systems, are ``device_server/protocol/hardware.py``'s,
which the client reads too). Sources are
those collected in ``/work/shared/ipu_arch.md``; "derived" marks arithmetic on published
figures, "assumption" a figure nobody published.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from device_server.protocol.hardware import VERSIONS, canonical_version

__all__ = ["BOW", "GC2", "GC200", "PRESETS", "Target", "get_target"]


@dataclass(frozen=True)
class Target:
    """One IPU model the emulator compiles for."""

    name: str                      # canonical preset name: "ipu1", "ipu2", "bow"
    product: str                   # marketing name: "GC2", "GC200", "Bow"
    ipu_version: str               # Poplar's spelling: "ipu1", "ipu2", "ipu21"
    hardware_tiles_per_ipu: int    # tiles on the chip
    tiles_per_ipu: int             # tiles the program may use (<= hardware_tiles_per_ipu)
    sram_bytes_per_tile: int       # tile-local SRAM
    clock_hz: float
    worker_threads_per_tile: int
    amp_fp16_flops_per_cycle_per_tile: float   # matrix unit, FP16 in, FP32 partials
    amp_fp32_flops_per_cycle_per_tile: float   # matrix unit, FP32
    vector_fp32_flops_per_cycle_per_tile: float
    vector_fp16_flops_per_cycle_per_tile: float
    memory_bytes_per_cycle_per_tile: float     # tile-local SRAM read bandwidth
    memory_latency_cycles: int
    exchange_bytes_per_cycle_per_tile: float   # on-chip tile-to-tile, in and out
    sync_cycles: int                            # one global BSP sync
    exchange_overhead_cycles: int               # fixed cost of one exchange phase
    vertex_overhead_cycles: int                 # per worker vertex
    host_link_bytes_per_s: float
    ipu_link_bytes_per_s: float                 # all IPU-Links of one IPU
    power_watts: float | None
    # ---- tile model (device_server/emulator/tiles, docs/tile_model.md): figures nobody
    # publishes per chip; each is an assumption, kept here so it can be corrected in one place.
    amp_fp16_input_channels: int = 16    # AMP consumes input channels (contraction) in groups of 16 (fp16)
    amp_fp32_input_channels: int = 8     # ... and of 8 (fp32)
    amp_fp16_output_channels: int = 16   # AMP produces output channels in groups of 16 (fp16; GC2: 8)
    amp_fp32_output_channels: int = 8    # ... and of 8 (fp32; GC2: 4)
    # FP16 partials (numerics.py): products one AMP pass sums before it adds them to an FP16
    # accumulator. Assumption: the AMP's FP16 input-channel group (amp_fp16_input_channels);
    # Graphcore documents the option (partialsType "half"), not the hardware's summation order.
    amp_fp16_partials_chunk: int = 16
    vector_bytes: int = 8                # one vector (64-bit) per worker instruction
    flops_per_transcendental: float = 8.0  # vector instructions per exp/log/sqrt/divide/... element
    available_memory_proportion: float = 0.6  # share of a tile a conv/matmul plan may use for temporaries (Poplar's default)
    min_bytes_per_tile: int = 128        # linear mappings put at least this much on each tile used
    vertex_state_bytes: int = 24         # per vertex (one multi-vertex per tile per compute set)
    codelet_bytes: int = 384             # code of one vertex type on one tile
    compute_set_control_bytes: int = 16  # control code per compute set on each tile it uses
    exchange_code_bytes: int = 24        # per exchange on each receiving tile
    exchange_code_bytes_per_source: int = 8  # per tile received from, on each receiving tile
    host_link_latency_s: float = 5e-6    # fixed cost of one host transfer (each direction)

    @property
    def sram_bytes_per_ipu(self) -> int:
        """SRAM of the tiles in use."""
        return self.tiles_per_ipu * self.sram_bytes_per_tile

    def to_dict(self) -> dict[str, object]:
        """All figures as a plain dict (for reports)."""
        return dataclasses.asdict(self)


# Shared by every preset (Poplar's planner constants, poplibs source via ipu_arch.md).
_SYNC_CYCLES = 90                # global sync about 90 cycles
_EXCHANGE_OVERHEAD_CYCLES = 100  # fixed exchange overhead about 100 cycles
_VERTEX_OVERHEAD_CYCLES = 16     # ~16 cycles per worker vertex
_WORKERS = 6                     # 6 hardware worker threads per tile (Louw s.II; Jia et al.)

GC2 = Target(
    name="ipu1",
    product="GC2",
    ipu_version="ipu1",
    hardware_tiles_per_ipu=1216,   # 16 columns x 19 islands x 4 tiles (Burchard et al. s.2)
    tiles_per_ipu=1216,
    sram_bytes_per_tile=262_144,   # 256 KiB (Louw & McIntosh-Smith 2021)
    clock_hz=1.6e9,                # 1.6 GHz (iPUG s.2); 1.3 GHz on PCIe power
    worker_threads_per_tile=_WORKERS,
    amp_fp16_flops_per_cycle_per_tile=64.0,    # derived: 124.5 TFLOP/s / (1216 x 1.6 GHz)
    amp_fp32_flops_per_cycle_per_tile=16.0,    # derived: 31.1 TFLOP/s / (1216 x 1.6 GHz)
    vector_fp32_flops_per_cycle_per_tile=4.0,  # derived: 7.6 TFLOP/s measured (Jia) / (1216 x 1.6 GHz)
    vector_fp16_flops_per_cycle_per_tile=8.0,  # assumption: twice the FP32 vector rate
    memory_bytes_per_cycle_per_tile=16.0,      # 31.1 TB/s aggregate read (Louw s.IV citing Jia)
    memory_latency_cycles=6,                   # 3.75 ns (Jia et al.)
    exchange_bytes_per_cycle_per_tile=4.0,     # derived: ~8 TB/s all-to-all (Louw s.II)
    sync_cycles=_SYNC_CYCLES,
    exchange_overhead_cycles=_EXCHANGE_OVERHEAD_CYCLES,
    vertex_overhead_cycles=_VERTEX_OVERHEAD_CYCLES,
    host_link_bytes_per_s=64e9,                # PCIe Gen4 x16 nominal (Louw s.II-III)
    ipu_link_bytes_per_s=192e9,                # C2 card: 3 links x 64 GB/s (Jia et al.)
    power_watts=150.0,                         # per IPU (iPUG)
    amp_fp16_output_channels=8,                # assumption: half the GC200's AMP width
    amp_fp32_output_channels=4,                # assumption: half the GC200's AMP width
)

GC200 = Target(
    name="ipu2",
    product="GC200",
    ipu_version="ipu2",
    hardware_tiles_per_ipu=1472,   # Graphcore product pages
    tiles_per_ipu=1472,
    sram_bytes_per_tile=638_976,   # 624 KiB (graphcore/popliner --mem-per-tile default)
    clock_hz=1.33e9,               # derived: 250 TFLOP/s / (1472 x 128 FLOP/cycle)
    worker_threads_per_tile=_WORKERS,
    amp_fp16_flops_per_cycle_per_tile=128.0,   # 250 TFLOP/s (Graphcore)
    amp_fp32_flops_per_cycle_per_tile=32.0,    # 62.5 TFLOP/s commonly quoted (unconfirmed)
    vector_fp32_flops_per_cycle_per_tile=4.0,  # assumption: same per cycle as GC2
    vector_fp16_flops_per_cycle_per_tile=8.0,  # assumption: twice the FP32 vector rate
    memory_bytes_per_cycle_per_tile=16.0,      # same tile design; 47.5 TB/s marketing would be ~24
    memory_latency_cycles=6,                   # assumption: as GC2
    exchange_bytes_per_cycle_per_tile=4.0,     # derived: 8 TB/s all-to-all (Graphcore)
    sync_cycles=_SYNC_CYCLES,
    exchange_overhead_cycles=_EXCHANGE_OVERHEAD_CYCLES,
    vertex_overhead_cycles=_VERTEX_OVERHEAD_CYCLES,
    host_link_bytes_per_s=5.5e9,               # via gateway, as assumed in graphcore/examples
    ipu_link_bytes_per_s=320e9,                # 10 IPU-Links (Graphcore M2000 pages)
    power_watts=None,
)

BOW = dataclasses.replace(
    GC200,
    name="bow",
    product="Bow",
    ipu_version="ipu21",           # Poplar's name for Bow
    clock_hz=1.85e9,               # Graphcore Bow launch
)

PRESETS: dict[str, Target] = {"ipu1": GC2, "ipu2": GC200, "bow": BOW}
if {k: (t.product, t.ipu_version, t.hardware_tiles_per_ipu) for k, t in PRESETS.items()} != {
        v.name: (v.product, v.poplar_name, v.tiles) for v in VERSIONS.values()}:
    raise RuntimeError("the presets and device_server/protocol/hardware.py name different chips")


def get_target(name: str, tiles_per_ipu: int = 0) -> Target:
    """The preset called ``name`` ("ipu1" = GC2, "ipu2" = GC200, "bow" or "ipu21" = Bow; the
    names are ``device_server.protocol.hardware``'s).

    ``tiles_per_ipu`` > 0 restricts the program to that many tiles (at most the chip's).
    """
    try:
        key = canonical_version(name)
    except ValueError:
        raise ValueError(f"Unknown IPU target {name!r}; accepted: "
                         f"{', '.join(repr(n) for n in [*PRESETS, 'ipu21'])}.") from None
    target = PRESETS[key]
    if tiles_per_ipu:
        if not isinstance(tiles_per_ipu, int) or not 0 < tiles_per_ipu <= target.hardware_tiles_per_ipu:
            raise ValueError(
                f"tiles_per_ipu={tiles_per_ipu!r} is out of range for {target.product} "
                f"({name!r}): accepted 1..{target.hardware_tiles_per_ipu}, or 0 for all."
            )
        target = dataclasses.replace(target, tiles_per_ipu=tiles_per_ipu)
    return target
