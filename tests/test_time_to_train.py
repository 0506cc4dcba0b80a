"""Gradient accumulation and time to train in ``tf_ipu.estimate`` (tf_ipu/estimate.py).

The step is planned as without accumulation, one micro-batch; with N micro-batches per weight
update, the step's all-reduce and the optimizer's update (sized as a program of its own) are
charged once per N micro-batches, and each micro-batch adds its gradients into accumulators.
Every figure is checked here against its formula from the per-step Estimate's own fields
(docs/tile_model.md, "Gradient accumulation and time to train"). Tiny Keras models: each
estimate lowers and plans in well under a second, and nothing needs a device server.
"""

from __future__ import annotations

import io
import json
import math
import xml.etree.ElementTree as ET
from contextlib import redirect_stdout

import pytest

from device_server.emulator.tiles import Estimate

BATCH, N, REPLICAS = 8, 8, 4
DATASET = 60_000


@pytest.fixture(scope="module")
def tiny():
    import keras

    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)], name="tiny")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    return model


@pytest.fixture(scope="module")
def plain(tiny):
    """The step without accumulation: 4 replicas on a Bow-2000."""
    import tf_ipu

    return tf_ipu.estimate(tiny, BATCH, training=True, ipu_version="bow", replicas=REPLICAS,
                           system="bow2000")


@pytest.fixture(scope="module")
def accumulated(tiny):
    import tf_ipu

    return tf_ipu.estimate(tiny, BATCH, training=True, ipu_version="bow", replicas=REPLICAS,
                           system="bow2000", gradient_accumulation_steps_per_replica=N,
                           dataset_size=DATASET, epochs=3)


def _per_update(step: Estimate, n: int, update: int, accumulate: int) -> float:
    """Cycles per weight update from the step's fields: n micro-batches without the update
    (+ the accumulation of their gradients), then the all-reduce and the update once."""
    if n == 1:
        return float(step.cycles)
    micro = step.cycles - step.all_reduce_cycles - update + accumulate
    return n * micro + step.all_reduce_cycles + update


def test_accumulation_charges_the_all_reduce_and_the_update_once_per_n_micro_batches(
        tiny, plain, accumulated):
    from tf_ipu.estimate import TrainingEstimate, _gradient_bytes

    t, step = accumulated, accumulated.step
    assert type(plain) is Estimate and isinstance(t, TrainingEstimate)
    # The step is planned as without accumulation.
    assert (step.cycles, step.device_cycles, step.all_reduce_cycles, step.host_cycles) == \
        (plain.cycles, plain.device_cycles, plain.all_reduce_cycles, plain.host_cycles)
    assert step.all_reduce_cycles > 0 and step.all_reduces == 1
    # The optimizer's update and the accumulation, each sized as a program of its own.
    assert 0 < t.update_cycles <= step.device_cycles and t.accumulate_cycles > 0 and not t.notes
    assert t.accumulator_bytes == _gradient_bytes(tiny) == (32 * 64 + 64 + 64 * 10 + 10) * 4
    # Per micro-batch: the all-reduce over N, the rest from the step's own fields.
    assert t.all_reduce_cycles == pytest.approx(step.all_reduce_cycles / N, rel=1e-6)
    per_update = _per_update(step, N, t.update_cycles, t.accumulate_cycles)
    assert t.cycles_per_update == pytest.approx(per_update, rel=1e-6)
    assert t.cycles == pytest.approx(per_update / N, rel=1e-6)
    assert t.micro_batch_cycles == pytest.approx(
        step.device_cycles + step.host_cycles + step.replica_sync_cycles - t.update_cycles
        + t.accumulate_cycles, rel=1e-6)
    assert t.seconds == t.latency_s == pytest.approx(t.cycles / step.clock_hz, rel=1e-9)
    assert t.seconds_per_update == pytest.approx(per_update / step.clock_hz, rel=1e-9)
    assert t.all_reduce_share == pytest.approx(step.all_reduce_cycles / per_update, rel=1e-6)
    assert t.all_reduce_share == pytest.approx(t.all_reduce_cycles / t.cycles, rel=1e-6)
    assert t.all_reduce_share < plain.all_reduce_share
    assert t.effective_batch == BATCH * N * REPLICAS
    assert t.throughput == pytest.approx(REPLICAS * BATCH / t.seconds, rel=1e-9)
    assert t.throughput >= plain.throughput
    # Anything else is the step's.
    assert (t.host_cycles, t.replicas, t.items_per_call, t.top_ops) == \
        (step.host_cycles, REPLICAS, BATCH, step.top_ops)
    # The accumulators live on the tiles as the trainable variables do.
    assert step.peak_tile_bytes < t.peak_tile_bytes <= step.peak_tile_bytes + t.accumulator_bytes
    assert t.fits
    for needle in ("accumulation 8 x 4 replicas = effective batch 256", "4 Bow IPUs of bow2000",
                   "float32, SGD", "ms per weight update", "with the accumulators"):
        assert needle in t.summary(), needle


