"""A session's resident variables, and the bulk data around them: blobs and shared memory.

    WriteVariables ──> values decoded (inline, blob, shared memory; data_path.py), checked
                       against --max-session-bytes, then stored: into the variable's buffer
                       when the dtype and shape are the same, else a new one
    ReadVariables  <── each variable inline, into the region the request named, or as a blob
    PutBlob        ──> chunks staged in the session (reserved first, within its limit)
    GetBlob        <── a blob a reply named, in chunks, then forgotten
    AttachSharedMemory ──> the client's segment mapped (the co-location probe), or why not

Execute stores the variables a program updated through ``Variables.store`` (execution.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from device_server.calls import CallState
from device_server.counters import Counters
from device_server.data_path import (
    DEFAULT_CHUNK_BYTES,
    Blob,
    ReplyBudget,
    TransferCounters,
    fill_reply_tensor,
    receive_blob,
    send_blob,
    tensor_value,
)
from device_server.protocol import device_pb2, shm
from device_server.service_config import ServiceConfig
from device_server.sessions import ServiceError, Session, SessionManager

logger = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class Variables:
    """The variables, blobs and shared-memory segments of the server's sessions.

    Attributes:
        config: the server's options (``max_session_bytes``, ``max_message_bytes``).
        counters: the server's counters (``variable_buffers_allocated``, ``shm_*``, ...).
        transfers: bytes by path (data_path.py).
        sessions: the server's sessions.
        call: the RPC each worker thread serves (entering a session within its deadline).
    """

    config: ServiceConfig
    counters: Counters
    transfers: TransferCounters
    sessions: SessionManager
    call: CallState = field(repr=False)

    def write(self, s: Session, request: device_pb2.WriteVariablesRequest) -> device_pb2.Empty:
        """Stores the request's values as the entered session's variables, all or none."""
        decoded: dict[str, np.ndarray] = {}
        adopted: set[str] = set()  # values that are staged blobs: kept as they are
        for i, named in enumerate(request.variables):
            if not named.key:
                raise ServiceError(_INVALID, f"WriteVariables: variable #{i} has an empty key.")
            what = f"WriteVariables: variable {named.key!r}"
            decoded[named.key] = tensor_value(s.data, named.tensor, what, self.transfers)
            if named.tensor.WhichOneof("payload") == "blob_id":
                adopted.add(named.key)
        limit = self.config.max_session_bytes
        if limit > 0:
            held = s.variable_bytes()
            after = held + s.data.staged_bytes() + sum(
                v.nbytes - (s.variables[k].nbytes if k in s.variables else 0)
                for k, v in decoded.items()
            )
            if after > limit:
                raise ServiceError(
                    _EXHAUSTED,
                    f"WriteVariables: session {s.session_id} would hold {after} bytes of "
                    f"resident variables, over the server's limit of {limit} bytes per "
                    f"session (--max-session-bytes); it holds {held} bytes in "
                    f"{len(s.variables)} variables now.",
                    kind="session-memory",
                )
        for key, value in decoded.items():  # all or nothing: every value decoded first
            s.replica_variables.pop(key, None)  # the host's value goes to every replica
            if key in adopted:
                s.variables[key] = value  # a staged blob: the buffer becomes the variable
                self.counters.add("variable_buffers_allocated")
            else:
                self.store(s, key, value)
        return device_pb2.Empty()

    def store(self, s: Session, key: str, value: np.ndarray) -> None:
        """Makes ``value`` the session's variable ``key``: written into the buffer the
        variable has when the dtype and shape are the same (as XLA writes an output into a
        donated parameter's buffer), else into a new buffer (``variable_buffers_allocated``).
        The emulator may have written it there already (``value is`` the buffer)."""
        held = s.variables.get(key)
        if held is value:
            self.counters.add("variable_bytes_updated_in_place", value.nbytes)
        elif (held is not None and held.dtype == value.dtype and held.shape == value.shape
                and held.flags.writeable and held.flags.c_contiguous):
            np.copyto(held, value)
            self.counters.add("variable_bytes_updated_in_place", value.nbytes)
        else:
            if not (value.flags.writeable and value.flags.c_contiguous and value.flags.owndata):
                value = np.array(value, order="C")  # owned, not a view of a request's bytes
            s.variables[key] = value
            self.counters.add("variable_buffers_allocated")

    def read(self, s: Session,
             request: device_pb2.ReadVariablesRequest) -> device_pb2.ReadVariablesReply:
        """The values of the variables the request names, from the entered session."""
        reply = device_pb2.ReadVariablesReply()
        budget = ReplyBudget(self.config.max_message_bytes)
        for key in request.keys:
            value = s.variables.get(key)
            if value is None:
                raise ServiceError(
                    _NOT_FOUND,
                    f"ReadVariables: session {s.session_id} has no variable {key!r} "
                    f"({len(s.variables)} variables resident).",
                    kind="unknown-variable",
                )
            region = request.regions[key] if key in request.regions else None
            fill_reply_tensor(s.data, reply.variables.add(key=key).tensor, value, budget,
                              region, self.transfers)
        return reply

    def put_blob(self, first: device_pb2.BlobChunk, rest: Any) -> device_pb2.BlobRef:
        """Stages a stream of chunks in the session, within its memory limit."""
        s = self.sessions.get(first.session_id)
        total = int(first.total_bytes)
        if total < 0:
            raise ServiceError(_INVALID, f"PutBlob: total_bytes is {total}.")
        limit = self.config.max_session_bytes
        with self.call.enter(self.sessions, first.session_id):
            replaced = s.data.replaced_keys() | ({first.replaces_variable} - {""})
            held = sum(v.nbytes for k, v in s.variables.items() if k not in replaced)
            staged = s.data.staged_bytes()
            if limit > 0 and held + staged + total > limit:
                raise ServiceError(
                    _EXHAUSTED,
                    f"PutBlob: session {s.session_id} would hold {held + staged + total} bytes "
                    f"({held} in resident variables, {staged} staged, {total} in this blob), "
                    f"over the server's limit of {limit} bytes per session "
                    f"(--max-session-bytes).",
                    kind="session-memory",
                )
            s.data.reserve(total)
        try:
            blob: Blob = receive_blob(iter(rest), first, s.data, self.transfers, s.touch)
        finally:
            s.data.release(total)
        with self.call.enter(self.sessions, first.session_id):
            return device_pb2.BlobRef(blob_id=s.data.put(blob))

    def get_blob(self, request: device_pb2.GetBlobRequest) -> Iterator[device_pb2.BlobChunk]:
        """The chunks of a blob a reply named (forgotten at once: a blob is sent once)."""
        with self.call.enter(self.sessions, request.session_id) as s:
            array = s.data.blobs_out.pop(request.blob_id, None)
            if array is None:
                raise ServiceError(
                    _NOT_FOUND, f"GetBlob: session {s.session_id} has no blob "
                    f"{request.blob_id[:40]!r} to send (a blob is sent once).", kind="unknown-blob")
        chunk = int(request.chunk_bytes) or DEFAULT_CHUNK_BYTES
        limit = self.config.max_message_bytes
        if limit > 0:
            chunk = min(chunk, max(1, limit // 4))
        return send_blob(array, chunk, self.transfers, s.touch)

    def attach_shared_memory(
        self, s: Session, request: device_pb2.AttachSharedMemoryRequest
    ) -> device_pb2.AttachSharedMemoryReply:
        """Maps the client's segment into the entered session if it is on this machine
        (the co-location probe)."""
        try:
            segment = shm.Segment.attach(request.name, int(request.nbytes), request.nonce)
        except shm.ShmUnavailable as e:
            self.counters.add("shm_attach_refused")
            return device_pb2.AttachSharedMemoryReply(attached=False, reason=str(e))
        number = s.data.attach(segment)
        self.counters.add("shm_segments_attached")
        logger.info("session %s attached shared memory segment %d (%d bytes)", s.short_id,
                    number, segment.nbytes)
        return device_pb2.AttachSharedMemoryReply(attached=True, segment=number)
