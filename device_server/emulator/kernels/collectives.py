"""``custom-call`` targets ``tf_ipu_all_reduce`` and ``tf_ipu_replica_id``: the collectives of
a replicated program.

    replica r: g = tf_ipu_all_reduce(g0, g1, ...)   backend_config "sum" | "mean" | "max" |
                                                    "min" | "prod"
               ──> emulator/replicas.py ReplicaGroup.all_reduce: every replica's operands
                   reduced in replica order; each replica gets the same values
    replica r: i = tf_ipu_replica_id()              s32[]: r (its index in the whole run:
                                                    first replica of its server + r)

Graphcore's replicated graphs sum gradients across replicas with a cross-replica sum (GCL's
all-reduce); this is its emulation. Outside a replicated run (one replica) the all-reduce
returns its operands and the replica id is 0. Result of the all-reduce: the operand's shape
for one operand, a tuple of the operands' shapes for several (the tile model charges it over
the system's IPU-Links, docs/tile_model.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator import replicas
from device_server.emulator.kernels import KernelContext, KernelFn, register_custom_call
from device_server.emulator.kernels.window import invalid
from device_server.protocol import ALL_REDUCE_TARGET, REPLICA_ID_TARGET, dtypes


def _config(ctx: KernelContext) -> str:
    raw = ctx.attr("backend_config", b"")
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


@register_custom_call(ALL_REDUCE_TARGET)
def _all_reduce(ctx: KernelContext) -> KernelFn:
    op = _config(ctx).strip() or "sum"
    if op not in replicas.REDUCTIONS:
        raise invalid(ctx, f"tf_ipu_all_reduce reduces with one of {list(replicas.REDUCTIONS)} "
                           f"(its backend_config), not {op!r}.")
    shape = ctx.instr.shape
    n = len(ctx.operand_shapes)
    if n == 0:
        raise invalid(ctx, "tf_ipu_all_reduce needs at least one operand.")
    declared = ([(dtypes.to_numpy(s.dtype), tuple(int(d) for d in s.dims)) for s in shape.tuple_shapes]
                if shape.is_tuple else [(ctx.out_dtype, tuple(ctx.out_shape))])
    given = list(zip(ctx.operand_dtypes, (tuple(s) for s in ctx.operand_shapes), strict=True))
    if declared != given:
        raise invalid(ctx, "tf_ipu_all_reduce's result must have its operands' shapes "
                           f"(operands {given}, result {declared}).")
    tuple_result = shape.is_tuple
    for dt, _ in given:
        if op != "sum" and op != "prod" and dt == np.bool_:
            raise invalid(ctx, f"tf_ipu_all_reduce {op!r} of pred operands is not defined.")
    where = f"{ctx.instr.name} (all-reduce {op})"

    def run(ops: Sequence[Any]) -> Any:
        here = replicas.current()
        if here is None:
            values = [np.array(a, copy=True) for a in ops]
        else:
            group, replica = here
            values = group.all_reduce(replica, op, [np.asarray(a) for a in ops], where)
        return tuple(values) if tuple_result else values[0]

    return run


@register_custom_call(REPLICA_ID_TARGET)
def _replica_id(ctx: KernelContext) -> KernelFn:
    if ctx.instr.shape.is_tuple or ctx.out_shape != () or ctx.out_dtype not in (
            np.dtype(np.int32), np.dtype(np.uint32)):
        raise invalid(ctx, "tf_ipu_replica_id returns s32[] or u32[].")
    dt = ctx.out_dtype

    def run(ops: Sequence[Any]) -> Any:
        here = replicas.current()
        return np.asarray(0 if here is None else here[0].first_replica + here[1], dtype=dt)

    return run
