"""Builds and runs the device server's gRPC server.

    client ==gRPC (max message lifted, 1 GiB by default; TLS if a cert is given)==>
        grpc.Server on host:port
          [token check: "authorization: Bearer <token>" metadata, if a token is set]
           |- tf_ipu.device.DeviceService
           |- grpc.health.v1.Health (SERVING; NOT_SERVING while shutting down; no token needed)
           '- server reflection

``serve()`` starts serving and returns a ``ServerHandle`` (bound port, ``stop(grace)``). It
binds 127.0.0.1 by default; exposing it on another interface is an explicit choice, best
made with a token (``token``) and TLS (``tls_cert_chain``/``tls_private_key``). A missing
or wrong token gets UNAUTHENTICATED. The server pings every client connection that has been
quiet for ``ServiceConfig.keepalive_seconds`` and closes one that does not answer
(``keepalive_options``): that is what lets a session live on its connection while its
client's Python is busy (``sessions.py``, connection leases). ``ServerHandle.stop`` drains: new work is refused with
UNAVAILABLE, calls in flight get a grace period, then the server stops. ``cli.py`` is the
command line around it.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from device_server.protocol.chunks import receive_window_options
from device_server.service import SERVICE_NAME, DeviceService, ServiceConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_GRPC_INT_MAX = (1 << 31) - 1
TOKEN_METADATA = "authorization"
_FLUSH_SECONDS = 2.0
_HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"


def grpc_message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options that lift the message size limits to ``max_message_bytes``
    (clamped to gRPC's int32 range; <= 0 means unlimited)."""
    n = -1 if max_message_bytes <= 0 else min(int(max_message_bytes), _GRPC_INT_MAX)
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


#: Clients may ping this often at most without calls in flight (``tf_ipu.client`` pings every
#: 20 s); faster pings are answered with GOAWAY "too_many_pings" after two strikes.
MIN_CLIENT_PING_SECONDS = 5.0


def keepalive_options(keepalive_seconds: float) -> list[tuple[str, int]]:
    """gRPC server options: ping each client connection after ``keepalive_seconds`` without
    traffic (also with no call in flight) and close it if the ping is not answered within
    twice that (at least 1 s); accept clients' own keepalive pings every
    ``MIN_CLIENT_PING_SECONDS``. gRPC's C core answers pings on its own threads, so a client
    whose Python holds the GIL still answers; a client that is gone does not (or its kernel
    closed the connection already). ``keepalive_seconds <= 0``: only the client ping policy
    (the server pings after gRPC's default of 2 hours)."""
    options = [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_CLIENT_PING_SECONDS * 1000)),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging an idle connection
    ]
    if keepalive_seconds > 0:
        ms = max(1, int(keepalive_seconds * 1000))
        timeout = max(1000, 2 * ms)
        # grpcio 1.85 closes a connection whose ping goes unanswered after
        # ``grpc.http2.ping_timeout_ms``; ``keepalive_timeout_ms`` alone did not (a stopped
        # client's connection was still open a minute later).
        options += [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", timeout),
                    ("grpc.http2.ping_timeout_ms", timeout)]
    return options


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


