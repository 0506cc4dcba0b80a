"""The device server's counters: what ``GetCounters`` reports and how Prometheus reads it.

    every RPC ──> Counters (by name: rpcs.<Method>, errors.<CODE>, bytes_in, compiles, ...)
    Execute   ──> LatencyStats (a histogram and the recent window: p50, p99)
    GetCounters <── DeviceService.counter_values() ──> prometheus_text (the exposition format)

``COUNTER_HELP`` names the counters every reply carries (0 until counted) and says what each
counts; the gauges (sessions, IPUs, cache entries) are read when asked (service.py).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the Execute latency histogram.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                   5.0, 10.0, 30.0)


@dataclass
class Counters:
    """Thread-safe monotonically increasing counters, by name."""

    values: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.values[name] = self.values.get(name, 0) + amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class LatencyStats:
    """Durations of one kind of call: a cumulative histogram (``LATENCY_BUCKETS``) and the
    last ``window`` values, from which quantiles (p50, p99) are read."""

    def __init__(self, window: int = 4096) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.count = 0
        self.total_seconds = 0.0
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.count += 1
            self.total_seconds += seconds
            self._recent.append(seconds)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the recent window; 0.0 before any call."""
        with self._lock:
            values = sorted(self._recent)
        if not values:
            return 0.0
        return values[min(len(values) - 1, int(q * len(values)))]

    def snapshot(self) -> tuple[list[int], int, float]:
        """(per-bucket counts, count, sum of seconds)."""
        with self._lock:
            return list(self.buckets), self.count, self.total_seconds


COUNTER_HELP = {
    "sessions_opened": "Sessions opened.",
    "sessions_closed": "Sessions closed by their client.",
    "sessions_expired": "Sessions closed because their lease expired.",
    "compile_requests": "Compile calls that reached the cache.",
    "compiles": "Programs compiled by the emulator (misses of the cache in memory and of the "
                "one on disk, that succeeded or failed).",
    "cache_hits": "Compile calls answered from the executable cache (in memory or on disk).",
    "disk_cache_hits": "Executables loaded from the executable cache on disk (not compiled).",
    "disk_cache_misses": "Executables looked for on disk and not found there.",
    "disk_cache_writes": "Executables written to the executable cache on disk.",
    "disk_cache_rejected": "Entries of the disk cache not trusted (corrupt, foreign, stale, "
                           "not the module's): deleted, and the program compiled again.",
    "disk_cache_evictions": "Entries deleted from the disk cache to keep it within its bound.",
    "disk_cache_write_errors": "Entries that could not be written to the disk cache.",
    "disk_cache_plan_waits": "Compiles that waited for another server planning the same "
                             "program in the shared disk cache (then loaded its entry).",
    "executions": "Programs executed.",
    "replica_runs": "Replicas run by this server (a program of R replicas counts R: with "
                    "--mpi-world, this server's replicas of the run only).",
    "variable_buffers_allocated": "Buffers allocated for resident variables (new variables, "
                                  "or a new dtype or shape).",
    "variable_bytes_updated_in_place": "Bytes of resident variables updated in their buffers.",
    "bytes_in": "Request bytes received.",
    "bytes_out": "Reply bytes sent.",
    "errors": "RPCs that ended with an error status.",
    "error_kinds": "RPCs that ended with an error status, by kind.",
}


def prometheus_text(values: dict[str, int], latency: LatencyStats | None = None) -> str:
    """Renders ``DeviceService.counter_values()`` (and the Execute latencies) in the
    Prometheus text exposition format."""
    lines: list[str] = []
    prefix = "tf_ipu_device_"
    for name, help_text in COUNTER_HELP.items():
        if name in ("errors", "error_kinds"):
            continue
        metric = f"{prefix}{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter",
                  f"{metric} {values.get(name, 0)}"]
    for family, label, help_text in (
        ("errors", "code", COUNTER_HELP["errors"]),
        ("error_kinds", "kind", COUNTER_HELP["errors"]),
        ("rpcs", "method", "RPCs received."),
        ("runs_stopped", "reason", "Runs stopped before their end (cancel, deadline, ...)."),
        ("compiles_stopped", "reason", "Compiles stopped before their end (cancel, ...)."),
    ):
        metric = f"{prefix}{family}_total"
        lines += [f"# HELP {metric} {help_text} by {label}", f"# TYPE {metric} counter"]
        for name in sorted(values):
            if name.startswith(family + "."):
                lines.append(f'{metric}{{{label}="{name.split(".", 1)[1]}"}} {values[name]}')
    for name, help_text in (
        ("sessions_active", "Open sessions."),
        ("ipus_total", "IPUs hosted."),
        ("ipus_free", "IPUs not attached to a session."),
        ("executables_cached", "Executables in the server's cache."),
        ("rpcs_in_flight", "RPCs being served."),
        ("execute_streams_open", "ExecuteStreams open (each holds a worker thread)."),
    ):
        metric = f"{prefix}{name}"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge",
                  f"{metric} {values.get(name, 0)}"]
    lines += [f"# HELP {prefix}cache_evictions_total Executables evicted from the cache.",
              f"# TYPE {prefix}cache_evictions_total counter",
              f"{prefix}cache_evictions_total {values.get('cache_evictions', 0)}"]
    if latency is not None:
        buckets, count, total = latency.snapshot()
        metric = f"{prefix}execute_seconds"
        lines += [f"# HELP {metric} Wall time of successful Execute calls in the server.",
                  f"# TYPE {metric} histogram"]
        running = 0
        for bound, n in zip((*LATENCY_BUCKETS, "+Inf"), buckets, strict=True):
            running += n
            lines.append(f'{metric}_bucket{{le="{bound}"}} {running}')
        lines += [f"{metric}_sum {total:.6f}", f"{metric}_count {count}"]
        metric = f"{prefix}execute_recent_seconds"
        lines += [f"# HELP {metric} Quantiles of the wall time of the last Execute calls.",
                  f"# TYPE {metric} summary"]
        for q in (0.5, 0.9, 0.99):
            lines.append(f'{metric}{{quantile="{q}"}} {latency.quantile(q):.6f}')
        lines += [f"{metric}_sum {total:.6f}", f"{metric}_count {count}"]
    return "\n".join(lines) + "\n"
