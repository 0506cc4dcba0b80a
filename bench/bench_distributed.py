"""Many instances: the emulator's wall time for 2 instances (tf-ipu-run, each with its own
device server, the servers one MPI job) against 1 instance, at the same global batch.

    (a) 1 instance, 2 replicas:      python program.py              (its embedded server)
    (b) 2 instances, 1 replica each: tf-ipu-run --num-instances 2 --num-replicas 2 --
                                     python program.py              (servers 0 and 1, MPI)

Both train the same small Keras CNN (Conv2D 32, strided Conv2D 32, Dense 128, Dense 10;
32x32x3 inputs, SGD) under PopDistStrategy (``popdist.tensorflow.set_ipu_config``), micro-
batch ``BATCH`` per replica (global batch 2 x ``BATCH``), ``STEPS_PER_EXECUTION`` steps per
device call, from the same seed and the same data: replica r of the run gets the global
batches j with j % 2 == r in both (Graphcore's round-robin within an instance; instance k of
(b) is replica k). Each program times inside itself: a first epoch (tracing, lowering,
compiling, the first runs) is not timed; then ``fit`` of ``EPOCHS`` epochs is, per step after
the first epoch = that time / steps per replica. The launcher's (or the process's) total
wall time, start-up included, is measured outside. The final FP32 weights of (a) and of both
instances of (b) must be bit-identical (np.array_equal): the bench fails if not. The bytes
that crossed MPI are the servers' counters ``world.all_reduce_bytes_sent`` (each server's
gradients to the other, every step).

    .venv/bin/python bench/run.py --only distributed [--quick]

``--quick``: fewer epochs (a smoke run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

BATCH = 16                 # micro-batch per replica
STEPS_PER_EXECUTION = 4    # steps per device call
STEPS_PER_EPOCH = 8        # steps per replica per epoch (2 device calls)
REPLICAS = 2
RUN_TIMEOUT = 600

#: The program both runs execute. Arguments: output folder, timed epochs.
PROGRAM = textwrap.dedent('''
    import json, os, sys, time
    out_dir, epochs = sys.argv[1], int(sys.argv[2])
    batch, n, steps, replicas = {batch}, {n}, {steps}, {replicas}
    # Outside tf-ipu-run: one instance of all the replicas (what set_ipu_config then reads).
    os.environ.setdefault("POPDIST_NUM_TOTAL_REPLICAS", str(replicas))
    os.environ.setdefault("POPDIST_NUM_LOCAL_REPLICAS", str(replicas))
    os.environ.setdefault("POPDIST_NUM_IPUS_PER_REPLICA", "1")
    os.environ.setdefault("POPDIST_REPLICA_INDEX_OFFSET", "0")
    import numpy as np
    import keras
    import tf_ipu
    import popdist
    import popdist.tensorflow
    from tf_ipu import runtime
    from tensorflow.python.ipu.distributed import PopDistStrategy

    k, local = popdist.getInstanceIndex(), popdist.getNumLocalReplicas()
    keras.utils.set_random_seed(0)
    cfg = tf_ipu.IPUConfig()
    popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=1)
    cfg.configure_ipu_system()
    g = steps * replicas  # global batches of an epoch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(g * batch, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=(g * batch,)).astype(np.int32)
    mine = [j for j in range(g) if (j % replicas) // local == k]
    xi = np.concatenate([x[j * batch:(j + 1) * batch] for j in mine])
    yi = np.concatenate([y[j * batch:(j + 1) * batch] for j in mine])
    strategy = PopDistStrategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=n)
        t0 = time.perf_counter()
        model.fit(xi, yi, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        first = time.perf_counter() - t0
        rt = runtime.get_runtime()
        before = rt.call_stats()
        t0 = time.perf_counter()
        model.fit(xi, yi, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        timed = time.perf_counter() - t0
        after = rt.call_stats()
    counters = rt.client.counters()
    np.savez(os.path.join(out_dir, f"weights-{{k}}.npz"), *model.get_weights())
    json.dump({{"instance": k, "local_replicas": local, "first_epoch_seconds": first,
               "timed_seconds": timed, "timed_steps": epochs * steps,
               "calls": int(after["calls"] - before["calls"]),
               "device_seconds": after["device_seconds"] - before["device_seconds"],
               "client_seconds": after["client_seconds"] - before["client_seconds"],
               "updates": int(model.optimizer.iterations.numpy()),
               "counters": {{name: int(counters.get(name, 0)) for name in (
                   "executions", "replica_runs", "all_reduce_bytes", "world.size",
                   "world.executions", "world.collectives", "world.all_reduce_bytes_sent",
                   "world.all_reduce_bytes_received")}}}},
              open(os.path.join(out_dir, f"instance-{{k}}.json"), "w"))
''').format(batch=BATCH, n=STEPS_PER_EXECUTION, steps=STEPS_PER_EPOCH, replicas=REPLICAS)


def _env() -> dict[str, str]:
    """This environment without the variables of a run or an MPI job this process may be
    part of, with the repository first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("POPDIST_", "OMPI_", "PMIX_", "PRTE_", "TF_IPU_RUN_"))
           and k != "TF_IPU_SERVER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(TF_CPP_MIN_LOG_LEVEL="2", GRPC_VERBOSITY="NONE", PYTHONUNBUFFERED="1")
    return env


