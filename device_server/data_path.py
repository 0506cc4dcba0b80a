"""The server's side of the data path: where the bytes of a wire ``Tensor`` are.

    request Tensor ── data ────> a read-only view of the request's bytes
                   ├─ blob_id ─> a buffer PutBlob filled chunk by chunk (staged in the session)
                   └─ shm ─────> a read-only view of a region of a segment the client shares
    reply Tensor  <── data      while the reply stays within its message budget
                  <── shm       into the region the request named for it (co-located)
                  <── blob_id   otherwise: GetBlob streams it out in chunks, then drops it

Infeeds: PushInfeed appends batches to a session's named ``Infeed`` while a run of the session
may be pulling from it (``emulator/kernels/infeed.py``); batches in shared memory are copied
out at once, so the host can reuse the region.

One ``SessionData`` per session holds its staged blobs (both ways) and attached segments; it
is read and written while the session is entered, except for a blob being received, which
belongs to its PutBlob call alone until it is registered. Staged bytes count against the
session's memory limit (``ServiceConfig.max_session_bytes``): a blob that will replace a
resident variable (``BlobChunk.replaces_variable``) is counted net of that variable's bytes.

``TransferCounters`` are what tests and benchmarks read: bytes by path, and the most bytes
the transport itself held for one transfer (its buffer plus the chunks in flight).
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from device_server.protocol import device_pb2, dtypes, shm
from device_server.protocol.chunks import CHUNK_BYTES, SerializedChunk
from device_server.sessions import ServiceError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

#: Bytes of one chunk of a blob (at most a quarter of the message limit).
DEFAULT_CHUNK_BYTES = CHUNK_BYTES
#: A reply's tensor larger than this goes as a blob even if it fits the message (chunks move
#: faster, and do not hold up the calls queued behind one big message).
INLINE_MAX_BYTES = 4 << 20
#: Dimensions an array may have (numpy's limit).
MAX_DIMS = 64
#: Segments a session may have attached at once (the client grows by attaching a new one).
MAX_SEGMENTS = 2


@dataclass
class Blob:
    """Staged bytes: ``array`` (owned, writable) and the variable it will replace, if any."""

    array: np.ndarray
    replaces: str = ""

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass
class TransferCounters:
    """Server-wide transfer figures (thread-safe): ``add`` sums, ``peak`` keeps maxima."""

    values: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, amount: int) -> None:
        with self._lock:
            self.values[name] = self.values.get(name, 0) + int(amount)

    def peak(self, name: str, amount: int) -> None:
        with self._lock:
            self.values[name] = max(self.values.get(name, 0), int(amount))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class Infeed:
    """The batches the host pushed to one named infeed of a session, oldest first; an end
    marker (the host ended the feed) is consumed by exactly one pull. Pushes and pulls come
    from different threads: PushInfeed calls, and the run that holds the session."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: deque[list[np.ndarray] | None] = deque()
        self._cond = threading.Condition()
        self.nbytes = 0
        self.pulled = 0

    def push(self, batches: list[list[np.ndarray]], end: bool, reset: bool = False) -> None:
        with self._cond:
            if reset:
                self._items.clear()
                self.nbytes = 0
            for batch in batches:
                self._items.append(batch)
                self.nbytes += sum(int(a.nbytes) for a in batch)
            if end:
                self._items.append(None)
            self._cond.notify_all()

    def queued(self) -> int:
        """Batches waiting for the device."""
        with self._cond:
            return sum(1 for item in self._items if item is not None)

    def pull(self, token: Any, where: str) -> list[np.ndarray] | None:
        """The next batch (None at an end marker), waiting for the host; gives up when the
        run is asked to stop (``token.in_loop``, emulator/cancel.py)."""
        with self._cond:
            while not self._items:
                if token is not None and token.in_loop():
                    raise token.stopped(f"{where}, waiting for the host's next batch")
                self._cond.wait(0.02)
            batch = self._items.popleft()
            if batch is not None:
                self.nbytes -= sum(int(a.nbytes) for a in batch)
                self.pulled += 1
            return batch


