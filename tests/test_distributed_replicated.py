"""One replicated program across device servers (issue 27, point 3), with a real mpirun on
loopback.

    mpirun -n N python -m device_server --mpi-world ...      the run's servers: one MPI job
    mpirun -n N python <instance program>                    the instances: another job
        instance k: popdist identity (offset k x local), TF_IPU_SERVER = server k,
        popdist.tensorflow.set_ipu_config, PopDistStrategy, Keras fit of a small model
        with Dropout, seeded 100 + k (instance 0's initial values must win)
    python <instance program> (no mpirun)                    the references: one instance
        with all the replicas (1 x 4, then 1 x 2), seeded 100, its own embedded server

Replica r of the run gets the same batches in both: one instance with R replicas feeds
replica r the global batches j with j % R == r (Graphcore's round-robin, step i of replica r
takes batch i x R + r of a call); instance k of a run of local replicas L takes the global
batches j with (j % R) // L == k, in order, so its local replica l is fed as replica
k x L + l. The final FP32 weights must be bit-identical (np.array_equal) to the reference.

The failure and program-hash tests need no TensorFlow: the test process talks to the two
servers of a world itself (tf_ipu.client.DeviceClient, hand-built IR with a
tf_ipu_all_reduce), one thread per server.

Time: 178 s measured on this machine's 2 cores shared with other jobs (load average 10-12);
nearly all of it is TensorFlow's start, tracing and compiling in the 8 instance processes
and the reference process (the tests without TensorFlow take 2-4 s each).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from device_server.protocol import ALL_REDUCE_TARGET, REPLICA_ID_TARGET, ir_pb2
from tests.server_util import Builder, array_shape, child_env, steps_module

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() \
    else sys.executable
MPIRUN = str(Path(PY).parent / "mpirun")
MPI_ARGS = ["--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,tcp",
            "--mca", "btl_tcp_if_include", "lo", "--mca", "mpi_yield_when_idle", "1"]
if os.geteuid() == 0:
    MPI_ARGS.insert(0, "--allow-run-as-root")
RUN_TIMEOUT = 600

#: The instance program: trains under PopDistStrategy and saves its weights. Argument: a
#: JSON list of runs (one under mpirun; several, one after the other, for the references).
INSTANCE = textwrap.dedent('''
    import json, os, sys
    runs = json.loads(sys.argv[1])
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    first = runs[0]
    os.environ["POPDIST_NUM_IPUS_PER_REPLICA"] = "1"
    os.environ["POPDIST_REPLICA_INDEX_OFFSET"] = str(rank * first["local"])
    os.environ["POPDIST_NUM_TOTAL_REPLICAS"] = str(first["total"])
    os.environ["POPDIST_NUM_LOCAL_REPLICAS"] = str(first["local"])
    if first.get("servers"):
        with open(os.path.join(first["servers"], f"server-{rank}")) as f:
            os.environ["TF_IPU_SERVER"] = "127.0.0.1:" + f.read().strip()
    import numpy as np
    import keras
    import tf_ipu  # noqa: F401
    import popdist.tensorflow
    from tensorflow.python.ipu.distributed import PopDistStrategy

    def model_of(width):
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(width, activation="relu"),
                                 keras.layers.Dropout(0.3), keras.layers.Dense(4)])

    for run in runs:
        total, local = run["total"], run["local"]
        os.environ["POPDIST_NUM_TOTAL_REPLICAS"] = str(total)
        os.environ["POPDIST_NUM_LOCAL_REPLICAS"] = str(local)
        seed = run["seed"] + rank
        keras.utils.set_random_seed(seed)
        own = [w.copy() for w in model_of(16).get_weights()]  # this instance's own start
        keras.utils.set_random_seed(seed)
        cfg = tf_ipu.IPUConfig()
        popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=1)
        cfg.configure_ipu_system()
        b, n = 4, 2
        steps = 4  # per replica: 2 device calls of 2 steps
        rng = np.random.default_rng(0)
        g = steps * total  # global batches of the epoch
        x = rng.normal(size=(g * b, 8)).astype(np.float32)
        y = rng.integers(0, 4, size=(g * b,)).astype(np.int32)
        mine = [j for j in range(g) if (j % total) // local == rank]
        xi = np.concatenate([x[j * b:(j + 1) * b] for j in mine])
        yi = np.concatenate([y[j * b:(j + 1) * b] for j in mine])
        strategy = PopDistStrategy()
        with strategy.scope():
            model = model_of(16)
            model.compile(optimizer=keras.optimizers.SGD(0.05),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=n)
            start = [w.copy() for w in model.get_weights()]
            model.fit(xi, yi, batch_size=b, epochs=1, shuffle=False, verbose=0)
        np.savez(os.path.join(run["out"], f"weights-{rank}.npz"), *model.get_weights())
        np.savez(os.path.join(run["out"], f"own-{rank}.npz"), *own)
        np.savez(os.path.join(run["out"], f"start-{rank}.npz"), *start)
        print("instance", rank, "done", flush=True)
''')


def _mpi_env() -> dict[str, str]:
    env = {k: v for k, v in child_env().items()
           if not k.startswith(("POPDIST_", "OMPI_", "PMIX_", "PRTE_")) and k != "TF_IPU_SERVER"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", GRPC_VERBOSITY="NONE")
    return env


class World:
    """``n`` device servers of ``ipus`` IPUs each, ranks of one mpirun (``--mpi-world``)."""

    def __init__(self, n: int, ipus: int, folder: Path) -> None:
        self.n, self.folder = n, folder
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "servers.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [MPIRUN, *MPI_ARGS, "-n", str(n), PY, "-m", "device_server", "--mpi-world",
                 "--port", "0", "--port-file", str(folder / "server-{rank}"), "--ipus", str(ipus),
                 "--shutdown-grace", "1"],
                env=_mpi_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        end = time.monotonic() + 60
        while not all((folder / f"server-{k}").exists() for k in range(n)):
            if self.process.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"the servers did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.addresses = [f"127.0.0.1:{(folder / f'server-{k}').read_text().strip()}"
                          for k in range(n)]

    def counters(self) -> list[dict[str, int]]:
        from tf_ipu.client import DeviceClient

        out = []
        for address in self.addresses:
            client = DeviceClient(address)
            try:
                out.append(client.counters())
            finally:
                client.close()
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def _instances(script: Path, runs: list[dict], n: int) -> subprocess.Popen:
    args = [PY, str(script), json.dumps(runs)]
    if n > 1:
        args = [MPIRUN, *MPI_ARGS, "-n", str(n), *args]
    env = _mpi_env()
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL, cwd=str(script.parent),
                            start_new_session=True)


def _finish(p: subprocess.Popen, what: str) -> str:
    try:
        out, _ = p.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        raise AssertionError(f"{what} did not end within {RUN_TIMEOUT} s:\n{out[-4000:]}") from None
    assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{out[-4000:]}"
    return out


def _weights(folder: Path, name: str) -> list[np.ndarray]:
    with np.load(folder / f"{name}.npz") as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


@pytest.fixture(scope="module")
def runs() -> Iterator[dict]:
    """The references and the three multi-instance runs (2 x 2, 4 x 1, 2 x 1), once."""
    root = Path(tempfile.mkdtemp(prefix="tf_ipu_world_"))
    script = root / "instance.py"
    script.write_text(INSTANCE)
    out = {name: root / name for name in ("ref4", "ref2", "w2x2", "w4x1", "w2x1")}
    for folder in out.values():
        folder.mkdir()
    reference = _instances(script, [{"total": 4, "local": 4, "seed": 100, "out": str(out["ref4"])},
                                    {"total": 2, "local": 2, "seed": 100, "out": str(out["ref2"])}],
                           1)
    result: dict = {"out": out}

    def launch(name: str, n: int, local: int) -> None:
        world = World(n, local, root / f"servers-{name}")
        try:
            p = _instances(script, [{"total": n * local, "local": local, "seed": 100,
                                     "out": str(out[name]), "servers": str(world.folder)}], n)
            _finish(p, f"the {n} x {local} run")
            result[f"counters-{name}"] = world.counters()
        finally:
            world.stop()

    try:
        # One after the other: at once they took longer here (2 cores, 7 TF processes).
        for args in (("w2x2", 2, 2), ("w4x1", 4, 1), ("w2x1", 2, 1)):
            launch(*args)
        _finish(reference, "the reference runs")
        yield result
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name, reference, n", [("w2x2", "ref4", 2), ("w4x1", "ref4", 4),
                                                ("w2x1", "ref2", 2)])
def test_instances_reach_the_weights_of_one_instance_with_all_replicas(runs, name, reference, n):
    out = runs["out"]
    ref = _weights(out[reference], "weights-0")
    for k in range(n):
        got = _weights(out[name], f"weights-{k}")
        assert len(got) == len(ref) == 4
        for w, r in zip(got, ref, strict=True):
            assert w.dtype == np.float32
            assert np.array_equal(w, r), (name, k, float(np.abs(w - r).max()))


def test_instance_zero_initial_weights_win_over_other_seeds(runs):
    out = runs["out"]
    for name, n in (("w2x2", 2), ("w4x1", 4)):
        own0 = _weights(out[name], "own-0")
        for k in range(1, n):
            own = _weights(out[name], f"own-{k}")  # seeded 100 + k: its own start differs
            assert not np.array_equal(own[0], own0[0])
            start = _weights(out[name], f"start-{k}")  # after the broadcast: instance 0's
            for s, o in zip(start, own0, strict=True):
                assert np.array_equal(s, o)
    # Training moved the weights (the comparison above is not of untouched values).
    assert not np.array_equal(_weights(out["w2x2"], "weights-0")[0],
                              _weights(out["w2x2"], "start-0")[0])


def test_each_server_runs_its_own_replicas_and_counts_the_mpi_bytes(runs):
    for name, n, local in (("w2x2", 2, 2), ("w4x1", 4, 1)):
        counters = runs[f"counters-{name}"]
        assert [c["world.rank"] for c in counters] == list(range(n))
        executions = counters[0]["executions"]
        assert executions >= 2  # two device calls of the epoch
        for c in counters:
            assert c["world.size"] == n
            assert c["executions"] == executions == c["world.executions"]
            # Only its local replicas: local per execution, not the run's n x local.
            assert c["replica_runs"] == executions * local
            sent, received = c["world.all_reduce_bytes_sent"], c["world.all_reduce_bytes_received"]
            # The gradients of the model (8x16 + 16 + 16x4 + 4 floats) per step, per replica,
            # to each of the other servers.
            grads = (8 * 16 + 16 + 16 * 4 + 4) * 4
            assert sent == received and sent >= executions * 2 * grads * local * (n - 1)
            assert c["world.failures_sent"] == c["world.failures_received"] == 0


# -- failure and mismatch: hand-built programs, the test process as both instances ---------


def _module(scale: float, name: str = "world_step") -> ir_pb2.Module:
    """y = all_reduce(sqrt(x) * scale + replica id) over the run's replicas."""
    m = ir_pb2.Module(name=name, entry_computation_id=0, frontend="test")
    b = Builder(m, 0, "main")
    x = b.parameter(array_shape(np.float32, [4]))
    rid = b.op("custom-call", [], array_shape(np.int32, []), custom_call_target=REPLICA_ID_TARGET)
    rid4 = b.op("broadcast", [b.op("convert", [rid], array_shape(np.float32, []))],
                array_shape(np.float32, [4]), dimensions=[])
    k = b.op("broadcast", [b.constant(np.array(scale, np.float32))], array_shape(np.float32, [4]),
             dimensions=[])
    v = b.op("add", [b.op("multiply", [b.op("sqrt", [x]), k]), rid4])
    b.root(b.op("custom-call", [v], custom_call_target=ALL_REDUCE_TARGET, backend_config="sum"))
    return m


