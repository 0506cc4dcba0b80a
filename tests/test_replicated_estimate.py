"""The tile model's estimate of replicated programs (device_server/emulator/tiles/replication.py).

A replicated program is one replica's; R replicas run it at once on a system's IPUs and meet
at ``tf_ipu_all_reduce``. The estimate adds to one replica's compute: the ring all-reduce over
the IPU-Links, a sync across the replicas' IPUs per call (and per device-loop trip), and the
host transfers of every replica over the host links they share. The ring is computed here
again, from the system's links, without the model's code (docs/tile_model.md, "Replicas and
collectives").
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from device_server.emulator import compile_module, get_target
from device_server.emulator.compiler import CompileOptions, executable_from_record
from device_server.emulator.tiles import Estimate, estimate_module
from device_server.emulator.tiles.replication import GCL_STEP_OVERHEAD_S
from device_server.protocol import ALL_REDUCE_TARGET, hardware

# x [M, K] @ w [K, N] -> g [M, N] f32, all-reduced, then summed: a big all-reduce (4 MiB per
# replica), small host transfers (two 32 KiB arguments in, a scalar out).
M, K, N = 1024, 8, 1024


@pytest.fixture(scope="module")
def tf():
    import tensorflow as tf

    return tf


@pytest.fixture(scope="module")
def lowered(tf):
    """The module, lowered once per preset's dtype (f32)."""
    from tensorflow.compiler.tf2xla.python import xla

    from tf_ipu.lowering.program import lower_function

    def step(x, w):
        g = tf.matmul(x, w)
        r, = xla.custom_call_v2(ALL_REDUCE_TARGET, [g], [tf.TensorSpec(g.shape, g.dtype)],
                                backend_config="sum", has_side_effect=True)
        return tf.reduce_sum(r)

    specs = [tf.TensorSpec([M, K], tf.float32), tf.TensorSpec([K, N], tf.float32)]
    return lower_function(step, specs, "replicated_step").module


@pytest.fixture(scope="module")
def looped(tf):
    """A loop of 5 trips at the top of the program, one all-reduce in its body."""
    from tensorflow.compiler.tf2xla.python import xla

    from tf_ipu.lowering.program import lower_function

    def step(x):
        def body(i, acc):
            r, = xla.custom_call_v2(ALL_REDUCE_TARGET, [acc * 2.0], [tf.TensorSpec(acc.shape, acc.dtype)],
                                    backend_config="mean", has_side_effect=True)
            return i + 1, r

        return tf.while_loop(lambda i, _: i < 5, body, [tf.constant(0), x])[1]

    return lower_function(step, [tf.TensorSpec([256, 256], tf.float32)], "looped_step").module


# ------------------------------------------------------------------ the model, independently


def _path_latency(system: hardware.System, path: list[int]) -> float:
    return sum(system.link(a, b).latency_s for a, b in zip(path, path[1:], strict=False))


def _ring_seconds(system: hardware.System, ipus: list[int], nbytes: int, target) -> float:
    """Ring all-reduce, the faster of ascending ids and the ladder's order (even ids up, odd
    ids down): 2(R-1)/R x B / slowest arrow + 2(R-1) x step latency;
    an arrow over several hops runs at its slowest hop's bandwidth divided by the arrows
    crossing that hop the same way; step latency = the slowest path's hop latencies + the
    external sync + GCL's step overhead."""
    r = len(ipus)
    if r < 2:
        return 0.0
    ascending = sorted(ipus)
    ladder = [i for i in ascending if i % 2 == 0] + [i for i in reversed(ascending) if i % 2 == 1]
    return min(_ring_in_order(system, ascending, nbytes, target),
               _ring_in_order(system, ladder, nbytes, target))


