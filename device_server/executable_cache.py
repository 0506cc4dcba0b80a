"""The server-wide cache of compiled executables.

An executable is identified by what defines it: the sha256 of the deterministically
serialized IR module, the target architecture (IPU version, tiles per IPU) and the compile
options. Sessions never see these keys: they hold random per-session handle ids that point at
cache entries (see ``sessions.ExecutableHandle``), so knowing a hash grants nothing.

The cache is bounded (entries, least recently used out first). Two sessions that compile the
same program at the same time compile it once: the second waits for the first.
Compile failures are not cached.

This cache lives in the server's memory. Below it, with ``--executable-cache-path``, the
server keeps what compiling produced in a folder under the same keys, across restarts: the
``build`` function the service hands to ``get_or_compile`` looks there before it compiles
(``disk_cache.py``), holding the folder's plan lock of the key (``DiskCache.planning``), so
that the servers sharing the folder (those of one ``tf-ipu-run``) plan a program once in
all: the first plans and writes it, the others wait for it and load it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from device_server.protocol import ir_pb2

_KEY_VERSION = b"tf_ipu-executable-v1"


def cache_key(
    module: ir_pb2.Module,
    ipu_version: str,
    tiles_per_ipu: int,
    refuse_opcodes: frozenset[str],
    fault_inject_opcode: str,
    allow_out_of_memory: bool,
    numerics: Mapping[str, Any] | None = None,
) -> str:
    """The hex sha256 that identifies an executable.

    Args:
        module: the program.
        ipu_version: canonical architecture name (e.g. ``"ipu2"``).
        tiles_per_ipu: tiles per IPU the program is compiled for.
        refuse_opcodes, fault_inject_opcode, allow_out_of_memory: the effective compile
            options (after the server's own flags were merged in).
        numerics: the numerics options (partials, floating-point behaviour, seed) as the
            emulator's ``CompileOptions`` fields; None or empty for the defaults.

    Returns:
        64 hex digits.
    """
    fields: dict[str, Any] = {
        "ipu_version": ipu_version,
        "tiles_per_ipu": int(tiles_per_ipu),
        "refuse_opcodes": sorted(refuse_opcodes),
        "fault_inject_opcode": fault_inject_opcode,
        "allow_out_of_memory": bool(allow_out_of_memory),
    }
    # Only what differs from the defaults (False, 0, "", "float"), so default keys stay stable.
    changed = {k: v for k, v in (numerics or {}).items() if v not in (False, 0, "", "float")}
    if changed:
        fields["numerics"] = changed
    options = json.dumps(fields, sort_keys=True).encode()
    h = hashlib.sha256()
    h.update(_KEY_VERSION + b"\0")
    h.update(len(options).to_bytes(8, "little") + options)
    h.update(module.SerializeToString(deterministic=True))
    return h.hexdigest()


@dataclass(frozen=True)
class CacheLookup:
    """The result of ``ExecutableCache.get_or_compile``.

    Attributes:
        executable: the compiled executable.
        hit: True if no compile ran for this call (found, or compiled by a concurrent call).
        compile_seconds: wall time of the compile that produced it (0 for a hit).
    """

    executable: Any
    hit: bool
    compile_seconds: float


class ExecutableCache:
    """A bounded LRU map from cache key to compiled executable.

    Args:
        max_entries: how many executables to keep; the least recently used goes first.
    """

    def __init__(self, max_entries: int = 128) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1. Received: {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._in_flight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"ExecutableCache(entries={len(self)}/{self.max_entries}, hits={self.hits}, "
            f"misses={self.misses}, evictions={self.evictions})"
        )

    def get_or_compile(self, key: str, compile_fn: Callable[[], Any]) -> CacheLookup:
        """Returns the executable for ``key``, compiling it with ``compile_fn`` if needed.

        Args:
            key: from ``cache_key``.
            compile_fn: builds the executable; its exceptions propagate to every caller
                waiting on this key, and nothing is cached.

        Returns:
            A ``CacheLookup``.
        """
        with self._lock:
            exe = self._entries.get(key)
            if exe is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return CacheLookup(exe, True, 0.0)
            pending = self._in_flight.get(key)
            if pending is None:
                pending = Future()
                self._in_flight[key] = pending
                owner = True
                self.misses += 1
            else:
                owner = False
                self.hits += 1
        if not owner:
            return CacheLookup(pending.result(), True, 0.0)

        start = time.perf_counter()
        try:
            exe = compile_fn()
        except BaseException as e:
            with self._lock:
                self._in_flight.pop(key, None)
            pending.set_exception(e)
            raise
        seconds = time.perf_counter() - start
        with self._lock:
            self._in_flight.pop(key, None)
            self._entries[key] = exe
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1
        pending.set_result(exe)
        return CacheLookup(exe, False, seconds)
