"""Ctrl-C reaches a running device call.

    Ctrl-C ──SIGINT──> Python's C-level handler ──signal number──> wakeup fd (a socket)
                                                                     │
         watcher thread (this module) <──────────────────────────────┘
           └─> callbacks: DeviceClient.cancel_running ──gRPC cancel──> the server stops
               the run at its next step, keeping the last completed step's variables
    main thread (in TF's C++, waiting for the step): TF returns the cancelled step, and the
           wrapper around it (``deferred_interrupt``) raises KeyboardInterrupt, as on a CPU.

Python runs signal handlers only on the main thread and only between bytecodes, so while the
main thread waits inside TensorFlow for a step (``model.fit``), a Ctrl-C alone would wait for
the device call to end. The signal's number is also written to the process's wakeup fd
(``signal.set_wakeup_fd``) at once, from C: this module owns that fd, and forwards every byte
to the fd that was installed before it (asyncio's, a notebook kernel's), so they keep
working. ``install`` must run on the main thread; it is called when the IPU system is
configured and again before device calls made on the main thread (someone may have replaced
the fd since). Around a device call, ``deferred_interrupt`` holds Python's own KeyboardInterrupt
back until TF has returned: raised inside TF's Python bindings, it would surface as a
RuntimeError from pybind11 instead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_log = logging.getLogger("tf_ipu")

_lock = threading.Lock()
_callbacks: list[Callable[[], None]] = []
_reader: socket.socket | None = None
_writer: socket.socket | None = None
_previous_fd = -1          # the wakeup fd installed before ours, to forward to
_thread: threading.Thread | None = None
_interrupts_seen = 0        # SIGINTs the watcher has passed on (for tests and logs)


def on_interrupt(callback: Callable[[], None]) -> None:
    """Calls ``callback()`` (on the watcher thread) at every SIGINT from now on."""
    with _lock:
        if callback not in _callbacks:
            _callbacks.append(callback)


def install() -> bool:
    """Makes this module's socket the process's signal wakeup fd (forwarding to the one it
    replaces). Returns False where it cannot: off the main thread, or on a platform without
    wakeup fds."""
    global _reader, _writer, _previous_fd, _thread
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if _writer is None:
            _reader, _writer = socket.socketpair()
            _writer.setblocking(False)
            _thread = threading.Thread(target=_watch, args=(_reader,), name="tf-ipu-sigint",
                                       daemon=True)
            _thread.start()
        ours = _writer.fileno()
        try:
            old = signal.set_wakeup_fd(ours, warn_on_full_buffer=False)
        except (ValueError, OSError) as e:  # not the main interpreter, or a closed fd
            _log.debug("tf_ipu: cannot watch for Ctrl-C: %s", e)
            return False
        if old != ours:
            _previous_fd = old
        return True


def _watch(reader: socket.socket) -> None:
    global _interrupts_seen
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        previous = _previous_fd
        if previous >= 0:
            try:
                os.write(previous, data)
            except OSError:  # its owner closed it; nothing to forward to
                pass
        if signal.SIGINT in data:
            _interrupts_seen += 1
            with _lock:
                callbacks = list(_callbacks)
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # a failing callback must not stop the watcher
                    _log.exception("tf_ipu: a Ctrl-C callback failed")


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Runs the block with Ctrl-C held back: a SIGINT during it (which also cancels the
    device call, see the module docstring) raises KeyboardInterrupt when the block ends,
    in place of the error the cancelled call raised. Only on the main thread and only while
    Python's default handler is installed; otherwise the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    seen: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        yield
    except BaseException:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if seen:
            raise KeyboardInterrupt from None
        raise
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if seen:
        raise KeyboardInterrupt