@pytest.fixture
def world2(tmp_path) -> Iterator[World]:
    world = World(2, 1, tmp_path / "servers")
    try:
        yield world
    finally:
        world.stop()


def _on_both(world: World, run: Callable[[int, object], object]) -> list[object]:
    """``run(k, client)`` for server k's own client (a session with one IPU), both at once;
    returns what each returned or raised."""
    from tf_ipu.client import DeviceClient

    results: list[object] = [None, None]

    def one(k: int) -> None:
        client = DeviceClient(world.addresses[k])
        try:
            client.open_session()
            client.attach(1)
            results[k] = run(k, client)
        except Exception as e:  # handed to the test
            results[k] = e
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a server waited forever"
    return results


def _all_reduce_on_both(world: World, scales: list[float], inputs: list[np.ndarray],
                        checks: bool = False) -> list[object]:
    """``_module(scales[k])`` compiled on server k as a program of 2 instances and run there
    with ``inputs[k]`` (``checks``: floating-point exception checks on)."""
    def run(k: int, client: object) -> object:
        exe = client.compile(_module(scales[k]), instances=2,  # type: ignore[attr-defined]
                             floating_point_behaviour={"inv": True} if checks else None)
        return client.execute(exe.executable_id, [inputs[k]], timeout=60)  # type: ignore[attr-defined]

    return _on_both(world, run)