def test_throughput_grows_with_the_accumulation_and_one_step_per_update_is_the_step(plain, accumulated):
    one = accumulated.with_accumulation(1)
    assert one.cycles == plain.cycles and one.throughput == pytest.approx(plain.throughput, rel=1e-12)
    assert one.all_reduce_share == pytest.approx(plain.all_reduce_share, rel=1e-12)
    assert one.peak_tile_bytes == plain.peak_tile_bytes and one.effective_batch == BATCH * REPLICAS
    rates = [accumulated.with_accumulation(n).throughput for n in (2, 4, 8, 16, 64)]
    assert all(r >= plain.throughput for r in rates)
    assert rates == sorted(rates)
    for n in (2, 16, 64):
        t = accumulated.with_accumulation(n)
        assert t.cycles == pytest.approx(
            _per_update(t.step, n, t.update_cycles, t.accumulate_cycles) / n, rel=1e-6)


def test_time_to_train_is_the_weight_updates_times_the_time_of_one(accumulated, tiny):
    import tf_ipu

    t = accumulated
    updates = math.ceil(3 * DATASET / (BATCH * N * REPLICAS))
    assert t.updates() == updates == 704
    assert t.time_to_train_s == pytest.approx(updates * t.seconds_per_update, rel=1e-9)
    assert t.time_to_train(steps=100) == pytest.approx(100 * t.seconds_per_update, rel=1e-9)
    assert t.time_to_train(dataset_size=1000, epochs=0.5) == pytest.approx(
        math.ceil(500 / 256) * t.seconds_per_update, rel=1e-9)
    line = t.time_to_train_summary()
    for needle in ("time to train tiny: 3 epochs of 60,000 items = 704 weight updates",
                   "on 4 Bow IPUs of bow2000, batch 8 x accumulation 8 x 4 replicas = effective "
                   "batch 256, float32, SGD"):
        assert needle in line, (needle, line)
    # A length in weight updates; one epoch when only the dataset is given; no accumulation.
    by_steps = tf_ipu.estimate(tiny, BATCH, training=True, ipu_version="bow", replicas=REPLICAS,
                               system="bow2000", gradient_accumulation_steps_per_replica=N, steps=50)
    assert by_steps.time_to_train_s == pytest.approx(50 * by_steps.seconds_per_update, rel=1e-9)
    assert "50 weight updates" in by_steps.time_to_train_summary()
    once = tf_ipu.estimate(tiny, BATCH, training=True, ipu_version="bow", dataset_size=DATASET)
    assert once.epochs == 1 and once.cycles == once.step.cycles
    assert once.time_to_train_s == pytest.approx(
        math.ceil(DATASET / BATCH) * once.step.seconds, rel=1e-9)
    # The report: the step's page, with the training figures beside it.
    d = json.loads(t.to_json())
    assert d["cycles"] == t.step.cycles and d["training"]["effective_batch"] == 256
    assert d["training"]["time_to_train_s"] == pytest.approx(t.time_to_train_s, rel=1e-12)
    assert t.summary() in d["notes"] and "\n" not in repr(t)
    ET.fromstring(t._repr_html_().split("\n", 1)[1])


