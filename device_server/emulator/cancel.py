"""Stopping a running program: at the next step of a device loop, or at the next iteration
of any other loop.

    service.Execute ──StopToken──> Executable.run(args, stop=token)
         │ stop(reason): client cancel, deadline,          │ (this thread's token)
         │ session closed, server shutdown                 v
         └──────────────────────────────────────> while kernels (kernels/control.py)
                                                    device loop: ends after the step it is in
                                                    other loops: raise RunStopped

A *device loop* is the loop the host wrote to run N steps in one call (``tf_ipu``'s Keras
integration names it ``DEVICE_LOOP_NAME``). Asked to stop, it ends at its next step boundary
as if its condition were false, so the rest of the program runs and the call's variables are
those of the last completed step (as Ctrl-C leaves a Keras model on a CPU). A step that does
not reach its end within ``NESTED_GRACE_SECONDS`` (a ``while`` inside it that never ends) is
abandoned: the loop returns the state it had before that step, if the step wrote no part of
that state in place; otherwise the whole call is abandoned. Any other loop raises
``RunStopped`` at its next iteration: the call is abandoned and the caller keeps nothing of
it. Programs with loops never write into donated buffers (``rewrites._mark_donations``), so
an abandoned call leaves the variables as they were.

A Compile has a token too (``service.compile``: the client's cancel, its deadline, the session
closing): planning calls ``checkpoint`` between its phases and every few instructions of the
long ones, which raises ``RunStopped`` once the token is stopped; nothing is cached then, and
the session (and its IPUs) take the next call at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from device_server.emulator.errors import EmulatorError
from device_server.protocol import DEVICE_LOOP_NAME

__all__ = ["DEVICE_LOOP_NAME", "NESTED_GRACE_SECONDS", "REASONS", "RunStopped", "StopToken",
           "checkpoint", "current", "is_device_loop", "running"]
#: How long a step of a device loop may go on after a stop was asked before its inner
#: loops give up.
NESTED_GRACE_SECONDS = 1.0

#: Why a run stops, as ``StopToken.reason`` spells it.
REASONS = ("cancelled", "deadline", "session-closed", "shutdown")


class RunStopped(EmulatorError):
    """A run was stopped before it completed a step of its device loop (or it has none):
    nothing of it is kept. ``reason`` is one of ``REASONS``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class StopToken:
    """Asks one run to stop; read by the run's loops. Thread-safe.

    Args:
        deadline: a ``time.monotonic()`` value after which the run stops by itself
            (reason ``"deadline"``), or None.
    """

    def __init__(self, deadline: float | None = None, infeed: Any = None) -> None:
        self.deadline = deadline
        #: Where the run's infeed custom-calls get batches (kernels/infeed.py):
        #: ``infeed(feed, token, where) -> list[np.ndarray] | None`` (None: the feed ended).
        self.infeed = infeed
        #: Where the run's outfeed custom-calls put values: ``outfeed(feed, arrays)``.
        self.outfeed: Any = None
        self._reason: str | None = None
        self._asked_at = 0.0
        self._lock = threading.Lock()
        self._loops = 0                 # device loops running now
        #: Steps the outermost device loop completed, once it ended early (None until then).
        self.steps_completed: int | None = None

    def stop(self, reason: str) -> None:
        """Asks the run to stop (the first reason given is kept)."""
        with self._lock:
            if self._reason is None:
                self._reason = reason
                self._asked_at = time.monotonic()

    @property
    def reason(self) -> str | None:
        """Why the run was asked to stop (a passed deadline counts), or None."""
        if self._reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.stop("deadline")
        return self._reason

    def at_step(self) -> bool:
        """At a device loop's step boundary: whether to end the loop now."""
        return self.reason is not None

    def in_loop(self) -> bool:
        """At an iteration of any other loop: whether to abandon the run now (at once,
        unless a device loop is running: then after the grace period)."""
        if self.reason is None:
            return False
        return not self._loops or time.monotonic() - self._asked_at > NESTED_GRACE_SECONDS

    @contextmanager
    def device_loop(self) -> Iterator[None]:
        """Marks a device loop as running (inner loops then give its step a grace period)."""
        with self._lock:
            self._loops += 1
        try:
            yield
        finally:
            with self._lock:
                self._loops -= 1

    def ended_early(self, completed: int) -> None:
        """Records that the outermost device loop ended after ``completed`` steps."""
        if self._loops <= 1:
            self.steps_completed = completed

    def stopped(self, where: str) -> RunStopped:
        """The error to raise when the run is abandoned at ``where``."""
        reason = self.reason or "cancelled"
        return RunStopped(f"stopped ({reason}) at {where}, before its step completed", reason)


def is_device_loop(source_op: str) -> bool:
    """Whether a ``while`` from TF op ``source_op`` is a device loop: the op itself is named
    so (TF may add a suffix, ``tf_ipu_device_loop_1``), not merely an op inside it."""
    return source_op.rsplit("/", 1)[-1].startswith(DEVICE_LOOP_NAME)


_current = threading.local()


def checkpoint(where: str) -> None:
    """Where long work that is not a run (a Compile's planning) may stop: raises
    ``RunStopped`` if this thread's token (``running``) was asked to stop. Cheap enough to
    call every few instructions."""
    token = getattr(_current, "token", None)
    if token is not None and token.reason is not None:
        raise RunStopped(f"stopped ({token.reason}) while {where}", token.reason)


def current() -> StopToken | None:
    """The token of the run on this thread, or None."""
    return getattr(_current, "token", None)


def running(token: StopToken | None) -> _Running:
    """Makes ``token`` this thread's run's token for the block (``with running(token):``)."""
    return _Running(token)


class _Running:
    """``running``'s block (a class, not a generator: it is on the path of every run)."""

    __slots__ = ("_token", "_previous")

    def __init__(self, token: StopToken | None) -> None:
        self._token = token
        self._previous: StopToken | None = None

    def __enter__(self) -> None:
        self._previous = getattr(_current, "token", None)
        _current.token = self._token

    def __exit__(self, *exc: object) -> None:
        _current.token = self._previous
