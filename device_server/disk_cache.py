"""The executable cache on disk: compiled programs kept across server restarts.

    Compile --> ExecutableCache (memory, LRU) --miss--> DiskCache.load(key) --miss--> compile_module
                                                        DiskCache.store(key, record) <--'

A folder (``--executable-cache-path``, Graphcore's ``--executable_cache_path``) holds one file
per executable, ``<key>.tfipu-exe``, where ``key`` is ``executable_cache.cache_key`` (the
sha256 of the module, the target and the options), and ``index.json`` (key -> file, size,
created, last use). An entry holds what planning the module produced, as plain data: the
record of ``Executable.cache_record`` (signature, instruction count and the whole tile-model
estimate) as zlib-compressed JSON. It holds no code: the program that runs is always
generated from the module the client sent (``executable.executable_from_record``), so a file
put in the folder can at worst give a wrong estimate, never run anything. Nothing is
unpickled, evaluated or imported from the folder.

An entry file is::

    tf_ipu executable cache entry\\n                       (MAGIC)
    {"format": 1, "version": ..., "build": ..., "key": ..., "created": ...,
     "content_bytes": N, "content_sha256": ...}\\n        (one line of JSON)
    N bytes: zlib(JSON of the record)

``load`` trusts an entry only if the magic and the format are right, ``version`` and
``build`` are this server's (``device_server.__version__`` and a hash of the emulator's
sources: entries written by other code are stale), ``key`` is the key asked for (a file
copied under another key's name is foreign), and the content has exactly N bytes with that
sha256 and decodes. Anything else is logged (a warning naming the file and why; INFO for a
stale one), the file is deleted, and the program is compiled and written again.

**Planned once.** Several servers sharing the folder (the servers of one ``tf-ipu-run``,
each serving one instance) compile the same program at about the same time. The service
asks for a program under ``planning(key)``: an exclusive ``fcntl.flock`` of
``.plan-<key>.lock`` in the folder. The first server takes it, finds no entry, plans the
program and writes the entry; the others wait on the lock (polled, so that a stopped
Compile stops waiting: ``cancel.checkpoint``), then find the entry and load it (counter
``disk_cache_plan_waits``). A server that dies holding the lock releases it (the kernel
drops a dead process's flocks), and the next one plans. The holder deletes the lock file
before releasing it; a waiter that then gets the lock of a deleted file (the path names
another file, or none) opens the path again, so two holders never share a key. A program
that fails to plan is not cached, so each waiter plans it in turn (and fails alike).

Writes are atomic (a temporary file in the folder, then ``os.replace``), as are rewrites of
the index. Index updates (and the size bound's evictions, least recently used first, after
each write) happen under an ``fcntl.flock`` of ``.lock``, so several server processes may
share a folder. A missing or corrupt index is rebuilt from the entry files (last use: their
modification time); files whose names are not entries are left alone. The folder is created
with mode 0700; entries and the index are 0600.

Not done: entries are checked for corruption and mix-ups, not signed; whoever can write the
folder can make an entry whose estimate lies (keep the folder private).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import device_server
from device_server.emulator import cancel

logger = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"tf_ipu executable cache entry\n"
SUFFIX = ".tfipu-exe"
INDEX_NAME = "index.json"
LOCK_NAME = ".lock"
#: Default bound of the folder's entries (``--executable-cache-bytes``).
DEFAULT_MAX_BYTES = 2 << 30
_MAX_HEADER_BYTES = 4096
_MAX_RECORD_BYTES = 256 << 20  # a record decompressed (a big model's is a few MB)
_KEY = re.compile(r"[0-9a-f]{64}")
_STALE_TEMP_SECONDS = 3600.0
PLAN_LOCK_PREFIX = ".plan-"
#: Polling of a plan lock held by another server: first sleep, longest sleep (seconds).
_PLAN_POLL_FIRST, _PLAN_POLL_MAX = 0.005, 0.05


class EntryRejected(ValueError):
    """An entry that is not trusted: ``why`` says what is wrong; ``stale`` when it is only
    from another version of the server."""

    def __init__(self, why: str, stale: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.stale = stale


def _hash_tree(h: Any, folder: Path) -> None:
    for path in sorted(folder.rglob("*.py")):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")


_build_id: str | None = None


def build_id() -> str:
    """A hash of what makes an entry's record: the sources of the emulator and of the
    protocol, and numpy's version (computed once per process)."""
    global _build_id
    if _build_id is None:
        root = Path(device_server.__file__).resolve().parent
        h = hashlib.sha256(f"numpy {np.__version__}\0".encode())
        for sub in ("emulator", "protocol"):
            _hash_tree(h, root / sub)
        _build_id = h.hexdigest()[:32]
    return _build_id


