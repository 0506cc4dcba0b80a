"""Execute: a compiled program run on a session's IPUs, with its parameters, resident
variables, infeeds and outfeeds, on one replica, on several, or across the run's servers.

    ExecuteRequest ──> the handle (the session's) and its parameters: values (inline, blob,
                       shared memory) or resident variables, checked against the signature
                   ──> refused before it runs: over tile memory, past its deadline, client gone
                   ──> Executable.run (one replica), run_replicated (several, each with its
                       own variables), joined with the other servers' (a world program)
                       with a stop token (calls.py) and the updated variables donated
                   ──> updated variables stored (variables.py), replicas' values kept apart
                   <── outputs (inline, shared memory or blobs) and the outfeeds' items
    PushInfeedRequest ──> a session's infeed, while a run of it may be pulling from it
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from device_server.calls import STOP_STATUS, STOP_WHY, CallState
from device_server.counters import Counters
from device_server.data_path import ReplyBudget, TransferCounters, fill_reply_tensor, tensor_value
from device_server.emulator import (
    EmulatorError,
    FloatingPointExceptionError,
    OutOfMemoryError,
    RunStopped,
    StopToken,
)
from device_server.emulator.kernels.infeed import InfeedEnded
from device_server.emulator.replicas import run_replicated
from device_server.programs import Programs
from device_server.protocol import device_pb2, dtypes
from device_server.service_config import ServiceConfig
from device_server.sessions import ExecutableHandle, ServiceError, Session, SessionManager
from device_server.variables import Variables

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def array_type(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    """``F32[2, 3]``: how errors spell an array type."""
    try:
        name = dtypes.dtype_name(dtypes.from_numpy(dtype))
    except ValueError:
        name = str(dtype)
    return f"{name}[{', '.join(str(d) for d in shape)}]"


@dataclass
class Execution:
    """Runs the sessions' programs.

    Attributes:
        config: the server's options (``max_message_bytes``, ``max_session_bytes``).
        counters: the server's counters (``executions``, ``replica_runs``, ``runs_stopped.*``).
        transfers: bytes by path (data_path.py).
        sessions: the server's sessions.
        call: the RPC each worker thread serves (its deadline, client and stop token).
        programs: the compiled programs (their first run's program, the run's world).
        variables: the sessions' variables (where updated values are stored).
    """

    config: ServiceConfig
    counters: Counters
    transfers: TransferCounters
    sessions: SessionManager
    call: CallState = field(repr=False)
    programs: Programs = field(repr=False)
    variables: Variables = field(repr=False)

    def execute(self, s: Session, request: device_pb2.ExecuteRequest) -> device_pb2.ExecuteReply:
        """Runs the executable ``request`` names in the entered session ``s``."""
        handle = self._handle(s, request)
        exe = handle.executable
        what = f"Execute of executable {handle.handle_id}"
        inputs, variable_of = self._bind(s, request, exe, what)
        updates = _updates(exe, variable_of, what)
        self._check_runnable(exe, what)
        outputs, per_replica, seconds, token = self._run(s, request, handle, what, inputs,
                                                         variable_of, updates)
        replicas = exe.options.replicas
        self.counters.add("executions")
        for out_index, key in updates.items():
            self.variables.store(s, key, outputs[out_index])
            for r in range(1, replicas):
                s.set_replica_variable(key, r, per_replica[r][out_index])
        if replicas > 1:
            # A replicated program's outputs: every replica's, stacked (leading dimension).
            outputs = [np.stack([per_replica[r][i] for r in range(replicas)])
                       if request.return_updated_variables or i not in updates else out
                       for i, out in enumerate(outputs)]
        if token.steps_completed is not None:
            # The device loop ended early: its variables (stored above) are those of its
            # last completed step; the caller gets the reason, not the outputs.
            reason = token.reason or "cancelled"
            self.counters.add(f"runs_stopped.{reason}")
            code, kind = STOP_STATUS[reason]
            raise ServiceError(
                code, f"{what}: stopped ({STOP_WHY[reason]}) after {token.steps_completed} "
                f"completed steps of its device loop; the device holds the variables of "
                f"step {token.steps_completed} of this call.", kind=kind,
            )
        return self._reply(s, request, outputs, updates, seconds)

    def _handle(self, s: Session, request: device_pb2.ExecuteRequest) -> ExecutableHandle:
        """The session's handle the request names (a session with IPUs only)."""
        if s.target is None:
            raise ServiceError(
                _PRECONDITION,
                f"Execute: session {s.session_id} has no IPUs attached.",
            )
        handle = s.executables.get(request.executable_id)
        if handle is None:
            shown = request.executable_id[:80]
            raise ServiceError(
                _NOT_FOUND,
                f"Execute: session {s.session_id} has no executable {shown!r} "
                f"(handles are valid only in the session that compiled them).",
                kind="unknown-executable",
            )
        return handle

    def _bind(self, s: Session, request: device_pb2.ExecuteRequest, exe: Any,
              what: str) -> tuple[list[np.ndarray], dict[int, str]]:
        """The program's arguments, and the resident variable bound to each parameter
        number that is one, checked against the program's parameters."""
        expected = exe.parameters
        if len(request.parameters) != len(expected):
            raise ServiceError(
                _INVALID,
                f"{what}: expected {len(expected)} parameters, received "
                f"{len(request.parameters)}.",
            )
        inputs: list[np.ndarray] = []
        variable_of: dict[int, str] = {}  # parameter number -> resident variable key
        for number, (binding, (dt, shape)) in enumerate(zip(request.parameters, expected, strict=True)):
            source = binding.WhichOneof("source")
            if source == "value":
                value = tensor_value(s.data, binding.value, f"{what}: parameter {number}",
                                     self.transfers)
                received = "value"  # spelled below, only if it does not match
            elif source == "variable_key":
                key = binding.variable_key
                value = s.variables.get(key)
                if value is None:
                    raise ServiceError(
                        _NOT_FOUND,
                        f"{what}: parameter {number} is bound to variable {key!r}, which "
                        f"session {s.session_id} does not have.",
                        kind="unknown-variable",
                    )
                variable_of[number] = key
                received = ""  # spelled below, only if it does not match
            else:
                raise ServiceError(
                    _INVALID, f"{what}: parameter {number} has neither a value nor a variable key."
                )
            if value.dtype != dt or tuple(value.shape) != tuple(shape):
                received = (f"a value of {array_type(value.dtype, value.shape)}" if received
                            else f"variable {binding.variable_key!r} of "
                                 f"{array_type(value.dtype, value.shape)}")
                raise ServiceError(
                    _INVALID,
                    f"{what}: parameter {number} expects {array_type(dt, tuple(shape))}, "
                    f"received {received}.",
                )
            inputs.append(value)
        return inputs, variable_of

    def _check_runnable(self, exe: Any, what: str) -> None:
        """Refuses a program that would not fit, a call past its deadline, and one whose
        client went away."""
        est = exe.estimate
        if est.refused:  # over the tile model's margin (within it, or unknown: it runs)
            raise ServiceError(
                _EXHAUSTED,
                f"{what}: program {exe.name!r} does not fit in tile memory "
                f"({est.peak_tile_bytes} bytes on the fullest tile, tiles have "
                f"{est.tile_bytes_limit}); it was compiled with allow_out_of_memory for "
                f"its report and cannot run.",
                kind="out-of-memory",
            )
        remaining = self.call.remaining()
        if remaining is not None and remaining <= 0:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{what}: the call's deadline passed while it waited; not run.",
                kind="deadline",
            )
        if not self.call.client_waiting():
            raise ServiceError(
                grpc.StatusCode.CANCELLED,
                f"{what}: the client went away before it ran; not run.",
                kind="cancelled",
            )

    def _run(self, s: Session, request: device_pb2.ExecuteRequest, handle: ExecutableHandle,
             what: str, inputs: list[np.ndarray], variable_of: dict[int, str],
             updates: dict[int, str]
             ) -> tuple[list[np.ndarray], list[list[np.ndarray]], float, StopToken]:
        """Runs the program (its replicas, with the other servers' for a world program):
        (outputs, every replica's arguments then outputs, seconds, its stop token)."""
        exe = handle.executable
        # Updated variables' buffers are donated: the program may write their new values
        # into them (as XLA does with donated buffers); a variable bound twice is not.
        bound = Counter(variable_of.values()) if updates else {}
        donated = [exe.aliases[o] for o, key in updates.items() if bound[key] == 1]
        if not exe.program_ready:
            self.programs.generate_program(exe, what)  # before the run deadline starts
        token = self.call.stop_token(request.run_deadline_seconds)
        token.infeed = lambda feed, tok, where: s.data.infeed(feed).pull(tok, where)
        token.outfeed = s.data.enqueue_outfeed
        s.data.outfeeds.clear()  # what a stopped call enqueued is not kept
        replicas = exe.options.replicas
        world = self.programs.world if exe.options.instances > 1 else None
        per_replica: list[list[np.ndarray]] = []
        if replicas > 1:
            # Every replica reads the same parameter values and its own variables.
            per_replica = [inputs]
            for r in range(1, replicas):
                args = list(inputs)
                for number, key in variable_of.items():
                    args[number] = s.replica_variable(key, r)
                per_replica.append(args)
        start = time.perf_counter()
        try:
            with s.run(token), self._world_run(world, handle, what, token) as meeting:
                if replicas > 1 or meeting is not None:
                    try:
                        per_replica, group = run_replicated(
                            exe, per_replica or [inputs], [donated] * replicas, stop=token,
                            world=meeting)
                    except BaseException:
                        # Replicas may have written some variables in place before one
                        # failed: the others start again from replica 0's next time.
                        for key in variable_of.values():
                            s.replica_variables.pop(key, None)
                        raise
                    outputs = per_replica[0]
                    self.counters.add("replicated_executions")
                    self.counters.add("all_reduce_bytes", group.all_reduce_bytes)
                else:
                    outputs = exe.run(inputs, donated, stop=token)
                self.counters.add("replica_runs", replicas)
        except RunStopped as e:
            self.counters.add(f"runs_stopped.{e.reason}")
            code, kind = STOP_STATUS[e.reason]
            raise ServiceError(
                code, f"{what}: {e}; nothing of this call was kept (the device holds the "
                f"variables as they were before it).", kind=kind,
            ) from e
        except OutOfMemoryError as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: {e}",
                               kind="out-of-memory") from e
        except InfeedEnded as e:
            raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, f"{what}: {e}",
                               kind="infeed-ended") from e
        except FloatingPointExceptionError as e:
            # The program's own arithmetic (as TF's CheckNumerics reports it), not a fault
            # of the server: INVALID_ARGUMENT, refined by the kind.
            raise ServiceError(_INVALID, f"{what}: {e}", kind="floating-point-exception") from e
        except EmulatorError as e:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"{what} failed on the device: {e}",
                               kind="execution") from e
        seconds = time.perf_counter() - start
        if len(outputs) != len(exe.outputs):
            raise ServiceError(
                grpc.StatusCode.INTERNAL,
                f"{what}: the emulator returned {len(outputs)} outputs, the executable "
                f"declares {len(exe.outputs)}.",
            )
        return outputs, per_replica, seconds, token

    def _reply(self, s: Session, request: device_pb2.ExecuteRequest, outputs: list[np.ndarray],
               updates: dict[int, str], seconds: float) -> device_pb2.ExecuteReply:
        """The reply: each output at its run-time shape (an output with dynamic dimensions
        may be smaller than its bound there; the message-size check counted the bounds), and
        the items the outfeeds received. Outputs bigger than the reply's budget go as blobs
        (GetBlob), or into the shared-memory regions the request named."""
        reply = device_pb2.ExecuteReply(device_seconds=seconds)
        budget = ReplyBudget(self.config.max_message_bytes)
        regions = request.output_regions
        for i, out in enumerate(outputs):
            if request.return_updated_variables or i not in updates:
                fill_reply_tensor(s.data, reply.outputs.add(), out, budget,
                                  regions[i] if i in regions else None, self.transfers)
            else:
                dtypes.fill_tensor(reply.outputs.add(), out, with_data=False)
        for feed, items in s.data.outfeeds.items():
            data = reply.outfeeds.add(feed=feed, count=len(items))
            for k in range(len(items[0]) if items else 0):
                stacked = np.stack([item[k] for item in items])
                fill_reply_tensor(s.data, data.values.add(), stacked, budget, None,
                                  self.transfers)
        s.data.outfeeds.clear()
        return reply

    @contextlib.contextmanager
    def _world_run(self, world: Any, handle: Any, what: str, token: Any) -> Iterator[Any]:
        """A world program's execution joined with the other servers' (``WorldRun``), or
        None for a program of this server only."""
        if world is None:
            yield None
            return
        digest = self.programs.world_digests[handle.cache_key]
        with world.run(digest, handle.executable.options.replicas, what,
                       stopped=lambda: token.reason) as meeting:
            yield meeting

    def push_infeed(self, request: device_pb2.PushInfeedRequest) -> device_pb2.PushInfeedReply:
        """Appends batches to one of the session's infeeds (without entering the session: a
        run of it may be pulling from that infeed right now)."""
        s = self.sessions.get(request.session_id)
        if not request.feed:
            raise ServiceError(_INVALID, "PushInfeed: the request names no feed.")
        batches: list[list[np.ndarray]] = []
        for b, batch in enumerate(request.batches):
            values = []
            for k, tensor in enumerate(batch.values):
                what = f"PushInfeed {request.feed!r}: batch {b}, value {k}"
                if tensor.WhichOneof("payload") == "blob_id":
                    raise ServiceError(_INVALID, f"{what}: an infeed batch travels inline or in "
                                                 f"shared memory, not as a blob.")
                value = tensor_value(s.data, tensor, what, self.transfers)
                if tensor.WhichOneof("payload") == "shm":
                    value = np.array(value)  # the host reuses the region once this returns
                values.append(value)
            batches.append(values)
        limit = self.config.max_session_bytes
        incoming = sum(int(v.nbytes) for batch in batches for v in batch)
        queued = s.data.infeed_bytes()
        if limit > 0 and queued + incoming > limit:
            raise ServiceError(
                _EXHAUSTED, f"PushInfeed {request.feed!r}: {queued + incoming} bytes of batches "
                f"would wait in session {s.session_id}'s infeeds, over the server's limit of "
                f"{limit} bytes per session (--max-session-bytes).", kind="session-memory")
        feed = s.data.infeed(request.feed)
        feed.push(batches, request.end, request.reset)
        self.counters.add("infeed_batches", len(batches))
        s.touch()
        return device_pb2.PushInfeedReply(queued=feed.queued())


def _updates(exe: Any, variable_of: dict[int, str], what: str) -> dict[int, str]:
    """Outputs that carry a new value of a resident variable: its key, by output index."""
    updates: dict[int, str] = {}
    for out_index, number in exe.aliases.items():
        key = variable_of.get(number)
        if key is None:
            continue
        if key in updates.values():
            raise ServiceError(
                _INVALID,
                f"{what}: variable {key!r} is bound to more than one updated parameter.",
            )
        updates[out_index] = key
    return updates
