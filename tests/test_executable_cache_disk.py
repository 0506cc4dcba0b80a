"""The executable cache on disk (``device_server/disk_cache.py``): programs compiled once are
loaded by a restarted server without compiling, corrupt or foreign entries are compiled again
and never trusted, the folder stays within its size bound, and the path reaches the embedded
server from ``IPUConfig`` or ``TF_POPLAR_FLAGS``.

Servers: standalone processes (``server_util.ServerProcess``) where a server restarts, and
in-process ones (``serve``) started afresh on the same folder elsewhere.
"""

from __future__ import annotations

import ast
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import server_util as su

from device_server import disk_cache
from device_server.cli import build_parser
from device_server.disk_cache import DiskCache, decode_entry, encode_entry
from device_server.server import serve
from device_server.service import DeviceService, ServiceConfig
from tf_ipu.client import DeviceClient

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 8)).astype(np.float32)
Y = RNG.standard_normal((16, 1)).astype(np.float32)
W = RNG.standard_normal((8, 1)).astype(np.float32)


def _entry_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{disk_cache.SUFFIX}"))


class _InProcess:
    """An in-process server on ``folder`` with one attached client."""

    def __init__(self, folder: Path, **config: object) -> None:
        self.handle = serve(config=ServiceConfig(executable_cache_path=str(folder), **config))
        self.client = DeviceClient(self.handle.address)
        self.client.open_session()
        self.client.attach(1)

    def counters(self) -> dict[str, int]:
        return self.client.counters()

    def close(self) -> None:
        self.client.close()
        self.handle.stop(grace=1.0)

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _compile_in_fresh_server(folder: Path, module) -> tuple[object, dict[str, int], list]:
    """Compiles ``module`` in a new server on ``folder``; (reply, counters, sgd outputs)."""
    with _InProcess(folder) as s:
        compiled = s.client.compile(module)
        out = s.client.execute(compiled.executable_id, [X, Y, W])
        return compiled, s.counters(), out


# -- (a) a restarted server loads what it compiled -------------------------------------------


def test_restarted_server_loads_the_program_from_disk_bit_for_bit(tmp_path):
    folder = tmp_path / "cache"  # made by the server
    module = su.sgd_module(name="sgd_disk")
    server = su.ServerProcess.start(["--executable-cache-path", str(folder)])
    try:
        with DeviceClient(server.address) as c:
            c.open_session()
            c.attach(1)
            first = c.compile(module)
            before = c.execute(first.executable_id, [X, Y, W])
            counters = c.counters()
        assert not first.cache_hit
        assert counters["compiles"] == 1 and counters["disk_cache_writes"] == 1
        assert counters["disk_cache_hits"] == 0 and counters["disk_cache_misses"] == 1
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        (entry,) = _entry_files(folder)
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600

        server.stop()
        server.args = ["--executable_cache_path", str(folder)]  # Graphcore's spelling
        server.restart()
        with DeviceClient(server.address) as c:
            c.open_session()
            c.attach(1)
            again = c.compile(module)
            after = c.execute(again.executable_id, [X, Y, W])
            counters = c.counters()
        assert again.cache_hit
        assert counters["compiles"] == 0, "the restarted server compiled it again"
        assert counters["disk_cache_hits"] == 1 and counters["cache_hits"] == 1
        assert again.estimate == first.estimate
        assert [a.tobytes() for a in after] == [b.tobytes() for b in before]
        assert "loaded from the disk cache" in server.log_tail()
    finally:
        server.stop()


