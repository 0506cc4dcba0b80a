"""Pods of Pod64s in the estimate (issue 27, point 5): the six systems, GCL's hierarchical
all-reduce (IPU-Links within a Pod64, GW-Links between Pod64s) and what the report says of it.
Estimates only: no device server."""

from __future__ import annotations

import keras
import pytest

import tf_ipu
from device_server.emulator.arch import get_target
from device_server.emulator.tiles import html
from device_server.emulator.tiles.replication import (
    GCL_STEP_OVERHEAD_S,
    all_reduce_parts,
    all_reduce_seconds,
    replication,
)
from device_server.protocol import hardware

POD_SYSTEMS = [("pod64", "ipu2", 1), ("pod128", "ipu2", 2), ("pod256", "ipu2", 4),
               ("bow-pod64", "bow", 1), ("bow-pod128", "bow", 2), ("bow-pod256", "bow", 4)]


@pytest.mark.parametrize("name, version, pod64s", POD_SYSTEMS)
def test_the_six_pods_have_their_ipus_machines_hosts_and_links(name, version, pod64s):
    s = hardware.get_system(name)
    assert (s.num_ipus, s.ipu_version, s.machines, s.hosts) == (64 * pod64s, version, 16 * pod64s, pod64s)
    assert s.num_pods == pod64s and [len(p) for p in s.pods] == [64] * pod64s
    # one gateway host link per machine, shared by its 4 IPUs
    assert len(s.host_links) == 16 * pod64s and all(len(h.ipus) == 4 for h in s.host_links)
    # each Pod64 an IPU-Link torus: 32 rungs + 64 rails (the ladder's ends looped round)
    assert len(s.links) == 96 * pod64s
    assert all(len(s.neighbours(i)) == 3 for i in range(s.num_ipus))
    assert s.link(0, 62) is not None and s.link(1, 63) is not None  # the torus's wrap
    assert all(s.pod_of(link.a) == s.pod_of(link.b) for link in s.links)
    assert s.path(0, 63) == [0, 1, 63]
    neighbour = hardware._BOW_NEIGHBOUR_BYTES_PER_S if version == "bow" else \
        hardware._GC200_NEIGHBOUR_BYTES_PER_S
    assert s.link(0, 1).bytes_per_s == neighbour
    # GW-Links: 2 ports of 100 Gbit/s, at most the gateway's PCIe to its IPUs
    gw = s.gw_link
    assert gw is not None and gw.ports == 2 and gw.line_bytes_per_s == 12.5e9
    assert gw.bytes_per_s == min(2 * 12.5e9 * hardware._GW_LINK_EFFICIENCY,
                                 hardware._GATEWAY_TO_IPUS_BYTES_PER_S)
    assert any("GW-Links" in a for a in s.assumptions) and any("datasheet" in x for x in s.sources)
    if pod64s > 1:
        with pytest.raises(ValueError, match="no IPU-Links join IPU 0 .pod 0. and IPU 64 .pod 1."):
            s.path(0, 64)
        assert "Pod64s joined by" in s.summary()


def test_the_all_reduce_crosses_gw_links_only_across_pod64s():
    bow = get_target("bow")
    one = replication(64, "bow-pod64", (), bow).ring
    assert one.links == ("IPU-Links",) and one.gw is None
    # 64 replicas of a Pod128 on its first 64 IPUs stay in one Pod64
    assert replication(64, "bow-pod128", (), bow).ring.gw is None
    for name, pods in (("bow-pod128", 2), ("bow-pod256", 4)):
        ring = replication(64 * pods, name, (), bow).ring
        assert ring.links == ("IPU-Links", "GW-Links")
        assert len(ring.gw.pods) == pods and ring.gw.per_pod == 64
        # the pod's ring is the Pod64's: same bandwidth and steps as on one Pod64
        assert ring.bytes_per_s == one.bytes_per_s and ring.step_latency_s == one.step_latency_s
    # replicas spread over two pods by their ids: 32 in each
    spread = replication(64, "bow-pod128", tuple(range(32)) + tuple(range(64, 96)), bow).ring
    assert spread.gw is not None and spread.gw.per_pod == 32 and len(spread.gw.pods) == 2


