"""Load on one device server: 8 clients at once, each training its own small model.

    8 threads, one DeviceClient (session, 1 IPU) each ==gRPC, loopback==> device server
      each: 200 steps of ``tests/server_util.sgd_module`` (least squares by SGD, batch 64,
      64 features; the weights stay resident on the device, a new batch goes with every call)

Every client first runs alone (solo), then all eight together; the concurrent runs must end
with results identical to the solo ones (every step's loss and the final weights, bit for
bit). Prints the throughput (steps per second, all clients) and the p50/p99 latency of an
Execute call, as the clients see it and as the server measures it (``GetCounters``).

    .venv/bin/python bench/bench_server.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import numpy as np  # noqa: E402
import server_util  # noqa: E402

from tf_ipu.client import DeviceClient, VariableRef  # noqa: E402

CLIENTS = 8
BATCH, DIM = 64, 64


class Trainer:
    """One client: its data, its session, its losses and per-call latencies."""

    def __init__(self, address: str, index: int, steps: int) -> None:
        rng = np.random.default_rng(index)
        self.x = rng.standard_normal((steps, BATCH, DIM)).astype(np.float32)
        true_w = rng.standard_normal((DIM, 1)).astype(np.float32)
        self.y = (self.x @ true_w + 0.01 * rng.standard_normal((steps, BATCH, 1))).astype(np.float32)
        self.client = DeviceClient(address, client_name=f"bench client {index}")
        self.client.open_session()
        self.client.attach(1)
        self.exe = self.client.compile(server_util.sgd_module(BATCH, DIM, lr=0.01)).executable_id
        self.losses: list[float] = []
        self.latencies: list[float] = []
        self.final_w: np.ndarray | None = None

    def run(self) -> None:
        self.client.write_variables({"w": np.zeros((DIM, 1), np.float32)})
        self.losses.clear()
        for k in range(len(self.x)):
            start = time.perf_counter()
            loss, _ = self.client.execute(self.exe, [self.x[k], self.y[k], VariableRef("w")])
            self.latencies.append(time.perf_counter() - start)
            self.losses.append(float(loss[0, 0]))
        self.final_w = np.array(self.client.read_variables(["w"])["w"])


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1e3


def main(quick: bool = False) -> None:
    steps = 50 if quick else 200
    server = server_util.ServerProcess.start(["--ipus", str(CLIENTS), "--log-level", "warning"])
    try:
        trainers = [Trainer(server.address, i, steps) for i in range(CLIENTS)]
        start = time.perf_counter()
        solo = []
        for t in trainers:
            t.run()
            solo.append((list(t.losses), t.final_w))
        solo_seconds = time.perf_counter() - start
        solo_latencies = [s for t in trainers for s in t.latencies]
        for t in trainers:
            t.latencies.clear()

        errors: list[BaseException] = []

        def run(t: Trainer) -> None:
            try:
                t.run()
            except BaseException as e:  # reported after the join
                errors.append(e)

        threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
        start = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - start
        if errors:
            raise errors[0]
        latencies = [s for t in trainers for s in t.latencies]
        identical = all(
            t.losses == losses and np.array_equal(t.final_w, w)
            for t, (losses, w) in zip(trainers, solo, strict=True)
        )
        counters = trainers[0].client.counters()
        for t in trainers:
            t.client.close()
    finally:
        server.stop()
    total = CLIENTS * steps
    print(f"{CLIENTS} clients x {steps} steps (sgd batch {BATCH}, {DIM} features, weights resident)")
    print(f"  one at a time: {total / solo_seconds:7.0f} steps/s; Execute p50 "
          f"{_pct(solo_latencies, 50):.2f} ms, p99 {_pct(solo_latencies, 99):.2f} ms")
    print(f"  all at once:   {total / seconds:7.0f} steps/s; Execute p50 "
          f"{_pct(latencies, 50):.2f} ms, p99 {_pct(latencies, 99):.2f} ms (client side); "
          f"in the server (both runs) p50 {counters['execute_latency_p50_us'] / 1e3:.2f} ms, "
          f"p99 {counters['execute_latency_p99_us'] / 1e3:.2f} ms")
    print(f"  results identical to the solo runs: {'yes' if identical else 'NO'}")
    if not identical:
        raise SystemExit("bench_server: concurrent results differ from the solo runs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="50 steps per client, not 200")
    main(quick=parser.parse_args().quick)
