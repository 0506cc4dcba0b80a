"""The device server's options (``ServiceConfig``, each a command line flag) and the checks
of a request against them that are not a compile option's own (``compile_requests.py``).

    cli.py flags ──> ServiceConfig ──> DeviceService (service.py) and its parts
    CompileRequest.options test switches ──> checked_test_switches: refused (PERMISSION_DENIED)
                                             unless --allow-test-options; merged with the
                                             server's own (--refuse-opcodes, --fault-inject)
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from device_server.disk_cache import DEFAULT_MAX_BYTES as DEFAULT_DISK_CACHE_BYTES
from device_server.protocol import device_pb2
from device_server.sessions import ServiceError


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


def checked_test_switches(options: device_pb2.CompileOptions, module_name: str,
                  config: ServiceConfig) -> tuple[frozenset[str], str]:
    """The opcodes a compile refuses and the one whose results it perturbs: the request's
    test switches with the server's own (``config.refuse_opcodes`` added to the request's,
    ``config.fault_inject_opcode`` first).

    Raises:
        ServiceError: PERMISSION_DENIED (kind ``test-option-refused``) naming the switches
            the request set, when the server does not allow them (``allow_test_options``).
    """
    refuse = frozenset(options.refuse_opcodes) | frozenset(config.refuse_opcodes)
    switches = [f"{name}={value!r}" for name, value in (
        ("fault_inject_opcode", options.fault_inject_opcode[:64]),
        ("refuse_opcodes", [o[:64] for o in options.refuse_opcodes[:8]])) if value]
    if switches and not config.allow_test_options:
        raise ServiceError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"Compile of {module_name!r}: {' and '.join(switches)} "
            f"{'are test switches' if len(switches) > 1 else 'is a test switch'}, and this "
            f"server refuses test switches from clients (its operator allows them with "
            f"--allow-test-options).", kind="test-option-refused")
    return refuse, config.fault_inject_opcode or options.fault_inject_opcode