def _ring_in_order(system: hardware.System, ring: list[int], nbytes: int, target) -> float:
    r = len(ring)
    ipus = ring
    paths = [system.path(ring[n], ring[(n + 1) % r]) for n in range(r)]
    crossing: dict[tuple[int, int], int] = {}
    for p in paths:
        for hop in zip(p, p[1:], strict=False):
            crossing[hop] = crossing.get(hop, 0) + 1
    bandwidth = min(system.link(a, b).bytes_per_s / crossing[(a, b)]
                    for p in paths for a, b in zip(p, p[1:], strict=False))
    step = max(_path_latency(system, p) for p in paths) + _sync_seconds(system, ipus, target) \
        + GCL_STEP_OVERHEAD_S
    return 2 * (r - 1) / r * nbytes / bandwidth + 2 * (r - 1) * step


def _sync_seconds(system: hardware.System, ipus: list[int], target) -> float:
    """A sync across the IPUs: on-chip sync + a round trip over the longest path."""
    longest = max(_path_latency(system, system.path(a, b)) for a in ipus for b in ipus)
    return target.sync_cycles / target.clock_hz + 2 * longest


def _host_seconds(system: hardware.System, ipus: list[int], bytes_in: int, bytes_out: int,
                  device_s: float = 0.0) -> float:
    """The most loaded host link: n replicas on it move n x the bytes, latency once a way.
    With Streaming Memory (Mk2 machines) the transfers are prefetched through it: the call
    waits for the copy between it and the IPU, and for the link only beyond the device time
    (tiles.cycles.staged_host_seconds)."""
    worst = 0.0
    for h in system.host_links:
        n = sum(1 for i in ipus if i in h.ipus)
        if n:
            link = sum(h.latency_s + n * b / h.bytes_per_s for b in (bytes_in, bytes_out))
            if system.streaming_memory_bytes_per_s:
                copy = (bytes_in + bytes_out) / system.streaming_memory_bytes_per_s
                link = max(copy, link - device_s)
            worst = max(worst, link)
    return worst


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("system_name, version", [("bow2000", "bow"), ("dss8440", "ipu1")])
def test_replicas_cost_one_replicas_compute_plus_the_ring_and_the_shared_host_links(
        lowered, system_name, version):
    target = get_target(version)
    system = hardware.get_system(system_name)
    alone = compile_module(lowered, target).estimate          # one IPU, no system
    assert alone.replicas == 1 and alone.all_reduce_cycles == 0 and alone.all_reduces == 0
    bytes_in, bytes_out = (M * K + K * N) * 4, 4
    assert (alone.host_bytes_in, alone.host_bytes_out) == (bytes_in, bytes_out)
    compute_s = alone.device_cycles / target.clock_hz
    for replicas in (1, 2, 4):
        est = compile_module(lowered, target, CompileOptions(replicas=replicas, system=system)).estimate
        ipus = list(range(replicas))
        ring_s = _ring_seconds(system, ipus, M * N * 4, target)
        sync_s = _sync_seconds(system, ipus, target) if replicas > 1 else 0.0
        host_s = _host_seconds(system, ipus, bytes_in, bytes_out, compute_s)
        expected = compute_s + ring_s + sync_s + host_s
        assert est.seconds == pytest.approx(expected, rel=0.02), (replicas, est.summary())
        # Each part on its own: the program per IPU is one replica's.
        assert est.device_cycles == alone.device_cycles
        assert est.all_reduce_cycles / target.clock_hz == pytest.approx(ring_s, rel=0.01, abs=1e-9)
        assert est.host_cycles / target.clock_hz == pytest.approx(host_s, rel=0.01)
        assert (est.replicas, est.system, est.ipu_ids) == (replicas, system_name, ipus)
        assert est.all_reduces == (1 if replicas > 1 else 0)
        assert est.all_reduce_bytes == (M * N * 4 if replicas > 1 else 0)
        assert est.replica_syncs == (1 if replicas > 1 else 0)
        assert est.peak_tile_bytes >= alone.peak_tile_bytes  # per IPU; + one ring chunk
        assert est.host_link["replicas"] == (min(replicas, 4) if system_name == "bow2000"
                                             else min(replicas, 2))
    # A C2 card's 2 IPUs share its PCIe link: 4 replicas on 2 cards load each as 2 on one do,
    # and 2 replicas on two cards (IPUs 0 and 2) as 1.
    if system_name == "dss8440":
        def host(replicas: int, ipu_ids: tuple[int, ...] = ()) -> int:
            options = CompileOptions(replicas=replicas, system=system, ipu_ids=ipu_ids)
            return compile_module(lowered, target, options).estimate.host_cycles

        assert host(4) == host(2) > host(2, (0, 2)) == host(1)


