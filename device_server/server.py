"""Builds and runs the device server's gRPC server.

    client ==gRPC (max message lifted, 1 GiB by default)==> grpc.Server on host:port
                                                             |- tf_ipu.device.DeviceService
                                                             |- grpc.health.v1.Health (SERVING)
                                                             '- server reflection

``serve()`` starts serving and returns a ``ServerHandle`` (bound port, ``stop(grace)``). It
binds 127.0.0.1 by default: the service has no authentication, so exposing it on another
interface is an explicit choice. ``cli.py`` is the command line around it.
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from device_server.service import SERVICE_NAME, DeviceService, ServiceConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_GRPC_INT_MAX = (1 << 31) - 1


def grpc_message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options that lift the message size limits to ``max_message_bytes``
    (clamped to gRPC's int32 range; <= 0 means unlimited)."""
    n = -1 if max_message_bytes <= 0 else min(int(max_message_bytes), _GRPC_INT_MAX)
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


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

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving: health goes NOT_SERVING, in-flight calls get ``grace`` seconds,
        then every session is closed."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.service.stop()
        logger.info("device server on %s stopped", self.address)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops or ``timeout`` passes; True if it stopped."""
        return self.server.wait_for_termination(timeout)

    def __repr__(self) -> str:
        return f"ServerHandle(address={self.address!r}, service={self.service!r})"


def serve(
    port: int = 0,
    host: str = "127.0.0.1",
    config: ServiceConfig | None = None,
    max_workers: int = 16,
) -> ServerHandle:
    """Starts a device server and returns once it is serving.

    Args:
        port: TCP port; 0 picks a free one (see ``ServerHandle.port``).
        host: interface to bind; 127.0.0.1 unless the server must be reachable from
            other machines.
        config: what the server hosts; ``ServiceConfig()`` by default (1 IPU, ipu2).
        max_workers: threads serving RPCs (calls of different sessions run concurrently).

    Returns:
        A ``ServerHandle``.

    Raises:
        ValueError: unknown ``config.ipu_version`` or bad numbers.
        RuntimeError: the address could not be bound.

    Example:
        >>> handle = serve(config=ServiceConfig(num_ipus=2, ipu_version="ipu2"))
        >>> client = DeviceClient(handle.address)  # tf_ipu.client
        >>> handle.stop()
    """
    config = config or ServiceConfig()
    service = DeviceService(config)
    options = grpc_message_options(config.max_message_bytes) + [("grpc.so_reuseport", 0)]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="device-rpc"),
        options=options,
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
    try:
        bound = server.add_insecure_port(format_address(host, port))
    except RuntimeError as e:
        raise RuntimeError(f"Could not bind the device server to {format_address(host, port)}: {e}") from e
    if bound == 0:
        raise RuntimeError(f"Could not bind the device server to {format_address(host, port)}.")
    server.start()
    service.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    handle = ServerHandle(server, service, health_servicer, host, bound)
    logger.info(
        "device server serving on %s: %d x %s, max message %d bytes, lease %.1f s",
        handle.address, config.num_ipus, service.default_ipu_version, config.max_message_bytes,
        config.lease_seconds,
    )
    return handle
