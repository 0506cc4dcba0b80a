"""Grouped convolutions (``feature_group_count`` > 1) in the tile planner, against how PopLibs
plans them (graphcore/poplibs@7eac0f26, lib/poplin):

- FP32 vertex candidates (ConvVertexType.cpp): the AMP (convGroupsPerGroup 1, inChansPerGroup
  any multiple of 2 up to 8, partialChansPerGroup 8 or 16) and the HMAC (convGroupsPerGroup
  1, no channel padding); VMAC and SLIC are FP16 only, the OuterProduct takes one input
  channel, and groups are combined only with one input channel (ConvPlan.cpp
  ``getCombineConvGroupCandidates``). So ResNeXt's FP32 groups of 4 channels run one group
  per vertex, on the AMP with their 4 output channels padded to 8, or on the HMAC unpadded.
- poplin zero-pads each group's output channels to partialChansPerGroup
  (Convolution.cpp ``convolutionPreprocess``): an AMP plan's partial sums hold them.
"""

from __future__ import annotations

import math
import re

import emulator_util as eu
import numpy as np
import pytest

from device_server.emulator import get_target
from device_server.emulator.tiles import plan_module

GC200 = get_target("ipu2")


def _grouped_conv(batch: int, size: int, groups: int, c_in: int, c_out: int, window: int):
    """An FP32 NHWC 'SAME' convolution of ``groups`` groups of ``c_in`` -> ``c_out`` channels."""
    b = eu.IRBuilder("grouped_conv")
    x = b.parameter(np.float32, [batch, size, size, groups * c_in])
    # An activation laid out by the layer before (not an input laid out for this plan).
    x = b.op("negate", [x], np.float32, [batch, size, size, groups * c_in], source_op="model/neg")
    w = b.parameter(np.float32, [window, window, c_in, groups * c_out])
    pad = (window - 1) // 2
    b.root(b.op("convolution", [x, w], np.float32, [batch, size, size, groups * c_out],
                source_op="model/conv/Conv2D", input_batch_dimension=0, input_feature_dimension=3,
                input_spatial_dimensions=[1, 2], kernel_input_feature_dimension=2,
                kernel_output_feature_dimension=3, kernel_spatial_dimensions=[0, 1],
                output_batch_dimension=0, output_feature_dimension=3,
                output_spatial_dimensions=[1, 2], window_strides=[1, 1], padding_low=[pad, pad],
                padding_high=[pad, pad], window_dilation=[1, 1], lhs_dilation=[1, 1],
                feature_group_count=groups, batch_group_count=1))
    return b.module()


def _record(module, proportion: float):
    plan = plan_module(module, GC200, memory_proportions={"convolution": proportion})
    (rec,) = [r for r in plan.ops.values() if r.opcode == "convolution"]
    return rec


def _splits(rec) -> dict[str, int]:
    found = dict(re.findall(r"\b([GMNK])(\d+)\b", rec.plan.split(" on ")[0]))
    return {k: int(v) for k, v in found.items()}


def test_resnext_4_channel_groups_are_planned_unpadded_on_the_vector_unit() -> None:
    """ResNeXt-50 32x4d's conv2 grouped convolution (batch 20, 56 x 56, 32 groups of 4, 3 x 3),
    FP32: the AMP would pad its 4 output channels to 8 and compute 4 of 8 input channels per
    weight load, so it is not faster than the HMAC (PopLibs' vector MAC): the plan runs on the
    vector unit, one group per tile, and holds no more than the input rows (with the window's
    halo) and the weights of its group: no padding, no partials buffer. Its temporaries are
    far below 0.35 of a tile, so 0.35, 0.6 and 0.8 plan it alike."""
    module = _grouped_conv(20, 56, 32, 4, 4, 3)
    recs = {p: _record(module, p) for p in (0.35, 0.6, 0.8)}
    for p, rec in recs.items():
        assert "(vector)" in rec.plan, (p, rec.plan)
        s = _splits(rec)
        assert s["G"] == 32 and s["N"] == 1 and s["K"] == 1, rec.plan  # whole groups per tile
        rows = math.ceil(20 * 56 * 56 / s["M"])
        inputs = rows * 4 * 4                       # the tile's output rows' input, 4 channels
        halo = 2 * 2 * 56 * 4 * 4                   # two extra image rows above and below
        weights = 3 * 3 * 4 * 4 * 4
        assert inputs <= rec.temp_bytes_per_tile <= inputs + halo + weights, (p, rec.temp_bytes_per_tile)
        assert rec.temp_bytes_per_tile <= 0.35 * GC200.sram_bytes_per_tile
    assert len({(r.plan, r.temp_bytes_per_tile) for r in recs.values()}) == 1


@pytest.mark.parametrize("proportion", [0.35, 0.8])
def test_amp_partials_of_a_grouped_conv_hold_the_padded_output_channels(proportion: float) -> None:
    """8 groups of 512 -> 4 channels, 1 x 1, batch 1 at 56 x 56: the AMP with the input channels
    split over tiles, so each tile holds partial sums, of its 4 output channels padded to 8
    (partialChansPerGroup 8, the least any AMP candidate has): the temporaries are the tile's
    input rows plus the padded partials (twice what 4 channels would hold), and at most its
    weights and the reduction's received partials more."""
    rec = _record(_grouped_conv(1, 56, 8, 512, 4, 1), proportion)
    assert "(AMP)" in rec.plan and "serial" not in rec.plan, rec.plan
    s = _splits(rec)
    assert s["K"] > 1 and s["N"] == 1, rec.plan
    g, m, k = math.ceil(8 / s["G"]), math.ceil(56 * 56 / s["M"]), 512 / s["K"]
    inputs, weights = g * m * k * 4, g * k * 4 * 4  # the weights: at most, being laid out here
    padded_partials = g * m * 8 * 4
    assert rec.temp_bytes_per_tile >= inputs + padded_partials, (rec.temp_bytes_per_tile, rec.plan)
    assert rec.temp_bytes_per_tile <= inputs + weights + 2 * padded_partials, (rec.temp_bytes_per_tile, rec.plan)