class SessionData:
    """A session's blobs, shared-memory segments and infeeds (see the module docstring)."""

    def __init__(self) -> None:
        self.infeeds: dict[str, Infeed] = {}
        # Values the running program handed to outfeeds, by feed: one list per enqueue.
        self.outfeeds: dict[str, list[list[np.ndarray]]] = {}
        self.blobs_in: dict[str, Blob] = {}
        self.blobs_out: dict[str, np.ndarray] = {}
        self.segments: dict[int, shm.Segment] = {}
        self._next_segment = 1
        self._receiving = 0  # bytes of blobs being received (not yet in blobs_in)
        self._lock = threading.Lock()

    def infeed(self, name: str) -> Infeed:
        """The infeed ``name``, created on first use (by either side)."""
        with self._lock:
            feed = self.infeeds.get(name)
            if feed is None:
                feed = self.infeeds[name] = Infeed(name)
            return feed

    def enqueue_outfeed(self, feed: str, values: list[np.ndarray]) -> None:
        """Called by the running program (the run holds the session)."""
        self.outfeeds.setdefault(feed, []).append(values)

    def infeed_bytes(self) -> int:
        with self._lock:
            return sum(f.nbytes for f in self.infeeds.values())

    def staged_bytes(self, exclude_replacing: Iterable[str] = ()) -> int:
        """Bytes staged in (and being received), the blobs replacing ``exclude_replacing``
        variables left out."""
        skip = set(exclude_replacing)
        with self._lock:
            return self._receiving + sum(
                b.nbytes for b in self.blobs_in.values() if not (b.replaces and b.replaces in skip))

    def replaced_keys(self) -> set[str]:
        return {b.replaces for b in self.blobs_in.values() if b.replaces}

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            self._receiving += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._receiving -= nbytes

    def put(self, blob: Blob) -> str:
        blob_id = secrets.token_hex(8)
        self.blobs_in[blob_id] = blob
        return blob_id

    def take(self, blob_id: str, what: str) -> Blob:
        blob = self.blobs_in.pop(blob_id, None)
        if blob is None:
            raise ServiceError(
                _NOT_FOUND,
                f"{what}: no staged blob {blob_id[:40]!r} in this session (PutBlob first; a "
                f"blob is used once).", kind="unknown-blob",
            )
        return blob

    def offer(self, array: np.ndarray) -> str:
        """Registers ``array`` for one GetBlob; returns its id."""
        blob_id = secrets.token_hex(8)
        self.blobs_out[blob_id] = array
        return blob_id

    def attach(self, segment: shm.Segment) -> int:
        """Adds a segment (the oldest is closed beyond ``MAX_SEGMENTS``); returns its id."""
        number = self._next_segment
        self._next_segment += 1
        self.segments[number] = segment
        while len(self.segments) > MAX_SEGMENTS:
            oldest = min(self.segments)
            self.segments.pop(oldest).close()
        return number

    def segment(self, number: int, what: str) -> shm.Segment:
        seg = self.segments.get(number)
        if seg is None:
            raise ServiceError(
                _NOT_FOUND,
                f"{what}: shared-memory segment {number} is not attached to this session "
                f"(attached: {sorted(self.segments) or 'none'}).", kind="unknown-segment",
            )
        return seg

    def close(self) -> None:
        """Drops everything (the session ends)."""
        self.blobs_in.clear()
        self.blobs_out.clear()
        self.infeeds.clear()
        self.outfeeds.clear()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()


def tensor_value(data: SessionData, tensor: device_pb2.Tensor, what: str,
                 counters: TransferCounters | None = None) -> np.ndarray:
    """The array a request's ``Tensor`` carries (read-only unless it is a staged blob, which
    the caller may keep as its own)."""
    source = tensor.WhichOneof("payload")
    if source == "blob_id":
        blob = data.take(tensor.blob_id, what)
        dt, dims = _type_of(tensor, what)
        a = blob.array
        if a.dtype != dt or tuple(a.shape) != dims:
            raise ServiceError(
                _INVALID,
                f"{what}: staged blob holds {dtypes.dtype_name(dtypes.from_numpy(a.dtype))}"
                f"{list(a.shape)}, the tensor says {dtypes.dtype_name(tensor.dtype)}{list(dims)}.",
            )
        return a
    if source == "shm":
        dt, dims = _type_of(tensor, what)
        region = tensor.shm
        seg = data.segment(region.segment, what)
        nbytes = _nbytes(dims, dt.itemsize)
        if region.nbytes != nbytes:
            raise ServiceError(
                _INVALID,
                f"{what}: {dtypes.dtype_name(tensor.dtype)}{list(dims)} needs {nbytes} bytes, "
                f"its shared-memory region has {region.nbytes}.",
            )
        try:
            a = seg.array(region.offset, dt, dims) if nbytes else np.zeros(dims, dt)
        except ValueError as e:
            raise ServiceError(_INVALID, f"{what}: {e}") from None
        if counters is not None:
            counters.add("shm_bytes_in", nbytes)
        return a
    try:
        return dtypes.from_tensor(tensor, what=what)
    except ValueError as e:  # DTypeError is a ValueError
        message = str(e)
        if not message.startswith(what):
            message = f"{what}: {message}"
        raise ServiceError(_INVALID, message) from None


def _type_of(tensor: device_pb2.Tensor, what: str) -> tuple[np.dtype, tuple[int, ...]]:
    try:
        dt = dtypes.to_numpy(tensor.dtype)
    except ValueError as e:
        raise ServiceError(_INVALID, f"{what}: {e}") from None
    dims = tuple(int(d) for d in tensor.dims)
    if any(d < 0 for d in dims):
        raise ServiceError(_INVALID, f"{what}: negative dimension in dims={list(dims)}.")
    if len(dims) > MAX_DIMS:
        raise ServiceError(_INVALID, f"{what}: dims has {len(dims)} dimensions, more than the "
                           f"{MAX_DIMS} an array may have.")
    count = dt.itemsize
    for d in dims:
        count *= max(d, 1)  # numpy refuses a shape past this even with a 0 dimension
        if count >= 1 << 63:
            raise ServiceError(_INVALID, f"{what}: dims={list(dims)} describe an array of more "
                               f"than 2**63 bytes (not counting its 0 dimensions).")
    return dt, dims


