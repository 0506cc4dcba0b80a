"""The ``variable_mapping`` option: variables mapped with ``poputil::mapTensorLinearly`` and the
copy poplin makes of one a matmul wants in another layout (tiles/mapping.py, tiles/matmul.py)."""

from __future__ import annotations

import dataclasses

import emulator_util as eu
import numpy as np
import pytest

from device_server.emulator import CompileOptions, compile_module, get_target
from device_server.emulator.tiles import estimate_module
from device_server.emulator.tiles.mapping import poputil_linear, variable_mappings
from device_server.emulator.tiles.matmul import (
    LinearOperand,
    MatmulProblem,
    linear_operand,
    plan_matmul,
    plan_rearranged,
)

IPU2 = get_target("ipu2")


def _counts(m) -> list[int]:
    return [m.elements_on(t) for t in range(m.total_tiles)]


# ------------------------------------------------------------------ poputil's linear mapping
# Hand computations of lib/poputil/TileMapping.cpp calcLinearTileMapping + lib/poputil/Util.cpp
# splitRegionsAux: grain = 8 bytes / itemsize elements, min = ceil(128 / itemsize) elements;
# grains G = ceil(n / grain); per tile ceil(G / tiles), raised to ceil(G / max(1, G // mingrains));
# V = ceil(G / per tile) tiles; tile v holds grains floor(vG/V) .. floor((v+1)G/V).


def test_linear_mapping_of_the_tutorials_m1() -> None:
    # FP32 [9000, 7500] on 1472 tiles: grain 2, G = 33,750,000; per tile ceil(G/1472) = 22,928
    # (min 16 grains: no change); V = ceil(G / 22,928) = 1472. 22,928 x 1472 - G = 16, so 16
    # tiles hold 22,927 grains (45,854 elements) and 1456 hold 22,928 (45,856: 183,424 B).
    m = poputil_linear(9000 * 7500, 4, 1472)
    counts = np.array(_counts(m))
    assert m.linear and m.first == 0 and m.tiles == 1472
    assert sorted(set(counts.tolist())) == [45_854, 45_856]
    assert int((counts == 45_854).sum()) == 16 and int((counts == 45_856).sum()) == 1456
    assert m.max_elements * 4 == 183_424 and int(counts.sum()) == 9000 * 7500
    vec = np.zeros(1472)
    m.add_to(vec, 4)
    assert vec.max() == 183_424 and vec.sum() == 9000 * 7500 * 4


