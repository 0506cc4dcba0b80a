"""The data path: bulk bandwidth and the latency of one small device call, on loopback.

    bandwidth  a TF tensor into IpuExecute -> the emulator's array (h2d), and back (d2h):
               256 MiB through shared memory and through gRPC messages, beside a plain
               memcpy of the same size; and 768 MiB of variables through chunked streams
               (past the message budget), with the peak RSS each side gained
                                                             target: shm >= 1 GB/s
    latency    one device call with a 1 KiB input (``x + 1`` under ``strategy.run``): the
               runtime's callback from entry to return (what the IpuExecute kernel waits
               for), p50 and p99, beside a bare gRPC unary echo of the same 1 KiB to a
               server process on loopback (the floor), and the whole ``tf.function`` call
                                                             target: p50 <= 1.3x the echo

Transfer time is the device call's wall time as the runtime sees it, less the time the
server spent running the program (``device_seconds``): the programs are a 1-element slice
(h2d) and a broadcast (d2h), so that is the crossing. Paths are chosen with
``IPUConfig.data_path`` (each a fresh session on the same local server).

    .venv/bin/python bench/run.py --only transport [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

MIB = 1 << 20

_ECHO_SERVER = r"""
import sys, time
from concurrent import futures
import grpc
server = grpc.server(futures.ThreadPoolExecutor(4))
echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Echo": echo}),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
sys.stdin.read()
"""


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _memcpy_seconds(nbytes: int, reps: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


def _device_seconds(fn: Any, arg: Any, reps: int) -> float:
    """Best (wall - server time) of ``reps`` device calls of ``fn(arg)``."""
    from tf_ipu import runtime

    rt = runtime.get_runtime()
    fn(arg)  # warm: trace, lower, compile, first buffers
    best = float("inf")
    for _ in range(reps):
        before = rt.call_stats()
        fn(arg)
        after = rt.call_stats()
        wall = after["client_seconds"] - before["client_seconds"]
        server = after["device_seconds"] - before["device_seconds"]
        best = min(best, wall - server)
    return best


def _bandwidth(path: str, nbytes: int, reps: int, strategy: Any, cfg: Any) -> dict[str, Any]:
    import tensorflow as tf

    from tf_ipu import runtime

    cfg.data_path = path
    cfg.configure_ipu_system()
    n = nbytes // 4
    x = tf.ones([n], tf.float32)

    @tf.function
    def h2d(v: tf.Tensor) -> tf.Tensor:
        return strategy.run(lambda t: t[:1], args=(v,))

    @tf.function
    def d2h(s: tf.Tensor) -> tf.Tensor:
        return strategy.run(lambda t: tf.broadcast_to(t, [n]), args=(s,))

    up = _device_seconds(h2d, x, reps)
    down = _device_seconds(d2h, tf.constant(2.0), reps)
    described = runtime.get_runtime().client.data.describe()
    return {"path": path, "bytes": nbytes, "h2d_s": up, "d2h_s": down, "described": described}


def _peak_rss(pid: int | str = "self") -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _streamed_variables(address: str, nbytes: int, server_pid: int | None) -> dict[str, float]:
    """Chunked streams through the client API: variables past the message budget. Also the
    peak RSS each side gained during the transfers, over its peak before them (the payload
    already held on the client: the value it sends, then the one it receives), after a
    round trip of one chunk more than the message budget takes (what the first transfer of
    any size costs once, code and buffers used for the first time: ``warm_server_rss``)."""
    from tf_ipu.client import DeviceClient

    c = DeviceClient(address, data_path="stream")
    c.open_session()
    warm = np.ones(c.data.chunk_bytes() + 1, np.uint8)  # one chunk and a byte: two chunks
    server_warm0 = _peak_rss(server_pid) if server_pid else 0
    c.write_variables({"warm-up": warm})
    c.read_variables(["warm-up"])
    warm_server = (_peak_rss(server_pid) - server_warm0) if server_pid else -1
    del warm
    value = np.ones(nbytes, np.uint8)
    client0 = _peak_rss()
    server0 = _peak_rss(server_pid) if server_pid else 0
    start = time.perf_counter()
    c.write_variables({"bulk": value})
    up = time.perf_counter() - start
    client_up = _peak_rss() - client0
    del value
    start = time.perf_counter()
    back = c.read_variables(["bulk"])["bulk"]
    down = time.perf_counter() - start
    assert back.nbytes == nbytes and back[-1] == 1
    server = (_peak_rss(server_pid) - server0) if server_pid else -1
    client_total = _peak_rss() - client0
    chunk = c.data.chunk_bytes()
    c.close()
    return {"h2d_s": up, "d2h_s": down, "client_rss_up": client_up,
            "client_rss_round_trip": client_total, "server_rss": server, "chunk": chunk,
            "warm_server_rss": warm_server}


def _quantiles(samples: list[float]) -> tuple[float, float]:
    a = np.sort(np.asarray(samples))
    return float(np.quantile(a, 0.5)), float(np.quantile(a, 0.99))


def _latency(strategy: Any, cfg: Any, calls: int) -> dict[str, float]:
    import grpc
    import tensorflow as tf

    from tf_ipu import runtime

    cfg.data_path = "auto"
    cfg.configure_ipu_system()
    rt = runtime.get_runtime()
    x = tf.ones([256], tf.float32)  # 1 KiB

    @tf.function
    def step(v: tf.Tensor) -> tf.Tensor:
        return strategy.run(lambda t: t + 1.0, args=(v,))

    echo = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(echo.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary("/bench.Echo/Echo")
        payload = bytes(1024)
        for _ in range(50):  # warm both
            call(payload, timeout=10)
            step(x)
        kernel, whole, bare = [], [], []
        for _ in range(calls):  # interleaved, so that drift hits all three
            start = time.perf_counter()
            call(payload, timeout=10)
            bare.append(time.perf_counter() - start)
            before = rt.call_stats()["client_seconds"]
            start = time.perf_counter()
            step(x)
            whole.append(time.perf_counter() - start)
            kernel.append(rt.call_stats()["client_seconds"] - before)
        channel.close()
    finally:
        echo.stdin.close()
        echo.wait(10)
    k50, k99 = _quantiles(kernel)
    e50, e99 = _quantiles(bare)
    w50, w99 = _quantiles(whole)
    return {"kernel_p50": k50, "kernel_p99": k99, "echo_p50": e50, "echo_p99": e99,
            "run_p50": w50, "run_p99": w99}


def main(quick: bool = False) -> list[dict[str, Any]]:
    import tf_ipu

    nbytes = (64 if quick else 256) * MIB
    reps = 2 if quick else 3
    cfg = tf_ipu.IPUConfig()
    cfg.configure_ipu_system()
    strategy = tf_ipu.IPUStrategy()
    rows: list[dict[str, Any]] = []
    memcpy = _memcpy_seconds(nbytes, reps)
    print(f"bandwidth, {nbytes // MIB} MiB, GB/s (best of {reps}); memcpy {_gbps(nbytes, memcpy):.2f}")
    for path in ("shm", "stream"):
        r = _bandwidth(path, nbytes, reps, strategy, cfg)
        r.update(memcpy_s=memcpy)
        rows.append(r)
        print(f"  {path:<7} h2d {_gbps(nbytes, r['h2d_s']):6.2f}  d2h {_gbps(nbytes, r['d2h_s']):6.2f}"
              f"   ({r['described']})")
    from tf_ipu.local_server import start_local_server

    big = (256 if quick else 768) * MIB
    with start_local_server(num_ipus=1) as fresh:  # its own peak RSS starts low
        s = _streamed_variables(fresh.address, big, fresh.pid)
    rows.append({"path": "chunked", "bytes": big, **s})
    print(f"  chunked h2d {_gbps(big, s['h2d_s']):6.2f}  d2h {_gbps(big, s['d2h_s']):6.2f}"
          f"   (variables of {big // MIB} MiB, PutBlob/GetBlob streams)")
    print(f"  chunked peak RSS over the peak before: server +{s['server_rss'] / MIB:.0f} MiB "
          f"(payload {big // MIB} MiB, chunks of {s['chunk'] // MIB} MiB; after a warm-up "
          f"round trip of two chunks, which cost it +{s['warm_server_rss'] / MIB:.0f} MiB); client +"
          f"{s['client_rss_up'] / MIB:.0f} MiB sending (the payload was held already), +"
          f"{s['client_rss_round_trip'] / MIB:.0f} MiB after receiving it back")
    lat = _latency(strategy, cfg, 200 if quick else 1000)
    rows.append({"path": "latency", **lat})
    print(f"latency, 1 KiB, ms: kernel p50 {lat['kernel_p50'] * 1e3:.3f} p99 "
          f"{lat['kernel_p99'] * 1e3:.3f} | echo p50 {lat['echo_p50'] * 1e3:.3f} p99 "
          f"{lat['echo_p99'] * 1e3:.3f} | strategy.run p50 {lat['run_p50'] * 1e3:.3f} p99 "
          f"{lat['run_p99'] * 1e3:.3f} | kernel/echo p50 "
          f"{lat['kernel_p50'] / lat['echo_p50']:.2f}x (target <= 1.3x)")
    cfg.data_path = "auto"
    return rows


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
