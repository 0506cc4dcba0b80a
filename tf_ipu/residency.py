"""Where each variable's newest value is: the host's record of device-resident state.

    host variable (tf_ipu.variables.IPUVariable)      device server session
        |  write: note_host_write -> dirty  ---------->  uploaded before the next call
        |  read:  stale? -> refresh  <----------------   ReadVariables, on demand
        '  device call updates it -> stale               (the value stays on the device)

One ``Residency`` per runtime, keyed by the variable's device key (``variable_key``), so that
the same record can later say *which* IPU (replica, pipeline stage) holds a value. Per key:

- ``on_device``: the session holds a value (false after a new session: upload it);
- ``dirty``: the host wrote since the device's value was set (upload before the next call);
- ``stale``: the device holds a newer value than the host (a host read refreshes first);
- ``watched``: host writes cannot be seen through hooks (a variable created outside
  IPUStrategy's scope, one known only by key, e.g. in a reloaded SavedModel, or one that a
  CPU ``tf.function`` writes): its bytes are compared with a snapshot before each call,
  which is what the ``host_bytes_compared`` counter counts. Zero for Keras models built in
  the strategy's scope.

This module holds state only; ``tf_ipu.runtime`` does the transfers. No TensorFlow import.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class VariableState:
    """What the host knows of one variable (module docstring)."""

    key: str
    ref: Any = None                       # weakref to the host variable, or None
    on_device: bool = False
    dirty: bool = True
    stale: bool = False
    watched: bool = False
    snapshot: np.ndarray | None = None    # watched: the bytes the device was last given

    def variable(self) -> Any:
        return None if self.ref is None else self.ref()


@dataclass
class LostState:
    """What a lost session took with it: the variables whose newest value was on the device
    only, and the last point at which the host held every variable."""

    keys: list[str]
    host_holds: str

    def describe(self) -> str:
        shown = ", ".join(k.split("#")[0] for k in self.keys[:4])
        more = f" and {len(self.keys) - 4} more" if len(self.keys) > 4 else ""
        return (
            f"the device held newer values of {len(self.keys)} variables ({shown}{more}) than "
            f"the host, and they are lost with the session. The host holds the weights of "
            f"{self.host_holds}: training goes on from there (Keras's BackupAndRestore "
            f"callback resumes from its last checkpoint)."
        )


@dataclass
class Residency:
    """The table of ``VariableState`` by key, plus counters (module docstring)."""

    states: dict[str, VariableState] = field(default_factory=dict)
    host_holds: str = "step 0 (before the first device call)"
    counters: dict[str, int] = field(default_factory=lambda: {
        "host_bytes_compared": 0,      # watched variables' bytes compared before calls
        "variable_bytes_uploaded": 0,  # host -> device
        "variable_bytes_refreshed": 0, # device -> host, on demand or at sync points
        "variables_refreshed": 0,
    })

    def track(self, key: str, variable: Any) -> VariableState:
        """Registers a host variable whose reads and writes are hooked."""
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = VariableState(key)
        st.ref = weakref.ref(variable)
        return st

    def get(self, key: str) -> VariableState:
        """The state of ``key``; a key seen for the first time is watched by content."""
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = VariableState(key, watched=True)
        return st

    def note_host_write(self, key: str) -> None:
        st = self.get(key)
        st.dirty = True
        st.stale = False

    def forget_device_value(self, key: str) -> None:
        """The host is about to overwrite ``key`` whole: its device value need not be fetched."""
        st = self.states.get(key)
        if st is not None:
            st.stale = False

    def stale_keys(self, keys: Iterable[str] | None = None) -> list[str]:
        if keys is None:
            keys = list(self.states)
        out = []
        for k in keys:
            st = self.states.get(k)
            if st is not None and st.stale:
                if st.ref is not None and st.variable() is None:  # the variable is gone
                    del self.states[k]
                    continue
                out.append(k)
        return out

    def needs_upload(self, st: VariableState, value: np.ndarray) -> bool:
        """Whether the host's ``value`` of ``st`` must be uploaded before a call."""
        if not st.on_device or st.dirty:
            return True
        if st.watched:
            self.counters["host_bytes_compared"] += int(value.nbytes)
            held = st.snapshot
            if held is None or not _same_bytes(held, value):
                st.stale = False  # the host wrote it: the host's value wins
                return True
        return False

    def uploaded(self, st: VariableState, value: np.ndarray) -> None:
        st.on_device = True
        st.dirty = False
        st.stale = False
        self.counters["variable_bytes_uploaded"] += int(value.nbytes)
        if st.watched:
            st.snapshot = value

    def device_updated(self, st: VariableState, returned: np.ndarray | None) -> None:
        """A device call produced a new value: it stays on the device (``returned`` is None)
        or came back for a watched variable the traced call assigns on the host."""
        if returned is None:
            st.stale = True
        elif st.watched:
            st.snapshot = returned

    def refreshed(self, st: VariableState, nbytes: int) -> None:
        st.stale = False
        self.counters["variable_bytes_refreshed"] += nbytes
        self.counters["variables_refreshed"] += 1

    def lose_session(self) -> LostState | None:
        """The session is gone: nothing is on the device any more; the host's copies become
        the truth. Returns what was lost, if anything."""
        lost = sorted(k for k in self.stale_keys())
        for st in self.states.values():
            st.on_device = False
            st.stale = False
            st.snapshot = None
        return LostState(lost, self.host_holds) if lost else None


_libc = ctypes.CDLL(None)
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.nbytes == 0:
        return True
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    return _libc.memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
