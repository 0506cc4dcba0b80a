"""Tests for device_server.protocol.shm (shared-memory segments); no TensorFlow, no server."""

from __future__ import annotations

import errno
import os
import random
import re
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from device_server.protocol import shm
from device_server.protocol.shm import (
    HEADER_BYTES,
    NAME_PATTERN,
    NONCE_BYTES,
    RegionAllocator,
    Segment,
    ShmUnavailable,
)

SIZE = 1 << 16


@pytest.fixture
def pair(tmp_path):
    """A created segment and the same segment attached, both in ``tmp_path``."""
    created = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    attached = Segment.attach(created.name, SIZE, created.nonce, directory=str(tmp_path))
    yield created, attached
    attached.close()
    created.unlink()
    created.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _stale_file(directory, pid: int, age: float = 3600.0) -> str:
    name = f"tf_ipu-{pid}-{os.urandom(16).hex()}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    then = time.time() - age
    os.utime(path, (then, then))
    return name


# -- segments ------------------------------------------------------------------------------


def test_default_directory(monkeypatch):
    monkeypatch.delenv(shm.SHM_DIR_ENV, raising=False)
    assert shm.default_directory() == "/dev/shm"
    monkeypatch.setenv(shm.SHM_DIR_ENV, "/somewhere")
    assert shm.default_directory() == "/somewhere"


def test_create_attach_share_bytes_both_ways(pair):
    created, attached = pair
    assert attached.nonce == created.nonce and len(created.nonce) == NONCE_BYTES
    assert attached.nbytes == created.nbytes == SIZE

    data = np.arange(1000, dtype=np.float32).reshape(10, 100)
    created.write(HEADER_BYTES, data)
    seen = attached.array(HEADER_BYTES, np.float32, (10, 100))
    np.testing.assert_array_equal(seen, data)
    assert not seen.flags.writeable

    back = np.linspace(-1, 1, 77).astype(np.float64)[::-1]  # not contiguous
    attached.write(8192, back)
    np.testing.assert_array_equal(created.array(8192, np.float64, 77), back)

    # a writable view on one side is visible on the other without copies
    view = created.array(4096, np.int64, (4,), writable=True)
    view[:] = [1, 2, 3, 4]
    np.testing.assert_array_equal(attached.array(4096, "<i8", 4), [1, 2, 3, 4])
    attached.buffer(4096, 8)[:] = (9).to_bytes(8, "little")
    assert view[0] == 9
    del view, seen


