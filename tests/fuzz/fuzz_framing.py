"""Fuzz target: the chunk and shared-memory framing of tensors, both sides of the data path.

    python tests/fuzz/fuzz_framing.py -max_total_time=300 SCRATCH tests/fuzz/corpus/framing

The input is ``[mode byte]`` then frames (``_common.frames``: 16-bit length, bytes). One
64 KiB shared-memory segment (made once, in the temporary directory) is attached as segment
1 on both sides.

- mode 0, the server (``device_server/data_path.py``): frames 1.. are the messages of a
  PutBlob stream (``chunks.parse_chunk``, then the service's checks of ``total_bytes``
  against its per-session limit, 64 MiB here, and ``receive_blob``), staged as blob ``"b0"``;
  frame 0 is a request ``Tensor`` (inline bytes, a blob id or a region of the segment)
  decoded by ``tensor_value``, whose value then goes back as a reply tensor
  (``fill_reply_tensor``, into the request's region if it named one; a blob when too big).
  Expected: an undecodable message, a ``ServiceError`` of any code but INTERNAL.
- mode 1, the host (``tf_ipu/transport.py``): frame 0 is a reply ``Tensor`` decoded by
  ``Call.decode``; frames 1.. are the GetBlob stream the stub server answers with.
  Expected: the client's errors (``tf_ipu.errors.DeviceError``: a reply that breaks the
  protocol is an InternalError naming it) and ``ValueError`` (``dtypes.from_tensor``'s
  size and type checks, naming the tensor).
- mode 2: frame 0 is an ``AttachSharedMemoryRequest`` given to ``shm.Segment.attach``
  (expected: ``ShmUnavailable``).

A finding: any other exception (MemoryError included: sizes must be checked before
anything is allocated), a crash or a hang.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Finding, frames, main  # noqa: E402

SEGMENT_BYTES = 64 << 10
MAX_SESSION_BYTES = 64 << 20
MAX_MESSAGE_BYTES = 1 << 20
_mods: dict[str, Any] = {}


def load() -> None:
    """Imports the code under test (lazily: see _common) and makes the segment."""
    if _mods:
        return
    import grpc
    from google.protobuf.message import DecodeError

    from device_server import data_path
    from device_server.protocol import chunks, device_pb2, shm
    from device_server.sessions import ServiceError
    from tf_ipu import errors, transport

    segment = shm.Segment.create(SEGMENT_BYTES, tempfile.gettempdir(), margin=0)
    segment.unlink()
    _mods.update(grpc=grpc, DecodeError=DecodeError, data_path=data_path, chunks=chunks,
                 device_pb2=device_pb2, shm=shm, ServiceError=ServiceError, errors=errors,
                 transport=transport, segment=segment)


def _server(parts: list[bytes]) -> None:
    m = _mods
    dp, pb = m["data_path"], m["device_pb2"]
    data = dp.SessionData()
    data.segments[1] = m["segment"]
    counters = dp.TransferCounters()
    if len(parts) > 1:
        try:
            stream = [m["chunks"].parse_chunk(p) for p in parts[1:]]
        except m["DecodeError"]:
            return  # the request deserializer refuses it: INVALID_ARGUMENT
        first = stream[0]
        total = int(first.total_bytes)  # DeviceService.put_blob's checks
        if total < 0:
            return
        if total > MAX_SESSION_BYTES:
            return  # RESOURCE_EXHAUSTED
        data.reserve(total)
        try:
            blob = dp.receive_blob(iter(stream[1:]), first, data, counters)
        finally:
            data.release(total)
        data.blobs_in["b0"] = blob
    try:
        tensor = pb.Tensor.FromString(parts[0] if parts else b"")
    except m["DecodeError"]:
        return
    value = dp.tensor_value(data, tensor, "fuzz tensor", counters)
    region = tensor.shm if tensor.WhichOneof("payload") == "shm" else None
    reply = pb.ReadVariablesReply()
    dp.fill_reply_tensor(data, reply.variables.add(key="v").tensor, value,
                         dp.ReplyBudget(MAX_MESSAGE_BYTES), region, counters)
    reply.SerializeToString()
    for blob_id, array in list(data.blobs_out.items()):
        for chunk in dp.send_blob(array, 4096, counters):
            m["chunks"].parse_chunk(chunk.SerializeToString())
        del data.blobs_out[blob_id]


class _StubClient:
    """What ``DataPath`` uses of a ``DeviceClient``: GetBlob answers with the given chunks."""

    def __init__(self, chunk_bytes: list[bytes]) -> None:
        self.session = SimpleNamespace(max_message_bytes=MAX_MESSAGE_BYTES,
                                       max_session_bytes=MAX_SESSION_BYTES)
        self.session_id = "fuzz"
        self.address = "fuzz"
        self._chunks = chunk_bytes

    def _call_stream_out(self, method: str, request: Any) -> Any:
        for raw in self._chunks:
            try:
                yield _mods["chunks"].parse_chunk(raw)
            except _mods["DecodeError"] as e:
                # gRPC ends the call when its response deserializer fails.
                raise _mods["errors"].InternalError(f"{method}: undecodable reply: {e}") from None


def _client(parts: list[bytes]) -> None:
    m = _mods
    try:
        tensor = m["device_pb2"].Tensor.FromString(parts[0] if parts else b"")
    except m["DecodeError"]:
        return  # gRPC refuses the reply
    path = m["transport"].DataPath(_StubClient(parts[1:]), mode="shm")
    path.kind = "shm"
    path._segment, path._segment_id = m["segment"], 1
    path._allocator = m["shm"].RegionAllocator(m["segment"].nbytes)
    with path.call() as call:
        call.decode(tensor, "fuzz output")


def _attach(parts: list[bytes]) -> None:
    m = _mods
    try:
        request = m["device_pb2"].AttachSharedMemoryRequest.FromString(parts[0] if parts else b"")
    except m["DecodeError"]:
        return
    try:
        m["shm"].Segment.attach(request.name, int(request.nbytes), request.nonce,
                                tempfile.gettempdir()).close()
    except m["shm"].ShmUnavailable:
        return


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' spelling)
    """Runs the framing in ``data`` (see the module docstring); raises on a finding."""
    load()
    m = _mods
    if not data:
        return
    mode, parts = data[0] % 3, frames(data[1:])
    m["segment"].buffer(m["shm"].HEADER_BYTES, SEGMENT_BYTES - m["shm"].HEADER_BYTES)[:] = (
        bytes(SEGMENT_BYTES - m["shm"].HEADER_BYTES))
    try:
        if mode == 0:
            _server(parts)
        elif mode == 1:
            _client(parts)
        else:
            _attach(parts)
    except m["ServiceError"] as e:
        if e.code == m["grpc"].StatusCode.INTERNAL:
            raise Finding(f"INTERNAL: {e.message}") from e
    except m["errors"].DeviceError:
        if mode != 1:
            raise
    except ValueError:
        if mode != 1:
            raise


if __name__ == "__main__":
    main(TestOneInput, load, ["device_server", "tf_ipu.transport"])