def _keras_train_step():
    """A small Keras CNN's training step (forward, backward, Adam) lowered to IR."""
    import keras
    import tensorflow as tf
    from keras_util import small_cnn

    from tf_ipu.lowering.program import lower_function

    model = small_cnn()
    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    opt.build(model.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return lower_function(step, [tf.TensorSpec([8, 8, 8, 4], tf.float32),
                                 tf.TensorSpec([8], tf.int64)], "train_step").module


def test_keras_train_step_from_disk_runs_bit_for_bit(tmp_path):
    module = _keras_train_step()
    rng = np.random.default_rng(1)

    def run(s: _InProcess) -> tuple[object, list[bytes]]:
        compiled = s.client.compile(module)
        args = [rng.standard_normal(p.shape).astype(p.dtype) if p.dtype.kind == "f"
                else np.zeros(p.shape, p.dtype) for p in compiled.parameters]
        return compiled, [a.tobytes() for a in s.client.execute(compiled.executable_id, args)]

    with _InProcess(tmp_path) as s:
        first, before = run(s)
        assert s.counters()["compiles"] == 1
    rng = np.random.default_rng(1)
    with _InProcess(tmp_path) as s:  # a fresh server on the same folder
        again, after = run(s)
        counters = s.counters()
    assert counters["compiles"] == 0 and counters["disk_cache_hits"] == 1
    assert again.cache_hit and again.estimate == first.estimate  # the whole report, too
    assert after == before


# -- (b) corrupt, foreign and garbage entries ----------------------------------------------------


def _flip_content(data: bytes) -> bytes:
    b = bytearray(data)
    b[-10] ^= 0xFF
    return bytes(b)


def _flip_key(data: bytes) -> bytes:
    k = data.index(b'"key": "') + 8
    return data[:k] + (b"0" if data[k:k + 1] != b"0" else b"1") + data[k + 1:]


DAMAGE = {
    "flipped content byte": (_flip_content, "does not match its sha256"),
    "flipped key byte": (_flip_key, "foreign"),
    "truncated": (lambda d: d[: len(d) - 7], "truncated"),
    "cut in the header": (lambda d: d[:40], "header line is missing"),
    "empty": (lambda d: b"", "not an entry"),
    "garbage": (lambda d: os.urandom(300), "not an entry"),
    "other version": (lambda d: d.replace(b'"version": "', b'"version": "9', 1), "another server"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_entry_is_compiled_again_not_trusted(tmp_path, caplog, damage):
    module = su.sgd_module(name="sgd_damaged")
    _compile_in_fresh_server(tmp_path, module)
    (entry,) = _entry_files(tmp_path)
    good = entry.read_bytes()
    spoil, why = DAMAGE[damage]
    entry.write_bytes(spoil(good))
    caplog.set_level(logging.INFO, logger="device_server.disk_cache")
    compiled, counters, out = _compile_in_fresh_server(tmp_path, module)
    assert counters["compiles"] == 1 and counters["disk_cache_rejected"] == 1
    assert counters["disk_cache_hits"] == 0 and not compiled.cache_hit
    (record,) = [r for r in caplog.records if "ignoring" in r.getMessage()]
    assert str(entry) in record.getMessage() and why in record.getMessage()
    assert record.levelno == (logging.INFO if damage == "other version" else logging.WARNING)
    ref_loss, ref_w = su.sgd_reference(X, Y, W)
    np.testing.assert_allclose(out[0], ref_loss, rtol=1e-5)
    # Written again, and trusted again.
    assert decode_entry(entry.read_bytes(), entry.stem)["name"] == "sgd_damaged"
    _, counters, _ = _compile_in_fresh_server(tmp_path, module)
    assert counters["compiles"] == 0 and counters["disk_cache_hits"] == 1


def test_foreign_entries_are_never_trusted(tmp_path, caplog):
    """An entry copied under another program's name, and one whose header names the right
    key but holds another program's record, are both compiled again."""
    a, b = su.sgd_module(name="a"), su.sgd_module(batch=4, name="b")
    _compile_in_fresh_server(tmp_path, a)
    (file_a,) = _entry_files(tmp_path)
    with _InProcess(tmp_path) as s:
        s.client.compile(b)
    (file_b,) = [f for f in _entry_files(tmp_path) if f != file_a]
    caplog.set_level(logging.WARNING, logger="device_server.disk_cache")

    shutil.copyfile(file_b, file_a)  # b's entry under a's name
    _, counters, out = _compile_in_fresh_server(tmp_path, a)
    assert counters["compiles"] == 1 and counters["disk_cache_rejected"] == 1
    assert "foreign" in caplog.text and out[0].shape == (1, 1)

    # A well-formed entry for a's key holding b's record (made by hand): its record is not a's.
    record_b = decode_entry(file_b.read_bytes(), file_b.stem)
    file_a.write_bytes(encode_entry(file_a.stem, record_b))
    caplog.clear()
    compiled, counters, _ = _compile_in_fresh_server(tmp_path, a)
    assert counters["compiles"] == 1 and counters["disk_cache_rejected"] == 1
    assert "does not describe the program" in caplog.text and str(file_a) in caplog.text
    assert [p.shape for p in compiled.parameters] == [(16, 8), (16, 1), (8, 1)]


def test_links_and_folders_in_place_of_an_entry_are_not_followed(tmp_path, caplog):
    cache = DiskCache(tmp_path / "cache")
    target = tmp_path / "elsewhere"
    target.write_bytes(encode_entry(_key(1), _record(1)))  # even a valid entry
    cache.file_of(_key(1)).symlink_to(target)
    cache.file_of(_key(2)).mkdir()
    caplog.set_level(logging.WARNING, logger="device_server.disk_cache")
    assert cache.load(_key(1)) is None and cache.load(_key(2)) is None
    assert cache.stats["rejected"] == 2 and "ignoring" in caplog.text
    assert target.exists() and not cache.file_of(_key(1)).is_symlink()  # the link went
    assert cache.store(_key(2), _record(2)) is False  # a folder is in its place: left alone
    assert cache.store(_key(1), _record(1)) and cache.load(_key(1))["name"] == "p1"


def test_nothing_in_an_entry_can_run_code():
    """The disk cache reads JSON and zlib only: no pickle, marshal, eval, exec or numpy
    file loading on the path from the folder to a record."""
    tree = ast.parse(Path(disk_cache.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"pickle", "marshal", "shelve", "dill", "importlib", "ctypes"}, imported
    names = {n.func.id for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not names & {"eval", "exec", "compile", "__import__"}, names
    numpy_calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                   and n.func.value.id in ("np", "numpy")}
    assert not numpy_calls & {"load", "fromfile", "loadtxt"}, numpy_calls


# -- (c) the size bound, the index, several processes ------------------------------------------


def _record(n: int, size: int = 2000) -> dict:
    """A record of about ``size`` bytes on disk (random hex: zlib halves it)."""
    return {"name": f"p{n}", "pad": np.random.default_rng(n).bytes(size).hex()}


def _key(n: int) -> str:
    return f"{n:064x}"


def test_size_bound_evicts_the_least_recently_used(tmp_path):
    one = len(encode_entry(_key(0), _record(0)))
    cache = DiskCache(tmp_path, max_bytes=2 * one + one // 2)  # room for two
    assert cache.store(_key(1), _record(1)) and cache.store(_key(2), _record(2))
    assert cache.load(_key(1))["name"] == "p1"  # 1 is now used more recently than 2
    assert cache.store(_key(3), _record(3))
    assert set(cache.entries()) == {_key(1), _key(3)}
    assert not cache.file_of(_key(2)).exists() and cache.stats["evictions"] == 1
    assert cache.load(_key(2)) is None and cache.stats["misses"] == 1
    assert sum(e["size"] for e in cache.entries().values()) <= cache.max_bytes
    # A folder over a smaller bound is trimmed when a server opens it.
    smaller = DiskCache(tmp_path, max_bytes=one + one // 2)
    assert set(smaller.entries()) == {_key(3)}
    # An entry larger than the whole bound is not kept (and nothing is evicted for it).
    assert not smaller.store(_key(4), _record(4, size=10 * one))
    assert set(smaller.entries()) == {_key(3)} and smaller.stats["write_errors"] == 1


def test_missing_or_corrupt_index_is_rebuilt_from_the_files(tmp_path, caplog):
    cache = DiskCache(tmp_path)
    for n in range(3):
        cache.store(_key(n), _record(n))
    index = tmp_path / disk_cache.INDEX_NAME
    (tmp_path / "notes.txt").write_text("not an entry")  # left alone
    index.write_text("{ not json")
    caplog.set_level(logging.WARNING, logger="device_server.disk_cache")
    again = DiskCache(tmp_path)
    assert set(again.entries()) == {_key(n) for n in range(3)} and "rebuilding" in caplog.text
    index.unlink()
    assert set(DiskCache(tmp_path).entries()) == {_key(n) for n in range(3)}
    assert again.load(_key(1))["name"] == "p1"
    assert (tmp_path / "notes.txt").exists()
    # A file the index does not know (a writer died before updating it) is found on opening.
    shutil.copyfile(again.file_of(_key(1)), again.file_of(_key(9)))
    assert _key(9) in DiskCache(tmp_path).entries()


def test_two_servers_share_a_folder(tmp_path):
    """Two caches on one folder (separate flocks, as two processes have) storing, loading
    and evicting at once keep an index that matches the files and the bound."""
    one = len(encode_entry(_key(0), _record(0)))
    caches = [DiskCache(tmp_path, max_bytes=12 * one) for _ in range(2)]
    errors: list[BaseException] = []

    def work(cache: DiskCache, start: int) -> None:
        try:
            for n in range(start, start + 15):
                cache.store(_key(n), _record(n))
                cache.load(_key(n - 3)) if n >= 3 else None
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(c, 100 * k)) for k, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    index = caches[0].entries()
    assert {f.stem for f in _entry_files(tmp_path)} == set(index)
    assert sum(e["size"] for e in index.values()) <= 12 * one
    assert sum(c.stats["rejected"] for c in caches) == 0
    for key in index:
        assert caches[1].load(key) is not None


def test_the_server_refuses_a_folder_it_cannot_use(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be used"):
        DeviceService(ServiceConfig(executable_cache_path=str(blocker / "sub")))
    args = build_parser().parse_args(["--executable_cache_path", "/x", "--executable-cache-bytes", "5"])
    assert (args.executable_cache_path, args.executable_cache_bytes) == ("/x", 5)
    assert build_parser().parse_args([]).executable_cache_bytes == disk_cache.DEFAULT_MAX_BYTES


# -- (d) the path reaches the embedded server; PRE_COMPILE fills the folder ---------------------


def test_ipu_config_and_poplar_flags_reach_the_embedded_server(tmp_path, monkeypatch, caplog):
    import tf_ipu
    from tf_ipu import local_server, runtime

    monkeypatch.delenv("TF_POPLAR_FLAGS", raising=False)
    cfg = tf_ipu.IPUConfig()
    assert runtime.local_server_args(cfg) == []
    monkeypatch.setenv("TF_POPLAR_FLAGS", f"--show_progress_bar=false --executable_cache_path={tmp_path}/a")
    assert runtime.local_server_args(cfg) == ["--executable-cache-path", f"{tmp_path}/a"]
    cfg.executable_cache_path = str(tmp_path / "b")  # the field wins
    assert runtime.local_server_args(cfg) == ["--executable-cache-path", f"{tmp_path}/b"]

    started: list[list[str]] = []

    class Fake:
        address = "127.0.0.1:1"

        def alive(self) -> bool:
            return True

    def fake_start(num_ipus: int, ipu_version: str, extra_args=()) -> Fake:
        started.append(list(extra_args))
        return Fake()

    monkeypatch.setattr(local_server, "start_local_server", fake_start)
    rt = runtime.DeviceRuntime()
    monkeypatch.setattr(runtime.atexit, "register", lambda fn: None)
    assert rt._ensure_local_server(cfg) == Fake.address
    assert started == [["--executable-cache-path", f"{tmp_path}/b"]]
    caplog.set_level(logging.WARNING, logger="tf_ipu")
    other = tf_ipu.IPUConfig()
    other.executable_cache_path = str(tmp_path / "c")
    for _ in range(2):
        rt._ensure_local_server(other)  # the running server keeps its folder; said once
    assert len(started) == 1
    assert caplog.text.count("keeps the executable cache folder") == 1 and f"{tmp_path}/c" in caplog.text


def test_pre_compile_fills_the_disk_cache(ipu_system, tmp_path):
    """PRE_COMPILE compiles through the same Compile call: a server started later on the
    folder runs the program without compiling it."""
    import tensorflow as tf

    import tf_ipu
    from tf_ipu.config import DeviceConnectionType

    strategy = tf_ipu.IPUStrategy()
    x = tf.constant(np.arange(6, dtype="float32").reshape(2, 3))
    fn = tf.function(lambda v: strategy.run(lambda t: t * 4.0 - 1.0, args=(v,)))
    handles = []
    try:
        for kind in (DeviceConnectionType.PRE_COMPILE, DeviceConnectionType.ALWAYS):
            handle = serve(config=ServiceConfig(executable_cache_path=str(tmp_path)))
            handles.append(handle)
            cfg = tf_ipu.IPUConfig()
            cfg.server_address = handle.address
            cfg.device_connection.type = kind
            cfg.configure_ipu_system()
            result = fn(x).numpy()
            counters = handle.service.counter_values()
            tf_ipu.get_runtime().shutdown()
            handle.stop(grace=1.0)
            if kind is DeviceConnectionType.PRE_COMPILE:
                np.testing.assert_array_equal(result, np.zeros((2, 3)))
                assert counters["compiles"] == 1 and counters["disk_cache_writes"] == 1
            else:
                np.testing.assert_array_equal(result, x.numpy() * 4.0 - 1.0)
                assert counters["compiles"] == 0 and counters["disk_cache_hits"] == 1
    finally:
        for handle in handles:
            handle.stop(grace=0.5)
        ipu_system.configure_ipu_system()
