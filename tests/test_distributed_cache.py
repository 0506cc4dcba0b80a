"""The servers of a tf-ipu-run share the executable cache and plan each program once
(issue 27, point 3), with a real mpirun on loopback.

    tf-ipu-run --num-instances N --num-replicas N --executable-cache-path C -- python PROGRAM
      servers' job: device server k (--executable-cache-path C), k < N
      instance k:   barrier with the others, then Compile of the same program on server k,
                    then its server's counters -> OUT/instance<k>.json

With the shared cache the N servers plan the program once in all: the first takes the plan
lock of its key (``DiskCache.planning``: an flock in C), plans it and writes the entry, the
others wait on the lock and load the entry (counters ``compiles``, ``disk_cache_hits``,
``disk_cache_plan_waits``). Without it, each server plans it. The program (200 matrix
products, planned in about a second here) is compiled by every instance at the same moment
(an MPI barrier just before), so without the lock the servers would plan it side by side.
The plan lock itself is tested directly too: a waiter loads what the holder wrote, a holder
killed with SIGKILL releases it, and a stopped Compile stops waiting. The programs import
no TensorFlow. 45 s on 2 cores at a load of 20 (three launches, of 2, 4 and 2 instances),
70 s to 3 min when the machine is busier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import server_util as su

from device_server.disk_cache import DiskCache
from device_server.emulator.cancel import RunStopped, StopToken, running

ROOT = Path(__file__).resolve().parents[1]
KEY = "ab" * 32

PROGRAM = """
import json, os, sys, time
sys.path.insert(0, sys.argv[2])  # tests/: server_util's IR builder
import numpy as np
import server_util as su
from device_server.protocol import ir_pb2
from tf_ipu.client import DeviceClient
from tf_ipu.distributed import identity, mpi

out_dir, layers, dim = sys.argv[1], int(sys.argv[3]), 64
k = identity.getInstanceIndex()
module = ir_pb2.Module(name=f"chain{layers}", entry_computation_id=0, frontend="test")
b = su.Builder(module, 0, "main")
y = b.parameter(su.array_shape(np.float32, [dim, dim]))
w = b.parameter(su.array_shape(np.float32, [dim, dim]))
for _ in range(layers):
    y = b.op("tanh", [b.dot(y, w, 1, 0, [dim, dim])])
b.root(b.tuple([y]))

client = DeviceClient(os.environ["TF_IPU_SERVER"])
client.open_session()
client.attach(1)
mpi.barrier()  # every instance asks its server at the same moment
start = time.time()
compiled = client.compile(module)
seconds = time.time() - start
counters = client.counters()
client.close()
names = ("compiles", "compile_requests", "disk_cache_hits", "disk_cache_writes",
         "disk_cache_plan_waits")
argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
run_dir = argv[argv.index(b"--run-dir") + 1].decode()  # this run's folder
json.dump({"server": os.environ["TF_IPU_SERVER"], "seconds": seconds, "run_dir": run_dir,
           "cycles": compiled.estimate.cycles, "cache_hit": compiled.cache_hit,
           **{n: counters.get(n, 0) for n in names}},
          open(os.path.join(out_dir, f"instance{k}.json"), "w"))
