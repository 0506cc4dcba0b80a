"""Verdicts a user can act on (issue 24, point 2): a failure of the tile model is never a
silent "fits"; one 5% margin for the model's error between "fits" and "refused"; the largest
micro-batch that fits (``tf_ipu.max_batch_size``, ``--max-batch-size``).

Failures are injected by replacing ``products.plan_matmul`` (what plans every dot and
convolution); the margin's bands by giving the same program tiles of other capacities.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import xml.etree.ElementTree as ET

import emulator_util as eu
import numpy as np
import pytest

from device_server.emulator import CompileOptions, OutOfMemoryError, compile_module, get_target
from device_server.emulator.compiler import executable_from_record
from device_server.emulator.errors import TileModelError
from device_server.emulator.tiles import estimate_module, products
from device_server.emulator.tiles.report import MEMORY_MARGIN, Estimate, judge_memory

IPU2 = get_target("ipu2")


def _dense_module() -> eu.ir_pb2.Module:
    b = eu.IRBuilder("dense_step")
    x = b.parameter(np.float32, [8, 16])
    w = b.parameter(np.float32, [16, 4])
    b.root(b.op("dot", [x, w], np.float32, [8, 4], source_op="sequential/dense_3/MatMul",
                lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[0],
                lhs_batch_dimensions=[], rhs_batch_dimensions=[]))
    return b.module()


def _dot_name(module: eu.ir_pb2.Module) -> str:
    return next(i.name for c in module.computations for i in c.instructions if i.opcode == "dot")


@pytest.fixture
def broken_matmul(monkeypatch):
    """The tile model fails (ZeroDivisionError) on every dot and convolution."""
    def fail(*args, **kwargs):
        raise ZeroDivisionError("injected failure")

    monkeypatch.setattr(products, "plan_matmul", fail)


# ------------------------------------------------------------------------------ failures


def test_tile_model_failure_raises_naming_the_instruction(broken_matmul) -> None:
    module = _dense_module()
    with pytest.raises(TileModelError) as info:
        estimate_module(module, None, IPU2)
    e = info.value
    name = _dot_name(module)
    assert (e.program, e.instruction, e.opcode, e.layer) == ("dense_step", name, "dot", "dense_3")
    assert isinstance(e.__cause__, ZeroDivisionError)
    msg = str(e)
    assert f"instruction '{name}' (opcode dot)" in msg and "Keras layer 'dense_3'" in msg
    assert "ZeroDivisionError: injected failure" in msg


def test_compile_goes_on_with_the_fit_unknown_and_a_warning(broken_matmul, caplog) -> None:
    module = _dense_module()
    name = _dot_name(module)
    with caplog.at_level(logging.WARNING):
        exe = compile_module(module, IPU2)
    est = exe.estimate
    assert est.fits is None and not est.fit_known and not est.refused and not est.within_margin
    assert est.cycles == 0 and f"'{name}'" in est.failure and "dense_3" in est.failure
    assert any(est.failure in n for n in est.notes)
    warned = [r.getMessage() for r in caplog.records if r.name == "device_server.emulator.compiler"]
    assert len(warned) == 1 and "fit unknown" in warned[0] and f"'{name}'" in warned[0]
    x, w = np.arange(128, dtype=np.float32).reshape(8, 16), np.ones((16, 4), np.float32)
    np.testing.assert_array_equal(exe.run([x, w])[0], x @ w)  # the run is not stopped
    assert "fit unknown" in est.summary() and "0 cycles" not in est.summary()
    # Every consumer keeps "unknown": the disk cache's record, the reply, the client's report.
    again = Estimate.from_dict(json.loads(json.dumps(est.to_dict())))
    assert again.fits is None and again.failure == est.failure
    assert executable_from_record(module, IPU2, CompileOptions(), exe.cache_record()).estimate.fits is None
    from device_server.service import _estimate
    from tf_ipu.client import _unknown_fit
    from tf_ipu.runtime import CompileReport

    reply = _estimate(est)
    assert reply.fits is False and _unknown_fit(reply.json) is None
    report = CompileReport("p", "d", "ipu2", 1472, 0, 0.0, 0, est.tile_bytes_limit, 0, None, False,
                           0.0, json.loads(reply.json))
    assert "FIT UNKNOWN" in report.summary() and name in report.summary()
    assert "FIT UNKNOWN" in est._repr_html_()


def test_keras_estimate_raises_naming_the_layer(broken_matmul) -> None:
    import keras

    import tf_ipu

    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="hidden")], name="tiny")
    with pytest.raises(TileModelError, match=r"Keras layer 'hidden'") as info:
        tf_ipu.estimate(model, 4)
    assert info.value.opcode == "dot" and info.value.layer == "hidden"
    with pytest.raises(TileModelError):
        tf_ipu.estimate_sweep(model, [1, 2])
    with pytest.raises(TileModelError):
        tf_ipu.max_batch_size(model, table=False)


# ------------------------------------------------------------------------------ margin


def _add_module() -> eu.ir_pb2.Module:
    b = eu.IRBuilder("adder")
    n = 20_000
    b.root(b.op("add", [b.parameter(np.float32, [n]), b.parameter(np.float32, [n])], np.float32,
                [n], source_op="model/adder/add"))
    return b.module()


def test_three_bands_fits_within_the_margin_refused(caplog) -> None:
    module = _add_module()
    peak = estimate_module(module, None, IPU2).peak_tile_bytes
    x = np.arange(20_000, dtype=np.float32)

    def with_sram(limit: int) -> object:
        return dataclasses.replace(IPU2, sram_bytes_per_tile=limit)

    # fits: peak <= capacity, no warning
    with caplog.at_level(logging.WARNING):
        exe = compile_module(module, with_sram(peak))
    est = exe.estimate
    assert est.peak_tile_bytes == peak and est.fits is True and not est.within_margin
    assert est.margin_bytes == int(peak * MEMORY_MARGIN) and not caplog.records

    # within the margin: capacity < peak <= capacity x 1.05: compiles, runs, warns
    limit = math.ceil(peak / 1.03)
    with caplog.at_level(logging.WARNING):
        exe = compile_module(module, with_sram(limit))
    est = exe.estimate
    assert est.peak_tile_bytes == peak and est.fits is False and est.within_margin and not est.refused
    assert est.over_bytes == peak - limit > 0 and est.margin_bytes == int(limit * MEMORY_MARGIN)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"tile {est.peak_tile} holds {peak:,} B" in warned[0]
    assert f"{peak - limit:,} B over its {limit:,} B" in warned[0]
    assert warned[0] in est.notes and "within the 5% margin" in est.summary()
    np.testing.assert_array_equal(exe.run([x, x])[0], x + x)
    record = exe.cache_record()
    assert executable_from_record(module, with_sram(limit), CompileOptions(), record).estimate.within_margin

    # above the margin: refused as today
    limit = math.floor(peak / 1.10)
    with pytest.raises(OutOfMemoryError, match=rf"Out of memory on tile {est.peak_tile}: {peak} bytes "
                                               rf"used but tiles only have {limit} bytes.*beyond the "
                                               r"tile model's 5% margin"):
        compile_module(module, with_sram(limit))
    est = compile_module(module, with_sram(limit), CompileOptions(allow_out_of_memory=True)).estimate
    assert est.fits is False and not est.within_margin and est.refused
    # the edge: exactly the margin over is within it, a byte more is not
    for limit in range(int(peak / (1 + MEMORY_MARGIN)) - 3, int(peak / (1 + MEMORY_MARGIN)) + 4):
        est = estimate_module(module, None, with_sram(limit))
        assert est.within_margin == (peak <= limit + int(limit * MEMORY_MARGIN)), limit


def test_margin_warning_names_the_ipu_of_a_pipeline() -> None:
    est = Estimate(ipu_version="ipu2", tiles_per_ipu=1472, clock_hz=1.33e9, cycles=1, seconds=1e-9,
                   peak_tile_bytes=650_000, tile_bytes_limit=638_976, total_bytes=1, fits=True,
                   program="piped", target="GC200 (ipu2)", peak_tile=5, pipeline_stages=2, peak_ipu=1,
                   ipus=[{"ipu": 0, "ipu_id": 0, "stages": [0]}, {"ipu": 1, "ipu_id": 1, "stages": [1]}])
    judge_memory(est)
    assert est.fits is False and est.within_margin and est.margin_bytes == 31_948
    assert "tile 5 of IPU 1 (IPU id 1, pipeline stage 1) holds 650,000 B, 11,024 B over" in est.notes[-1]
    est.peak_tile_bytes = 638_976 + 31_949
    assert judge_memory(est).refused


# ------------------------------------------------------------------------------ max batch


def _fits(model, n: int, **kw) -> bool:
    import tf_ipu

    return bool(tf_ipu.estimate(model, n, tiles_per_ipu=4, **kw).fits)


def test_max_batch_size_agrees_with_the_estimates_either_side(tmp_path) -> None:
    import keras

    import tf_ipu

    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(10)], name="sized")
    m = tf_ipu.max_batch_size(model, tiles_per_ipu=4)
    n = m.batch_size
    assert 1 < n < m.limit == 4096 and not m.capped and 0 < m.plans <= m.estimates
    assert _fits(model, n) and not _fits(model, n + 1)
    sizes = [p["batch_size"] for p in m.probes]
    first_no = next(k for k, p in enumerate(m.probes) if not p["fits"])
    assert sizes[:first_no + 1] == [2 ** k for k in range(first_no + 1)]  # powers of two first
    assert len(m.table) == 12 and {c["available_memory_proportion"] for c in m.table} == \
        {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}
    for c in m.table:
        amp, b = c["available_memory_proportion"], c["batch_size"]
        kw = {"available_memory_proportion": amp, "recomputation": c["recomputation"]}
        assert _fits(model, b, **kw) and not _fits(model, b + 1, **kw), c
    assert m.cell(False, 0.1) > m.cell(False, 0.6)  # fewer temporaries leave room for more
    text = open(m.save_html(str(tmp_path / "m.html")), encoding="utf-8").read()
    ET.fromstring(text.split("\n", 1)[1])
    assert f"<b>{n:,}</b>" in text and "recomputation on" in text
    capped = tf_ipu.max_batch_size(model, tiles_per_ipu=4, limit=100, table=False)
    assert (capped.batch_size, capped.capped, capped.table) == (100, True, [])
    none = tf_ipu.max_batch_size(model, tiles_per_ipu=1, table=False)  # weights alone overflow
    assert none.batch_size == 0 and [p["batch_size"] for p in none.probes] == [1]
    with pytest.raises(ValueError, match="limit must be a positive int"):
        tf_ipu.max_batch_size(model, limit=0)


def test_max_batch_size_cli_prints_the_table(capsys, tmp_path) -> None:
    import importlib

    import tf_ipu

    cli = importlib.import_module("tf_ipu.estimate")
    html = tmp_path / "cli.html"
    assert cli.main(["--model", "mlp", "--max-batch-size", "--tiles-per-ipu", "8",
                     "--html", str(html)]) == 0
    out = capsys.readouterr().out
    found = re.search(r"largest inference micro-batch that fits on ipu2 \(.*\): (\d+);", out)
    assert found, out
    n = int(found.group(1))
    rows = re.findall(r"^\s+(0\.[1-6])\s+(\d+)\s+(\d+)$", out, re.M)
    assert [r[0] for r in rows] == ["0.1", "0.2", "0.3", "0.4", "0.5", "0.6"]
    model = cli.build_model("mlp")
    assert tf_ipu.estimate(model, n, tiles_per_ipu=8).fits
    assert not tf_ipu.estimate(model, n + 1, tiles_per_ipu=8).fits
    assert "Largest micro-batch" in html.read_text(encoding="utf-8")