def test_attach_from_another_process(tmp_path):
    """The real flow: a second process attaches, the creator unlinks, both keep sharing."""
    child = (
        "import sys, numpy as np\n"
        "from device_server.protocol.shm import Segment\n"
        "name, nonce, d = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]\n"
        f"s = Segment.attach(name, {SIZE}, nonce, directory=d)\n"
        "print('attached', flush=True)\n"
        "sys.stdin.readline()\n"
        "s.write(128, s.array(64, np.int32, 4) * 2)\n"
        "s.close()\n"
        "print('done', flush=True)\n"
    )
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    seg.write(HEADER_BYTES, np.array([1, 2, 3, 4], np.int32))
    proc = subprocess.Popen(
        [sys.executable, "-c", child, seg.name, seg.nonce.hex(), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        assert proc.stdout.readline().strip() == "attached"
        seg.unlink()
        assert list(tmp_path.iterdir()) == []
        out, _ = proc.communicate("go\n", timeout=30)
    finally:
        seg.unlink()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip() == "done"
    np.testing.assert_array_equal(seg.array(128, np.int32, 4), [2, 4, 6, 8])
    seg.close()


def test_file_mode_and_name(tmp_path):
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    try:
        match = NAME_PATTERN.fullmatch(seg.name)
        assert match is not None and int(match.group(1)) == os.getpid()
        assert seg.path == os.path.join(str(tmp_path), seg.name)
        st = os.stat(seg.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == SIZE
        with open(seg.path, "rb") as f:
            assert f.read(NONCE_BYTES) == seg.nonce
    finally:
        seg.unlink()
        seg.close()


def test_unlink_keeps_mappings(pair):
    created, attached = pair
    created.unlink()
    assert not os.path.exists(created.path)
    created.unlink()  # idempotent
    created.write(HEADER_BYTES, np.full(16, 7, np.uint8))
    np.testing.assert_array_equal(attached.array(HEADER_BYTES, np.uint8, 16), 7)
    attached.write(SIZE - 4, np.array([5], np.int32))
    assert created.array(SIZE - 4, np.int32, ())[()] == 5
    # attaching again is no longer possible: the name is gone
    with pytest.raises(ShmUnavailable, match="not on this machine"):
        Segment.attach(created.name, SIZE, created.nonce, directory=os.path.dirname(created.path))


def test_dev_shm_default_directory(monkeypatch):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    monkeypatch.delenv(shm.SHM_DIR_ENV, raising=False)
    try:
        seg = Segment.create(1 << 20, margin=0)
    except ShmUnavailable as exc:
        pytest.skip(f"/dev/shm unusable here: {exc}")
    try:
        assert os.path.dirname(seg.path) == "/dev/shm"
        other = Segment.attach(seg.name, seg.nbytes, seg.nonce)
    finally:
        seg.unlink()
    assert not os.path.exists(seg.path)
    seg.write(HEADER_BYTES, np.arange(8, dtype=np.uint16))
    np.testing.assert_array_equal(other.array(HEADER_BYTES, np.uint16, 8), np.arange(8))
    other.close()
    seg.close()


def test_attach_wrong_nonce(tmp_path):
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    try:
        wrong = bytes(b ^ 0xFF for b in seg.nonce)
        with pytest.raises(ShmUnavailable, match="nonce mismatch"):
            Segment.attach(seg.name, SIZE, wrong, directory=str(tmp_path))
        with pytest.raises(ShmUnavailable, match="16 bytes"):
            Segment.attach(seg.name, SIZE, b"short", directory=str(tmp_path))
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.parametrize(
    "name",
    ["../etc/passwd", "tf_ipu-x", "tf_ipu-1-" + "A" * 32, "tf_ipu-1-" + "0" * 31, "/tmp/x", ""],
)
def test_attach_invalid_name(tmp_path, name):
    with pytest.raises(ShmUnavailable, match="invalid segment name"):
        Segment.attach(name, SIZE, bytes(NONCE_BYTES), directory=str(tmp_path))


def test_attach_missing(tmp_path):
    name = f"tf_ipu-{os.getpid()}-{'0' * 32}"
    with pytest.raises(ShmUnavailable, match=re.escape("a different host or container?")):
        Segment.attach(name, SIZE, bytes(NONCE_BYTES), directory=str(tmp_path))


def test_attach_size_larger_than_file(tmp_path):
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    try:
        with pytest.raises(ShmUnavailable, match=f"file has {SIZE} bytes, {SIZE + 1} asked"):
            Segment.attach(seg.name, SIZE + 1, seg.nonce, directory=str(tmp_path))
        # a smaller mapping of a larger file is fine
        small = Segment.attach(seg.name, SIZE // 2, seg.nonce, directory=str(tmp_path))
        assert small.nbytes == SIZE // 2
        small.close()
    finally:
        seg.unlink()
        seg.close()


def test_attach_rejects_loose_mode_and_symlink(tmp_path):
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    try:
        os.chmod(seg.path, 0o644)
        with pytest.raises(ShmUnavailable, match="group/other"):
            Segment.attach(seg.name, SIZE, seg.nonce, directory=str(tmp_path))
        os.chmod(seg.path, 0o600)
        link = f"tf_ipu-{os.getpid()}-{'a' * 32}"
        os.symlink(seg.path, tmp_path / link)
        with pytest.raises(ShmUnavailable, match="symbolic link"):
            Segment.attach(link, SIZE, seg.nonce, directory=str(tmp_path))
    finally:
        seg.unlink()
        seg.close()


def test_create_refuses_when_little_free(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda directory: 12345)
    with pytest.raises(ShmUnavailable, match="12345 bytes free"):
        Segment.create(SIZE, directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_create_margin_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda directory: SIZE + 100)
    with pytest.raises(ShmUnavailable, match="margin"):
        Segment.create(SIZE, directory=str(tmp_path), margin=101)
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=100)
    seg.unlink()
    seg.close()


def test_create_missing_directory(tmp_path):
    with pytest.raises(ShmUnavailable, match="missing"):
        Segment.create(SIZE, directory=str(tmp_path / "missing"))


def test_create_too_small():
    with pytest.raises(ValueError, match="at least 64"):
        Segment.create(HEADER_BYTES - 1)


def test_close_idempotent_with_live_views(tmp_path):
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    seg.unlink()
    view = seg.array(HEADER_BYTES, np.int32, 8, writable=True)
    mv = seg.buffer(HEADER_BYTES, 32)
    assert not seg.closed
    seg.close()  # views still export the buffer: must not raise
    assert seg.closed
    seg.close()
    view[:] = 3  # still mapped
    assert bytes(mv[:4]) == (3).to_bytes(4, "little")
    with pytest.raises(ValueError, match="closed"):
        seg.array(HEADER_BYTES, np.int32, 1)
    del view, mv


def test_bounds_errors(pair):
    seg, _ = pair
    with pytest.raises(ValueError, match=rf"offset=0 nbytes=8 .*{SIZE} bytes"):
        seg.buffer(0, 8)
    with pytest.raises(ValueError, match="nbytes=-1"):
        seg.buffer(HEADER_BYTES, -1)
    with pytest.raises(ValueError, match=f"offset={SIZE - 4} nbytes=8"):
        seg.buffer(SIZE - 4, 8)
    with pytest.raises(ValueError, match="offset=32"):
        seg.array(32, np.float32, (4,))
    with pytest.raises(ValueError, match=f"nbytes={SIZE}"):
        seg.array(HEADER_BYTES, np.uint8, (SIZE,))
    with pytest.raises(ValueError, match="offset=-64"):
        seg.array(-64, np.uint8, 1)
    with pytest.raises(ValueError, match="outside segment"):
        seg.write(SIZE - 8, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="offset=0"):
        seg.write(0, np.zeros(1, np.uint8))
    # the header is untouched and the edges are usable
    assert bytes(seg.buffer(HEADER_BYTES, 0)) == b""
    seg.write(SIZE - 8, np.zeros(2, np.float32))
    assert seg.array(SIZE, np.uint8, (0,)).size == 0


# -- stale segments --------------------------------------------------------------------------


def test_sweep_stale(tmp_path):
    dead = _stale_file(tmp_path, _dead_pid())
    alive = _stale_file(tmp_path, os.getpid())
    parent = _stale_file(tmp_path, os.getppid())
    young = _stale_file(tmp_path, _dead_pid(), age=0.0)  # maybe another pid namespace's
    (tmp_path / "unrelated").write_bytes(b"x")
    removed = shm.sweep_stale(str(tmp_path))
    assert removed == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive, parent, young, "unrelated"])
    assert shm.sweep_stale(str(tmp_path)) == []
    assert shm.sweep_stale(str(tmp_path / "missing")) == []


def test_create_sweeps_first(tmp_path):
    dead = _stale_file(tmp_path, _dead_pid())
    seg = Segment.create(SIZE, directory=str(tmp_path), margin=0)
    try:
        assert [p.name for p in tmp_path.iterdir()] == [seg.name]
        assert dead != seg.name
    finally:
        seg.unlink()
        seg.close()


# -- region allocator ------------------------------------------------------------------------


def test_allocator_basic():
    a = RegionAllocator(HEADER_BYTES + 1024)
    assert a.capacity == HEADER_BYTES + 1024 and a.used == 0
    x = a.alloc(100)
    y = a.alloc(0)
    z = a.alloc(64)
    assert (x, y, z) == (HEADER_BYTES, HEADER_BYTES + 128, HEADER_BYTES + 192)
    assert a.used == 128 + 64 + 64
    assert a.alloc(1024) is None
    rest = a.alloc(1024 - 256)
    assert rest == HEADER_BYTES + 256
    assert a.alloc(1) is None
    a.free(rest)
    with pytest.raises(ValueError, match="not an allocated"):
        a.free(rest)
    with pytest.raises(ValueError, match="not an allocated"):
        a.free(HEADER_BYTES + 8)
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_allocator_first_fit_and_coalesce():
    a = RegionAllocator(HEADER_BYTES + 64 * 10)
    offs = [a.alloc(64) for _ in range(10)]
    assert offs == [HEADER_BYTES + 64 * i for i in range(10)]
    assert a.alloc(1) is None
    for i in (1, 3, 2):  # free a hole in the middle; 1|2|3 become one range
        a.free(offs[i])
    assert a.free_ranges() == [(offs[1], offs[4])]
    assert a.alloc(64 * 4) is None
    assert a.alloc(64 * 3) == offs[1]
    a.free(offs[1])
    for i in (0, 9, 5, 4, 6, 8, 7):
        a.free(offs[i])
    assert a.used == 0
    assert a.free_ranges() == [(HEADER_BYTES, HEADER_BYTES + 640)]
    assert a.alloc(640) == HEADER_BYTES


def test_allocator_unaligned_capacity():
    a = RegionAllocator(HEADER_BYTES + 100)
    assert a.alloc(101) is None
    assert a.alloc(100) == HEADER_BYTES
    assert a.used == 100
    a.free(HEADER_BYTES)
    assert a.alloc(10) == HEADER_BYTES
    assert a.alloc(36) == HEADER_BYTES + 64
    assert a.alloc(1) is None
    assert RegionAllocator(HEADER_BYTES).alloc(0) is None


def test_allocator_concurrent_no_overlap():
    capacity = HEADER_BYTES + (1 << 16)
    a = RegionAllocator(capacity)
    live: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        for _ in range(3000):
            if mine and (rng.random() < 0.5 or len(mine) > 20):
                off = mine.pop(rng.randrange(len(mine)))
                with lock:
                    del live[off]
                a.free(off)
                continue
            size = rng.choice([0, 1, 63, 64, 65, 500, 1000, 4096])
            off = a.alloc(size)
            if off is None:
                continue
            end = off + -(-max(size, 1) // 64) * 64  # the rounded region
            with lock:
                if off % 64 or off < HEADER_BYTES or end > capacity:
                    errors.append(f"bad region {off}+{size}")
                for o, e in live.items():
                    if off < e and o < end:
                        errors.append(f"overlap {off}..{end} with {o}..{e}")
                live[off] = end
            mine.append(off)
        for off in mine:
            with lock:
                del live[off]
            a.free(off)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert a.used == 0
    assert a.free_ranges() == [(HEADER_BYTES, capacity)]


def test_create_fallocate_failure_cleans_up(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
    with pytest.raises(ShmUnavailable, match=f"cannot allocate {SIZE} bytes .*ENOSPC"):
        Segment.create(SIZE, directory=str(tmp_path), margin=0)
    assert list(tmp_path.iterdir()) == []