def _nbytes(dims: tuple[int, ...], itemsize: int) -> int:
    """Bytes of an array of ``dims`` (non-negative), exact: numpy's int64 product wraps (a
    tensor of [2**32, 2**32] would be 0 bytes). Past 2**63 it stops counting, as no int64
    field can match it."""
    if 0 in dims:
        return 0
    count = itemsize
    for d in dims:
        count *= d
        if count >= 1 << 63:
            break
    return count


class ReplyBudget:
    """How many bytes a reply may still carry inline."""

    def __init__(self, max_message_bytes: int) -> None:
        limit = max_message_bytes if max_message_bytes > 0 else 1 << 30
        self.left = limit // 2  # room for the message's other fields and its framing

    def take(self, nbytes: int) -> bool:
        if nbytes <= self.left:
            self.left -= nbytes
            return True
        return False


def fill_reply_tensor(data: SessionData, tensor: device_pb2.Tensor, array: np.ndarray,
                      budget: ReplyBudget, region: device_pb2.ShmRegion | None = None,
                      counters: TransferCounters | None = None) -> None:
    """Puts ``array`` into a reply's ``Tensor``: into ``region`` if one was named and it fits,
    else inline within ``budget``, else as a blob for GetBlob."""
    a = np.asarray(array, order="C")
    nbytes = int(a.nbytes)
    if region is not None and region.segment and region.nbytes >= nbytes:
        seg = data.segment(region.segment, "reply")
        try:
            seg.write(region.offset, a) if nbytes else None
        except ValueError as e:
            raise ServiceError(_INVALID, f"reply: {e}") from None
        dtypes.fill_tensor(tensor, a, with_data=False)
        tensor.shm.CopyFrom(device_pb2.ShmRegion(segment=region.segment, offset=region.offset,
                                                 nbytes=nbytes))
        if counters is not None:
            counters.add("shm_bytes_out", nbytes)
        return
    if nbytes <= INLINE_MAX_BYTES and budget.take(nbytes):
        dtypes.fill_tensor(tensor, a)
        return
    dtypes.fill_tensor(tensor, a, with_data=False)
    tensor.blob_id = data.offer(a)


def receive_blob(chunks: Iterator[device_pb2.BlobChunk], first: device_pb2.BlobChunk,
                 data: SessionData, counters: TransferCounters,
                 touch: Any = None) -> Blob:
    """Copies a PutBlob stream into a new buffer of the size (and type) its first chunk
    declares. The caller has reserved ``first.total_bytes`` in ``data``; ``touch()`` (the
    session's lease) is called at every chunk."""
    total = int(first.total_bytes)
    if first.dims or first.dtype:
        dt, dims = _type_of(first, "PutBlob")
        if _nbytes(dims, dt.itemsize) != total:
            raise ServiceError(
                _INVALID, f"PutBlob: {dtypes.dtype_name(first.dtype)}{list(dims)} is not "
                f"{total} bytes.")
        array = np.empty(dims, dt)
    else:
        array = np.empty(total, np.uint8)
    flat = array.reshape(-1).view(np.uint8)
    offset = 0
    held = 0
    for chunk in _with_first(first, chunks):
        data = chunk.data  # a view of the message's bytes (protocol/chunks.py): read once
        n = len(data)
        if offset + n > total:
            raise ServiceError(
                _INVALID, f"PutBlob: the stream carries more than the {total} bytes its first "
                f"chunk declared.")
        flat[offset:offset + n] = np.frombuffer(data, np.uint8)
        offset += n
        held = max(held, n)
        if touch is not None:
            touch()
    if offset != total:
        raise ServiceError(
            _INVALID, f"PutBlob: the stream ended after {offset} of the {total} bytes its "
            f"first chunk declared.")
    counters.add("stream_bytes_in", total)
    counters.peak("stream_peak_bytes_held", total + 2 * held)
    return Blob(array, first.replaces_variable)


def _with_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def send_blob(array: np.ndarray, chunk_bytes: int, counters: TransferCounters,
              touch: Any = None) -> Iterator[device_pb2.BlobChunk]:
    """A GetBlob stream of ``array``'s bytes (its buffer read in place, one chunk copied at a
    time); ``touch()`` at every chunk."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    total = int(flat.nbytes)
    counters.peak("stream_peak_bytes_held", 2 * min(chunk_bytes, total))
    if total == 0:
        yield device_pb2.BlobChunk(total_bytes=0)
        return
    for offset in range(0, total, chunk_bytes):
        if touch is not None:
            touch()
        # One copy of the chunk makes the message's bytes (protocol/chunks.py).
        yield SerializedChunk(total if offset == 0 else 0, flat[offset:offset + chunk_bytes])
    counters.add("stream_bytes_out", total)
