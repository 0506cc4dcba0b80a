"""The host side of the device protocol: a thin, typed wrapper over the gRPC stub.

    tf_ipu.runtime -> DeviceClient (this module) ==gRPC==> device_server.service.DeviceService
                      |- one session, kept while this client's connection is up (the
                      |  server's keepalive pings, answered by gRPC's C core even while
                      |  Python holds the GIL) and by a heartbeat thread
                      |- Execute calls over one ExecuteStream (no call set-up each time)
                      '- numpy arrays <-> wire Tensors (raw bytes + dtype + dims; no pickle)

Every call has a deadline; a server that cannot be reached raises ``DeviceUnavailableError``
naming the address within ``connect_timeout`` (10 s by default), never a hang. gRPC errors
are re-raised as ``tf_ipu.errors.DeviceError`` subclasses carrying the server's message,
address and error kind. A server that wants a token gets it as ``authorization: Bearer``
metadata on every call; ``tls_ca`` makes the channel TLS, checked against that CA. Does not
import TensorFlow.

Example:
    >>> client = DeviceClient("127.0.0.1:50051")
    >>> client.open_session()
    >>> client.attach(1, "ipu2")
    >>> program = client.compile(module)
    >>> [y] = client.execute(program.executable_id, [x])
    >>> client.close()
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from device_server.protocol import device_pb2, device_pb2_grpc, dtypes, ir_pb2
from device_server.protocol.chunks import parse_chunk, receive_window_options
from tf_ipu import errors
from tf_ipu.transport import DataPath

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_SERVICE = device_pb2.DESCRIPTOR.services_by_name["DeviceService"].full_name
ERROR_KIND_METADATA = "tf-ipu-error-kind"
TOKEN_ENV = "TF_IPU_SERVER_TOKEN"
_GRPC_INT_MAX = (1 << 31) - 1
#: The client's own keepalive pings (seconds): a connection whose server stopped answering
#: fails its calls within about twice this, instead of at their deadlines. The device server
#: accepts pings this often (``device_server.server.MIN_CLIENT_PING_SECONDS``).
KEEPALIVE_SECONDS = 20.0


@dataclass(frozen=True)
class VariableRef:
    """Binds an entry parameter to a device-resident variable of the session, by key."""

    key: str


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one entry parameter or output."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def __repr__(self) -> str:
        return f"TensorSpec({self.dtype}, {list(self.shape)})"


@dataclass(frozen=True)
class Estimate:
    """The emulator's first estimate for one execution of a program (see device.proto).

    ``json`` is the full report; ``report`` parses it. ``fits`` is None when the fit is
    unknown (the tile model failed: the report's ``failure`` says where); a program over its
    tiles within the tile model's margin has ``fits`` False and ``report["within_margin"]``.
    """

    ipu_version: str
    tiles_per_ipu: int
    clock_hz: float
    cycles: int
    seconds: float
    peak_tile_bytes: int
    tile_bytes_limit: int
    total_bytes: int
    fits: bool | None
    json: str = ""

    @property
    def report(self) -> dict[str, Any]:
        """The full report as a dict ({} if the server sent none)."""
        return json.loads(self.json) if self.json else {}


@dataclass(frozen=True)
class CompiledProgram:
    """What Compile returned.

    Attributes:
        executable_id: handle valid in this client's session only.
        cache_hit: the server had it compiled already.
        parameters, outputs: specs of the entry parameters and flattened outputs.
        aliases: output index -> parameter number whose new value the output carries.
        estimate: the emulator's estimate.
        compile_seconds: server-side compile time (0 for a cache hit).
    """

    executable_id: str
    cache_hit: bool
    parameters: list[TensorSpec]
    outputs: list[TensorSpec]
    aliases: dict[int, int]
    estimate: Estimate
    compile_seconds: float


@dataclass(frozen=True)
class SessionInfo:
    """What OpenSession returned."""

    session_id: str
    server_version: str
    default_ipu_version: str
    num_ipus: int
    free_ipus: int
    max_message_bytes: int
    lease_seconds: float
    max_session_bytes: int = 0  # 0: no limit
    unix_socket: str = ""       # where the server also listens, for clients on its machine
    system: str = ""            # the named system it hosts ("" for a plain count of IPUs)
    connection_lease: bool = False  # kept while this client's connection is up


@dataclass(frozen=True)
class Attachment:
    """What AttachIpus returned."""

    ipu_ids: list[int]
    ipu_version: str
    tiles_per_ipu: int


@dataclass
class _Heartbeat:
    thread: threading.Thread
    stop: threading.Event = field(default_factory=threading.Event)


#: Seconds an ExecuteStream may stay idle before the client closes it: an idle client holds
#: none of the server's worker threads (and a server shutting down waits for none).
STREAM_IDLE_SECONDS = 2.0
#: Seconds to use Execute after the server refused a stream (it served as many as it may).
STREAM_REFUSED_SECONDS = 10.0


class _ExecuteStream:
    """Execute calls over one ExecuteStream (device.proto), one at a time.

        call(request) -> queue -> gRPC's sending thread ==stream==> server: each request
        answered in order -> next(replies) -> call returns the reply

    A call costs no call set-up (~0.1 ms on loopback). A watchdog thread cancels the stream
    when a call's deadline passes (``timed_out``) and closes it after ``STREAM_IDLE_SECONDS``
    without calls. A stream that failed, timed out, was interrupted or closed is ``dead``: the
    client opens another for its next call.
    """

    def __init__(self, method: Any, metadata: Any) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.replies = method(iter(self._requests.get, None), metadata=metadata)
        self.lock = threading.Lock()  # held by the call in flight (``DeviceClient``)
        self.calls = 0
        self.dead = False
        self.timed_out = False
        self._state = threading.Lock()
        self._changed = threading.Condition(self._state)
        self._deadline: float | None = None  # of the call in flight (time.monotonic())
        self._wake_at = math.inf  # when the watchdog looks next
        self._last_used = time.monotonic()
        threading.Thread(target=self._watch, name="tf-ipu-execute-stream", daemon=True).start()

    def call(self, request: Any, timeout: float) -> Any | None:
        """Sends ``request`` and returns its reply; None if the stream is dead already
        (nothing was sent). Raises what the stream raises: ``grpc.RpcError`` with the call's
        status, ``StopIteration`` if the server ended the stream without an answer."""
        deadline = time.monotonic() + timeout
        with self._state:
            if self.dead:
                return None
            self._deadline = deadline
            if deadline < self._wake_at:
                self._changed.notify()
        self.calls += 1
        try:
            self._requests.put(request)
            return next(self.replies)
        finally:
            self._last_used = time.monotonic()
            with self._state:
                self._deadline = None

    def close(self, cancel: bool = False) -> None:
        """Ends the stream: the server's handler returns (``cancel``: at once, stopping a
        run in progress)."""
        with self._state:
            self.dead = True
            self._changed.notify()
        self._end(cancel)

    def _end(self, cancel: bool) -> None:
        self._requests.put(None)  # the end of the requests (and of gRPC's sending thread)
        if cancel:
            self.replies.cancel()

    def _watch(self) -> None:
        with self._state:
            while not self.dead:
                now = time.monotonic()
                if self._deadline is not None:
                    if now >= self._deadline:
                        self.timed_out = self.dead = True
                        break
                    self._wake_at = self._deadline
                elif now - self._last_used >= STREAM_IDLE_SECONDS:
                    self.dead = True  # (under the lock: no call starts on it from now on)
                    break
                else:
                    self._wake_at = self._last_used + STREAM_IDLE_SECONDS
                self._changed.wait(self._wake_at - now)
            else:
                return  # closed by the client
        self._end(cancel=self.timed_out)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """gRPC channel options: message limits lifted to ``max_message_bytes`` (<= 0:
    unlimited), a quick reconnect after the server restarts, a receive window of two
    chunks (``receive_window_options``), and a connection of the channel's own that stays
    up while the channel is open: the session's connection lease lives on it (not shared
    with other channels of the process, which would keep it up after this client closed;
    not dropped when idle), and keepalive pings find a server that stopped answering."""
    n = -1 if max_message_bytes <= 0 else min(int(max_message_bytes), _GRPC_INT_MAX)
    keepalive_ms = int(KEEPALIVE_SECONDS * 1000)
    return [
        ("grpc.max_send_message_length", n),
        ("grpc.max_receive_message_length", n),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_retries", 0),
        *receive_window_options(),  # replies' chunks: at most two in flight
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.client_idle_timeout_ms", _GRPC_INT_MAX),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms),
        ("grpc.http2.ping_timeout_ms", keepalive_ms),  # (what closes it in grpcio 1.85)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class DeviceClient:
    """A connection to a device server, with at most one session.

    Args:
        address: ``host:port`` of the server.
        timeout: deadline in seconds of control calls (sessions, IPUs, heartbeats,
            counters), and of reaching the server at all (``connect_timeout``).
        run_timeout: deadline of Compile, Execute and variable transfers, which can
            legitimately take long on an emulated device.
        max_message_bytes: largest message either way (the server's is 1 GiB by default).
        client_name: shown in the server's logs.
        token: sent as ``authorization: Bearer <token>`` with every call; None reads
            ``$TF_IPU_SERVER_TOKEN`` ("" sends none).
        tls_ca: PEM bytes, or the path of a PEM file, of the CA that signed the server's
            certificate: the channel then speaks TLS. None: plaintext.
        tls_server_name: the name to check the server's certificate against, if not the
            address's host.
        data_path: ``"auto"`` (shared memory if the server is on this machine, as a probe
            at ``open_session`` finds, else streaming), ``"shm"`` or ``"stream"``
            (``tf_ipu.transport``); None reads ``$TF_IPU_DATA_PATH`` (default ``"auto"``).

    Raises:
        ValueError: an empty address or non-positive timeouts.
        OSError: ``tls_ca`` names a file that cannot be read.

    Example:
        >>> client = DeviceClient("ipus.example.com:5005", token="s3cret", tls_ca="ca.pem")
    """

    def __init__(
        self,
        address: str,
        timeout: float = 10.0,
        run_timeout: float = 600.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        client_name: str = "",
        token: str | None = None,
        tls_ca: bytes | str | None = None,
        tls_server_name: str = "",
        data_path: str | None = None,
    ) -> None:
        if not address or not isinstance(address, str):
            raise ValueError(f"DeviceClient needs a 'host:port' address. Received: {address!r}")
        if not timeout > 0 or not run_timeout > 0:
            raise ValueError(
                f"Timeouts must be > 0. Received: timeout={timeout}, run_timeout={run_timeout}"
            )
        self.address = address
        self.timeout = float(timeout)
        self.run_timeout = float(run_timeout)
        self.last_device_seconds = 0.0  # the server's time for the last Execute
        # What the last Execute's program handed to outfeeds: feed -> (count, stacked values)
        self.last_outfeeds: dict[str, tuple[int, list[np.ndarray]]] = {}
        self.client_name = client_name or f"tf_ipu pid {os.getpid()}"
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self._metadata = (("authorization", f"Bearer {token.strip()}"),) if token else None
        options = channel_options(max_message_bytes)
        self._options = list(options)
        self._tls = tls_ca is not None
        self._tcp_channel: Any = None  # the TCP channel, once calls moved to a Unix socket
        if tls_ca is not None:
            if isinstance(tls_ca, str):
                tls_ca = Path(tls_ca).read_bytes()
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=tls_ca), options=options
            )
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = device_pb2_grpc.DeviceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._session: SessionInfo | None = None
        self._attachment: Attachment | None = None
        self._heartbeat: _Heartbeat | None = None
        self._lease_stub = self._stub  # the session's connection (TCP), for its heartbeats
        self._reachable = False
        self._closed = False
        self._lock = threading.Lock()
        self.heartbeats = 0  # sent and answered
        self.heartbeat_failures = 0
        if data_path is None:
            data_path = os.environ.get("TF_IPU_DATA_PATH", "").strip() or "auto"
        self.data = DataPath(self, data_path)
        self._running = 0   # device calls in progress (cancel_running stops them)
        self._lock_running = threading.Lock()
        # executable id -> (output specs, outputs that update a variable)
        self._outputs_of: dict[str, tuple[list[TensorSpec], set[int]]] = {}
        self._variable_specs: dict[str, TensorSpec] = {}    # key -> spec, as last written
        self._stream: _ExecuteStream | None = None  # Execute calls go over it when they can
        self._stream_lock = threading.Lock()
        self._streams_off_until = 0.0  # time.monotonic() until which Execute is unary

    def __repr__(self) -> str:
        sid = self._session.session_id[:8] + ".." if self._session else None
        return (
            f"DeviceClient(address={self.address!r}, session={sid}, "
            f"ipus={self._attachment.ipu_ids if self._attachment else []})"
        )

    def __enter__(self) -> DeviceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        """The open session's id (raises ``FailedPreconditionError`` if none)."""
        if self._session is None:
            raise errors.FailedPreconditionError(
                "No session is open on this client; call open_session() first.", self.address
            )
        return self._session.session_id

    @property
    def session(self) -> SessionInfo | None:
        """What OpenSession returned, or None."""
        return self._session

    @property
    def attachment(self) -> Attachment | None:
        """What AttachIpus returned, or None."""
        return self._attachment

    def _error(self, method: str, e: grpc.RpcError, timeout: float) -> errors.DeviceError:
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = (e.details() if hasattr(e, "details") else None) or str(e)
        kind = ""
        try:
            for k, v in e.trailing_metadata() or ():
                if k == ERROR_KIND_METADATA:
                    kind = v.decode() if isinstance(v, bytes) else str(v)
        except Exception:  # no metadata on locally generated errors
            pass
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and kind != "deadline":
            details = f"{method} got no answer within {timeout:g} s ({details})"
        elif code == grpc.StatusCode.UNAVAILABLE and kind != "shutting-down":
            details = f"{method}: cannot reach the device server ({details})"
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            limit = self._session.max_message_bytes if self._session else 0
            details = (f"{method}: the message is larger than the gRPC limit ({details}); "
                       + (f"the server takes at most {limit} bytes a message "
                          f"(--max-message-bytes)." if limit else "see --max-message-bytes."))
        return errors.from_status(code.name, details, self.address, kind)

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        if self._closed:
            raise errors.FailedPreconditionError(f"{method}: the client is closed.", self.address)
        if not self._reachable:
            self._probe()
        timeout = self.timeout if timeout is None else timeout
        try:
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(method, e, timeout) from None
        except ValueError as e:  # the channel was closed under this call
            raise errors.FailedPreconditionError(f"{method}: {e}", self.address) from None

    def _call_stoppable(self, method: str, request: Any, timeout: float) -> Any:
        """``_call`` for a device call that ``cancel_running`` (another thread) can stop."""
        with self._lock_running:
            self._running += 1
        try:
            return self._call(method, request, timeout)
        finally:
            with self._lock_running:
                self._running -= 1

    def _execute_call(self, request: device_pb2.ExecuteRequest, timeout: float) -> Any:
        """Execute, on this client's ExecuteStream when it can (one thread at a time; the
        server may refuse streams, an older one has none), else as a unary call."""
        stream = self._execute_stream()
        if stream is not None:
            with self._lock_running:
                self._running += 1
            try:
                request.timeout_seconds = timeout
                reply = stream.call(request, timeout)
            except grpc.RpcError as e:
                self._drop_stream(stream)
                kind = _error_kind(e)
                if stream.calls == 1 and (e.code() == grpc.StatusCode.UNIMPLEMENTED
                                          or kind == "too-many-streams"):
                    # Not run: send it as a unary call; streams again after a while (or
                    # never, from a server without them).
                    self._streams_off_until = time.monotonic() + (
                        STREAM_REFUSED_SECONDS if kind else math.inf)
                    logger.debug("Execute without a stream on %s: %s", self.address,
                                 e.details())
                    reply = None
                elif stream.timed_out:
                    raise errors.from_status(
                        "DEADLINE_EXCEEDED", f"Execute got no answer within {timeout:g} s",
                        self.address) from None
                elif self._closed:
                    raise errors.FailedPreconditionError(
                        "Execute: the client was closed under this call.", self.address) from None
                else:
                    raise self._error("Execute", e, timeout) from None
            except StopIteration:
                self._drop_stream(stream)
                raise errors.InternalError(
                    "Execute: the server ended the stream without an answer.",
                    self.address) from None
            except BaseException:  # e.g. KeyboardInterrupt: the reply would come unread
                self._drop_stream(stream, cancel=True)
                raise
            finally:
                stream.lock.release()
                with self._lock_running:
                    self._running -= 1
            if reply is not None:
                return reply
        return self._call_stoppable("Execute", request, timeout)

    def _execute_stream(self) -> _ExecuteStream | None:
        """The stream for an Execute call, its ``lock`` taken; None when the call is to be
        unary (streams refused, or another thread's call holds the stream)."""
        if self._closed:
            raise errors.FailedPreconditionError("Execute: the client is closed.", self.address)
        if not self._reachable:
            self._probe()
        if self._streams_off_until and time.monotonic() < self._streams_off_until:
            return None
        with self._stream_lock:
            stream = self._stream
            if stream is not None and not stream.dead and stream.replies.done():
                stream.close()  # it ended between calls (e.g. the server restarted)
            if stream is None or stream.dead:
                stream = self._stream = _ExecuteStream(self._stub.ExecuteStream, self._metadata)
            if not stream.lock.acquire(blocking=False):
                return None
        if stream.dead:  # the watchdog closed it meanwhile (idle): a new one
            stream.lock.release()
            return self._execute_stream()
        return stream

    def _drop_stream(self, stream: _ExecuteStream | None = None, cancel: bool = False) -> None:
        """Ends ``stream`` (by default the current one) and forgets it."""
        with self._stream_lock:
            if stream is None:
                stream = self._stream
            if self._stream is stream:
                self._stream = None
        if stream is not None:
            stream.close(cancel)

    def _call_stream_in(self, method: str, chunks: Any) -> Any:
        """A client-streaming call (PutBlob), with ``run_timeout``: ``chunks`` are its
        messages serialized already (``device_server.protocol.chunks.serialize_chunk``)."""
        call = self._channel.stream_unary(
            f"/{_SERVICE}/{method}", request_serializer=None,
            response_deserializer=device_pb2.BlobRef.FromString)
        try:
            return call(chunks, timeout=self.run_timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(method, e, self.run_timeout) from None

    def _call_stream_out(self, method: str, request: Any) -> Any:
        """A server-streaming call (GetBlob): yields its messages, parsed by ``parse_chunk``
        (their data fields are views of the bytes received, not copies)."""
        call = self._channel.unary_stream(
            f"/{_SERVICE}/{method}", request_serializer=type(request).SerializeToString,
            response_deserializer=parse_chunk)
        try:
            yield from call(request, timeout=self.run_timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(method, e, self.run_timeout) from None

    def cancel_running(self) -> int:
        """Stops this client's device calls in progress (from any thread): the server stops
        each at its next step, keeps the variables of the last completed one, and the call
        raises ``CancelledError``. Returns how many runs the server stopped."""
        # The call may not have reached its run yet (uploads, or queued behind another call
        # of the session): ask again for a little while until a run is stopped.
        end = time.monotonic() + 2.0
        while True:
            with self._lock_running:
                running = self._running
            session = self._session
            if not running or session is None:
                return 0
            try:
                reply = self._stub.CancelRun(device_pb2.SessionRef(session_id=session.session_id),
                                             timeout=self.timeout, metadata=self._metadata)
            except (grpc.RpcError, ValueError) as e:  # the server (or the channel) is gone
                logger.debug("CancelRun on %s failed: %s", self.address, e)
                return 0
            if reply.runs_stopped or time.monotonic() > end:
                return int(reply.runs_stopped)
            time.sleep(0.05)

    def _probe(self) -> None:
        """One health check without waiting for a connection: fails fast on a refused
        port and within ``timeout`` on an address that does not answer."""
        try:
            self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # every device server has one
                raise errors.DeviceUnavailableError(
                    f"Something answers at {self.address}, but not a tf_ipu device server "
                    f"(no health service: {e.details()})",
                    self.address,
                ) from None
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise errors.DeviceUnavailableError(
                    f"No device server answers at {self.address} "
                    f"(waited up to {self.timeout:g} s): {e.details()}",
                    self.address,
                ) from None
            raise self._error("Health.Check", e, self.timeout) from None
        self._reachable = True

    def wait_for_server(self, deadline: float = 10.0) -> None:
        """Waits until the server's health service reports SERVING.

        Args:
            deadline: seconds to wait at most.

        Raises:
            DeviceUnavailableError: naming the address and what the last attempt saw.
        """
        end = time.monotonic() + deadline
        last = "no attempt"
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise errors.DeviceUnavailableError(
                    f"The device server at {self.address} was not serving within "
                    f"{deadline:g} s (last check: {last}).",
                    self.address,
                )
            try:
                reply = self._health.Check(
                    health_pb2.HealthCheckRequest(), timeout=min(remaining, 2.0)
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    self._reachable = True
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def healthy(self) -> bool:
        """Whether the server answers SERVING and this client's session (if any) is open."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(), timeout=min(self.timeout, 2.0))
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            if self._session is not None:
                self._stub.Heartbeat(device_pb2.SessionRef(session_id=self._session.session_id),
                                     timeout=min(self.timeout, 2.0), metadata=self._metadata)
            return True
        except (grpc.RpcError, ValueError):  # ValueError: the channel is closed
            return False

    # -- sessions and IPUs --------------------------------------------------------------

    def open_session(self, lease_seconds: float = 0.0) -> SessionInfo:
        """Opens this client's session and starts its heartbeat.

        The session asks for a connection lease: the server keeps it while this client's
        connection is up, also when no call or heartbeat comes for longer than the lease
        (TensorFlow holding the GIL for a long trace, a large transfer in flight); a client
        that is gone loses it within the lease. ``session.connection_lease`` says whether the
        server agreed (not behind a proxy, for example); if not, the heartbeat alone keeps it.

        Args:
            lease_seconds: the lease; 0 for the server's default. The heartbeat renews it
                three times per lease.

        Returns:
            A ``SessionInfo``.

        Raises:
            FailedPreconditionError: a session is already open on this client.
        """
        with self._lock:
            if self._session is not None:
                raise errors.FailedPreconditionError(
                    f"Session {self._session.session_id} is already open on this client.",
                    self.address,
                )
            reply = self._call(
                "OpenSession",
                device_pb2.OpenSessionRequest(client_name=self.client_name,
                                              lease_seconds=lease_seconds, connection_lease=True),
            )
            self._session = SessionInfo(
                session_id=reply.session_id,
                server_version=reply.server_version,
                default_ipu_version=reply.default_ipu_version,
                num_ipus=reply.num_ipus,
                free_ipus=reply.free_ipus,
                max_message_bytes=reply.max_message_bytes,
                lease_seconds=reply.lease_seconds,
                max_session_bytes=reply.max_session_bytes,
                unix_socket=reply.unix_socket,
                system=reply.system,
                connection_lease=reply.connection_lease,
            )
            self._lease_stub = self._stub  # stays on this connection after a move
            self._start_heartbeat(reply.session_id, reply.lease_seconds)
            logger.debug("opened session %s on %s", reply.session_id, self.address)
        try:
            self.data.setup()
        except BaseException:
            self.close()
            raise
        if self.data.kind == "shm" and self._session.unix_socket and not self._tls:
            self._move_to_unix_socket(self._session.unix_socket)
        logger.debug("data path to %s: %s", self.address, self.data.describe())
        return self._session

    def attach(
        self,
        num_ipus: int = 1,
        ipu_version: str = "",
        tiles_per_ipu: int = 0,
        wait_seconds: float = 0.0,
        ipu_ids: Sequence[int] = (),
    ) -> Attachment:
        """Attaches IPUs to the session, exclusively.

        Args:
            num_ipus: how many (ignored when ``ipu_ids`` is given).
            ipu_version: ``"ipu1"``, ``"ipu2"``, ``"bow"``; ``""`` for the server's default.
            tiles_per_ipu: 0 for the version's full tile count.
            wait_seconds: how long the server may wait for enough IPUs to become free.
            ipu_ids: exactly these IPUs of the server (``IPUConfig.select_ipus``).

        Returns:
            An ``Attachment`` (ids, canonical version, tiles per IPU).

        Raises:
            ResourceExhaustedError: fewer free IPUs than asked, also after ``wait_seconds``
                (the message says how many were requested and free).
        """
        reply = self._call(
            "AttachIpus",
            device_pb2.AttachIpusRequest(
                session_id=self.session_id, num_ipus=0 if ipu_ids else num_ipus,
                ipu_version=ipu_version, tiles_per_ipu=tiles_per_ipu,
                wait_seconds=wait_seconds, ipu_ids=list(ipu_ids),
            ),
            self.timeout + max(0.0, wait_seconds),
        )
        self._attachment = Attachment(list(reply.ipu_ids), reply.ipu_version, reply.tiles_per_ipu)
        return self._attachment

    def detach(self) -> None:
        """Releases the session's IPUs (its executable handles go with them)."""
        self._call("DetachIpus", device_pb2.SessionRef(session_id=self.session_id))
        self._attachment = None

    def close(self) -> None:
        """Closes the session (best effort if the server is gone) and the channel.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._stop_heartbeat()
            self._drop_stream()  # its handler on the server returns
            if self._session is not None:
                try:
                    self._stub.CloseSession(
                        device_pb2.SessionRef(session_id=self._session.session_id),
                        timeout=min(self.timeout, 5.0), metadata=self._metadata,
                    )
                except grpc.RpcError as e:
                    logger.debug("CloseSession on %s: %s", self.address, e.code().name)
                self._session = None
                self._attachment = None
            self._closed = True
            self._channel.close()
            if self._tcp_channel is not None:
                self._tcp_channel.close()
            self.data.close()

    def abandon(self) -> None:
        """Drops the connection without telling the server (for a server that is gone or
        that forgot the session): stops the heartbeat, closes the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._heartbeat is not None:
                self._heartbeat.stop.set()  # not joined: it may be inside a call
                self._heartbeat = None
            self._drop_stream(cancel=True)
            self._session = None
            self._attachment = None
            self._closed = True
            self._channel.close()
            if self._tcp_channel is not None:
                self._tcp_channel.close()
            self.data.close()

    def _move_to_unix_socket(self, path: str) -> None:
        """Makes further calls over the server's Unix socket (the probe showed this machine
        is the server's): a little faster than TCP on loopback. Stays on TCP if it fails."""
        channel = grpc.insecure_channel(f"unix:{path}", options=self._options)
        stub = device_pb2_grpc.DeviceServiceStub(channel)
        try:
            stub.Heartbeat(device_pb2.SessionRef(session_id=self.session_id),
                           timeout=min(self.timeout, 2.0), metadata=self._metadata)
        except grpc.RpcError as e:
            logger.debug("staying on TCP: the Unix socket %s does not answer (%s)", path,
                         e.code().name)
            channel.close()
            return
        self._drop_stream()  # (none yet, normally) streams open on the new channel
        self._tcp_channel, self._channel = self._channel, channel
        self._stub = stub
        self.data.control = "gRPC over Unix socket"

    def _start_heartbeat(self, session_id: str, lease_seconds: float) -> None:
        """Renews the lease three times per lease from a thread, over the connection the
        session was opened on (with a connection lease, a heartbeat after a reconnect ties
        the session to the new connection). A thread that cannot get the GIL misses its
        beats; the connection lease covers that."""
        interval = max(0.05, lease_seconds / 3.0)
        stop = threading.Event()
        stub = self._lease_stub

        def beat() -> None:
            request = device_pb2.SessionRef(session_id=session_id)
            failing = False  # a run of failures is logged once, as a warning
            while not stop.wait(interval):
                try:
                    stub.Heartbeat(request, timeout=max(interval, 1.0), metadata=self._metadata)
                    self.heartbeats += 1
                    failing = False
                except grpc.RpcError as e:
                    self.heartbeat_failures += 1
                    logger.log(logging.DEBUG if failing else logging.WARNING,
                               "heartbeat of session %s to %s failed: %s %s", session_id,
                               self.address, e.code().name, e.details())
                    failing = True
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        return  # the session is gone; nothing left to keep alive
                except ValueError:  # channel closed under us
                    return

        thread = threading.Thread(target=beat, name=f"tf-ipu-heartbeat-{session_id[:8]}", daemon=True)
        self._heartbeat = _Heartbeat(thread, stop)
        thread.start()

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop.set()
            if self._heartbeat.thread is not threading.current_thread():
                self._heartbeat.thread.join(timeout=self.timeout)
            self._heartbeat = None

    # -- programs -----------------------------------------------------------------------

    def compile(
        self,
        module: ir_pb2.Module,
        options: device_pb2.CompileOptions | None = None,
        *,
        refuse_opcodes: Iterable[str] = (),
        fault_inject_opcode: str = "",
        allow_out_of_memory: bool = False,
        matmul_partials_type: str = "",
        convolution_partials_type: str = "",
        matmul_available_memory_proportion: float | None = None,
        convolution_available_memory_proportion: float | None = None,
        floating_point_behaviour: Mapping[str, bool] | None = None,
        stochastic_rounding_seed: int = 0,
        replicas: int = 1,
        pipeline: Mapping[str, Any] | None = None,
        recomputation: bool = False,
    ) -> CompiledProgram:
        """Compiles a program for the session's IPUs (cached on the server by content).

        Args:
            module: the IR program.
            options: compile options as a message; or give the keyword arguments, which
                are added to it.
            refuse_opcodes: opcodes to refuse (debugging).
            fault_inject_opcode: opcode whose results to perturb (debugging).
            allow_out_of_memory: compile (and report) even if it does not fit.
            matmul_partials_type, convolution_partials_type: "float" (default) or "half":
                the accumulator of FP16 matrix products / convolutions.
            matmul_available_memory_proportion, convolution_available_memory_proportion:
                PopLibs' availableMemoryProportion (0 .. 1) the tile model plans matrix
                products / convolutions with (None: the preset's, 0.6).
            floating_point_behaviour: ``inv``, ``div0``, ``oflo``, ``esr``, ``nanoo`` flags
                (``IPUConfig.floating_point_behaviour``); unnamed flags stay off.
            stochastic_rounding_seed: seed of stochastic rounding (0: from the program).
            replicas: how many replicas run the program at once, one per attached IPU
                (1: not replicated); every output then has a leading dimension of replicas.
            pipeline: a pipelined program's stages (``tf_ipu.pipelining.plan``: "stages",
                "stage_ipus", "ipus_per_replica", "schedule", "micro_batches",
                "recomputation"); the module's instructions carry their stage.
            recomputation: ``IPUConfig.allow_recompute`` for a program without a pipeline
                (the tile model's cheap remaking; a pipeline says its own).

        Returns:
            A ``CompiledProgram``.

        Raises:
            UnsupportedOpError, OutOfMemoryError, InvalidArgumentError,
            FailedPreconditionError (no IPUs attached).
        """
        opts = device_pb2.CompileOptions()
        if options is not None:
            opts.CopyFrom(options)
        opts.refuse_opcodes.extend(refuse_opcodes)
        if fault_inject_opcode:
            opts.fault_inject_opcode = fault_inject_opcode
        if allow_out_of_memory:
            opts.allow_out_of_memory = True
        if matmul_partials_type:
            opts.matmul_partials_type = matmul_partials_type
        if convolution_partials_type:
            opts.convolution_partials_type = convolution_partials_type
        if matmul_available_memory_proportion is not None:
            opts.matmul_available_memory_proportion = float(matmul_available_memory_proportion)
        if convolution_available_memory_proportion is not None:
            opts.convolution_available_memory_proportion = float(convolution_available_memory_proportion)
        for name, value in (floating_point_behaviour or {}).items():
            if name not in ("inv", "div0", "oflo", "esr", "nanoo"):
                raise ValueError(f"floating_point_behaviour: unknown flag {name!r}.")
            if value:
                setattr(opts.floating_point_behaviour, name, True)
        if stochastic_rounding_seed:
            opts.stochastic_rounding_seed = int(stochastic_rounding_seed)
        if replicas > 1:
            opts.replicas = int(replicas)
        opts.recomputation = bool(recomputation)
        if pipeline:
            opts.pipeline_stages = int(pipeline["stages"])
            opts.stage_ipus.extend(int(i) for i in pipeline["stage_ipus"])
            opts.ipus_per_replica = int(pipeline["ipus_per_replica"])
            opts.pipeline_schedule = str(pipeline["schedule"])
            opts.micro_batches = int(pipeline["micro_batches"])
            opts.recomputation = bool(pipeline.get("recomputation", False))
            offload = pipeline.get("offload")
            opts.optimizer_state_offload = {True: "on", False: "off", None: "auto"}.get(
                offload, str(offload or "auto"))
            opts.optimizer_state_sharding = bool(pipeline.get("sharding", False))
        request = device_pb2.CompileRequest(session_id=self.session_id, options=opts)
        limit = self._session.max_message_bytes if self._session else 0
        if limit > 0 and module.ByteSize() > limit // 2:  # too big for one message: a blob
            request.module_blob_id = self.data.put_blob(module.SerializeToString())
        else:
            request.module.CopyFrom(module)
        # Stoppable as a run is: cancel_running (Ctrl-C) stops the server's planning too.
        reply = self._call_stoppable("Compile", request, self.run_timeout)
        e = reply.estimate
        outputs = [_spec(o) for o in reply.outputs]
        aliased = {int(a.output_index) for a in reply.aliases}
        self._outputs_of[reply.executable_id] = (outputs, aliased)
        return CompiledProgram(
            executable_id=reply.executable_id,
            cache_hit=reply.cache_hit,
            parameters=[_spec(s) for s in reply.parameters],
            outputs=outputs,
            aliases={int(a.output_index): int(a.parameter_number) for a in reply.aliases},
            estimate=Estimate(
                ipu_version=e.ipu_version, tiles_per_ipu=e.tiles_per_ipu, clock_hz=e.clock_hz,
                cycles=e.cycles, seconds=e.seconds, peak_tile_bytes=e.peak_tile_bytes,
                tile_bytes_limit=e.tile_bytes_limit, total_bytes=e.total_bytes,
                fits=e.fits or _unknown_fit(e.json), json=e.json,
            ),
            compile_seconds=reply.compile_seconds,
        )

    # -- variables ----------------------------------------------------------------------

    def write_variables(self, variables: Mapping[str, np.ndarray]) -> None:
        """Writes (creating if new) device-resident variables of the session, all at once.
        Values past the message budget are streamed first (``tf_ipu.transport``)."""
        request = device_pb2.WriteVariablesRequest(session_id=self.session_id)
        with self.data.call() as call:
            for key, value in variables.items():
                named = request.variables.add(key=key)
                call.encode(named.tensor, value, f"variable {key!r}", replaces=key)
                self._variable_specs[key] = TensorSpec(
                    dtypes.to_numpy(named.tensor.dtype), tuple(named.tensor.dims))
            self._call("WriteVariables", request, self.run_timeout)

    def read_variables(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Reads device-resident variables back (through shared memory, inline, or streamed,
        as ``tf_ipu.transport`` decides).

        Returns:
            key -> array (read-only views of the reply's bytes, or arrays of their own).

        Raises:
            NotFoundError: naming the first key the session does not have.
        """
        request = device_pb2.ReadVariablesRequest(session_id=self.session_id, keys=list(keys))
        with self.data.call() as call:
            for key in request.keys:
                spec = self._variable_specs.get(key)
                region = None if spec is None else call.output_region(spec.dtype, spec.shape)
                if region is not None:
                    request.regions[key].CopyFrom(region)
            reply = self._call("ReadVariables", request, self.run_timeout)
            return {v.key: call.decode(v.tensor, f"variable {v.key!r}") for v in reply.variables}

    # -- execution ----------------------------------------------------------------------

    def execute(
        self,
        executable_id: str,
        bindings: Sequence[np.ndarray | VariableRef | Any],
        return_updated_variables: bool = False,
        timeout: float | None = None,
        run_deadline: float = 0.0,
    ) -> list[np.ndarray | None]:
        """Runs an executable once.

        Args:
            executable_id: from ``compile`` in this session.
            bindings: one per entry parameter, in order: an array (sent with the call) or a
                ``VariableRef`` (a resident variable; if the parameter is aliased to an
                output, the device keeps the new value under that key).
            return_updated_variables: also send back the new values of resident variables.
            timeout: deadline in seconds of the call (``run_timeout`` by default).
            run_deadline: seconds after which the server stops the run (0: none but the
                call's): a device loop ends at its next step and keeps its variables, and the
                call raises ``DeadlineExceededError``.

        Returns:
            The flattened outputs as arrays (read-only views; copy to modify). An output
            that updated a resident variable is ``None`` unless
            ``return_updated_variables``.

        Raises:
            InvalidArgumentError: naming the parameter number, expected and received types.
            NotFoundError: unknown executable id or variable key.
            CancelledError: ``cancel_running`` (or the session closing) stopped it.
            DeadlineExceededError: the run deadline (or the call's) passed; the message says
                after how many steps of its device loop the run stopped.
        """
        # One call per step, or more often: the per-call work below is kept small (the
        # latency of a small call is within 1.3x a bare gRPC echo, bench/bench_transport.py).
        request = device_pb2.ExecuteRequest(session_id=self.session_id,
                                            executable_id=executable_id)
        if return_updated_variables:
            request.return_updated_variables = True
        if run_deadline > 0:
            request.run_deadline_seconds = float(run_deadline)
        with self.data.call() as call:
            parameters = request.parameters
            for number, b in enumerate(bindings):
                if isinstance(b, VariableRef):
                    parameters.add(variable_key=b.key)
                else:
                    call.encode(parameters.add().value, b, f"parameter {number}")
            specs, aliased = self._outputs_of.get(executable_id, _NO_OUTPUTS)
            for i, spec in enumerate(specs):
                if i in aliased and not return_updated_variables:
                    continue  # stays on the device
                region = call.output_region(spec.dtype, spec.shape)
                if region is not None:
                    request.output_regions[i].CopyFrom(region)
            reply = self._execute_call(request, self.run_timeout if timeout is None else timeout)
            self.last_device_seconds = reply.device_seconds
            self.last_outfeeds = {
                o.feed: (int(o.count), [call.decode(t, f"outfeed {o.feed!r}") for t in o.values])
                for o in reply.outfeeds
            } if len(reply.outfeeds) else {}
            outputs: list[np.ndarray | None] = []
            for i, t in enumerate(reply.outputs):
                if t.WhichOneof("payload") is None and _count(t.dims):
                    outputs.append(None)  # stayed on the device
                else:
                    outputs.append(call.decode(t, f"output {i}"))
            return outputs

    def push_infeed(self, feed: str, batches: Sequence[Sequence[np.ndarray]],
                    end: bool = False, reset: bool = False) -> int:
        """Appends ``batches`` (each a list of arrays, in the order the program's
        ``tf_ipu_infeed`` custom-call declares them) to the session's infeed ``feed``; ``end``
        ends the feed after them; ``reset`` first drops what the feed holds. Runs alongside an
        ``execute`` of the same session, from another thread: the device pulls the batches as
        its loop reaches them. Returns how many batches now wait in the feed."""
        request = device_pb2.PushInfeedRequest(session_id=self.session_id, feed=feed, end=end,
                                               reset=reset)
        with self.data.call() as call:
            for b, batch in enumerate(batches):
                out = request.batches.add()
                for k, value in enumerate(batch):
                    call.encode(out.values.add(), value, f"infeed {feed!r} batch {b} value {k}",
                                inline_only=True)
            return int(self._call("PushInfeed", request).queued)

    def counters(self) -> dict[str, int]:
        """The server's counters (``sessions_opened``, ``compiles``, ``cache_hits``,
        ``executions``, ``bytes_in``, ``bytes_out``, ``errors.<CODE>``, ...)."""
        return dict(self._call("GetCounters", device_pb2.Empty()).counters)

    def prometheus_text(self) -> str:
        """The server's counters in the Prometheus text format."""
        return self._call("GetCounters", device_pb2.Empty()).prometheus_text


#: ``_outputs_of`` of an executable this client did not compile.
_NO_OUTPUTS: tuple[list[TensorSpec], frozenset[int]] = ([], frozenset())


def _error_kind(e: grpc.RpcError) -> str:
    """The ``tf-ipu-error-kind`` trailing metadata of a failed call ("" if none)."""
    try:
        for k, v in e.trailing_metadata() or ():
            if k == ERROR_KIND_METADATA:
                return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # no metadata on locally generated errors
        pass
    return ""


def _count(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _spec(s: device_pb2.TensorSpec) -> TensorSpec:
    return TensorSpec(dtypes.to_numpy(s.dtype), tuple(int(d) for d in s.dims))


def _unknown_fit(report: str) -> bool | None:
    """For a reply whose ``fits`` is False: None if its report says the fit is unknown (the
    tile model failed; the proto's bool cannot say so), else False."""
    try:
        return None if report and json.loads(report).get("fits", False) is None else False
    except (ValueError, AttributeError):
        return False
