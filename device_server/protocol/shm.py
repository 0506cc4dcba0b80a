"""Shared-memory segments for the host<->device data path on one machine.

When the client (tf_ipu) and the device server run on the same host, tensors can go
through a file in a tmpfs (``/dev/shm``) mapped by both processes instead of being
streamed over gRPC::

    client                                              server
    ------                                              ------
    Segment.create(n)
      /dev/shm/tf_ipu-<pid>-<32 hex>, mode 0600,
      posix_fallocate(n), nonce -> header[0:16]
            |
            |---- gRPC: name, size, nonce ------------> Segment.attach(name, n, nonce)
            |                                             open O_NOFOLLOW, fstat checks
            |                                             (regular, our uid, 0600, size),
            |                                             mmap, compare nonce
            |                                             == the co-location probe
            |<--- ok (or error: fall back to streaming) --|
    Segment.unlink()
      the name is gone at once; the memory lives
      while either mapping exists, so nothing is
      left in /dev/shm even after kill -9 of either side

    [ header: 64 bytes (nonce, zero padding) | regions handed out by RegionAllocator ... ]

Only the stdlib and numpy are used; ``multiprocessing.shared_memory`` is avoided on
purpose (its resource tracker would unlink or warn about segments behind our back).
"""

from __future__ import annotations

import bisect
import errno
import hmac
import mmap
import operator
import os
import re
import secrets
import stat
import threading
import time
from types import TracebackType
from typing import Any

import numpy as np

__all__ = [
    "HEADER_BYTES",
    "NAME_PATTERN",
    "NAME_PREFIX",
    "NONCE_BYTES",
    "SHM_DIR_ENV",
    "RegionAllocator",
    "Segment",
    "ShmUnavailable",
    "default_directory",
    "free_bytes",
    "sweep_stale",
]

SHM_DIR_ENV = "TF_IPU_SHM_DIR"
"""Environment variable naming the directory segments are created in."""

HEADER_BYTES = 64
"""Bytes at the start of every segment reserved for the header (the nonce, then zeros)."""

NONCE_BYTES = 16
"""Length of the random nonce stored at offset 0 of the header."""

NAME_PREFIX = "tf_ipu-"
"""Prefix of every segment's file name."""

NAME_PATTERN = re.compile(r"tf_ipu-([1-9][0-9]*)-([0-9a-f]{32})", re.ASCII)
"""Valid segment names (use ``fullmatch``): ``tf_ipu-<decimal pid>-<32 lowercase hex>``."""

_ALIGNMENT = 64


def default_directory() -> str:
    """The directory for segments: ``$TF_IPU_SHM_DIR`` if set and non-empty, else ``/dev/shm``."""
    return os.environ.get(SHM_DIR_ENV) or "/dev/shm"


class ShmUnavailable(Exception):
    """Shared memory cannot be used for this transfer; the message says why.

    Callers catch it and fall back to streaming the data over gRPC.
    """


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process can still allocate in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _errno_text(exc: OSError) -> str:
    if exc.errno is None:
        return str(exc)
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{name}: {os.strerror(exc.errno)}"


