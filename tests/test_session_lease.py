"""Sessions survive busy clients (connection leases, ``device_server/sessions.py``), and
clients that are gone still lose theirs within the lease.

One server, four client processes at once (no TensorFlow: ``DeviceClient`` alone), ~40 s:

    gil     holds the GIL for 30 s (its heartbeat thread starves), then compiles and runs
            on the same session and IPU
    write   sends no heartbeats at all, writes a 768 MiB variable over the streaming data
            path, stays silent for more than a lease, then reads it back
    killed  SIGKILL: another client gets its IPU within lease + reaper period + slack
    frozen  SIGSTOP (a host that vanished: its connection stops answering the server's
            keepalive pings): its IPU is free within 3 keepalives + lease + slack
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import server_util as su

from tf_ipu.client import DeviceClient

LEASE = 2.0
KEEPALIVE = 1.0
REAPER = 0.25  # SessionManager's reaper period
GIL_SECONDS = 30.0
WRITE_BYTES = 768 << 20

_CHILD = r"""
import json, sys, threading, time
import numpy as np
import server_util as su
from tf_ipu.client import DeviceClient

mode, address, lease, gil_seconds, write_bytes = (
    sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))

def say(**fields):
    print(json.dumps(fields), flush=True)

if mode == "write":  # no heartbeat thread at all: only the connection keeps the session
    DeviceClient._start_heartbeat = lambda self, session_id, lease_seconds: None
c = DeviceClient(address, data_path="stream" if mode == "write" else "auto")
info = c.open_session(lease_seconds=lease)
ipus = c.attach(1).ipu_ids
say(state="ready", ipus=ipus, connection_lease=info.connection_lease)

if mode == "gil":
    ticks = {"last": time.monotonic(), "gap": 0.0}

    def tick():  # any Python thread that gets the GIL moves this along
        while True:
            now = time.monotonic()
            ticks["gap"] = max(ticks["gap"], now - ticks["last"])
            ticks["last"] = now
            time.sleep(0.01)

    threading.Thread(target=tick, daemon=True).start()
    time.sleep(3 * lease)  # a few heartbeats first
    beats_before = c.heartbeats
    sys.setswitchinterval(1000.0)  # no other thread gets the GIL for 1000 s
    start = time.monotonic()
    while time.monotonic() - start < gil_seconds:
        pass
    held = time.monotonic() - start
    beats_during = c.heartbeats - beats_before  # (read before any other thread ran)
    sys.setswitchinterval(0.005)
    time.sleep(0.1)
    x = np.arange(64, dtype=np.float32).reshape(16, 4) / 64
    y, w = np.ones((16, 1), np.float32), np.full((4, 1), 0.5, np.float32)
    exe = c.compile(su.sgd_module(batch=16, dim=4)).executable_id
    loss, _ = c.execute(exe, [x, y, w])
    ref_loss, _ = su.sgd_reference(x, y, w)
    say(state="done", held=held, gap=ticks["gap"], beats_before=beats_before,
        beats_during=beats_during, heartbeat_failures=c.heartbeat_failures,
        loss_ok=bool(np.allclose(loss, ref_loss, rtol=1e-5)), ipus=c.attachment.ipu_ids,
        session=c.session_id[:8])
    c.close()
