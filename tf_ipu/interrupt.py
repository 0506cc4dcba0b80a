"""Ctrl-C reaches a running device call, wherever the main thread waits for it.

    Ctrl-C ──SIGINT──> Python's C-level handler ──signal number──> wakeup fd (a socket)
                                                                     │
         watcher thread (this module) <──────────────────────────────┘
           ├─> marks the interrupt pending: device calls and compiles from now on fail at
           │   once (a host ``tf.while_loop`` calling the device ends at its next call)
           └─> callbacks: DeviceClient.cancel_running ──gRPC cancel──> the server stops
               the run at its next step (keeping the last completed step's variables), or
               the Compile at its next planning checkpoint
    main thread (in TF's C++, waiting for the call): TF returns the cancelled call's error;
           this module's SIGINT handler raises KeyboardInterrupt, as on a CPU.

Python runs signal handlers only on the main thread and only between bytecodes, so while the
main thread waits inside TensorFlow for a device call (``model.fit``, a ``tf.function`` that
calls ``strategy.run``, a loaded SavedModel's signature), a Ctrl-C alone would wait for the
call to end, forever for one that never does. The signal's number is also written to the
process's wakeup fd (``signal.set_wakeup_fd``) at once, from C: this module owns that fd, and
forwards every byte to the fd that was installed before it (asyncio's, a notebook kernel's),
so they keep working. ``install`` must run on the main thread; it runs when ``tf_ipu`` sets
up TensorFlow, when the IPU system is configured and again before device calls made on the
main thread (someone may have replaced the fd since).

``install`` also makes ``_on_sigint`` the SIGINT handler where Python's default one is
installed (a handler the user installed is left alone; only the cancelling then happens). It
raises KeyboardInterrupt as the default one does, except where that would go wrong:

- inside ``deferred_interrupt`` (around the Keras integration's device calls) it holds the
  interrupt back until the block ends, then raises it in place of the cancelled call's error;
- inside a device call running on the main thread (``held_back``: the IpuExecute kernel's
  callback, which must return a status to TF) and while TensorFlow builds the exception of a
  failed call (from C++, through pybind11, which would turn a KeyboardInterrupt raised there
  into "RuntimeError: ... MISMATCH of original and normalized active exception types"), it
  sets a profile hook on the main thread that raises it at the first function call outside
  those frames (TF's Python code once the call has returned), and removes itself. Never at a
  return (a lock an ``__enter__`` took would stay taken), in a ``__del__`` or during a garbage
  collection (Python drops exceptions there: the Ctrl-C would be lost); the SIGINT handler
  itself defers to the hook in those places too.

The pending mark ends when the KeyboardInterrupt is raised, so the IPU takes the next call.
"""

from __future__ import annotations

import _thread
import gc
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

_log = logging.getLogger("tf_ipu")

_lock = threading.Lock()
_callbacks: list[Callable[[], None]] = []
_reader: socket.socket | None = None
_writer: socket.socket | None = None
_previous_fd = -1          # the wakeup fd installed before ours, to forward to
_thread_: threading.Thread | None = None
_interrupts_seen = 0        # SIGINTs the watcher has passed on (for tests and logs)
_pending = False            # a SIGINT the watcher saw, not yet raised as KeyboardInterrupt
_retrips = 0                # SIGINTs this module raised again itself (the watcher skips them)
_deferring = 0              # deferred_interrupt blocks open on the main thread
_holding = 0                # deferred_interrupt blocks and held_back calls open on it
_held = False               # a SIGINT arrived while _holding
_reading = False            # the watcher is taking bytes from the fd (pending may follow)
_delivered_at = -1.0        # time.monotonic() of the last KeyboardInterrupt raised here
_cancel_lock = threading.Lock()  # held by a callback cancelling calls (see cancelling)
#: How long after an unsafe place the SIGINT handler runs again (``_retrip``).
RETRIP_SECONDS = 0.01
#: Files whose frames the SIGINT handler must not raise in: TF's exception classes (built
#: from C++ through pybind11 when a call fails) and the op library's kernel callbacks.
_UNSAFE_FILES = (os.path.join("framework", "errors_impl.py"), os.path.join("tf_ipu_ops", ""),
                 os.path.join("ops", "python", "__init__.py"))


