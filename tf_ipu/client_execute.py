"""A ``DeviceClient``'s runs: Execute over one ExecuteStream, infeeds, stopping runs.

    execute(executable_id, bindings) ── arrays / VariableRefs encoded (tf_ipu.transport)
        └─ _execute_call ──> _ExecuteStream (one at a time, no call set-up) ══> server
                         └─> unary Execute (streams refused, or another thread's call on it)
    push_infeed ──PushInfeed──> the session's infeed, beside a running execute
    cancel_running ──CancelRun──> the server stops this client's runs at their next step

``Execution`` is one part of ``DeviceClient`` (``tf_ipu.client``).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from device_server.protocol import device_pb2
from tf_ipu import errors
from tf_ipu.client_channel import _error_kind
from tf_ipu.client_types import TensorSpec, VariableRef, _count

logger = logging.getLogger("tf_ipu.client")

#: Seconds an ExecuteStream may stay idle before the client closes it: an idle client holds
#: none of the server's worker threads (and a server shutting down waits for none).
STREAM_IDLE_SECONDS = 2.0
#: Seconds to use Execute after the server refused a stream (it served as many as it may).
STREAM_REFUSED_SECONDS = 10.0


class _ExecuteStream:
    """Execute calls over one ExecuteStream (device.proto), one at a time.

        call(request) -> queue -> gRPC's sending thread ==stream==> server: each request
        answered in order -> next(replies) -> call returns the reply

    A call costs no call set-up (~0.1 ms on loopback). A watchdog thread cancels the stream
    when a call's deadline passes (``timed_out``) and closes it after ``STREAM_IDLE_SECONDS``
    without calls. A stream that failed, timed out, was interrupted or closed is ``dead``: the
    client opens another for its next call.
    """

    def __init__(self, method: Any, metadata: Any) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.replies = method(iter(self._requests.get, None), metadata=metadata)
        self.lock = threading.Lock()  # held by the call in flight (``DeviceClient``)
        self.calls = 0
        self.dead = False
        self.timed_out = False
        self._state = threading.Lock()
        self._changed = threading.Condition(self._state)
        self._deadline: float | None = None  # of the call in flight (time.monotonic())
        self._wake_at = math.inf  # when the watchdog looks next
        self._last_used = time.monotonic()
        threading.Thread(target=self._watch, name="tf-ipu-execute-stream", daemon=True).start()

    def call(self, request: Any, timeout: float) -> Any | None:
        """Sends ``request`` and returns its reply; None if the stream is dead already
        (nothing was sent). Raises what the stream raises: ``grpc.RpcError`` with the call's
        status, ``StopIteration`` if the server ended the stream without an answer."""
        deadline = time.monotonic() + timeout
        with self._state:
            if self.dead:
                return None
            self._deadline = deadline
            if deadline < self._wake_at:
                self._changed.notify()
        self.calls += 1
        try:
            self._requests.put(request)
            return next(self.replies)
        finally:
            self._last_used = time.monotonic()
            with self._state:
                self._deadline = None

    def close(self, cancel: bool = False) -> None:
        """Ends the stream: the server's handler returns (``cancel``: at once, stopping a
        run in progress)."""
        with self._state:
            self.dead = True
            self._changed.notify()
        self._end(cancel)

    def _end(self, cancel: bool) -> None:
        self._requests.put(None)  # the end of the requests (and of gRPC's sending thread)
        if cancel:
            self.replies.cancel()

    def _watch(self) -> None:
        with self._state:
            while not self.dead:
                now = time.monotonic()
                if self._deadline is not None:
                    if now >= self._deadline:
                        self.timed_out = self.dead = True
                        break
                    self._wake_at = self._deadline
                elif now - self._last_used >= STREAM_IDLE_SECONDS:
                    self.dead = True  # (under the lock: no call starts on it from now on)
                    break
                else:
                    self._wake_at = self._last_used + STREAM_IDLE_SECONDS
                self._changed.wait(self._wake_at - now)
            else:
                return  # closed by the client
        self._end(cancel=self.timed_out)


#: ``_outputs_of`` of an executable this client did not compile.
_NO_OUTPUTS: tuple[list[TensorSpec], frozenset[int]] = ([], frozenset())


class Execution:
    """Execute calls, their stream, infeeds and cancelling of a DeviceClient (module docstring)."""

    def _execute_call(self, request: device_pb2.ExecuteRequest, timeout: float) -> Any:
        """Execute, on this client's ExecuteStream when it can (one thread at a time; the
        server may refuse streams, an older one has none), else as a unary call."""
        stream = self._execute_stream()
        if stream is not None:
            with self._lock_running:
                self._running += 1
            try:
                request.timeout_seconds = timeout
                reply = stream.call(request, timeout)
            except grpc.RpcError as e:
                self._drop_stream(stream)
                kind = _error_kind(e)
                if stream.calls == 1 and (e.code() == grpc.StatusCode.UNIMPLEMENTED
                                          or kind == "too-many-streams"):
                    # Not run: send it as a unary call; streams again after a while (or
                    # never, from a server without them).
                    self._streams_off_until = time.monotonic() + (
                        STREAM_REFUSED_SECONDS if kind else math.inf)
                    logger.debug("Execute without a stream on %s: %s", self.address,
                                 e.details())
                    reply = None
                elif stream.timed_out:
                    raise errors.from_status(
                        "DEADLINE_EXCEEDED", f"Execute got no answer within {timeout:g} s",
                        self.address) from None
                elif self._closed:
                    raise errors.FailedPreconditionError(
                        "Execute: the client was closed under this call.", self.address) from None
                else:
                    raise self._error("Execute", e, timeout) from None
            except StopIteration:
                self._drop_stream(stream)
                raise errors.InternalError(
                    "Execute: the server ended the stream without an answer.",
                    self.address) from None
            except BaseException:  # e.g. KeyboardInterrupt: the reply would come unread
                self._drop_stream(stream, cancel=True)
                raise
            finally:
                stream.lock.release()
                with self._lock_running:
                    self._running -= 1
            if reply is not None:
                return reply
        return self._call_stoppable("Execute", request, timeout)

    def _execute_stream(self) -> _ExecuteStream | None:
        """The stream for an Execute call, its ``lock`` taken; None when the call is to be
        unary (streams refused, or another thread's call holds the stream)."""
        if self._closed:
            raise errors.FailedPreconditionError("Execute: the client is closed.", self.address)
        if not self._reachable:
            self._probe()
        if self._streams_off_until and time.monotonic() < self._streams_off_until:
            return None
        with self._stream_lock:
            stream = self._stream
            if stream is not None and not stream.dead and stream.replies.done():
                stream.close()  # it ended between calls (e.g. the server restarted)
            if stream is None or stream.dead:
                stream = self._stream = _ExecuteStream(self._stub.ExecuteStream, self._metadata)
            if not stream.lock.acquire(blocking=False):
                return None
        if stream.dead:  # the watchdog closed it meanwhile (idle): a new one
            stream.lock.release()
            return self._execute_stream()
        return stream

    def _drop_stream(self, stream: _ExecuteStream | None = None, cancel: bool = False) -> None:
        """Ends ``stream`` (by default the current one) and forgets it."""
        with self._stream_lock:
            if stream is None:
                stream = self._stream
            if self._stream is stream:
                self._stream = None
        if stream is not None:
            stream.close(cancel)

    def cancel_running(self) -> int:
        """Stops this client's device calls in progress (from any thread): the server stops
        each at its next step, keeps the variables of the last completed one, and the call
        raises ``CancelledError``. Returns how many runs the server stopped."""
        # The call may not have reached its run yet (uploads, or queued behind another call
        # of the session): ask again for a little while until a run is stopped.
        end = time.monotonic() + 2.0
        while True:
            with self._lock_running:
                running = self._running
            session = self._session
            if not running or session is None:
                return 0
            try:
                reply = self._stub.CancelRun(device_pb2.SessionRef(session_id=session.session_id),
                                             timeout=self.timeout, metadata=self._metadata)
            except (grpc.RpcError, ValueError) as e:  # the server (or the channel) is gone
                logger.debug("CancelRun on %s failed: %s", self.address, e)
                return 0
            if reply.runs_stopped or time.monotonic() > end:
                return int(reply.runs_stopped)
            time.sleep(0.05)

    def execute(
        self,
        executable_id: str,
        bindings: Sequence[np.ndarray | VariableRef | Any],
        return_updated_variables: bool = False,
        timeout: float | None = None,
        run_deadline: float = 0.0,
    ) -> list[np.ndarray | None]:
        """Runs an executable once.

        Args:
            executable_id: from ``compile`` in this session.
            bindings: one per entry parameter, in order: an array (sent with the call) or a
                ``VariableRef`` (a resident variable; if the parameter is aliased to an
                output, the device keeps the new value under that key).
            return_updated_variables: also send back the new values of resident variables.
            timeout: deadline in seconds of the call (``run_timeout`` by default).
            run_deadline: seconds after which the server stops the run (0: none but the
                call's): a device loop ends at its next step and keeps its variables, and the
                call raises ``DeadlineExceededError``.

        Returns:
            The flattened outputs as arrays (read-only views; copy to modify). An output
            that updated a resident variable is ``None`` unless
            ``return_updated_variables``.

        Raises:
            InvalidArgumentError: naming the parameter number, expected and received types.
            NotFoundError: unknown executable id or variable key.
            CancelledError: ``cancel_running`` (or the session closing) stopped it.
            DeadlineExceededError: the run deadline (or the call's) passed; the message says
                after how many steps of its device loop the run stopped.
        """
        # One call per step, or more often: the per-call work below is kept small (the
        # latency of a small call is within 1.3x a bare gRPC echo, bench/bench_transport.py).
        request = device_pb2.ExecuteRequest(session_id=self.session_id,
                                            executable_id=executable_id)
        if return_updated_variables:
            request.return_updated_variables = True
        if run_deadline > 0:
            request.run_deadline_seconds = float(run_deadline)
        with self.data.call() as call:
            parameters = request.parameters
            for number, b in enumerate(bindings):
                if isinstance(b, VariableRef):
                    parameters.add(variable_key=b.key)
                else:
                    call.encode(parameters.add().value, b, f"parameter {number}")
            specs, aliased = self._outputs_of.get(executable_id, _NO_OUTPUTS)
            for i, spec in enumerate(specs):
                if i in aliased and not return_updated_variables:
                    continue  # stays on the device
                region = call.output_region(spec.dtype, spec.shape)
                if region is not None:
                    request.output_regions[i].CopyFrom(region)
            reply = self._execute_call(request, self.run_timeout if timeout is None else timeout)
            self.last_device_seconds = reply.device_seconds
            self.last_outfeeds = {
                o.feed: (int(o.count), [call.decode(t, f"outfeed {o.feed!r}") for t in o.values])
                for o in reply.outfeeds
            } if len(reply.outfeeds) else {}
            outputs: list[np.ndarray | None] = []
            for i, t in enumerate(reply.outputs):
                if t.WhichOneof("payload") is None and _count(t.dims):
                    outputs.append(None)  # stayed on the device
                else:
                    outputs.append(call.decode(t, f"output {i}"))
            return outputs

    def push_infeed(self, feed: str, batches: Sequence[Sequence[np.ndarray]],
                    end: bool = False, reset: bool = False) -> int:
        """Appends ``batches`` (each a list of arrays, in the order the program's
        ``tf_ipu_infeed`` custom-call declares them) to the session's infeed ``feed``; ``end``
        ends the feed after them; ``reset`` first drops what the feed holds. Runs alongside an
        ``execute`` of the same session, from another thread: the device pulls the batches as
        its loop reaches them. Returns how many batches now wait in the feed."""
        request = device_pb2.PushInfeedRequest(session_id=self.session_id, feed=feed, end=end,
                                               reset=reset)
        with self.data.call() as call:
            for b, batch in enumerate(batches):
                out = request.batches.add()
                for k, value in enumerate(batch):
                    call.encode(out.values.add(), value, f"infeed {feed!r} batch {b} value {k}",
                                inline_only=True)
            return int(self._call("PushInfeed", request).queued)
