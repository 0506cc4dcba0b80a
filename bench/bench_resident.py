"""Device-resident weights: Keras training under IPUStrategy over plain TF on CPU, per step.

    (a) mlp4096_sgd:  4 Dense layers of 4096 (67M parameters, 269 MB FP32), SGD, batch 8,
                      steps_per_execution=1        targets: <= 1.5x CPU, client <= 1.15x server
    (b) mlp2048_adam: 4 Dense layers of 2048 (16.8M parameters), Adam, batch 8,
                      steps_per_execution=8        target:  <= 1.5x CPU
    (c) the small MLP of bench_keras_step (32-64-64-10, Adam, batch 32) at
        steps_per_execution=32                     target:  <= 1.2x CPU
        ... and the same with the device pulling each batch from an infeed during the call
        (``set_infeed_queue_options(device_pull=True)``)

Both sides train the same model from the same weights, warm (the first epoch, which traces,
lowers and compiles, is not timed), epochs interleaved so that drift hits both; the best
epoch of each side is kept. The per-step time is the steady state, from an epoch's first
``on_train_batch_end`` to its last, on both sides; the whole epoch's time per step is printed
beside it, with the bytes fetched at each epoch end (the host refreshes every variable there:
over gRPC today, at the bulk path's speed once "Data at memory speed" lands). Also printed
for the IPU side, over the timed epochs:

- ``client/server``: the wall time of the device calls as the host's runtime sees them
  (from entry into ``DeviceRuntime.execute`` to its return) over the time the server spent
  running them (``ExecuteReply.device_seconds``): the host's and the wire's overhead;
- ``wire/step``: bytes the server received and sent (its ``bytes_in``/``bytes_out``
  counters) per step, less the epoch-end fetches, beside the step's own inputs and outputs
  (target: inputs + outputs + 64 KiB).

    .venv/bin/python bench/run.py --only resident [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def _mlp(width: int, layers: int = 4) -> Any:
    import keras

    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
        + [keras.layers.Dense(width)]
    )


def _small_mlp() -> Any:
    import keras

    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def _case(name: str, build: Any, optimizer: Any, width: int, n_out: int, batch: int, spe: int,
          steps: int, rounds: int, strategy: Any, device_pull: bool = False) -> dict[str, Any]:
    import keras

    import tf_ipu

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * steps, width)).astype("float32")
    y = rng.integers(0, n_out, batch * steps)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=n_out > 10)
    keras.utils.set_random_seed(0)
    cpu = build()
    cpu.compile(optimizer=optimizer(), loss=loss, steps_per_execution=spe)
    with strategy.scope():
        ipu = build()
        ipu.compile(optimizer=optimizer(), loss=loss, steps_per_execution=spe)
    ipu.set_weights(cpu.get_weights())
    ipu.set_infeed_queue_options(device_pull=device_pull)

    class Steady(keras.callbacks.Callback):
        """Times the device calls' steady state: from the first on_train_batch_end of an
        epoch to its last (what an epoch's start and end add is reported apart)."""

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, b: int, logs: Any = None) -> None:
            self.ends.append(time.perf_counter())

    def epoch(model: Any) -> tuple[float, float]:
        """(epoch wall, steady-state seconds per step)."""
        cb = Steady()
        t0 = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
        wall = time.perf_counter() - t0
        per_call = (cb.ends[-1] - cb.ends[0]) / (len(cb.ends) - 1)
        return wall, per_call / spe

    epoch(cpu)  # warm-up: traces, lowers and compiles
    epoch(ipu)
    rt = tf_ipu.get_runtime()
    client = rt.client
    before = client.counters()
    host0 = rt.counters()
    stats0 = rt.call_stats()
    t_cpu: list[tuple[float, float]] = []
    t_ipu: list[tuple[float, float]] = []
    for _ in range(rounds):
        t_cpu.append(epoch(cpu))
        t_ipu.append(epoch(ipu))
    stats1 = rt.call_stats()
    host1 = rt.counters()
    after = client.counters()
    synced = (host1["variable_bytes_refreshed"] - host0["variable_bytes_refreshed"]) / rounds
    wire = (after["bytes_in"] - before["bytes_in"]) + (after["bytes_out"] - before["bytes_out"])
    # The counters call itself travels too; it is small (a few KB).
    calls = stats1["calls"] - stats0["calls"]
    client_s = stats1["client_seconds"] - stats0["client_seconds"]
    server_s = stats1["device_seconds"] - stats0["device_seconds"]
    c = min(t for _, t in t_cpu)
    i = min(t for _, t in t_ipu)
    c_epoch = min(w for w, _ in t_cpu) / steps
    i_epoch = min(w for w, _ in t_ipu) / steps
    # What crossed per step between epoch ends (the epoch-end sync reported apart).
    # (Through shared memory, the epoch-end fetch does not cross the wire at all.)
    wire_step = (wire - (synced * rounds if client.data.kind == "stream" else 0)) / (rounds * steps)
    io_bytes = (x[:batch].nbytes + y[:batch].astype("int64").nbytes) + 4  # batch + a scalar loss
    n_params = sum(int(np.prod(w.shape)) for w in cpu.weights)
    row = {
        "case": name,
        "device_pull": device_pull,
        "parameters": n_params,
        "batch": batch,
        "steps_per_execution": spe,
        "cpu_ms_per_step": round(c * 1e3, 3),
        "ipu_ms_per_step": round(i * 1e3, 3),
        "ratio": round(i / c, 3),
        "cpu_epoch_ms_per_step": round(c_epoch * 1e3, 3),
        "ipu_epoch_ms_per_step": round(i_epoch * 1e3, 3),
        "epoch_ratio": round(i_epoch / c_epoch, 3),
        "epoch_end_sync_bytes": round(synced),
        "device_calls": calls,
        "client_over_server": round(client_s / server_s, 3) if server_s > 0 else None,
        "wire_bytes_per_step": round(wire_step),
        "step_io_bytes": io_bytes,
    }
    print(
        f"{name}: {n_params / 1e6:.1f}M parameters, batch {batch}, steps_per_execution={spe}, "
        f"{steps} steps an epoch: per step between epoch ends CPU {c * 1e3:.2f} ms, "
        f"IPUStrategy {i * 1e3:.2f} ms, ratio {i / c:.2f}x; client/server "
        f"{row['client_over_server']}x over {calls} device calls; wire/step "
        f"{row['wire_bytes_per_step']:,} B (step inputs+outputs ~{io_bytes:,} B); whole epochs "
        f"{c_epoch * 1e3:.2f} vs {i_epoch * 1e3:.2f} ms/step ({i_epoch / c_epoch:.2f}x), with "
        f"{synced / 1e6:.1f} MB fetched at each epoch end",
        flush=True,
    )
    return row


def main(quick: bool = False) -> list[dict[str, Any]]:
    import keras

    import tf_ipu

    cfg = tf_ipu.IPUConfig()
    cfg.configure_ipu_system()
    strategy = tf_ipu.IPUStrategy()
    rounds = 2 if quick else 3
    rows = [
        _case("mlp4096_sgd", lambda: _mlp(4096), lambda: keras.optimizers.SGD(0.01),
              4096, 4096, 8, 1, 6 if quick else 12, rounds, strategy),
        _case("mlp2048_adam", lambda: _mlp(2048), lambda: keras.optimizers.Adam(1e-3),
              2048, 2048, 8, 8, 16 if quick else 32, rounds, strategy),
        _case("small_mlp_adam", _small_mlp, lambda: keras.optimizers.Adam(1e-3),
              32, 10, 32, 32, 128 if quick else 256, rounds, strategy),
        _case("small_mlp_adam_device_pull", _small_mlp, lambda: keras.optimizers.Adam(1e-3),
              32, 10, 32, 32, 128 if quick else 256, rounds, strategy, device_pull=True),
    ]
    return rows


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
