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

from device_server.emulator.calibration import CYCLE_SCALES, E2E, E2E_CLASSES, FITTED, scale_name
from device_server.protocol.hardware import VERSIONS, canonical_version

__all__ = ["BOW", "GC2", "GC200", "PRESETS", "PROVENANCE", "Target", "calibration_summary",
           "get_target", "provenance"]


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
    amp_fp32_output_channels: int = 16   # ... and of 16 (fp32; GC2: 8)
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
    # ---- fitted to bench/calibration's measurements (calibration.py, docs/tile_model.md):
    # the share of the tile-memory rate Poplar's library vertices sustain on streaming work
    # (STREAM triad with Poplar's primitives), and of the AMP peak a matrix product's inner
    # loop sustains (the largest products measured).
    library_memory_efficiency: float = FITTED["library_memory_efficiency"]
    amp_fp16_efficiency: float = FITTED["amp_fp16_efficiency"]
    amp_fp32_efficiency: float = FITTED["amp_fp32_efficiency"]
    # cycles a matrix product's pass costs beyond its work and one vertex's overhead (the
    # AMP's set-up per pass; fitted to the smallest products measured)
    matmul_pass_overhead_cycles: float = FITTED["matmul_pass_overhead_cycles"]
    # ---- end-to-end cycle scales (calibration.json "e2e", bench/calibration/fit.py --e2e):
    # one factor per class no op-level source covers, on the cycles the model gives that
    # class (calibration.apply_cycle_scales; host link: tiles/cycles.host_seconds). 1.0:
    # not fitted, or the fit was not adopted (it must beat one constant on all cycles).
    elementwise_cycle_scale: float = CYCLE_SCALES["elementwise_cycle_scale"]
    conv_cycle_scale: float = CYCLE_SCALES["conv_cycle_scale"]
    reduction_cycle_scale: float = CYCLE_SCALES["reduction_cycle_scale"]
    exchange_cycle_scale: float = CYCLE_SCALES["exchange_cycle_scale"]
    sync_cycle_scale: float = CYCLE_SCALES["sync_cycle_scale"]
    host_link_cycle_scale: float = CYCLE_SCALES["host_link_cycle_scale"]
    collective_cycle_scale: float = CYCLE_SCALES["collective_cycle_scale"]

    @property
    def sram_bytes_per_ipu(self) -> int:
        """SRAM of the tiles in use."""
        return self.tiles_per_ipu * self.sram_bytes_per_tile

    def to_dict(self) -> dict[str, object]:
        """All figures as a plain dict (for reports)."""
        return dataclasses.asdict(self)


# Shared by every preset: vendor-model constants of PopLibs' planners and estimators (PROVENANCE
# says which; Poplar's own figures, e.g. Target::getMaxIPUSyncDelay, are not public).
_SYNC_CYCLES = 90                # the sync cost of PopLibs' CTC-loss planner
_EXCHANGE_OVERHEAD_CYCLES = 100  # the fixed exchange overhead of the same planner
_VERTEX_OVERHEAD_CYCLES = 16     # worker prologue of PopLibs' ScaledAdd / HMAC estimators
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
    host_link_bytes_per_s=32e9,                # PCIe Gen4 x16: 64 GB/s counting both ways (Louw s.II-III)
    ipu_link_bytes_per_s=192e9,                # C2 card: 3 links x 64 GB/s (Jia et al.)
    power_watts=150.0,                         # per IPU (iPUG)
    amp_fp16_output_channels=8,                # PopLibs' GC2 AMP codelets: 8 conv units
    amp_fp32_output_channels=8,                # PopLibs' GC2 AMP codelets: 8 conv units
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

