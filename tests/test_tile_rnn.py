"""PopLibs' RNN sequence layout and backward buffers (``device_server/emulator/tiles/rnn.py``),
checked against the figures PopLibs' formulas give by hand (graphcore/poplibs at 7eac0f26,
``lib/popnn/Rnn.cpp`` and ``Lstm.cpp``). No TensorFlow: about 1 s (the imports)."""

from __future__ import annotations

import numpy as np
import pytest

from device_server.emulator.tiles import rnn

_TILE = 638_976  # GC200


def _tutorial(steps: int) -> rnn.RnnLayer:
    """The recomputation tutorial's PopnnLSTM: batch 16, 512 features, 256 units, FP32."""
    return rnn.rnn_layer("lstm", steps, 16, 512, 256, 4, 1472, _TILE)


def _per_tile(mapping) -> np.ndarray:
    vec = np.zeros(mapping.total_tiles)
    mapping.add_to(vec, 1.0)
    return vec


def test_the_tutorials_sequences_sit_on_the_tiles_one_step_uses_in_two_shards() -> None:
    # One step: [16, 512] is 16 x 32 grains of 16 on 512 tiles, [16, 256] 256 tiles: 512 tiles
    # a shard, 1472 // 512 = 2 shards at most; ceil(2048 x 512 B / 63,897.6 B) = 17 wanted.
    layer = _tutorial(2048)
    assert (layer.tiles_per_shard, layer.shards) == (512, 2)
    out = _per_tile(rnn.sequence_mapping(layer, 256))
    held = np.nonzero(out)[0]
    # 256 tiles x 2 shards, tile (j + 1) x 5 - 1 - shard, each 1,024 steps x 16 floats.
    assert len(held) == 512 and set(out[held]) == {1024 * 16}
    assert {3, 4, 8, 9, 1278, 1279} <= set(held.tolist()) and 0 not in held
    inp = _per_tile(rnn.sequence_mapping(layer, 512))
    assert np.array_equal(np.nonzero(inp)[0], np.arange(1024)) and set(inp[:1024]) == {1024 * 16}
    # The layer's intermediates stacked (createOutputTensor with a multiple): on the same tiles.
    six = _per_tile(rnn.sequence_mapping(layer, 256, 6))
    assert np.array_equal(six, 6 * out)
    assert rnn.sequence_mapping(layer, 256).elements == 2048 * 16 * 256


def test_shorter_sequences_take_fewer_shards_or_hold_fewer_steps() -> None:
    # 256 steps (a slice between the tutorial's checkpoints): 3 wanted, 2 at most: 128 steps a tile.
    layer = _tutorial(256)
    assert layer.shards == 2
    assert _per_tile(rnn.sequence_mapping(layer, 256)).max() == 128 * 16
    # A small layer: 4 x [16] inputs and 4 x [32] outputs use 4 and 8 tiles; 32 steps of
    # 64 + 7 x 64 B fit 10% of a tile in one shard.
    small = rnn.rnn_layer("lstm", 32, 4, 16, 32, 4, 1472, _TILE)
    assert (small.tiles_per_shard, small.shards) == (8, 1)
    assert np.count_nonzero(_per_tile(rnn.sequence_mapping(small, 32))) == 8


def test_the_backward_holds_popnns_four_sequences_when_it_interleaves_the_weight_update() -> None:
    layer = _tutorial(2048)
    held = rnn.backward_sequences(layer, _TILE, input_gradient=True)
    assert [(size, n) for _, size, n in held] == [(256, 1), (512, 1), (512, 1), (256, 1)]
    # The program already makes the input's gradient: not counted twice.
    assert len(rnn.backward_sequences(layer, _TILE, input_gradient=False)) == 3
    # A layer too wide for one step of gate gradients in 10% of 0.2 of a tile, whose weights
    # are larger than its gate gradients: PopLibs keeps them for a weight update after it.
    # (16,384 units at batch 256: 179 grains of 16 floats a tile, 45,824 B of gate gradients a
    # step against 12,779 B; weights (2 x 16,384) x 16,384 x 4 against 256 x 16,384 x 4 x 4.)
    wide = rnn.rnn_layer("lstm", 4, 256, 16384, 16384, 4, 1472, _TILE)
    held = rnn.backward_sequences(wide, _TILE, input_gradient=True)
    assert held[-1][1:] == (16384, 4) and len(held) == 5


def test_the_scope_names_the_kernel() -> None:
    assert rnn.kind_of("m_1/tf_ipu_stage_0_1/popnn_lstm_1/tf_ipu_popnn_lstm/while") == "lstm"
    assert rnn.kind_of("gradient_tape/m/popnn_gru/tf_ipu_popnn_gru_reset_after_1/while/x") \
        == "gru_reset_after"
    assert rnn.kind_of("m/gru/tf_ipu_popnn_gru/while") == "gru"
    assert rnn.kind_of("m/lstm/while") == ""
    with pytest.raises(ValueError, match="unknown PopLibs RNN kind 'rnn'"):
        rnn.rnn_layer("rnn", 8, 1, 1, 1, 4, 1472, _TILE)
