"""Warnings said once per process: options and calls ported code uses that have no effect here.

    notices.once("IPUConfig.optimizations.combine_matmuls", "has no effect here: ...")
    -> WARNING tf_ipu: IPUConfig.optimizations.combine_matmuls has no effect here: ...

Each subject is warned about at most once (a notebook that re-runs a cell is not flooded);
``said()`` lists the subjects warned about so far and ``_forget()`` clears them (for tests; not part of the API).
"""

from __future__ import annotations

import logging
import threading

_log = logging.getLogger("tf_ipu")
_said: set[str] = set()
_lock = threading.Lock()


def once(subject: str, message: str) -> bool:
    """Logs ``"<subject> <message>"`` as a warning unless ``subject`` was warned about
    already; True if it was logged now."""
    with _lock:
        if subject in _said:
            return False
        _said.add(subject)
    _log.warning("tf_ipu: %s %s", subject, message)
    return True


def said() -> frozenset[str]:
    """The subjects warned about so far in this process."""
    with _lock:
        return frozenset(_said)


def _forget() -> None:
    """Forgets every subject (the next ``once`` of each warns again)."""
    with _lock:
        _said.clear()


__all__ = ["once", "said"]
