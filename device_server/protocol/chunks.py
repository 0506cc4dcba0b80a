"""BlobChunks (the messages of PutBlob and GetBlob streams) without copies of their data.

    sender:   serialize_chunk(header, array slice) -> the message's bytes, in one copy
    receiver: parse_chunk(bytes) -> the header's fields, and ``data`` as a view of the bytes

Protobuf copies a bytes field when it parses a message, again each time the field is read,
and when it serializes one: a 4 MiB chunk then costs three copies besides the one into (or
out of) its buffer, and those transient chunks raise each side's peak memory beyond the
payload plus two chunks (docs/architecture.md, "The data path"). Only the data field is
handled here, by the wire format's rules; every other field is parsed and written by
protobuf, and bytes the scan does not take go to protobuf whole, which refuses what it
cannot parse: the host and the server use the same two functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from device_server.protocol import device_pb2

#: Bytes of the chunks either side sends by default (at most a quarter of the message limit).
CHUNK_BYTES = 4 << 20

_DATA = device_pb2.BlobChunk.DESCRIPTOR.fields_by_name["data"].number
_TOTAL = device_pb2.BlobChunk.DESCRIPTOR.fields_by_name["total_bytes"].number


class ChunkView:
    """A parsed BlobChunk whose ``data`` is a read-only view of the message's bytes; its
    other fields are those of ``message`` (the chunk parsed without its data)."""

    __slots__ = ("_message", "data")

    def __init__(self, message: device_pb2.BlobChunk, data: memoryview) -> None:
        self._message = message
        self.data = data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._message, name)


def parse_chunk(raw: bytes) -> device_pb2.BlobChunk | ChunkView:
    """A BlobChunk from its wire bytes, its data not copied (a ``ChunkView``). Bytes the scan
    does not take (no data field, a repeated one, anything malformed) are parsed by protobuf,
    which raises for what it cannot parse.

    Example:
        >>> chunk = parse_chunk(serialize_chunk(device_pb2.BlobChunk(total_bytes=3),
        ...                                     np.arange(3, dtype=np.uint8)))
        >>> chunk.total_bytes, bytes(chunk.data)
        (3, b'\\x00\\x01\\x02')
    """
    span = _length_delimited_span(raw, _DATA)
    if span is None:
        return device_pb2.BlobChunk.FromString(raw)
    tag_start, start, end = span
    rest = device_pb2.BlobChunk.FromString(raw[:tag_start] + raw[end:])
    return ChunkView(rest, memoryview(raw)[start:end])


def serialize_chunk(header: device_pb2.BlobChunk | None, data: np.ndarray) -> bytes:
    """The bytes of a BlobChunk with ``header``'s fields (its data field unset) and ``data``
    (a contiguous array, sent as its raw bytes), made in one copy of ``data``."""
    head = bytearray(header.SerializeToString() if header is not None else b"")
    head += _varint((_DATA << 3) | 2) + _varint(int(data.nbytes))
    return b"".join((head, memoryview(data).cast("B")))


class SerializedChunk:
    """A BlobChunk of ``total_bytes`` and ``data``, serialized (``serialize_chunk``): what a
    response serializer takes (it has ``SerializeToString``)."""

    __slots__ = ("_raw",)

    def __init__(self, total_bytes: int, data: np.ndarray) -> None:
        header = device_pb2.BlobChunk(total_bytes=total_bytes) if total_bytes else None
        self._raw = serialize_chunk(header, data)

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's spelling)
        return self._raw

    def ByteSize(self) -> int:  # noqa: N802
        return len(self._raw)


def receive_window_options(window_bytes: int = 2 * CHUNK_BYTES) -> list[tuple[str, int]]:
    """gRPC options (server or channel) that fix the HTTP/2 receive window of each stream
    at ``window_bytes``: what the other side may have sent that this side has not read yet.
    gRPC otherwise grows the window to the bandwidth-delay product it measures, and during
    a chunked transfer the receiver held ten chunks and more its reader had not reached: a
    768 MiB round trip peaked at the payload plus 30-130 MiB on the server (once 265 MiB).
    Two chunks keep each side at the payload plus two chunks, and still carry 400 MB/s over
    a link of 20 ms round trip."""
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", int(window_bytes))]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int] | None:
    result = shift = 0
    for i in range(pos, min(pos + 10, len(raw))):
        byte = raw[i]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i + 1
        shift += 7
    return None  # truncated, or longer than a varint may be


def _length_delimited_span(raw: bytes, number: int) -> tuple[int, int, int] | None:
    """(start of its tag, start, end) of the one length-delimited field ``number`` of the
    message in ``raw``; None if there is not exactly one, or the scan meets anything but
    well-formed fields of wire types 0, 1, 2 and 5."""
    pos, n, found = 0, len(raw), None
    while pos < n:
        tag_start = pos
        read = _read_varint(raw, pos)
        if read is None:
            return None
        tag, pos = read
        wire = tag & 7
        if tag >> 3 == 0:
            return None
        if wire == 0:
            read = _read_varint(raw, pos)
            if read is None:
                return None
            pos = read[1]
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            read = _read_varint(raw, pos)
            if read is None:
                return None
            length, pos = read
            if tag >> 3 == number:
                if found is not None:
                    return None
                found = (tag_start, pos, pos + length)
            pos += length
        else:
            return None
        if pos > n:
            return None
    return found