@pytest.mark.parametrize("name, pods", [("bow-pod128", 2), ("bow-pod256", 4), ("pod256", 4)])
def test_the_gw_link_term_is_the_hand_computation_from_the_named_figures(name, pods):
    version = "bow" if name.startswith("bow") else "ipu2"
    rep = replication(64 * pods, name, (), get_target(version))
    nbytes = 100e6
    # each machine: min(2 x 100 Gbit/s x 85%, PCIe Gen4 x8 16 GB/s) each way, its 4 IPUs
    # sharing it; a Pod64's 64 replicas send 2 (P - 1) / P of the bytes through them
    machine = min(2 * 100e9 / 8 * 0.85, 16e9)
    pod_bw = 64 * machine / 4
    gw_step = 10e-6 + GCL_STEP_OVERHEAD_S
    expected_gw = 2 * (pods - 1) / pods * nbytes / pod_bw + 2 * (pods - 1) * gw_step
    parts = all_reduce_parts(rep.ring, 64 * pods, nbytes)
    assert parts["GW-Links"] == pytest.approx(expected_gw, rel=1e-9)
    # the IPU-Link part: reduce-scatter + all-gather over one Pod64's 64 replicas
    local = 2 * 63 / 64 * nbytes / rep.ring.bytes_per_s + 2 * 63 * rep.ring.step_latency_s
    assert parts["IPU-Links"] == pytest.approx(local, rel=1e-9)
    assert all_reduce_seconds(rep.ring, 64 * pods, nbytes) == pytest.approx(local + expected_gw)
    # the same bytes on one Pod64 cost the IPU-Link part alone
    one = replication(64, name.replace(str(64 * pods), "64"), (), get_target(version))
    assert all_reduce_seconds(one.ring, 64, nbytes) == pytest.approx(local)


@pytest.fixture(scope="module")
def model():
    inputs = keras.Input((32,))
    x = keras.layers.Dense(256, activation="relu")(inputs)
    m = keras.Model(inputs, keras.layers.Dense(10)(x))
    m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def _estimate(model, system, replicas, **kw):
    return tf_ipu.estimate(model, 8, training=True, ipu_version="bow", replicas=replicas,
                           system=system, tiles_per_ipu=16, **kw)


def test_the_estimate_charges_and_reports_the_hierarchical_all_reduce(model):
    pod64 = _estimate(model, "bow-pod64", 64)
    pod128 = _estimate(model, "bow-pod128", 128)
    pod256 = _estimate(model, "bow-pod256", 256)
    assert pod64.all_reduce_links == ["IPU-Links"] and pod64.all_reduce_gw_cycles == 0
    assert pod128.all_reduce_links == pod256.all_reduce_links == ["IPU-Links", "GW-Links"]
    assert pod64.all_reduce_bytes == pod128.all_reduce_bytes > 0
    clock = pod128.clock_hz
    for est, pods in ((pod128, 2), (pod256, 4)):
        nbytes, count = est.all_reduce_bytes, est.all_reduces
        pod_bw = 64 * min(2 * 12.5e9 * 0.85, 16e9) / 4
        hand = (2 * (pods - 1) / pods * nbytes / pod_bw
                + count * 2 * (pods - 1) * (10e-6 + GCL_STEP_OVERHEAD_S)) * clock
        assert est.all_reduce_gw_cycles == pytest.approx(hand, rel=1e-6)
        # the pod's IPU-Link part is the Pod64's: the difference is the GW-Link term
        assert est.all_reduce_cycles - pod64.all_reduce_cycles == pytest.approx(hand, abs=2)
        assert 0 < est.all_reduce_share < 1
        assert "over IPU-Links and GW-Links" in est.summary() and "Pod64s)" in est.summary()
        page = html.render_html(est.to_dict())
        assert "crosses IPU-Links and GW-Links" in page and "Pod64s over the GW-Links" in page
        assert est.to_dict()["all_reduce_links"] == ["IPU-Links", "GW-Links"]
    assert pod256.all_reduce_cycles > pod128.all_reduce_cycles > pod64.all_reduce_cycles
    assert "over IPU-Links" in pod64.summary() and "GW-Links" not in pod64.summary()


def test_the_training_estimate_reports_the_gw_share(model):
    t = _estimate(model, "bow-pod256", 256, gradient_accumulation_steps_per_replica=4)
    assert t.all_reduce_links == ["IPU-Links", "GW-Links"]
    assert 0 < t.all_reduce_gw_share < t.all_reduce_share < 1
    assert t.all_reduce_gw_share == pytest.approx(t.step.all_reduce_gw_cycles / t.cycles_per_update)
    assert "over IPU-Links and GW-Links" in t.summary() and "on the GW-Links" in t.summary()
    assert t.to_dict()["training"]["all_reduce_gw_share"] == t.all_reduce_gw_share


@pytest.mark.parametrize("name, ipus", [("bow-pod64", 64), ("pod128", 128), ("bow-pod256", 256)])
def test_replicas_beyond_the_pods_ipus_are_refused_naming_the_numbers(model, name, ipus):
    version = "bow" if name.startswith("bow") else "ipu2"
    with pytest.raises(ValueError, match=rf"{ipus + 1} replicas need {ipus + 1} IPUs .one per "
                                         rf"replica., but system '{name}' has {ipus} IPUs"):
        tf_ipu.estimate(model, 8, training=True, ipu_version=version, replicas=ipus + 1,
                        system=name, tiles_per_ipu=16)