def encode_entry(key: str, record: dict[str, Any], created: float | None = None) -> bytes:
    """The bytes of the entry file for ``key`` holding ``record``."""
    content = zlib.compress(json.dumps(record, separators=(",", ":"), allow_nan=True).encode(), 6)
    header = {
        "format": FORMAT,
        "version": device_server.__version__,
        "build": build_id(),
        "key": key,
        "created": time.time() if created is None else created,
        "content_bytes": len(content),
        "content_sha256": hashlib.sha256(content).hexdigest(),
    }
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + content


def decode_entry(data: bytes, key: str) -> dict[str, Any]:
    """The record in entry bytes written for ``key``.

    Raises:
        EntryRejected: saying what is wrong (``stale`` for another server version's entry).
    """
    if not data.startswith(MAGIC):
        raise EntryRejected("it is not an entry (no magic line)")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + _MAX_HEADER_BYTES)
    if end < 0:
        raise EntryRejected("its header line is missing or too long")
    try:
        header = json.loads(data[len(MAGIC):end])
    except (ValueError, RecursionError) as e:
        raise EntryRejected(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise EntryRejected("its header is not a JSON object")
    if header.get("format") != FORMAT:
        raise EntryRejected(f"format {header.get('format')!r}, not {FORMAT}", stale=True)
    for name, ours in (("version", device_server.__version__), ("build", build_id())):
        if header.get(name) != ours:
            raise EntryRejected(f"written by another server ({name} {header.get(name)!r}, "
                                f"this one is {ours!r})", stale=True)
    if header.get("key") != key:
        raise EntryRejected(f"foreign: written for key {str(header.get('key'))[:64]!r}")
    content = data[end + 1:]
    size, digest = header.get("content_bytes"), header.get("content_sha256")
    if not isinstance(size, int) or len(content) != size:
        raise EntryRejected(f"truncated or padded: {len(content)} content bytes, the header "
                            f"says {size!r}")
    if hashlib.sha256(content).hexdigest() != digest:
        raise EntryRejected("its content does not match its sha256 (corrupt)")
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(content, _MAX_RECORD_BYTES)
        if inflate.unconsumed_tail or not inflate.eof:
            raise EntryRejected("its content is incomplete or too big when decompressed")
        record = json.loads(raw)
    except EntryRejected:
        raise
    except (zlib.error, ValueError, RecursionError) as e:
        raise EntryRejected(f"its content does not decode ({type(e).__name__}: {e})") from None
    if not isinstance(record, dict):
        raise EntryRejected("its record is not a JSON object")
    return record


class DiskCache:
    """A folder of executable records (see the module docstring), bounded in bytes.

    Args:
        path: the folder; created (mode 0700) if absent.
        max_bytes: bound of the entries' total size; the least recently used go first.

    Raises:
        ValueError: the folder cannot be made or used, or ``max_bytes`` < 1.

    Example:
        >>> disk = DiskCache("/tmp/exe-cache")
        >>> disk.store(key, exe.cache_record())
        >>> record = disk.load(key)      # None: not there (or rejected, and deleted)
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"the executable cache's size bound must be >= 1 byte. "
                             f"Received: {max_bytes}")
        self.path = Path(path).expanduser().resolve()
        self.max_bytes = int(max_bytes)
        self.stats = {"hits": 0, "misses": 0, "writes": 0, "rejected": 0, "evictions": 0,
                      "write_errors": 0, "plan_waits": 0}
        self._lock = threading.Lock()  # the index, among this process's threads
        self._stats_lock = threading.Lock()
        try:
            if not self.path.is_dir():
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(self.path, 0o700)
            elif self.path.stat().st_mode & 0o022:
                logger.warning("executable cache: %s is writable by other users; whoever can "
                               "write it can make the estimates of this server's programs",
                               self.path)
            with self._locked():
                index = self._read_index(reconcile=True)
                self._evict(index, keep="")
                self._write_index(index)
        except OSError as e:
            raise ValueError(f"executable cache path {str(path)!r} cannot be used: "
                             f"{type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        index = self.entries()
        return (f"DiskCache(path={str(self.path)!r}, entries={len(index)}, "
                f"bytes={sum(e['size'] for e in index.values())}/{self.max_bytes}, "
                f"hits={self.stats['hits']}, rejected={self.stats['rejected']})")

    def file_of(self, key: str) -> Path:
        """The entry file of ``key``."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"an executable cache key is 64 hex digits. Received: {key!r}")
        return self.path / f"{key}{SUFFIX}"

    def entries(self) -> dict[str, dict[str, Any]]:
        """The index: key -> ``{"file", "size", "created", "last_use"}``."""
        with self._locked():
            return self._read_index()

    # -- reading -------------------------------------------------------------------------

    def load(self, key: str) -> dict[str, Any] | None:
        """The record stored for ``key``, checked (see the module docstring); None if there
        is none, or it was rejected (then it is logged and deleted)."""
        path = self.file_of(key)
        try:
            data = _read_regular_file(path, self.max_bytes)
        except FileNotFoundError:
            self._count("misses")
            return None
        except (OSError, EntryRejected) as e:
            self.reject(key, e.why if isinstance(e, EntryRejected) else f"unreadable ({e})")
            return None
        try:
            record = decode_entry(data, key)
        except EntryRejected as e:
            self.reject(key, e.why, stale=e.stale)
            return None
        self._count("hits")
        try:
            with self._locked():
                index = self._read_index()
                entry = index.get(key)
                if entry is None and path.exists():  # the index lost it (rebuilt meanwhile)
                    entry = index[key] = _entry_of(path, len(data))
                if entry is not None:  # else evicted meanwhile: the record read is still good
                    entry["last_use"] = time.time()
                    self._write_index(index)
        except OSError as e:
            logger.warning("executable cache: cannot update the index in %s: %s", self.path, e)
        return record

    def reject(self, key: str, why: str, stale: bool = False) -> None:
        """Logs that the entry of ``key`` is not trusted and why, and deletes it (never
        raises: the program is compiled anyway)."""
        path = self.file_of(key)
        self._count("rejected")
        log = logger.info if stale else logger.warning
        log("executable cache: ignoring %s: %s; the program is compiled again", path, why)
        try:
            with self._locked():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                index = self._read_index()
                if index.pop(key, None) is not None:
                    self._write_index(index)
        except OSError as e:  # e.g. a folder in the entry's place: left as it is
            logger.warning("executable cache: cannot delete %s: %s", path, e)

    # -- writing -------------------------------------------------------------------------

    def store(self, key: str, record: dict[str, Any]) -> bool:
        """Writes the entry of ``key`` (atomically) and evicts least recently used entries
        beyond the size bound. Failures are logged, not raised: the server goes on without
        the entry. Returns whether it was written."""
        path = self.file_of(key)
        try:
            data = encode_entry(key, record)
        except (TypeError, ValueError) as e:
            logger.warning("executable cache: cannot encode the entry of %s: %s", key[:16], e)
            self._count("write_errors")
            return False
        if len(data) > self.max_bytes:
            logger.warning("executable cache: the entry of %s (%d bytes) is larger than the "
                           "bound (%d bytes); not kept", key[:16], len(data), self.max_bytes)
            self._count("write_errors")
            return False
        try:
            tmp = _write_temporary(path, data)
            with self._locked():  # the file and its index entry change together
                _replace(tmp, path)
                index = self._read_index()
                now = time.time()
                index[key] = {"file": path.name, "size": len(data), "created": now, "last_use": now}
                self._evict(index, keep=key)
                self._write_index(index)
        except OSError as e:
            logger.warning("executable cache: cannot write %s: %s", path, e)
            self._count("write_errors")
            return False
        self._count("writes")
        return True

    # -- planned once --------------------------------------------------------------------

    def plan_lock_of(self, key: str) -> Path:
        """The lock file of ``key``'s planning (see ``planning``)."""
        return self.path / f"{PLAN_LOCK_PREFIX}{self.file_of(key).stem}.lock"

    @contextlib.contextmanager
    def planning(self, key: str) -> Iterator[bool]:
        """Holds the plan lock of ``key`` for the block: the servers sharing this folder
        plan a program one at a time, so that the first plans and writes it and the others,
        once they hold the lock, load it (module docstring, "Planned once"). Yields whether
        another process (or thread) held the lock first.

        Raises:
            RunStopped: this thread's Compile was stopped while it waited.
            OSError: the lock file cannot be made.
        """
        path = self.plan_lock_of(key)
        waited = False
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if not _try_flock(fd):
                    if not waited:
                        waited = True
                        self._count("plan_waits")
                        logger.info("executable cache: another server plans %s; waiting for "
                                    "its entry", key[:16])
                    sleep = _PLAN_POLL_FIRST
                    while not _try_flock(fd):
                        cancel.checkpoint(f"waiting for another server's plan of {key[:16]}")
                        time.sleep(sleep)
                        sleep = min(_PLAN_POLL_MAX, sleep * 2)
                same = _same_file(fd, path)  # else the holder deleted it: open it again
            except BaseException:
                os.close(fd)
                raise
            if same:
                break
            os.close(fd)
        try:
            yield waited
        finally:
            with contextlib.suppress(OSError):
                path.unlink()  # under the lock: see the module docstring
            os.close(fd)  # releases the lock

    # -- the index -----------------------------------------------------------------------

    def _count(self, name: str, amount: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += amount

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's threads, then other processes (flock) out of the index."""
        with self._lock:
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the lock

    def _read_index(self, reconcile: bool = False) -> dict[str, dict[str, Any]]:
        """The index (under ``_locked``); rebuilt from the files if missing or corrupt, and
        checked against them when ``reconcile``."""
        path = self.path / INDEX_NAME
        try:
            raw = json.loads(_read_regular_file(path, 64 << 20))
            entries = raw.get("entries") if isinstance(raw, dict) and raw.get("format") == FORMAT else None
            if not isinstance(entries, dict) or not all(
                    _KEY.fullmatch(k) and _valid_entry(v) for k, v in entries.items()):
                raise ValueError("not an index of this format")
        except FileNotFoundError:
            return self._scan()
        except (OSError, ValueError, RecursionError, EntryRejected) as e:
            logger.warning("executable cache: %s is unreadable (%s); rebuilding it from the "
                           "entry files", path, getattr(e, "why", e))
            return self._scan()
        if reconcile:
            found = self._scan()
            entries = {k: v for k, v in entries.items() if k in found}
            for k, v in found.items():
                entries.setdefault(k, v)
                entries[k]["size"] = v["size"]
        return entries

    def _scan(self) -> dict[str, dict[str, Any]]:
        """An index made from the entry files (and old temporary files removed)."""
        entries: dict[str, dict[str, Any]] = {}
        now = time.time()
        for p in self.path.iterdir():
            try:
                if p.name.startswith(".tmp-"):
                    if now - p.lstat().st_mtime > _STALE_TEMP_SECONDS:
                        p.unlink()
                    continue
                if p.suffix == SUFFIX and _KEY.fullmatch(p.stem) and p.is_file() and not p.is_symlink():
                    entries[p.stem] = _entry_of(p, p.stat().st_size)
            except OSError:
                continue  # gone meanwhile
        return entries

    def _write_index(self, entries: dict[str, dict[str, Any]]) -> None:
        data = json.dumps({"format": FORMAT, "entries": entries}, sort_keys=True, indent=1)
        path = self.path / INDEX_NAME
        _replace(_write_temporary(path, data.encode()), path)

    def _evict(self, index: dict[str, dict[str, Any]], keep: str) -> None:
        """Deletes least recently used entries (not ``keep``) until the bound holds."""
        total = sum(e["size"] for e in index.values())
        for key in sorted(index, key=lambda k: index[k]["last_use"]):
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            entry = index.pop(key)
            total -= entry["size"]
            with contextlib.suppress(FileNotFoundError):
                (self.path / entry["file"]).unlink()
            self._count("evictions")
            logger.info("executable cache: evicted %s (%d bytes, least recently used)",
                        entry["file"], entry["size"])


def _try_flock(fd: int) -> bool:
    """Takes the exclusive flock of ``fd`` if it is free; whether it did."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _valid_entry(v: Any) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("file"), str) and _KEY.fullmatch(v["file"].removesuffix(SUFFIX)) is not None
            and v["file"].endswith(SUFFIX)
            and all(isinstance(v.get(f), (int, float)) and not isinstance(v.get(f), bool)
                    for f in ("size", "created", "last_use")))


def _entry_of(path: Path, size: int) -> dict[str, Any]:
    mtime = path.stat().st_mtime
    return {"file": path.name, "size": int(size), "created": mtime, "last_use": mtime}


def _read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file (not through a symbolic link) of at most ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not (st.st_mode & 0o170000 == 0o100000):
            raise EntryRejected("it is not a regular file")
        if st.st_size > limit:
            raise EntryRejected(f"it is {st.st_size} bytes, more than the cache may hold")
        return f.read(limit + 1)


def _write_temporary(path: Path, data: bytes) -> str:
    """A new file (mode 0600) beside ``path`` holding ``data``; ``_replace`` makes it ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def _replace(tmp: str, path: Path) -> None:
    """Renames ``tmp`` to ``path`` atomically (readers see the old file or the new one)."""
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
