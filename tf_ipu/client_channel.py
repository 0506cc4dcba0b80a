"""A ``DeviceClient``'s connection: the gRPC channel's options, calls with deadlines, and
errors named.

    DeviceClient ── _call(method, request, timeout) ──> stub ==gRPC (TCP, or the server's
        │                                                 Unix socket once on its machine)==> server
        ├─ _probe / wait_for_server / healthy: the health service (fails fast, never hangs)
        ├─ _call_stream_in / _call_stream_out: PutBlob / GetBlob chunks (run_timeout)
        └─ _error: grpc.RpcError -> tf_ipu.errors.DeviceError (the server's kind, the address)

``ChannelCalls`` is one part of ``DeviceClient`` (``tf_ipu.client``), which owns the channel,
the stubs and the flags these methods read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from device_server.protocol import device_pb2, device_pb2_grpc
from device_server.protocol.chunks import parse_chunk, receive_window_options
from tf_ipu import errors

logger = logging.getLogger("tf_ipu.client")

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_SERVICE = device_pb2.DESCRIPTOR.services_by_name["DeviceService"].full_name
ERROR_KIND_METADATA = "tf-ipu-error-kind"
TOKEN_ENV = "TF_IPU_SERVER_TOKEN"
_GRPC_INT_MAX = (1 << 31) - 1
#: The client's own keepalive pings (seconds): a connection whose server stopped answering
#: fails its calls within about twice this, instead of at their deadlines. The device server
#: accepts pings this often (``device_server.server.MIN_CLIENT_PING_SECONDS``).
KEEPALIVE_SECONDS = 20.0


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


def _error_kind(e: grpc.RpcError) -> str:
    """The ``tf-ipu-error-kind`` trailing metadata of a failed call ("" if none)."""
    try:
        for k, v in e.trailing_metadata() or ():
            if k == ERROR_KIND_METADATA:
                return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # no metadata on locally generated errors
        pass
    return ""


class ChannelCalls:
    """The calls and health checks of a DeviceClient's channel (module docstring)."""

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