def test_a_failing_replica_on_one_server_stops_the_others_with_its_error(world2):
    x = np.arange(1, 5, dtype=np.float32)
    ok = _all_reduce_on_both(world2, [2.0, 2.0], [x, x * 4], checks=True)
    # Sums in global replica order: server 0's replica is replica 0, server 1's replica 1.
    expected = (np.sqrt(x) * 2 + 0) + (np.sqrt(x * 4) * 2 + 1)
    for r in ok:
        assert isinstance(r, list), r
        np.testing.assert_allclose(r[0], expected, rtol=0, atol=0)
    started = time.monotonic()
    bad = _all_reduce_on_both(world2, [2.0, 2.0], [x, -x], checks=True)
    assert time.monotonic() - started < 30
    assert all(isinstance(r, Exception) for r in bad), bad
    assert "sqrt" in str(bad[1]) or "invalid" in str(bad[1]).lower(), bad[1]
    assert "instance 1 (device server rank 1) failed" in str(bad[0]), bad[0]
    assert "FloatingPointExceptionError" in str(bad[0])
    # The run stays broken; the servers still answer.
    again = _all_reduce_on_both(world2, [2.0, 2.0], [x, x], checks=True)
    assert all("the run is broken" in str(r) for r in again), again
    counters = world2.counters()
    assert counters[1]["world.failures_sent"] == 1 and counters[0]["world.failures_received"] == 1