elif mode == "write":
    value = np.full(write_bytes // 4, 1.5, np.float32)
    value[-1] = 7.0
    start = time.monotonic()
    c.write_variables({"big": value})
    written = time.monotonic() - start
    time.sleep(lease + 1.0)  # silent for more than a lease
    back = c.read_variables(["big"])["big"]
    say(state="done", write_seconds=written, silent_seconds=time.monotonic() - start,
        streamed=c.data.counters.get("stream_bytes_out", 0), heartbeats=c.heartbeats,
        same=bool(back.shape == value.shape and back[-1] == 7.0 and np.array_equal(back, value)))
    c.close()
else:  # killed / frozen: idle, heartbeating, until the test signals it
    time.sleep(600)
"""


def _child(mode: str, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode, address, str(LEASE), str(GIL_SECONDS),
         str(WRITE_BYTES)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=su.child_env(PYTHONPATH=str(su.ROOT / "tests")),
    )


def _line(child: subprocess.Popen, mode: str) -> dict:
    line = child.stdout.readline()
    if not line:
        child.wait(10)
        pytest.fail(f"{mode} client ended without a word ({child.returncode}):\n"
                    f"{child.stderr.read()[-3000:]}")
    return json.loads(line)


def _free_after(observer: DeviceClient, ipu: int, since: float, bound: float) -> float:
    """Seconds from ``since`` until ``observer`` could attach IPU ``ipu`` (waiting for it)."""
    observer.attach(ipu_ids=[ipu], wait_seconds=bound + 5.0)
    took = time.monotonic() - since
    observer.detach()
    return took


def test_busy_clients_keep_their_sessions_and_gone_ones_lose_them_within_the_lease():
    args = ["--ipus", "4", "--lease-seconds", str(LEASE), "--keepalive-seconds", str(KEEPALIVE)]
    with su.ServerProcess.start(args) as server:
        modes = ("gil", "write", "killed", "frozen")
        children = {m: _child(m, server.address) for m in modes}
        try:
            ready = {m: _line(children[m], m) for m in modes}
            assert all(r["state"] == "ready" and r["connection_lease"] for r in ready.values()), ready
            with DeviceClient(server.address) as observer:
                observer.open_session()
                start = time.monotonic()
                children["killed"].send_signal(signal.SIGKILL)
                children["frozen"].send_signal(signal.SIGSTOP)
                killed_bound = LEASE + REAPER + 1.0
                frozen_bound = 3 * KEEPALIVE + LEASE + REAPER + 1.5
                killed = _free_after(observer, ready["killed"]["ipus"][0], start, killed_bound)
                frozen = _free_after(observer, ready["frozen"]["ipus"][0], start, frozen_bound)
                print(f"SIGKILL: IPU free after {killed:.2f} s; SIGSTOP: after {frozen:.2f} s")
                assert killed <= killed_bound, f"SIGKILLed client's IPU free after {killed:.2f} s"
                assert frozen <= frozen_bound, f"SIGSTOPped client's IPU free after {frozen:.2f} s"
                # The busy clients' IPUs stay taken meanwhile.
                if observer.counters()["ipus_free"] != 2:
                    for child in children.values():
                        if child.poll() is None and child is not children["frozen"]:
                            child.kill()
                    pytest.fail("a busy client lost its session:\n" + server.log_tail() + "\n".join(
                        f"--- {m}:\n{children[m].stderr.read()[-3000:]}" for m in ("gil", "write")))

                write = _line(children["write"], "write")
                print(f"768 MiB write: {write}")
                assert write["same"] and write["heartbeats"] == 0, write
                assert write["streamed"] >= WRITE_BYTES, write
                assert write["silent_seconds"] > write["write_seconds"] + LEASE, write

                gil = _line(children["gil"], "gil")
                print(f"GIL held: {gil}")
                assert gil["held"] >= GIL_SECONDS, gil
                # No other Python thread ran meanwhile: the heartbeat thread was starved.
                assert gil["gap"] >= GIL_SECONDS - 0.5 and gil["beats_during"] == 0, gil
                assert gil["beats_before"] >= 2, gil  # (it did beat before)
                assert gil["loss_ok"] and gil["ipus"] == ready["gil"]["ipus"], gil
                assert gil["heartbeat_failures"] == 0, gil
                assert observer.counters()["sessions_expired"] == 2  # killed and frozen only
            for m in ("gil", "write"):
                assert children[m].wait(30) == 0, children[m].stderr.read()[-3000:]
        finally:
            for child in children.values():
                if child.poll() is None:
                    child.kill()
                    child.wait(10)