def test_a_pipeline_replicated_across_pod64s_reduces_each_stage_over_gw_links():
    """2-IPU replicas: 64 of them fill a Bow Pod128 (32 in each Pod64); each stage IPU's
    all-reduce runs over its 32 holders in each pod, then across the two pods."""
    m = _two_stage_model(4)
    one = tf_ipu.estimate(m, 4, training=True, ipu_version="bow", replicas=32,
                          system="bow-pod64", tiles_per_ipu=16)
    two = tf_ipu.estimate(m, 4, training=True, ipu_version="bow", replicas=64,
                          system="bow-pod128", tiles_per_ipu=16)
    assert one.all_reduce_links == ["IPU-Links"]
    assert two.all_reduce_links == ["IPU-Links", "GW-Links"]
    assert two.ring["gw"]["per_pod"] == 32 and len(two.ring["gw"]["pods"]) == 2
    assert two.all_reduce_cycles > one.all_reduce_cycles > 0
    with pytest.raises(ValueError, match="65 replica.s. of 2 IPUs need 130 IPUs, but system "
                                         "'bow-pod128' has 128"):
        tf_ipu.estimate(m, 4, training=True, ipu_version="bow", replicas=65,
                        system="bow-pod128", tiles_per_ipu=16)


def _two_stage_model(accumulation):
    with tf_ipu.IPUStrategy().scope():
        m = keras.Sequential([keras.Input((64,))]
                             + [keras.layers.Dense(64, activation="relu") for _ in range(3)]
                             + [keras.layers.Dense(8)])
        m.compile(optimizer="sgd", loss="mse")
        m.set_pipeline_stage_assignment([0, 0, 1, 1])
        m.set_pipelining_options(gradient_accumulation_steps_per_replica=accumulation,
                                 device_mapping=[0, 1])
    return m


def test_planning_once_re_costs_replicas_systems_and_accumulation_as_a_fresh_estimate():
    """bench_mlperf's ``_plan_once``: one lowering and one plan for a pipelined program
    whatever its replicas, system and micro-batches per update; every figure the speed-up
    reads is the fresh estimate's (the memory may differ by the all-reduce's receive chunk)."""
    from bench.bench_mlperf import _plan_once, _with_accumulation
    from tf_ipu.estimate import _lowerings

    runs = [("bow-pod16", 8, 4), ("bow-pod64", 32, 12), ("bow-pod128", 64, 6)]

    def est(m, system, replicas, accumulation):
        return tf_ipu.estimate(_with_accumulation(m, accumulation), 4, training=True,
                               ipu_version="bow", replicas=replicas, system=system,
                               tiles_per_ipu=16, steps=1)

    fresh = [est(_two_stage_model(a), s, r, a) for s, r, a in runs]
    shared = _two_stage_model(runs[0][2])
    with _lowerings(), _plan_once() as counts:
        once = [est(shared, s, r, a) for s, r, a in runs]
    assert counts == {"plans": 1, "reused": 2}
    for f, o, (system, replicas, accumulation) in zip(fresh, once, runs, strict=True):
        assert o.gradient_accumulation_steps_per_replica == accumulation
        assert (o.step.system, o.step.replicas) == (system, replicas)
        assert o.throughput == pytest.approx(f.throughput, rel=1e-12)
        assert o.cycles_per_update == f.cycles_per_update
        assert o.all_reduce_share == pytest.approx(f.all_reduce_share, rel=1e-12)
        assert o.all_reduce_links == f.all_reduce_links
        assert o.step.ring == f.step.ring
        chunk = max(1, f.step.all_reduce_bytes)   # at most a replica's gradients, spread on tiles
        assert abs(o.step.peak_tile_bytes - f.step.peak_tile_bytes) <= chunk
    assert once[2].all_reduce_links == ["IPU-Links", "GW-Links"]


def test_the_bert_pod_configurations_are_the_submissions_and_match_the_logs():
    """Every BERT pod run is its own configuration file's (8-IPU pipelines: not the round's
    Pod16 one), and its IPUs, global batch and accumulation are those its logs state."""
    from bench.bench_mlperf import _BERT_PODS, SEQUENCES_PER_ROW, _bert_layout, _measured_pod

    assert [(r.version, r.system) for r in _BERT_PODS] == [
        ("v1.0", "pod64"), ("v1.1", "pod64"), ("v1.1", "pod128"), ("v2.0", "bow-pod64"),
        ("v2.0", "bow-pod128"), ("v2.0", "bow-pod256")]
    for run in _BERT_PODS:
        layout = _bert_layout(run.placement)
        assert sorted(set(layout.ipus)) == list(range(8)) and layout.ipus[0] == layout.ipus[-1] == 0
        assert hardware.get_system(run.system).ipu_version == run.chip
        pod = _measured_pod("bert", run.version, run.names)
        assert pod["n_devices"] == 8 * run.replicas
        assert pod["global_batch_size"] == run.replicas * run.micro * run.accumulation * SEQUENCES_PER_ROW
        assert pod["accumulation"] == run.accumulation
    # v1.0's Pod64: the embedding alone on IPU 0 (encoder_start_ipu 1), layers on IPUs 1-7
    v10 = _bert_layout(_BERT_PODS[0].placement)
    assert v10.att[0] == 1 and v10.att[-1] == 7 and len(v10.ipus) == 9
    with pytest.raises(ValueError, match="encoder_start_ipu 2 is not modelled"):
        _bert_layout("8-IPU layers_per_ipu [4, 4, 4, 4, 4, 4], encoder_start_ipu 2")