@dataclass
class ServerHandle:
    """A running device server.

    Attributes:
        server: the ``grpc.Server``.
        service: the servicer (for in-process inspection, e.g. ``service.counter_values()``).
        health: the health servicer.
        host, port: where it listens (``port`` is the bound one, also when 0 was asked).
    """

    server: grpc.Server
    service: DeviceService
    health: health.HealthServicer
    host: str
    port: int

    @property
    def address(self) -> str:
        """``host:port`` to give to a client."""
        return format_address(self.host, self.port)

    def stop(self, grace: float | None = 1.0) -> bool:
        """Stops serving, in order: new work is refused (UNAVAILABLE, "shutting down") and
        health goes NOT_SERVING; calls in flight get up to ``grace`` seconds to finish; then
        the server stops (cancelling calls still running) and every session is closed.

        Returns:
            True if every call in flight finished within the grace period.
        """
        start = time.monotonic()
        self.service.begin_shutdown()
        self.health.enter_graceful_shutdown()
        drained = self.service.wait_idle(grace or 0.0)
        if not drained:
            logger.warning("%d calls still running after the %.1f s grace period; cancelling "
                           "them", self.service.in_flight, grace or 0.0)
            self.service.sessions.stop_runs("shutdown")  # runs end at their next step
        # Handlers that returned may still be sending their replies: a moment for those.
        self.server.stop(_FLUSH_SECONDS if drained else 0).wait()
        self.service.stop()
        logger.info("device server on %s stopped in %.2f s", self.address,
                    time.monotonic() - start)
        return drained

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops or ``timeout`` passes; True if it stopped."""
        return self.server.wait_for_termination(timeout)

    def __repr__(self) -> str:
        return f"ServerHandle(address={self.address!r}, service={self.service!r})"


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with ``authorization: Bearer <token>`` metadata (compared in
    constant time); the health service is exempt, so probes need no secret. Refused calls
    get UNAUTHENTICATED and are counted and logged by the service like any other error.

    Args:
        token: the expected token (non-empty).
        service: the servicer, for counters and the RPC log.
    """

    def __init__(self, token: str, service: DeviceService) -> None:
        if not token:
            raise ValueError("TokenInterceptor needs a non-empty token.")
        self._expected = token.encode()
        self._service = service

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        method = details.method or ""
        if method.startswith(_HEALTH_PREFIX):
            return continuation(details)
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA:
                presented = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, token = presented.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        why = "carries no token" if not presented else "carries a token this server does not accept"
        message = (f"{method}: the call {why}; this device server wants "
                   f"'{TOKEN_METADATA}: Bearer <token>' metadata (IPUConfig.server_token or "
                   f"TF_IPU_SERVER_TOKEN on the client).")
        name = method.rsplit("/", 1)[-1]
        service = self._service

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            service.count_error(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")
            service.log_rpc(name, "", "UNAUTHENTICATED", 0.0, 0, 0, context,
                            kind="unauthenticated", message=message)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(
    port: int = 0,
    host: str = "127.0.0.1",
    config: ServiceConfig | None = None,
    max_workers: int = 16,
    token: str = "",
    tls_cert_chain: bytes | None = None,
    tls_private_key: bytes | None = None,
    unix_socket: str = "",
    world: Any = None,
) -> ServerHandle:
    """Starts a device server and returns once it is serving.

    Args:
        port: TCP port; 0 picks a free one (see ``ServerHandle.port``).
        host: interface to bind; 127.0.0.1 unless the server must be reachable from
            other machines.
        config: what the server hosts; ``ServiceConfig()`` by default (1 IPU, ipu2).
        max_workers: threads serving RPCs (calls of different sessions run concurrently).
        token: if set, every call but health checks must carry
            ``authorization: Bearer <token>`` metadata (UNAUTHENTICATED otherwise).
        tls_cert_chain, tls_private_key: PEM bytes; given both, the server speaks TLS only.
        unix_socket: also serve (plaintext) on this Unix socket path, which sessions are told
            of: a client that proves it shares this machine (the shared-memory probe) moves
            its calls there. Its folder should be private (mode 0700); the socket is made
            0600. Not with TLS.
        world: the run's device servers (``emulator.world.World``, ``--mpi-world``), which
            the replicated programs of several instances span; None: none.

    Returns:
        A ``ServerHandle``.

    Raises:
        ValueError: unknown ``config.ipu_version``, bad numbers, or only one of the TLS
            cert and key.
        RuntimeError: the address could not be bound.

    Example:
        >>> handle = serve(config=ServiceConfig(num_ipus=2, ipu_version="ipu2"))
        >>> client = DeviceClient(handle.address)  # tf_ipu.client
        >>> handle.stop()
    """
    config = config or ServiceConfig()
    if (tls_cert_chain is None) != (tls_private_key is None):
        raise ValueError("TLS needs both a certificate chain and a private key; received one.")
    service = DeviceService(config)
    service.world = world
    service.max_execute_streams = max(0, max_workers // 2)  # the rest serve the other calls
    options = (grpc_message_options(config.max_message_bytes) + [("grpc.so_reuseport", 0)]
               + receive_window_options() + keepalive_options(config.keepalive_seconds))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="device-rpc"),
        options=options,
        interceptors=[TokenInterceptor(token, service)] if token else None,
    )
    server.add_generic_rpc_handlers((service.generic_handler(),))
    health_servicer = health.HealthServicer(
        experimental_non_blocking=True,
        experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=1),
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = format_address(host, port)
    try:
        if tls_cert_chain is not None:
            credentials = grpc.ssl_server_credentials([(tls_private_key, tls_cert_chain)])
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"Could not bind the device server to {format_address(host, port)}: {e}") from e
    if bound == 0:
        raise RuntimeError(f"Could not bind the device server to {format_address(host, port)}.")
    if unix_socket and tls_cert_chain is None:
        if os.path.exists(unix_socket):
            os.unlink(unix_socket)
        previous = os.umask(0o177)  # the socket is created 0600
        try:
            if server.add_insecure_port(f"unix:{unix_socket}") == 0:
                raise RuntimeError(f"Could not bind the device server to unix:{unix_socket}.")
        finally:
            os.umask(previous)
        config.unix_socket = unix_socket
    server.start()
    service.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    handle = ServerHandle(server, service, health_servicer, host, bound)
    logger.info(
        "device server serving on %s (%s, %s): %d x %s, max message %d bytes, lease %.1f s%s, "
        "max %d bytes per session, request deadline %g s, %d cached executables",
        handle.address, "TLS" if tls_cert_chain is not None else "plaintext",
        "token required" if token else "no token", config.num_ipus,
        service.default_ipu_version, config.max_message_bytes, config.lease_seconds,
        " (or while connected)" if service.sessions.connections is not None else "",
        config.max_session_bytes, config.request_deadline_seconds, config.cache_entries,
    )
    if not is_loopback(host) and not token:
        logger.warning("serving on %s without a token: anyone who reaches this address can "
                       "use the IPUs (see --token-file)", handle.address)
    return handle
