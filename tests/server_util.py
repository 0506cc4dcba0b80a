"""Helpers for the device server's service tests, its fuzz campaign and its load benchmark:
small IR programs built by hand (no TensorFlow needed) and standalone server processes.

    module = sgd_module(batch=16, dim=8)           # a training-like step, w resident
    server = ServerProcess.start(["--ipus", "2"])  # python -m device_server on a free port
    ...
    server.kill()                                  # SIGKILL; .restart() on the same port
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from device_server.protocol import dtypes, ir_pb2

ROOT = Path(__file__).resolve().parents[1]


# -- hand-built IR programs ----------------------------------------------------------------


class Builder:
    """Builds one computation of a module (the entry, or one it calls)."""

    def __init__(self, module: ir_pb2.Module, comp_id: int, name: str) -> None:
        self.module = module
        self.comp = module.computations.add(id=comp_id, name=name)
        self._params = 0

    def _add(self, opcode: str, operands: Sequence[int], shape: ir_pb2.Shape, **attrs: object) -> int:
        iid = len(self.comp.instructions)
        instr = self.comp.instructions.add(
            id=iid, name=f"{self.comp.name}.{opcode}.{iid}", opcode=opcode,
            operands=list(operands), shape=shape,
        )
        for key, value in attrs.items():
            if isinstance(value, np.ndarray):
                instr.attrs[key].literal.CopyFrom(literal(value))
            elif isinstance(value, str):
                instr.attrs[key].s = value
            elif isinstance(value, int):
                instr.attrs[key].i = value
            else:
                instr.attrs[key].ints.values.extend(value)
                instr.attrs[key].ints.SetInParent()
        return iid

    def shape(self, iid: int) -> ir_pb2.Shape:
        return self.comp.instructions[iid].shape

    def parameter(self, shape: ir_pb2.Shape) -> int:
        iid = self._add("parameter", [], shape)
        self.comp.instructions[iid].parameter_number = self._params
        self._params += 1
        return iid

    def unpack(self, state: ir_pb2.Shape) -> list[int]:
        """A tuple parameter of shape ``state``, and one get-tuple-element per element."""
        p = self.parameter(state)
        return [self.op("get-tuple-element", [p], e, index=k) for k, e in enumerate(state.tuple_shapes)]

    def constant(self, value: np.ndarray) -> int:
        return self._add("constant", [], array_shape(value.dtype, value.shape), value=value)

    def op(self, opcode: str, operands: Sequence[int], shape: ir_pb2.Shape | None = None,
           called: Sequence[int] = (), **attrs: object) -> int:
        """An instruction; its shape is its first operand's unless given."""
        iid = self._add(opcode, operands, shape or self.shape(operands[0]), **attrs)
        self.comp.instructions[iid].called_computations.extend(called)
        return iid

    def dot(self, lhs: int, rhs: int, lc: int, rc: int, dims: Sequence[int]) -> int:
        return self.op("dot", [lhs, rhs], array_shape(np.float32, dims),
                       lhs_contracting_dimensions=[lc], rhs_contracting_dimensions=[rc],
                       lhs_batch_dimensions=[], rhs_batch_dimensions=[])

    def tuple(self, elements: Sequence[int]) -> int:
        shape = ir_pb2.Shape(is_tuple=True, tuple_shapes=[self.shape(e) for e in elements])
        return self.op("tuple", elements, shape)

    def root(self, iid: int) -> None:
        self.comp.root_id = iid


def array_shape(dtype: object, dims: Sequence[int]) -> ir_pb2.Shape:
    return ir_pb2.Shape(dtype=dtypes.from_numpy(np.dtype(dtype)), dims=list(dims))


def literal(value: np.ndarray) -> ir_pb2.Literal:
    a = np.asarray(value, order="C")
    return ir_pb2.Literal(shape=array_shape(a.dtype, a.shape), data=a.tobytes())


