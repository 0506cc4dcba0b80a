"""Fuzz campaign against a device server: malformed and mutated requests on every RPC.

    python tests/fuzz_server.py --requests 10000 --seconds 600 [--seed 0] [--address host:port]

Starts its own server (``python -m device_server``, 4 IPUs) unless ``--address`` names one.
A *fuzz session* supplies a corpus of valid serialized requests for all ten RPCs (its own
session id, executable handles and variables, so mutants reach deep into the handlers); each
request sent is a mutant of one of them:

- byte mutations (bit flips, special bytes, insertions, deletions, truncation, duplicated
  chunks, splices of two requests, appended fields with absurd lengths): many no longer
  decode, which exercises the server's refusal of undecodable messages;
- structured mutations (a random field anywhere in the message, nested IR included, set to
  an extreme value: negative or huge dims and ids, unknown enum values, NaN and infinite
  floats, long strings, truncated bytes, emptied or duplicated repeated fields).

They travel as raw bytes through a generic channel method, so nothing on the client side
validates them. Every so often the campaign checks that the server process is alive, that
its health service says SERVING, and that a *healthy session* beside the fuzzed one still
trains a small model step by step with the same results as numpy. The fuzz session is
re-made whenever a mutant closed or detached it. Exit code 0 if the server never crashed and
the healthy session never saw a wrong result; the summary counts statuses and lists the
distinct INTERNAL messages (faults the server caught but did not map to a better status).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import server_util as su  # noqa: E402
from google.protobuf.descriptor import FieldDescriptor  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from device_server.protocol import device_pb2, dtypes, ir_pb2  # noqa: E402

SERVICE = "tf_ipu.device.DeviceService"
CALL_TIMEOUT = 3.0
CHECK_EVERY = 100          # requests between liveness/health/healthy-session checks
REPAIR_EVERY = 20          # requests between checks that the fuzz session still works
_EXTREME_INTS = [0, 1, -1, 2, 7, 255, 2**31 - 1, -(2**31), 2**32, 2**62, 2**63 - 1, -(2**63)]
_EXTREME_FLOATS = [0.0, -0.0, 1e-300, -1.0, 1e300, math.inf, -math.inf, math.nan]


# -- mutations -------------------------------------------------------------------------------


def mutate_bytes(data: bytes, rng: random.Random, other: bytes) -> bytes:
    """One random byte-level mutation of ``data`` (``other``: a request to splice with)."""
    b = bytearray(data)
    op = rng.randrange(9)
    if op == 0 and b:  # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and b:  # special byte values
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x01, 0x0A, 0x12])
    elif op == 2:  # insert random bytes
        i = rng.randint(0, len(b))
        b[i:i] = rng.randbytes(rng.randint(1, 16))
    elif op == 3 and b:  # delete a range
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 32)]
    elif op == 4 and b:  # truncate
        del b[rng.randrange(len(b)):]
    elif op == 5 and b:  # duplicate a chunk
        i = rng.randrange(len(b))
        j = min(len(b), i + rng.randint(1, 64))
        b[j:j] = b[i:j]
    elif op == 6:  # splice with another request
        i, j = rng.randint(0, len(b)), rng.randint(0, len(other))
        b = b[:i] + bytearray(other[j:])
    elif op == 7:  # a length-delimited field that claims far more bytes than follow
        field_no = rng.randint(1, 20)
        b += bytes([(field_no << 3) | 2]) + rng.choice(
            [b"\xff\xff\xff\xff\x0f", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x7f"])
    else:  # a varint field with an overlong or extreme value
        field_no = rng.randint(1, 20)
        b += bytes([field_no << 3]) + rng.choice(
            [b"\xff" * 10 + b"\x01", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x80"])
    return bytes(b)


def _fields(message: Any, depth: int = 0) -> list[tuple[Any, FieldDescriptor]]:
    """Every (message, field) pair reachable in ``message`` (set sub-messages only)."""
    out = [(message, f) for f in message.DESCRIPTOR.fields]
    if depth > 12:
        return out
    for f in message.DESCRIPTOR.fields:
        if f.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if f.message_type.GetOptions().map_entry:
            for value in getattr(message, f.name).values():
                if hasattr(value, "DESCRIPTOR"):
                    out += _fields(value, depth + 1)
        elif f.is_repeated:
            for item in getattr(message, f.name):
                out += _fields(item, depth + 1)
        elif message.HasField(f.name):
            out += _fields(getattr(message, f.name), depth + 1)
    return out


def _scalar(f: FieldDescriptor, rng: random.Random) -> Any:
    t = f.type
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rng.choice(_EXTREME_FLOATS) if t == FieldDescriptor.TYPE_DOUBLE else rng.choice(
            [0.0, -1.0, 1e30, math.inf, math.nan])
    if t == FieldDescriptor.TYPE_STRING:
        return rng.choice(["", "x", "\u00e9\u4e2d", "A" * 5000, "while", "add", "F32",
                           "../../etc/passwd", "%s%n", "\x00"])
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.choice([b"", b"\x00", rng.randbytes(rng.randint(1, 64)), b"\xff" * 3])
    if t == FieldDescriptor.TYPE_ENUM:
        return rng.choice([v.number for v in f.enum_type.values] + [-1, 99, 2**31 - 1])
    bits = 32 if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
                       FieldDescriptor.TYPE_SFIXED32) else 64
    unsigned = t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64,
                     FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64)
    lo, hi = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return min(hi, max(lo, rng.choice(_EXTREME_INTS + [rng.randint(-3, 40)])))


def mutate_structure(request: Any, rng: random.Random) -> bytes:
    """One field anywhere in ``request`` set to an extreme value; returns the bytes."""
    msg = type(request)()
    msg.CopyFrom(request)
    pairs = _fields(msg)
    if not pairs:
        return msg.SerializeToString()
    holder, f = rng.choice(pairs)
    try:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            value = getattr(holder, f.name)
            if f.message_type.GetOptions().map_entry:
                value.clear()
            elif f.is_repeated:
                if len(value) and rng.random() < 0.5:
                    del value[rng.randrange(len(value))]
                elif len(value):
                    value.add().CopyFrom(value[rng.randrange(len(value))])
                else:
                    value.add()
            else:
                holder.ClearField(f.name)
        elif f.is_repeated:
            value = getattr(holder, f.name)
            if len(value) and rng.random() < 0.4:
                value[rng.randrange(len(value))] = _scalar(f, rng)
            elif len(value) and rng.random() < 0.5:
                del value[rng.randrange(len(value)):]
            else:
                value.extend([_scalar(f, rng) for _ in range(rng.randint(1, 4))])
        elif f.containing_oneof is not None and rng.random() < 0.3:
            holder.ClearField(f.name)
        else:
            setattr(holder, f.name, _scalar(f, rng))
    except (ValueError, TypeError):  # a value the field cannot hold: mutate bytes instead
        pass
    return msg.SerializeToString()


# -- the two sessions ------------------------------------------------------------------------


class Raw:
    """Sends raw bytes to any method of the service."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._methods = {name: channel.unary_unary(f"/{SERVICE}/{name}") for name in METHODS}

    def call(self, method: str, data: bytes, timeout: float = CALL_TIMEOUT) -> tuple[str, bytes, str]:
        """(status name, reply bytes, details)."""
        try:
            return "OK", self._methods[method](data, timeout=timeout), ""
        except grpc.RpcError as e:
            return e.code().name, b"", e.details() or ""


