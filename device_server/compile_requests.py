"""A Compile request's checks, before the emulator sees it: its options turned into the
emulator's ``CompileOptions`` fields, its arrays against the session's byte limit, and the
emulator's compile errors turned into the status the client sees.

    CompileRequest.options --> numerics_options / planning_options / pipeline_options
                               (INVALID_ARGUMENT naming the field and the value)
    CompileRequest.module  --> check_array_sizes (RESOURCE_EXHAUSTED before allocation)
    compile_module(...) raises --> compile_error: UNIMPLEMENTED, RESOURCE_EXHAUSTED,
                                   INVALID_ARGUMENT; INTERNAL only for the emulator's own bugs

Used by ``Programs.compile`` (programs.py) and by the Compile fuzz target
(tests/fuzz/fuzz_compile.py), so both refuse the same requests the same way.
"""

from __future__ import annotations

from typing import Any

import grpc

from device_server.emulator import (
    EmulatorError,
    InvalidProgramError,
    OutOfMemoryError,
    UnsupportedOpError,
)
from device_server.emulator.tiles.pipeline import MAX_PIPELINE_STAGES
from device_server.emulator.tiles.proportions import check_entry
from device_server.protocol import device_pb2, dtypes, ir_pb2
from device_server.sessions import ServiceError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def check_array_sizes(module: ir_pb2.Module, limit: int) -> None:
    """Refuses a module with an array larger than ``limit`` bytes (0: no limit) before the
    emulator sees it: constant folding at compile time would allocate it."""
    if limit <= 0:
        return

    def nbytes(shape: ir_pb2.Shape, depth: int = 0) -> int:
        if shape.is_tuple:
            if depth > 64:
                raise ServiceError(_INVALID, f"Compile of module {module.name!r}: tuple shapes "
                                   f"nested deeper than 64.", kind="invalid-program")
            return max((nbytes(t, depth + 1) for t in shape.tuple_shapes), default=0)
        if shape.dtype == ir_pb2.TOKEN:
            return 0
        try:
            itemsize = dtypes.to_numpy(shape.dtype).itemsize
        except ValueError:
            return 0  # the emulator names the bad dtype
        dims = list(shape.dims)
        if not dims or 0 in dims or min(dims) < 0:
            return itemsize if not dims else 0  # empty, or a bad dimension the emulator names
        count = 1
        for d in dims:
            count *= d
            if count > limit:  # stop before the product grows without bound
                break
        return count * itemsize

    for comp in module.computations:
        for instr in comp.instructions:
            size = nbytes(instr.shape)
            if size > limit:
                raise ServiceError(
                    _EXHAUSTED,
                    f"Compile of module {module.name!r}: instruction {instr.name!r} "
                    f"({instr.opcode}) makes an array of {size} bytes, more than the server "
                    f"allows one session ({limit} bytes, --max-session-bytes).",
                    kind="out-of-memory",
                )


def numerics_options(options: device_pb2.CompileOptions) -> dict[str, Any]:
    """The emulator ``CompileOptions`` fields for a request's numerics (partials, stochastic
    rounding, floating-point exception checks); defaults when the request says nothing."""
    fp = options.floating_point_behaviour
    out: dict[str, Any] = {}
    for name in ("matmul_partials_type", "convolution_partials_type"):
        value = getattr(options, name)
        if value not in ("", "float", "half"):
            raise ServiceError(_INVALID, f"Compile: CompileOptions.{name} must be 'float' or "
                               f"'half', not {value!r}.", kind="invalid-options")
        out[name] = value or "float"
    for name in ("inv", "div0", "oflo", "esr", "nanoo"):
        out[name] = bool(getattr(fp, name))
    out["stochastic_rounding_seed"] = int(options.stochastic_rounding_seed)
    return out


def planning_options(options: device_pb2.CompileOptions) -> dict[str, float]:
    """The emulator ``CompileOptions`` fields of PopLibs' availableMemoryProportion (only those
    the request sets: unset is the preset's), checked to be in [0, 1]."""
    out: dict[str, float] = {}
    for name in ("matmul_available_memory_proportion", "convolution_available_memory_proportion"):
        if not options.HasField(name):
            continue
        value = float(getattr(options, name))
        if not 0.0 <= value <= 1.0:  # also NaN
            raise ServiceError(_INVALID, f"Compile: CompileOptions.{name} must be in [0, 1] "
                               f"(availableMemoryProportion), not {value!r}.",
                               kind="invalid-options")
        out[name] = value
    return out


