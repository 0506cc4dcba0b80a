"""The device server as a service: many clients, faults, bad input, limits, security,
observability, and a short fuzz campaign.

Servers: the suite's shared one (``device_server``), an in-process one with small limits
(``limited``), and standalone processes on fixed ports (``server_util.ServerProcess``) where
a test kills, restarts or signals the server. Programs are hand-built IR
(``server_util.sgd_module``, ``loop_module``); expected results are numpy's.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import server_util as su
from grpc_health.v1 import health_pb2, health_pb2_grpc

from device_server.cli import build_parser, read_token
from device_server.executable_cache import cache_key
from device_server.protocol import device_pb2, device_pb2_grpc, ir_pb2
from device_server.server import is_loopback, serve
from device_server.service import ServiceConfig
from tf_ipu import errors
from tf_ipu.client import DeviceClient, SessionInfo, VariableRef

MIB = 1 << 20
RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 8)).astype(np.float32)
Y = RNG.standard_normal((16, 1)).astype(np.float32)
W = RNG.standard_normal((8, 1)).astype(np.float32)
LOOP_X = np.ones((32, 32), np.float32)


@pytest.fixture(scope="module")
def limited():
    """An in-process server with small limits: 2 IPUs, 1 MiB messages, 2 MiB per session,
    1 s request deadline, 2 cached executables."""
    config = ServiceConfig(num_ipus=2, max_message_bytes=MIB, max_session_bytes=2 * MIB,
                           request_deadline_seconds=1.0, cache_entries=2)
    handle = serve(config=config)
    yield handle
    handle.stop(grace=1.0)


def attached(address: str, num_ipus: int = 1, **kwargs) -> DeviceClient:
    c = DeviceClient(address, **kwargs)
    c.open_session()
    c.attach(num_ipus)
    return c


def counters(address: str) -> dict[str, int]:
    with DeviceClient(address) as c:
        return c.counters()


def wait_until(predicate, timeout: float, what: str) -> float:
    """Polls ``predicate`` until true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def loop_iterations(client: DeviceClient, executable_id: str, seconds: float) -> int:
    """How many iterations of ``loop_module`` take about ``seconds`` on this machine now."""
    n = 20_000
    start = time.perf_counter()
    client.execute(executable_id, [np.array(n, np.int32), LOOP_X])
    return int(min(2**31 - 1, n * seconds / max(time.perf_counter() - start, 1e-4)))


def check_sgd(client: DeviceClient, executable_id: str) -> None:
    loss, new_w = client.execute(executable_id, [X, Y, W], return_updated_variables=False)
    ref_loss, ref_w = su.sgd_reference(X, Y, W)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(new_w, ref_w, rtol=1e-5, atol=1e-7)


# -- many clients ----------------------------------------------------------------------------


def test_attach_waits_for_ipus_then_names_requested_and_free(limited):
    address = limited.address
    with DeviceClient(address) as a, DeviceClient(address) as b, DeviceClient(address) as c:
        for x in (a, b, c):
            x.open_session()
        a.attach(2)
        with pytest.raises(errors.ResourceExhaustedError, match=r"requested 1, free 0 of 2") as info:
            b.attach(1)  # no wait: at once
        assert info.value.kind == "no-free-ipus"
        threading.Timer(0.4, a.detach).start()
        start = time.monotonic()
        assert len(b.attach(1, wait_seconds=5).ipu_ids) == 1
        assert 0.3 < time.monotonic() - start < 3
        start = time.monotonic()
        with pytest.raises(errors.ResourceExhaustedError,
                           match=r"requested 2, free 1 of 2 on this server \(after waiting 0\.\d s\)"):
            c.attach(2, wait_seconds=0.5)
        assert 0.45 < time.monotonic() - start < 3
        start = time.monotonic()
        with pytest.raises(errors.InvalidArgumentError, match=r"3 IPUs asked for .* hosts 2"):
            c.attach(3, wait_seconds=30)  # more than the server hosts: no point waiting
        assert time.monotonic() - start < 1
        with pytest.raises(errors.InvalidArgumentError, match="wait_seconds must be >= 0"):
            c.attach(1, wait_seconds=-1)