METHODS = ["OpenSession", "CloseSession", "Heartbeat", "AttachIpus", "DetachIpus", "Compile",
           "WriteVariables", "ReadVariables", "Execute", "GetCounters"]


def _tensor(a: np.ndarray) -> device_pb2.Tensor:
    return dtypes.to_tensor(np.asarray(a))


def mul_module() -> ir_pb2.Module:
    """``(p0 * p1, p0 + p1)`` on f32[2, 3]."""
    m = ir_pb2.Module(name="mul", entry_computation_id=0, frontend="fuzz")
    b = su.Builder(m, 0, "main")
    x = b.parameter(su.array_shape(np.float32, [2, 3]))
    y = b.parameter(su.array_shape(np.float32, [2, 3]))
    b.root(b.tuple([b.op("multiply", [x, y]), b.op("add", [x, y])]))
    return m


class FuzzSession:
    """The fuzzed session and its corpus of valid requests, by method."""

    def __init__(self, raw: Raw) -> None:
        self.raw = raw
        self.corpus: dict[str, list[Any]] = {}
        self.session_id = ""
        self.remakes = 0

    def make(self) -> None:
        """Opens a session (30 s lease), attaches one IPU, compiles, writes; builds the
        corpus. Raises RuntimeError if the server will not do it."""
        status, reply, details = self.raw.call("OpenSession", device_pb2.OpenSessionRequest(
            client_name="fuzz", lease_seconds=30).SerializeToString())
        if status != "OK":
            raise RuntimeError(f"OpenSession: {status} {details}")
        sid = device_pb2.OpenSessionReply.FromString(reply).session_id
        self.session_id = sid
        self._attach()
        rng = np.random.default_rng(1)
        x, y = rng.standard_normal((16, 8), np.float32), rng.standard_normal((16, 1), np.float32)
        w = np.zeros((8, 1), np.float32)
        modules = [su.sgd_module(), mul_module()]
        handles = [self._compile(m) for m in modules]
        self._check("WriteVariables", device_pb2.WriteVariablesRequest(
            session_id=sid, variables=[device_pb2.NamedTensor(key="w", tensor=_tensor(w))]))
        ref = device_pb2.SessionRef(session_id=sid)
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        self.corpus = {
            "OpenSession": [device_pb2.OpenSessionRequest(client_name="fuzz-x", lease_seconds=1.0)],
            "CloseSession": [ref],
            "Heartbeat": [ref],
            "AttachIpus": [device_pb2.AttachIpusRequest(session_id=sid, num_ipus=1,
                                                        ipu_version="ipu2", tiles_per_ipu=16,
                                                        wait_seconds=0.2)],
            "DetachIpus": [ref],
            "Compile": [device_pb2.CompileRequest(session_id=sid, module=m) for m in modules]
            + [device_pb2.CompileRequest(session_id=sid, module=modules[0], options=device_pb2.CompileOptions(
                allow_out_of_memory=True, refuse_opcodes=["tanh"], fault_inject_opcode="dot"))],
            "WriteVariables": [device_pb2.WriteVariablesRequest(session_id=sid, variables=[
                device_pb2.NamedTensor(key="w", tensor=_tensor(w)),
                device_pb2.NamedTensor(key="v", tensor=_tensor(np.arange(5, dtype=np.int32)))])],
            "ReadVariables": [device_pb2.ReadVariablesRequest(session_id=sid, keys=["w"])],
            "Execute": [
                device_pb2.ExecuteRequest(session_id=sid, executable_id=handles[0], parameters=[
                    device_pb2.ParameterBinding(value=_tensor(x)),
                    device_pb2.ParameterBinding(value=_tensor(y)),
                    device_pb2.ParameterBinding(variable_key="w")], return_updated_variables=True),
                device_pb2.ExecuteRequest(session_id=sid, executable_id=handles[1], parameters=[
                    device_pb2.ParameterBinding(value=_tensor(a)),
                    device_pb2.ParameterBinding(value=_tensor(a))]),
            ],
            "GetCounters": [device_pb2.Empty()],
        }

    def _check(self, method: str, request: Any) -> bytes:
        status, reply, details = self.raw.call(method, request.SerializeToString(), timeout=30)
        if status != "OK":
            raise RuntimeError(f"{method}: {status} {details}")
        return reply

    def _attach(self) -> None:
        self._check("AttachIpus", device_pb2.AttachIpusRequest(
            session_id=self.session_id, num_ipus=1, tiles_per_ipu=16, wait_seconds=5))

    def _compile(self, module: ir_pb2.Module) -> str:
        reply = self._check("Compile", device_pb2.CompileRequest(session_id=self.session_id, module=module))
        return device_pb2.CompileReply.FromString(reply).executable_id

    def repair(self) -> None:
        """Re-makes the session if a mutant closed it, detached it or dropped its handles."""
        probe = self.corpus["Execute"][1].SerializeToString()
        status, _, _ = self.raw.call("Execute", probe, timeout=30)
        if status != "OK":
            self.raw.call("CloseSession", device_pb2.SessionRef(
                session_id=self.session_id).SerializeToString())
            self.remakes += 1
            self.make()


