"""Compile: a module to an executable, through the server's two caches, and the program's
first run after it was loaded from disk.

    CompileRequest ──> the module (inline, or a staged blob) and its options
                       (compile_requests.py, service_config.checked_test_switches)
                   ──> cache_key(module, target, options)
                   ──> ExecutableCache (memory, LRU) ── miss ──> DiskCache.planning(key)
                          (servers sharing the folder plan a program once) ──> the entry on
                          disk, or compile_module (stoppable: CancelRun, deadline, close)
                   <── a handle in the session, the signature and the tile model's estimate

A program of several instances (the run's world, ``--mpi-world``) also gets the digest the
servers compare before they run it together (``world_digests``, emulator/world.py).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from device_server.calls import STOP_STATUS, STOP_WHY, CallState
from device_server.compile_requests import (
    check_array_sizes,
    compile_error,
    numerics_options,
    pipeline_options,
    planning_options,
    replication_key,
)
from device_server.counters import Counters
from device_server.disk_cache import DiskCache
from device_server.emulator import (
    CompileOptions,
    EmulatorError,
    RunStopped,
    compile_module,
    executable_from_record,
)
from device_server.emulator.cancel import running
from device_server.emulator.world import program_digest
from device_server.executable_cache import ExecutableCache, cache_key
from device_server.protocol import device_pb2, dtypes, hardware, ir_pb2
from device_server.service_config import ServiceConfig, checked_test_switches
from device_server.sessions import ExecutableHandle, IpuPool, ServiceError, Session

logger = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class Programs:
    """The server's compiled programs: the executable cache in memory and the one on disk
    (optional), shared by every session; each session holds handles to them.

    Args:
        config: the server's options (cache bounds, the disk cache's folder, limits).
        counters: the server's counters (``compiles``, ``cache_hits``, ``disk_cache_*``).
        pool: the server's IPUs (a replicated program's system, without a named one).
        system: the server's named system, or None.
        call: the RPC each worker thread serves (stop tokens of compiles).

    Raises:
        ValueError: a disk cache folder that cannot be used (the server does not start).
    """

    def __init__(self, config: ServiceConfig, counters: Counters, pool: IpuPool,
                 system: hardware.System | None, call: CallState) -> None:
        self.config = config
        self.counters = counters
        self.pool = pool
        self.system = system
        self.call = call
        self.cache = ExecutableCache(config.cache_entries)
        # ValueError for a folder that cannot be used: the server does not start.
        self.disk_cache = (DiskCache(config.executable_cache_path, config.executable_cache_bytes)
                           if config.executable_cache_path else None)
        if self.disk_cache is not None:
            logger.info("executable cache on disk: %r", self.disk_cache)
        #: The run's device servers (``--mpi-world``: emulator/world.py), or None.
        self.world: Any = None
        #: Cache key -> digest the servers compare, of the programs of several instances.
        self.world_digests: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"Programs(cache={self.cache!r}, disk_cache={self.disk_cache!r})"

    def compile(self, s: Session, request: device_pb2.CompileRequest) -> device_pb2.CompileReply:
        """Compiles ``request``'s module for the entered session ``s`` (or finds it in a
        cache) and gives the session a handle to it."""
        if s.target is None:
            raise ServiceError(
                _PRECONDITION,
                f"Compile: session {s.session_id} has no IPUs attached; call AttachIpus "
                f"first (the architecture to compile for comes from it).",
            )
        module = request.module
        if request.module_blob_id:
            raw = s.data.take(request.module_blob_id, "Compile").array
            module = ir_pb2.Module()
            try:
                module.ParseFromString(memoryview(raw.reshape(-1).view(np.uint8)))
            except Exception as e:
                raise ServiceError(
                    _INVALID, f"Compile: the staged module ({raw.nbytes} bytes) is not a "
                    f"valid Module: {type(e).__name__}: {e}", kind="undecodable-request",
                ) from None
        refuse, fault = checked_test_switches(request.options, module.name, self.config)
        allow_oom = request.options.allow_out_of_memory
        numerics = numerics_options(request.options)
        planning = planning_options(request.options)
        pipeline = pipeline_options(request.options, module.name)
        replication = self.replication(s, request.options.replicas, module.name,
                                       pipeline.get("ipus_per_replica", 1),
                                       int(request.options.instances))
        extras = {**numerics, **replication_key(replication), **pipeline,
                  **{k: f"{v!r}" for k, v in planning.items()}}
        key = cache_key(module, s.ipu_version, s.tiles_per_ipu, refuse, fault, allow_oom,
                        extras)
        if replication.get("instances", 1) > 1:  # what the servers compare (world.py)
            self.world_digests[key] = program_digest(module, repr(sorted(
                {**extras, "target": (s.ipu_version, s.tiles_per_ipu), "refuse": sorted(refuse),
                 "fault": fault, "allow_oom": allow_oom}.items())))
        target = s.target
        options = CompileOptions(
            refuse_opcodes=refuse, fault_inject_opcode=fault, allow_out_of_memory=allow_oom,
            **numerics, **planning, **replication, **pipeline,
        )

        from_disk: list[bool] = []

        def build() -> Any:
            if self.disk_cache is None:
                return build_or_load()
            with self.disk_cache.planning(key):  # servers sharing it plan it once
                return build_or_load()

        def build_or_load() -> Any:
            if self.disk_cache is not None:
                check_array_sizes(module, self.config.max_session_bytes)
                exe = self._load_from_disk(key, module, target, options)
                if exe is not None:
                    from_disk.append(True)
                    return exe
            self.counters.add("compiles")
            check_array_sizes(module, self.config.max_session_bytes)
            try:
                exe = compile_module(module, target, options)
            except RunStopped:  # cancelled (_compile_stoppable says so)
                raise
            except Exception as e:
                mapped = compile_error(e, module.name)
                if mapped is e:
                    raise
                raise mapped from e
            if self.disk_cache is not None:
                self.disk_cache.store(key, exe.cache_record())
            return exe

        self.counters.add("compile_requests")
        lookup = self._compile_stoppable(s, key, build, module.name)
        hit = lookup.hit or bool(from_disk)
        if hit:
            self.counters.add("cache_hits")
        exe = lookup.executable
        handle_id = s.handle_by_key.get(key)
        if handle_id is None:
            handle_id = secrets.token_hex(16)
            s.handle_by_key[key] = handle_id
            s.executables[handle_id] = ExecutableHandle(handle_id, key, exe)
        logger.info(
            "session %s compiled %r -> %s (%s, %.3f s)", s.short_id, module.name,
            handle_id[:8], "loaded from the disk cache" if from_disk
            else "cache hit" if lookup.hit else "compiled", lookup.compile_seconds,
        )
        return device_pb2.CompileReply(
            executable_id=handle_id,
            cache_hit=hit,
            parameters=[tensor_spec(dt, shape) for dt, shape in exe.parameters],
            outputs=[tensor_spec(dt, shape if exe.options.replicas <= 1
                                  else (exe.options.replicas, *shape))
                     for dt, shape in exe.outputs],
            aliases=[
                ir_pb2.Alias(output_index=o, parameter_number=p)
                for o, p in sorted(exe.aliases.items())
            ],
            estimate=estimate(exe.estimate),
            compile_seconds=lookup.compile_seconds,
        )

    def _compile_stoppable(self, s: Session, key: str, build: Callable[[], Any],
                           module_name: str) -> Any:
        """``cache.get_or_compile(key, build)`` with a stop token, as a run has: CancelRun
        (Ctrl-C), the client going away or its deadline, the session closing and the server
        shutting down stop the planning at its next ``cancel.checkpoint``; nothing is cached
        and the session takes its next call at once. A compile of the same key that another
        call started and was stopped is compiled again here."""
        token = self.call.stop_token(0.0)
        with s.run(token), running(token):
            while True:
                try:
                    return self.cache.get_or_compile(key, build)
                except RunStopped as e:
                    if token.reason is None:  # another call's compile of this key stopped
                        continue
                    self.counters.add(f"compiles_stopped.{token.reason}")
                    code, kind = STOP_STATUS[token.reason]
                    raise ServiceError(
                        code, f"Compile of {module_name!r}: {e}; nothing was compiled or cached "
                        f"({STOP_WHY.get(token.reason, token.reason)}).", kind=kind) from None

    def replication(self, s: Session, replicas: int, module_name: str,
                     ipus_per_replica: int = 1, instances: int = 1) -> dict[str, Any]:
        """The emulator's replication options for a program of ``replicas`` replicas of
        ``ipus_per_replica`` IPUs each (a pipeline's), on the IPUs the session holds (in the
        server's system, or its plain IPUs), and of ``instances`` servers (the run's world);
        what the session or the server cannot run is refused, naming the numbers."""
        replicas = max(1, int(replicas))
        if instances > 1:
            world = self.world
            if world is None or world.size != instances:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Compile of module {module_name!r}: the program is one replicated program "
                    f"of {instances} instances (CompileOptions.instances), but this device "
                    + ("server is not part of a world of servers (start them as one MPI job "
                       "with --mpi-world, as tf-ipu-run does)." if world is None else
                       f"server's world has {world.size} servers."),
                    kind="world-mismatch")
        needed = replicas * ipus_per_replica
        held = len(s.ipu_ids)
        if needed > max(held, 1):
            per = f" of {ipus_per_replica} IPUs each" if ipus_per_replica > 1 else ", one per IPU"
            raise ServiceError(
                _INVALID,
                f"Compile of module {module_name!r}: the program has {replicas} replica"
                f"{'s' if replicas != 1 else ''}{per}, {needed} IPUs, but session "
                f"{s.session_id} holds {held} IPU{'s' if held != 1 else ''} ({s.ipu_ids}); "
                f"attach {needed} IPUs (IPUConfig.auto_select_ipus = {needed}).",
                kind="too-many-replicas",
            )
        if needed == 1 and instances <= 1:
            return {}
        system = self.system or hardware.plain_system(self.pool.num_ipus, s.ipu_version)
        # Every IPU of every replica: replica r on ipu_ids[r * P:(r + 1) * P].
        return {"replicas": replicas, "system": system, "ipu_ids": tuple(s.ipu_ids[:needed]),
                **({"instances": instances} if instances > 1 else {})}

    def _load_from_disk(self, key: str, module: ir_pb2.Module, target: Any,
                        options: CompileOptions) -> Any:
        """The executable of ``key`` made from its disk cache entry, or None (no entry, or
        one that is rejected: it does not describe this module)."""
        assert self.disk_cache is not None
        record = self.disk_cache.load(key)
        if record is None:
            return None
        try:
            exe = executable_from_record(module, target, options, record)
        except (ValueError, TypeError, EmulatorError) as e:
            self.disk_cache.reject(key, f"its record does not describe the program: {e}")
            return None
        self.counters.add("disk_cache_hits")
        return exe

    def generate_program(self, exe: Any, what: str) -> None:
        """Generates the program of an executable loaded from the disk cache (its first run)."""
        start = time.perf_counter()
        try:
            exe.ensure_program()
        except Exception as e:
            raise ServiceError(
                grpc.StatusCode.INTERNAL, f"{what}: generating the program of {exe.name!r} "
                f"(loaded from the executable cache on disk) failed: {type(e).__name__}: {e}",
                kind="execution",
            ) from e
        logger.info("generated the program of %r (loaded from the disk cache) in %.3f s",
                    exe.name, time.perf_counter() - start)


def tensor_spec(dtype: np.dtype, shape: tuple[int, ...]) -> device_pb2.TensorSpec:
    """The wire spec of an array type."""
    return device_pb2.TensorSpec(dtype=dtypes.from_numpy(dtype), dims=list(shape))


def estimate(est: Any) -> device_pb2.Estimate:
    """The tile model's estimate as the wire ``Estimate`` (its whole report as JSON)."""
    try:
        report = json.dumps(est.to_dict(), sort_keys=True, default=str)
    except (TypeError, ValueError) as e:
        report = json.dumps({"error": f"report not serializable: {e}"})
    def i64(x: Any) -> int:  # a figure past int64 (a loop of 2^60 trips) saturates; the JSON has it whole
        return max(-(1 << 63), min((1 << 63) - 1, int(x)))

    return device_pb2.Estimate(
        ipu_version=str(est.ipu_version),
        tiles_per_ipu=int(est.tiles_per_ipu),
        clock_hz=float(est.clock_hz),
        cycles=i64(est.cycles),
        seconds=float(est.seconds),
        peak_tile_bytes=i64(est.peak_tile_bytes),
        tile_bytes_limit=i64(est.tile_bytes_limit),
        total_bytes=i64(est.total_bytes),
        fits=bool(est.fits),  # False also when unknown: the report's "fits" is null then
        json=report,
    )