def test_sessions_are_isolated_and_a_hash_grants_nothing(device_server):
    module = su.sgd_module(name="isolated")
    with attached(device_server) as a, attached(device_server) as b:
        assert re.fullmatch(r"[0-9a-f]{32}", a.session_id) and a.session_id != b.session_id
        program = a.compile(module)
        a.write_variables({"secret": W})
        with pytest.raises(errors.NotFoundError, match="no variable 'secret'"):
            b.read_variables(["secret"])
        own = b.compile(module)
        assert own.cache_hit and own.executable_id != program.executable_id
        with pytest.raises(errors.NotFoundError, match="bound to variable 'secret'"):
            b.execute(own.executable_id, [X, Y, VariableRef("secret")])
        with pytest.raises(errors.NotFoundError, match="no executable"):
            b.execute(program.executable_id, [X, Y, W])
        # The cache's content hash names the executable on the server, but is no handle.
        key = cache_key(module, "ipu2", 1472, frozenset(), "", False)
        for c in (a, b):
            with pytest.raises(errors.NotFoundError, match="no executable") as info:
                c.execute(key, [X, Y, W])
            assert info.value.kind == "unknown-executable"
        # A session id one character off is another (unknown) session.
        other = a.session_id[:-1] + ("0" if a.session_id[-1] != "0" else "1")
        with grpc.insecure_channel(device_server) as channel:
            stub = device_pb2_grpc.DeviceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as rpc:
                stub.CloseSession(device_pb2.SessionRef(session_id=other), timeout=5)
            assert rpc.value.code() == grpc.StatusCode.NOT_FOUND
        np.testing.assert_array_equal(a.read_variables(["secret"])["secret"], W)
        check_sgd(a, program.executable_id)
        check_sgd(b, own.executable_id)


# -- faults ----------------------------------------------------------------------------------

_CHILD_CLIENT = """
import sys, types
root = sys.argv[1]
sys.path[:0] = [root, root + "/tests"]
pkg = types.ModuleType("tf_ipu")  # the client alone, without TensorFlow
pkg.__path__ = [root + "/tf_ipu"]
sys.modules["tf_ipu"] = pkg
import numpy as np
import server_util as su
from tf_ipu.client import DeviceClient
c = DeviceClient(sys.argv[2])
c.open_session()  # the server's default lease
c.attach(2)
exe = c.compile(su.loop_module()).executable_id
x = np.ones((32, 32), np.float32)
print("running", flush=True)
while True:
    c.execute(exe, [np.array(int(sys.argv[3]), np.int32), x])
"""


def test_killed_client_has_its_ipus_released_within_10_s(device_server):
    with attached(device_server) as c:
        half_a_second = loop_iterations(c, c.compile(su.loop_module()).executable_id, 0.5)
    before = counters(device_server)["ipus_free"]
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_CLIENT, str(su.ROOT), device_server, str(half_a_second)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=su.child_env(),
    )
    try:
        line = child.stdout.readline()  # blocks until the child attached and compiled
        assert line.strip() == "running", child.stderr.read()
        assert counters(device_server)["ipus_free"] == before - 2
        time.sleep(0.3)  # inside an Execute (each takes ~0.5 s)
        child.kill()
        child.wait()
        released = wait_until(lambda: counters(device_server)["ipus_free"] == before, 15,
                              "the killed client's IPUs were released")
        assert released < 10, f"released after {released:.1f} s"
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()


