"""The data path: no size ceiling (chunked streams), shared memory when co-located (found by
a probe, with its fallbacks), bit-identical results either way, and no segment left behind
when a client or the server is killed with ``kill -9``.

Servers: standalone processes (``server_util.ServerProcess``), so that their memory maps can
be read from ``/proc`` and they can be killed; the suite's shared one where that suffices.
References: the bytes sent (sha256 of 3 GiB), numpy (``sgd_reference``), and the same run
through the other path (bitwise).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import server_util as su

from device_server.protocol import shm
from tf_ipu import errors
from tf_ipu.client import DeviceClient, VariableRef

GIB = 1 << 30


def _segments_in_dev_shm() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(shm.NAME_PREFIX))


def _mapped_segments(pid: int) -> list[str]:
    """The tf_ipu segments process ``pid`` has mapped (their names are unlinked: "(deleted)")."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                           for line in f if "/tf_ipu-" in line})
    except FileNotFoundError:
        return []


def _wait_until(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _sha(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def test_a_3_gib_variable_set_round_trips_in_chunks():
    """3 GiB (three 1 GiB variables, each as large as a message) up and back by streaming,
    through a raised --max-session-bytes, checked by hash; the transport holds at most two
    chunks beyond the payload on each side."""
    limit = 3 * GIB + (64 << 20)
    with su.ServerProcess.start(["--max-session-bytes", str(limit)]) as server:
        c = DeviceClient(server.address, data_path="stream")
        c.open_session()
        rng = np.random.default_rng(7)
        values = {f"v{i}": rng.integers(0, 255, GIB, dtype=np.uint8) for i in range(3)}
        sent = _sha(values.values())
        c.write_variables(values)
        # The per-session limit still refuses what would not fit (a 4th GiB).
        with pytest.raises(errors.ResourceExhaustedError, match=r"over the server's limit of "
                           rf"{limit} bytes per session") as info:
            c.write_variables({"v3": np.zeros(GIB, np.uint8)})
        assert info.value.kind == "session-memory"
        del values
        back = c.read_variables(["v0", "v1", "v2"])
        assert _sha(back[k] for k in ("v0", "v1", "v2")) == sent
        chunk = c.data.chunk_bytes()
        assert c.data.counters["stream_bytes_out"] >= 3 * GIB
        assert c.data.counters["stream_bytes_in"] == 3 * GIB
        assert c.data.counters["stream_peak_bytes_held"] <= 2 * chunk
        moved = c.counters()
        assert moved["transfer.stream_bytes_in"] >= 3 * GIB
        assert moved["transfer.stream_bytes_out"] == 3 * GIB
        assert moved["transfer.stream_peak_bytes_held"] <= GIB + 2 * chunk  # payload + 2 chunks
        c.close()


def _sgd_run(address: str, data_path: str, steps: int = 5) -> tuple[str, list[np.ndarray], dict]:
    """A few SGD steps on resident weights with big batches, through ``data_path``."""
    c = DeviceClient(address, data_path=data_path)
    c.open_session()
    c.attach(1)
    rng = np.random.default_rng(3)
    batch, dim = 4096, 64  # 1 MiB of inputs a step: shared memory when co-located
    exe = c.compile(su.sgd_module(batch=batch, dim=dim, name="sgd_big")).executable_id
    c.write_variables({"w": rng.standard_normal((dim, 1)).astype(np.float32)})
    results = []
    for _ in range(steps):
        x = rng.standard_normal((batch, dim)).astype(np.float32)
        y = rng.standard_normal((batch, 1)).astype(np.float32)
        loss, _ = c.execute(exe, [x, y, VariableRef("w")])
        results.append(np.array(loss))
    results.append(np.array(c.read_variables(["w"])["w"]))
    kind, counters = c.data.kind, dict(c.data.counters)
    c.close()
    return kind, results, counters


def test_shared_memory_and_streaming_give_bit_identical_results(device_server):
    kind_shm, through_shm, shm_counters = _sgd_run(device_server, "auto")
    kind_stream, through_stream, _ = _sgd_run(device_server, "stream")
    assert (kind_shm, kind_stream) == ("shm", "stream")
    assert shm_counters["shm_bytes_out"] >= 5 * (4096 * 64 * 4)  # the batches went through shm
    for a, b in zip(through_shm, through_stream, strict=True):
        assert a.tobytes() == b.tobytes()
    x_w = np.random.default_rng(3).standard_normal((64, 1)).astype(np.float32)
    assert np.isfinite(through_shm[-1]).all() and not np.array_equal(through_shm[-1], x_w)


def test_a_small_or_full_dev_shm_falls_back_to_streaming(device_server, monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda directory: 1 << 20)  # a 1 MiB tmpfs
    c = DeviceClient(device_server)
    c.open_session()
    try:
        assert c.data.kind == "stream"
        assert "free" in c.data.reason and "/dev/shm" in c.data.reason, c.data.reason
        assert c.data.describe().startswith("gRPC streaming (")
        c.write_variables({"a": np.arange(100_000, dtype=np.float32)})
        np.testing.assert_array_equal(c.read_variables(["a"])["a"], np.arange(100_000, dtype=np.float32))
    finally:
        c.close()
    forced = DeviceClient(device_server, data_path="shm")
    with pytest.raises(errors.FailedPreconditionError, match="data_path='shm'.*free"):
        forced.open_session()


def test_the_probe_finds_a_server_that_does_not_share_dev_shm(tmp_path):
    """A server whose shared memory is elsewhere (another host or container; here another
    directory) cannot map the client's segment: auto falls back, and says why."""
    env = su.child_env(TF_IPU_SHM_DIR=str(tmp_path))
    with su.ServerProcess.start([], env=env) as server:
        c = DeviceClient(server.address)
        c.open_session()
        try:
            assert c.data.kind == "stream"
            assert "not on this machine's shared memory" in c.data.reason, c.data.reason
        finally:
            c.close()
        with pytest.raises(errors.FailedPreconditionError, match="not on this machine's shared memory"):
            DeviceClient(server.address, data_path="shm").open_session()
    assert _segments_in_dev_shm() == []


_CLIENT_SCRIPT = r"""
import os, sys, time
import numpy as np
from tf_ipu.client import DeviceClient
c = DeviceClient(sys.argv[1], data_path="shm", timeout=2.0)
c.open_session(lease_seconds=1.0)
c.write_variables({"a": np.ones(1 << 20, np.float32)})
print("READY", c.data.kind, c.data.counters.get("shm_bytes_out", 0), flush=True)
time.sleep(120)
"""


def test_no_segment_is_left_after_kill_9_of_the_client_or_the_server():
    with su.ServerProcess.start(["--lease-seconds", "1"]) as server:
        # The client is killed: its session's lease runs out and the server unmaps.
        child = subprocess.Popen([sys.executable, "-c", _CLIENT_SCRIPT, server.address],
                                 stdout=subprocess.PIPE, text=True, env=su.child_env())
        try:
            line = child.stdout.readline()
            assert line.split()[:2] == ["READY", "shm"] and int(line.split()[2]) >= 4 << 20, line
            assert _mapped_segments(child.pid) and _mapped_segments(server.process.pid)
            assert _segments_in_dev_shm() == []  # named for milliseconds only
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
        _wait_until(lambda: not _mapped_segments(server.process.pid), 15,
                    "the server unmaps the dead client's segment")
        assert _segments_in_dev_shm() == []

        # The server is killed: this client unmaps when it drops the connection. (Other
        # clients of this process, e.g. the suite's runtime, have segments of their own.)
        others = set(_mapped_segments(os.getpid()))
        c = DeviceClient(server.address, data_path="shm", timeout=2.0)
        c.open_session()
        c.write_variables({"a": np.ones(1 << 20, np.float32)})
        ours = set(_mapped_segments(os.getpid())) - others
        assert len(ours) == 1
        server.kill()
        with pytest.raises(errors.DeviceUnavailableError):
            c.read_variables(["a"])
        c.abandon()
        assert not ours & set(_mapped_segments(os.getpid()))
        assert _segments_in_dev_shm() == []


def test_the_compile_report_names_the_data_path(ipu_system):
    import tensorflow as tf

    import tf_ipu
    from tf_ipu import runtime

    strategy = tf_ipu.IPUStrategy()

    @tf.function
    def double(x):
        return strategy.run(lambda v: v * 2.0, args=(x,))

    np.testing.assert_array_equal(double(tf.ones([300, 300])).numpy(), np.full((300, 300), 2.0))
    report = runtime.get_runtime().reports[-1]
    assert report.data_path.startswith("shared memory (") and "data path: shared memory" in report.summary()