def test_servers_that_compiled_different_programs_are_refused(world2):
    x = np.arange(1, 5, dtype=np.float32)
    results = _all_reduce_on_both(world2, [2.0, 3.0], [x, x])
    for r in results:
        assert isinstance(r, Exception), r
        assert "did not all compile the same program" in str(r), r
        assert "instance 0:" in str(r) and "instance 1:" in str(r)
    # Refused at once by both, agreed: the run is not broken, the same program runs.
    same = _all_reduce_on_both(world2, [3.0, 3.0], [x, x])
    assert all(isinstance(r, list) for r in same), same
    assert world2.counters()[0]["world.broken"] == 0


def test_a_stop_on_one_server_stops_every_replica_at_the_same_step(world2):
    from tf_ipu.client import VariableRef

    never = np.int32(2**31 - 1)
    dim = 8

    def run(k: int, client: object) -> object:
        exe = client.compile(steps_module(dim, name="world_steps"),  # type: ignore[attr-defined]
                             instances=2).executable_id
        client.write_variables({"w": np.zeros(dim, np.float32)})  # type: ignore[attr-defined]
        try:  # a device loop that never ends; only server 0's call has a run deadline
            client.execute(exe, [VariableRef("w"), never, never],  # type: ignore[attr-defined]
                           run_deadline=1.0 if k == 0 else 0.0, timeout=60)
        except Exception as e:  # both must stop, at the same step
            return str(e), client.read_variables(["w"])["w"]  # type: ignore[attr-defined]
        return "not stopped", None

    started = time.monotonic()
    results = _on_both(world2, run)
    assert time.monotonic() - started < 30
    (said0, w0), (said1, w1) = results  # type: ignore[misc]
    for said in (said0, said1):
        assert "run deadline passed" in said and "completed steps" in said, said
    steps = w0[0]
    assert steps >= 1 and steps == int(steps)
    np.testing.assert_array_equal(w0, np.full(dim, steps, np.float32))
    np.testing.assert_array_equal(w1, w0)  # the same step on both servers