def test_the_all_reduce_share_throughput_and_report(lowered, tmp_path):
    target = get_target("bow")
    est = estimate_module(lowered, None, target, replicas=4, system=hardware.get_system("bow2000"))
    assert est.all_reduce_share == pytest.approx(est.all_reduce_cycles / est.cycles)
    assert 0.2 < est.all_reduce_share < 1.0
    assert est.cycles == (est.device_cycles + est.all_reduce_cycles + est.replica_sync_cycles
                          + est.host_cycles)
    (c,) = est.collectives
    assert (c["bytes"], c["executions"], c["reduction"]) == (M * N * 4, 1, "sum")
    assert c["seconds"] * target.clock_hz == pytest.approx(est.all_reduce_cycles, abs=1)
    assert "4 replicas on bow2000" in est.summary() and "of the call" in est.summary()
    d = est.to_dict()
    assert d["all_reduce_share"] == est.all_reduce_share and d["ring"]["ipus"] == [0, 2, 3, 1]
    assert any("ring" in a for a in est.assumptions)
    # Throughput: items per call are per replica; a call runs all of them.
    est.items_per_call = 32
    assert est.throughput == pytest.approx(4 * 32 / est.seconds)
    # The cache's round trip keeps every new field.
    again = Estimate.from_dict(json.loads(est.to_json()))
    assert again == est
    html = est._repr_html_()
    ET.fromstring(html.split("\n", 1)[1])  # well-formed, with the replicas and the links' lane
    assert "4 on bow2000 IPUs 0, 1, 2, 3" in html and "of the call; ring 0 &gt; 2" in html
    assert "IPU-Links" in html


def test_a_cached_executable_keeps_the_replicated_estimate(lowered):
    target = get_target("bow")
    options = CompileOptions(replicas=2, system=hardware.get_system("bow2000"))
    exe = compile_module(lowered, target, options)
    record = json.loads(json.dumps(exe.cache_record()))
    again = executable_from_record(lowered, target, options, record)
    assert again.estimate == exe.estimate and again.estimate.all_reduces == 1


def test_more_replicas_than_ipus_or_ipu_ids_that_do_not_match_are_refused(lowered):
    bow, bow2000 = get_target("bow"), hardware.get_system("bow2000")
    with pytest.raises(ValueError, match=r"5 replicas need 5 IPUs \(one per replica\), but "
                                         r"system 'bow2000' has 4 IPUs"):
        compile_module(lowered, bow, CompileOptions(replicas=5, system=bow2000))
    with pytest.raises(ValueError, match=r"one IPU per replica: 1 IPU ids \[0\] for 2 replicas"):
        estimate_module(lowered, None, bow, replicas=2, system=bow2000, ipu_ids=(0,))
    with pytest.raises(ValueError, match=r"ipu_ids \[7\] are not IPUs of system 'bow2000'"):
        estimate_module(lowered, None, bow, replicas=2, system=bow2000, ipu_ids=(0, 7))
    with pytest.raises(ValueError, match=r"has GC2 IPUs \(ipu1\); the program is compiled for Bow"):
        estimate_module(lowered, None, bow, replicas=2, system=hardware.get_system("dss8440"))
    with pytest.raises(ValueError, match=r"replicas must be an int >= 1"):
        estimate_module(lowered, None, bow, replicas=0)


