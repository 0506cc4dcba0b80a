"""Graphcore's popdist TF2 training tutorial's calls under tf-ipu-run (issue 27, point 2).

    tf-ipu-run --num-instances 2 --num-replicas 4 -- python tests/data/popdist_tutorial_training.py OUT
        instance k: set_ipu_config, PopDistStrategy, dataset.shard(2, k), fit one epoch,
                    instance 0 saves saved_model.h5;  writes OUT/instance<k>.json

The script (tests/data/popdist_tutorial_training.py) makes the calls of graphcore/tutorials
at commit 7536e40, feature_examples/tensorflow2/popdist/popdist_training.py, on generated
arrays (sample i carries i in its first pixel) with a small model. One launch (a module
fixture); the tests read what each instance wrote.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "popdist_tutorial_training.py"
SAMPLES, BATCH, INSTANCES, REPLICAS = 64, 4, 2, 4
LOCAL_REPLICAS = REPLICAS // INSTANCES


def _still_running(processes: list[list]) -> list[str]:
    """Those of [pid, command line] still running (the same pid with the same command)."""
    alive = []
    for pid, cmd in processes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                now = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        if now == cmd:
            alive.append(f"{pid}: {cmd.replace(chr(0), ' ')}")
    return alive


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("popdist_tutorial")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("POPDIST_", "OMPI_", "PMIX_")) and k != "TF_IPU_SERVER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TUTORIAL_SAMPLES"] = str(SAMPLES)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tf_ipu.distributed.launcher",
         "--num-instances", str(INSTANCES), "--num-replicas", str(REPLICAS), "--",
         sys.executable, str(SCRIPT), str(folder)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    outs = [json.loads((folder / f"instance{k}.json").read_text()) for k in range(INSTANCES)]
    left = [p for out in outs for p in _still_running(out["processes"])]
    return {"folder": folder, "result": result, "outs": outs, "elapsed": elapsed, "left": left}


def test_the_tutorial_runs_and_leaves_nothing(run):
    outs, result = run["outs"], run["result"]
    assert [out["instance"] for out in outs] == list(range(INSTANCES))
    for out in outs:
        assert out["joined"] is True  # set_ipu_config(config) made it one run
        assert out["instances"] == INSTANCES and out["local_replicas"] == LOCAL_REPLICAS
        shard_batches = SAMPLES // INSTANCES // BATCH
        assert out["shard_batches"] == shard_batches
        assert out["steps_per_execution"] == shard_batches // LOCAL_REPLICAS
    # The tutorial prints its numbers on instance 0 only.
    assert result.stdout.count(f"{SAMPLES} samples, {INSTANCES} instances") == 1, result.stdout
    # Each program ran as its MPI rank, with its watchdog and its device server (a rank
    # of the servers' job): all are gone.
    for out in outs:
        assert len(out["processes"]) >= 3, out["processes"]  # program, watchdog, server
        assert any("device_server" in p[1] for p in out["processes"]), out["processes"]
    assert not run["left"], run["left"]
    for out in outs:  # and the launcher removed its run folder
        program = out["processes"][0][1].split("\0")
        if "--run-dir" in program:
            assert not os.path.exists(program[program.index("--run-dir") + 1])
    print(f"tutorial run: {run['elapsed']:.1f} s")


def test_each_instance_trained_on_its_own_shard(run):
    shards = []
    for k, out in enumerate(run["outs"]):
        batches = out["seen"]
        # The epoch drew every batch of the shard (Keras also peeks at one to build the
        # model, and the shuffle draws a new order each time the dataset is iterated).
        assert len(batches) >= out["shard_batches"], batches
        assert all(len(b) == BATCH for b in batches)
        seen = {i for b in batches for i in b}
        assert seen == set(range(k, SAMPLES, INSTANCES)), sorted(seen)  # dataset.shard(2, k)
        shards.append(seen)
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(SAMPLES))
    # Each instance's count, summed over MPI (host_collective_ops.all_reduce): all of them.
    assert [out["drawn_by_all"] for out in run["outs"]] == [SAMPLES] * INSTANCES
    # Shuffled: the first batch is not the shard's first samples in order.
    assert any(out["seen"][0] != list(range(k, k + INSTANCES * BATCH, INSTANCES))
               for k, out in enumerate(run["outs"]))


def test_initial_weights_are_instance_0s(run):
    outs = run["outs"]
    n = len(outs[0]["initial"])
    assert n == 10  # 3 Conv2D + 2 Dense, kernel and bias each
    for j in range(n):
        w0, w1 = np.array(outs[0]["initial"][j]), np.array(outs[1]["initial"][j])
        np.testing.assert_array_equal(w0, w1)
        # ...and they are what instance 0 draws on its own (same seed, same model).
        np.testing.assert_array_equal(w0, np.array(outs[0]["own_initial"][j]))
    # Seeded apart, instance 1 alone would have started elsewhere (kernels; biases are 0).
    kernels = [j for j, name in enumerate(outs[0]["weight_names"]) if name.endswith("kernel")]
    assert len(kernels) == 5
    for j in kernels:
        assert not np.allclose(outs[0]["own_initial"][j], outs[1]["own_initial"][j])
    # Training moved them.
    for j in kernels:
        assert not np.allclose(outs[0]["initial"][j], outs[0]["final"][j])


def test_replicas_of_different_instances_draw_apart(run):
    # Dropout's seed state is broadcast like any variable and stays instance 0's: the
    # device program is one program of the run's replicas, whose replica id is global, so
    # replica j of instance k draws as replica 2k + j of one program (the masks themselves:
    # tests/test_distributed_replicated.py, bit-identical weights to one instance).
    states = [np.array(out["seed_states"], np.int64) for out in run["outs"]]
    assert states[0].shape == (3, 2)  # the three Dropout layers
    assert len(set(states[0][:, 0].tolist())) == 3  # each layer its own seed
    np.testing.assert_array_equal(states[1], states[0])


def test_logs_are_reduced_over_the_instances(run):
    histories = [out["history"] for out in run["outs"]]
    assert set(histories[0]) == {"loss", "accuracy"}
    assert histories[0] == histories[1]  # host-side means: the same on every instance
    (loss,), (accuracy,) = histories[0]["loss"], histories[0]["accuracy"]
    assert math.isfinite(loss) and 0.5 < loss < 10
    # Each instance counted 4 steps x 2 replicas x 4 samples = 32: accuracies in 32nds.
    assert 0 <= accuracy <= 1 and abs(accuracy * 32 - round(accuracy * 32)) < 1e-4


def test_only_instance_0_saved(run):
    folder, outs = run["folder"], run["outs"]
    assert [out["saved"] for out in outs] == [True] + [False] * (INSTANCES - 1)
    saved = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.h5"))
    assert saved == ["saved_model.h5"]
    with h5py.File(folder / "saved_model.h5", "r") as f:
        stored: dict[str, np.ndarray] = {}
        f["model_weights"].visititems(
            lambda name, item: stored.__setitem__("/".join(name.split("/")[-2:]), item[()])
            if isinstance(item, h5py.Dataset) else None)
    names = ["/".join(n.split("/")[-2:]) for n in outs[0]["weight_names"]]
    assert sorted(stored) == sorted(names)
    for name, w in zip(names, outs[0]["final"], strict=True):  # instance 0's trained weights
        np.testing.assert_array_equal(stored[name], np.array(w, np.float32))


def test_the_loss_is_scaled_by_the_runs_replicas(run):
    # Graphcore's PopDistStrategy reports every replica of the run, so Keras scales each
    # replica's loss by 1/4 and the summed gradients are a mean (the tutorial's learning
    # rate assumes so). The sum spans all 4 replicas of the run: the instances' replicas
    # are one replicated program (device_server/emulator/world.py).
    grads = []
    for out in run["outs"]:  # instance k's replica r is replica 2k + r of the run
        assert out["num_replicas_in_sync"] == REPLICAS
        x, y = np.array(out["step_x"]), np.array(out["step_y"])
        # From w = 0, an MSE batch's gradient is -2/4 x^T y; replica r had batch r.
        grads += [-2.0 / 4 * x[4 * r:4 * r + 4].T @ y[4 * r:4 * r + 4]
                  for r in range(LOCAL_REPLICAS)]
    expected = -0.1 * sum(grads) / REPLICAS
    for out in run["outs"]:
        np.testing.assert_allclose(out["linear_kernel"], expected, rtol=1e-5)
        assert not np.allclose(out["linear_kernel"], -0.1 * sum(grads))  # not unscaled
    # ...and not the sum of instance 0's replicas alone.
    assert not np.allclose(run["outs"][0]["linear_kernel"],
                           -0.1 * sum(grads[:LOCAL_REPLICAS]) / REPLICAS)
