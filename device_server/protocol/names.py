"""Naming the user's code: the Keras layer a TensorFlow op name belongs to.

    "sequential/dense_1/MatMul"                       -> "dense_1"
    "gradient_tape/sequential/conv2d/Conv2DBackpropFilter" -> "conv2d (backward)"
    "tf_ipu_device_loop/functional_1/dense_1/MatMul"  -> "dense" (a step of the device loop)
    "sequential_1/tf_ipu_stage_1/dense_2_1/MatMul"    -> "dense_2" (a pipeline stage's scope)

Shared by the emulator's errors and reports (device_server) and the host's lowering errors
(tf_ipu), so that both sides name a layer the same way.
"""

from __future__ import annotations

import re

from device_server.protocol import DEVICE_LOOP_NAME

__all__ = ["layer_of"]

# Leading op-name scopes that say "this is the backward pass of what follows".
_BACKWARD_SCOPES = ("gradient_tape",)
# Scopes that are not layers (optimizers, loss and metric bookkeeping, TF internals).
_NON_LAYER_SCOPES = {
    "XLA_Args", "XLA_Retvals", "while", "cond", "StatefulPartitionedCall",
    "PartitionedCall",
}


_UNIQUIFIED = re.compile(r"^(.+)_\d+$")
# Leading scopes of control flow around the model's ops (the device loop's ``while``).
_CONTROL_SCOPES = re.compile(rf"^(while|cond|body|{DEVICE_LOOP_NAME})(_\d+)?$")
# The scope tf_ipu.pipelining puts around a pipeline stage's layer calls (not a layer).
_STAGE_SCOPE = re.compile(r"^tf_ipu_stage_\d+(_\d+)?$")


def layer_of(source_op: str) -> str:
    """Best-effort Keras layer name of a TF op name, ``""`` when there is none.

    ``sequential/dense_1/MatMul`` -> ``dense_1``;
    ``gradient_tape/sequential/conv2d/Conv2DBackpropFilter`` -> ``conv2d (backward)``.
    The first scope is taken to be the model and the second the layer, as Keras names ops
    ``<model>/<layer>/<op>``; names with fewer scopes have no layer.

    Measured on Keras 3.15 / TF 2.21: inside a traced ``tf.function`` Keras enters each scope
    twice, so TF uniquifies every component once (layer ``dense`` of model ``sequential``
    gives ``sequential_1/dense_1/MatMul``; layer ``dense_1`` gives ``dense_1_1``). When the
    model scope carries such a ``_<n>`` suffix, one suffix is removed from the layer scope.
    """
    parts = [p for p in source_op.split("/") if p and not _STAGE_SCOPE.match(p)]
    while len(parts) > 1 and _CONTROL_SCOPES.match(parts[0]):
        parts = parts[1:]  # ``while/sequential/dense/MatMul``: a step in the device loop
    backward = bool(parts) and parts[0] in _BACKWARD_SCOPES
    if backward:
        parts = parts[1:]
        while len(parts) > 1 and _CONTROL_SCOPES.match(parts[0]):
            parts = parts[1:]  # ``gradient_tape/tf_ipu_device_loop/model/layer/op``
    if len(parts) < 3 or parts[0] in _NON_LAYER_SCOPES or parts[1] in _NON_LAYER_SCOPES:
        return ""
    layer = parts[1]
    if _UNIQUIFIED.match(parts[0]):
        m = _UNIQUIFIED.match(layer)
        if m:
            layer = m.group(1)
    return f"{layer} (backward)" if backward else layer