def test_the_compared_digest_ignores_names_but_not_the_program():
    from device_server.emulator.world import program_digest

    a, b = _module(2.0, name="sequential/train_function"), _module(2.0, name="other")
    for k, instr in enumerate(a.computations[0].instructions):
        instr.source_op = f"sequential_1/dense_3/op{k}"
        b.computations[0].instructions[k].source_op = f"sequential_2/dense_7/op{k}"
        b.computations[0].instructions[k].name = f"renamed.{k}"
    assert program_digest(a, "opts") == program_digest(b, "opts")
    assert program_digest(a, "opts") != program_digest(a, "other opts")
    assert program_digest(a, "opts") != program_digest(_module(3.0), "opts")
    c = _module(2.0)
    c.computations[0].instructions[0].source_op = "sequential/dense/other_op"
    assert program_digest(a, "opts") != program_digest(c, "opts")


def test_a_world_execution_waiting_behind_another_gives_up_at_its_own_stop(tmp_path):
    """Server 0 holds a world execution that never ends by itself (a device loop without
    end, on both servers); a second session's world program on server 0 waits for it and
    gives up at its own run deadline (DEADLINE_EXCEEDED), or when its client cancels it,
    naming the execution that holds the server; the first is then stopped, and both
    servers still run world programs, their executions still matched."""
    from tf_ipu.client import DeviceClient, VariableRef
    from tf_ipu.errors import DeviceError

    servers = World(2, 2, tmp_path / "servers")  # 2 IPUs each: two sessions on server 0
    holders = [DeviceClient(address) for address in servers.addresses]
    try:
        never = np.int32(2**31 - 1)
        held: list[object] = [None, None]

        def hold(k: int) -> None:
            client = holders[k]
            try:
                client.open_session()
                client.attach(1)
                exe = client.compile(steps_module(8, name="world_steps"),
                                     instances=2).executable_id
                client.write_variables({"w": np.zeros(8, np.float32)})
                client.execute(exe, [VariableRef("w"), never, never], timeout=120)
                held[k] = "not stopped"
            except Exception as e:  # the test stops it below
                held[k] = (e, client.read_variables(["w"])["w"])

        threads = [threading.Thread(target=hold, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        end = time.monotonic() + 60
        while servers.counters()[0]["world.executions"] < 1:  # server 0 holds it now
            assert time.monotonic() < end and all(t.is_alive() for t in threads), held
            time.sleep(0.1)

        waiter = DeviceClient(servers.addresses[0])
        try:
            waiter.open_session()
            waiter.attach(1)
            exe = waiter.compile(_module(2.0), instances=2).executable_id
            x = np.arange(1, 5, dtype=np.float32)
            # (a) Its run deadline (0.5 s) passes while it waits.
            started = time.monotonic()
            with pytest.raises(DeviceError) as info:
                waiter.execute(exe, [x], run_deadline=0.5, timeout=60)
            waited = time.monotonic() - started
            assert 0.5 <= waited < 3.0, waited
            assert info.value.code == "DEADLINE_EXCEEDED", info.value
            said = str(info.value)
            assert "another world execution holds device server rank 0" in said, said
            assert "Execute of executable" in said and "world execution 0" in said, said
            assert " since " in said and "UTC" in said and "its run was stopped (" in said, said
            # (b) Its client cancels it while it waits.
            cancel = threading.Timer(0.5, waiter.cancel_running)
            started = time.monotonic()
            cancel.start()
            with pytest.raises(DeviceError) as info:
                waiter.execute(exe, [x], timeout=60)
            waited = time.monotonic() - started
            cancel.join()
            assert 0.5 <= waited < 3.0, waited
            assert info.value.code == "CANCELLED", info.value
            assert "another world execution holds device server rank 0" in str(info.value)
            assert all(t.is_alive() for t in threads), held  # the first still held it
            counters = servers.counters()
            assert counters[0]["world.run_waits_given_up"] == 2, counters[0]
            assert counters[0]["world.executions"] == 1  # the waits were no executions
        finally:
            waiter.close()

        # The first is stopped (by its client on server 0): both servers at the same step.
        holders[0].cancel_running()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), held
        (e0, w0), (e1, w1) = held  # type: ignore[misc]
        assert "completed steps" in str(e0) and "completed steps" in str(e1), (e0, e1)
        np.testing.assert_array_equal(w1, w0)

        # Both servers still serve world programs, and their executions are still matched.
        x = np.arange(1, 5, dtype=np.float32)
        ok = _all_reduce_on_both(servers, [2.0, 2.0], [x, x * 4])
        expected = (np.sqrt(x) * 2 + 0) + (np.sqrt(x * 4) * 2 + 1)
        for r in ok:
            assert isinstance(r, list), r
            np.testing.assert_array_equal(r[0], expected)
        counters = servers.counters()
        assert [c["world.executions"] for c in counters] == [2, 2]
        assert [c["world.broken"] for c in counters] == [0, 0]
    finally:
        for client in holders:
            client.close()
        servers.stop()


def test_a_waiting_world_execution_stops_with_its_own_reason():
    """``World``'s wait for its run lock alone (no MPI: the lock held by hand): the stop's
    reason given by ``stopped()`` is the error's (a bare True reads as the deadline), the
    wait ends within a slice of the stop, and the holder is named."""
    from device_server.emulator.cancel import RunStopped
    from device_server.emulator.world import RUN_LOCK_SLICE_SECONDS, _Holder
    from device_server.emulator.world import World as ServerWorld

    world = ServerWorld.__new__(ServerWorld)  # only what the wait reads
    world.rank, world._run_lock, world.stats = 3, threading.Lock(), {"run_waits_given_up": 0}
    world._run_lock.acquire()
    world._holder = _Holder("Execute of executable abc", 0x1234, 7, time.time() - 5,
                            time.monotonic() - 5)
    for said, reason in (("cancelled", "cancelled"), ("shutdown", "shutdown"),
                         ("session-closed", "session-closed"), (True, "deadline")):
        stop_at = time.monotonic() + 0.3
        started = time.monotonic()
        with pytest.raises(RunStopped) as info:
            world._acquire_run(0x5678, lambda said=said, at=stop_at:
                               said if time.monotonic() > at else None)
        assert 0.3 <= time.monotonic() - started < 0.3 + 4 * RUN_LOCK_SLICE_SECONDS + 0.5
        assert info.value.reason == reason
        said_text = str(info.value)
        assert "another world execution holds device server rank 3" in said_text
        assert "Execute of executable abc (program 0000000000001234, world execution 7)" in said_text
        assert "program 0000000000005678" in said_text
    assert world.stats["run_waits_given_up"] == 4
    world._run_lock.release()
    world._holder = None
    # Free: taken at once, whatever stopped() says.
    world._acquire_run(1, lambda: "cancelled")
    world._run_lock.release()
