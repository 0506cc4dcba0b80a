"""Loader and validator for the calibration table (``measurements.jsonl``, ``sources.json``).

The table holds published measurements of IPU (and comparison GPU/CPU) performance, one JSON
object per line.  See ``README.md`` beside this file for the schema and the declared held-out
split.  Nothing here fits or changes the tile model: it only reads and checks the data.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MEASUREMENTS_PATH = HERE / "measurements.jsonl"
SOURCES_PATH = HERE / "sources.json"

OP_CLASSES: frozenset[str] = frozenset({
    "matmul", "conv", "elementwise", "reduction", "stream", "exchange", "sync",
    "host_link", "ipu_link", "collective", "e2e_inference", "e2e_training",
})
OP_LEVEL_CLASSES: frozenset[str] = OP_CLASSES - {"e2e_inference", "e2e_training"}
IPU_CHIPS: frozenset[str] = frozenset({"GC2", "GC200", "Bow"})
COMPARISON_CHIPS: frozenset[str] = frozenset({
    "V100", "T4", "A100", "H100-PCIe", "H100-NVLink", "GH200", "MI250", "Xeon-8168", "Xeon-lake",
})
CHIPS: frozenset[str] = IPU_CHIPS | COMPARISON_CHIPS
METRICS: frozenset[str] = frozenset({
    "tflops", "gbytes_per_s", "tbytes_per_s", "cycles", "ns", "seconds", "items_per_s",
    "latency_ms", "latency_p90_ms", "latency_p95_ms", "latency_p99_ms", "ratio", "fraction",
    "fraction_of_peak", "fraction_of_roofline", "relative_performance", "energy_wh",
})
HOW: frozenset[str] = frozenset({"table", "text", "plot"})
READ_STATUSES: frozenset[str] = frozenset({"full", "partial", "abstract"})
ROLES: frozenset[str] = frozenset({"op_level", "e2e_validation", "e2e_reference"})

_FIELDS = ("id", "source", "chip", "op_class", "params", "metric", "value", "uncertainty",
           "how", "where", "excluded", "notes")


class TableError(ValueError):
    """A row or a source does not follow the schema."""


@dataclass(frozen=True)
class Measurement:
    """One published point."""

    id: str
    source: str
    chip: str
    op_class: str
    params: Mapping[str, Any]
    metric: str
    value: float | None
    uncertainty: float
    how: str
    where: str
    excluded: str = ""
    notes: str = ""

    @property
    def is_excluded(self) -> bool:
        return bool(self.excluded)

    @property
    def is_ipu(self) -> bool:
        return self.chip in IPU_CHIPS

    @property
    def usable(self) -> bool:
        """Not excluded, measured on an IPU, with a value: a candidate for fitting or validation."""
        return not self.is_excluded and self.is_ipu and self.value is not None


@dataclass(frozen=True)
class Source:
    """One cited document and how much of it could be read here."""

    key: str
    citation: str
    url: str
    read: str
    read_where: list[str]
    taken: list[str]
    role: str
    not_available: list[str] = field(default_factory=list)
    notes: str = ""


def _check_row(raw: Mapping[str, Any], lineno: int) -> Measurement:
    missing = [f for f in _FIELDS if f not in raw]
    if missing:
        raise TableError(f"line {lineno}: missing fields {missing}")
    extra = set(raw) - set(_FIELDS)
    if extra:
        raise TableError(f"line {lineno}: unknown fields {sorted(extra)}")
    m = Measurement(**{f: raw[f] for f in _FIELDS})
    where = f"line {lineno} ({m.id!r})"
    if not isinstance(m.id, str) or not m.id:
        raise TableError(f"{where}: id must be a non-empty string")
    if m.op_class not in OP_CLASSES:
        raise TableError(f"{where}: op_class {m.op_class!r} not in {sorted(OP_CLASSES)}")
    if m.chip not in CHIPS:
        raise TableError(f"{where}: chip {m.chip!r} not in {sorted(CHIPS)}")
    if m.metric not in METRICS:
        raise TableError(f"{where}: metric {m.metric!r} not in {sorted(METRICS)}")
    if m.how not in HOW:
        raise TableError(f"{where}: how {m.how!r} not in {sorted(HOW)}")
    if not isinstance(m.params, dict):
        raise TableError(f"{where}: params must be an object")
    if not isinstance(m.excluded, str) or not isinstance(m.notes, str) or not isinstance(m.where, str):
        raise TableError(f"{where}: excluded, notes and where must be strings")
    if not m.where:
        raise TableError(f"{where}: 'where' (section/table/figure) is empty")
    if m.value is None:
        if not m.excluded:
            raise TableError(f"{where}: a row without a value must be excluded with a reason")
    elif not isinstance(m.value, (int, float)) or isinstance(m.value, bool):
        raise TableError(f"{where}: value must be a number or null")
    if not isinstance(m.uncertainty, (int, float)) or not 0 <= m.uncertainty < 1:
        raise TableError(f"{where}: uncertainty must be a relative number in [0, 1)")
    if m.how == "plot" and m.uncertainty == 0 and "label" not in m.where.lower():
        raise TableError(f"{where}: a value read off a plot needs an uncertainty (or a printed label)")
    return m


def load_measurements(path: Path | str = MEASUREMENTS_PATH) -> list[Measurement]:
    """Every row of the table, validated; raises :class:`TableError` on a malformed row."""
    out: list[Measurement] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise TableError(f"line {lineno}: {e}") from e
            out.append(_check_row(raw, lineno))
    dup = [k for k, n in Counter(m.id for m in out).items() if n > 1]
    if dup:
        raise TableError(f"duplicate ids: {dup}")
    return out


def load_sources(path: Path | str = SOURCES_PATH) -> dict[str, Source]:
    """The cited sources by key; raises :class:`TableError` on a malformed entry."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out: dict[str, Source] = {}
    for raw in data["sources"]:
        try:
            s = Source(**raw)
        except TypeError as e:
            raise TableError(f"source {raw.get('key')!r}: {e}") from e
        if s.key in out:
            raise TableError(f"duplicate source key {s.key!r}")
        if s.read not in READ_STATUSES:
            raise TableError(f"source {s.key!r}: read {s.read!r} not in {sorted(READ_STATUSES)}")
        if s.role not in ROLES:
            raise TableError(f"source {s.key!r}: role {s.role!r} not in {sorted(ROLES)}")
        if not s.read_where:
            raise TableError(f"source {s.key!r}: say where the text was read")
        out[s.key] = s
    return out