@pytest.mark.parametrize("kwargs, match", [
    ({"gradient_accumulation_steps_per_replica": 0}, r"gradient_accumulation_steps_per_replica=0"),
    ({"gradient_accumulation_steps_per_replica": -3}, r"gradient_accumulation_steps_per_replica=-3"),
    ({"gradient_accumulation_steps_per_replica": 2.0}, r"gradient_accumulation_steps_per_replica=2\.0"),
    ({"dataset_size": -5, "epochs": 1}, r"dataset_size=-5"),
    ({"dataset_size": 0}, r"dataset_size=0"),
    ({"dataset_size": 100, "epochs": 2, "steps": 10}, r"not both\. Received: epochs=2, steps=10"),
    ({"epochs": 2}, r"epochs needs dataset_size.*epochs=2"),
    ({"dataset_size": 100, "epochs": -1}, r"epochs=-1"),
    ({"steps": 0}, r"steps=0"),
    ({"training": False, "gradient_accumulation_steps_per_replica": 4}, r"training=False"),
])
def test_bad_arguments_are_refused_naming_the_value(tiny, kwargs, match):
    import tf_ipu

    kwargs = {"training": True, **kwargs}
    with pytest.raises(ValueError, match=match):
        tf_ipu.estimate(tiny, BATCH, ipu_version="bow", **kwargs)


def test_bad_arguments_of_the_result_methods(accumulated):
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps_per_replica=0"):
        accumulated.with_accumulation(0)
    with pytest.raises(ValueError, match=r"dataset_size=-1"):
        accumulated.time_to_train(dataset_size=-1, epochs=1)
    with pytest.raises(ValueError, match=r"epochs=1, steps=3"):
        accumulated.time_to_train(dataset_size=10, epochs=1, steps=3)


def test_mixed_precision_sweep_and_the_model_s_own_accumulation_options():
    import keras

    import tf_ipu

    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)], name="mixed")
        model.compile(loss="mse", optimizer="adam")  # a LossScaleOptimizer around Adam
    finally:
        keras.mixed_precision.set_global_policy(policy)
    sweep = tf_ipu.estimate_sweep(model, [4, 16], training=True, ipu_version="bow", replicas=2,
                                  system="bow2000", gradient_accumulation_steps_per_replica=4)
    for t, b in zip(sweep.estimates, (4, 16), strict=True):
        assert t.items_per_call == b and t.update_cycles > 0 and not t.notes
        assert (t.precision, t.optimizer) == ("mixed_float16", "Adam")
        assert t.step.sweep == sweep.points
    assert [p["effective_batch"] for p in sweep.points] == [4 * 4 * 2, 16 * 4 * 2]
    assert sweep.points[1]["throughput"] == sweep.estimates[1].throughput
    from tf_ipu import accumulation

    accumulation.set_gradient_accumulation_options(model, gradient_accumulation_steps_per_replica=4)
    est = tf_ipu.estimate(model, 4, training=True, ipu_version="bow")
    assert type(est) is Estimate
    assert any("set_gradient_accumulation_options(4) is not applied" in n for n in est.notes)


def test_the_command_line():
    from tf_ipu.estimate import main

    out = io.StringIO()
    with redirect_stdout(out):
        main(["--model", "mlp", "--training", "--batch-size", "4", "--ipu-version", "bow",
              "--replicas", "4", "--system", "bow2000", "--gradient-accumulation", "16",
              "--dataset-size", "60000", "--epochs", "2"])
    text = out.getvalue()
    assert "accumulation 16 x 4 replicas = effective batch 256" in text
    assert "time to train mlp: 2 epochs of 60,000 items = 469 weight updates" in text
    assert "once per 16 micro-batches" in text
    with pytest.raises(SystemExit), redirect_stdout(io.StringIO()):
        main(["--model", "mlp", "--training", "--gradient-accumulation", "0"])
