"""Cycle costs of the pieces of a BSP superstep on one tile, from the target's figures.

A superstep is ``exchange -> sync -> compute`` (Poplar's order: data a compute set needs arrive
before it runs); it costs as much as its slowest tile in each phase:

* **compute**: a tile's work runs on up to ``worker_threads_per_tile`` (6) workers that share
  the tile's issue slots; the tile reaches its full rate only with all of them busy, so work
  that splits into fewer than six pieces runs at ``pieces / 6`` of it. Each piece is one worker
  vertex that pays ``vertex_overhead_cycles``. Work is the larger of its arithmetic at the rate
  of the unit that does it (AMP or vector, FP16 or FP32) and its tile-memory traffic at
  ``memory_bytes_per_cycle_per_tile`` x ``library_memory_efficiency`` (a roofline per tile;
  the efficiency is fitted to STREAM measured with Poplar's primitives);
* **sync**: ``sync_cycles`` per superstep;
* **exchange**: ``exchange_overhead_cycles`` plus the busiest tile's bytes in or out over
  ``exchange_bytes_per_cycle_per_tile`` (a tile sends and receives at that rate at once; one
  send may reach several tiles, so data needed by many tiles is counted once at the sender).
"""

from __future__ import annotations

import math

from device_server.emulator.arch import Target

__all__ = ["compute_cycles", "exchange_cycles", "host_seconds", "memory_rate", "staged_host_seconds",
           "vector_rate", "worker_pieces"]


def vector_rate(target: Target, itemsize: int) -> float:
    """Vector-unit FLOP/cycle/tile for elements of ``itemsize`` bytes (16-bit: the FP16 rate)."""
    if itemsize <= 2:
        return target.vector_fp16_flops_per_cycle_per_tile
    return target.vector_fp32_flops_per_cycle_per_tile


def memory_rate(target: Target) -> float:
    """Bytes per cycle a tile's library vertices move through its memory: the read port's
    rate times the share of it they sustain (fitted: ``library_memory_efficiency``)."""
    return target.memory_bytes_per_cycle_per_tile * target.library_memory_efficiency


def worker_pieces(target: Target, elements: float, itemsize: int) -> int:
    """Workers a tile's ``elements`` can keep busy (at least one vector each)."""
    per_vector = max(1, target.vector_bytes // max(1, itemsize))
    return max(1, min(target.worker_threads_per_tile, math.ceil(elements / per_vector)))


def compute_cycles(target: Target, flops: float, mem_bytes: float, rate: float,
                   pieces: int, vertices_per_worker: int = 1) -> float:
    """Cycles of one tile's part of a compute set (see module docstring)."""
    if flops <= 0 and mem_bytes <= 0:
        return 0.0
    workers = target.worker_threads_per_tile
    occupancy = max(1, min(workers, int(pieces))) / workers
    work = max(flops / (rate * occupancy), mem_bytes / (memory_rate(target) * occupancy))
    return work + target.vertex_overhead_cycles * max(1, vertices_per_worker)


def exchange_cycles(target: Target, max_bytes_in: float, max_bytes_out: float = 0.0) -> float:
    """Cycles of one exchange phase given the busiest tile's bytes in and out."""
    busiest = max(max_bytes_in, max_bytes_out)
    if busiest <= 0:
        return 0.0
    return target.exchange_overhead_cycles + busiest / target.exchange_bytes_per_cycle_per_tile


def host_seconds(target: Target, bytes_in: int, bytes_out: int, *, bytes_per_s: float = 0.0,
                 latency_s: float = -1.0, sharers: int = 1) -> float:
    """Time to stream ``bytes_in`` to the device and ``bytes_out`` back over the host link:
    the target's figures unless ``bytes_per_s`` / ``latency_s`` (a system's host link) are
    given; ``sharers`` devices moving as much at once over that link multiply the bytes (the
    latency is paid once per direction)."""
    rate = bytes_per_s if bytes_per_s > 0 else target.host_link_bytes_per_s
    latency = latency_s if latency_s >= 0 else target.host_link_latency_s
    total = 0.0
    for b in (bytes_in, bytes_out):
        if b > 0:
            total += latency + max(1, sharers) * b / rate
    return total * target.host_link_cycle_scale  # end-to-end scale (calibration.json; 1.0 unfitted)


def staged_host_seconds(target: Target, network_s: float, bytes_in: int, bytes_out: int,
                        staging_bytes_per_s: float, device_s: float) -> float:
    """The host transfers' share of a call's time when Poplar prefetches them through a staging
    area near the IPU (Streaming Memory, the IPU-Machine's DRAM: Graphcore's TensorFlow user
    guide, "Efficient IPU I/O", Prefetch elements; prefetch is on by default in Poplar, PopTorch
    user guide, "Efficient IPU I/O"). The host's transfer to and from the staging area
    (``network_s``, as ``host_seconds`` gives it) runs while the IPU computes; what blocks the
    IPU is the copy between the staging area and its tiles (the StreamCopyMid of a profile),
    ``bytes_in + bytes_out`` at ``staging_bytes_per_s``; overlapping that copy too needs I/O
    tiles (same guide, "I/O Tiles"), which the model does not plan. A call then takes
    max(device + copy, network): this returns the part beyond ``device_s``, max(copy, network
    - device). ``staging_bytes_per_s`` 0 (no staging area): ``network_s``, all serial."""
    if staging_bytes_per_s <= 0:
        return network_s
    copy = (bytes_in + bytes_out) / staging_bytes_per_s * target.host_link_cycle_scale
    return max(copy, network_s - max(0.0, device_s))