def test_linear_mapping_keeps_poputils_128_bytes_a_tile() -> None:
    # FP32 [1000]: G = 500; ceil(500/1472) = 1 grain, but min 32 elements = 16 grains:
    # max(1, 500 // 16) = 31 tiles at most, ceil(500/31) = 17 grains a tile, V = ceil(500/17) = 30.
    # floor(v * 500 / 30) steps by 16 or 17: 20 tiles of 17 grains (136 B), 10 of 16 (128 B).
    m = poputil_linear(1000, 4, 1472)
    counts = [c for c in _counts(m) if c]
    assert m.tiles == 30 and len(counts) == 30 and _counts(m)[30:] == [0] * (1472 - 30)
    assert sorted(set(counts)) == [32, 34] and counts.count(34) == 20 and counts.count(32) == 10
    assert min(counts) * 4 >= 128
    # The grains are in order: tile v's first element is floor(v * 500 / 30) * 2.
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    assert starts.tolist() == [(v * 500 // 30) * 2 for v in range(30)]


@pytest.mark.parametrize("n,itemsize,tiles,expected", [
    (10, 2, 1472, [10]),          # FP16: grain 4, G = 3 < 16 min grains: one tile
    (7, 4, 4, [7]),               # G = 4 (the last grain short), min 16 grains: one tile
    (2943, 4, 1472, [32] * 91 + [31]),  # G = 1472, per tile 16 (min): V = 92, 1471 grains of 2 + 1 short
])
def test_linear_mapping_small_tensors(n: int, itemsize: int, tiles: int, expected: list[int]) -> None:
    assert [c for c in _counts(poputil_linear(n, itemsize, tiles)) if c] == expected


def test_linear_mapping_refuses_a_bad_size() -> None:
    with pytest.raises(ValueError, match=r"elements=0"):
        poputil_linear(0, 4, 1472)


# ------------------------------------------------------------------ the option


def _dot_module(m: int, k: int, n: int) -> eu.ir_pb2.Module:
    b = eu.IRBuilder("linear_dot")
    x = b.parameter(np.float32, [m, k])
    w = b.parameter(np.float32, [k, n])
    b.root(b.op("dot", [x, w], np.float32, [m, n], source_op="dense/MatMul",
                lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0],
                lhs_batch_dimensions=[], rhs_batch_dimensions=[]))
    return b.module()


_KINDS = {0: "argument", 1: "variable"}


def test_only_variables_are_mapped_linearly() -> None:
    module = _dot_module(64, 4096, 4096)
    maps = variable_mappings(module, 8, 128, 1472, _KINDS)
    assert list(maps) == ["parameter.2"] and maps["parameter.2"].linear
    assert variable_mappings(module, 8, 128, 1472, _KINDS, "consumer") == {}


def test_a_linear_weight_is_rearranged_into_the_matmuls_layout() -> None:
    """x [64, 4096] . w [4096, 4096] FP32, w a variable. The rhs's contraction (rows) is not
    its innermost dimension, so poplin's detected grouping is 1 and an AMP plan rearranges
    it: the peak grows by w's share of the plan's tiles (the copy) over the default layout,
    where w is created in the plan's layout. Tolerance 0.5% of the copy: the two layouts of w
    itself differ by at most a grain a tile."""
    module = _dot_module(64, 4096, 4096)
    consumer = estimate_module(module, None, IPU2, param_kinds=_KINDS)
    linear = estimate_module(module, None, IPU2, param_kinds=_KINDS, variable_mapping="linear")
    w_bytes = 4096 * 4096 * 4
    plan = plan_matmul(MatmulProblem(1, 64, 4096, 4096, 1, 64 * 4096 * 4, w_bytes, 0.0, 4, 4, True,
                                     b_local=True), IPU2)
    copy = w_bytes / plan.tiles
    assert copy > 40_000
    grown = linear.peak_tile_bytes - consumer.peak_tile_bytes
    assert grown == pytest.approx(copy, rel=0.005), (grown, copy)
    assert linear.context.get("variable_mapping", "").startswith("linear")
    assert "variable_mapping" not in consumer.context
    # The copy is filled by an exchange: the linear program takes more cycles.
    assert linear.cycles > consumer.cycles


def test_the_default_is_the_consumer_layout() -> None:
    module = _dot_module(64, 4096, 4096)
    a = estimate_module(module, None, IPU2, param_kinds=_KINDS)
    b = estimate_module(module, None, IPU2, param_kinds=_KINDS, variable_mapping="consumer")
    assert (a.peak_tile_bytes, a.cycles, a.peak_tile) == (b.peak_tile_bytes, b.cycles, b.peak_tile)


def test_elementwise_use_of_a_linear_variable_needs_no_copy() -> None:
    """v + v on a linear FP32 [1024, 1024] variable: no rearrangement, the result as large
    as the variable: the fullest tile holds the variable's share and the result's (an even
    spread over the 1472 tiles), within 4 KB of code, vertex state and exchange code."""
    b = eu.IRBuilder("linear_add")
    v = b.parameter(np.float32, [1024, 1024])
    b.root(b.op("add", [v, v], np.float32, [1024, 1024], source_op="add"))
    est = estimate_module(b.module(), None, IPU2, param_kinds={0: "variable"},
                          variable_mapping="linear")
    held = poputil_linear(1024 * 1024, 4, 1472).max_elements * 4 + -(-1024 * 1024 // 1472) * 4
    assert held <= est.peak_tile_bytes <= held + 4096
    kinds = {c["kind"] for c in est.to_dict()["contributors"]}
    assert "temporaries" not in kinds


def test_a_linear_input_read_by_few_tiles_is_not_copied() -> None:
    """poplin rearranges an input only when the plan broadcasts it to more than 7 tiles or its
    channel grouping is 1: m1 [9000, 7500] (contraction innermost, a whole row on tile 0:
    grouping 7500) under a plan with no N split is read from its linear layout."""
    m1 = poputil_linear(9000 * 7500, 4, 1472)
    problem = MatmulProblem(1, 9000, 300, 7500, 1, 9000 * 7500 * 4, 7500 * 300 * 4, 0.0, 4, 4, True)
    op = LinearOperand(m1, 4, 7500)
    plan, copy = plan_rearranged(problem, IPU2, None, [op, None])
    assert plan.pn <= 7 and not copy.a and copy.bytes_per_tile == 0
    assert plan == plan_matmul(problem, IPU2)  # planned with m1 not local
    # Broadcast to more than 7 tiles (x [64, 512] . w [512, 16384]: the plan splits N 265
    # ways): copied, x's bytes over the plan's tiles on each of them.
    wide = dataclasses.replace(problem, m=64, k=512, n=16384, a_bytes=64 * 512 * 4, b_bytes=512 * 16384 * 4)
    x = LinearOperand(poputil_linear(64 * 512, 4, 1472), 4, 512)
    plan, copy = plan_rearranged(wide, IPU2, None, [x, None])
    assert plan.pn > 7 and copy.a and not copy.b
    assert copy.bytes_per_tile == pytest.approx(64 * 512 * 4 / plan.tiles)
    assert plan == plan_matmul(dataclasses.replace(wide, a_local=True), IPU2)  # x in the plan's layout


def test_detected_grouping_follows_the_contraction() -> None:
    b = eu.IRBuilder("g")
    x = b.parameter(np.float32, [9000, 7500])
    w = b.parameter(np.float32, [7500, 300])
    dot = b.op("dot", [x, w], np.float32, [9000, 300], lhs_contracting_dimensions=[1],
               rhs_contracting_dimensions=[0], lhs_batch_dimensions=[], rhs_batch_dimensions=[])
    b.root(dot)
    instr = next(i for i in b.module().computations[0].instructions if i.opcode == "dot")
    lhs = linear_operand(poputil_linear(9000 * 7500, 4, 1472), 4, instr, 0, [9000, 7500])
    rhs = linear_operand(poputil_linear(7500 * 300, 4, 1472), 4, instr, 1, [7500, 300])
    assert lhs is not None and lhs.grouping == 7500  # gcd(7500 on tile 0, 7500)
    assert rhs is not None and rhs.grouping == 1     # rows contracted: not contiguous
    # A row split over tiles: [2, 7500] has G = 7500 grains; min 16 grains a tile gives at
    # most 7500 // 16 = 468 tiles, ceil(7500 / 468) = 17 grains a tile, 442 tiles holding 16
    # or 17 grains: the largest piece of the first row is 34 elements, gcd(34, 7500) = 2.
    small = linear_operand(poputil_linear(2 * 7500, 4, 1472), 4, instr, 0, [2, 7500])
    assert small is not None and small.mapping.tiles == 442 and small.grouping == 2
    assert linear_operand(None, 4, instr, 0, [9000, 7500]) is None


# ------------------------------------------------------------------ bad values


def test_a_bad_value_names_the_option_and_the_value() -> None:
    module = _dot_module(8, 16, 4)
    with pytest.raises(ValueError, match=r"variable_mapping must be .*'Linear'"):
        estimate_module(module, None, IPU2, variable_mapping="Linear")
    with pytest.raises(ValueError, match=r"CompileOptions\.variable_mapping must be .*'rows'"):
        compile_module(module, IPU2, CompileOptions(variable_mapping="rows"))


def test_compile_options_carry_the_linear_mapping() -> None:
    module = _dot_module(8, 16, 4)
    exe = compile_module(module, IPU2, CompileOptions(variable_mapping="linear"))
    assert exe.estimate.context.get("variable_mapping", "").startswith("linear")


def test_tf_ipu_estimate_refuses_a_bad_value() -> None:
    keras = pytest.importorskip("keras")
    import tf_ipu

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"tf_ipu\.estimate: variable_mapping must be .*'rowwise'"):
        tf_ipu.estimate(model, 2, variable_mapping="rowwise")
