"""The device server's gRPC servicer: typed requests in, emulator calls, typed replies out.

    tf_ipu.client.DeviceClient ==gRPC==> DeviceService (this module)
                                           |- SessionManager  sessions, leases, IPU pool
                                           |- ExecutableCache  sha256(module, arch, options)
                                           |    '- DiskCache     the same keys, on disk (optional)
                                           |- compile_requests a Compile's options and array
                                           |                   sizes checked, errors mapped
                                           '- emulator         compile_module / Executable.run

Every handler runs inside ``_rpc``: a ``ServiceError`` becomes its gRPC status, any other
exception becomes INTERNAL with the exception's text, and the server keeps serving. Requests
that do not even decode are refused as INVALID_ARGUMENT (the request deserializer never
raises). Refinements of a status (``out-of-memory`` vs ``no-free-ipus``) travel as trailing
metadata ``tf-ipu-error-kind`` and are counted by kind. Nothing from the wire is pickled or
evaluated: arrays are raw bytes plus dtype and dims (``device_server.protocol.dtypes``).
``ExecuteStream`` serves Execute calls over one stream, each of its requests through the same
wrapper as a unary Execute (an error ends the stream with the call's status).

Limits (``ServiceConfig``, each a command line flag): message size either way, executables
cached, bytes of resident variables per session (which also bounds the largest array a
program may produce), how long a call may wait (request deadline), calls queued per session.
While the server shuts down (``begin_shutdown``) new work is refused with UNAVAILABLE and
calls already running finish. Each RPC ends with one log record on ``device_server.rpc``
(method, session, status, duration, bytes), which ``--log-format json`` prints as one JSON
line (successful per-step calls at DEBUG, ``--log-level debug``). A run stops early (``emulator/cancel.py``) when its client cancels or goes away, at its
run deadline or the call's deadline, when its session closes and when the server shuts
down: a device loop at its next step, keeping the variables of the last completed step;
other loops at their next iteration, keeping nothing of the call.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

import device_server
from device_server.compile_requests import (
    check_array_sizes,
    compile_error,
    numerics_options,
    pipeline_options,
    planning_options,
    replication_key,
)
from device_server.data_path import (
    DEFAULT_CHUNK_BYTES,
    Blob,
    ReplyBudget,
    SessionData,
    TransferCounters,
    fill_reply_tensor,
    receive_blob,
    send_blob,
    tensor_value,
)
from device_server.disk_cache import DEFAULT_MAX_BYTES as DEFAULT_DISK_CACHE_BYTES
from device_server.disk_cache import DiskCache
from device_server.emulator import (
    CompileOptions,
    EmulatorError,
    FloatingPointExceptionError,
    OutOfMemoryError,
    RunStopped,
    StopToken,
    compile_module,
    executable_from_record,
    get_target,
)
from device_server.emulator.cancel import running
from device_server.emulator.kernels.infeed import InfeedEnded
from device_server.emulator.replicas import run_replicated
from device_server.emulator.world import program_digest
from device_server.executable_cache import ExecutableCache, cache_key
from device_server.protocol import device_pb2, dtypes, hardware, ir_pb2, shm
from device_server.protocol.chunks import parse_chunk
from device_server.sessions import (
    ConnectionTable,
    ExecutableHandle,
    IpuPool,
    ServiceError,
    Session,
    SessionManager,
)

logger = logging.getLogger(__name__)
rpc_logger = logging.getLogger("device_server.rpc")

SERVICE_NAME = device_pb2.DESCRIPTOR.services_by_name["DeviceService"].full_name
ERROR_KIND_METADATA = "tf-ipu-error-kind"
_MAX_DETAILS_CHARS = 2000

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

#: Calls still served while the server shuts down (they start no new work).
_ALLOWED_WHILE_DRAINING = frozenset(
    {"CloseSession", "Heartbeat", "DetachIpus", "ReadVariables", "GetCounters", "GetBlob",
     "CancelRun"}
)
#: Calls made once per step or more often: their successful records are DEBUG.
_QUIET_WHEN_OK = frozenset({"Execute", "Heartbeat", "ReadVariables", "WriteVariables", "PutBlob",
                            "GetBlob", "CancelRun", "PushInfeed"})
#: The status of a stopped run, by reason (emulator/cancel.py), and how messages say it.
_STOP_STATUS = {
    "cancelled": (grpc.StatusCode.CANCELLED, "cancelled"),
    "deadline": (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
    "session-closed": (grpc.StatusCode.CANCELLED, "session-closed"),
    "shutdown": (grpc.StatusCode.UNAVAILABLE, "shutting-down"),
}
_STOP_WHY = {
    "cancelled": "the client cancelled the call",
    "deadline": "its run deadline passed",
    "session-closed": "its session was closed",
    "shutdown": "the server is shutting down",
}
#: Upper bounds (seconds) of the Execute latency histogram.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                   5.0, 10.0, 30.0)


@dataclass
class ServiceConfig:
    """What a device server hosts and how it behaves.

    Attributes:
        num_ipus: IPUs hosted.
        ipu_version: architecture of a session that does not ask for one.
        lease_seconds: default session lease.
        max_message_bytes: the largest gRPC message either way (reported to clients).
        refuse_opcodes: opcodes refused by every compile (added to the request's).
        fault_inject_opcode: opcode whose results every compile perturbs (takes precedence
            over the request's).
        allow_test_options: whether clients may send test switches (``CompileOptions.
            fault_inject_opcode`` and ``refuse_opcodes``); False: a Compile asking for one is
            refused with
            PERMISSION_DENIED (the ``--allow-test-options`` flag; a client's own local
            server allows them).
        cache_entries: bound of the executable cache.
        max_waiting_calls: calls of one session that may queue behind the running one.
        max_session_bytes: bytes of resident variables one session may hold, and the
            largest array a program may produce (0: no limit).
        request_deadline_seconds: longest a call may wait (for its session's earlier call,
            for free IPUs) on top of the client's own deadline (0: the client's only).
        unix_socket: the Unix socket the server also listens on ("" for none), told to
            sessions (``OpenSessionReply.unix_socket``).
        executable_cache_path: folder of the executable cache on disk ("" for none), which
            keeps compiled programs across restarts (``disk_cache.py``).
        executable_cache_bytes: bound of that folder's entries, in bytes.
        system: a named system (``device_server.protocol.hardware.SYSTEMS``: its IPUs, their
            version and links), or "" for ``num_ipus`` IPUs of any version sessions ask for.
        keepalive_seconds: the server pings each client connection after this many seconds
            without traffic, and closes one whose ping is not answered (``server.
            keepalive_options``); 0: gRPC's default (2 hours), and no connection leases.
        connection_leases: keep a session while its client's connection is up, when the
            client asks (``sessions.py``); off behind a proxy that pools connections (the
            server would see the proxy's connection, not the client's).
    """

    num_ipus: int = 1
    ipu_version: str = "ipu2"
    lease_seconds: float = 5.0
    max_message_bytes: int = 1 << 30
    refuse_opcodes: tuple[str, ...] = ()
    fault_inject_opcode: str = ""
    allow_test_options: bool = False
    cache_entries: int = 128
    max_waiting_calls: int = 8
    max_session_bytes: int = 4 << 30
    request_deadline_seconds: float = 600.0
    unix_socket: str = ""
    executable_cache_path: str = ""
    executable_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES
    system: str = ""
    keepalive_seconds: float = 2.0
    connection_leases: bool = True


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


@dataclass
class _Request:
    """A decoded request and its size on the wire."""

    message: Any
    nbytes: int


@dataclass
class _Undecodable:
    """Stands in for a request that failed to decode, so the handler can refuse it."""

    type_name: str
    nbytes: int
    error: str


class _Messages:
    """The requests of a client stream: ``first`` (read at once; an empty stream gives an
    undecodable stand-in), then the rest by iteration (an undecodable one raises)."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        self.first = next(iterator, None) or _Undecodable("stream", 0, "the stream is empty")
        self.nbytes = self.first.nbytes

    def __iter__(self) -> Any:
        for request in self._iterator:
            self.nbytes += request.nbytes
            if isinstance(request, _Undecodable):
                raise ServiceError(
                    _INVALID, f"a message of the stream ({request.nbytes} bytes) is not a valid "
                    f"{request.type_name}: {request.error}", kind="undecodable-request")
            yield request.message


@dataclass
class _StreamReply:
    """What a server-streaming handler returns to ``_rpc``: nothing inline, then chunks."""

    chunks: Any

    def ByteSize(self) -> int:  # noqa: N802 (the protobuf spelling ``_rpc`` calls)
        return 0


class _CallState(threading.local):
    """The RPC this worker thread is serving: its context and absolute deadlines."""

    context: Any = None
    deadline: float | None = None  # time.monotonic() value: the client's, or the server's
    client_deadline: float | None = None  # the client's own (the run's), or None
    stream: _ExecuteStream | None = None  # the ExecuteStream this call came on, if any


class _ExecuteStream:
    """One ExecuteStream being served: the stop token of its call running now, which the
    stream's one termination callback stops when the client cancels or goes away."""

    __slots__ = ("token",)

    def __init__(self) -> None:
        self.token: StopToken | None = None

    def cancelled(self) -> None:
        token = self.token
        if token is not None:
            token.stop("cancelled")


_COUNTER_HELP = {
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


def _spec(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    """``F32[2, 3]``: how errors spell an array type."""
    try:
        name = dtypes.dtype_name(dtypes.from_numpy(dtype))
    except ValueError:
        name = str(dtype)
    return f"{name}[{', '.join(str(d) for d in shape)}]"


class DeviceService:
    """Implements ``tf_ipu.device.DeviceService`` over the emulator.

    Args:
        config: the server's configuration; ``config.ipu_version`` must be a known target.
    """

    def __init__(self, config: ServiceConfig) -> None:
        if config.system:  # ValueError for an unknown name
            self.system: hardware.System | None = hardware.get_system(config.system)
            config = dataclasses.replace(config, num_ipus=self.system.num_ipus,
                                         ipu_version=self.system.ipu_version)
        else:
            self.system = None
        default_target = get_target(config.ipu_version)  # ValueError for an unknown name
        self.config = config
        self.default_ipu_version, _ = _describe_target(default_target, config.ipu_version)
        self.counters = Counters()
        self.pool = IpuPool(config.num_ipus)
        if self.system is not None:
            self.pool.description = f"a {self.system.name}: {self.system.description}"
        self.sessions = SessionManager(
            self.pool,
            default_lease_seconds=config.lease_seconds,
            max_waiting_calls=config.max_waiting_calls,
            on_close=self._on_session_closed,
            connections=ConnectionTable()
            if config.connection_leases and config.keepalive_seconds > 0 else None,
        )
        self.cache = ExecutableCache(config.cache_entries)
        # ValueError for a folder that cannot be used: the server does not start.
        self.disk_cache = (DiskCache(config.executable_cache_path, config.executable_cache_bytes)
                           if config.executable_cache_path else None)
        if self.disk_cache is not None:
            logger.info("executable cache on disk: %r", self.disk_cache)
        self.execute_latency = LatencyStats()
        self.transfers = TransferCounters()
        #: The run's device servers (``--mpi-world``: emulator/world.py), or None.
        self.world: Any = None
        #: Cache key -> digest the servers compare, of the programs of several instances.
        self.world_digests: dict[str, int] = {}
        self._server_refuse = frozenset(config.refuse_opcodes)
        self._call = _CallState()
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        #: ExecuteStreams served at once at most (each holds a worker thread: ``serve`` sets
        #: half of its workers); past it a stream is refused and the client uses Execute.
        self.max_execute_streams = 4
        self._execute_streams = 0
        self._idle = threading.Condition(self._in_flight_lock)
        self._idle_waiters = 0  # wait_idle calls waiting (notified when no RPC is left)
        self._shutting_down = False

    def __repr__(self) -> str:
        return (
            f"DeviceService(ipus={self.pool.num_ipus}, free={self.pool.free}, "
            f"ipu_version={self.default_ipu_version!r}, sessions={self.sessions.count()}, "
            f"cache={self.cache!r})"
        )

    # -- wiring -------------------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The handler to add to a ``grpc.Server`` (``server.add_generic_rpc_handlers``)."""
        methods = {
            "OpenSession": (self.open_session, device_pb2.OpenSessionRequest),
            "CloseSession": (self.close_session, device_pb2.SessionRef),
            "Heartbeat": (self.heartbeat, device_pb2.SessionRef),
            "AttachIpus": (self.attach_ipus, device_pb2.AttachIpusRequest),
            "DetachIpus": (self.detach_ipus, device_pb2.SessionRef),
            "Compile": (self.compile, device_pb2.CompileRequest),
            "WriteVariables": (self.write_variables, device_pb2.WriteVariablesRequest),
            "ReadVariables": (self.read_variables, device_pb2.ReadVariablesRequest),
            "Execute": (self.execute, device_pb2.ExecuteRequest),
            "GetCounters": (self.get_counters, device_pb2.Empty),
            "AttachSharedMemory": (self.attach_shared_memory, device_pb2.AttachSharedMemoryRequest),
            "CancelRun": (self.cancel_run, device_pb2.SessionRef),
            "PushInfeed": (self.push_infeed, device_pb2.PushInfeedRequest),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._rpc(name, fn),
                request_deserializer=self._decoder(cls),
                response_serializer=self._encode,
            )
            for name, (fn, cls) in methods.items()
        }
        handlers["PutBlob"] = grpc.stream_unary_rpc_method_handler(
            self._rpc("PutBlob", self.put_blob, stream_in=True),
            request_deserializer=self._decoder(device_pb2.BlobChunk, parse_chunk),
            response_serializer=self._encode,
        )
        handlers["GetBlob"] = grpc.unary_stream_rpc_method_handler(
            self._rpc_stream_out("GetBlob", self.get_blob),
            request_deserializer=self._decoder(device_pb2.GetBlobRequest),
            response_serializer=self._encode,
        )
        handlers["ExecuteStream"] = grpc.stream_stream_rpc_method_handler(
            self._execute_stream(),
            request_deserializer=self._decoder(device_pb2.ExecuteRequest),
            response_serializer=self._encode,
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def start(self) -> None:
        """Starts the lease reaper."""
        self.sessions.start()

    def stop(self) -> None:
        """Stops the reaper and closes all sessions."""
        self.begin_shutdown()
        self.sessions.stop()

    # -- shutdown -----------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """From now on, calls that would start new work get UNAVAILABLE; calls waiting for
        IPUs give up. Calls already running go on (see ``wait_idle``)."""
        self._shutting_down = True
        self.pool.close()

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def in_flight(self) -> int:
        """RPCs being served right now."""
        with self._idle:
            return self._in_flight

    def wait_idle(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the RPCs in flight to finish; True if none is
        left."""
        end = time.monotonic() + max(0.0, timeout)
        with self._idle:
            self._idle_waiters += 1
            try:
                while self._in_flight:
                    remaining = end - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._idle.wait(remaining)
            finally:
                self._idle_waiters -= 1
            return True

    # -- the RPC wrapper ----------------------------------------------------------------

    def _decoder(self, cls: type, parse: Callable[[bytes], Any] | None = None
                 ) -> Callable[[bytes], Any]:
        """The request deserializer of ``cls`` (``parse``: how to parse it, if not
        ``cls.FromString``); it never raises (an undecodable request is refused by ``_rpc``)."""
        parse = parse or cls.FromString

        def decode(raw: bytes) -> Any:
            self.counters.add("bytes_in", len(raw))
            try:
                return _Request(parse(raw), len(raw))
            except Exception as e:  # DecodeError, recursion limit, ...
                return _Undecodable(cls.__name__, len(raw), f"{type(e).__name__}: {e}")

        return decode

    def _encode(self, reply: Any) -> bytes:
        raw = reply.SerializeToString()
        self.counters.add("bytes_out", len(raw))
        return raw

    def _rpc(self, name: str, fn: Callable[[Any], Any], stream_in: bool = False,
             own_timeout: bool = False) -> Callable[[Any, grpc.ServicerContext], Any]:
        """The wrapper of a handler (see the module docstring). ``own_timeout``: the request's
        ``timeout_seconds`` also bounds the call (a call on a stream)."""
        # Made once: the wrapper runs for every call (one per step, or more often).
        rpcs_counter = f"rpcs.{name}"
        ok_level = logging.DEBUG if name in _QUIET_WHEN_OK else logging.INFO
        latency = self.execute_latency if name == "Execute" else None
        in_flight_lock = self._in_flight_lock

        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            with in_flight_lock:
                self._in_flight += 1
            self.counters.add(rpcs_counter)
            stream = None
            if stream_in:  # an iterator of requests: the first one names the session
                stream = _Messages(request)
                request = stream.first
            message = getattr(request, "message", None)
            session_id = str(getattr(message, "session_id", ""))
            remaining = context.time_remaining()
            if own_timeout and message is not None and message.timeout_seconds > 0:
                own = message.timeout_seconds
                remaining = own if remaining is None else min(remaining, own)
            now = time.monotonic()
            call = self._call
            call.client_deadline = None if remaining is None else now + remaining
            limit = self.config.request_deadline_seconds
            if limit > 0:
                remaining = limit if remaining is None else min(remaining, limit)
            call.context = context
            call.deadline = None if remaining is None else now + remaining
            reply, out_bytes = None, 0
            try:
                if isinstance(request, _Undecodable):
                    raise ServiceError(
                        _INVALID,
                        f"{name}: the request ({request.nbytes} bytes) is not a valid "
                        f"{request.type_name}: {request.error}",
                        kind="undecodable-request",
                    )
                if self._shutting_down and name not in _ALLOWED_WHILE_DRAINING:
                    raise ServiceError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{name}: the device server is shutting down and accepts no new work; "
                        f"retry once it is back.",
                        kind="shutting-down",
                    )
                reply = fn(message) if stream is None else fn(message, stream)
                out_bytes = reply.ByteSize()
                max_bytes = self.config.max_message_bytes
                if 0 < max_bytes < out_bytes:
                    raise ServiceError(
                        _EXHAUSTED,
                        f"{name}: the reply would be {out_bytes} bytes, more than the server's "
                        f"message limit of {max_bytes} bytes (--max-message-bytes).",
                        kind="message-too-large",
                    )
                error, exc_info = None, False
            except ServiceError as e:
                error, exc_info = e, False
            except Exception as e:
                error, exc_info = ServiceError(
                    grpc.StatusCode.INTERNAL,
                    f"{name} failed inside the device server: {type(e).__name__}: {e}",
                    kind="internal",
                ), True
            finally:
                call.context = None
                call.deadline = None
                call.client_deadline = None
                with in_flight_lock:
                    self._in_flight -= 1
                    if not self._in_flight and self._idle_waiters:
                        self._idle.notify_all()
            seconds = time.perf_counter() - start
            if stream is not None:
                request = _Request(message, stream.nbytes)
            if error is None:
                if latency is not None:
                    latency.observe(seconds)
                if rpc_logger.isEnabledFor(ok_level):  # (log_rpc's own test, without the call)
                    self.log_rpc(name, session_id, "OK", seconds, request.nbytes, out_bytes,
                                 context)
                return reply
            text = error.message
            if len(text) > _MAX_DETAILS_CHARS:
                text = text[:_MAX_DETAILS_CHARS] + f"... ({len(error.message)} chars)"
            self.count_error(error.code, error.kind)
            self.log_rpc(name, session_id, error.code.name, seconds, request.nbytes, 0, context,
                         kind=error.kind, message=text, exc_info=exc_info)
            if error.kind:
                context.set_trailing_metadata(((ERROR_KIND_METADATA, error.kind),))
            context.abort(error.code, text)

        return handle

    def _rpc_stream_out(self, name: str, fn: Callable[[Any], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        """``_rpc`` for a call that answers with a stream: ``fn`` checks the request and returns
        a ``_StreamReply`` (errors then get their status as any call's do), whose chunks are
        sent after."""
        unary = self._rpc(name, fn)

        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            reply = unary(request, context)
            try:
                yield from reply.chunks
            except ServiceError as e:
                self.count_error(e.code, e.kind)
                context.abort(e.code, e.message)
            except Exception as e:
                self.count_error(grpc.StatusCode.INTERNAL, "internal")
                context.abort(grpc.StatusCode.INTERNAL,
                              f"{name} failed inside the device server: {type(e).__name__}: {e}")

        return handle

    def _execute_stream(self) -> Callable[[Any, grpc.ServicerContext], Any]:
        """ExecuteStream (device.proto): each request of the stream is an Execute call, served
        by ``_rpc`` as the unary call is (counted, logged, deadline from the request's
        ``timeout_seconds``); a call's error ends the stream with its status. The stream
        holds this worker thread while it is open, so at most ``max_execute_streams`` are."""
        call = self._rpc("Execute", self.execute, own_timeout=True)

        def handle(requests: Any, context: grpc.ServicerContext) -> Any:
            with self._in_flight_lock:
                open_now = self._execute_streams
                refused = open_now >= self.max_execute_streams
                if not refused:
                    self._execute_streams += 1
            if refused:
                message = (f"ExecuteStream: the server serves {open_now} streams, as many as "
                           f"it may (each holds one of its worker threads); the request was "
                           f"not run: send it with Execute.")
                self.count_error(_EXHAUSTED, "too-many-streams")
                self.log_rpc("ExecuteStream", "", _EXHAUSTED.name, 0.0, 0, 0, context,
                             kind="too-many-streams", message=message)
                context.set_trailing_metadata(((ERROR_KIND_METADATA, "too-many-streams"),))
                context.abort(_EXHAUSTED, message)
            self.counters.add("rpcs.ExecuteStream")
            stream = _ExecuteStream()
            context.add_callback(stream.cancelled)
            try:
                for request in requests:
                    self._call.stream = stream
                    try:
                        reply = call(request, context)
                    finally:
                        self._call.stream = None
                    yield reply
            finally:
                with self._in_flight_lock:
                    self._execute_streams -= 1

        return handle

    def count_error(self, code: grpc.StatusCode, kind: str = "") -> None:
        """Counts an RPC that ended with ``code`` (by code, and by kind: the error's own, or
        the code's name, e.g. ``invalid-argument``)."""
        self.counters.add("errors")
        self.counters.add(f"errors.{code.name}")
        self.counters.add(f"error_kinds.{kind or code.name.lower().replace('_', '-')}")

    def log_rpc(
        self,
        method: str,
        session_id: str,
        status: str,
        seconds: float,
        bytes_in: int,
        bytes_out: int,
        context: Any = None,
        kind: str = "",
        message: str = "",
        exc_info: bool = False,
    ) -> None:
        """Writes the one log record of an RPC to ``device_server.rpc``: INFO if it went
        well (DEBUG for the per-step calls, ``_QUIET_WHEN_OK``: a record per step would cost
        the step a fifth of its time on loopback and flood the log; the counters and the
        latency histogram cover them), WARNING for an error, ERROR with the traceback for a
        fault inside the server.
        The fields travel as ``record.rpc`` (``--log-format json`` prints them). Sessions are
        shown by the first 8 characters of their id, here and in every log line of the
        server: the whole id is a credential."""
        if status == "OK":
            level = logging.DEBUG if method in _QUIET_WHEN_OK else logging.INFO
        else:
            level = logging.ERROR if exc_info else logging.WARNING
        if not rpc_logger.isEnabledFor(level):
            return
        fields: dict[str, Any] = {
            "method": method,
            "session": session_id[:8],
            "status": status,
            "duration_ms": round(seconds * 1e3, 3),
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
        }
        if context is not None:
            try:
                fields["peer"] = context.peer()
            except Exception:  # no peer once the connection is gone
                pass
        if kind:
            fields["kind"] = kind
        if message and len(session_id) > 8:
            message = message.replace(session_id, session_id[:8])
        if message:
            fields["message"] = message
        text = (f"{method} session={fields['session'] or '-'} -> {status} in "
                f"{fields['duration_ms']:.2f} ms ({bytes_in} B in, {bytes_out} B out)")
        if message:
            text += f": {message}"
        rpc_logger.log(level, "%s", text, exc_info=exc_info, extra={"rpc": fields})

    def _remaining(self) -> float | None:
        """Seconds left before this call's deadline (the client's or the server's), or None."""
        deadline = self._call.deadline
        return None if deadline is None else deadline - time.monotonic()

    def _client_waiting(self) -> bool:
        """Whether the client of this call still waits for its answer."""
        context = self._call.context
        return context is None or context.is_active()

    def _stop_token(self, run_deadline_seconds: float) -> StopToken:
        """A stop token for the run this call starts: it stops by itself at the run deadline
        the request asks for or at the call's own deadline, and when the client cancels or
        goes away (gRPC's termination callback)."""
        call = self._call
        # The client's deadline (the server's request deadline bounds waiting, not running).
        deadline = call.client_deadline
        if run_deadline_seconds > 0:
            run_end = time.monotonic() + run_deadline_seconds
            deadline = run_end if deadline is None else min(deadline, run_end)
        token = StopToken(deadline)
        if call.stream is not None:
            call.stream.token = token  # the stream's callback stops it (one per stream)
        elif call.context is not None:
            call.context.add_callback(lambda: token.stop("cancelled"))
        return token

    def _on_session_closed(self, session: Session, reason: str) -> None:
        self.counters.add("sessions_expired" if reason == "expired" else "sessions_closed")

    def _enter(self, session_id: str) -> Any:
        return self.sessions.get(session_id).enter(
            self.sessions.max_waiting_calls, timeout=self._remaining()
        )

    # -- sessions and IPUs --------------------------------------------------------------

    def _peer(self) -> str:
        """The peer of this call's connection (``ipv4:10.0.0.7:53122``), or ""."""
        context = self._call.context
        try:
            return str(context.peer()) if context is not None else ""
        except Exception:  # no peer once the connection is gone
            return ""

    def open_session(self, request: device_pb2.OpenSessionRequest) -> device_pb2.OpenSessionReply:
        session = self.sessions.open(request.client_name, request.lease_seconds,
                                     peer=self._peer() if request.connection_lease else "")
        session.data = SessionData()
        self.counters.add("sessions_opened")
        return device_pb2.OpenSessionReply(
            session_id=session.session_id,
            server_version=device_server.__version__,
            default_ipu_version=self.default_ipu_version,
            num_ipus=self.pool.num_ipus,
            free_ipus=self.pool.free,
            max_message_bytes=self.config.max_message_bytes,
            lease_seconds=session.lease_seconds,
            max_session_bytes=self.config.max_session_bytes,
            unix_socket=self.config.unix_socket,
            system=self.system.name if self.system else "",
            connection_lease=session.connection_lease,
        )

    def close_session(self, request: device_pb2.SessionRef) -> device_pb2.Empty:
        self.sessions.close(request.session_id)
        return device_pb2.Empty()

    def heartbeat(self, request: device_pb2.SessionRef) -> device_pb2.Empty:
        session = self.sessions.get(request.session_id)  # renews the lease
        if session.connection_lease:  # and ties it to this connection too (a reconnect)
            self.sessions.bind(session, self._peer())
        return device_pb2.Empty()

    def attach_ipus(self, request: device_pb2.AttachIpusRequest) -> device_pb2.AttachIpusReply:
        with self._enter(request.session_id) as s:
            if s.ipu_ids:
                raise ServiceError(
                    _PRECONDITION,
                    f"Session {s.session_id} already has IPUs {s.ipu_ids} attached "
                    f"({s.ipu_version}); call DetachIpus first.",
                )
            if request.tiles_per_ipu < 0:
                raise ServiceError(
                    _INVALID,
                    f"tiles_per_ipu must be >= 0 (0 = the version's full count). "
                    f"Received: {request.tiles_per_ipu}",
                )
            wait = request.wait_seconds
            if not wait >= 0:  # negative or NaN
                raise ServiceError(
                    _INVALID, f"wait_seconds must be >= 0. Received: {request.wait_seconds}"
                )
            version = request.ipu_version or self.default_ipu_version
            try:
                target = get_target(version, tiles_per_ipu=request.tiles_per_ipu)
            except ValueError as e:
                raise ServiceError(
                    _INVALID,
                    f"AttachIpus: no target for ipu_version={version!r}, "
                    f"tiles_per_ipu={request.tiles_per_ipu}: {e}",
                ) from None
            if self.system is not None and target.name != self.system.ipu_version:
                raise ServiceError(
                    _INVALID,
                    f"AttachIpus: this server hosts a {self.system.name} "
                    f"({self.system.description}): it has no {version!r} IPUs. Ask for "
                    f"ipu_version {self.system.ipu_version!r} (or none), or use a server "
                    f"started with another --system.",
                )
            remaining = self._remaining()
            if remaining is not None:
                wait = min(wait, max(0.0, remaining - 0.05))  # answer before the deadline
            ids = self.pool.allocate(request.num_ipus, s.session_id, wait_seconds=wait,
                                     still_wanted=self._client_waiting,
                                     wanted=request.ipu_ids)
            s.ipu_ids = ids
            s.target = target
            s.ipu_version, s.tiles_per_ipu = _describe_target(target, version)
            logger.info("session %s attached IPUs %s (%s, %d tiles each)", s.short_id, ids,
                        s.ipu_version, s.tiles_per_ipu)
            return device_pb2.AttachIpusReply(
                ipu_ids=ids, ipu_version=s.ipu_version, tiles_per_ipu=s.tiles_per_ipu
            )

    def detach_ipus(self, request: device_pb2.SessionRef) -> device_pb2.Empty:
        with self._enter(request.session_id) as s:
            self.sessions.detach(s)
        return device_pb2.Empty()

    # -- programs -----------------------------------------------------------------------

    def compile(self, request: device_pb2.CompileRequest) -> device_pb2.CompileReply:
        with self._enter(request.session_id) as s:
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
            refuse = frozenset(request.options.refuse_opcodes) | self._server_refuse
            switches = [f"{name}={value!r}" for name, value in (
                ("fault_inject_opcode", request.options.fault_inject_opcode[:64]),
                ("refuse_opcodes", [o[:64] for o in request.options.refuse_opcodes[:8]])) if value]
            if switches and not self.config.allow_test_options:
                raise ServiceError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"Compile of {module.name!r}: {' and '.join(switches)} "
                    f"{'are test switches' if len(switches) > 1 else 'is a test switch'}, and this "
                    f"server refuses test switches from clients (its operator allows them with "
                    f"--allow-test-options).", kind="test-option-refused")
            fault = self.config.fault_inject_opcode or request.options.fault_inject_opcode
            allow_oom = request.options.allow_out_of_memory
            numerics = numerics_options(request.options)
            planning = planning_options(request.options)
            pipeline = pipeline_options(request.options, module.name)
            replication = self._replication(s, request.options.replicas, module.name,
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
                parameters=[_tensor_spec(dt, shape) for dt, shape in exe.parameters],
                outputs=[_tensor_spec(dt, shape if exe.options.replicas <= 1
                                      else (exe.options.replicas, *shape))
                         for dt, shape in exe.outputs],
                aliases=[
                    ir_pb2.Alias(output_index=o, parameter_number=p)
                    for o, p in sorted(exe.aliases.items())
                ],
                estimate=_estimate(exe.estimate),
                compile_seconds=lookup.compile_seconds,
            )

    def _compile_stoppable(self, s: Session, key: str, build: Callable[[], Any],
                           module_name: str) -> Any:
        """``cache.get_or_compile(key, build)`` with a stop token, as a run has: CancelRun
        (Ctrl-C), the client going away or its deadline, the session closing and the server
        shutting down stop the planning at its next ``cancel.checkpoint``; nothing is cached
        and the session takes its next call at once. A compile of the same key that another
        call started and was stopped is compiled again here."""
        token = self._stop_token(0.0)
        with s.run(token), running(token):
            while True:
                try:
                    return self.cache.get_or_compile(key, build)
                except RunStopped as e:
                    if token.reason is None:  # another call's compile of this key stopped
                        continue
                    self.counters.add(f"compiles_stopped.{token.reason}")
                    code, kind = _STOP_STATUS[token.reason]
                    raise ServiceError(
                        code, f"Compile of {module_name!r}: {e}; nothing was compiled or cached "
                        f"({_STOP_WHY.get(token.reason, token.reason)}).", kind=kind) from None

    def _replication(self, s: Session, replicas: int, module_name: str,
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

    def _generate_program(self, exe: Any, what: str) -> None:
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

    # -- variables ----------------------------------------------------------------------

    def write_variables(self, request: device_pb2.WriteVariablesRequest) -> device_pb2.Empty:
        with self._enter(request.session_id) as s:
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
                    self._store_variable(s, key, value)
        return device_pb2.Empty()

    def _store_variable(self, s: Session, key: str, value: np.ndarray) -> None:
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

    def read_variables(self, request: device_pb2.ReadVariablesRequest) -> device_pb2.ReadVariablesReply:
        with self._enter(request.session_id) as s:
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

    # -- bulk data -------------------------------------------------------------------------

    def put_blob(self, first: device_pb2.BlobChunk, rest: Any) -> device_pb2.BlobRef:
        """Stages a stream of chunks in the session, within its memory limit."""
        s = self.sessions.get(first.session_id)
        total = int(first.total_bytes)
        if total < 0:
            raise ServiceError(_INVALID, f"PutBlob: total_bytes is {total}.")
        limit = self.config.max_session_bytes
        with self._enter(first.session_id):
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
        with self._enter(first.session_id):
            return device_pb2.BlobRef(blob_id=s.data.put(blob))

    def get_blob(self, request: device_pb2.GetBlobRequest) -> _StreamReply:
        """Streams out (and forgets) a blob a reply named."""
        with self._enter(request.session_id) as s:
            array = s.data.blobs_out.pop(request.blob_id, None)
            if array is None:
                raise ServiceError(
                    _NOT_FOUND, f"GetBlob: session {s.session_id} has no blob "
                    f"{request.blob_id[:40]!r} to send (a blob is sent once).", kind="unknown-blob")
        chunk = int(request.chunk_bytes) or DEFAULT_CHUNK_BYTES
        limit = self.config.max_message_bytes
        if limit > 0:
            chunk = min(chunk, max(1, limit // 4))
        return _StreamReply(send_blob(array, chunk, self.transfers, s.touch))

    def attach_shared_memory(
        self, request: device_pb2.AttachSharedMemoryRequest
    ) -> device_pb2.AttachSharedMemoryReply:
        """Maps the client's segment if it is on this machine (the co-location probe)."""
        with self._enter(request.session_id) as s:
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

    # -- execution ----------------------------------------------------------------------

    def execute(self, request: device_pb2.ExecuteRequest) -> device_pb2.ExecuteReply:
        with self._enter(request.session_id) as s:
            if s.target is None:
                raise ServiceError(
                    _PRECONDITION,
                    f"Execute: session {s.session_id} has no IPUs attached.",
                )
            handle = s.executables.get(request.executable_id)
            if handle is None:
                shown = request.executable_id[:80]
                raise ServiceError(
                    _NOT_FOUND,
                    f"Execute: session {s.session_id} has no executable {shown!r} "
                    f"(handles are valid only in the session that compiled them).",
                    kind="unknown-executable",
                )
            exe = handle.executable
            what = f"Execute of executable {handle.handle_id}"
            expected = exe.parameters
            if len(request.parameters) != len(expected):
                raise ServiceError(
                    _INVALID,
                    f"{what}: expected {len(expected)} parameters, received "
                    f"{len(request.parameters)}.",
                )
            inputs: list[np.ndarray] = []
            variable_of: dict[int, str] = {}  # parameter number -> resident variable key
            for number, (binding, (dt, shape)) in enumerate(zip(request.parameters, expected, strict=True)):
                source = binding.WhichOneof("source")
                if source == "value":
                    value = tensor_value(s.data, binding.value, f"{what}: parameter {number}",
                                         self.transfers)
                    received = "value"  # spelled below, only if it does not match
                elif source == "variable_key":
                    key = binding.variable_key
                    value = s.variables.get(key)
                    if value is None:
                        raise ServiceError(
                            _NOT_FOUND,
                            f"{what}: parameter {number} is bound to variable {key!r}, which "
                            f"session {s.session_id} does not have.",
                            kind="unknown-variable",
                        )
                    variable_of[number] = key
                    received = ""  # spelled below, only if it does not match
                else:
                    raise ServiceError(
                        _INVALID, f"{what}: parameter {number} has neither a value nor a variable key."
                    )
                if value.dtype != dt or tuple(value.shape) != tuple(shape):
                    received = (f"a value of {_spec(value.dtype, value.shape)}" if received
                                else f"variable {binding.variable_key!r} of "
                                     f"{_spec(value.dtype, value.shape)}")
                    raise ServiceError(
                        _INVALID,
                        f"{what}: parameter {number} expects {_spec(dt, tuple(shape))}, "
                        f"received {received}.",
                    )
                inputs.append(value)

            # Outputs that carry a new value of a resident variable, by output index.
            updates: dict[int, str] = {}
            for out_index, number in exe.aliases.items():
                key = variable_of.get(number)
                if key is None:
                    continue
                if key in updates.values():
                    raise ServiceError(
                        _INVALID,
                        f"{what}: variable {key!r} is bound to more than one updated parameter.",
                    )
                updates[out_index] = key

            est = exe.estimate
            if est.refused:  # over the tile model's margin (within it, or unknown: it runs)
                raise ServiceError(
                    _EXHAUSTED,
                    f"{what}: program {exe.name!r} does not fit in tile memory "
                    f"({est.peak_tile_bytes} bytes on the fullest tile, tiles have "
                    f"{est.tile_bytes_limit}); it was compiled with allow_out_of_memory for "
                    f"its report and cannot run.",
                    kind="out-of-memory",
                )
            remaining = self._remaining()
            if remaining is not None and remaining <= 0:
                raise ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{what}: the call's deadline passed while it waited; not run.",
                    kind="deadline",
                )
            if not self._client_waiting():
                raise ServiceError(
                    grpc.StatusCode.CANCELLED,
                    f"{what}: the client went away before it ran; not run.",
                    kind="cancelled",
                )

            # Updated variables' buffers are donated: the program may write their new values
            # into them (as XLA does with donated buffers); a variable bound twice is not.
            bound = Counter(variable_of.values()) if updates else {}
            donated = [exe.aliases[o] for o, key in updates.items() if bound[key] == 1]
            if not exe.program_ready:
                self._generate_program(exe, what)  # before the run deadline starts
            token = self._stop_token(request.run_deadline_seconds)
            token.infeed = lambda feed, tok, where: s.data.infeed(feed).pull(tok, where)
            token.outfeed = s.data.enqueue_outfeed
            s.data.outfeeds.clear()  # what a stopped call enqueued is not kept
            replicas = exe.options.replicas
            world = self.world if exe.options.instances > 1 else None
            per_replica: list[list[np.ndarray]] = []
            if replicas > 1:
                # Every replica reads the same parameter values and its own variables.
                per_replica = [inputs]
                for r in range(1, replicas):
                    args = list(inputs)
                    for number, key in variable_of.items():
                        args[number] = s.replica_variable(key, r)
                    per_replica.append(args)
            start = time.perf_counter()
            try:
                with s.run(token), self._world_run(world, handle, what, token) as meeting:
                    if replicas > 1 or meeting is not None:
                        try:
                            per_replica, group = run_replicated(
                                exe, per_replica or [inputs], [donated] * replicas, stop=token,
                                world=meeting)
                        except BaseException:
                            # Replicas may have written some variables in place before one
                            # failed: the others start again from replica 0's next time.
                            for key in variable_of.values():
                                s.replica_variables.pop(key, None)
                            raise
                        outputs = per_replica[0]
                        self.counters.add("replicated_executions")
                        self.counters.add("all_reduce_bytes", group.all_reduce_bytes)
                    else:
                        outputs = exe.run(inputs, donated, stop=token)
                    self.counters.add("replica_runs", replicas)
            except RunStopped as e:
                self.counters.add(f"runs_stopped.{e.reason}")
                code, kind = _STOP_STATUS[e.reason]
                raise ServiceError(
                    code, f"{what}: {e}; nothing of this call was kept (the device holds the "
                    f"variables as they were before it).", kind=kind,
                ) from e
            except OutOfMemoryError as e:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: {e}",
                                   kind="out-of-memory") from e
            except InfeedEnded as e:
                raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, f"{what}: {e}",
                                   kind="infeed-ended") from e
            except FloatingPointExceptionError as e:
                # The program's own arithmetic (as TF's CheckNumerics reports it), not a fault
                # of the server: INVALID_ARGUMENT, refined by the kind.
                raise ServiceError(_INVALID, f"{what}: {e}", kind="floating-point-exception") from e
            except EmulatorError as e:
                raise ServiceError(grpc.StatusCode.INTERNAL, f"{what} failed on the device: {e}",
                                   kind="execution") from e
            seconds = time.perf_counter() - start
            if len(outputs) != len(exe.outputs):
                raise ServiceError(
                    grpc.StatusCode.INTERNAL,
                    f"{what}: the emulator returned {len(outputs)} outputs, the executable "
                    f"declares {len(exe.outputs)}.",
                )
            self.counters.add("executions")
            for out_index, key in updates.items():
                self._store_variable(s, key, outputs[out_index])
                for r in range(1, replicas):
                    s.set_replica_variable(key, r, per_replica[r][out_index])
            if replicas > 1:
                # A replicated program's outputs: every replica's, stacked (leading dimension).
                outputs = [np.stack([per_replica[r][i] for r in range(replicas)])
                           if request.return_updated_variables or i not in updates else out
                           for i, out in enumerate(outputs)]
            if token.steps_completed is not None:
                # The device loop ended early: its variables (stored above) are those of its
                # last completed step; the caller gets the reason, not the outputs.
                reason = token.reason or "cancelled"
                self.counters.add(f"runs_stopped.{reason}")
                code, kind = _STOP_STATUS[reason]
                raise ServiceError(
                    code, f"{what}: stopped ({_STOP_WHY[reason]}) after {token.steps_completed} "
                    f"completed steps of its device loop; the device holds the variables of "
                    f"step {token.steps_completed} of this call.", kind=kind,
                )

            # Each output at its run-time shape: an output with dynamic dimensions may be
            # smaller than its bound there (the message-size check above counted the bounds).
            # Outputs bigger than the reply's budget go as blobs (GetBlob), or into the
            # shared-memory regions the request named.
            reply = device_pb2.ExecuteReply(device_seconds=seconds)
            budget = ReplyBudget(self.config.max_message_bytes)
            regions = request.output_regions
            for i, out in enumerate(outputs):
                if request.return_updated_variables or i not in updates:
                    fill_reply_tensor(s.data, reply.outputs.add(), out, budget,
                                      regions[i] if i in regions else None, self.transfers)
                else:
                    dtypes.fill_tensor(reply.outputs.add(), out, with_data=False)
            for feed, items in s.data.outfeeds.items():
                data = reply.outfeeds.add(feed=feed, count=len(items))
                for k in range(len(items[0]) if items else 0):
                    stacked = np.stack([item[k] for item in items])
                    fill_reply_tensor(s.data, data.values.add(), stacked, budget, None,
                                      self.transfers)
            s.data.outfeeds.clear()
            return reply

    @contextlib.contextmanager
    def _world_run(self, world: Any, handle: Any, what: str, token: Any) -> Iterator[Any]:
        """A world program's execution joined with the other servers' (``WorldRun``), or
        None for a program of this server only."""
        if world is None:
            yield None
            return
        digest = self.world_digests[handle.cache_key]
        with world.run(digest, handle.executable.options.replicas, what,
                       stopped=lambda: token.reason is not None) as meeting:
            yield meeting

    def push_infeed(self, request: device_pb2.PushInfeedRequest) -> device_pb2.PushInfeedReply:
        """Appends batches to one of the session's infeeds (without entering the session: a
        run of it may be pulling from that infeed right now)."""
        s = self.sessions.get(request.session_id)
        if not request.feed:
            raise ServiceError(_INVALID, "PushInfeed: the request names no feed.")
        batches: list[list[np.ndarray]] = []
        for b, batch in enumerate(request.batches):
            values = []
            for k, tensor in enumerate(batch.values):
                what = f"PushInfeed {request.feed!r}: batch {b}, value {k}"
                if tensor.WhichOneof("payload") == "blob_id":
                    raise ServiceError(_INVALID, f"{what}: an infeed batch travels inline or in "
                                                 f"shared memory, not as a blob.")
                value = tensor_value(s.data, tensor, what, self.transfers)
                if tensor.WhichOneof("payload") == "shm":
                    value = np.array(value)  # the host reuses the region once this returns
                values.append(value)
            batches.append(values)
        limit = self.config.max_session_bytes
        incoming = sum(int(v.nbytes) for batch in batches for v in batch)
        queued = s.data.infeed_bytes()
        if limit > 0 and queued + incoming > limit:
            raise ServiceError(
                _EXHAUSTED, f"PushInfeed {request.feed!r}: {queued + incoming} bytes of batches "
                f"would wait in session {s.session_id}'s infeeds, over the server's limit of "
                f"{limit} bytes per session (--max-session-bytes).", kind="session-memory")
        feed = s.data.infeed(request.feed)
        feed.push(batches, request.end, request.reset)
        self.counters.add("infeed_batches", len(batches))
        s.touch()
        return device_pb2.PushInfeedReply(queued=feed.queued())

    def cancel_run(self, request: device_pb2.SessionRef) -> device_pb2.CancelRunReply:
        """Stops the session's runs in progress at their next step (no need to enter the
        session: the run holds it)."""
        s = self.sessions.get(request.session_id)
        return device_pb2.CancelRunReply(runs_stopped=s.stop_runs("cancelled"))

    # -- counters -----------------------------------------------------------------------

    def counter_values(self) -> dict[str, int]:
        """Counters and gauges, by name (``errors.<CODE>``, ``rpcs.<Method>`` included)."""
        values = {name: 0 for name in _COUNTER_HELP}
        values.update(self.counters.snapshot())
        values["sessions_active"] = self.sessions.count()
        values["ipus_total"] = self.pool.num_ipus
        values["ipus_free"] = self.pool.free
        values["executables_cached"] = len(self.cache)
        values["cache_evictions"] = self.cache.evictions
        values["rpcs_in_flight"] = self.in_flight
        values["execute_streams_open"] = self._execute_streams
        _, count, _ = self.execute_latency.snapshot()
        values["execute_latency_count"] = count
        values["execute_latency_p50_us"] = round(self.execute_latency.quantile(0.5) * 1e6)
        values["execute_latency_p99_us"] = round(self.execute_latency.quantile(0.99) * 1e6)
        values.update({f"transfer.{k}": v for k, v in self.transfers.snapshot().items()})
        if self.world is not None:
            values.update(self.world.counters())
        if self.disk_cache is not None:
            values.update({f"disk_cache_{k}": v for k, v in self.disk_cache.stats.items()
                           if k != "hits"})  # hits: those whose record described the module
        return values

    def get_counters(self, request: device_pb2.Empty) -> device_pb2.CountersReply:
        values = self.counter_values()
        return device_pb2.CountersReply(
            counters=values, prometheus_text=prometheus_text(values, self.execute_latency)
        )


def prometheus_text(values: dict[str, int], latency: LatencyStats | None = None) -> str:
    """Renders ``DeviceService.counter_values()`` (and the Execute latencies) in the
    Prometheus text exposition format."""
    lines: list[str] = []
    prefix = "tf_ipu_device_"
    for name, help_text in _COUNTER_HELP.items():
        if name in ("errors", "error_kinds"):
            continue
        metric = f"{prefix}{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter",
                  f"{metric} {values.get(name, 0)}"]
    for family, label, help_text in (
        ("errors", "code", _COUNTER_HELP["errors"]),
        ("error_kinds", "kind", _COUNTER_HELP["errors"]),
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


# -- helpers ----------------------------------------------------------------------------


def _describe_target(target: Any, fallback_name: str) -> tuple[str, int]:
    """(canonical version name, tiles per IPU) of an emulator target."""
    name = getattr(target, "name", None) or getattr(target, "ipu_version", None) or fallback_name
    return str(name), int(getattr(target, "tiles_per_ipu", 0))


def _tensor_spec(dtype: np.dtype, shape: tuple[int, ...]) -> device_pb2.TensorSpec:
    return device_pb2.TensorSpec(dtype=dtypes.from_numpy(dtype), dims=list(shape))


def _estimate(est: Any) -> device_pb2.Estimate:
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