def sgd_module(batch: int = 16, dim: int = 8, lr: float = 0.05, name: str = "sgd") -> ir_pb2.Module:
    """One step of least-squares regression by SGD, a training step in miniature.

    Parameters ``x: f32[batch, dim]``, ``y: f32[batch, 1]``, ``w: f32[dim, 1]`` (resident);
    outputs ``(loss: f32[1, 1], new w)`` with output 1 aliased to parameter 2.
    """
    m = ir_pb2.Module(name=name, entry_computation_id=0, frontend="test")
    b = Builder(m, 0, "main")
    x = b.parameter(array_shape(np.float32, [batch, dim]))
    y = b.parameter(array_shape(np.float32, [batch, 1]))
    w = b.parameter(array_shape(np.float32, [dim, 1]))
    err = b.op("subtract", [b.dot(x, w, 1, 0, [batch, 1]), y])
    grad = b.dot(x, err, 0, 0, [dim, 1])
    scale = b.op("broadcast", [b.constant(np.array(lr / batch, np.float32))],
                 array_shape(np.float32, [dim, 1]), dimensions=[])
    new_w = b.op("subtract", [w, b.op("multiply", [grad, scale])])
    loss = b.dot(err, err, 0, 0, [1, 1])
    b.root(b.tuple([loss, new_w]))
    m.aliases.add(output_index=1, parameter_number=2)
    return m


