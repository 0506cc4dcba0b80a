"""The tile model's memory-aware schedule (device_server/emulator/tiles/schedule.py, liveness.py).

Peak memory per tile is counted with every computation's instructions in the order of least
peak memory the scheduler finds (list schedulers, a depth-first order, or HLO order when that
is no worse), and the report keeps HLO order's peak beside it. The scheduler is measured here
against the exact optimum, found by an exhaustive search written in this file (memoized over
the sets of nodes already run), on random graphs of 10 to 14 nodes.
"""

from __future__ import annotations

import json
import random
from functools import cache

import emulator_util as eu
import numpy as np
import pytest

from device_server.emulator import get_target
from device_server.emulator.tiles import Estimate, estimate_module, plan_module
from device_server.emulator.tiles.liveness import graph_of, hlo_liveness, liveness
from device_server.emulator.tiles.memory import profile_memory
from device_server.emulator.tiles.schedule import SCHEDULERS, Graph, schedule

IPU2 = get_target("ipu2")


# ------------------------------------------------------------------ the optimum, independently


def _random_graph(rng: random.Random, n: int) -> Graph:
    """``n`` nodes in a random topological order, each making one buffer read by its
    successors (0 to 3 predecessors each), plus a root reading every result, as a
    computation's root tuple does; random sizes and some temporaries."""
    preds: list[list[int]] = [[]]
    for v in range(1, n - 1):
        preds.append(sorted(rng.sample(range(v), min(v, rng.choice([0, 1, 1, 2, 2, 3])))))
    used = {p for ps in preds for p in ps}
    preds.append([v for v in range(n - 1) if v not in used])  # the root
    size = [float(rng.randint(1, 100)) for _ in range(n - 1)] + [0.0]
    temp = [float(rng.choice([0, 0, rng.randint(1, 50)])) for _ in range(n)]
    return Graph(preds=preds, maker=list(range(n)), reads=[list(p) for p in preds], size=size,
                 temp=temp, kept=[False] * n)


def _peak(g: Graph, order: list[int]) -> float:
    """Bytes live at each node run: buffers made and not yet read by all their readers
    (the node's own included), plus the node's temporaries; the most of them."""
    assert sorted(order) == list(range(g.nodes))
    done: set[int] = set()
    best = 0.0
    for v in order:
        assert set(g.preds[v]) <= done, f"node {v} runs before a predecessor"
        done.add(v)
        live = sum(g.size[b] for b in range(len(g.size))
                   if g.maker[b] in done and (g.kept[b] or not set(g.readers[b]) <= done - {v}))
        best = max(best, live + g.temp[v])
    return best


def _optimum(g: Graph) -> float:
    """The least peak over every valid order: f(S) = min over ready v of max(bytes while v
    runs after S, f(S + v)), memoized over the set S of nodes run."""
    n = g.nodes
    pred_mask = [sum(1 << p for p in ps) for ps in g.preds]
    reader_mask = [sum(1 << r for r in rs) for rs in g.readers]

    @cache
    def f(done: int) -> float:
        if done == (1 << n) - 1:
            return 0.0
        held = sum(g.size[b] for b in range(len(g.size))
                   if done >> g.maker[b] & 1 and (g.kept[b] or reader_mask[b] & ~done))
        best = float("inf")
        for v in range(n):
            if done >> v & 1 or pred_mask[v] & ~done:
                continue
            during = held + sum(g.size[b] for b in g.makes[v]) + g.temp[v]
            if during < best:
                best = min(best, max(during, f(done | 1 << v)))
        return best

    return f(0)


def test_scheduler_is_within_ten_percent_of_the_optimum_on_random_graphs() -> None:
    rng = random.Random(14)
    ratios = []
    per_scheduler: dict[str, list[float]] = {name: [] for name in SCHEDULERS}
    for _ in range(60):
        g = _random_graph(rng, rng.randint(10, 14))
        best = _optimum(g)
        order, _ = schedule(g)
        ratios.append(_peak(g, order) / best)
        for name, make in SCHEDULERS.items():
            per_scheduler[name].append(_peak(g, make(g)) / best)
    mean = sum(ratios) / len(ratios)
    assert 1.0 <= min(ratios) and mean <= 1.1, (mean, max(ratios))
    # The reverse list scheduler does most of it on its own.
    assert sum(per_scheduler["reverse"]) / len(ratios) <= 1.1