def pipeline_options(options: device_pb2.CompileOptions, module_name: str) -> dict[str, Any]:
    """The emulator ``CompileOptions`` fields of a pipelined program (empty when it is not
    pipelined), checked: a stage mapped to an IPU the replica does not span, a schedule of
    another name, no micro-batches are refused naming the numbers."""
    stages = int(options.pipeline_stages)
    where = f"Compile of module {module_name!r}"
    if stages <= 1 and not options.stage_ipus:
        return stage_proportion_options(options, 1, where)
    if stages > MAX_PIPELINE_STAGES or len(options.stage_ipus) > MAX_PIPELINE_STAGES:
        raise ServiceError(_INVALID, f"{where}: CompileOptions.pipeline_stages must be at most "
                           f"{MAX_PIPELINE_STAGES} (stage_ipus as many). Received: "
                           f"pipeline_stages={stages}, {len(options.stage_ipus)} stage_ipus.",
                           kind="invalid-options")
    stage_ipus = tuple(int(i) for i in options.stage_ipus) or tuple(range(stages))
    if len(stage_ipus) != stages:
        raise ServiceError(_INVALID, f"{where}: stage_ipus {list(stage_ipus)} names {len(stage_ipus)} "
                           f"IPUs for {stages} pipeline stages (one per stage).",
                           kind="invalid-options")
    per_replica = int(options.ipus_per_replica) or max(stage_ipus) + 1
    if max(stage_ipus) >= per_replica or per_replica & (per_replica - 1):
        raise ServiceError(_INVALID, f"{where}: a replica spans {per_replica} IPUs (a power "
                           f"of two), so stages can be mapped to IPUs 0 .. {per_replica - 1}; "
                           f"stage_ipus is {list(stage_ipus)}.", kind="invalid-options")
    schedule = options.pipeline_schedule or "grouped"
    if schedule not in ("grouped", "interleaved", "sequential"):
        raise ServiceError(_INVALID, f"{where}: pipeline_schedule must be 'grouped', "
                           f"'interleaved' or 'sequential', not {schedule!r}.",
                           kind="invalid-options")
    return {"pipeline_stages": stages, "stage_ipus": stage_ipus, "ipus_per_replica": per_replica,
            "pipeline_schedule": schedule, "micro_batches": max(1, int(options.micro_batches)),
            "recomputation": bool(options.recomputation),
            **optimizer_state_options(options, where),
            **stage_proportion_options(options, stages, where)}


def stage_proportion_options(options: device_pb2.CompileOptions, stages: int,
                             where: str) -> dict[str, Any]:
    """A pipeline's per-stage availableMemoryProportion (``PipelineStageOptions``) as the
    emulator's ``stage_memory_proportions`` entries (empty: none given), checked: a phase or
    kind of another name, a stage the program lacks, a proportion outside [0, 1] are refused
    naming the entry."""
    if not options.stage_memory_proportions:
        return {}
    entries = []
    for e in options.stage_memory_proportions:
        try:
            entries.append(check_entry((e.phase, int(e.stage), e.kind, float(e.proportion)),
                                       max(1, stages)))
        except ValueError as err:
            raise ServiceError(_INVALID, f"{where}: CompileOptions.stage_memory_proportions: "
                               f"{err}", kind="invalid-options") from None
    return {"stage_memory_proportions": tuple(entries)}


def optimizer_state_options(options: device_pb2.CompileOptions, where: str) -> dict[str, Any]:
    """A pipelined program's optimizer-state placement (offload and sharding), checked."""
    offload = options.optimizer_state_offload or "auto"
    if offload not in ("auto", "on", "off"):
        raise ServiceError(_INVALID, f"{where}: optimizer_state_offload must be 'auto', 'on' "
                           f"or 'off', not {offload!r}.", kind="invalid-options")
    return {"optimizer_state_offload": offload,
            "optimizer_state_sharding": bool(options.optimizer_state_sharding)}


def replication_key(replication: dict[str, Any]) -> dict[str, Any]:
    """What of the replication options identifies an executable (its estimate depends on
    the system's links and the IPUs the replicas run on)."""
    if not replication:
        return {}
    key = {"replicas": replication["replicas"], "system": replication["system"].name,
           "ipu_ids": ",".join(str(i) for i in replication["ipu_ids"])}
    if replication.get("instances", 1) > 1:  # one program across the run's servers
        key["instances"] = replication["instances"]
    return key


def compile_error(error: Exception, module_name: str) -> Exception:
    """Maps an emulator compile error to the ``ServiceError`` the client should see."""
    where = f"Compile of module {module_name!r}"
    if isinstance(error, ServiceError):
        return error
    if isinstance(error, UnsupportedOpError):
        return ServiceError(grpc.StatusCode.UNIMPLEMENTED, f"{where}: {error}", kind="unsupported-op")
    if isinstance(error, OutOfMemoryError):
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{where}: {error}",
                            kind="out-of-memory")
    if isinstance(error, (InvalidProgramError, ValueError)):
        return ServiceError(_INVALID, f"{where}: {error}", kind="invalid-program")
    if isinstance(error, EmulatorError):
        return ServiceError(grpc.StatusCode.INTERNAL, f"{where}: {type(error).__name__}: {error}")
    return error
