"""What the fuzz harnesses (``tests/fuzz/fuzz_*.py``) share: the finding exception, frame
splitting, and the atheris entry point.

A harness module has ``TestOneInput(data: bytes) -> None`` that feeds ``data`` to its target
in-process. Refusals the target documents (its invalid-input errors, a ``ServiceError`` whose
status is not INTERNAL) return normally; anything else propagates: an unexpected exception,
or a :class:`Finding` (an error the server would answer with INTERNAL). Harnesses import
their targets lazily (in ``load()``) so that ``python tests/fuzz/fuzz_x.py`` can instrument
them with atheris before they are imported, and so that ``tests/test_fuzz_replay.py`` can
replay the corpora without atheris.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
ROOT = FUZZ_DIR.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class Finding(AssertionError):
    """The target failed in a way the server would report as INTERNAL (or not at all)."""


def frames(data: bytes, limit: int = 64) -> list[bytes]:
    """Splits ``data`` into at most ``limit`` frames, each a little-endian 16-bit length and
    that many bytes; a short last frame takes what is left."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data) and len(out) < limit:
        if pos + 2 > len(data):
            out.append(data[pos:])
            break
        n = int.from_bytes(data[pos:pos + 2], "little")
        out.append(data[pos + 2:pos + 2 + n])
        pos += 2 + n
    return out


def join_frames(parts: Sequence[bytes]) -> bytes:
    """The inverse of :func:`frames` (for the corpus generator)."""
    out = bytearray()
    for p in parts:
        if len(p) > 0xFFFF:
            raise ValueError(f"a frame holds at most 65535 bytes, not {len(p)}")
        out += len(p).to_bytes(2, "little") + p
    return bytes(out)


def main(test_one_input: Callable[[bytes], None], load: Callable[[], None],
         include: Sequence[str]) -> None:
    """Fuzzes ``test_one_input`` with atheris (libFuzzer flags in ``sys.argv``), the
    modules named by ``include`` (package prefixes) instrumented for coverage."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import logging

    logging.disable(logging.CRITICAL)  # refusals log warnings; keep the fuzzer's output
    import atheris

    with atheris.instrument_imports(include=list(include)):
        load()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