def test_every_scheduler_gives_an_order_that_respects_the_graph() -> None:
    rng = random.Random(3)
    for _ in range(20):
        g = _random_graph(rng, rng.randint(2, 40))
        for make in SCHEDULERS.values():
            _peak(g, make(g))  # asserts predecessors first, every node once
    cyclic = Graph(preds=[[1], [0]], maker=[0, 1], reads=[[1], [0]], size=[1.0, 1.0],
                   temp=[0.0, 0.0], kept=[False, False])
    with pytest.raises(ValueError, match="cycle"):
        SCHEDULERS["reverse"](cyclic)


# ------------------------------------------------------------------ on planned programs


def _bad_order_module(branches: int = 8, n: int = 1 << 16) -> eu.ir_pb2.Module:
    """``exp(x * c_i)`` for every branch first, then a slice of each, then their sum: in this
    emission order every big result is live at once; one at a time suffices."""
    b = eu.IRBuilder("branches")
    x = b.parameter(np.float32, [n])
    big = [b.op("exponential", [b.op("multiply", [x, b.constant(np.full(n, i + 1.0, np.float32))],
                                     np.float32, [n])], np.float32, [n]) for i in range(branches)]
    small = [b.op("slice", [e], np.float32, [8], slice_starts=[0], slice_limits=[8],
                  slice_strides=[1]) for e in big]
    acc = small[0]
    for s in small[1:]:
        acc = b.op("add", [acc, s], np.float32, [8])
    b.root(acc)
    return b.module()


def test_the_schedule_runs_branches_one_at_a_time() -> None:
    plan = plan_module(_bad_order_module(), IPU2)
    hlo = profile_memory(plan, order="hlo")
    sched = profile_memory(plan)
    assert sched.order == "scheduled" and hlo.order == "hlo"
    assert sched.hlo_order_peak_bytes == hlo.peak_bytes
    big = (1 << 16) * 4
    # HLO order: the 8 big results (plus one in the making); scheduled: about two at a time.
    assert hlo.peak_not_always_live_bytes >= 8 * big
    assert sched.peak_not_always_live_bytes <= 3 * big
    assert sched.peak_bytes < hlo.peak_bytes


def _all_plans(ctx, out):
    out.append(ctx)
    for p in ctx.points:
        for alts in p.subs:
            for c in alts:
                _all_plans(c, out)
    return out


@pytest.fixture(scope="module")
def tf():
    import tensorflow as tf

    return tf


@pytest.fixture(scope="module")
def loop_module(tf):
    """A counting loop (a called computation) with a dense step in its body."""
    from tf_ipu.lowering.program import lower_function

    def step(x, w):
        def body(i, acc):
            return i + 1, tf.nn.relu(tf.matmul(acc, w)) + tf.reduce_mean(acc)

        return tf.reduce_sum(tf.while_loop(lambda i, _: i < 3, body, [tf.constant(0), x])[1])

    specs = [tf.TensorSpec([64, 128], tf.float32), tf.TensorSpec([128, 128], tf.float32)]
    return lower_function(step, specs, "loop_step").module


def test_hlo_order_live_ranges_follow_from_the_reads_the_planner_records(loop_module) -> None:
    """The scheduler's graph (operands, reads) gives back the planner's own live ranges when
    the order is HLO order, in every computation (entry, loop condition and body)."""
    plan = plan_module(loop_module, IPU2)
    plans = _all_plans(plan.entry, [])
    assert len(plans) >= 3
    for ctx in plans:
        g, bufs = graph_of(ctx, [0.0] * len(ctx.points))
        mine = liveness(g, bufs, list(range(g.nodes)), "hlo")
        theirs = hlo_liveness(ctx)
        assert [(b.instr.name, f, last) for b, f, last in mine.ranges] == \
            [(b.instr.name, f, last) for b, f, last in theirs.ranges]