def on_interrupt(callback: Callable[[], None]) -> None:
    """Calls ``callback()`` (on the watcher thread) at every SIGINT from now on."""
    with _lock:
        if callback not in _callbacks:
            _callbacks.append(callback)


def pending() -> bool:
    """Whether a Ctrl-C was seen that has not been raised as KeyboardInterrupt yet (device
    calls started now fail at once). Only while this module's SIGINT handler is installed."""
    return _pending and _handler_installed()


@contextmanager
def cancelling() -> Iterator[bool]:
    """For a Ctrl-C callback that cancels device calls: yields whether to cancel now (the
    interrupt is pending; or this module's handler is not installed, and every SIGINT
    cancels). The KeyboardInterrupt waits for the block to end, so that a cancel never
    reaches a call that the user's code started after it."""
    with _cancel_lock:
        yield pending() or not _handler_installed()


def _handler_installed() -> bool:
    try:
        return signal.getsignal(signal.SIGINT) is _on_sigint
    except ValueError:  # a subinterpreter
        return False


def install() -> bool:
    """Makes this module's socket the process's signal wakeup fd (forwarding to the one it
    replaces) and ``_on_sigint`` the SIGINT handler where Python's default one is installed.
    Returns False where it cannot: off the main thread, or on a platform without wakeup
    fds."""
    global _reader, _writer, _previous_fd, _thread_
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if _writer is None:
            _reader, _writer = socket.socketpair()
            _writer.setblocking(False)
            _thread_ = threading.Thread(target=_watch, args=(_reader,), name="tf-ipu-sigint",
                                        daemon=True)
            _thread_.start()
        ours = _writer.fileno()
        try:
            old = signal.set_wakeup_fd(ours, warn_on_full_buffer=False)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, _on_sigint)
        except (ValueError, OSError) as e:  # not the main interpreter, or a closed fd
            _log.debug("tf_ipu: cannot watch for Ctrl-C: %s", e)
            return False
        if old != ours:
            _previous_fd = old
        return True


def _watch(reader: socket.socket) -> None:
    global _interrupts_seen, _pending, _retrips, _reading
    while True:
        try:
            select.select([reader], [], [])
            _reading = True  # (before the bytes leave the fd: see _delivered)
            data = reader.recv(64)
        except (OSError, ValueError):
            _reading = False
            return
        if not data:
            _reading = False
            return
        sigints = data.count(signal.SIGINT)
        with _lock:
            own = min(sigints, _retrips)  # interrupt_main's, not the user's
            _retrips -= own
        if own:
            data = data.replace(bytes([signal.SIGINT]), b"", own)
            sigints -= own
        previous = _previous_fd
        if previous >= 0 and data:
            try:
                os.write(previous, data)
            except OSError:  # its owner closed it; nothing to forward to
                pass
        if sigints:
            _interrupts_seen += 1
            # (Before the callbacks: a call starting now fails at once. Not for a signal whose
            # KeyboardInterrupt was raised already, before its byte was read.)
            if _handler_installed() and time.monotonic() - _delivered_at > 0.05:
                _pending = True
        _reading = False
        if sigints:
            with _lock:
                callbacks = list(_callbacks)
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # a failing callback must not stop the watcher
                    _log.exception("tf_ipu: a Ctrl-C callback failed")


def _retrip() -> None:
    """Has the SIGINT handler run again soon (``RETRIP_SECONDS``), at the main thread's
    next bytecode then. Not at once: interrupt_main on the main thread would run it again
    right here."""

    def again() -> None:
        global _retrips
        with _lock:
            _retrips += 1
        _thread.interrupt_main(signal.SIGINT)

    timer = threading.Timer(RETRIP_SECONDS, again)
    timer.daemon = True
    timer.start()


