"""Replays every fuzz seed (``tests/fuzz/corpus/<target>/``) and every crash reproducer
(``tests/fuzz/crashes/<target>/``) through its harness's ``TestOneInput``, without atheris
and without searching: each input must be refused the documented way or accepted, never
raise anything else. ``make fuzz`` searches; this only keeps what it found fixed.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

FUZZ_DIR = Path(__file__).resolve().parent / "fuzz"
#: target (the folder under corpus/ and crashes/) -> harness module in tests/fuzz/
TARGETS = {
    "compile": "fuzz_compile",
    "hlo": "fuzz_hlo",
    "onnx": "fuzz_onnx",
    "disk_cache": "fuzz_disk_cache",
    "framing": "fuzz_framing",
}


def _inputs() -> list[tuple[str, Path]]:
    found = []
    for kind in ("corpus", "crashes"):
        for target in TARGETS:
            folder = FUZZ_DIR / kind / target
            if folder.is_dir():
                found += [(target, p) for p in sorted(folder.iterdir())
                          if p.is_file() and not p.name.startswith(".")]
    return found


def _harness(target: str) -> ModuleType:
    if str(FUZZ_DIR) not in sys.path:
        sys.path.insert(0, str(FUZZ_DIR))
    return importlib.import_module(TARGETS[target])


def test_every_target_has_seeds() -> None:
    for target in TARGETS:
        folder = FUZZ_DIR / "corpus" / target
        assert folder.is_dir() and any(folder.iterdir()), f"no seed corpus for {target}"


@pytest.mark.parametrize(
    ("target", "path"), _inputs(),
    ids=[f"{p.parent.parent.name}/{t}/{p.name}" for t, p in _inputs()])
def test_replay(target: str, path: Path) -> None:
    _harness(target).TestOneInput(path.read_bytes())