# ---- provenance: every figure of every preset is published (with its source; arithmetic on
# published figures counts, and says so), fitted (bench/calibration), or assumed (no public
# figure; bench/bench_calibration.py shows how much the main estimates move with it).
_P, _F, _A = "published", "fitted", "assumed"
_FIT = ("bench/calibration/fit.py: fitted to {rows} (calibration.json)")
_COMMON: dict[str, tuple[str, str]] = {
    "worker_threads_per_tile": (_P, "6 hardware worker threads (Louw & McIntosh-Smith 2021 s.II; Jia et al. 2019)"),
    "sync_cycles": (_A, "90 cycles: the sync cost PopLibs' CTC-loss planner uses (graphcore/poplibs@7eac0f26 lib/popnn/CTCLossPlan.cpp, estimateCycles), a vendor-model constant of that planner; the general planners ask Poplar (Target::getMaxIPUSyncDelay), whose value is not public"),
    "exchange_overhead_cycles": (_A, "100 cycles: the fixed exchange overhead of PopLibs' CTC-loss planner (graphcore/poplibs@7eac0f26 lib/popnn/CTCLossPlan.cpp, estimateCycles); the convolution planner's exchange model has no fixed term"),
    "vertex_overhead_cycles": (_A, "16: the worker prologue of PopLibs' ScaledAdd and HMAC convolution estimators (graphcore/poplibs@7eac0f26 lib/popops/PerformanceEstimation.cpp, lib/poplin/PerformanceEstimation.hpp); other vertices' estimators use 5-58 worker cycles"),
    "available_memory_proportion": (_P, "PopLibs' default availableMemoryProportion, 0.6 (Poplar docs)"),
    "vector_fp16_flops_per_cycle_per_tile": (_A, "twice the FP32 vector rate, as PopLibs' estimators cost a 4-half vector like a 2-float one (graphcore/poplibs@7eac0f26 lib/popops/popopsCycleEstimators.hpp; a vendor model)"),
    "amp_fp16_input_channels": (_P, "16 = 4 halves per 64-bit load x a 4-deep conv-unit chain, every chip (PopLibs' AMP codelets and planner, graphcore/poplibs@7eac0f26 lib/poplin/ConvVertexType.cpp, ConvModel.cpp getConvUnitWeightHeight)"),
    "amp_fp32_input_channels": (_P, "8 = 2 floats per 64-bit load x 4, every chip (PopLibs' float AMP codelets, graphcore/poplibs@7eac0f26 lib/poplin/codelets/asm/conv_partial_1x1_float_float*.S)"),
    "amp_fp16_output_channels": (_A, "16 conv units: PopLibs' GC200/Bow AMP codelets with FP16 partials (graphcore/poplibs@7eac0f26 conv_partial_1x1_half_float_8_and_half_half_h16.S); with FP32 partials PopLibs uses 8, which the model does not distinguish yet"),
    "amp_fp32_output_channels": (_P, "16 conv units on GC200/Bow (PopLibs' float dual-AMP codelets, graphcore/poplibs@7eac0f26 lib/poplin/codelets/asm/conv_partial_1x1_float_float_16.S)"),
    "amp_fp16_partials_chunk": (_A, "16 products, one AMP pass over an input-channel group (PopLibs' half-in half-out AMP codelets); how the AMP rounds inside a pass is not public"),
    "vector_bytes": (_P, "64-bit arithmetic vectors (PopLibs' estimators: 4 halves or 2 floats per vector, graphcore/poplibs@7eac0f26 lib/popops/popopsCycleEstimators.hpp)"),
    "flops_per_transcendental": (_A, "vector instructions per exp/log/sqrt/divide element"),
    "min_bytes_per_tile": (_P, "128 B: PopLibs' linear tile mapping keeps at least 128 bytes on each tile (graphcore/poplibs@7eac0f26 lib/poputil/TileMapping.cpp, documented in include/poputil/TileMapping.hpp)"),
    "vertex_state_bytes": (_A, "24 B: PopLibs' vertex states are 8-28 B (field layouts of its codelets, e.g. graphcore/poplibs@7eac0f26 lib/poplin/codelets/asm/conv_partial_1x1_supervisor.S 28 B, lib/popops/codelets/asm/binaryOps1D.S 16 B); Poplar's own per-vertex bookkeeping is not public"),
    "codelet_bytes": (_A, "code of one vertex type on one tile (no public figure)"),
    "compute_set_control_bytes": (_A, "control code per compute set per tile (no public figure)"),
    "exchange_code_bytes": (_A, "exchange code per exchange per receiving tile (no public figure)"),
    "exchange_code_bytes_per_source": (_A, "8 B per source tile; PopLibs' slice planner counts 4 B per exchange instruction (graphcore/poplibs@7eac0f26 lib/popops/DynamicSlice.cpp constructModel)"),
    "host_link_latency_s": (_A, "fixed cost of one host transfer"),
    "tiles_per_ipu": (_P, "all of the chip's tiles (a setting: IPUConfig.ipu_model.tiles_per_ipu)"),
}
_GC2_OWN: dict[str, tuple[str, str]] = {
    "hardware_tiles_per_ipu": (_P, "1216 tiles (Burchard et al. s.2; Jia et al. 2019)"),
    "sram_bytes_per_tile": (_P, "256 KiB per tile (Louw & McIntosh-Smith 2021)"),
    "clock_hz": (_P, "1.6 GHz (IPU programmer's guide s.2)"),
    "amp_fp16_flops_per_cycle_per_tile": (_P, "derived: 124.5 TFLOP/s peak (Jia et al. 2019) / (1216 x 1.6 GHz)"),
    "amp_fp32_flops_per_cycle_per_tile": (_P, "derived: 31.1 TFLOP/s peak (Jia et al. 2019) / (1216 x 1.6 GHz)"),
    "vector_fp32_flops_per_cycle_per_tile": (_P, "derived: 7.6 TFLOP/s measured (Louw Fig. 2 citing Jia) / (1216 x 1.6 GHz)"),
    "memory_bytes_per_cycle_per_tile": (_P, "16 B/cycle/tile read: 31.1 TB/s (Louw s.IV citing Jia); 30.7 TB/s read measured with assembly (Jia, via summaries)"),
    "memory_latency_cycles": (_P, "6 cycles (Jia et al. 2019)"),
    "exchange_bytes_per_cycle_per_tile": (_P, "derived: ~8 TB/s all-to-all (Louw s.II) / (1216 x 1.6 GHz)"),
    "host_link_bytes_per_s": (_P, "PCIe Gen4 x16, ~32 GB/s each way (Louw s.II-III); a system's host links replace it"),
    "ipu_link_bytes_per_s": (_P, "C2 card: 3 IPU-Links x 64 GB/s (Jia et al. 2019)"),
    "power_watts": (_P, "150 W per IPU (IPU programmer's guide)"),
    "library_memory_efficiency": (_F, _FIT.format(rows="STREAM triad with Poplar's primitives, GC2 (Louw & McIntosh-Smith 2021 Table I)")),
    "amp_fp16_efficiency": (_F, _FIT.format(rows="the FP16 matrix-product ceiling, GC2 (Jia et al. 2019, via Louw Fig. 2), and dense products on Bow (Li et al. 2023)")),
    "amp_fp32_efficiency": (_F, _FIT.format(rows="the FP32 matrix-product ceiling, GC2 (Jia et al. 2019, via Louw Fig. 2), and dense products on Bow (Li et al. 2023)")),
    "matmul_pass_overhead_cycles": (_F, _FIT.format(rows="dense products of 4 to 65,536 columns on Bow (Li et al. 2023) and the GC2 ceilings (Jia et al. 2019)")),
}
_MK2_OWN: dict[str, tuple[str, str]] = {
    "hardware_tiles_per_ipu": (_P, "1472 tiles (Graphcore product pages)"),
    "sram_bytes_per_tile": (_P, "624 KiB (graphcore/popliner --mem-per-tile default)"),
    "clock_hz": (_P, "derived: 250 TFLOP/s (Graphcore) / (1472 x 128 FLOP/cycle)"),
    "amp_fp16_flops_per_cycle_per_tile": (_P, "250 TFLOP/s FP16 (Graphcore) at the clock above"),
    "amp_fp32_flops_per_cycle_per_tile": (_P, "derived: 7.989 PFLOP/s FP32 over 128 GC200 (IPU-POD128 datasheet s.2.1) / (1472 x 1.33 GHz) = 32; Bow: 22.31 PFLOP/s over 256 (Bow Pod256 datasheet s.2.1) / (1472 x 1.85 GHz) = 32"),
    "vector_fp32_flops_per_cycle_per_tile": (_A, "the GC2's per cycle (same tile design; PopLibs' vector estimators have no per-chip branch)"),
    "memory_bytes_per_cycle_per_tile": (_P, "16 B/cycle read (two 64-bit loads) + 8 B write per instruction (PopLibs' ld2xst64pace loops, graphcore/poplibs@7eac0f26 lib/popops/codelets/asm/ScaledAddSupervisor_fp.S, no per-chip branch): 24 B x 1472 x 1.33 GHz = 47 TB/s, Graphcore's 47.5 TB/s"),
    "memory_latency_cycles": (_A, "the GC2's 6 cycles (same tile design)"),
    "exchange_bytes_per_cycle_per_tile": (_P, "derived: 8 TB/s all-to-all (Graphcore) / (1472 x 1.33 GHz), rounded"),
    "host_link_bytes_per_s": (_A, "5.5 GB/s through the gateway, as graphcore/examples assume"),
    "ipu_link_bytes_per_s": (_P, "10 IPU-Links, 320 GB/s per IPU (Graphcore M2000 pages)"),
    "power_watts": (_A, "not published per IPU (None)"),
    "library_memory_efficiency": (_A, "the GC2's fitted figure (same tile design; no GC200 or Bow STREAM measurement)"),
    "amp_fp16_efficiency": (_A, "the figure fitted on GC2 and Bow products (same tile design; no GC200 product measured)"),
    "amp_fp32_efficiency": (_A, "the figure fitted on GC2 and Bow products (same tile design; no GC200 product measured)"),
    "matmul_pass_overhead_cycles": (_A, "the figure fitted on Bow products (same tile design; no GC200 product measured)"),
}


