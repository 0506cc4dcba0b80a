"""Where a pipelined model's optimizer state lives: offloaded to Streaming Memory, sharded
over replicas (Graphcore's ``offload_weight_update_variables`` and
``replicated_optimizer_state_sharding``), and ``suggest_pipeline`` checked by the tile model.

The optimizer state is what only the weight update reads (Adam's two moments here). Offloaded,
it leaves the IPU except during the update, and is read and written once per update at the
system's Streaming Memory bandwidth (``protocol.hardware.System``); sharded over R replicas,
each holds and streams 1/R of it. docs/tile_model.md, "Pipelines".
"""

from __future__ import annotations

import numpy as np
import pytest

WIDTH = 256


def _model(**pipelining):
    import keras

    import tf_ipu

    with tf_ipu.IPUStrategy().scope():
        model = keras.Sequential([keras.Input((WIDTH,))]
                                 + [keras.layers.Dense(WIDTH, activation="relu", name=f"d{i}")
                                    for i in range(4)]
                                 + [keras.layers.Dense(8, name="head")])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.set_pipeline_stage_assignment([0, 0, 1, 1, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4, **pipelining)
    return model


def _adam_state_bytes(layers) -> int:
    """Adam's two moments of each weight, FP32."""
    return sum(2 * 4 * int(np.prod(w.shape)) for layer in layers for w in layer.weights)


def _estimate(model, tiles=0, batch=8, **kw):
    import tf_ipu

    return tf_ipu.estimate(model, batch, training=True, ipu_version="ipu2", system="m2000",
                           tiles_per_ipu=tiles, **kw)


def test_offloaded_optimizer_state_leaves_the_ipu_and_costs_streaming(ipu_system):
    """offload_weight_update_variables=True: each IPU's optimizer state (its stages' Adam
    moments, counted from the weights' shapes) is offloaded; the memory it held is freed
    outside the update, and each update pays 2 x state / bandwidth more on the IPU with the
    most; False keeps it; None offloads only where an IPU does not fit otherwise."""
    from device_server.protocol import hardware

    kept = _estimate(_model(offload_weight_update_variables=False))
    model = _model(offload_weight_update_variables=True)
    off = _estimate(model)
    layers = {layer.name: layer for layer in model.layers}
    expect = [_adam_state_bytes([layers["d0"], layers["d1"]]),
              _adam_state_bytes([layers["d2"], layers["d3"], layers["head"]])]
    # The iteration counter is only the update's too (8 bytes, on the stage of its update).
    state = [i["optimizer_state_bytes"] for i in off.ipus]
    assert all(e <= s <= e + 64 for e, s in zip(expect, state, strict=True)), (state, expect)
    assert [i["offloaded_bytes"] for i in off.ipus] == state
    assert [i["offloaded_bytes"] for i in kept.ipus] == [0, 0]
    for a, b in zip(kept.ipus, off.ipus, strict=True):
        assert b["at_peak_tile"]["variables"] <= a["at_peak_tile"]["variables"]
        assert sum(b["bytes_by_category"].values()) < sum(a["bytes_by_category"].values())
    bandwidth = hardware.get_system("m2000").streaming_memory_bytes_per_s
    streamed = max(2 * s / bandwidth * off.clock_hz for s in state)
    extra = off.pipeline_cycles_per_update - kept.pipeline_cycles_per_update
    assert streamed * 0.9 <= extra <= streamed * 1.1 + 2_000, (extra, streamed)
    assert any("in Streaming Memory (as asked)" in n for n in off.notes), off.notes
    auto = _estimate(_model())  # fits: nothing offloaded
    assert [i["offloaded_bytes"] for i in auto.ipus] == [0, 0]


def test_automatic_offload_makes_a_stage_fit_when_the_system_has_streaming_memory(ipu_system):
    """On few tiles, at batch 64, the IPUs do not fit with their optimizer state; None
    (automatic) offloads it where an IPU does not fit, and then it fits: the report says why."""
    tiles = 0
    for t in (3, 4, 5):
        kept = _estimate(_model(offload_weight_update_variables=False), tiles=t, batch=64)
        off = _estimate(_model(offload_weight_update_variables=True), tiles=t, batch=64)
        if not kept.fits and off.fits:
            tiles = t
            break
    assert tiles, "no tile count where offloading decides whether it fits"
    auto = _estimate(_model(), tiles=tiles, batch=64)
    assert auto.fits
    offloaded = [i["ipu"] for i in auto.ipus if i["offloaded_bytes"]]
    over = [i["ipu"] for i in kept.ipus if not i["fits"]]
    assert offloaded == over
    assert any("automatic: it does not fit otherwise" in n for n in auto.notes), auto.notes


def test_sharded_optimizer_state_streams_a_replicas_share(ipu_system):
    """replicated_optimizer_state_sharding over 2 replicas: each replica streams half of the
    offloaded state, so the update costs less than offloading alone; on one replica the
    report says nothing was sharded."""
    off = _estimate(_model(offload_weight_update_variables=True), replicas=2)
    shard = _estimate(_model(offload_weight_update_variables=True,
                             replicated_optimizer_state_sharding=True), replicas=2)
    assert shard.replicas == 2
    assert shard.pipeline_cycles_per_update < off.pipeline_cycles_per_update
    assert any("1/2 of it on each replica" in n for n in shard.notes), shard.notes
    one = _estimate(_model(offload_weight_update_variables=True,
                           replicated_optimizer_state_sharding=True))
    assert [i["offloaded_bytes"] for i in one.ipus] == [i["offloaded_bytes"] for i in off.ipus]


def test_bad_optimizer_state_options_name_the_fix(ipu_system):
    import tf_ipu

    model = _model(offload_weight_update_variables=True)
    with pytest.raises(ValueError, match=r"needs Streaming Memory, which system 'c2'.*m2000"):
        tf_ipu.estimate(model, 8, training=True, ipu_version="ipu1", system="c2")
    with pytest.raises(ValueError, match="offload_weight_update_variables must be True, False or None"):
        _model(offload_weight_update_variables="yes")
    with pytest.raises(ValueError, match="replicated_optimizer_state_sharding must be True or False"):
        _model(replicated_optimizer_state_sharding=None)
    model = _model(offload_weight_update_variables=False, replicated_optimizer_state_sharding=True)
    with pytest.raises(ValueError, match="shards the offloaded optimizer state"):
        _estimate(model, replicas=2)


def test_suggest_pipeline_is_checked_by_the_tile_model(ipu_system):
    """The per-layer sums see weights, optimizer state and activations, not code, exchange
    buffers or attention's temporaries: for a small BERT on 80 tiles they accept a split the
    tile model refuses (its first IPU over by >10%); the check splits again until every
    IPU fits, and the model's own stage assignment is left as it was."""
    import keras

    import tf_ipu
    from tf_ipu.models.bert import bert_classifier, bert_encoder

    tiles, batch = 80, 8
    with tf_ipu.IPUStrategy().scope():
        model = bert_classifier(bert_encoder(layers=2, hidden=128, heads=2, seq_len=128,
                                             vocab=4096, dropout=0.0), classes=2)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [a.pipeline_stage for a in model.get_pipeline_stage_assignment()]
    unchecked = tf_ipu.suggest_pipeline(model, ipus=2, batch_size=batch, check=False,
                                        tiles_per_ipu=tiles)
    model.set_pipeline_stage_assignment(list(unchecked))
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    est = tf_ipu.estimate(model, batch, training=True, ipu_version="ipu2", tiles_per_ipu=tiles)
    assert not est.fits and est.ipus[0]["peak_tile_bytes"] > 1.1 * est.tile_bytes_limit
    model.reset_pipeline_stage_assignment()
    checked = tf_ipu.suggest_pipeline(model, ipus=2, batch_size=batch, tiles_per_ipu=tiles)
    assert list(checked) != list(unchecked)
    assert sum(checked.stages) > sum(unchecked.stages)  # layers moved off the first IPU
    assert any("the tile model found IPU 0" in n for n in checked.notes), checked.notes
    assert any("checked by the tile model: every IPU fits" in n for n in checked.notes), checked.notes
    assert [a.pipeline_stage for a in model.get_pipeline_stage_assignment()] == before
    model.set_pipeline_stage_assignment(list(checked))
    assert tf_ipu.estimate(model, batch, training=True, ipu_version="ipu2",
                           tiles_per_ipu=tiles).fits


def test_offload_travels_to_the_server_and_leaves_results_unchanged(ipu_system):
    """Through IPUStrategy and the device server: the compile report of a pipelined fit with
    offload_weight_update_variables=True says the state was offloaded, and the weights match
    the same fit with it kept on chip (where the state lives never changes results)."""
    import keras
    from keras_util import attached_ipus

    import tf_ipu

    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    y = rng.normal(size=(32, 2)).astype(np.float32)
    weights, reports = [], []
    with attached_ipus(ipu_system, 2):
        for offload in (True, False):
            keras.utils.set_random_seed(1)
            strategy = tf_ipu.IPUStrategy()
            with strategy.scope():
                model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                          keras.layers.Dense(2)])
                model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                              steps_per_execution=4)
                model.set_pipeline_stage_assignment([0, 1])
                model.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                             offload_weight_update_variables=offload)
                model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
            weights.append(model.get_weights())
            reports.append([r for r in strategy.reports if "stages=2" in r.name][-1])
    on, off = (r.details for r in reports)
    assert [i["offloaded_bytes"] > 0 for i in on["ipus"]] == [True, True], on["ipus"]
    assert [i["offloaded_bytes"] for i in off["ipus"]] == [0, 0]
    assert any("in Streaming Memory (as asked)" in n for n in on["notes"]), on["notes"]
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)