def sgd_reference(x: np.ndarray, y: np.ndarray, w: np.ndarray, lr: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """numpy's (loss, new w) for ``sgd_module``."""
    err = x @ w - y
    return err.T @ err, w - (x.T @ err) * np.float32(lr / x.shape[0])


def _count_condition(m: ir_pb2.Module, state: ir_pb2.Shape, comp_id: int = 1) -> Builder:
    """Computation ``comp_id``: a loop condition ``state[0] < state[2]`` (s32 counters)."""
    pred = array_shape(np.bool_, [])
    cond = Builder(m, comp_id, "cond")
    i, _, n, *_ = cond.unpack(state)
    cond.root(cond.op("compare", [i, n], pred, direction="LT", compare_type="SIGNED"))
    return cond


def loop_module(dim: int = 32, name: str = "loop") -> ir_pb2.Module:
    """A program whose run time the caller picks: ``n`` times ``x = tanh(x @ W)``.

    Parameters ``n: s32[]``, ``x: f32[dim, dim]``; output the final ``x``.
    """
    m = ir_pb2.Module(name=name, entry_computation_id=0, frontend="test")
    s32, mat = array_shape(np.int32, []), array_shape(np.float32, [dim, dim])
    state = ir_pb2.Shape(is_tuple=True, tuple_shapes=[s32, mat, s32])

    _count_condition(m, state)

    body = Builder(m, 2, "body")
    i, x, n = body.unpack(state)
    one = body.constant(np.array(1, np.int32))
    weights = np.eye(dim, dtype=np.float32) * 0.9 + 0.01
    xw = body.dot(x, body.constant(weights), 1, 0, [dim, dim])
    body.root(body.tuple([body.op("add", [i, one]), body.op("tanh", [xw]), n]))

    main = Builder(m, 0, "main")
    n = main.parameter(s32)
    x = main.parameter(mat)
    init = main.tuple([main.constant(np.array(0, np.int32)), x, n])
    loop = main.op("while", [init], state, called=[1, 2])
    main.root(main.op("get-tuple-element", [loop], mat, index=1))
    # The entry computation comes first in the module, as the converter writes it.
    m.computations.sort(key=lambda c: c.id)
    return m


def _steps_and_weights(m: ir_pb2.Module, main: Builder, loop: int,
                       device_loop: bool = True) -> ir_pb2.Module:
    """Finishes a module whose loop state starts (steps: s32, w): outputs (steps, new w) with
    w aliased to parameter 0; ``device_loop`` names the loop as tf_ipu's step loop."""
    if device_loop:
        main.comp.instructions[loop].source_op = "tf_ipu_device_loop"
    shapes = main.shape(loop).tuple_shapes
    main.root(main.tuple([main.op("get-tuple-element", [loop], shapes[0], index=0),
                          main.op("get-tuple-element", [loop], shapes[1], index=1)]))
    m.aliases.add(output_index=1, parameter_number=0)
    m.computations.sort(key=lambda c: c.id)  # the entry first, as the converter writes it
    return m


def steps_module(dim: int = 64, device_loop: bool = True, name: str = "steps") -> ir_pb2.Module:
    """A device loop in miniature: up to ``n`` steps of ``w = w + 1``, each step spinning an
    inner loop 5 times, or forever from step ``stall`` on (a ``while`` that never ends).

    Parameters ``w: f32[dim]`` (resident), ``n: s32[]``, ``stall: s32[]``; outputs
    ``(steps run: s32[], new w)`` with output 1 aliased to parameter 0. ``device_loop``
    names the outer loop as tf_ipu's Keras integration names its step loop.
    """
    m = ir_pb2.Module(name=name, entry_computation_id=0, frontend="test")
    s32, vec, pred = array_shape(np.int32, []), array_shape(np.float32, [dim]), array_shape(np.bool_, [])
    state = ir_pb2.Shape(is_tuple=True, tuple_shapes=[s32, vec, s32, s32])  # i, w, n, stall
    inner = ir_pb2.Shape(is_tuple=True, tuple_shapes=[s32, s32, s32])      # j, i, stall

    _count_condition(m, state)

    icond = Builder(m, 3, "inner_cond")
    j, i, stall = icond.unpack(inner)
    short = icond.op("compare", [j, icond.constant(np.array(5, np.int32))], pred,
                     direction="LT", compare_type="SIGNED")
    stuck = icond.op("compare", [i, stall], pred, direction="GE", compare_type="SIGNED")
    icond.root(icond.op("or", [short, stuck]))

    ibody = Builder(m, 4, "inner_body")
    j, i, stall = ibody.unpack(inner)
    ibody.root(ibody.tuple([ibody.op("add", [j, ibody.constant(np.array(1, np.int32))]), i, stall]))

    body = Builder(m, 2, "body")
    i, w, n, stall = body.unpack(state)
    spin = body.op("while", [body.tuple([body.constant(np.array(0, np.int32)), i, stall])],
                   inner, called=[3, 4])
    j = body.op("get-tuple-element", [spin], s32, index=0)
    one = body.op("broadcast", [body.op("convert", [j], array_shape(np.float32, []))], vec,
                  dimensions=[])
    five = body.op("broadcast", [body.constant(np.array(5, np.float32))], vec, dimensions=[])
    step = body.op("divide", [one, five])  # 1.0: the inner loop ran 5 times
    body.root(body.tuple([body.op("add", [i, body.constant(np.array(1, np.int32))]),
                          body.op("add", [w, step]), n, stall]))

    main = Builder(m, 0, "main")
    w = main.parameter(vec)
    n = main.parameter(s32)
    stall = main.parameter(s32)
    loop = main.op("while", [main.tuple([main.constant(np.array(0, np.int32)), w, n, stall])],
                   state, called=[1, 2])
    return _steps_and_weights(m, main, loop, device_loop)


def infeed_module(feed: str = "batches", dim: int = 8, name: str = "infeed") -> ir_pb2.Module:
    """A device loop that pulls its batches from infeed ``feed`` as Graphcore's do: up to
    ``n`` steps of ``w = w + rowsum(x)``, the next batch ``x: f32[4, dim]`` pulled at the end
    of each step (and one before the loop); it stops early when the host ends the feed.

    Parameters ``w: f32[dim]`` (resident), ``n: s32[]``; outputs ``(steps run: s32[], new w)``
    with output 1 aliased to parameter 0.
    """
    m = ir_pb2.Module(name=name, entry_computation_id=0, frontend="test")
    s32, pred = array_shape(np.int32, []), array_shape(np.bool_, [])
    vec, batch = array_shape(np.float32, [dim]), array_shape(np.float32, [4, dim])
    pulled = ir_pb2.Shape(is_tuple=True, tuple_shapes=[pred, batch])
    state = ir_pb2.Shape(is_tuple=True, tuple_shapes=[s32, vec, s32, pred, batch])  # i w n ok x

    def pull(b: Builder, i: int) -> tuple[int, int]:
        got = b.op("custom-call", [i], pulled, custom_call_target="tf_ipu_infeed",
                   backend_config=feed)
        return (b.op("get-tuple-element", [got], pred, index=0),
                b.op("get-tuple-element", [got], batch, index=1))

    cond = Builder(m, 1, "cond")
    i, _, n, ok, _ = cond.unpack(state)
    more = cond.op("compare", [i, n], pred, direction="LT", compare_type="SIGNED")
    cond.root(cond.op("and", [more, ok]))

    add = Builder(m, 3, "add")
    add.root(add.op("add", [add.parameter(array_shape(np.float32, [])),
                            add.parameter(array_shape(np.float32, []))]))

    body = Builder(m, 2, "body")
    i, w, n, _, x = body.unpack(state)
    rows = body.op("reduce", [x, body.constant(np.array(0, np.float32))], vec, called=[3],
                   dimensions=[0])
    nxt = body.op("add", [i, body.constant(np.array(1, np.int32))])
    ok, x2 = pull(body, nxt)
    body.root(body.tuple([nxt, body.op("add", [w, rows]), n, ok, x2]))

    main = Builder(m, 0, "main")
    w = main.parameter(vec)
    n = main.parameter(s32)
    zero = main.constant(np.array(0, np.int32))
    ok, x = pull(main, zero)
    loop = main.op("while", [main.tuple([zero, w, n, ok, x])], state, called=[1, 2])
    return _steps_and_weights(m, main, loop)


# -- standalone server processes -----------------------------------------------------------


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sigint_default() -> None:
    """``preexec_fn`` for a child that must receive Ctrl-C: SIGINT back to its default
    disposition. A suite started in the background by a non-interactive shell (``make test &``)
    has SIGINT ignored, and children inherit that: Python then installs no KeyboardInterrupt
    handler in them, and a SIGINT sent to them would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (and ``extra`` set)."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def launcher_env(**extra: str) -> dict[str, str]:
    """``child_env`` for a test's own ``tf-ipu-run``: without the variables of a run or an
    MPI job this process may be part of (``POPDIST_*``, ``OMPI_*``, ``PMIX_*``,
    ``TF_IPU_RUN_*``, ``TF_IPU_SERVER``), then ``extra``."""
    env = {k: v for k, v in child_env().items()
           if not k.startswith(("POPDIST_", "OMPI_", "PMIX_", "TF_IPU_RUN_"))
           and k != "TF_IPU_SERVER"}
    return {**env, **extra}


class ServerProcess:
    """``python -m device_server`` on a fixed port, as a child process.

    Args:
        args: extra command line arguments.
        port: the port (a free one if 0); kept across ``restart``.
        env: the child's environment (``child_env()`` by default).
        log_path: where its stderr goes (a pipe is never used: a full pipe would block it).
    """

    def __init__(self, args: Sequence[str] = (), port: int = 0, env: dict[str, str] | None = None,
                 log_path: str | os.PathLike | None = None) -> None:
        self.args = list(args)
        self.port = port or free_port()
        self.env = env or child_env()
        self.log_path = Path(log_path) if log_path else Path(
            f"/tmp/tf_ipu_test_server_{os.getpid()}_{self.port}.log")
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, args: Sequence[str] = (), **kwargs: object) -> ServerProcess:
        server = cls(args, **kwargs)  # type: ignore[arg-type]
        server.restart()
        return server

    def restart(self, timeout: float = 30.0) -> None:
        """Starts the server (again, on the same port) and waits until it serves."""
        port_file = self.log_path.with_suffix(".port")
        port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "device_server", "--port", str(self.port),
                 "--port-file", str(port_file), *self.args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
            )
        end = time.monotonic() + timeout
        while not port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"device server exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > end:
                raise RuntimeError(f"device server did not start in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.02)
        port_file.unlink(missing_ok=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.alive():
            self.process.kill()
        if self.process is not None:
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM (then SIGKILL after 10 s); removes the log."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log_path.unlink(missing_ok=True)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