def _e2e_provenance() -> dict[str, tuple[str, str]]:
    """Each end-to-end cycle scale: "fitted" (with its runs) where calibration.json's e2e fit
    is adopted and fitted it, else "assumed" 1.0 (and why)."""
    out = {}
    fitted = E2E.get("fitted", {}) if E2E.get("adopted") else {}
    for cls in E2E_CLASSES:
        name = scale_name(cls)
        if name in fitted:
            out[name] = (_F, f"bench/calibration/fit.py --e2e: fitted end to end to "
                             f"{E2E.get('source', 'the one-host MLPerf runs')} (calibration.json), "
                             f"within {E2E['bounds'][name]}")
        else:
            why = (f"the end-to-end fit is not adopted ({E2E.get('why', '')})" if not E2E.get("adopted")
                   else "not among the classes the end-to-end fit fits")
            out[name] = (_A, f"1.0, no end-to-end correction of {cls} cycles: {why}")
    return out


_E2E_OWN = _e2e_provenance()
PROVENANCE: dict[str, dict[str, tuple[str, str]]] = {
    "ipu1": {**_COMMON, **_GC2_OWN,
             "matmul_pass_overhead_cycles": (_A, "the figure fitted on Bow products (same tile design; GC2's only product points are ceilings of large products)"),
             "amp_fp16_output_channels": (_P, "8 conv units with FP16 or FP32 partials (PopLibs' GC2 AMP codelets, graphcore/poplibs@7eac0f26 lib/poplin/codelets/asm/conv_partial_1x1_half_half.S)"),
             "amp_fp32_output_channels": (_P, "8 conv units (PopLibs' GC2 float AMP codelets, graphcore/poplibs@7eac0f26 lib/poplin/codelets/asm/conv_partial_1x1_float_float.S): 8 x 8 MACs per 8 cycles = 16 FLOP/cycle, the 31.1 TFLOP/s peak"),
             **{k: (_A, f"the GC200/Bow end-to-end figure (same tile design; no GC2 run fitted): {why}")
                for k, (_, why) in _E2E_OWN.items()}},
    "ipu2": {**_COMMON, **_MK2_OWN, **_E2E_OWN},
    "bow": {**_COMMON, **_MK2_OWN, "clock_hz": (_P, "1.85 GHz (Graphcore Bow launch)"),
            **{f: _GC2_OWN[f] for f in ("amp_fp16_efficiency", "amp_fp32_efficiency",
                                        "matmul_pass_overhead_cycles")}, **_E2E_OWN},
}
_NOT_FIGURES = ("name", "product", "ipu_version")


def provenance(preset: str) -> dict[str, tuple[str, str]]:
    """Each figure of preset ``preset`` ("ipu1", "ipu2", "bow"): (kind, source or why), kind
    "published", "fitted" or "assumed"."""
    return dict(PROVENANCE[canonical_version(preset)])


def calibration_summary(preset: str) -> dict[str, int]:
    """How many of the preset's figures are published, fitted and assumed."""
    kinds = [k for k, _ in provenance(preset).values()]
    return {kind: kinds.count(kind) for kind in (_P, _F, _A)}


for _name, _target in PRESETS.items():
    _figures = {f.name for f in dataclasses.fields(_target)} - set(_NOT_FIGURES)
    if set(PROVENANCE[_name]) != _figures:
        raise RuntimeError(f"preset {_name}: figures without a provenance "
                           f"{sorted(_figures - set(PROVENANCE[_name]))}, provenance without a figure "
                           f"{sorted(set(PROVENANCE[_name]) - _figures)}")
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
