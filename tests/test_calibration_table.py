"""The calibration table (bench/calibration, issue 15) loads and follows its schema."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.calibration import table


@pytest.fixture(scope="module")
def measurements() -> list[table.Measurement]:
    return table.load_measurements()


@pytest.fixture(scope="module")
def sources() -> dict[str, table.Source]:
    return table.load_sources()


def test_table_loads(measurements):
    assert len(measurements) > 0
    assert all(isinstance(m, table.Measurement) for m in measurements)


def test_ids_unique(measurements):
    dup = [k for k, n in Counter(m.id for m in measurements).items() if n > 1]
    assert not dup


def test_every_row_source_exists(measurements, sources):
    table.check_table(measurements, sources)
    assert {m.source for m in measurements} <= set(sources)


def test_op_class_allowed(measurements):
    assert {m.op_class for m in measurements} <= table.OP_CLASSES


def test_excluded_rows_have_reason(measurements):
    for m in measurements:
        assert isinstance(m.excluded, str)
        if m.value is None:
            assert m.excluded.strip(), m.id
    # a reason, not a flag
    assert all(len(m.excluded.strip()) >= 10 for m in measurements if m.is_excluded)


def test_every_source_has_read_status(sources):
    for s in sources.values():
        assert s.read in {"full", "partial", "abstract"}, s.key
        assert s.read_where, s.key


def test_plot_values_carry_uncertainty(measurements):
    for m in measurements:
        if m.how == "plot" and "label" not in m.where.lower():
            assert m.uncertainty > 0, m.id


def test_validation_sources_never_in_op_level_folds(measurements, sources):
    validation = {k for k, s in sources.items() if s.role != "op_level"}
    for oc in table.OP_LEVEL_CLASSES:
        assert not set(table.loso_folds(measurements, oc)) & validation


def test_malformed_rows_rejected(tmp_path):
    good = dict(id="x", source="louw2021", chip="GC2", op_class="stream", params={},
                metric="gbytes_per_s", value=1.0, uncertainty=0.0, how="table", where="T1",
                excluded="", notes="")
    for bad in (dict(good, op_class="bogus"), dict(good, value=None), dict(good, chip="H100"),
                dict(good, how="plot", where="Fig. 1")):
        p = tmp_path / "m.jsonl"
        p.write_text(json.dumps(bad) + "\n")
        with pytest.raises(table.TableError):
            table.load_measurements(p)
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(table.TableError):
        table.load_measurements(p)