def _as_size(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None


class Segment:
    """One mapped shared-memory file.

    Attributes:
        name: the file name, ``tf_ipu-<pid>-<32 hex>``.
        path: ``directory/name``; the file may already be unlinked.
        nbytes: size of the mapping in bytes, header included.
        nonce: the 16 random bytes at offset 0, proving both sides map the same file.
    """

    name: str
    path: str
    nbytes: int
    nonce: bytes

    def __init__(self, name: str, path: str, nbytes: int, nonce: bytes, mapping: mmap.mmap):
        """Wrap an existing mapping; use :meth:`create` or :meth:`attach` instead."""
        self.name = name
        self.path = path
        self.nbytes = nbytes
        self.nonce = nonce
        self._mmap: mmap.mmap | None = mapping

    # -- construction -------------------------------------------------------------------

    @classmethod
    def create(cls, nbytes: int, directory: str | None = None, margin: int = 16 << 20) -> Segment:
        """Create, size and map a new segment of ``nbytes`` bytes (client side).

        Stale segments of dead processes are swept first. Raises :class:`ShmUnavailable`
        when the filesystem has fewer than ``nbytes + margin`` bytes free (touching pages of
        an overcommitted tmpfs would raise SIGBUS) or when any step fails.
        """
        nbytes = _as_size(nbytes, "nbytes")
        margin = _as_size(margin, "margin")
        if nbytes < HEADER_BYTES:
            raise ValueError(f"a segment needs at least {HEADER_BYTES} bytes, asked {nbytes}")
        if margin < 0:
            raise ValueError(f"margin must be non-negative, got {margin}")
        directory = directory if directory is not None else default_directory()
        sweep_stale(directory)
        try:
            available = free_bytes(directory)
        except OSError as exc:
            raise ShmUnavailable(
                f"{directory}: cannot query free space ({_errno_text(exc)})"
            ) from exc
        if available < nbytes + margin:
            raise ShmUnavailable(
                f"{directory}: {nbytes} bytes asked (+{margin} margin), only {available} bytes free"
            )

        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(directory, name)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise ShmUnavailable(f"{path}: cannot create ({_errno_text(exc)})") from exc
        try:
            try:
                os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)
                else:  # pragma: no cover - non-Linux
                    os.ftruncate(fd, nbytes)
                mapping = mmap.mmap(fd, nbytes)
            except OSError as exc:
                _unlink_quietly(path)
                raise ShmUnavailable(
                    f"{path}: cannot allocate {nbytes} bytes ({_errno_text(exc)}); "
                    f"{_free_text(directory)}"
                ) from exc
        finally:
            os.close(fd)
        nonce = secrets.token_bytes(NONCE_BYTES)
        mapping[0:NONCE_BYTES] = nonce
        return cls(name, path, nbytes, nonce, mapping)

    @classmethod
    def attach(cls, name: str, nbytes: int, nonce: bytes, directory: str | None = None) -> Segment:
        """Map the client's segment ``name`` (server side) and check it is the same file.

        Succeeds only if the file is found here, is a regular file owned by this uid with
        no group/other permissions, holds at least ``nbytes`` bytes and starts with
        ``nonce``. Raises :class:`ShmUnavailable` naming the failed check otherwise.
        """
        if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
            raise ShmUnavailable(f"invalid segment name {name!r}")
        try:
            nbytes = _as_size(nbytes, "nbytes")
        except TypeError as exc:
            raise ShmUnavailable(str(exc)) from None
        if nbytes < HEADER_BYTES:
            raise ShmUnavailable(
                f"segment {name}: size {nbytes} is smaller than the {HEADER_BYTES}-byte header"
            )
        if not isinstance(nonce, bytes | bytearray | memoryview) or len(nonce) != NONCE_BYTES:
            raise ShmUnavailable(f"segment {name}: the nonce must be {NONCE_BYTES} bytes")
        nonce = bytes(nonce)
        directory = directory if directory is not None else default_directory()
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmUnavailable(
                f"{path}: not on this machine's shared memory (a different host or container?)"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ShmUnavailable(f"{path}: is a symbolic link") from None
            raise ShmUnavailable(f"{path}: cannot open ({_errno_text(exc)})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmUnavailable(f"{path}: not a regular file")
            if st.st_uid != os.getuid():
                raise ShmUnavailable(
                    f"{path}: owned by uid {st.st_uid}, this process runs as uid {os.getuid()}"
                )
            if st.st_mode & 0o077:
                raise ShmUnavailable(
                    f"{path}: mode {stat.S_IMODE(st.st_mode):04o} gives group/other access "
                    "(0600 expected)"
                )
            if st.st_size < nbytes:
                raise ShmUnavailable(f"{path}: file has {st.st_size} bytes, {nbytes} asked")
            try:
                mapping = mmap.mmap(fd, nbytes)
            except OSError as exc:
                raise ShmUnavailable(
                    f"{path}: cannot map {nbytes} bytes ({_errno_text(exc)})"
                ) from None
        except OSError as exc:  # fstat
            raise ShmUnavailable(f"{path}: cannot stat ({_errno_text(exc)})") from None
        finally:
            os.close(fd)
        if not hmac.compare_digest(mapping[0:NONCE_BYTES], nonce):
            mapping.close()
            raise ShmUnavailable(f"{path}: nonce mismatch (not the segment the client created)")
        return cls(name, path, nbytes, nonce, mapping)

    # -- lifetime ------------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the file's name; the mappings stay valid. Calling it again is harmless."""
        _unlink_quietly(self.path)

    def close(self) -> None:
        """Unmap (idempotent, never raises).

        If numpy arrays or memoryviews still use the mapping, only this object's reference
        is dropped: the memory is unmapped when the last view is garbage-collected.
        """
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        try:
            mapping.close()
        except BufferError:
            pass  # exported views keep the mmap object (and its pages) alive
        except Exception:  # close() must never raise
            pass

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._mmap is None

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Segment {self.name} {self.nbytes} bytes {state}>"

    # -- data access ---------------------------------------------------------------------

    def _mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mmap

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"range offset={offset} nbytes={nbytes} is outside segment {self.name} "
                f"(usable [{HEADER_BYTES}, {self.nbytes}) of {self.nbytes} bytes)"
            )

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """A writable memoryview of ``nbytes`` bytes at ``offset`` (no copy)."""
        offset = _as_size(offset, "offset")
        nbytes = _as_size(nbytes, "nbytes")
        self._check_range(offset, nbytes)
        return memoryview(self._mapping())[offset : offset + nbytes]

    def array(self, offset: int, dtype: Any, shape: Any, writable: bool = False) -> np.ndarray:
        """A C-ordered numpy view of ``shape``/``dtype`` at ``offset`` (no copy).

        The view is read-only unless ``writable``. It stays valid after :meth:`close`.
        """
        offset = _as_size(offset, "offset")
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError(f"dtype {dt} holds Python objects and cannot live in a segment")
        dims = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        dims = tuple(_as_size(d, "shape entries") for d in dims)
        if any(d < 0 for d in dims):
            raise ValueError(f"negative dimension in shape {dims}")
        nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        self._check_range(offset, nbytes)
        view = np.ndarray(dims, dtype=dt, buffer=self._mapping(), offset=offset, order="C")
        if not writable:
            view.flags.writeable = False
        return view

    def write(self, offset: int, array: np.ndarray) -> None:
        """Copy ``array``'s elements in C order to ``offset`` (one copy, no temporaries)."""
        source = np.asarray(array)
        target = self.array(offset, source.dtype, source.shape, writable=True)
        np.copyto(target, source, casting="no")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _free_text(directory: str) -> str:
    try:
        return f"{free_bytes(directory)} bytes free in {directory}"
    except OSError as exc:
        return f"free space of {directory} unknown ({_errno_text(exc)})"


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):
        return False  # exists (EPERM: another user's) or not a pid we can reason about
    return False


