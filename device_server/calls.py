"""The RPC a worker thread is serving: its deadlines, its client, and how its run stops.

    DeviceService._rpc ──sets──> CallState (per thread: context, deadlines, stream)
                                   ├─ remaining()       seconds left to wait (client's or server's)
                                   ├─ client_waiting()  whether the client still wants the answer
                                   ├─ peer()            the connection (connection leases)
                                   ├─ enter(...)        the session's lock, within the deadline
                                   └─ stop_token(...)   a run's stop token (emulator/cancel.py)

A run stops early when its client cancels or goes away, at its run deadline or the call's,
when its session closes and when the server shuts down; ``STOP_STATUS`` gives the status of
each reason and ``STOP_WHY`` how messages say it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from device_server.emulator import StopToken
from device_server.sessions import SessionManager

#: The status of a stopped run, by reason (emulator/cancel.py), and how messages say it.
STOP_STATUS = {
    "cancelled": (grpc.StatusCode.CANCELLED, "cancelled"),
    "deadline": (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
    "session-closed": (grpc.StatusCode.CANCELLED, "session-closed"),
    "shutdown": (grpc.StatusCode.UNAVAILABLE, "shutting-down"),
}
STOP_WHY = {
    "cancelled": "the client cancelled the call",
    "deadline": "its run deadline passed",
    "session-closed": "its session was closed",
    "shutdown": "the server is shutting down",
}


class ExecuteStreamState:
    """One ExecuteStream being served: the stop token of its call running now, which the
    stream's one termination callback stops when the client cancels or goes away."""

    __slots__ = ("token",)

    def __init__(self) -> None:
        self.token: StopToken | None = None

    def cancelled(self) -> None:
        token = self.token
        if token is not None:
            token.stop("cancelled")


class CallState(threading.local):
    """The RPC this worker thread is serving: its context and absolute deadlines."""

    context: Any = None
    deadline: float | None = None  # time.monotonic() value: the client's, or the server's
    client_deadline: float | None = None  # the client's own (the run's), or None
    stream: ExecuteStreamState | None = None  # the ExecuteStream this call came on, if any

    def remaining(self) -> float | None:
        """Seconds left before this call's deadline (the client's or the server's), or None."""
        deadline = self.deadline
        return None if deadline is None else deadline - time.monotonic()

    def client_waiting(self) -> bool:
        """Whether the client of this call still waits for its answer."""
        context = self.context
        return context is None or context.is_active()

    def peer(self) -> str:
        """The peer of this call's connection (``ipv4:10.0.0.7:53122``), or ""."""
        context = self.context
        try:
            return str(context.peer()) if context is not None else ""
        except Exception:  # no peer once the connection is gone
            return ""

    def enter(self, sessions: SessionManager, session_id: str) -> Any:
        """The session's ``enter`` context (its calls one at a time), waiting at most until
        this call's deadline."""
        return sessions.get(session_id).enter(sessions.max_waiting_calls,
                                              timeout=self.remaining())

    def stop_token(self, run_deadline_seconds: float) -> StopToken:
        """A stop token for the run this call starts: it stops by itself at the run deadline
        the request asks for or at the call's own deadline, and when the client cancels or
        goes away (gRPC's termination callback)."""
        # The client's deadline (the server's request deadline bounds waiting, not running).
        deadline = self.client_deadline
        if run_deadline_seconds > 0:
            run_end = time.monotonic() + run_deadline_seconds
            deadline = run_end if deadline is None else min(deadline, run_end)
        token = StopToken(deadline)
        if self.stream is not None:
            self.stream.token = token  # the stream's callback stops it (one per stream)
        elif self.context is not None:
            self.context.add_callback(lambda: token.stop("cancelled"))
        return token
