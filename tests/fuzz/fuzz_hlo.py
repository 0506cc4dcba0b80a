"""Fuzz target: the HLO-to-IR converter (``tf_ipu.lowering.hlo_to_ir.hlo_module_to_ir``).

    python tests/fuzz/fuzz_hlo.py -max_total_time=300 SCRATCH tests/fuzz/corpus/hlo

The input is a serialized XLA ``HloModuleProto`` (what ``experimental_get_compiler_ir(...)(
stage="hlo_serialized")`` gives). The converter imports TensorFlow's protos (so TensorFlow
is loaded, ~5 s); only ``tf_ipu.lowering`` is instrumented.

Expected: ``DecodeError`` (not an HloModuleProto) and ``HloConversionError`` (the converter's
documented refusal, naming the opcode, instruction and TF op). A finding: any other
exception (a ``KeyError``, ``StopIteration``, a numpy ``ValueError`` that names nothing the
user wrote, ...), a crash or a hang. The IR made must serialize.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import main  # noqa: E402

_mods: dict[str, Any] = {}


def load() -> None:
    """Imports the code under test (lazily: see _common)."""
    if _mods:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from google.protobuf.message import DecodeError

    from tf_ipu.lowering import hlo_to_ir

    _mods.update(DecodeError=DecodeError, hlo_to_ir=hlo_to_ir)


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' spelling)
    """Converts the HLO module in ``data``; raises on a finding."""
    load()
    m = _mods
    try:
        module = m["hlo_to_ir"].hlo_module_to_ir(data)
    except (m["DecodeError"], RecursionError, m["hlo_to_ir"].HloConversionError):
        return
    module.SerializeToString()


if __name__ == "__main__":
    main(TestOneInput, load, ["tf_ipu.lowering"])
