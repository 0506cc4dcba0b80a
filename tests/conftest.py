"""Shared pytest fixtures.

- ``device_server``: the address of one device server (a child process, 8 IPUs, ipu2) shared
  by the whole test session; set ``TF_IPU_TEST_SERVER=host:port`` to use a running one.
- ``onnx_server``: that server as ``tf_ipu.onnx``'s default for one test module (its clients
  closed after it); ONNX test modules use it with ``pytestmark``.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def device_server():
    """Address (``host:port``) of the session's device server."""
    external = os.environ.get("TF_IPU_TEST_SERVER")
    if external:
        yield external
        return
    from tf_ipu.local_server import start_local_server

    server = start_local_server(num_ipus=8, ipu_version="ipu2")
    try:
        yield server.address
    finally:
        import sys

        runtime = sys.modules.get("tf_ipu.runtime")
        if runtime is not None and runtime._RUNTIME is not None:
            runtime._RUNTIME.shutdown()  # close the session (and its heartbeat) first
        server.stop()


@pytest.fixture(scope="session")
def ipu_system(device_server):
    """This process's IPU system, configured once against the shared device server.

    Tests that change the config (debug switches, IPU version) restore it before returning.
    """
    import tf_ipu

    cfg = tf_ipu.IPUConfig()
    cfg.server_address = device_server
    cfg.auto_select_ipus = 1
    cfg.ipu_model.version = "ipu2"
    cfg.configure_ipu_system()
    return cfg


@pytest.fixture(scope="module")
def onnx_server(device_server):
    """``device_server`` as tf_ipu.onnx's default server for the module."""
    import tf_ipu.onnx as tox
    from tf_ipu.onnx import device as onnx_device

    tox.set_default_server(device_server)
    yield device_server
    onnx_device.close_all()
    tox.set_default_server(None)