def test_sigterm_drains_calls_in_flight_refuses_new_work_and_exits_0():
    server = su.ServerProcess.start(["--ipus", "2", "--shutdown-grace", "10"])
    try:
        client = attached(server.address)
        exe = client.compile(su.loop_module()).executable_id
        two_seconds = loop_iterations(client, exe, 2.0)
        result: dict[str, object] = {}

        def long_call() -> None:
            try:
                result["out"] = client.execute(exe, [np.array(two_seconds, np.int32), LOOP_X])
            except Exception as e:  # reported by the asserts below
                result["error"] = e

        worker = threading.Thread(target=long_call)
        worker.start()
        probe = DeviceClient(server.address)
        wait_until(lambda: probe.counters()["rpcs_in_flight"] >= 2, 10, "the long call started")
        server.signal(signal.SIGTERM)
        wait_until(lambda: not probe.healthy(), 5, "health went NOT_SERVING")
        with pytest.raises(errors.DeviceUnavailableError, match="shutting down and accepts no new work") as info:
            probe.open_session()
        assert info.value.kind == "shutting-down"
        assert probe.counters()["error_kinds.shutting-down"] >= 1  # observability still answers
        worker.join(30)
        assert "error" not in result, result
        [out] = result["out"]
        assert out.shape == (32, 32) and np.isfinite(out).all()
        assert server.process.wait(timeout=15) == 0
        probe.close()
        client.abandon()
    finally:
        server.kill()
        server.stop()

    # A call longer than the grace period is cancelled, and the process still exits 0 in time.
    server = su.ServerProcess.start(["--shutdown-grace", "0.5"])
    try:
        client = attached(server.address)
        exe = client.compile(su.loop_module()).executable_id
        worker = threading.Thread(target=long_call)
        result.clear()
        worker.start()
        probe = DeviceClient(server.address)
        wait_until(lambda: probe.counters()["rpcs_in_flight"] >= 2, 10, "the long call started")
        start = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.process.wait(timeout=10) == 0
        assert time.monotonic() - start < 5
        worker.join(10)
        assert isinstance(result.get("error"), errors.DeviceError), result
        assert result["error"].code in ("CANCELLED", "UNAVAILABLE")
        probe.abandon()
        client.abandon()
    finally:
        server.kill()
        server.stop()


def test_server_killed_mid_fit_then_back_resumes_from_the_checkpoint(ipu_system, tmp_path):
    """kill -9 of the server mid-fit: a clear error at once, naming the last step whose
    weights the host holds; the server comes back on the same port; fit reconnects,
    re-uploads from the host, resumes from BackupAndRestore's checkpoint and ends exactly
    where an uninterrupted run ends."""
    import keras
    import tensorflow as tf

    import tf_ipu
    from tests.keras_util import classification_data, mlp

    server = su.ServerProcess.start(["--ipus", "2"])
    cfg = tf_ipu.IPUConfig()
    cfg.server_address = server.address
    cfg.connect_timeout = 2.0
    try:
        cfg.configure_ipu_system()
        strategy = tf_ipu.IPUStrategy()
        x, y = classification_data(64, (16,))
        models = []
        for _ in range(2):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                m = mlp()
                m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                          loss="sparse_categorical_crossentropy", steps_per_execution=1)
            models.append(m)
        model, reference = models
        reference.set_weights(model.get_weights())
        fit = dict(x=x, y=y, batch_size=16, epochs=5, shuffle=False, verbose=0)
        backup = str(tmp_path / "backup")

        class KillServer(keras.callbacks.Callback):
            killed_at = 0.0

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if self.epoch == 2 and batch == 1 and server.alive():
                    server.kill()
                    KillServer.killed_at = time.monotonic()

        with pytest.raises(tf.errors.UnavailableError, match="cannot reach the device server") as info:
            model.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup), KillServer()])
        assert time.monotonic() - KillServer.killed_at < 10
        assert server.address in str(info.value)
        # Weights stay on the device: the error says what the host holds (the sync at the
        # end of epoch 2 = step 8; the two steps of epoch 3 were on the device only).
        assert "The host holds the weights of step 8 (end of epoch 2)" in str(info.value)
        assert not tf_ipu.get_runtime().connected
        with pytest.raises(errors.DeviceUnavailableError, match=server.address):
            cfg.configure_ipu_system()  # still down: says so within connect_timeout

        checkpoint = mlp()
        checkpoint.load_weights(os.path.join(backup, "latest.weights.h5"))  # after epoch 1
        server.restart()  # same address

        class Resumed(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.weights = [np.array(w) for w in self.model.get_weights()]

            def on_epoch_begin(self, epoch, logs=None):
                self.first_epoch = getattr(self, "first_epoch", epoch)

        resumed = Resumed()
        history = model.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup), resumed])
        assert resumed.first_epoch == 2 and len(history.history["loss"]) == 3
        for got, saved in zip(resumed.weights, checkpoint.get_weights(), strict=True):
            np.testing.assert_array_equal(got, saved)
        assert tf_ipu.get_runtime().client.address == server.address

        reference.fit(**fit)
        for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    finally:
        server.kill()
        server.stop()
        ipu_system.configure_ipu_system()