def sweep_stale(directory: str | None = None, min_age_seconds: float = 60.0) -> list[str]:
    """Remove segments left in ``directory`` by processes that no longer exist.

    Only files named ``tf_ipu-<pid>-<hex>``, owned by this uid, whose pid is gone and that
    are older than ``min_age_seconds`` are removed (a name lives for milliseconds; the age
    keeps a process of another pid namespace sharing the directory safe). Returns the
    removed names; never raises.
    """
    removed: list[str] = []
    try:
        directory = directory if directory is not None else default_directory()
        uid = os.getuid()
        own_pid = os.getpid()
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    match = NAME_PATTERN.fullmatch(entry.name)
                    if match is None:
                        continue
                    pid = int(match.group(1))
                    if pid == own_pid:
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                        continue
                    if time.time() - st.st_mtime < min_age_seconds:
                        continue
                    if not _pid_gone(pid):
                        continue
                    os.unlink(entry.path)
                    removed.append(entry.name)
                except Exception:  # best effort, per file
                    continue
    except Exception:  # never raises
        pass
    return removed


class RegionAllocator:
    """Thread-safe first-fit allocator of 64-byte-aligned regions in ``[HEADER_BYTES, capacity)``.

    Requests are rounded up to a multiple of 64 bytes (0 bytes counts as 64); freed ranges
    are coalesced with their free neighbours.
    """

    def __init__(self, capacity: int):
        """Manage a segment of ``capacity`` bytes (the header included)."""
        capacity = _as_size(capacity, "capacity")
        if capacity < HEADER_BYTES:
            raise ValueError(f"capacity {capacity} is smaller than the {HEADER_BYTES}-byte header")
        self._capacity = capacity
        self._lock = threading.Lock()
        # Sorted, disjoint, non-adjacent free ranges: parallel lists of starts and ends.
        self._starts: list[int] = [HEADER_BYTES] if capacity > HEADER_BYTES else []
        self._ends: list[int] = [capacity] if capacity > HEADER_BYTES else []
        self._allocated: dict[int, int] = {}
        self._used = 0

    @property
    def capacity(self) -> int:
        """Total bytes managed, the header included."""
        return self._capacity

    @property
    def used(self) -> int:
        """Bytes currently allocated (after rounding)."""
        return self._used

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free region of at least ``nbytes`` bytes, or None if none is large enough."""
        nbytes = _as_size(nbytes, "nbytes")
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        need = max(nbytes, 1)
        rounded = -(-need // _ALIGNMENT) * _ALIGNMENT
        with self._lock:
            for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
                length = end - start
                if length < need:
                    continue
                # Only the range ending at an unaligned capacity can be shorter than `rounded`.
                take = min(rounded, length)
                if take == length:
                    del self._starts[i]
                    del self._ends[i]
                else:
                    self._starts[i] = start + take
                self._allocated[start] = take
                self._used += take
                return start
        return None

    def free(self, offset: int) -> None:
        """Return the region at ``offset``; ValueError if ``offset`` is not allocated."""
        with self._lock:
            size = self._allocated.pop(offset, None)
            if size is None:
                raise ValueError(f"offset {offset} is not an allocated region")
            self._used -= size
            start, end = offset, offset + size
            i = bisect.bisect_left(self._starts, start)
            merge_prev = i > 0 and self._ends[i - 1] == start
            merge_next = i < len(self._starts) and self._starts[i] == end
            if merge_prev and merge_next:
                self._ends[i - 1] = self._ends[i]
                del self._starts[i]
                del self._ends[i]
            elif merge_prev:
                self._ends[i - 1] = end
            elif merge_next:
                self._starts[i] = start
            else:
                self._starts.insert(i, start)
                self._ends.insert(i, end)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ``(start, end)`` ranges, sorted (a snapshot, for tests and debugging)."""
        with self._lock:
            return list(zip(self._starts, self._ends, strict=True))

    def __repr__(self) -> str:
        return f"<RegionAllocator used={self._used} capacity={self._capacity}>"
