"""PopLibs' recurrent layers (``PopnnLSTM`` / ``PopnnGRU``): how their sequences sit on the tiles
and what their backward pass holds beside them.

Graphcore's TF ran these layers as PopLibs' fused kernels (graphcore/tensorflow at b2127bb,
``driver/ops/custom_ops/popnn/lstm.cc``: ``popnn::lstm::lstmFwd`` / ``lstmBwdWithWU``, the
input allocated by ``popnn::lstm::createInput``). Here they lower to a ``while`` loop whose
``source_op`` carries the layer's scope (``tf_ipu_popnn_lstm``, ``tf_ipu_popnn_gru``,
``tf_ipu_popnn_gru_reset_after``; ``tf_ipu/graphcore/addons/keras/layers/rnn.py``), and the tile
model lays out what that loop keeps per step as PopLibs lays out its sequences
(graphcore/poplibs at 7eac0f26):

- **Sequences** (``lib/popnn/Rnn.cpp``, ``createMultiDynamicSliceTensor``): one step of a
  ``[steps, batch, size]`` sequence is cut into grains of ``gcd(16, size)`` elements, ``batch x
  size / grain`` grains over the tiles one step of the layer's input or output uses (the larger:
  ``tilesPerShard``), each tile holding its grains for every step of its shard. The steps are cut
  into ``shards`` runs of ``ceil(steps / shards)``; shard ``s`` of tile ``j`` of a sequence that
  uses ``used`` tiles sits on tile ``(j + 1) x (tiles // used) - 1 - s``. So a sequence sits on
  ``used x shards`` tiles, not on the whole chip, and an input-sized and an output-sized
  sequence share some of them. (PopLibs also rotates every sequence of a layer by one seed, a
  hash of its sizes; not modelled: it moves which tiles, not what each holds.)
- **Shards** (``lib/popnn/Lstm.cpp`` and ``Gru.cpp``, ``getNumShards``; ``Rnn.cpp``,
  ``RnnParams::getMaxShards``): ``min(ceil(operand bytes / (0.1 x tile memory)), max shards)``,
  where the operand bytes are ``steps x (input + output x (1 + intermediates))`` bytes per tile of
  one step spread over the whole chip, and ``max shards = ceil(steps / ceil(steps / (tiles //
  tilesPerShard)))``. Intermediates per step (``getNumFwdIntermediatesToSave``, recomputation
  mode "none", full output sequence, as TF's ops set them): LSTM 6 (four gates, ``tanh(c)``, the
  previous cell state); GRU 3 (+1 with ``reset_after``).
- **The backward pass** (``lstmBwdImpl`` / ``gruBwdImpl``, ``lstmBwdWithWU``): besides the
  forward's intermediates, output and input, the kernel holds across its loop the output's
  gradient rearranged into the sequence layout (``gradLayerNextRearranged``), the input's
  gradient sequence (``calcInputGradients``, set in training: ``rnn_util.cc``), and for the
  weight update interleaved with it a copy of the input (``prevLayerOut``) and the output shifted
  by a step (``prevStepOut``). Interleaving is PopLibs' choice (``interleaveWUCadence``): when
  not even one step of the backward intermediates fits 10% of 0.2 of a tile, and interleaving
  saves nothing (``interleavedWUIsBeneficial``), the backward keeps its per-step gate gradients
  (4 for an LSTM, 3 for a GRU) for a weight-update pass after it, which copies the input and
  shifts the output then.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from device_server.emulator.tiles.mapping import TileMapping

__all__ = ["RnnLayer", "backward_sequences", "kind_of", "rnn_layer", "sequence_mapping"]

#: The layer's scope in a loop's ``source_op`` -> (kind, forward intermediates per step,
#: gate gradients per step).
_KINDS = {"lstm": (6, 4), "gru": (3, 3), "gru_reset_after": (4, 3)}
_SCOPE = re.compile(r"(?:^|/)tf_ipu_popnn_(lstm|gru_reset_after|gru)(?:_\d+)?/")

#: PopLibs' share of a tile an RNN's sequences may take before it shards them (getNumShards),
#: and the share and fraction ``interleaveWUCadence`` gives the backward intermediates.
_OPERAND_FRACTION = 0.1
_WU_PROPORTION = 0.2
_WU_FRACTION = 0.1


def kind_of(source_op: str) -> str:
    """The PopLibs layer a loop's ``source_op`` names (``"lstm"``, ``"gru"``,
    ``"gru_reset_after"``), ``""`` if none."""
    m = _SCOPE.search(source_op or "")
    return m.group(1) if m else ""


def _grains(size: int) -> tuple[int, int]:
    grain = math.gcd(16, size)
    return grain, size // grain


def _tiles_used(tiles: int, batch: int, size: int) -> int:
    grains = _grains(size)[1] * batch
    per_tile = -(-grains // tiles)
    return -(-grains // per_tile)


def _bytes_per_tile(tiles: int, batch: int, size: int, itemsize: int) -> int:
    grain, grains = _grains(size)
    return -(-(grains * batch) // tiles) * grain * itemsize


@dataclass(frozen=True)
class RnnLayer:
    """One PopLibs RNN layer's sequence layout (see module docstring)."""

    kind: str
    steps: int
    batch: int
    input_size: int
    output_size: int
    itemsize: int
    total_tiles: int
    tiles_per_shard: int
    shards: int