class HealthySession:
    """A session beside the fuzzed one that trains ``sgd_module`` and checks every result
    against numpy."""

    def __init__(self, raw: Raw) -> None:
        self.raw = raw
        self.steps = 0
        status, reply, details = raw.call("OpenSession", device_pb2.OpenSessionRequest(
            client_name="healthy", lease_seconds=60).SerializeToString(), timeout=30)
        if status != "OK":
            raise RuntimeError(f"healthy OpenSession: {status} {details}")
        self.sid = device_pb2.OpenSessionReply.FromString(reply).session_id
        self._ok("AttachIpus", device_pb2.AttachIpusRequest(session_id=self.sid, num_ipus=1))
        reply = self._ok("Compile", device_pb2.CompileRequest(session_id=self.sid, module=su.sgd_module()))
        self.exe = device_pb2.CompileReply.FromString(reply).executable_id
        rng = np.random.default_rng(7)
        self.x = rng.standard_normal((16, 8)).astype(np.float32)
        self.y = (self.x @ rng.standard_normal((8, 1))).astype(np.float32)
        self.w = np.zeros((8, 1), np.float32)
        self._ok("WriteVariables", device_pb2.WriteVariablesRequest(
            session_id=self.sid, variables=[device_pb2.NamedTensor(key="w", tensor=_tensor(self.w))]))

    def _ok(self, method: str, request: Any) -> bytes:
        status, reply, details = self.raw.call(method, request.SerializeToString(), timeout=30)
        if status != "OK":
            raise AssertionError(f"healthy session: {method} -> {status}: {details}")
        return reply

    def step(self) -> None:
        """One training step; asserts it matches numpy (and the variable stayed put)."""
        request = device_pb2.ExecuteRequest(session_id=self.sid, executable_id=self.exe, parameters=[
            device_pb2.ParameterBinding(value=_tensor(self.x)),
            device_pb2.ParameterBinding(value=_tensor(self.y)),
            device_pb2.ParameterBinding(variable_key="w")], return_updated_variables=True)
        reply = device_pb2.ExecuteReply.FromString(self._ok("Execute", request))
        loss, new_w = (dtypes.from_tensor(t) for t in reply.outputs)
        ref_loss, ref_w = su.sgd_reference(self.x, self.y, self.w)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-4, err_msg="healthy session: loss")
        np.testing.assert_allclose(new_w, ref_w, rtol=1e-4, atol=1e-6, err_msg="healthy session: w")
        self.w = np.array(new_w)
        self.steps += 1