def check_table(measurements: Iterable[Measurement], sources: Mapping[str, Source]) -> None:
    """Cross-checks: every row's source exists."""
    unknown = sorted({m.source for m in measurements if m.source not in sources})
    if unknown:
        raise TableError(f"rows cite unknown sources: {unknown}")


def counts(measurements: Iterable[Measurement]) -> dict[str, Counter]:
    """Row counts by op_class, by source, and usable (IPU, not excluded) op-level rows by class."""
    ms = list(measurements)
    return {
        "op_class": Counter(m.op_class for m in ms),
        "source": Counter(m.source for m in ms),
        "usable_op_class": Counter(m.op_class for m in ms if m.usable),
        "usable_op_class_sources": Counter(
            f"{m.op_class}:{m.source}" for m in ms if m.usable),
    }


def loso_folds(measurements: Iterable[Measurement], op_class: str) -> dict[str, list[Measurement]]:
    """The declared held-out split: for one op class, the usable rows grouped by source.

    Leave-one-source-out holds out each group in turn; end-to-end rows are never returned here.
    """
    if op_class not in OP_LEVEL_CLASSES:
        raise ValueError(f"{op_class!r} is not an op-level class")
    folds: dict[str, list[Measurement]] = {}
    for m in measurements:
        if m.op_class == op_class and m.usable:
            folds.setdefault(m.source, []).append(m)
    return folds


if __name__ == "__main__":
    ms = load_measurements()
    srcs = load_sources()
    check_table(ms, srcs)
    for name, c in counts(ms).items():
        print(name, dict(sorted(c.items())))
