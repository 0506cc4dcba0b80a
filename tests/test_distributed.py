"""tf-ipu-run and the instance API (popdist's names), with a real mpirun on loopback.

    test process ── tf-ipu-run (python -m tf_ipu.distributed.launcher)
                      ├─ mpirun (servers' job): device server 0, device server 1 ── MPI
                      └─ mpirun (instances' job): rank 0: program ─gRPC─> server 0 ─┐
                                                  rank 1: program ─gRPC─> server 1 ─┴ MPI
    each program writes what it saw to a JSON file; the tests compare the files.

Two runs with TensorFlow share one launch (a module fixture); the failure run imports no
TensorFlow, so it is quick.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import server_util as su

from tf_ipu.distributed import identity, launcher

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 240


def _launch(args: list[str], cwd: Path, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tf_ipu.distributed.launcher", *args],
                          cwd=cwd, env=su.launcher_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _run_processes() -> list[str]:
    """Command lines of processes that belong to a tf-ipu-run (their run folder's name)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if "tf_ipu_run_" in cmd:
            found.append(f"{pid}: {cmd}")
    return found


# -- the launcher's plan (no processes) ---------------------------------------------------


def test_replicas_divide_evenly_among_instances():
    assert launcher.divide_replicas(4, 2) == 2
    assert launcher.divide_replicas(6, 3) == 2
    assert launcher.divide_replicas(1, 1) == 1
    with pytest.raises(launcher.LaunchError, match=r"--num-replicas 3 .* --num-instances 2"):
        launcher.divide_replicas(3, 2)
    with pytest.raises(launcher.LaunchError, match="--num-instances must be >= 1"):
        launcher.divide_replicas(2, 0)


def test_command_line_refuses_an_uneven_division(capsys):
    status = launcher.main(["--num-instances", "4", "--num-replicas", "6", "--", "python", "x.py"])
    assert status == 2
    err = capsys.readouterr().err
    assert "--num-replicas 6 cannot be divided evenly among --num-instances 4" in err
    assert launcher.main(["--num-instances", "2", "--num-replicas", "2"]) == 2
    assert "no program given" in capsys.readouterr().err
    assert launcher.main(["--num-instances", "2", "--num-replicas", "2",
                          "--only-output-from-instance", "2", "--", "python", "x.py"]) == 2
    assert "[0, 2)" in capsys.readouterr().err


def test_mpirun_command_local_and_hosts():
    plan, _ = launcher.plan_from_args(
        ["--num-instances", "2", "--num-replicas", "4", "--ipus-per-replica", "2",
         "--mpi-global-args=--tag-output", "--mpi-local-args=-x FOO",
         "--executable-cache-path", "/tmp/cache", "--", "python", "train.py", "--lr", "1"])
    assert plan.local_replicas == 2
    cmd = launcher.mpirun_command(plan, "/tmp/run", "mpirun")
    joined = " ".join(cmd)
    assert "--oversubscribe" in cmd and "btl_tcp_if_include lo" in joined  # loopback only
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert cmd[cmd.index("-n") + 1] == "2"
    assert cmd.index("--tag-output") < cmd.index("-n") < cmd.index("FOO")  # global, local
    assert "mpi_yield_when_idle 1" in joined and "--bind-to none" in joined
    assert cmd[-5:] == ["--", "python", "train.py", "--lr", "1"]
    # The servers' job: the same MPI options (local args aside), rank k becoming server k
    # with instance k's 2 x 2 IPUs and the shared cache folder.
    servers = launcher.servers_command(plan, "/tmp/run", "mpirun")
    assert servers[:servers.index("-n") + 2] == cmd[:cmd.index("-n") + 2]
    assert "FOO" not in servers and "TF_IPU_RUN_WATCH" not in servers
    assert servers[servers.index("--run-dir") - 1] == "--server"
    assert servers[servers.index("--ipus") + 1] == "4"
    assert "--executable-cache-path /tmp/cache" in " ".join(servers)
    assert "--executable-cache-path" not in cmd
    env = launcher.run_environment(plan)
    assert env[identity.TOTAL_REPLICAS] == "4" and env[identity.LOCAL_REPLICAS] == "2"
    assert env[identity.IPUS_PER_REPLICA] == "2" and "TF_IPU_SERVER" not in env

    remote, _ = launcher.plan_from_args(["--num-instances", "4", "--num-replicas", "4",
                                         "--host", "node1,node2", "--", "python", "t.py"])
    cmd = launcher.mpirun_command(remote, "/tmp/run", "mpirun")
    assert cmd[cmd.index("--host") + 1] == "node1:2,node2:2"
    assert "--oversubscribe" not in cmd and "lo" not in cmd
    servers = launcher.servers_command(remote, "/tmp/run", "mpirun")
    # Server k lands on instance k's host: the same hosts and mapping.
    assert servers[:servers.index("-n") + 2] == cmd[:cmd.index("-n") + 2]
    with pytest.raises(launcher.LaunchError, match="3 hosts"):
        launcher.plan_from_args(["--num-instances", "4", "--num-replicas", "4",
                                 "--host", "a,b,c", "--", "python", "t.py"])


def test_python_options_stay_with_the_interpreter():
    from tf_ipu.distributed.rank import split_interpreter_options

    assert split_interpreter_options(["-u", "-X", "dev", "train.py", "-v"]) == (
        ["-u", "-X", "dev"], ["train.py", "-v"])
    assert split_interpreter_options(["-m", "pkg.mod", "-x"]) == ([], ["-m", "pkg.mod", "-x"])
    assert split_interpreter_options(["-O", "-c", "print(1)"]) == (["-O"], ["-c", "print(1)"])


def test_outside_a_run_one_instance(monkeypatch):
    for name in (*identity.RUN_VARIABLES, *identity.INSTANCE_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    import importlib

    import tensorflow as tf

    import tf_ipu  # registers popdist and Graphcore's module names

    popdist = importlib.import_module("popdist")
    importlib.import_module("popdist.tensorflow")
    host_collective_ops = importlib.import_module(
        "tensorflow.python.ipu.distributed.host_collective_ops")

    assert not popdist.isPopdistEnvSet()
    assert (popdist.getInstanceIndex(), popdist.getNumInstances(), popdist.getNumLocalReplicas(),
            popdist.getNumTotalReplicas(), popdist.getNumIpusPerReplica(),
            popdist.getReplicaIndexOffset()) == (0, 1, 1, 1, 1, 0)
    popdist.init()  # nothing to join
    cfg = tf_ipu.IPUConfig()
    cfg.auto_select_ipus = 4
    assert popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=2) is cfg
    assert cfg.auto_select_ipus == 2  # one replica of 2 IPUs
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(host_collective_ops.allreduce(tf.constant(a)).numpy(), a)
    np.testing.assert_array_equal(host_collective_ops.allgather(tf.constant(a)).numpy(), a)


def test_popdist_imports_neither_tensorflow_nor_mpi():
    code = ("import sys, tf_ipu.distributed as d; assert d.install_popdist(); "
            "import popdist, popdist.tensorflow; assert popdist.getNumInstances() == 1; "
            "print(sorted(m for m in ('tensorflow', 'mpi4py.MPI') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POPDIST_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- runs ---------------------------------------------------------------------------------

PROGRAM = """
import json, os, sys
import numpy as np
import tensorflow as tf
import tf_ipu, keras
import popdist, popdist.tensorflow
from tf_ipu import notices
from tensorflow.python import ipu
from tensorflow.python.ipu.distributed import host_collective_ops, popdist_strategy

k = popdist.getInstanceIndex()
out = {name: getattr(popdist, name)() for name in (
    "getInstanceIndex", "getNumInstances", "getNumLocalReplicas", "getNumTotalReplicas",
    "getNumIpusPerReplica", "getReplicaIndexOffset", "isPopdistEnvSet")}
out["rank"] = int(os.environ["OMPI_COMM_WORLD_RANK"])
out["server"] = os.environ["TF_IPU_SERVER"]
argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
out["run_dir"] = argv[argv.index(b"--run-dir") + 1].decode()  # this run's folder
keras.utils.set_random_seed(1000 + 7 * k)  # each instance draws other initial weights

cfg = ipu.config.IPUConfig()
popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=1)
out["auto_select_ipus"] = cfg.auto_select_ipus
cfg.configure_ipu_system()
strategy = popdist_strategy.PopDistStrategy()
out["joined"] = strategy.joined
with strategy.scope():
    own = keras.layers.Dense(3, name="d").kernel_initializer((4, 3)).numpy()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d"),
                              keras.layers.Dense(1, name="e")])
    out["own_kernel"] = own.tolist()
    out["weights"] = [w.numpy().tolist() for w in model.weights]
    out["reduced"] = strategy.reduce(tf.distribute.ReduceOp.MEAN,
                                     tf.constant([[1.0, 2.0], [3.0, 4.0]]) * (k + 1),
                                     axis=0).numpy().tolist()
    # Each instance evaluates its own data; the loss reported is the instances' mean.
    data = np.random.RandomState(10 + k).rand(8, 4).astype(np.float32)
    target = np.random.RandomState(20 + k).rand(8, 1).astype(np.float32)
    out["data"], out["target"] = data.tolist(), target.tolist()
    model.compile(loss="mse")
    # Within the instance, its 2 replicas' losses are averaged (Graphcore's default keeps
    # the last replica's); across the instances, tf_ipu.distributed averages them.
    model.set_replication_options(replicated_metric_reduction_method="MEAN")
    out["evaluated"] = model.evaluate(data, target, batch_size=4, verbose=0)

x = np.random.RandomState(k).rand(3, 5).astype(np.float32)
out["x"] = x.tolist()
out["sum"] = host_collective_ops.allreduce(tf.constant(x), tf.distribute.ReduceOp.SUM).numpy().tolist()
out["mean"] = host_collective_ops.allreduce(tf.constant(x), tf.distribute.ReduceOp.MEAN).numpy().tolist()
out["gathered"] = host_collective_ops.allgather(tf.constant(x[: k + 1])).numpy().tolist()
out["from_1"] = host_collective_ops.broadcast(tf.constant(x), root_rank=1).numpy().tolist()
in_graph = tf.function(lambda t: host_collective_ops.allreduce(t, tf.distribute.ReduceOp.SUM))
out["sum_in_function"] = in_graph(tf.constant(x)).numpy().tolist()

# A configuration not made for the run: the instances run independently, and are told so.
plain = ipu.config.IPUConfig()
plain.configure_ipu_system()
out["warned"] = any("run independently" in m or "under tf-ipu-run" in m for m in notices.said())
out["joined_plain"] = popdist_strategy.PopDistStrategy().joined
json.dump(out, open(os.path.join(sys.argv[1], f"instance{k}.json"), "w"))
"""


@pytest.fixture(scope="module")
def tf_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distributed")
    script = folder / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    before = set(_run_processes())
    start = time.monotonic()
    result = _launch(["--num-instances", "2", "--num-replicas", "4", "--",
                      sys.executable, str(script), str(folder)], folder)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    outs = [json.loads((folder / f"instance{k}.json").read_text()) for k in range(2)]
    # Only this run's processes: the run folder in their command lines (runs of other test
    # sessions may be going on at the same time).
    return outs, elapsed, {p for p in set(_run_processes()) - before if outs[0]["run_dir"] in p}


def test_each_instance_knows_who_it_is(tf_run):
    outs, _, _ = tf_run
    for k, out in enumerate(outs):
        assert out["isPopdistEnvSet"] is True
        assert out["getInstanceIndex"] == out["rank"] == k
        assert out["getNumInstances"] == 2
        assert out["getNumTotalReplicas"] == 4
        assert out["getNumLocalReplicas"] == 2
        assert out["getNumIpusPerReplica"] == 1
        assert out["getReplicaIndexOffset"] == 2 * k
        assert out["auto_select_ipus"] == 2  # its replicas, on its own server


def test_each_instance_has_its_own_device_server(tf_run):
    outs, _, left = tf_run
    addresses = [out["server"] for out in outs]
    assert len(set(addresses)) == 2, addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    assert not left, left  # the servers (and ranks) are gone once the launcher returned


def test_initial_weights_come_from_instance_0(tf_run):
    outs, _, _ = tf_run
    assert outs[0]["joined"] and outs[1]["joined"]
    # Seeded apart, the instances draw different kernels on their own...
    assert not np.allclose(outs[0]["own_kernel"], outs[1]["own_kernel"])
    # ...but the model built under PopDistStrategy holds instance 0's on both.
    for w0, w1 in zip(outs[0]["weights"], outs[1]["weights"], strict=True):
        np.testing.assert_array_equal(np.array(w0), np.array(w1))
    assert np.abs(np.array(outs[0]["weights"][0])).sum() > 0


def test_keras_logs_are_reduced_over_the_instances(tf_run):
    outs, _, _ = tf_run
    w1, b1, w2, b2 = (np.array(w, np.float64) for w in outs[0]["weights"])
    losses = []
    for out in outs:
        x, t = np.array(out["data"], np.float64), np.array(out["target"], np.float64)
        losses.append(np.mean(((x @ w1 + b1) @ w2 + b2 - t) ** 2))
    assert abs(losses[0] - losses[1]) > 1e-3  # the instances' own losses differ
    for out in outs:
        assert out["evaluated"] == pytest.approx(np.mean(losses), rel=1e-4)


def test_host_collectives_match_numpy(tf_run):
    outs, _, _ = tf_run
    xs = [np.array(out["x"], np.float32) for out in outs]
    for out in outs:
        np.testing.assert_allclose(out["sum"], xs[0] + xs[1], rtol=1e-6)
        np.testing.assert_allclose(out["sum_in_function"], xs[0] + xs[1], rtol=1e-6)
        np.testing.assert_allclose(out["mean"], (xs[0] + xs[1]) / 2, rtol=1e-6)
        np.testing.assert_array_equal(out["gathered"], np.concatenate([xs[0][:1], xs[1][:2]]))
        np.testing.assert_array_equal(out["from_1"], xs[1])
        # MEAN along axis 0 of [[1,2],[3,4]] x1 (instance 0) and x2 (instance 1): every
        # row of both instances weighs alike.
        rows = np.concatenate([np.array([[1.0, 2.0], [3.0, 4.0]]) * (k + 1) for k in range(2)])
        np.testing.assert_allclose(out["reduced"], rows.mean(axis=0))


def test_a_program_not_configured_for_the_run_is_warned(tf_run):
    outs, _, _ = tf_run
    for out in outs:
        assert out["warned"] is True
        assert out["joined_plain"] is False


FAILING = """
import sys, time
from tf_ipu.distributed import identity, mpi
k = identity.getInstanceIndex()
if k == 1:
    time.sleep(0.5)
    raise RuntimeError("boom in instance one")
mpi.barrier()  # instance 0 waits here for an instance that will never come
print("not reached", flush=True)
"""


def test_a_failing_instance_stops_the_run_and_is_named(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(textwrap.dedent(FAILING))
    before = set(_run_processes())
    start = time.monotonic()
    result = _launch(["--num-instances", "2", "--num-replicas", "2",
                      "--only-output-from-instance", "0",
                      "--executable-cache-path", str(tmp_path / "cache"), "--",
                      sys.executable, "-u", str(script)], tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "instance 1 (MPI rank 1) failed: RuntimeError: boom in instance one" in result.stderr
    # Instance 1's own traceback was not shown (--only-output-from-instance 0): the
    # launcher's line is the one naming the error.
    assert result.stderr.count("boom in instance one") == 1, result.stderr
    assert (tmp_path / "cache").is_dir()  # the servers were given the shared cache folder
    assert "not reached" not in result.stdout
    assert elapsed < 100, elapsed
    assert not set(_run_processes()) - before


MISMATCHED = """
import json, sys
from tf_ipu.distributed import identity, mpi
k = identity.getInstanceIndex()
out = {"gathered": mpi.allgather([[k, k]] * (k + 1)).tolist()}
try:  # instance 0 reduces its logs while instance 1 still runs a step
    mpi.allreduce([1.0], "mean", "epoch-end logs" if k == 0 else "a step's logs")
    out["error"] = None
except RuntimeError as e:
    out["error"] = str(e)
mpi.barrier()
out["after"] = mpi.allreduce([k + 1], "sum").tolist()  # still in step with each other
json.dump(out, open(sys.argv[1] + f"/mismatch{k}.json", "w"))
"""


def test_instances_at_different_calls_are_told_not_left_waiting(tmp_path):
    script = tmp_path / "mismatched.py"
    script.write_text(textwrap.dedent(MISMATCHED))
    result = _launch(["--num-instances", "2", "--num-replicas", "2", "--",
                      sys.executable, str(script), str(tmp_path)], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    outs = [json.loads((tmp_path / f"mismatch{k}.json").read_text()) for k in range(2)]
    for k, out in enumerate(outs):
        assert out["gathered"] == [[0, 0], [1, 1], [1, 1]]  # sizes differ along dim 0
        assert f"Instance {k} is at a collective call" in out["error"]
        assert "same number of steps" in out["error"]
        assert out["after"] == [3]


def test_a_server_that_cannot_start_is_named_with_its_log(tmp_path):
    # A file where the cache folder should be: every server of the run refuses it and exits
    # before serving; each instance's rank says which server, and what its log says.
    (tmp_path / "not_a_folder").write_text("")
    before = set(_run_processes())
    start = time.monotonic()
    result = _launch(["--num-instances", "2", "--num-replicas", "2",
                      "--executable-cache-path", str(tmp_path / "not_a_folder"), "--",
                      sys.executable, "-c", "print('not reached')"], tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "not reached" not in result.stdout
    found = re.search(r"tf-ipu-run: instance (\d) \(MPI rank \1\) failed: could not start: its "
                      r"device server \(server \1 of the run, rank \1 of the servers' MPI job, "
                      r"serving 1 IPU\) "
                      r"(\(pid \d+\) ended before serving|did not serve: the servers' MPI "
                      r"job ended)\. Its log ends with:\n[^\0]*?executable cache path "
                      r"'[^']*not_a_folder' cannot be used", result.stderr)
    assert found, result.stderr[-3000:]
    assert elapsed < 60, elapsed  # at once, not after the 120 s start-up limit
    assert not set(_run_processes()) - before