# -- the campaign ----------------------------------------------------------------------------


@dataclass
class Report:
    requests: int = 0
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    by_method: Counter = field(default_factory=Counter)
    internal: Counter = field(default_factory=Counter)
    slow: Counter = field(default_factory=Counter)  # mutants not answered within CALL_TIMEOUT
    server_peak_rss: int = 0  # bytes (VmHWM), when the campaign started the server itself
    checks: int = 0
    healthy_steps: int = 0
    fuzz_session_remakes: int = 0
    crashes: int = 0
    failure: str = ""

    @property
    def ok(self) -> bool:
        return not self.crashes and not self.failure

    def summary(self) -> str:
        lines = [
            f"fuzz: {self.requests} requests in {self.seconds:.1f} s "
            f"({self.requests / max(self.seconds, 1e-9):.0f}/s), crashes {self.crashes}, "
            f"health/healthy-session checks {self.checks}, healthy steps {self.healthy_steps}, "
            f"fuzz session re-made {self.fuzz_session_remakes} times",
            "  statuses: " + ", ".join(f"{k} {v}" for k, v in self.statuses.most_common()),
            "  methods: " + ", ".join(f"{k} {v}" for k, v in sorted(self.by_method.items())),
        ]
        if self.server_peak_rss:
            lines.append(f"  server peak resident memory: {self.server_peak_rss / 2**20:,.0f} MiB")
        if self.slow:
            lines.append(f"  not answered within {CALL_TIMEOUT:.0f} s: "
                         + ", ".join(f"{k} {v}" for k, v in self.slow.most_common()))
        if self.internal:
            lines.append(f"  INTERNAL ({sum(self.internal.values())}, distinct {len(self.internal)}):")
            lines += [f"    {n} x {msg}" for msg, n in self.internal.most_common(20)]
        if self.failure:
            lines.append(f"  FAILED: {self.failure}")
        return "\n".join(lines)