"""

LAYERS = 200


def _launch(tmp_path: Path, instances: int, cache: Path | None) -> list[dict]:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    extra = ["--executable-cache-path", str(cache)] if cache is not None else []
    result = subprocess.run(
        [sys.executable, "-m", "tf_ipu.distributed.launcher", "--num-instances", str(instances),
         "--num-replicas", str(instances), *extra, "--", sys.executable, str(script),
         str(tmp_path), str(ROOT / "tests"), str(LAYERS)],
        cwd=tmp_path, env=su.launcher_env(), capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outs = [json.loads((tmp_path / f"instance{k}.json").read_text()) for k in range(instances)]
    run_dir = outs[0]["run_dir"]
    assert not [p for p in os.listdir("/proc") if p.isdigit() and run_dir in _cmdline(p)]
    return outs


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


@pytest.mark.parametrize("instances", [2, 4])
def test_servers_sharing_the_cache_plan_a_program_once(tmp_path, instances):
    outs = _launch(tmp_path, instances, tmp_path / "cache")
    assert len({o["server"] for o in outs}) == instances  # one server per instance
    assert all(o["compile_requests"] == 1 for o in outs)
    # One plan in all; every other server loaded the entry the planner wrote.
    assert sum(o["compiles"] for o in outs) == 1, outs
    assert sum(o["disk_cache_writes"] for o in outs) == 1, outs
    assert sum(o["disk_cache_hits"] for o in outs) == instances - 1, outs
    assert sum(o["cache_hit"] for o in outs) == instances - 1, outs
    # The same estimate everywhere (the entry is the planner's).
    assert len({o["cycles"] for o in outs}) == 1
    assert len(list((tmp_path / "cache").glob("*.tfipu-exe"))) == 1
    assert not list((tmp_path / "cache").glob(".plan-*"))  # lock files removed
    waits = sum(o["disk_cache_plan_waits"] for o in outs)
    print(f"{instances} servers: {waits} waited on the plan lock; compile seconds "
          f"{[round(o['seconds'], 2) for o in outs]}")


def test_servers_without_a_cache_plan_it_each(tmp_path):
    outs = _launch(tmp_path, 2, None)
    assert [o["compiles"] for o in outs] == [1, 1], outs
    assert not any(o["cache_hit"] for o in outs)
    assert all(o["disk_cache_plan_waits"] == 0 for o in outs)


# -- the plan lock itself -------------------------------------------------------------------


def _record() -> dict:
    return {"planned_by": "the holder", "cycles": 1234}


def test_a_waiter_loads_what_the_holder_planned(tmp_path):
    holder, waiter = DiskCache(tmp_path), DiskCache(tmp_path)  # two flocks, as two servers
    held, got = threading.Event(), {}

    def plan() -> None:
        with holder.planning(KEY) as waited:
            got["holder_waited"] = waited
            held.set()
            time.sleep(0.5)  # planning
            holder.store(KEY, _record())

    t = threading.Thread(target=plan)
    t.start()
    assert held.wait(10)
    start = time.monotonic()
    with waiter.planning(KEY) as waited:
        got["waited_for"] = time.monotonic() - start
        got["record"] = waiter.load(KEY)
    t.join()
    assert got["holder_waited"] is False and waited is True
    assert got["waited_for"] > 0.2  # it did wait for the holder
    assert got["record"] == _record()  # and loaded its entry: nothing to plan
    assert waiter.stats["plan_waits"] == 1 and holder.stats["plan_waits"] == 0
    assert not holder.plan_lock_of(KEY).exists()


HOLDER = """
import sys, time
from device_server.disk_cache import DiskCache
with DiskCache(sys.argv[1]).planning(sys.argv[2]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_server_killed_holding_the_lock_releases_it(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), KEY], env=su.child_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        waiter, done = DiskCache(tmp_path), threading.Event()
        result = {}

        def wait() -> None:
            with waiter.planning(KEY) as waited:
                result["waited"], result["record"] = waited, waiter.load(KEY)
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        assert not done.wait(0.5)  # held by the other process
        child.kill()
        killed = time.monotonic()
        assert done.wait(10)
        assert time.monotonic() - killed < 2.0
        # The holder wrote nothing: the waiter plans it itself.
        assert result == {"waited": True, "record": None}
    finally:
        child.kill()
        child.wait()


def test_a_stopped_compile_stops_waiting(tmp_path):
    holder, waiter = DiskCache(tmp_path), DiskCache(tmp_path)
    token = StopToken()
    with holder.planning(KEY):
        threading.Timer(0.3, token.stop, ("cancelled",)).start()
        start = time.monotonic()
        with running(token), pytest.raises(RunStopped, match="another server's plan"):
            with waiter.planning(KEY):
                pass
        assert 0.2 < time.monotonic() - start < 3.0
