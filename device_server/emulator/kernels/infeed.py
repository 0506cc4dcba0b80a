"""``custom-call`` targets ``tf_ipu_infeed`` and ``tf_ipu_outfeed``: the device pulls the next
batch of an infeed, or hands values to an outfeed, while it runs.

    host: PushInfeed(feed, batches) ──gRPC──> session's Infeed queue (device_server/data_path)
    device loop step k: custom-call tf_ipu_infeed ── waits for the queue ──> (present, *batch)

Graphcore's IPUs take their input this way: the program asks the host for the next batch of
a named infeed while it runs, so one device call can take as many batches as it runs steps and
the host prepares batches while the device computes. Result: a tuple ``(present: pred[],
values...)`` of the shapes the instruction declares; ``present`` is false (and the values
zeros) once the host has ended the feed, so the loop can stop there. Attribute
``backend_config`` (b): the feed's name, and ``|strict`` to make an ended feed an error
(a custom loop that calls ``next(iterator)``). Operands: any (e.g. the step index, to order the
pull within the loop). The run's source of batches comes with its stop token
(``emulator/cancel.py``): a wait for a batch ends when the run is asked to stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator import cancel
from device_server.emulator.errors import ExecutionError
from device_server.emulator.kernels import KernelContext, KernelFn, register_custom_call
from device_server.emulator.kernels.window import invalid
from device_server.protocol import INFEED_TARGET as TARGET
from device_server.protocol import OUTFEED_TARGET, dtypes


class InfeedEnded(ExecutionError):
    """A strict pull found the feed ended: the host's dataset has no more elements (the
    service answers OUT_OF_RANGE, as TF's iterators do)."""


@register_custom_call(TARGET)
def _infeed(ctx: KernelContext) -> KernelFn:
    feed, _, mode = _config(ctx).partition("|")
    strict = mode == "strict"
    if not feed:
        raise invalid(ctx, "tf_ipu_infeed needs the feed's name as backend_config.")
    shape = ctx.instr.shape
    if not shape.is_tuple or not shape.tuple_shapes:
        raise invalid(ctx, "tf_ipu_infeed returns a tuple (present, values...).")
    leaves = [(dtypes.to_numpy(s.dtype), tuple(int(d) for d in s.dims)) for s in shape.tuple_shapes]
    if leaves[0] != (np.dtype(np.bool_), ()):
        raise invalid(ctx, "tf_ipu_infeed's first result must be pred[] (whether a batch came).")
    specs = leaves[1:]
    absent = (np.asarray(False), *(np.zeros(s, d) for d, s in specs))
    where = f"{ctx.instr.name} (infeed {feed!r})"

    def run(ops: Sequence[Any]) -> Any:
        token = cancel.current()
        source = None if token is None else token.infeed
        if source is None:
            raise ExecutionError(f"{where}: this run has no infeed (the host did not open one).")
        batch = source(feed, token, where)
        if batch is None:
            if strict:
                raise InfeedEnded(
                    f"{where}: the infeed ended: the host's dataset has no more elements "
                    f"(a loop asked for more batches than it holds).")
            return absent
        if len(batch) != len(specs):
            raise ExecutionError(
                f"{where}: the host sent a batch of {len(batch)} tensors, the program takes "
                f"{len(specs)}.")
        for k, (a, (dt, s)) in enumerate(zip(batch, specs, strict=True)):
            if a.dtype != dt or tuple(a.shape) != s:
                raise ExecutionError(
                    f"{where}: value {k} of the batch is {a.dtype}{list(a.shape)}, the program "
                    f"takes {dt}{list(s)}.")
        return (np.asarray(True), *batch)

    return run


def _config(ctx: KernelContext) -> str:
    raw = ctx.attr("backend_config", b"")
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


@register_custom_call(OUTFEED_TARGET)
def _outfeed(ctx: KernelContext) -> KernelFn:
    """``tf_ipu_outfeed``: hands its operands (copies) to the session's outfeed named by
    ``backend_config``, which the host dequeues after the call; result ``pred[]`` (true)."""
    feed = _config(ctx)
    if not feed:
        raise invalid(ctx, "tf_ipu_outfeed needs the feed's name as backend_config.")
    where = f"{ctx.instr.name} (outfeed {feed!r})"
    done = np.asarray(True)

    def run(ops: Sequence[Any]) -> Any:
        token = cancel.current()
        sink = None if token is None else token.outfeed
        if sink is None:
            raise ExecutionError(f"{where}: this run has no outfeed (the host did not open one).")
        sink(feed, [np.array(a, copy=True) for a in ops])
        return done

    return run