def test_side_effects_keep_their_order_and_updates_follow_reads() -> None:
    b = eu.IRBuilder("effects")
    v = b.parameter(np.float32, [1024])
    x = b.parameter(np.float32, [1024])
    y = b.op("multiply", [x, v], np.float32, [1024])          # reads the variable
    r1 = b.op("custom-call", [y], np.float32, [1024], custom_call_target="tf_ipu_all_reduce")
    r2 = b.op("custom-call", [x], np.float32, [1024], custom_call_target="tf_ipu_all_reduce")
    new_v = b.op("subtract", [v, r2], np.float32, [1024])     # written over the variable
    b.root(b.tuple([r1, new_v]))
    module = b.module()
    module.aliases.add(output_index=1, parameter_number=0)
    plan = plan_module(module, IPU2)
    assert len(plan.overwrites) == 1
    g, _ = graph_of(plan.entry, [0.0] * len(plan.entry.points), plan.overwrites)
    point = {p.instr.id: k for k, p in enumerate(plan.entry.points)}
    assert point[r1] in g.preds[point[r2]]      # the second custom call after the first
    assert point[y] in g.preds[point[new_v]]    # the update after the variable's read
    for make in SCHEDULERS.values():
        order = make(g)
        assert order.index(point[r1]) < order.index(point[r2])
        assert order.index(point[y]) < order.index(point[new_v])


# ------------------------------------------------------------------ ResNet-50 and BERT


def _lowered_train_step(tf, model, x_spec, y_spec, name):
    from tf_ipu.lowering.program import lower_function

    def fn(x, y):
        return model.train_step((x, y))

    lowered = lower_function(fn, [x_spec, y_spec], name)
    kinds = {n: {"arg": "argument", "var": "variable", "const": "constant"}[p["kind"]]
             for n, p in enumerate(json.loads(lowered.signature)["params"])}
    return lowered.module, kinds


@pytest.fixture(scope="module")
def resnet50_step(tf):
    """ResNet-50's training step at 32 x 32 (all its layers; small activations), batch 2."""
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy())
    return _lowered_train_step(tf, model, tf.TensorSpec([2, 32, 32, 3]), tf.TensorSpec([2], tf.int32),
                               "resnet50/train_step")


@pytest.fixture(scope="module")
def bert_step(tf):
    """A small BERT encoder (2 layers, hidden 128) with a classifier, Adam, batch 2."""
    import keras

    from tf_ipu.models import bert_classifier, bert_encoder

    model = bert_classifier(bert_encoder(2, 128, 2, 64, 1000, dropout=0.0), 2)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return _lowered_train_step(tf, model, tf.TensorSpec([2, 64], tf.int32), tf.TensorSpec([2], tf.int32),
                               "bert/train_step")


@pytest.mark.parametrize("which", ["resnet50_step", "bert_step"])
def test_training_reports_the_hlo_order_peak_beside_the_scheduled_one(which, request, tmp_path) -> None:
    module, kinds = request.getfixturevalue(which)
    for preset in ("ipu2",) if which == "resnet50_step" else ("ipu1", "ipu2"):
        est = estimate_module(module, None, get_target(preset), param_kinds=kinds)
        assert est.memory_order in ("scheduled", "hlo")
        assert est.hlo_order_peak_tile_bytes > 0
        assert est.peak_tile_bytes <= est.hlo_order_peak_tile_bytes
        assert sum(est.schedulers.values()) >= 1
        assert est.fits == (est.peak_tile_bytes <= est.tile_bytes_limit)
    d = json.loads(est.to_json())
    back = Estimate.from_dict(d)
    assert (back.hlo_order_peak_tile_bytes, back.hlo_order_peak_tile, back.memory_order,
            back.schedulers) == (est.hlo_order_peak_tile_bytes, est.hlo_order_peak_tile,
                                 est.memory_order, est.schedulers)
    page = open(est.save_html(str(tmp_path / "report.html"))).read()
    assert "HLO order" in page
