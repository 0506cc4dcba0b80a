"""The device server and its client over real gRPC: sessions, IPUs, compile, execute,
resident variables, errors, leases, parent watching, health and counters.

Programs are small IR modules built by hand (``fma_module``); the expected results are
numpy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from device_server.protocol import device_pb2, device_pb2_grpc, dtypes, ir_pb2
from tf_ipu import errors
from tf_ipu.client import DeviceClient, VariableRef
from tf_ipu.local_server import start_local_server

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (2, 3)
CONST = (np.arange(6, dtype=np.float32).reshape(SHAPE) - 2.5) / 4
X = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
W = np.array([[0.5, -1, 2], [3, 0.25, -4]], dtype=np.float32)


def fma_module(name: str = "fma", shape: tuple[int, ...] = SHAPE, const: np.ndarray | None = None) -> ir_pb2.Module:
    """``(p0 * p1 + const, p1 + p0)``; output 1 is aliased to parameter 1 (a variable)."""
    const = CONST if const is None else const

    def f32() -> ir_pb2.Shape:
        return ir_pb2.Shape(dtype=ir_pb2.F32, dims=shape)

    comp = ir_pb2.Computation(id=1, name="main", root_id=6)

    def instr(id_: int, opcode: str, operands=(), shape=None, **kw) -> ir_pb2.Instruction:
        return comp.instructions.add(
            id=id_, name=f"{opcode}.{id_}", opcode=opcode, shape=shape or f32(),
            operands=list(operands), **kw,
        )

    instr(0, "parameter", parameter_number=0)
    instr(1, "parameter", parameter_number=1)
    c = instr(2, "constant")
    c.attrs["value"].literal.CopyFrom(ir_pb2.Literal(shape=f32(), data=const.astype(np.float32).tobytes()))
    instr(3, "multiply", [0, 1])
    instr(4, "add", [3, 2])
    instr(5, "add", [1, 0])
    instr(6, "tuple", [4, 5], shape=ir_pb2.Shape(is_tuple=True, tuple_shapes=[f32(), f32()]))
    return ir_pb2.Module(
        name=name, computations=[comp], entry_computation_id=1, frontend="test",
        aliases=[ir_pb2.Alias(output_index=1, parameter_number=1)],
    )


def mul_module() -> ir_pb2.Module:
    """``p0 * p1`` on f32[2, 3], nothing else."""
    shape = ir_pb2.Shape(dtype=ir_pb2.F32, dims=SHAPE)
    comp = ir_pb2.Computation(id=0, name="main", root_id=2)
    comp.instructions.add(id=0, name="x", opcode="parameter", shape=shape, parameter_number=0)
    comp.instructions.add(id=1, name="y", opcode="parameter", shape=shape, parameter_number=1)
    comp.instructions.add(id=2, name="xy", opcode="multiply", shape=shape, operands=[0, 1])
    return ir_pb2.Module(name="mul", computations=[comp], entry_computation_id=0)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(device_server):
    """A client with an open session and one ipu2 attached."""
    c = DeviceClient(device_server)
    c.open_session()
    c.attach(1, "ipu2")
    yield c
    c.close()


@pytest.fixture
def stub(device_server):
    channel = grpc.insecure_channel(device_server)
    yield device_pb2_grpc.DeviceServiceStub(channel)
    channel.close()


def free_ipus(address: str) -> int:
    with DeviceClient(address) as c:
        return c.counters()["ipus_free"]


# -- the happy path ----------------------------------------------------------------------


def test_health_is_serving_and_reflection_lists_the_service(device_server):
    with grpc.insecure_channel(device_server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tf_ipu.device.DeviceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {"tf_ipu.device.DeviceService", "grpc.health.v1.Health"} <= names


def test_compile_and_execute_match_numpy(client):
    program = client.compile(fma_module(unique("fma")))
    assert not program.cache_hit
    assert [(s.dtype, s.shape) for s in program.parameters] == [(np.dtype(np.float32), SHAPE)] * 2
    assert [(s.dtype, s.shape) for s in program.outputs] == [(np.dtype(np.float32), SHAPE)] * 2
    assert program.aliases == {1: 1}
    assert program.estimate.ipu_version == "ipu2" and program.estimate.cycles > 0
    assert program.estimate.fits and isinstance(program.estimate.report, dict)

    out, new_w = client.execute(program.executable_id, [X, W])
    np.testing.assert_allclose(out, X * W + CONST, rtol=1e-6)
    np.testing.assert_allclose(new_w, W + X, rtol=1e-6)


def test_messages_above_4_mib_pass(client):
    shape = (1024, 1100)  # 4.5 MB per array, each way
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    program = client.compile(fma_module(unique("big"), shape, np.zeros(shape, np.float32)))
    out, new_w = client.execute(program.executable_id, [x, w])
    np.testing.assert_allclose(out, x * w, rtol=1e-6)
    np.testing.assert_allclose(new_w, w + x, rtol=1e-6)


def test_resident_variables_are_updated_through_aliases(client):
    program = client.compile(fma_module())
    client.write_variables({"w": W})
    out, new_w = client.execute(program.executable_id, [X, VariableRef("w")])
    np.testing.assert_allclose(out, X * W + CONST, rtol=1e-6)
    assert new_w is None  # stayed on the device
    np.testing.assert_allclose(client.read_variables(["w"])["w"], W + X, rtol=1e-6)

    out, new_w = client.execute(program.executable_id, [X, VariableRef("w")],
                                return_updated_variables=True)
    np.testing.assert_allclose(out, X * (W + X) + CONST, rtol=1e-6)
    np.testing.assert_allclose(new_w, W + 2 * X, rtol=1e-6)
    np.testing.assert_allclose(client.read_variables(["w"])["w"], W + 2 * X, rtol=1e-6)


def test_calls_of_one_session_are_serialized(client):
    """Threads sharing a session never lose an update of the resident variable."""
    program = client.compile(fma_module())
    client.write_variables({"acc": np.zeros(SHAPE, np.float32)})
    ones = np.ones(SHAPE, np.float32)

    def work() -> None:
        for _ in range(10):
            client.execute(program.executable_id, [ones, VariableRef("acc")])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(client.read_variables(["acc"])["acc"], np.full(SHAPE, 40.0))


def test_sessions_run_concurrently_and_share_the_cache(device_server):
    module = fma_module(unique("shared"))
    results: dict[int, object] = {}

    def work(i: int) -> None:
        try:
            with DeviceClient(device_server) as c:
                c.open_session()
                c.attach(1)
                program = c.compile(module)
                for k in range(5):
                    x = X + i + k
                    out, _ = c.execute(program.executable_id, [x, W])
                    np.testing.assert_allclose(out, x * W + CONST, rtol=1e-6)
                results[i] = program.cache_hit
        except BaseException as e:  # reported below, on the test's thread
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(v, bool) for v in results.values()), results
    assert sorted(results.values()) == [False, True, True]  # compiled once


def test_cache_hit_across_sessions_but_handles_stay_private(device_server):
    module = fma_module(unique("private"))
    with DeviceClient(device_server) as a, DeviceClient(device_server) as b:
        for c in (a, b):
            c.open_session()
            c.attach(1)
        pa = a.compile(module)
        pb = b.compile(module)
        assert (pa.cache_hit, pb.cache_hit) == (False, True)
        assert pa.executable_id != pb.executable_id
        with pytest.raises(errors.NotFoundError) as info:
            b.execute(pa.executable_id, [X, W])
        assert pa.executable_id in str(info.value) and b.session_id in str(info.value)
        assert device_server in str(info.value)
        out, _ = b.execute(pb.executable_id, [X, W])
        np.testing.assert_allclose(out, X * W + CONST, rtol=1e-6)


# -- errors ------------------------------------------------------------------------------


def test_wrong_arguments_name_the_parameter(client):
    program = client.compile(fma_module())
    exe = program.executable_id
    with pytest.raises(errors.InvalidArgumentError, match=r"parameter 0 expects F32\[2, 3\], received a value of F64\[2, 3\]"):
        client.execute(exe, [X.astype(np.float64), W])
    with pytest.raises(errors.InvalidArgumentError, match=r"parameter 1 expects F32\[2, 3\], received a value of F32\[3, 2\]"):
        client.execute(exe, [X, W.T.copy()])
    with pytest.raises(errors.InvalidArgumentError, match="expected 2 parameters, received 1"):
        client.execute(exe, [X])
    client.write_variables({"v32": np.zeros(3, np.float32)})
    with pytest.raises(errors.InvalidArgumentError, match=r"parameter 1 expects F32\[2, 3\], received variable 'v32' of F32\[3\]"):
        client.execute(exe, [X, VariableRef("v32")])
    with pytest.raises(errors.NotFoundError, match="parameter 1 is bound to variable 'nope'"):
        client.execute(exe, [X, VariableRef("nope")])
    with pytest.raises(errors.NotFoundError, match="no variable 'missing'"):
        client.read_variables(["missing"])
    with pytest.raises(errors.NotFoundError, match="no executable 'feedface'"):
        client.execute("feedface", [X, W])


def test_malformed_tensor_is_invalid_argument(client, stub):
    program = client.compile(fma_module())
    bad = device_pb2.Tensor(dtype=ir_pb2.F32, dims=[2, 3], data=b"\0" * 7)
    request = device_pb2.ExecuteRequest(
        session_id=client.session_id, executable_id=program.executable_id,
        parameters=[device_pb2.ParameterBinding(value=bad),
                    device_pb2.ParameterBinding(value=dtypes.to_tensor(W))],
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Execute(request, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameter 0" in info.value.details() and "needs 24 bytes, received 7" in info.value.details()


def test_unknown_session_is_not_found(stub):
    calls = [
        ("Heartbeat", device_pb2.SessionRef(session_id="no-such-session")),
        ("AttachIpus", device_pb2.AttachIpusRequest(session_id="no-such-session", num_ipus=1)),
        ("Compile", device_pb2.CompileRequest(session_id="no-such-session", module=fma_module())),
        ("Execute", device_pb2.ExecuteRequest(session_id="no-such-session", executable_id="x")),
        ("CloseSession", device_pb2.SessionRef(session_id="no-such-session")),
    ]
    for method, request in calls:
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, method
        assert "no-such-session" in info.value.details(), method


def test_attach_errors(device_server):
    with DeviceClient(device_server) as c:
        c.open_session()
        with pytest.raises(errors.FailedPreconditionError, match="no IPUs attached"):
            c.compile(fma_module())
        with pytest.raises(errors.InvalidArgumentError,
                           match=r"1000 IPUs asked for .* this server hosts \d+: ask for at most"):
            c.attach(1000)
        with pytest.raises(errors.InvalidArgumentError, match="ipu9"):
            c.attach(1, "ipu9")
        attached = c.attach(2, "bow", tiles_per_ipu=64)
        assert (len(attached.ipu_ids), attached.ipu_version, attached.tiles_per_ipu) == (2, "bow", 64)
        with pytest.raises(errors.FailedPreconditionError, match="already has IPUs"):
            c.attach(1)
        assert c.compile(fma_module()).estimate.tiles_per_ipu == 64
        c.detach()
        with pytest.raises(errors.FailedPreconditionError):
            c.compile(fma_module())


def test_refused_opcode_is_unimplemented(client):
    with pytest.raises(errors.UnsupportedOpError, match="multiply") as info:
        client.compile(fma_module(), refuse_opcodes=["multiply"])
    assert info.value.grpc_code == 12


def _mutations() -> list[tuple[str, ir_pb2.Module]]:
    out = []

    def mutant(what: str, change) -> None:
        m = fma_module()
        change(m)
        out.append((what, m))

    mutant("operand id that does not exist", lambda m: m.computations[0].instructions[3].operands.__setitem__(1, 99))
    mutant("root id that does not exist", lambda m: setattr(m.computations[0], "root_id", 42))
    mutant("entry computation that does not exist", lambda m: setattr(m, "entry_computation_id", 7))
    mutant("no computations", lambda m: m.ClearField("computations"))
    mutant("constant with short data", lambda m: setattr(
        m.computations[0].instructions[2].attrs["value"].literal, "data", b"\0" * 5))
    mutant("add of mismatched shapes", lambda m: m.computations[0].instructions[1].shape.dims.__setitem__(0, 5))
    mutant("alias to a missing output", lambda m: setattr(m.aliases[0], "output_index", 9))
    # Found by tests/fuzz_server.py --seed 20261202 (answered INTERNAL "Value out of range"
    # when the estimate's bytes overflowed int64): a shape with a negative dimension.
    mutant("negative dimension", lambda m: m.computations[0].instructions[3].shape.dims.__setitem__(0, -(1 << 63)))
    return out


@pytest.mark.parametrize("what,module", _mutations(), ids=[w for w, _ in _mutations()])
def test_mutated_module_is_invalid_argument(client, what, module):
    with pytest.raises(errors.InvalidArgumentError) as info:
        client.compile(module)
    if what == "negative dimension":
        assert "dimension 0 of its shape is -9223372036854775808" in str(info.value)



def test_garbage_request_is_refused_and_server_keeps_serving(client, device_server):
    with grpc.insecure_channel(device_server) as channel:
        raw = channel.unary_unary("/tf_ipu.device.DeviceService/Compile")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\x0a\x05ab", timeout=5)  # a length-delimited field cut short
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid CompileRequest" in info.value.details()
    program = client.compile(fma_module())
    out, _ = client.execute(program.executable_id, [X, W])
    np.testing.assert_allclose(out, X * W + CONST, rtol=1e-6)


# -- leases, counters, reachability ------------------------------------------------------


def test_expired_lease_frees_ipus_and_heartbeat_keeps_it(device_server, stub):
    before = free_ipus(device_server)
    session = stub.OpenSession(device_pb2.OpenSessionRequest(client_name="silent", lease_seconds=0.5),
                               timeout=5).session_id
    stub.AttachIpus(device_pb2.AttachIpusRequest(session_id=session, num_ipus=2), timeout=5)
    with DeviceClient(device_server) as alive:
        alive.open_session(lease_seconds=1.0)  # its heartbeat renews it every ~0.33 s
        alive.attach(1)
        assert free_ipus(device_server) == before - 3
        deadline = time.monotonic() + 5
        while free_ipus(device_server) != before - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert free_ipus(device_server) == before - 1  # only the silent session was reaped
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(device_pb2.SessionRef(session_id=session), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        out, _ = alive.execute(alive.compile(fma_module()).executable_id, [X, W])
        np.testing.assert_allclose(out, X * W + CONST, rtol=1e-6)
    assert free_ipus(device_server) == before


def test_counters_move(client):
    before = client.counters()
    program = client.compile(fma_module())
    client.execute(program.executable_id, [X, W])
    with pytest.raises(errors.InvalidArgumentError):
        client.execute(program.executable_id, [X])
    after = client.counters()
    assert after["executions"] == before["executions"] + 1
    assert after["compile_requests"] == before["compile_requests"] + 1
    assert after["cache_hits"] + after["compiles"] > before["cache_hits"] + before["compiles"]
    assert after["bytes_in"] >= before["bytes_in"] + 2 * X.nbytes
    assert after["bytes_out"] >= before["bytes_out"] + 2 * X.nbytes
    assert after["errors.INVALID_ARGUMENT"] == before.get("errors.INVALID_ARGUMENT", 0) + 1
    assert after["sessions_opened"] >= 1 and after["rpcs.Execute"] >= 2
    text = client.prometheus_text()
    assert f"tf_ipu_device_executions_total {after['executions']}" in text
    assert 'tf_ipu_device_errors_total{code="INVALID_ARGUMENT"}' in text


def test_unreachable_server_is_unavailable_quickly():
    start = time.monotonic()
    with pytest.raises(errors.DeviceUnavailableError, match="127.0.0.1:1"):
        DeviceClient("127.0.0.1:1").open_session()  # refused
    with pytest.raises(errors.DeviceUnavailableError, match="10.255.255.1:9"):
        DeviceClient("10.255.255.1:9", timeout=1.5).open_session()  # unroutable or silent
    with pytest.raises(errors.DeviceUnavailableError, match="127.0.0.1:1"):
        DeviceClient("127.0.0.1:1").wait_for_server(1.0)
    assert time.monotonic() - start < 10


# -- the server process ------------------------------------------------------------------


def test_server_flags_and_parent_pid(tmp_path):
    """Server-side --refuse-opcode and --fault-inject apply to every compile; the server
    exits once its --parent-pid is gone."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [sys.executable, "-m", "device_server", "--port", "0", "--port-file", str(port_file),
         "--parent-pid", str(parent.pid), "--ipus", "1", "--refuse-opcode", "add",
         "--fault-inject", "multiply", "--log-level", "warning"],
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.02)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        with DeviceClient(address) as c:
            c.open_session()
            c.attach(1)
            with pytest.raises(errors.UnsupportedOpError, match="add"):
                c.compile(fma_module())
            [xy] = c.execute(c.compile(mul_module()).executable_id, [X, W])
            assert not np.allclose(xy, X * W)  # perturbed
        parent.kill()
        parent.wait()
        assert server.wait(timeout=5) == 0
    finally:
        parent.kill()
        server.kill()
        server.wait()
        server.stderr.close()


def test_local_server_failure_shows_its_stderr():
    with pytest.raises(errors.DeviceUnavailableError, match="Unknown IPU target 'ipu9'"):
        start_local_server(ipu_version="ipu9")


def test_device_server_does_not_import_tensorflow():
    code = ("import sys, device_server.cli, device_server.server; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'tensorflow']")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