def _unsafe(frame: FrameType | None) -> bool:
    """Whether ``frame`` or a caller is code that C++ called and where a KeyboardInterrupt
    would not reach the user as one."""
    while frame is not None:
        name = frame.f_code.co_filename
        if any(f in name for f in _UNSAFE_FILES):
            return True
        frame = frame.f_back
    return False


def _raise_when_safe() -> None:
    """Raises the held KeyboardInterrupt on the main thread at its first Python call or
    return (or C call) outside unsafe code: a profile hook (the main thread's own, so
    nothing else pays for it), removed then. With a profiler already installed (cProfile):
    the SIGINT handler runs again a moment later instead."""
    if sys.getprofile() is not None:
        _retrip()
        return
    sys.setprofile(_when_safe)


def _when_safe(frame: FrameType, event: str, arg: object) -> None:
    # Only where a function is about to start: raised at a return, the exception would
    # replace a result already made (a lock taken by ``__enter__`` or ``acquire`` would never
    # be released). Never inside a finalizer or a garbage collection, where Python swallows
    # it ("Exception ignored in ...") and the Ctrl-C would be lost.
    if event not in ("call", "c_call") or _collecting or _in_finalizer(frame) or _unsafe(frame):
        return
    sys.setprofile(None)
    _delivered()
    raise KeyboardInterrupt


_collecting = False  # a garbage collection is running (gc.callbacks)


def _gc_phase(phase: str, info: dict[str, int]) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_gc_phase)


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether ``frame`` or a caller is an object's ``__del__``, whose exceptions Python
    prints and drops."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _delivered() -> None:
    """The KeyboardInterrupt is raised now: the pending mark ends (once the watcher has read
    the signal's byte, so that it does not mark it again after)."""
    global _pending, _delivered_at
    reader = _reader
    end = time.monotonic() + 0.2
    while reader is not None and time.monotonic() < end:
        try:
            readable = select.select([reader], [], [], 0)[0]
        except (OSError, ValueError):
            break
        if not readable and not _reading:
            break
        time.sleep(0.002)
    _pending = False
    _delivered_at = time.monotonic()
    if _cancel_lock.acquire(timeout=3.0):  # a cancel in progress ends first (cancelling)
        _cancel_lock.release()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler (see the module docstring)."""
    global _held
    if _holding:
        _held = True
        return
    if _unsafe(frame) or _collecting or _in_finalizer(frame):
        _raise_when_safe()  # raised there, it would be lost or break TF's error handling
        return
    _delivered()
    raise KeyboardInterrupt


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Runs the block with Ctrl-C held back: a SIGINT during it (which also cancels the
    device call, see the module docstring) raises KeyboardInterrupt when the block ends,
    in place of the error the cancelled call raised. Only on the main thread and only while
    Python's default handler (or this module's) is installed; otherwise the block runs as it
    is."""
    global _deferring, _holding, _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler:
        install()
        handler = signal.getsignal(signal.SIGINT)
    if handler is not _on_sigint:
        yield
        return
    _deferring += 1
    _holding += 1
    try:
        yield
    except BaseException:
        if _end_deferring():
            raise KeyboardInterrupt from None
        raise
    if _end_deferring():
        raise KeyboardInterrupt


def _end_deferring() -> bool:
    """Closes a ``deferred_interrupt`` block: whether to raise KeyboardInterrupt now."""
    global _deferring, _holding, _held
    _deferring -= 1
    _holding -= 1
    if not _held or _deferring:
        return False  # an outer block raises it
    _held = False
    if _holding:  # (not expected: a held_back call around a deferred_interrupt block)
        _held = True
        return False
    _delivered()
    return True


@contextmanager
def held_back() -> Iterator[None]:
    """Around a device call that the main thread makes from inside TensorFlow (the
    IpuExecute kernel's callback): a SIGINT during it is raised as KeyboardInterrupt once TF
    has returned to Python, not inside the callback. Elsewhere the block runs as it is."""
    global _holding, _held
    if threading.current_thread() is not threading.main_thread() or not _handler_installed():
        yield
        return
    _holding += 1
    try:
        yield
    finally:
        _holding -= 1
        if _held and not _holding:
            _held = False
            _raise_when_safe()