def rnn_layer(kind: str, steps: int, batch: int, input_size: int, output_size: int,
              itemsize: int, total_tiles: int, tile_bytes: int) -> RnnLayer:
    """The layout PopLibs gives the layer's sequences on a chip of ``total_tiles`` tiles of
    ``tile_bytes`` each (``getTilesPerShard``, ``getMaxShards``, ``getNumShards``)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown PopLibs RNN kind {kind!r} (one of {sorted(_KINDS)})")
    if min(steps, batch, input_size, output_size, itemsize, total_tiles) < 1:
        raise ValueError(f"an RNN layer needs positive sizes: steps={steps}, batch={batch}, "
                         f"input_size={input_size}, output_size={output_size}")
    per_shard = max(_tiles_used(total_tiles, batch, input_size),
                    _tiles_used(total_tiles, batch, output_size))
    steps_per_shard = -(-steps // max(1, total_tiles // per_shard))
    max_shards = -(-steps // steps_per_shard)
    intermediates = _KINDS[kind][0]
    one_step = (_bytes_per_tile(total_tiles, batch, input_size, itemsize)
                + _bytes_per_tile(total_tiles, batch, output_size, itemsize) * (1 + intermediates))
    wanted = math.ceil(one_step * steps / (tile_bytes * _OPERAND_FRACTION))
    return RnnLayer(kind, steps, batch, input_size, output_size, itemsize, total_tiles,
                    per_shard, max(1, min(wanted, max_shards)))


def sequence_mapping(layer: RnnLayer, size: int, multiple: int = 1) -> TileMapping:
    """The mapping of ``multiple`` ``[steps, batch, size]`` sequences of ``layer`` laid out
    together (``createMultiDynamicSliceTensor``; PopLibs stacks an LSTM's intermediates so),
    as an irregular mapping over the run of tiles it uses, sliceable by step."""
    grain, grains = _grains(size)
    grains *= layer.batch
    per_tile = -(-grains // layer.tiles_per_shard)
    used = -(-grains // per_tile)
    stride = layer.total_tiles // used
    on_last = grains - (used - 1) * per_tile
    steps_first = -(-layer.steps // layer.shards)
    counts = np.zeros(layer.total_tiles, np.int64)
    for shard in range(layer.shards):
        steps = steps_first if shard < layer.shards - 1 else layer.steps - steps_first * (layer.shards - 1)
        if steps <= 0:
            continue
        for j in range(used):
            tile = (j + 1) * stride - 1 - shard
            counts[tile] += steps * (per_tile if j < used - 1 else on_last) * grain * multiple
    held = np.nonzero(counts)[0]
    first, last = int(held[0]), int(held[-1])
    return TileMapping(first, last - first + 1, int(counts.sum()), layer.total_tiles,
                       counts[first:last + 1], slices=layer.steps)


def backward_sequences(layer: RnnLayer, tile_bytes: int,
                       input_gradient: bool) -> list[tuple[str, int, int]]:
    """What PopLibs' backward pass of ``layer`` holds across its loop beside the forward's
    sequences: ``(what, size, sequences)`` per buffer (see module docstring).
    ``input_gradient``: the program does not already make the input's gradient sequence."""
    bwd_per_step = _bytes_per_tile(layer.total_tiles, layer.batch, layer.output_size,
                                   layer.itemsize) * _KINDS[layer.kind][1]
    room = int(_WU_FRACTION * int(tile_bytes * _WU_PROPORTION))
    interleaved = min(layer.steps, room // max(1, bwd_per_step)) > 0
    if not interleaved:  # interleavedWUIsBeneficial: transposed weights vs gate gradients
        gates = _KINDS[layer.kind][1]
        weights = (layer.input_size + layer.output_size) * layer.output_size * gates
        interleaved = weights <= layer.batch * layer.output_size * gates * layer.steps
    out: list[tuple[str, int, int]] = [("output gradient, rearranged", layer.output_size, 1)]
    if input_gradient:
        out.append(("input gradient sequence", layer.input_size, 1))
    out.append(("input copy for the weight update", layer.input_size, 1))
    out.append(("output shifted by a step for the weight update", layer.output_size, 1))
    if not interleaved:
        out.append(("gate gradients per step for the weight update", layer.output_size,
                    _KINDS[layer.kind][1]))
    return out
