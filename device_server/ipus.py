"""AttachIpus: a session's target (IPU version and tiles) and its IPUs from the pool.

    AttachIpusRequest ──> checks (tiles_per_ipu, wait_seconds, a known target, the server's
                          system) ──> IpuPool.allocate (waits within the call's deadline)
                      <── the session's ipu_ids, target, ipu_version, tiles_per_ipu

DetachIpus and the lease's end free them (``sessions.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from device_server.calls import CallState
from device_server.emulator import get_target
from device_server.protocol import device_pb2, hardware
from device_server.sessions import IpuPool, ServiceError, Session

logger = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def describe_target(target: Any, fallback_name: str) -> tuple[str, int]:
    """(canonical version name, tiles per IPU) of an emulator target."""
    name = getattr(target, "name", None) or getattr(target, "ipu_version", None) or fallback_name
    return str(name), int(getattr(target, "tiles_per_ipu", 0))


def attach_ipus(s: Session, request: device_pb2.AttachIpusRequest, pool: IpuPool,
                system: hardware.System | None, default_ipu_version: str,
                call: CallState) -> device_pb2.AttachIpusReply:
    """Attaches the IPUs ``request`` asks for to the entered session ``s``.

    Raises:
        ServiceError: FAILED_PRECONDITION if ``s`` has IPUs already; INVALID_ARGUMENT for a
            bad number or a version the server has no target for (or, with a named system,
            does not host), naming what was received; the pool's own errors.
    """
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
    version = request.ipu_version or default_ipu_version
    try:
        target = get_target(version, tiles_per_ipu=request.tiles_per_ipu)
    except ValueError as e:
        raise ServiceError(
            _INVALID,
            f"AttachIpus: no target for ipu_version={version!r}, "
            f"tiles_per_ipu={request.tiles_per_ipu}: {e}",
        ) from None
    if system is not None and target.name != system.ipu_version:
        raise ServiceError(
            _INVALID,
            f"AttachIpus: this server hosts a {system.name} "
            f"({system.description}): it has no {version!r} IPUs. Ask for "
            f"ipu_version {system.ipu_version!r} (or none), or use a server "
            f"started with another --system.",
        )
    remaining = call.remaining()
    if remaining is not None:
        wait = min(wait, max(0.0, remaining - 0.05))  # answer before the deadline
    ids = pool.allocate(request.num_ipus, s.session_id, wait_seconds=wait,
                        still_wanted=call.client_waiting, wanted=request.ipu_ids)
    s.ipu_ids = ids
    s.target = target
    s.ipu_version, s.tiles_per_ipu = describe_target(target, version)
    logger.info("session %s attached IPUs %s (%s, %d tiles each)", s.short_id, ids,
                s.ipu_version, s.tiles_per_ipu)
    return device_pb2.AttachIpusReply(
        ipu_ids=ids, ipu_version=s.ipu_version, tiles_per_ipu=s.tiles_per_ipu
    )
