"""Reads an ONNX model and brings it to an opset the importer maps.

    path | bytes | ModelProto ──parse──> ModelProto ──check──> opset of ai.onnx
         opset < 7 ──onnx.version_converter──> opset 7      opset > latest ──> refused
         (external data: read from the file's folder)

A file that is not a model (malformed, truncated, empty) raises ``OnnxLoadError`` naming the
file and what is wrong; nothing reaches the device server.
"""

from __future__ import annotations

import os
from typing import Any

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from tf_ipu.onnx.errors import OnnxLoadError

#: The oldest opset the importer maps directly; older models go through the converter.
MIN_OPSET = 7
#: The newest opset the pinned onnx package knows.
MAX_OPSET = onnx.defs.onnx_opset_version()
ONNX_DOMAINS = ("", "ai.onnx")


def default_opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset (1 if it names none, as the spec says)."""
    for imp in model.opset_import:
        if imp.domain in ONNX_DOMAINS:
            return int(imp.version)
    return 1


def read_model(source: Any) -> tuple[onnx.ModelProto, str]:
    """The ModelProto of ``source`` (a path, bytes or a ModelProto) and a name for messages."""
    if isinstance(source, onnx.ModelProto):
        return source, source.graph.name or "model"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _parse(bytes(source), "the model bytes"), "model"
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise OnnxLoadError(f"Cannot read ONNX model {path!r}: {e.strerror or e}.") from None
        model = _parse(data, repr(path))
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
            try:
                onnx.external_data_helper.load_external_data_for_model(
                    model, os.path.dirname(os.path.abspath(path)))
            except (OSError, ValueError) as e:
                raise OnnxLoadError(f"ONNX model {path!r}: its external data cannot be read: {e}.") from None
        return model, os.path.splitext(os.path.basename(path))[0]
    raise TypeError(f"tf_ipu.onnx.load takes a path, bytes or an onnx.ModelProto, not {type(source).__name__}.")


def _parse(data: bytes, what: str) -> onnx.ModelProto:
    if not data:
        raise OnnxLoadError(f"ONNX model {what} is empty.")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise OnnxLoadError(f"ONNX model {what} is not a valid ModelProto (malformed or truncated: {e}).") from None
    if not model.HasField("graph") or not (len(model.graph.node) or len(model.graph.output)):
        raise OnnxLoadError(f"ONNX model {what} holds no graph (is it an ONNX file? a truncated one?).")
    return model


def prepare_model(model: onnx.ModelProto, what: str) -> onnx.ModelProto:
    """Checks ``model`` and converts an opset older than ``MIN_OPSET`` with onnx's version
    converter; an opset newer than ``MAX_OPSET`` is refused."""
    opset = default_opset(model)
    if opset > MAX_OPSET:
        raise OnnxLoadError(
            f"ONNX model {what} uses opset {opset} of ai.onnx; the newest this build maps is "
            f"{MAX_OPSET} (onnx {onnx.__version__}).")
    bad = _non_utf8_string(model)
    if bad:
        raise OnnxLoadError(f"ONNX model {what}: {bad} is not UTF-8 text (a malformed or "
                            f"corrupted file?).")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxLoadError(f"ONNX model {what} does not pass onnx's checker: {first}") from None
    except ValueError as e:  # onnx's C++ side parses the model again, more strictly
        raise OnnxLoadError(f"ONNX model {what} is not a valid ModelProto (onnx's checker "
                            f"cannot read it: {e}).") from None
    if opset < MIN_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, MIN_OPSET)
        except Exception as e:  # the converter raises plain RuntimeErrors  # noqa: BLE001
            raise OnnxLoadError(
                f"ONNX model {what} uses opset {opset}; converting it to opset {MIN_OPSET} "
                f"with onnx's version converter failed: {e}") from None
    return model


def _non_utf8_string(message: Any, path: str = "model") -> str:
    """The path of the first string field of ``message`` that is not UTF-8 ("" if none):
    ONNX's protos are proto2, whose parser lets such strings through (as bytes)."""
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING:
            items = value if field.is_repeated else [value]
            for i, v in enumerate(items):
                if isinstance(v, bytes):
                    index = f"[{i}]" if field.is_repeated else ""
                    return f"{path}.{field.name}{index}"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                continue  # ONNX has no map fields
            items = value if field.is_repeated else [value]
            for i, v in enumerate(items):
                index = f"[{i}]" if field.is_repeated else ""
                found = _non_utf8_string(v, f"{path}.{field.name}{index}")
                if found:
                    return found
    return ""