def campaign(address: str, requests: int, seconds: float, seed: int,
             alive: Any = lambda: True, progress: bool = False, save: str = "") -> Report:
    """Sends up to ``requests`` mutants within ``seconds`` to the server at ``address``.

    Args:
        alive: returns whether the server process still runs (for a server we started).
        save: a folder to write each mutant answered with INTERNAL to (``<method>-<n>.bin``).
    """
    rng = random.Random(seed)
    report = Report()
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    health = health_pb2_grpc.HealthStub(channel)
    raw = Raw(channel)
    start = time.monotonic()
    try:
        healthy = HealthySession(raw)
        fuzz = FuzzSession(raw)
        fuzz.make()

        def check() -> None:
            report.checks += 1
            if not alive():
                report.crashes += 1
                raise AssertionError("the server process is gone")
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                raise AssertionError(f"health says {status}")
            healthy.step()

        check()
        while report.requests < requests and time.monotonic() - start < seconds:
            method = rng.choice(METHODS)
            base = rng.choice(fuzz.corpus[method])
            data = base.SerializeToString()
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                if rng.random() < 0.5:
                    other = rng.choice(fuzz.corpus[rng.choice(METHODS)]).SerializeToString()
                    data = mutate_bytes(data, rng, other)
                else:
                    try:
                        base = type(base).FromString(data)
                    except Exception:  # already undecodable: keep mutating bytes
                        data = mutate_bytes(data, rng, data)
                        continue
                    data = mutate_structure(base, rng)
            status, _, details = raw.call(method, data)
            report.requests += 1
            report.statuses[status] += 1
            report.by_method[method] += 1
            if status == "DEADLINE_EXCEEDED":  # the server took > CALL_TIMEOUT over it
                report.slow[method] += 1
                if save:
                    Path(save).mkdir(parents=True, exist_ok=True)
                    (Path(save) / f"slow-{method}-{report.requests}.bin").write_bytes(data)
            if status == "INTERNAL":
                report.internal[f"{method}: {details[:160]}"] += 1
                if save:
                    Path(save).mkdir(parents=True, exist_ok=True)
                    (Path(save) / f"{method}-{report.requests}.bin").write_bytes(data)
            if status == "UNAVAILABLE" and not alive():
                report.crashes += 1
                raise AssertionError(f"the server died on a {method} mutant")
            if report.requests % REPAIR_EVERY == 0:
                fuzz.repair()
            if report.requests % CHECK_EVERY == 0:
                check()
                if progress:
                    print(f"  {report.requests} requests, {time.monotonic() - start:.0f} s",
                          file=sys.stderr)
        check()
    except (AssertionError, RuntimeError) as e:
        report.failure = str(e)
    finally:
        report.seconds = time.monotonic() - start
        report.healthy_steps = healthy.steps if "healthy" in locals() else 0
        report.fuzz_session_remakes = fuzz.remakes if "fuzz" in locals() else 0
        channel.close()
    return report


def _peak_rss(pid: int) -> int:
    """A process's peak resident memory in bytes (Linux's VmHWM), or 0."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description="Fuzz a tf_ipu device server.")
    p.add_argument("--requests", type=int, default=10_000, help="mutants to send (default 10000)")
    p.add_argument("--seconds", type=float, default=600.0, help="time bound (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default="", help="fuzz this server instead of starting one")
    p.add_argument("--progress", action="store_true", help="print progress to stderr")
    p.add_argument("--save-internal", default="", metavar="DIR",
                   help="write the mutants answered with INTERNAL, or not answered in time, "
                        "to this folder")
    args = p.parse_args(argv)
    server = None
    if args.address:
        address, alive = args.address, (lambda: True)
    else:
        # Test switches allowed, so that the mutants' fault_inject_opcode and refuse_opcodes
        # reach the compiler (a server's refusal of them is tested in test_server_service.py).
        server = su.ServerProcess.start(["--ipus", "4", "--log-level", "error", "--allow-test-options",
                                         "--max-session-bytes", str(256 << 20)])
        address, alive = server.address, server.alive
    try:
        report = campaign(address, args.requests, args.seconds, args.seed, alive, args.progress,
                          args.save_internal)
    finally:
        if server is not None:
            if server.alive():
                report.server_peak_rss = _peak_rss(server.process.pid)
                server.stop()
            else:
                report.crashes = max(report.crashes, 1)
                print(server.log_tail(), file=sys.stderr)
    print(report.summary())
    return report


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
