"""Graphcore's whole ``IPUConfig`` tree (SDK 3): every option is accepted, checked, read back,
and either honoured here (shown) or named in one warning; plus ``select_ipus``, Graphcore's
``loops`` over infeed queues, and the Keras methods that warn once.

Reference for the option list: graphcore/tensorflow ``tensorflow/python/ipu/config.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

# Graphcore's option tree as SDK 3 defines it: path -> default (a group's options are listed
# with their full paths; the types follow from the defaults).
GRAPHCORE_OPTIONS = {
    "allow_recompute": False, "selection_order": "SelectionOrder.AUTO",
    "serialization_output_folder": "", "compilation_poplar_options": {},
    "gcl_poplar_options": {}, "auto_select_ipus": None, "select_ipus": [],
    "convolutions.poplar_options": {},
    "device_connection.type": "DeviceConnectionType.ALWAYS", "device_connection.version": "",
    "device_connection.enable_remote_buffers": False,
    "slices.poplar_options": {},
    "experimental.always_rearrange_copies_on_the_host": False,
    "experimental.enable_remote_buffer_embedding": False,
    "experimental.enable_prng_stability": False,
    "experimental.multi_replica_distribution.process_index": 0,
    "experimental.multi_replica_distribution.process_count": 0,
    "floating_point_behaviour.inv": False, "floating_point_behaviour.div0": False,
    "floating_point_behaviour.oflo": False,
    "floating_point_behaviour.esr": "StochasticRoundingBehaviour.OFF",
    "floating_point_behaviour.nanoo": False, "floating_point_behaviour.set_all": False,
    "io_tiles.num_io_tiles": 0, "io_tiles.place_ops_on_io_tiles": False,
    "io_tiles.available_memory_proportion": 0.9,
    "ipu_model.compile_ipu_code": True, "ipu_model.tiles_per_ipu": 0, "ipu_model.version": "ipu2",
    "matmuls.clear_pass_type": False, "matmuls.poplar_options": {},
    "norms.use_stable_statistics": False,
    "norms.experimental.distributed_batch_norm_replica_group_size": 1,
    "optimizations.math.fast": False, "optimizations.math.dot_strength": True,
    "optimizations.prefetch_data_streams": True, "optimizations.combine_embedding_lookups": False,
    "optimizations.combine_matmuls": False, "optimizations.enable_graph_outlining": True,
    "optimizations.merge_infeed_io_copies": False,
    "optimizations.maximum_cross_replica_sum_buffer_size": 0,
    "optimizations.maximum_reduce_scatter_buffer_size": 0,
    "optimizations.maximum_inter_ipu_copies_buffer_size": 0,
    "optimizations.maximum_send_recv_cluster_size": 0,
    "optimizations.maximum_reduce_many_buffer_size": 0,
    "optimizations.maximum_all_gather_buffer_size": 0,
    "optimizations.minimum_remote_tensor_size": 128,
    "optimizations.merge_remote_buffers": "MergeRemoteBuffersBehaviour.IF_BENEFICIAL",
    "optimizations.enable_gather_simplifier": True,
    "optimizations.triangular_solve_expander_block_size": 0,
    "optimizations.cholesky_block_size": 0, "optimizations.enable_fast_math": False,
    "pooling.poplar_options": {},
    "scheduling.algorithm": "SchedulingAlgorithm.CHOOSE_BEST",
    "scheduling.maximum_scheduler_lookahead_depth": 5,
    "scheduling.maximum_scheduler_search_space_size": 64,
}

HONOURED = {
    "auto_select_ipus", "select_ipus", "device_connection.type", "device_connection.version",
    "floating_point_behaviour.inv", "floating_point_behaviour.div0",
    "floating_point_behaviour.oflo", "floating_point_behaviour.esr",
    "floating_point_behaviour.nanoo", "floating_point_behaviour.set_all",
    "ipu_model.tiles_per_ipu", "ipu_model.version",
    "matmuls.poplar_options", "convolutions.poplar_options",  # partialsType, availableMemoryProportion
}


def _walk(cfg, path):
    *groups, leaf = path.split(".")
    for g in groups:
        cfg = getattr(cfg, g)
    return cfg, leaf


def _other_value(default):
    """A value of the same type as ``default`` that differs from it."""
    import tf_ipu.config as c

    if isinstance(default, str) and "." in default:  # an enum member, spelled
        enum_name, member = default.split(".")
        members = list(getattr(c, enum_name))
        return next(m for m in members if m.name != member)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return 0.5
    if isinstance(default, dict):
        return {"availableMemoryProportion": "0.3"}
    if isinstance(default, str):
        return "x"
    raise AssertionError(default)


def test_every_graphcore_option_is_accepted_read_back_and_honoured_or_warned_once(caplog):
    import tf_ipu.config as c
    from tf_ipu import notices

    notices._forget()
    cfg = c.IPUConfig()
    for path, default in GRAPHCORE_OPTIONS.items():
        group, leaf = _walk(cfg, path)
        if default is not None:
            got = getattr(group, leaf)
            assert (str(got) if isinstance(got, c.enum.Enum) else got) == default, (path, got)
        effect = group.effect(leaf)
        assert (effect is c.Effect.HONOURED) == (path in HONOURED), (path, effect)
        if path in HONOURED or default is None:
            continue
        value = _other_value(default)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tf_ipu"):
            setattr(group, leaf, value)
            setattr(group, leaf, value)  # the second time: no second warning
        assert getattr(group, leaf) == value, path
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and f"IPUConfig.{path} " in said[0], (path, said)
        assert ("no effect" in said[0]), said[0]
    assert len(notices.said()) == len(GRAPHCORE_OPTIONS) - len(HONOURED)


def test_bad_values_name_the_option_and_what_it_takes():
    import tf_ipu.config as c

    cfg = c.IPUConfig()
    with pytest.raises(TypeError, match=r"IPUConfig.scheduling.algorithm must be a "
                       r"SchedulingAlgorithm. Received: 'LOOK_AHEAD'"):
        cfg.scheduling.algorithm = "LOOK_AHEAD"
    with pytest.raises(TypeError, match=r"optimizations.combine_matmuls must be a bool"):
        cfg.optimizations.combine_matmuls = 1
    with pytest.raises(AttributeError, match=r"Did you mean IPUConfig.optimizations.combine_matmuls"):
        cfg.optimizations.combine_matmul = True
    with pytest.raises(ValueError, match=r"availableMemoryProportion'\] must be a number in"):
        cfg.matmuls.poplar_options = {"availableMemoryProportion": "most"}
    with pytest.raises(ValueError, match=r"partialsType'\] must be 'float' or 'half'"):
        cfg.convolutions.poplar_options = {"partialsType": "double"}
    with pytest.raises(ValueError, match=r"distributed_batch_norm_replica_group_size must be at least 1"):
        cfg.norms.experimental.distributed_batch_norm_replica_group_size = 0
    with pytest.raises(AttributeError, match="is a group"):
        cfg.optimizations.math = {}
    cfg.io_tiles.place_ops_on_io_tiles = True
    with pytest.raises(ValueError, match=r"place_ops_on_io_tiles needs IPUConfig.io_tiles.num_io_tiles > 0"):
        cfg.configure_ipu_system()
    cfg = c.IPUConfig()
    cfg.auto_select_ipus, cfg.select_ipus = 2, 1
    with pytest.raises(ValueError, match=r"only one of auto_select_ipus \(2\) and select_ipus"):
        cfg.configure_ipu_system()
    with pytest.raises(ValueError, match="one IPU index"):
        cfg.select_ipus = [1, 2]


def test_honoured_numerics_options_reach_the_compile():
    """Graphcore's spellings of options the emulator honours: poplar_options' partialsType,
    esr as a StochasticRoundingBehaviour, set_all."""
    import tf_ipu.config as c

    cfg = c.IPUConfig()
    assert cfg.compile_numerics()["matmul_partials_type"] == "float"
    cfg.matmuls.poplar_options = {"partialsType": "half"}
    cfg.convolutions.poplar_options = {"partialsType": "HALF", "availableMemoryProportion": 0.2}
    assert cfg.compile_numerics()["matmul_partials_type"] == "half"
    assert cfg.compile_numerics()["convolution_partials_type"] == "half"
    flags = cfg.compile_numerics()["floating_point_behaviour"]
    assert not any(flags.values())
    for esr, on in ((c.StochasticRoundingBehaviour.ON, True), (c.StochasticRoundingBehaviour.OFF, False),
                    (c.StochasticRoundingBehaviour.REPLICA_IDENTICAL_ONLY, True), (True, True)):
        cfg.floating_point_behaviour.esr = esr
        assert cfg.compile_numerics()["floating_point_behaviour"]["esr"] is on, esr
    cfg.floating_point_behaviour.esr = False
    cfg.floating_point_behaviour.set_all = True
    assert all(cfg.compile_numerics()["floating_point_behaviour"].values())


def test_select_ipus_attaches_that_ipu_and_says_when_it_is_taken(device_server):
    import tf_ipu
    from tf_ipu import errors
    from tf_ipu.client import DeviceClient

    with DeviceClient(device_server) as holder:
        holder.open_session()
        held = holder.attach(ipu_ids=[5])
        assert held.ipu_ids == [5]
        with DeviceClient(device_server) as other:
            other.open_session()
            with pytest.raises(errors.ResourceExhaustedError, match="IPU 5 .* is attached to "
                               "another session"):
                other.attach(ipu_ids=[5])
            with pytest.raises(errors.InvalidArgumentError, match="does not have"):
                other.attach(ipu_ids=[99])
            assert other.attach(ipu_ids=[6]).ipu_ids == [6]
    rt = tf_ipu.get_runtime()
    cfg = tf_ipu.IPUConfig()
    cfg.server_address = device_server
    cfg.select_ipus = 3
    try:
        cfg.configure_ipu_system()
        assert rt.client.attachment.ipu_ids == [3]
    finally:
        cfg.select_ipus = []
        cfg.configure_ipu_system()


def test_graphcore_loops_repeat_over_an_infeed_queue_the_closure_holds(ipu_system):
    """Graphcore's documented pattern: loops.repeat(n, body, inputs, infeed_queue) inside the
    device function, the queues reached through its closure, not passed to strategy.run:
    one device call takes n batches from the infeed; successive calls go on."""
    import tensorflow as tf
    from tensorflow.python import ipu
    from tensorflow.python.ipu import ipu_infeed_queue, ipu_outfeed_queue, loops

    data = np.arange(80, dtype=np.float32).reshape(20, 4)
    ds = tf.data.Dataset.from_tensor_slices((data, data[:, :1] * 2)).batch(2, drop_remainder=True)
    infeed = ipu_infeed_queue.IPUInfeedQueue(ds.repeat())
    sums = ipu_outfeed_queue.IPUOutfeedQueue()

    def body(total, x, y):
        sums.enqueue({"x": tf.reduce_sum(x)})
        return total + tf.reduce_sum(x) + tf.reduce_sum(y)

    def device_fn():
        return loops.repeat(5, body, [tf.constant(0.0)], infeed)

    strategy = ipu.ipu_strategy.IPUStrategy()
    batches = [data[i:i + 2] for i in range(0, 20, 2)]
    for call in range(2):
        with strategy.scope():
            total = strategy.run(device_fn)
        part = batches[5 * call:5 * call + 5]
        assert float(total) == pytest.approx(sum(b.sum() + 2 * b[:, 0].sum() for b in part))
        np.testing.assert_array_equal(sums.dequeue()["x"].numpy(), [b.sum() for b in part])

    counted = ipu_outfeed_queue.IPUOutfeedQueue()

    def no_carried():
        return loops.repeat(3, lambda x, y: counted.enqueue(y), infeed_queue=infeed)

    with strategy.scope():
        strategy.run(no_carried)
    assert counted.dequeue().shape == (3, 2, 1)
    with pytest.raises(TypeError, match="must match"):
        with strategy.scope():
            strategy.run(lambda: loops.repeat(2, lambda t, x, y: tf.cast(t, tf.int32),
                                              [tf.constant(0.0)], infeed))


def test_keras_queue_options_warn_once_naming_what_has_no_effect(ipu_system, caplog):
    import keras

    from tf_ipu import notices

    notices._forget()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with caplog.at_level(logging.WARNING, logger="tf_ipu"):
        for _ in range(2):
            model.set_outfeed_queue_options(buffer_depth=4)
            model.set_asynchronous_callbacks(True)
            model.set_infeed_queue_options(prefetch_depth=1, buffer_size=3)
        model.set_asynchronous_callbacks(False)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert any("set_outfeed_queue_options(buffer_depth=4) has no effect" in m for m in said)
    assert any("set_asynchronous_callbacks(True) has no effect" in m for m in said)
    assert any("set_infeed_queue_options(buffer_size=3) has no effect" in m for m in said)
    with pytest.raises(ValueError, match="must be a bool"):
        model.set_asynchronous_callbacks("yes")
