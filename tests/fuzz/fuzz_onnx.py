"""Fuzz target: the ONNX importer (``tf_ipu.onnx``: loader, shapes, importer, folding).

    python tests/fuzz/fuzz_onnx.py -max_total_time=300 SCRATCH tests/fuzz/corpus/onnx

The input is a serialized ``onnx.ModelProto``, taken as ``tf_ipu.onnx.load(model_bytes,
batch_size=2)`` takes it up to the IR module (no device server): ``read_model``,
``prepare_model`` (onnx's checker, the version converter for opsets < 7), ``fix_inputs``,
``import_model``. The importer imports no TensorFlow; ``tf_ipu.onnx`` is instrumented.

Expected: ``OnnxError`` (``OnnxLoadError``, ``UnsupportedOnnxError``; each names the file,
the node or the input). A finding: any other exception, a crash or a hang. The IR made must
serialize.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import main  # noqa: E402

BATCH = 2
_mods: dict[str, Any] = {}


def load() -> None:
    """Imports the code under test (lazily: see _common)."""
    if _mods:
        return
    from tf_ipu.onnx import errors, importer, loader, shapes

    _mods.update(errors=errors, importer=importer, loader=loader, shapes=shapes)


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' spelling)
    """Imports the ONNX model in ``data``; raises on a finding."""
    load()
    m = _mods
    try:
        proto, name = m["loader"].read_model(data)
        proto = m["loader"].prepare_model(proto, repr(name))
        specs = m["shapes"].fix_inputs(proto.graph, BATCH, None)
        program = m["importer"].import_model(proto, specs, name=name)
    except m["errors"].OnnxError:
        return
    program.module.SerializeToString()


if __name__ == "__main__":
    main(TestOneInput, load, ["tf_ipu.onnx"])
