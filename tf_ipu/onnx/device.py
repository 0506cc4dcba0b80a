"""The ONNX front end's link to the device server: sessions per IPU version and count,
shared by every model of the process.

    OnnxModel ──compile(module, replicas)──> _Session(address, ipu_version, ipus)
                                              └─ tf_ipu.client.DeviceClient ==gRPC==> server
    server: load(server=) > set_default_server() > $TF_IPU_SERVER > the address an
            IPUConfig configured > the embedded server (tf_ipu.runtime's, started on demand)
    load(system="c2"): the same order, but the server must host that system; without one
            named, a server of that system alone (``--system c2``), started on demand and
            shared by the process's models of that system

Nothing here imports TensorFlow. Sessions close at exit, before the embedded server stops.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.protocol import ir_pb2
from tf_ipu import errors
from tf_ipu.client import CompiledProgram, DeviceClient

_lock = threading.RLock()
_sessions: dict[tuple[str, str, int], _Session] = {}
_default_server: list[str | None] = [None]
_atexit_registered = [False]


def set_default_server(address: str | None) -> None:
    """Makes ``address`` (``host:port``) the server of models loaded without ``server=``;
    None goes back to ``$TF_IPU_SERVER`` or the embedded server."""
    _default_server[0] = address


def resolve_address(server: str | None = None, system: str = "") -> str:
    """The device server a model uses (see the module docstring)."""
    if server:
        return server
    if _default_server[0]:
        return _default_server[0]
    env = os.environ.get("TF_IPU_SERVER")
    if env:
        return env
    if system:
        return system_server_address(system)
    from tf_ipu.runtime import get_runtime

    runtime = get_runtime()
    cfg = runtime.config
    if cfg is not None and getattr(cfg, "server_address", None):
        return str(cfg.server_address)
    return runtime.embedded_server_address()


_system_servers: dict[str, Any] = {}


def system_server_address(system: str) -> str:
    """A local device server hosting the named system (``python -m device_server --system
    NAME``), started on first use and stopped at exit."""
    from device_server.protocol import hardware
    from tf_ipu.local_server import start_local_server

    spec = hardware.get_system(system)
    with _lock:
        srv = _system_servers.get(spec.name)
        if srv is None or not srv.alive():
            srv = start_local_server(num_ipus=spec.num_ipus, ipu_version=spec.ipu_version,
                                     extra_args=("--system", spec.name))
            _system_servers[spec.name] = srv
        return str(srv.address)


@dataclass
class _Session:
    client: DeviceClient
    ipu_version: str
    ipus: int
    lock: threading.Lock


def session(address: str, ipu_version: str, ipus: int, system: str = "") -> _Session:
    """The process's session on ``address`` holding ``ipus`` IPUs of ``ipu_version`` (of the
    named ``system``, which the server must host: ValueError otherwise)."""
    key = (address, ipu_version, ipus)
    with _lock:
        s = _sessions.get(key)
        if s is not None and not s.client._closed and (not system or s.client.session.system == system):
            return s
        client = DeviceClient(address, client_name=f"tf_ipu.onnx[{os.getpid()}]")
        try:
            hosted = client.open_session().system
            if system and hosted != system:
                raise ValueError(
                    f"system={system!r}: the device server at {address} hosts "
                    f"{repr(hosted) if hosted else 'plain IPUs (no named system)'}; start one with "
                    f"--system {system}, or leave server= unset for one started here.")
            client.attach(ipus, ipu_version)
        except BaseException:
            client.close()
            raise
        s = _Session(client, ipu_version, ipus, threading.Lock())
        _sessions[key] = s
        if not _atexit_registered[0]:
            atexit.register(close_all)  # runs before the embedded server's (registered earlier)
            _atexit_registered[0] = True
        return s


def close_all() -> None:
    """Closes every session of the ONNX front end (their IPUs are free again)."""
    with _lock:
        for s in _sessions.values():
            s.client.close()
        _sessions.clear()


def compile_module(s: _Session, module: ir_pb2.Module, replicas: int,
                   options: dict[str, Any]) -> CompiledProgram:
    with s.lock:
        return s.client.compile(module, replicas=replicas, **options)


def execute(s: _Session, executable_id: str, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    with s.lock:
        outs = s.client.execute(executable_id, list(arrays))
    if any(o is None for o in outs):
        raise errors.InternalError("the device kept an output of an ONNX program (none is a variable)")
    return [np.array(o) for o in outs]  # copies: the reply's buffers are read-only views
