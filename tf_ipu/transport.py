"""The host's side of the data path: how each tensor of a request crosses to the device
server, and each tensor of a reply back (``device_server/data_path.py`` is the other side).

    DeviceClient request ─┬─ small tensor ─────────────> inline bytes in the gRPC message
                          ├─ co-located, >= SHM_MIN ───> copied into a region of this
                          │                              client's shared-memory segment
                          └─ > 4 MiB, or past the ─────> PutBlob stream, in chunks
                             message budget
    reply tensor <─ inline bytes | the region this client named for it | GetBlob stream

Which path is used is settled once per session (``DataPath.setup``): ``"auto"`` tries shared
memory and falls back to streaming, saying why (``DataPath.describe()``, shown in the compile
report); ``"shm"`` insists (an error says why not); ``"stream"`` never tries. Co-location is
found by a probe, not guessed from the address: this client creates a segment in its
``/dev/shm`` (if there is room: a small or full tmpfs would mean SIGBUS) and asks the server
to map it by name and prove it with the nonce the segment holds; a server on another machine,
or in a container with its own ``/dev/shm``, cannot. The segment's name is removed as soon as
the server has answered, so nothing is left behind even if either process is killed; the
memory goes with the last mapping. The segment grows (a new, bigger one) when a call needs
more room than is free.

Counters (``DataPath.counters``): bytes by path, and ``stream_peak_bytes_held``, the most bytes
this side's transport held for one streamed transfer beyond the payload itself.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from device_server.protocol import device_pb2, dtypes, shm
from device_server.protocol.chunks import CHUNK_BYTES as _WIRE_CHUNK_BYTES
from device_server.protocol.chunks import serialize_chunk
from tf_ipu import errors

if TYPE_CHECKING:
    from tf_ipu.client import DeviceClient

DATA_PATHS = ("auto", "shm", "stream")
#: Tensors smaller than this go inline even when shared memory is on (a copy into the
#: segment and a region on the wire cost more than the bytes for them).
SHM_MIN_BYTES = 32 << 10
#: The first segment's size; it grows to fit what a call needs.
INITIAL_SEGMENT_BYTES = 16 << 20
#: Bytes of one chunk of a streamed blob (at most a quarter of the message limit).
CHUNK_BYTES = _WIRE_CHUNK_BYTES
#: A tensor larger than this goes as a blob even if it would fit in the message: chunks move
#: faster than one big message (which also holds up the heartbeats queued behind it).
INLINE_MAX_BYTES = 4 << 20


class DataPath:
    """The data path of one client's session (see the module docstring).

    Args:
        client: the client whose session it serves.
        mode: ``"auto"``, ``"shm"`` or ``"stream"``.
    """

    def __init__(self, client: DeviceClient, mode: str = "auto") -> None:
        if mode not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {', '.join(DATA_PATHS)}. Received: {mode!r}")
        self.client = client
        self.mode = mode
        self.kind = "stream"           # what is in use: "shm" or "stream"
        self.reason = "not set up"     # why streaming, when it is
        self.counters: dict[str, int] = {}
        self.control = "gRPC"          # how requests travel ("gRPC over Unix socket")
        self._segment: shm.Segment | None = None
        self._segment_id = 0
        self._allocator: shm.RegionAllocator | None = None
        # Segments replaced by a bigger one, by id, until their last region is freed.
        self._retired: dict[int, tuple[shm.Segment, shm.RegionAllocator]] = {}
        # Regions of stopped calls, oldest first, and how many such lists were freed before.
        self._held_back: list[list[tuple[int, int]]] = []
        self._held_back_total = 0
        self._lock = threading.Lock()

    # -- set-up ------------------------------------------------------------------------
    def setup(self) -> None:
        """Settles the path for the session just opened (the co-location probe)."""
        if self.mode == "stream":
            self.kind, self.reason = "stream", "data_path='stream'"
            return
        reason = self._attach(INITIAL_SEGMENT_BYTES)
        if reason is None:
            self.kind, self.reason = "shm", ""
            return
        self.kind, self.reason = "stream", reason
        if self.mode == "shm":
            raise errors.FailedPreconditionError(
                f"data_path='shm', but shared memory with the device server cannot be used: "
                f"{reason}", self.client.address, "shm-unavailable",
            )

    def _attach(self, nbytes: int) -> str | None:
        """Creates a segment of ``nbytes`` and has the server map it; None if it did, else
        why not. The segment's name is removed either way."""
        try:
            segment = shm.Segment.create(nbytes)
        except shm.ShmUnavailable as e:
            return str(e)
        try:
            reply = self.client._call(
                "AttachSharedMemory",
                device_pb2.AttachSharedMemoryRequest(
                    session_id=self.client.session_id, name=segment.name, nbytes=segment.nbytes,
                    nonce=segment.nonce),
            )
        except errors.DeviceError as e:
            segment.unlink()
            segment.close()
            return f"the server cannot map shared memory ({e.code}: {e.message})"
        segment.unlink()  # both sides have it mapped (or the server could not find it)
        if not reply.attached:
            segment.close()
            return f"the server is not on this machine's shared memory: {reply.reason}"
        if self._segment is not None and self._allocator is not None:
            self._retired[self._segment_id] = (self._segment, self._allocator)
        self._segment, self._segment_id = segment, int(reply.segment)
        self._allocator = shm.RegionAllocator(segment.nbytes)
        self._count("shm_segments", 1)
        return None

    def describe(self) -> str:
        """One line for reports: the path in use and, for streaming in auto mode, why."""
        if self.kind == "shm" and self._segment is not None:
            return f"shared memory ({self._segment.nbytes >> 20} MiB segment) + {self.control}"
        return f"gRPC streaming ({self.reason})" if self.reason else "gRPC streaming"

    def close(self) -> None:
        with self._lock:
            for seg, _ in self._retired.values():
                seg.close()
            self._retired.clear()
            if self._segment is not None:
                self._segment.close()
            self._segment, self._allocator = None, None
            self.kind = "stream"

    # -- regions ---------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> tuple[int, int] | None:
        """(segment id, offset) of a free region of ``nbytes``, growing the segment if need
        be; None when shared memory is off or there is no room."""
        if self.kind != "shm" or nbytes < SHM_MIN_BYTES:
            return None
        with self._lock:
            self._drop_idle_retired()
            if self._allocator is None:
                return None
            offset = self._allocator.alloc(nbytes)
            if offset is None and not self._retired:
                size = max(2 * self._segment.nbytes, 1 << (2 * nbytes + shm.HEADER_BYTES).bit_length())
                if self._attach(size) is None:
                    offset = self._allocator.alloc(nbytes)
            if offset is None:
                return None
            return self._segment_id, offset

    def _free(self, segment_id: int, offset: int) -> None:
        with self._lock:
            if segment_id == self._segment_id and self._allocator is not None:
                self._allocator.free(offset)
            elif segment_id in self._retired:
                self._retired[segment_id][1].free(offset)

    def _drop_idle_retired(self) -> None:
        for segment_id, (seg, alloc) in list(self._retired.items()):
            if not alloc.used:
                seg.close()
                del self._retired[segment_id]

    def _segment_of(self, segment_id: int) -> shm.Segment:
        if segment_id == self._segment_id and self._segment is not None:
            return self._segment
        if segment_id in self._retired:
            return self._retired[segment_id][0]
        raise errors.InternalError(f"shared-memory segment {segment_id} is gone")

    def _quarantine(self, regions: list[tuple[int, int]]) -> None:
        with self._lock:
            self._held_back.append(list(regions))

    def _quarantined_count(self) -> int:
        with self._lock:
            return self._held_back_total + len(self._held_back)

    def _release_quarantine(self, before: int) -> None:
        """Frees regions of stopped calls quarantined before a call that has come back."""
        with self._lock:
            n = before - self._held_back_total
            if n <= 0:
                return
            ready, self._held_back = self._held_back[:n], self._held_back[n:]
            self._held_back_total += n
        for regions in ready:
            for segment_id, offset in regions:
                self._free(segment_id, offset)

    def _count(self, name: str, amount: int) -> None:
        self.counters[name] = self.counters.get(name, 0) + int(amount)

    def _peak(self, name: str, amount: int) -> None:
        self.counters[name] = max(self.counters.get(name, 0), int(amount))

    # -- calls -----------------------------------------------------------------------------
    def call(self) -> Call:
        """The data of one request and its reply (a context manager: frees its regions)."""
        return Call(self)

    def chunk_bytes(self) -> int:
        limit = self.client.session.max_message_bytes if self.client.session else 0
        return max(1, min(CHUNK_BYTES, (limit or (1 << 30)) // 4))

    def put_blob(self, data: np.ndarray | bytes, replaces: str = "") -> str:
        """Streams ``data`` (an array, or raw bytes) to the session's staging; returns its
        blob id."""
        raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray)) else data
        a = np.ascontiguousarray(raw)
        flat = a.reshape(-1).view(np.uint8)
        total = int(flat.nbytes)
        chunk = self.chunk_bytes()
        first = device_pb2.BlobChunk(session_id=self.client.session_id, total_bytes=total,
                                     replaces_variable=replaces)
        if not isinstance(data, (bytes, bytearray)):
            first.dtype = dtypes.from_numpy(a.dtype)
            first.dims.extend(a.shape)

        def chunks() -> Iterator[bytes]:  # each message made in one copy of its chunk
            yield serialize_chunk(first, flat[:chunk])
            for offset in range(chunk, total, chunk):
                yield serialize_chunk(None, flat[offset:offset + chunk])

        reply = self.client._call_stream_in("PutBlob", chunks())
        self._count("stream_bytes_out", total)
        # A message's bytes, and gRPC's copy of them.
        self._peak("stream_peak_bytes_held", 2 * min(chunk, total))
        return reply.blob_id

    def get_blob(self, blob_id: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Streams a blob a reply named into a new array of ``dtype`` and ``shape``."""
        what = f"GetBlob of {dtypes.dtype_name(dtypes.from_numpy(dtype))}{list(shape)[:8]}"
        if len(shape) > 64 or any(d < 0 for d in shape):
            raise errors.InternalError(f"{what}: the reply's dims are not an array's (negative, "
                                       f"or more than 64).", self.client.address)
        limit = self.client.session.max_session_bytes if self.client.session else 0
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if 0 < limit < nbytes:  # checked before allocating: the server holds no such array
            raise errors.InternalError(f"{what}: {nbytes} bytes, more than the server's limit "
                                       f"of {limit} bytes per session.", self.client.address)
        out = np.empty(shape, dtype)
        flat = out.reshape(-1).view(np.uint8)
        offset = held = 0
        request = device_pb2.GetBlobRequest(session_id=self.client.session_id, blob_id=blob_id,
                                            chunk_bytes=self.chunk_bytes())
        for chunk in self.client._call_stream_out("GetBlob", request):
            data = chunk.data  # a view of the message's bytes: read once
            n = len(data)
            if offset + n > flat.nbytes:
                raise errors.InternalError(
                    f"GetBlob: the server sent more than the {flat.nbytes} bytes of "
                    f"{dtypes.dtype_name(dtypes.from_numpy(out.dtype))}{list(shape)}.",
                    self.client.address)
            flat[offset:offset + n] = np.frombuffer(data, np.uint8)
            offset += n
            held = max(held, n)
        if offset != flat.nbytes:
            raise errors.InternalError(
                f"GetBlob: the stream ended after {offset} of {flat.nbytes} bytes.",
                self.client.address)
        self._count("stream_bytes_in", offset)
        self._peak("stream_peak_bytes_held", 2 * held)
        return out


class Call:
    """The data path of one request: a budget for inline bytes, the regions it took."""

    def __init__(self, path: DataPath) -> None:
        self.path = path
        session = path.client.session
        limit = session.max_message_bytes if session is not None else 0
        self.budget = (limit if limit > 0 else 1 << 30) // 2
        self._regions: list[tuple[int, int]] = []
        self.started_after = path._quarantined_count()

    def __enter__(self) -> Call:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None and issubclass(kind, (errors.CancelledError,
                                                  errors.DeadlineExceededError)):
            # The server may still be reading or writing this call's regions (it stops at
            # the next step): they are reused only after a later call has come back.
            self.path._quarantine(self._regions)
        else:
            for segment_id, offset in self._regions:
                self.path._free(segment_id, offset)
            if kind is None:
                self.path._release_quarantine(self.started_after)
        self._regions = []

    def encode(self, tensor: device_pb2.Tensor, value: Any, what: str, replaces: str = "",
               inline_only: bool = False) -> None:
        """Fills a request's ``tensor`` with ``value``: a region, inline bytes or a blob
        (``inline_only``: never a blob; too big for the message is an error then)."""
        a = np.asarray(value, order="C")
        nbytes = int(a.nbytes)
        if nbytes < SHM_MIN_BYTES and nbytes <= self.budget:
            # The usual small tensor: inline bytes, without looking for a region.
            try:
                dtypes.fill_tensor(tensor, a)
            except ValueError as e:  # DTypeError: no wire type for this dtype
                raise errors.InvalidArgumentError(f"{what}: {e}") from None
            self.budget -= nbytes
            self.path._count("inline_bytes_out", nbytes)
            return
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        try:
            code = dtypes.from_numpy(a.dtype)
        except ValueError as e:
            raise errors.InvalidArgumentError(f"{what}: {e}") from None
        nbytes = int(a.nbytes)
        place = self.path._alloc(nbytes) if nbytes >= SHM_MIN_BYTES else None
        if place is not None:
            segment_id, offset = place
            self._regions.append(place)
            self.path._segment_of(segment_id).write(offset, a)
            tensor.dtype = code
            tensor.dims.extend(a.shape)
            tensor.shm.CopyFrom(device_pb2.ShmRegion(segment=segment_id, offset=offset,
                                                     nbytes=nbytes))
            self.path._count("shm_bytes_out", nbytes)
            return
        if nbytes <= self.budget and (nbytes <= INLINE_MAX_BYTES or inline_only):
            self.budget -= nbytes
            dtypes.fill_tensor(tensor, a)
            self.path._count("inline_bytes_out", nbytes)
            return
        if inline_only:
            raise errors.InvalidArgumentError(
                f"{what}: {nbytes} bytes do not fit in one message (the budget left is "
                f"{self.budget} bytes) and cannot be streamed here.", self.path.client.address)
        tensor.dtype = code
        tensor.dims.extend(a.shape)
        tensor.blob_id = self.path.put_blob(a, replaces)

    def output_region(self, dtype: np.dtype, shape: tuple[int, ...]) -> device_pb2.ShmRegion | None:
        """A region for a reply's tensor of ``dtype`` and ``shape`` (its bound), if shared
        memory is on and it is big enough to be worth one."""
        if self.path.kind != "shm":
            return None
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes < SHM_MIN_BYTES:
            return None  # inline costs less
        place = self.path._alloc(nbytes)
        if place is None:
            return None
        self._regions.append(place)
        return device_pb2.ShmRegion(segment=place[0], offset=place[1], nbytes=nbytes)

    def decode(self, tensor: device_pb2.Tensor, what: str) -> np.ndarray:
        """The array a reply's ``tensor`` holds (a copy out of shared memory, a new array for
        a blob, a read-only view of the reply's bytes for inline data)."""
        source = tensor.WhichOneof("payload")
        if source == "data" or source is None:
            return dtypes.from_tensor(tensor, what=what)
        dt = dtypes.to_numpy(tensor.dtype)
        shape = tuple(int(d) for d in tensor.dims)
        if source == "blob_id":
            return self.path.get_blob(tensor.blob_id, dt, shape)
        region = tensor.shm
        segment = self.path._segment_of(region.segment)
        value = np.array(segment.array(region.offset, dt, shape))
        self.path._count("shm_bytes_in", value.nbytes)
        return value