def test_forgotten_session_is_reopened_and_the_call_retried(ipu_system):
    """The server forgets the runtime's session (lease, restart between calls): the next
    device call opens a new one, uploads the host's values and goes on, with no error."""
    import keras

    import tf_ipu
    from tests.keras_util import classification_data, mlp

    strategy = tf_ipu.IPUStrategy()
    x, y = classification_data(48, (16,))
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            m = mlp()
            m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", steps_per_execution=3)
        models.append(m)
    a, b = models
    b.set_weights(a.get_weights())
    fit = dict(x=x, y=y, batch_size=16, shuffle=False, verbose=0)
    a.fit(**fit, epochs=2)
    b.fit(**fit, epochs=1)
    runtime = tf_ipu.get_runtime()
    old = runtime.client.session_id
    with grpc.insecure_channel(ipu_system.server_address) as channel:
        device_pb2_grpc.DeviceServiceStub(channel).CloseSession(
            device_pb2.SessionRef(session_id=old), timeout=5)
    b.fit(**fit, epochs=1)
    assert runtime.client.session_id != old
    for got, want in zip(b.get_weights(), a.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# -- Execute over a stream -------------------------------------------------------------------


def test_execute_stream_answers_in_order_and_an_error_ends_only_that_stream(device_server):
    with attached(device_server) as c:
        exe = c.compile(su.sgd_module(name="streamed")).executable_id
        before = c.counters()
        for _ in range(5):
            check_sgd(c, exe)
        assert c._stream is not None and not c._stream.dead and c._stream.calls == 5
        with pytest.raises(errors.InvalidArgumentError, match="expected 3 parameters, received 2"):
            c.execute(exe, [X, Y])
        assert c._stream is None  # the error ended it, with the call's status
        check_sgd(c, exe)  # on a new stream
        after = c.counters()
        assert after["rpcs.ExecuteStream"] - before.get("rpcs.ExecuteStream", 0) == 2
        assert after["rpcs.Execute"] - before.get("rpcs.Execute", 0) == 7  # each call counted
        assert after["execute_streams_open"] >= 1
    with grpc.insecure_channel(device_server) as channel:  # bad input on a stream
        stream = channel.stream_stream("/tf_ipu.device.DeviceService/ExecuteStream")
        with pytest.raises(grpc.RpcError) as info:
            next(stream(iter([b"\x0a\xff\xff\xff\xff\x0f"]), timeout=5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not a valid ExecuteRequest" in info.value.details()
        assert ("tf-ipu-error-kind", "undecodable-request") in info.value.trailing_metadata()


def test_execute_streams_are_bounded_idle_ones_close_and_refused_calls_go_unary(monkeypatch):
    monkeypatch.setattr("tf_ipu.client_execute.STREAM_IDLE_SECONDS", 1.5)
    handle = serve(config=ServiceConfig(num_ipus=3), max_workers=4)  # 2 streams at most
    try:
        clients = [attached(handle.address) for _ in range(3)]
        programs = [c.compile(su.sgd_module(name="bounded")).executable_id for c in clients]
        for c, exe in zip(clients, programs, strict=True):
            check_sgd(c, exe)
        values = clients[0].counters()
        assert values["execute_streams_open"] == 2
        assert values["error_kinds.too-many-streams"] == 1
        assert clients[2]._stream is None and clients[2]._streams_off_until > time.monotonic()
        check_sgd(clients[2], programs[2])  # unary, without asking again
        assert clients[0].counters()["error_kinds.too-many-streams"] == 1
        # Idle streams are closed by their clients: the server's threads are free again.
        wait_until(lambda: clients[0].counters()["execute_streams_open"] == 0, 5, "idle close")
        check_sgd(clients[0], programs[0])  # a new stream
        for c in clients:
            c.close()
        wait_until(lambda: handle.service.counter_values()["execute_streams_open"] == 0, 5,
                   "streams end with their clients")
    finally:
        handle.stop(grace=1.0)


def test_execute_stream_call_without_an_answer_meets_its_deadline():
    """The client's watchdog ends a stream whose call gets no answer in time (here from a
    server that never answers)."""
    release = threading.Event()

    def never(requests, context):
        for _ in requests:
            release.wait(30)
            yield device_pb2.ExecuteReply()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "tf_ipu.device.DeviceService", {"ExecuteStream": grpc.stream_stream_rpc_method_handler(
            never, request_deserializer=device_pb2.ExecuteRequest.FromString,
            response_serializer=device_pb2.ExecuteReply.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c = DeviceClient(f"127.0.0.1:{port}")
    try:
        c._reachable = True  # (it has no health service, nor sessions)
        c._session = SessionInfo("0" * 32, "", "", 1, 1, 1 << 30, 5.0)
        start = time.monotonic()
        with pytest.raises(errors.DeadlineExceededError, match=r"no answer within 0\.5 s"):
            c.execute("x", [], timeout=0.5)
        assert 0.4 < time.monotonic() - start < 3
        assert c._stream is None
    finally:
        release.set()
        c.abandon()
        server.stop(0)


# -- bad input and limits ----------------------------------------------------------------------

_REQUEST_TYPES = {
    "OpenSession": "OpenSessionRequest", "CloseSession": "SessionRef", "Heartbeat": "SessionRef",
    "AttachIpus": "AttachIpusRequest", "DetachIpus": "SessionRef", "Compile": "CompileRequest",
    "WriteVariables": "WriteVariablesRequest", "ReadVariables": "ReadVariablesRequest",
    "Execute": "ExecuteRequest", "GetCounters": "Empty",
}


def test_every_rpc_refuses_undecodable_and_unknown_session_requests(device_server):
    with attached(device_server) as healthy, grpc.insecure_channel(device_server) as channel:
        program = healthy.compile(su.sgd_module(name="beside"))
        for method, type_name in _REQUEST_TYPES.items():
            raw = channel.unary_unary(f"/tf_ipu.device.DeviceService/{method}")
            with pytest.raises(grpc.RpcError) as info:
                raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)  # a field longer than the message
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert f"is not a valid {type_name}" in info.value.details(), method
            assert ("tf-ipu-error-kind", "undecodable-request") in info.value.trailing_metadata()
            if method in ("OpenSession", "GetCounters"):
                continue
            request = getattr(device_pb2, type_name)(session_id="0" * 32)
            with pytest.raises(grpc.RpcError) as info:
                raw(request.SerializeToString(), timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, method
            assert "0" * 32 in info.value.details(), method
            assert ("tf-ipu-error-kind", "unknown-session") in info.value.trailing_metadata()
        check_sgd(healthy, program.executable_id)


@pytest.mark.parametrize("data_path", ["stream", "shm"])
def test_requests_and_replies_past_the_message_limit_move_in_chunks(limited, data_path):
    with attached(limited.address, data_path=data_path) as c, \
            attached(limited.address, data_path=data_path) as d:
        assert c.session.max_message_bytes == MIB and c.data.kind == data_path
        big = RNG.standard_normal(300_000).astype(np.float32)  # 1.2 MB: more than a message
        c.write_variables({"big": big})
        c.write_variables({"a": np.zeros(50_000, np.float32), "b": np.ones(50_000, np.float32)})
        back = c.read_variables(["big", "a", "b"])  # 1.6 MB in all
        np.testing.assert_array_equal(back["big"], big)
        assert back["a"].sum() == 0 and back["b"].sum() == 50_000

        m = ir_pb2.Module(name="spread", entry_computation_id=0)
        b = su.Builder(m, 0, "main")
        p = b.parameter(su.array_shape(np.float32, [300_000]))
        b.root(b.op("add", [p, b.constant(np.full(300_000, 2, np.float32))]))  # a 1.2 MB module
        program = d.compile(m)  # (another session: the first holds most of its 2 MiB)
        [out] = d.execute(program.executable_id, [big])  # 1.2 MB in and out
        np.testing.assert_array_equal(out, big + 2)
        moved = {k: c.data.counters.get(k, 0) + d.data.counters.get(k, 0)
                 for k in {*c.data.counters, *d.data.counters}}
        if data_path == "stream":
            assert moved["stream_bytes_out"] >= 3 * 1_200_000 and moved["stream_bytes_in"] >= 2_400_000
            # Beyond the payload, the transport holds at most two chunks at a time.
            peak = max(c.data.counters["stream_peak_bytes_held"], d.data.counters["stream_peak_bytes_held"])
            assert 0 < peak <= 2 * c.data.chunk_bytes()
            server = limited.service.transfers.snapshot()
            assert server["stream_peak_bytes_held"] <= m.ByteSize() + 2 * c.data.chunk_bytes()
        else:
            assert moved["shm_bytes_out"] >= 2 * 1_200_000 and moved["shm_bytes_in"] >= 2_400_000
        check_sgd(c, c.compile(su.sgd_module()).executable_id)


@pytest.mark.parametrize("data_path", ["stream", "shm"])
def test_session_memory_limit_names_bytes_and_limit(limited, data_path):
    with attached(limited.address, data_path=data_path) as c, attached(limited.address) as other:
        block = np.zeros(200_000, np.float32)  # 800 KB: streamed as a blob, or in shm
        c.write_variables({"a": block})
        c.write_variables({"b": block})
        held = ("1600000 in resident variables, 0 staged, 800000 in this blob" if data_path == "stream"
                else "it holds 1600000 bytes in 2 variables")
        with pytest.raises(errors.ResourceExhaustedError,
                           match=r"would hold 2400000 bytes.*over the server's limit of 2097152 bytes "
                                 r"per session \(--max-session-bytes\)") as info:
            c.write_variables({"c": block})
        assert held in info.value.message
        assert info.value.kind == "session-memory"
        c.write_variables({"a": block + 1})  # replacing does not grow
        other.write_variables({"a": block})  # a limit per session
        other.write_variables({"b": block})
        m = ir_pb2.Module(name="huge", entry_computation_id=0)
        b = su.Builder(m, 0, "main")
        b.root(b.op("broadcast", [b.parameter(su.array_shape(np.float32, []))],
                    su.array_shape(np.float32, [1 << 30]), dimensions=[]))
        with pytest.raises(errors.OutOfMemoryError, match=r"makes an array of 4294967296 bytes"):
            c.compile(m)


def test_program_that_does_not_fit_is_resource_exhausted_at_compile_and_run(limited):
    with DeviceClient(limited.address) as c:
        c.open_session()
        c.attach(1, tiles_per_ipu=1)  # 624 KiB of SRAM
        module = su.sgd_module(batch=512, dim=256, name="too_big")
        with pytest.raises(errors.OutOfMemoryError, match=r"Out of memory") as info:
            c.compile(module)
        assert info.value.code == "RESOURCE_EXHAUSTED" and info.value.kind == "out-of-memory"
        program = c.compile(module, allow_out_of_memory=True)  # for the report
        assert not program.estimate.fits
        x = np.zeros((512, 256), np.float32)
        with pytest.raises(errors.OutOfMemoryError, match="does not fit in tile memory.*cannot run"):
            c.execute(program.executable_id, [x, np.zeros((512, 1), np.float32),
                                              np.zeros((256, 1), np.float32)])


def test_call_queued_behind_a_long_one_meets_the_request_deadline(limited):
    with attached(limited.address) as c:
        exe = c.compile(su.loop_module()).executable_id
        worker = threading.Thread(target=c.execute, args=(
            exe, [np.array(loop_iterations(c, exe, 2.5), np.int32), LOOP_X]))
        worker.start()
        with DeviceClient(limited.address) as probe:
            wait_until(lambda: probe.counters()["rpcs_in_flight"] >= 2, 10, "the long call started")
        start = time.monotonic()
        with pytest.raises(errors.DeadlineExceededError, match=r"waited 1\.0 s for the session's earlier call"):
            c.read_variables([])
        assert 0.9 < time.monotonic() - start < 2.5
        worker.join(30)


def test_executable_cache_is_bounded_and_handles_survive_eviction(limited):
    with attached(limited.address) as c:
        before = c.counters()["cache_evictions"]
        programs = [c.compile(su.sgd_module(name=f"evict{i}")) for i in range(3)]
        after = c.counters()
        assert after["executables_cached"] == 2 and after["cache_evictions"] >= before + 1
        check_sgd(c, programs[0].executable_id)  # its handle still holds it


# -- security ----------------------------------------------------------------------------------


def test_test_switches_are_refused_unless_the_operator_allows_them(limited, device_server):
    """A standalone server refuses a client's fault_inject_opcode or refuse_opcodes (PERMISSION_DENIED, naming
    the switch and the flag) and goes on serving; a server started with
    --allow-test-options (the suite's, a client's own local server) honours it."""
    module = su.sgd_module(batch=16, dim=8, name="sgd_switch")
    with DeviceClient(limited.address) as c:
        c.open_session()
        c.attach(1)
        with pytest.raises(errors.DeviceError, match=r"fault_inject_opcode='dot' is a test switch.*"
                           r"--allow-test-options") as info:
            c.compile(module, fault_inject_opcode="dot")
        assert info.value.code == "PERMISSION_DENIED" and info.value.kind == "test-option-refused"
        with pytest.raises(errors.DeviceError, match=r"refuse_opcodes=\['tanh'\] is a test switch"):
            c.compile(module, refuse_opcodes=["tanh"])
        check_sgd(c, c.compile(module).executable_id)  # the session goes on
    assert not build_parser().parse_args([]).allow_test_options
    with DeviceClient(device_server) as c:
        c.open_session()
        c.attach(1)
        loss, _ = c.execute(c.compile(module, fault_inject_opcode="dot").executable_id, [X, Y, W],
                            return_updated_variables=False)
        assert not np.allclose(loss, su.sgd_reference(X, Y, W)[0], rtol=1e-3)


def test_nothing_is_pickled_or_evaluated_and_loopback_is_the_default():
    sources = [*(su.ROOT / "device_server").glob("*.py"), su.ROOT / "tf_ipu" / "client.py",
               su.ROOT / "tf_ipu" / "runtime.py", su.ROOT / "device_server" / "protocol" / "dtypes.py"]
    unsafe_modules = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
    unsafe_calls = {"eval", "exec", "compile", "__import__"}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & unsafe_modules, f"{path.name}:{node.lineno} imports {names}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in unsafe_calls, f"{path.name}:{node.lineno}: {node.func.id}()"
            if isinstance(node, ast.Attribute) and node.attr in ("loads", "load"):
                base = node.value.id if isinstance(node.value, ast.Name) else ""
                assert base in ("json", ""), f"{path.name}:{node.lineno}: {base}.{node.attr}"
    assert build_parser().parse_args([]).host == "127.0.0.1"
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


def test_code_in_the_request_is_never_run(limited, tmp_path):
    """Python in every string of a program (names, opcodes, attributes, source ops) and in
    attributes the emulator turns into code (a tuple index, a comparison direction) is data:
    compiling and running such programs writes no marker file and the server goes on."""
    marker = tmp_path / "pwned"
    payloads = [
        f"x'); open({str(marker)!r}, 'w').write('1'); ('",
        f"0]; open({str(marker)!r}, 'w').write('1'); x = [0",
        f"LT {{1}}) or open({str(marker)!r}, 'w') or ({{0}}",
        "{0.__class__.__mro__[1].__subclasses__}",
    ]
    with attached(limited.address) as c:
        for payload in payloads:
            module = su.sgd_module(name=payload)
            for comp in module.computations:
                comp.name = payload
                for instr in comp.instructions:
                    instr.name = payload + instr.name
                    instr.source_op = payload
                    instr.source_type = payload
            c.execute(c.compile(module).executable_id, [X, Y, W])  # names are only data
            for opcode, attr in (("get-tuple-element", "index"), ("compare", "direction"),
                                 (payload, "x")):
                bad = su.sgd_module(name="bad")
                instr = bad.computations[0].instructions[4]
                instr.opcode = opcode
                instr.attrs[attr].s = payload
                with pytest.raises((errors.InvalidArgumentError, errors.UnsupportedOpError)):
                    c.compile(bad)
        check_sgd(c, c.compile(su.sgd_module()).executable_id)
    assert not marker.exists()


def test_token_is_checked_from_metadata(monkeypatch):
    handle = serve(config=ServiceConfig(num_ipus=1), token="s3cret-token")
    try:
        with pytest.raises(errors.UnauthenticatedError, match="carries no token"):
            DeviceClient(handle.address, token="").open_session()
        with pytest.raises(errors.UnauthenticatedError, match="does not accept"):
            DeviceClient(handle.address, token="wrong").open_session()
        with grpc.insecure_channel(handle.address) as channel:  # health needs no token
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        monkeypatch.setenv("TF_IPU_SERVER_TOKEN", "s3cret-token")
        with attached(handle.address) as c:  # the token from the environment
            check_sgd(c, c.compile(su.sgd_module()).executable_id)
            assert c.counters()["error_kinds.unauthenticated"] == 2
    finally:
        handle.stop(grace=0.5)
    token_file = Path(f"/tmp/tf_ipu_token_{os.getpid()}")
    token_file.write_text("  from-file\n")
    try:
        assert read_token(str(token_file)) == "from-file"
    finally:
        token_file.unlink()
    assert read_token("") == "s3cret-token"


def _self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for localhost / 127.0.0.1 and its key, made with the openssl CLI (the
    venv has no ``cryptography``)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_token_and_json_logs_through_the_command_line(ipu_system, tmp_path):
    import tf_ipu

    cert, key = _self_signed_cert(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("tls-token\n")
    log = tmp_path / "server.log"
    server = su.ServerProcess.start(
        ["--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file),
         "--log-format", "json", "--log-level", "debug", "--ipus", "2"], log_path=log)
    try:
        with attached(server.address, token="tls-token", tls_ca=str(cert)) as c:
            check_sgd(c, c.compile(su.sgd_module()).executable_id)
        with pytest.raises(errors.UnauthenticatedError):
            DeviceClient(server.address, token="nope", tls_ca=cert.read_bytes()).open_session()
        with pytest.raises(errors.DeviceUnavailableError):  # plaintext to a TLS port
            DeviceClient(server.address, token="tls-token", timeout=3).open_session()
        cfg = tf_ipu.IPUConfig()  # IPUConfig passes both through to the runtime
        cfg.server_address = server.address
        cfg.server_token = "tls-token"
        cfg.server_tls_ca = str(cert)
        cfg.configure_ipu_system()
        assert tf_ipu.get_runtime().client.counters()["sessions_active"] == 1
        ipu_system.configure_ipu_system()
        server.signal(signal.SIGTERM)
        assert server.process.wait(timeout=15) == 0
        # gRPC's C core may print its own (non-JSON) lines, e.g. on the failed handshake.
        lines = log.read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        assert len(records) >= len(lines) - 5
        rpcs = [r for r in records if "method" in r]
        for r in rpcs:
            assert {"method", "session", "status", "duration_ms", "bytes_in", "bytes_out"} <= r.keys()
        by_method = {(r["method"], r["status"]) for r in rpcs}
        assert {("OpenSession", "OK"), ("Compile", "OK"), ("Execute", "OK"),
                ("OpenSession", "UNAUTHENTICATED")} <= by_method
        [execute] = [r for r in rpcs if r["method"] == "Execute"]
        assert execute["bytes_in"] > X.nbytes and execute["bytes_out"] > W.nbytes
        assert len(execute["session"]) == 8  # never the whole id: it is a credential
    finally:
        ipu_system.configure_ipu_system()
        server.kill()
        server.stop()


# -- observability ---------------------------------------------------------------------------


def test_counters_have_errors_by_kind_and_execute_latency(device_server):
    with attached(device_server) as c:
        exe = c.compile(su.sgd_module(name="latency")).executable_id
        for _ in range(20):
            check_sgd(c, exe)
        with pytest.raises(errors.NotFoundError):
            c.execute("nope", [])
        values = c.counters()
        assert values["error_kinds.unknown-executable"] >= 1
        assert values["execute_latency_count"] >= 20
        assert 0 < values["execute_latency_p50_us"] <= values["execute_latency_p99_us"]
        text = c.prometheus_text()
    assert 'tf_ipu_device_error_kinds_total{kind="unknown-executable"}' in text
    assert "# TYPE tf_ipu_device_execute_seconds histogram" in text
    assert 'tf_ipu_device_execute_seconds_bucket{le="+Inf"}' in text
    assert re.search(r'tf_ipu_device_execute_recent_seconds\{quantile="0\.99"\} [0-9.]+', text)


# -- fuzz ------------------------------------------------------------------------------------


def test_fuzz_campaign_short():
    """500 mutants over all RPCs: no crash, health SERVING, the healthy session exact.
    (The full campaign: ``python tests/fuzz_server.py --requests 10000 --seconds 600``.)"""
    import fuzz_server

    report = fuzz_server.main(["--requests", "500", "--seconds", "30", "--seed", "11"])
    assert report.ok, report.summary()
    assert report.requests == 500 and report.crashes == 0 and report.healthy_steps >= 5
    assert len(report.by_method) == 10
