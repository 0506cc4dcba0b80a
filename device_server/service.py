"""The device server's gRPC servicer: typed requests in, the parts below called, typed
replies or gRPC statuses out. This module is the plumbing and the error mapping; each concern
lives in its own module:

    tf_ipu.client.DeviceClient ==gRPC==> DeviceService (this module): each RPC to its part,
                                         errors to statuses (``_rpc``), logs, shutdown
        |- calls.py          the call being served: deadlines, client, stop token
        |- sessions.py       OpenSession, CloseSession, Heartbeat: leases, the IPU pool
        |- ipus.py           AttachIpus: a session's target and IPUs
        |- programs.py       Compile: ExecutableCache, DiskCache (plan lock), world digests
        |    |- compile_requests.py  the request's options and array sizes, errors mapped
        |    '- service_config.py    ServiceConfig; the test switches it allows
        |- variables.py      Read/WriteVariables, PutBlob, GetBlob, AttachSharedMemory
        |- execution.py      Execute (replicas, a world's run), PushInfeed
        |    '- data_path.py         where a tensor's bytes are (message, blob, shared memory)
        '- counters.py       GetCounters: counters, Execute latency, Prometheus text

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

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

import device_server
from device_server.calls import CallState, ExecuteStreamState
from device_server.counters import (
    COUNTER_HELP,
    LATENCY_BUCKETS,
    Counters,
    LatencyStats,
    prometheus_text,
)
from device_server.data_path import SessionData, TransferCounters
from device_server.emulator import get_target
from device_server.execution import Execution
from device_server.ipus import attach_ipus, describe_target
from device_server.programs import Programs, estimate, tensor_spec
from device_server.protocol import device_pb2, hardware
from device_server.protocol.chunks import parse_chunk
from device_server.service_config import ServiceConfig
from device_server.sessions import (
    ConnectionTable,
    IpuPool,
    ServiceError,
    Session,
    SessionManager,
)
from device_server.variables import Variables

#: Names other modules import from here (the parts above hold them now).
__all__ = ["COUNTER_HELP", "ERROR_KIND_METADATA", "LATENCY_BUCKETS", "SERVICE_NAME", "Counters",
           "DeviceService", "LatencyStats", "ServiceConfig", "prometheus_text"]
#: The Compile reply's pieces, as the fuzz targets and tests/test_tile_verdicts.py call them.
_tensor_spec = tensor_spec
_estimate = estimate

logger = logging.getLogger(__name__)
rpc_logger = logging.getLogger("device_server.rpc")

SERVICE_NAME = device_pb2.DESCRIPTOR.services_by_name["DeviceService"].full_name
ERROR_KIND_METADATA = "tf-ipu-error-kind"
_MAX_DETAILS_CHARS = 2000

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

#: Calls still served while the server shuts down (they start no new work).
_ALLOWED_WHILE_DRAINING = frozenset(
    {"CloseSession", "Heartbeat", "DetachIpus", "ReadVariables", "GetCounters", "GetBlob",
     "CancelRun"}
)
#: Calls made once per step or more often: their successful records are DEBUG.
_QUIET_WHEN_OK = frozenset({"Execute", "Heartbeat", "ReadVariables", "WriteVariables", "PutBlob",
                            "GetBlob", "CancelRun", "PushInfeed"})


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
        self.default_ipu_version, _ = describe_target(default_target, config.ipu_version)
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
        self._call = CallState()
        self.execute_latency = LatencyStats()
        self.transfers = TransferCounters()
        # ValueError for a disk cache folder that cannot be used: the server does not start.
        self.programs = Programs(config, self.counters, self.pool, self.system, self._call)
        self.variables = Variables(config, self.counters, self.transfers, self.sessions,
                                   self._call)
        self.execution = Execution(config, self.counters, self.transfers, self.sessions,
                                   self._call, self.programs, self.variables)
        self.cache = self.programs.cache
        self.disk_cache = self.programs.disk_cache
        #: Cache key -> digest the servers compare, of the programs of several instances.
        self.world_digests = self.programs.world_digests
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        #: ExecuteStreams served at once at most (each holds a worker thread: ``serve`` sets
        #: half of its workers); past it a stream is refused and the client uses Execute.
        self.max_execute_streams = 4
        self._execute_streams = 0
        self._idle = threading.Condition(self._in_flight_lock)
        self._idle_waiters = 0  # wait_idle calls waiting (notified when no RPC is left)
        self._shutting_down = False

    @property
    def world(self) -> Any:
        """The run's device servers (``--mpi-world``: emulator/world.py), or None."""
        return self.programs.world

    @world.setter
    def world(self, world: Any) -> None:
        self.programs.world = world

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
            stream = ExecuteStreamState()
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

    def _on_session_closed(self, session: Session, reason: str) -> None:
        self.counters.add("sessions_expired" if reason == "expired" else "sessions_closed")

    def _enter(self, session_id: str) -> Any:
        return self._call.enter(self.sessions, session_id)

    # -- sessions and IPUs --------------------------------------------------------------

    def open_session(self, request: device_pb2.OpenSessionRequest) -> device_pb2.OpenSessionReply:
        session = self.sessions.open(request.client_name, request.lease_seconds,
                                     peer=self._call.peer() if request.connection_lease else "")
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
            self.sessions.bind(session, self._call.peer())
        return device_pb2.Empty()

    def attach_ipus(self, request: device_pb2.AttachIpusRequest) -> device_pb2.AttachIpusReply:
        with self._enter(request.session_id) as s:
            return attach_ipus(s, request, self.pool, self.system, self.default_ipu_version,
                               self._call)

    def detach_ipus(self, request: device_pb2.SessionRef) -> device_pb2.Empty:
        with self._enter(request.session_id) as s:
            self.sessions.detach(s)
        return device_pb2.Empty()

    # -- programs, variables, bulk data, execution (programs.py, variables.py, execution.py)

    def compile(self, request: device_pb2.CompileRequest) -> device_pb2.CompileReply:
        with self._enter(request.session_id) as s:
            return self.programs.compile(s, request)

    def write_variables(self, request: device_pb2.WriteVariablesRequest) -> device_pb2.Empty:
        with self._enter(request.session_id) as s:
            return self.variables.write(s, request)

    def read_variables(self, request: device_pb2.ReadVariablesRequest) -> device_pb2.ReadVariablesReply:
        with self._enter(request.session_id) as s:
            return self.variables.read(s, request)

    def put_blob(self, first: device_pb2.BlobChunk, rest: Any) -> device_pb2.BlobRef:
        """Stages a stream of chunks in the session, within its memory limit."""
        return self.variables.put_blob(first, rest)

    def get_blob(self, request: device_pb2.GetBlobRequest) -> _StreamReply:
        """Streams out (and forgets) a blob a reply named."""
        return _StreamReply(self.variables.get_blob(request))

    def attach_shared_memory(
        self, request: device_pb2.AttachSharedMemoryRequest
    ) -> device_pb2.AttachSharedMemoryReply:
        """Maps the client's segment if it is on this machine (the co-location probe)."""
        with self._enter(request.session_id) as s:
            return self.variables.attach_shared_memory(s, request)

    def execute(self, request: device_pb2.ExecuteRequest) -> device_pb2.ExecuteReply:
        with self._enter(request.session_id) as s:
            return self.execution.execute(s, request)

    def push_infeed(self, request: device_pb2.PushInfeedRequest) -> device_pb2.PushInfeedReply:
        """Appends batches to one of the session's infeeds (without entering the session: a
        run of it may be pulling from that infeed right now)."""
        return self.execution.push_infeed(request)

    def cancel_run(self, request: device_pb2.SessionRef) -> device_pb2.CancelRunReply:
        """Stops the session's runs in progress at their next step (no need to enter the
        session: the run holds it)."""
        s = self.sessions.get(request.session_id)
        return device_pb2.CancelRunReply(runs_stopped=s.stop_runs("cancelled"))

    # -- counters -----------------------------------------------------------------------

    def counter_values(self) -> dict[str, int]:
        """Counters and gauges, by name (``errors.<CODE>``, ``rpcs.<Method>`` included)."""
        values = {name: 0 for name in COUNTER_HELP}
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
