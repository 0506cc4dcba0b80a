"""Fuzz target: a Compile request, through the IR decoder and the emulator's compiler.

    python tests/fuzz/fuzz_compile.py -max_total_time=300 SCRATCH tests/fuzz/corpus/compile

The input is a serialized ``device_pb2.CompileRequest`` (module and options), handled as
``DeviceService.compile`` does for a session holding four ipu2 IPUs (tiles_per_ipu 64, so
the tile model stays quick): the options through the service's checks, the array sizes
through its limit (64 MiB here, not the server's 4 GiB default: the fuzzer's own memory is
the bound), then ``compile_module``, its errors mapped by ``compile_requests.compile_error`` as the service maps them.

Expected: an undecodable request (INVALID_ARGUMENT), a ``ServiceError`` of any code but
INTERNAL. A finding: an error the service would map to INTERNAL (any exception other than
InvalidProgramError, ValueError, UnsupportedOpError, OutOfMemoryError), a crash or a hang.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Finding, main  # noqa: E402

MAX_ARRAY_BYTES = 64 << 20
IPUS = 4
_mods: dict[str, Any] = {}


def load() -> None:
    """Imports the code under test (lazily: see _common)."""
    if _mods:
        return
    import grpc
    from google.protobuf.message import DecodeError

    from device_server import compile_requests, service
    from device_server.emulator import CompileOptions, compile_module, get_target
    from device_server.executable_cache import cache_key
    from device_server.protocol import device_pb2, hardware
    from device_server.sessions import ServiceError

    _mods.update(grpc=grpc, DecodeError=DecodeError, service=service, requests=compile_requests,
                 CompileOptions=CompileOptions, compile_module=compile_module,
                 target=get_target("ipu2", tiles_per_ipu=64), device_pb2=device_pb2,
                 hardware=hardware, ServiceError=ServiceError, cache_key=cache_key)


def _compile(data: bytes) -> None:
    m = _mods
    service, requests = m["service"], m["requests"]
    try:
        request = m["device_pb2"].CompileRequest.FromString(data)
    except (m["DecodeError"], RecursionError):
        return  # the service's decoder refuses it: INVALID_ARGUMENT
    module, opts = request.module, request.options
    numerics = requests.numerics_options(opts)
    planning = requests.planning_options(opts)
    pipeline = requests.pipeline_options(opts, module.name)
    replication: dict[str, Any] = {}
    replicas = max(1, int(opts.replicas))
    needed = replicas * pipeline.get("ipus_per_replica", 1)
    if needed > IPUS:
        return  # Programs.replication (programs.py) refuses it: INVALID_ARGUMENT
    if needed > 1:
        replication = {"replicas": replicas, "ipu_ids": tuple(range(needed)),
                       "system": m["hardware"].plain_system(IPUS, "ipu2")}
    options = m["CompileOptions"](allow_out_of_memory=opts.allow_out_of_memory, **numerics,
                                  **planning, **replication, **pipeline)
    m["cache_key"](module, "ipu2", 64, frozenset(), "", opts.allow_out_of_memory, numerics)
    requests.check_array_sizes(module, MAX_ARRAY_BYTES)
    try:
        exe = m["compile_module"](module, m["target"], options)
    except Exception as e:
        mapped = requests.compile_error(e, module.name)
        if mapped is e:
            raise
        raise mapped from e
    # The reply the service builds from the executable.
    reply = m["device_pb2"].CompileReply(
        parameters=[service._tensor_spec(dt, shape) for dt, shape in exe.parameters],
        outputs=[service._tensor_spec(dt, shape) for dt, shape in exe.outputs],
        estimate=service._estimate(exe.estimate))
    reply.SerializeToString()


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' spelling)
    """Compiles the request in ``data``; raises on a finding."""
    load()
    try:
        _compile(data)
    except _mods["ServiceError"] as e:
        if e.code == _mods["grpc"].StatusCode.INTERNAL:
            raise Finding(f"INTERNAL: {e.message}") from e


if __name__ == "__main__":
    main(TestOneInput, load, ["device_server"])