def _side(name: str, command: list[str], out: Path, instances: int) -> dict[str, Any]:
    """Runs ``command`` (which writes ``instance-k.json`` and ``weights-k.npz`` into ``out``
    for k < ``instances``); returns what they wrote, the total wall time and the load."""
    out.mkdir()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=out, env=_env(), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{name} did not end within {RUN_TIMEOUT} s") from e
    total = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed (exit status {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")
    ranks = []
    for k in range(instances):
        with open(out / f"instance-{k}.json") as f:
            ranks.append(json.load(f))
    return {"side": name, "instances": instances, "total_seconds": total,
            "load_before": [round(v, 2) for v in load_before],
            "load_after": [round(v, 2) for v in os.getloadavg()], "ranks": ranks}


def _weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def main(quick: bool = False) -> list[dict[str, Any]]:
    epochs = 2 if quick else 6
    folder = Path(tempfile.mkdtemp(prefix="tf_ipu_bench_distributed_"))
    try:
        program = folder / "program.py"
        program.write_text(PROGRAM)
        py = sys.executable
        print(f"Keras CNN (Conv2D 32, Conv2D 32 /2, Dense 128, Dense 10; 32x32x3), SGD, micro-batch "
              f"{BATCH} per replica, global batch {BATCH * REPLICAS}, {STEPS_PER_EXECUTION} steps "
              f"per device call; timed: fit of {epochs} epochs x {STEPS_PER_EPOCH} steps per "
              f"replica after an untimed first epoch; {os.cpu_count()} cores")
        one = _side("1 instance x 2 replicas", [py, str(program), str(folder / "one"), str(epochs)],
                    folder / "one", 1)
        two = _side("2 instances x 1 replica (tf-ipu-run)",
                    [py, "-m", "tf_ipu.distributed.launcher", "--num-instances", "2",
                     "--num-replicas", str(REPLICAS), "--", py, str(program),
                     str(folder / "two"), str(epochs)], folder / "two", 2)
        reference = _weights(folder / "one" / "weights-0.npz")
        identical = all(
            len(got) == len(reference)
            and all(g.dtype == r.dtype and np.array_equal(g, r) for g, r in zip(got, reference, strict=True))
            for got in (_weights(folder / "two" / f"weights-{k}.npz") for k in range(2)))
        rows = []
        for side in (one, two):
            # The instances run in step: the slowest one's time is the run's.
            timed = max(r["timed_seconds"] for r in side["ranks"])
            steps = side["ranks"][0]["timed_steps"]
            first = max(r["first_epoch_seconds"] for r in side["ranks"])
            mpi_bytes = sum(r["counters"]["world.all_reduce_bytes_sent"] for r in side["ranks"])
            row = {"side": side["side"], "instances": side["instances"],
                   "replicas_per_instance": side["ranks"][0]["local_replicas"],
                   "global_batch": BATCH * REPLICAS, "timed_steps": steps,
                   "timed_seconds": timed, "seconds_per_step": timed / steps,
                   "first_epoch_seconds": first, "total_seconds": side["total_seconds"],
                   "device_calls": side["ranks"][0]["calls"],
                   "device_seconds_per_call": max(r["device_seconds"] / r["calls"]
                                                  for r in side["ranks"]),
                   "client_seconds_per_call": max(r["client_seconds"] / r["calls"]
                                                  for r in side["ranks"]),
                   "updates": side["ranks"][0]["updates"], "mpi_bytes_sent": mpi_bytes,
                   "counters": [r["counters"] for r in side["ranks"]],
                   "load_before": side["load_before"], "load_after": side["load_after"]}
            rows.append(row)
            print(f"  {side['side']:38s} {row['seconds_per_step'] * 1e3:7.1f} ms a step "
                  f"({steps} steps in {timed:.2f} s; a call of {STEPS_PER_EXECUTION}: "
                  f"{row['client_seconds_per_call'] * 1e3:.0f} ms, server "
                  f"{row['device_seconds_per_call'] * 1e3:.0f} ms); first epoch {first:.1f} s; total "
                  f"{side['total_seconds']:.1f} s; MPI bytes sent {mpi_bytes:,}; load "
                  f"{side['load_before'][0]:.2f} -> {side['load_after'][0]:.2f}")
        ratio = rows[1]["seconds_per_step"] / rows[0]["seconds_per_step"]
        total_ratio = rows[1]["total_seconds"] / rows[0]["total_seconds"]
        print(f"  2 instances / 1 instance: {ratio:.2f}x a step, {total_ratio:.2f}x in total "
              f"(start-up included); final weights bit-identical: {identical}")
        rows.append({"ratio_per_step": ratio, "ratio_total": total_ratio,
                     "weights_identical": identical, "cpus": os.cpu_count()})
        if not identical:
            raise AssertionError("the 2-instance run's final weights differ from the "
                                 "1-instance run's (they must be bit-identical)")
        if rows[1]["updates"] != rows[0]["updates"]:
            raise AssertionError(f"the runs made different numbers of weight updates: "
                                 f"{rows[0]['updates']} and {rows[1]['updates']}")
        return rows
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main("--quick" in sys.argv)
