"""``tf.summary`` and the IPU: summaries are written on the host, never from a device program.

TensorBoard works as with plain Keras wherever the summary is written on the host: Keras's
``TensorBoard`` callback (it writes the logs that the device returns, once per device call of
``steps_per_execution`` steps, and the weights' histograms at epoch ends), and ``tf.summary``
calls in callbacks or in the host-side Python around ``fit``. A ``tf.summary`` call inside a
step that runs on the IPU (a ``train_step``/``test_step``/``predict_step`` override, or a
layer's ``call``, traced while a default writer is set, e.g. by the ``TensorBoard`` callback)
would put a summary-writer op into the device program; XLA cannot compile those, and they
must not vanish from the program either. :func:`refuse_summaries` finds them in the traced
step and raises an error naming each call (its kind, its tag, the user's file and line) and
the host-side ways to write it.
"""

from __future__ import annotations

import os
from typing import Any

#: Ops that write to (or manage) a summary writer: a device program cannot hold them.
SUMMARY_OPS = frozenset({
    "WriteSummary", "WriteRawProtoSummary", "WriteScalarSummary", "WriteHistogramSummary",
    "WriteImageSummary", "WriteAudioSummary", "WriteGraphSummary", "ImportEvent",
    "FlushSummaryWriter", "CloseSummaryWriter", "CreateSummaryFileWriter",
    "CreateSummaryDbWriter",
})
#: TensorBoard plugin name (in the summary's metadata) -> the ``tf.summary`` function.
_PLUGIN_CALLS = {"scalars": "scalar", "histograms": "histogram", "images": "image",
                 "audio": "audio", "text": "text"}
#: TF1-style write ops (``tf.compat.v1.summary`` forwarded, ``tf.raw_ops``) -> the call.
_OP_CALLS = {"WriteScalarSummary": "tf.summary.scalar", "WriteHistogramSummary":
             "tf.summary.histogram", "WriteImageSummary": "tf.summary.image",
             "WriteAudioSummary": "tf.summary.audio", "WriteGraphSummary": "tf.summary.graph",
             "WriteRawProtoSummary": "tf.summary.experimental.write_raw_pb"}
_LIBRARY_DIRS: tuple[str, ...] = ()


def _library_dirs() -> tuple[str, ...]:
    """Folders of the packages between the user's call and the op (frames to skip)."""
    global _LIBRARY_DIRS
    if not _LIBRARY_DIRS:
        import importlib.util

        dirs = [os.path.dirname(os.path.abspath(__file__))]
        for name in ("tensorflow", "keras", "tensorboard", "tf_keras"):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations:
                dirs.extend(os.path.abspath(p) for p in spec.submodule_search_locations)
        _LIBRARY_DIRS = tuple(d + os.sep for d in dirs)
    return _LIBRARY_DIRS


def _user_frame(op: Any) -> str:
    """``file:line`` of the innermost frame of ``op``'s creation outside TensorFlow, Keras,
    TensorBoard and tf_ipu (the user's call), or "" if there is none."""
    try:
        frames = list(op.traceback)
    except Exception:  # noqa: BLE001 (an op without a creation stack)
        return ""
    skip = _library_dirs()
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(skip) and "<frozen" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return ""


def _constant(tensor: Any) -> Any:
    """The value of ``tensor`` if it is a constant (a tag, metadata), else None."""
    try:
        import tensorflow as tf

        return tf.get_static_value(tensor)
    except Exception:  # noqa: BLE001
        return None


def _describe(op: Any) -> str:
    """``tf.summary.scalar('loss')`` (and where it was called) for a summary op."""
    call = "tf.summary.write"
    tag = None
    if op.type == "WriteSummary" and len(op.inputs) >= 5:
        tag = _constant(op.inputs[3])
        metadata = _constant(op.inputs[4])
        if metadata is not None:
            try:
                from tensorboard.compat.proto import summary_pb2

                plugin = summary_pb2.SummaryMetadata.FromString(
                    bytes(metadata.item() if hasattr(metadata, "item") else metadata)
                ).plugin_data.plugin_name
                call = f"tf.summary.{_PLUGIN_CALLS.get(plugin, 'write')}"
            except Exception:  # noqa: BLE001 (unreadable metadata: the generic name)
                pass
    elif op.type in _OP_CALLS:
        call = _OP_CALLS[op.type]
        if op.type not in ("WriteGraphSummary", "WriteRawProtoSummary") and len(op.inputs) >= 3:
            tag = _constant(op.inputs[2])
    else:
        call = f"a summary writer op ({op.type})"
    if tag is not None:
        tag = tag.item() if hasattr(tag, "item") else tag
        tag = tag.decode() if isinstance(tag, bytes) else str(tag)
        call += f"({tag!r})"
    where = _user_frame(op)
    return call + (f" at {where}" if where else "")


def summary_calls(graph: Any) -> list[str]:
    """The summary ops of ``graph`` and of the functions it calls (conditionals, loops),
    each described as the ``tf.summary`` call that made it; in order, once each."""
    found: dict[str, None] = {}
    seen: set[int] = set()

    def walk(g: Any) -> None:
        if id(g) in seen:
            return
        seen.add(id(g))
        for op in g.get_operations():
            if op.type in SUMMARY_OPS:
                found.setdefault(_describe(op), None)
        for function in list(getattr(g, "_functions", {}).values()):
            sub = getattr(function, "graph", None)
            if sub is not None:
                walk(sub)

    walk(graph)
    return list(found)


def refuse_summaries(graph: Any, program: str) -> None:
    """Raises ``tf_ipu.errors.UnsupportedOpError`` naming every ``tf.summary`` call traced
    into ``graph``, the step of the IPU program ``program``; does nothing if there is none."""
    calls = summary_calls(graph)
    if not calls:
        return
    from tf_ipu import errors

    raise errors.UnsupportedOpError(
        f"{program}: {'; '.join(calls)}: a TensorBoard summary written inside the step, "
        f"which runs on the IPU; summaries are written on the host, not from a device program. "
        f"Return the value from the step (train_step's logs: Keras's TensorBoard callback "
        f"writes them as batch_<name>/epoch_<name>), or write it with tf.summary in a "
        f"keras.callbacks.Callback (on_train_batch_end, on_epoch_end), or send it to the "
        f"host through an IPUOutfeedQueue.",
        kind="summary-on-device",
    )


__all__ = ["SUMMARY_OPS", "refuse_summaries", "summary_calls"]
