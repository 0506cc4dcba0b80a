"""Fuzz target: entries of the executable cache on disk, read back into an executable.

    python tests/fuzz/fuzz_disk_cache.py -max_total_time=300 SCRATCH tests/fuzz/corpus/disk_cache

The input is ``[module byte][mode byte][payload]``. The module byte picks one of the small
modules of :func:`modules` (``cache_record`` of each made the seed entries). Mode 0 (mod 3):
the payload is an entry file's bytes (``disk_cache.decode_entry`` under the fixed key
:data:`KEY`: magic, header, sha256, zlib, JSON). Mode 1: the payload is a record's JSON,
wrapped in an entry with a correct header and sha256 (as whoever can write the folder can
make one), so the search reaches the record's checks instead of stopping at the hash. Mode
2: the module's true record with fields replaced, a byte pair each (which field of the
record or its estimate, which value of :data:`EXTREMES`), wrapped the same way: JSON
mutations rarely keep the record parseable, these always do.

Then, as ``Programs._load_from_disk`` and ``compile`` do: ``executable_from_record``
(``ValueError``, ``TypeError`` and ``EmulatorError`` are expected: the service rejects the
entry and compiles again), and for an accepted record the Compile reply (signature and
``_estimate``) and the estimate's report. Anything else raising is a finding (the service
would answer INTERNAL).
"""

from __future__ import annotations

import hashlib
import json
import sys
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Finding, main  # noqa: E402

KEY = "5eed" * 16
#: Values mode 2 puts into a record's fields.
EXTREMES: list = [0, 1, -1, 2, 64, 2**31, 2**63 - 1, -(2**63), 2**64, 10**30, 0.0, -0.0, 0.5, 1e-300,
                  1e308, float("inf"), float("-inf"), float("nan"), "", "ipu2", "ipu1", "x" * 300,
                  None, True, False, [], [0], [[0, 0]], {}, {"a": 1}, [1e308, -1]]
_mods: dict[str, Any] = {}


def modules() -> list[Any]:
    """The modules the entries describe: f32[4] + f32[4]; and a tuple (sum, x) whose second
    output aliases parameter 0 with a reduce over a called computation."""
    from device_server.protocol import ir_pb2

    def shape(dims: list[int], dtype: int = ir_pb2.F32) -> Any:
        return ir_pb2.Shape(dtype=dtype, dims=dims)

    add = ir_pb2.Module(name="add", entry_computation_id=1)
    c = add.computations.add(id=1, name="main", root_id=3)
    c.instructions.add(id=1, name="x", opcode="parameter", shape=shape([4]), parameter_number=0)
    c.instructions.add(id=2, name="y", opcode="parameter", shape=shape([4]), parameter_number=1)
    c.instructions.add(id=3, name="add", opcode="add", shape=shape([4]), operands=[1, 2])

    red = ir_pb2.Module(name="reduce", entry_computation_id=1)
    s = red.computations.add(id=2, name="sum", root_id=13)
    s.instructions.add(id=11, name="a", opcode="parameter", shape=shape([]), parameter_number=0)
    s.instructions.add(id=12, name="b", opcode="parameter", shape=shape([]), parameter_number=1)
    s.instructions.add(id=13, name="ab", opcode="add", shape=shape([]), operands=[11, 12])
    c = red.computations.add(id=1, name="main", root_id=5)
    c.instructions.add(id=1, name="x", opcode="parameter", shape=shape([2, 3]), parameter_number=0)
    zero = c.instructions.add(id=2, name="zero", opcode="constant", shape=shape([]))
    zero.attrs["value"].literal.shape.CopyFrom(shape([]))
    zero.attrs["value"].literal.data = b"\0\0\0\0"
    r = c.instructions.add(id=3, name="r", opcode="reduce", shape=shape([2]), operands=[1, 2],
                           called_computations=[2])
    r.attrs["dimensions"].ints.values.append(1)
    c.instructions.add(id=4, name="neg", opcode="negate", shape=shape([2, 3]), operands=[1])
    out = c.instructions.add(id=5, name="out", opcode="tuple", operands=[3, 4])
    out.shape.is_tuple = True
    out.shape.tuple_shapes.extend([shape([2]), shape([2, 3])])
    red.aliases.add(output_index=1, parameter_number=0)
    return [add, red]


def load() -> None:
    """Imports the code under test (lazily: see _common)."""
    if _mods:
        return
    import grpc

    from device_server import disk_cache, service
    from device_server.emulator import (
        CompileOptions,
        EmulatorError,
        executable_from_record,
        get_target,
    )
    from device_server.protocol import device_pb2
    from device_server.sessions import ServiceError

    _mods.update(grpc=grpc, disk_cache=disk_cache, service=service, options=CompileOptions(),
                 EmulatorError=EmulatorError, from_record=executable_from_record,
                 target=get_target("ipu2", tiles_per_ipu=64), device_pb2=device_pb2,
                 ServiceError=ServiceError, modules=modules())
    from device_server.emulator import compile_module

    _mods["records"] = [compile_module(mod, _mods["target"], _mods["options"]).cache_record()
                        for mod in _mods["modules"]]


def wrap_record(record_json: bytes) -> bytes:
    """An entry for :data:`KEY` with a correct header holding ``record_json`` (compressed)."""
    dc = _mods["disk_cache"]
    content = zlib.compress(record_json, 6)
    header = {"format": dc.FORMAT, "version": dc.device_server.__version__,
              "build": dc.build_id(), "key": KEY, "created": 0.0,
              "content_bytes": len(content), "content_sha256": hashlib.sha256(content).hexdigest()}
    return dc.MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + content


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' spelling)
    """Reads the entry in ``data`` back into an executable; raises on a finding."""
    load()
    m = _mods
    if len(data) < 2:
        return
    module = m["modules"][data[0] % len(m["modules"])]
    payload = data[2:]
    mode = data[1] % 3
    if mode == 2:
        record = json.loads(json.dumps(m["records"][data[0] % len(m["records"])]))
        est = record["estimate"]
        keys = [(record, k) for k in sorted(record)] + [(est, k) for k in sorted(est)]
        for i in range(0, len(payload) - 1, 2):
            holder, k = keys[payload[i] % len(keys)]
            holder[k] = EXTREMES[payload[i + 1] % len(EXTREMES)]
        payload = json.dumps(record, allow_nan=True).encode()
    entry = wrap_record(payload) if mode else payload
    try:
        record = m["disk_cache"].decode_entry(entry, KEY)
    except m["disk_cache"].EntryRejected:
        return  # logged, deleted, compiled again
    try:
        exe = m["from_record"](module, m["target"], m["options"], record)
    except (ValueError, TypeError, m["EmulatorError"]):
        return  # Programs._load_from_disk rejects the entry
    service = m["service"]
    try:
        reply = m["device_pb2"].CompileReply(
            parameters=[service._tensor_spec(dt, shape) for dt, shape in exe.parameters],
            outputs=[service._tensor_spec(dt, shape) for dt, shape in exe.outputs],
            estimate=service._estimate(exe.estimate))
        reply.SerializeToString()
        json.dumps(exe.estimate.to_dict(), default=str)
        exe.estimate.summary()
    except m["ServiceError"] as e:
        if e.code == m["grpc"].StatusCode.INTERNAL:
            raise Finding(f"INTERNAL: {e.message}") from e
    except Exception as e:
        raise Finding(f"an accepted cache entry breaks the Compile reply: "
                      f"{type(e).__name__}: {e}") from e


if __name__ == "__main__":
    main(TestOneInput, load, ["device_server"])