def test_the_per_update_split_reads_two_accumulation_counts():
    from bench.bench_mlperf import per_update_split

    # T = N c + u: measured c = 5 ms, u = 9 ms; estimated c = 7 ms, u = 4 ms
    def tput(c, u, n, replicas, items):
        return items * n * replicas / (n * c + u)

    row = {"benchmark": "ResNet-50", "round": "v1.1", "system": "pod128",
           "sizes": {"pod": [128, 20, 2, "micro-batch 20"], "pod16": [16, 20, 10, "micro-batch 20"]},
           "measured_throughput": tput(5e-3, 9e-3, 2, 128, 20),
           "estimated_throughput": tput(7e-3, 4e-3, 2, 128, 20),
           "measured_pod16_throughput": tput(5e-3, 9e-3, 10, 16, 20),
           "estimated_pod16_throughput": tput(7e-3, 4e-3, 10, 16, 20)}
    [split] = per_update_split([row, {"summary": {}}])
    assert split["accumulation"] == [2, 10] and split["systems"] == ["pod128", "pod16"]
    assert split["measured"]["micro_batch_s"] == pytest.approx(5e-3)
    assert split["measured"]["per_update_s"] == pytest.approx(9e-3)
    assert split["estimated"]["micro_batch_s"] == pytest.approx(7e-3)
    assert split["estimated"]["per_update_s"] == pytest.approx(4e-3)


@pytest.mark.parametrize("name, hosts", [("pod16", 1), ("bow-pod64", 1), ("pod128", 2), ("bow-pod256", 4)])
def test_the_host_servers_feed_is_stated_from_their_nics(name, hosts):
    """One host server per Pod64 (the MLPerf runs' n_hosts), each with a dual-port 100 GbE
    RNIC: what a measured rate needs of it is stated; the estimate does not charge it."""
    s = hardware.get_system(name)
    assert s.hosts == hosts and s.host_server_bytes_per_s == 2 * 100e9 / 8
    # 146,253 8-bit 224x224x3 images a second (ResNet-50 v2.0, Bow Pod64, measured)
    line = s.host_feed(146_253 * 150_528 * hosts)
    assert line == (f"22.0 GB/s from each of {hosts} host server{'s' if hosts > 1 else ''}: "
                    "88% of its NICs' 25 GB/s")
    assert any("RNIC" in x for x in s.sources) or name == "pod16"
    assert hardware.get_system("bow2000").host_feed(1e9) == ""


def test_the_all_reduce_share_of_a_pipelined_training_estimate_is_its_steps():
    """A pipeline's step spreads one update's all-reduce over its micro-batches already: the
    TrainingEstimate's share of the time per update is the step's share (not divided by the
    accumulation again), and its GW-Link part is counted although the step's all-reduce count
    per micro-batch rounds to 0."""
    from bench.bench_mlperf import _all_reduce_shares

    m = _two_stage_model(8)
    t = tf_ipu.estimate(m, 4, training=True, ipu_version="bow", replicas=64, system="bow-pod128",
                        tiles_per_ipu=16, steps=1)
    assert t.pipelined and t.gradient_accumulation_steps_per_replica == 8
    share, gw = _all_reduce_shares(t)
    assert (share, gw) == (t.all_reduce_share, t.all_reduce_gw_share)
    assert share == pytest.approx(t.step.all_reduce_cycles / t.step.cycles) and 0 < gw < share < 1
    assert t.all_reduce_cycles == t.step.all_reduce_cycles
    # the GW-Link stage: bandwidth term + the GW steps' latency (2 pods, 32 replicas in each)
    ring = t.step.ring["gw"]
    assert len(ring["pods"]) == 2
    assert t.step.all_reduce_gw_cycles >= (t.step.all_reduce_bytes / ring["bytes_per_s"]
                                           * t.step.clock_hz)
    assert gw == pytest.approx(t.step.all_reduce_gw_cycles / t.step.cycles, rel=1e-9)
    assert _all_reduce_shares(t.step) == pytest.approx((share, gw), rel=1e-12)