def test_a_path_of_several_hops_runs_at_its_slowest_hop_shared_by_the_arrows_crossing_it(lowered):
    """DSS8440 IPUs 0 and 3 (different cards): no link joins them, each way the path takes 2
    hops, a card's pair (64 GB/s) and a card-to-card rail (32 GB/s): the ring runs at 32 GB/s
    with both hops' latency. Bow-2000's 4 IPUs in id order: 1 -> 2 and 3 -> 0 each cross
    IPU 1 -> IPU 0, which they share: half its bandwidth; the ladder's ring (0 2 3 1) uses
    single links at full bandwidth, and is the one charged."""
    gc2, dss = get_target("ipu1"), hardware.get_system("dss8440")
    assert dss.link(0, 3) is None
    est = estimate_module(lowered, None, gc2, replicas=2, system=dss, ipu_ids=(3, 0))
    a, b = est.ring["arrows"]
    assert est.ring["ipus"] == [0, 3] and a["path"] == [0, 1, 3] and b["path"] == [3, 1, 0]
    assert a["hops"] == b["hops"] == 2 and a["shared"] == 1
    assert est.ring["bytes_per_s"] == dss.link(1, 3).bytes_per_s == 32e9
    hop = dss.link(0, 1).latency_s + dss.link(1, 3).latency_s
    sync = gc2.sync_cycles / gc2.clock_hz + 2 * hop
    assert est.ring["step_latency_s"] == pytest.approx(hop + sync + GCL_STEP_OVERHEAD_S)
    expected = 2 * 1 / 2 * M * N * 4 / 32e9 + 2 * (hop + sync + GCL_STEP_OVERHEAD_S)
    assert est.all_reduce_cycles / gc2.clock_hz == pytest.approx(expected, rel=1e-3)

    from device_server.emulator.tiles.replication import _ring_in_order

    bow, bow2000 = get_target("bow"), hardware.get_system("bow2000")
    in_order = _ring_in_order(bow2000, (0, 1, 2, 3), 0.0)
    arrows = {(x.src, x.dst): x for x in in_order.arrows}
    assert arrows[(1, 2)].path == (1, 0, 2) and arrows[(3, 0)].path == (3, 1, 0)
    assert arrows[(1, 2)].shared == arrows[(3, 0)].shared == 2
    assert in_order.bytes_per_s == pytest.approx(bow2000.link(0, 1).bytes_per_s / 2)
    assert arrows[(0, 1)].bytes_per_s == bow2000.link(0, 1).bytes_per_s  # 0 -> 1 is not shared
    four = estimate_module(lowered, None, bow, replicas=4, system=bow2000)
    assert four.ring["ipus"] == [0, 2, 3, 1]
    assert all(len(x["path"]) == 2 for x in four.ring["arrows"])  # one link each
    assert four.ring["bytes_per_s"] == pytest.approx(bow2000.link(0, 1).bytes_per_s)


def test_each_device_loop_trip_pays_its_all_reduce_and_a_replica_sync(looped):
    bow, bow2000 = get_target("bow"), hardware.get_system("bow2000")
    one = estimate_module(looped, None, bow)
    two = estimate_module(looped, None, bow, replicas=2, system=bow2000)
    assert (two.all_reduces, two.replica_syncs) == (5, 1 + 5)
    assert two.all_reduce_bytes == 5 * 256 * 256 * 4
    ring_s = _ring_seconds(bow2000, [0, 1], 256 * 256 * 4, bow)
    assert two.all_reduce_cycles / bow.clock_hz == pytest.approx(5 * ring_s, rel=1e-3)
    assert two.replica_sync_cycles / bow.clock_hz == pytest.approx(
        6 * _sync_seconds(bow2000, [0, 1], bow), rel=1e-3)
    assert (one.all_reduces, one.replica_syncs, one.all_reduce_cycles) == (0, 0, 0)
    assert two.device_cycles == one.device_cycles
    assert two.collectives[0]["executions"] == 5 and two.collectives[0]["reduction"] == "mean"


def test_one_replica_on_a_system_uses_its_host_link_and_no_collective(lowered):
    gc2, c2 = get_target("ipu1"), hardware.get_system("c2")
    est = estimate_module(lowered, None, gc2, replicas=1, system=c2)
    assert est.all_reduce_cycles == est.replica_sync_cycles == 0 and not est.ring
    pcie = c2.host_link(0)
    expected = sum(pcie.latency_s + b / pcie.bytes_per_s for b in (est.host_bytes_in, est.host_bytes_out))
    assert est.host_cycles / gc2.clock_hz == pytest.approx(expected, rel=1e-3)
    assert np.isclose(est.throughput, 1 / est.seconds)
