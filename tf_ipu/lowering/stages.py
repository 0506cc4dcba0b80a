"""The pipeline stage of every instruction of a pipelined program (IR attribute ``pipeline_stage``).

    TF op name "…/tf_ipu_stage_1/dense_2/MatMul"      (tf_ipu.pipelining's name scopes)
      └─ HLO metadata op_name ─> IR source_op ─> stage 1   (the innermost scope wins)
    gradients: "gradient_tape/…/tf_ipu_stage_1/…"    -> stage 1 (TF names them after the op)
    no scope (the loss, loop plumbing, constants): the stage of an operand that has one, else
      of a user that has one, else 0; a called computation's untagged instructions take the
      stage of the instruction that calls it.
    recomputation checkpoints (tf_ipu.pipelining.recomputation_checkpoint): the forward
      `reshape` in a "tf_ipu_recomputation_checkpoint" scope gets the flag
      ``recomputation_checkpoint`` when the pipeline's recomputation mode honours them.

The tile model reads the attribute to plan each stage on its IPU (docs/tile_model.md); the
emulator runs the program as any other (a pipeline computes what its micro-batches, run one
after the other with gradient accumulation, compute).
"""

from __future__ import annotations

import re

from device_server.protocol import ir_pb2

#: The IR attribute holding an instruction's stage (docs/ir.md).
STAGE_ATTR = "pipeline_stage"
#: The IR attribute (flag) of a recomputation checkpoint's instruction (docs/ir.md).
CHECKPOINT_ATTR = "recomputation_checkpoint"
# TF makes a name scope entered twice unique with a suffix: "tf_ipu_stage_0_1" is stage 0.
# An instruction XLA made of several TF ops has their names joined by ";"
# ("Exp;tf_ipu_stage_1/PartitionedCall/Exp"): a scope may start after one.
_SCOPE = re.compile(r"(?:^|[/;])tf_ipu_stage_(\d+)(?:_\d+)?(?=[/;]|$)")
_CHECKPOINT = re.compile(r"(?:^|[/;])tf_ipu_recomputation_checkpoint(?:_\d+)?/")
_GRADIENT = re.compile(r"(?:^|[/;])(?:gradient_tape|gradients)/")


def is_checkpoint(instr: ir_pb2.Instruction) -> bool:
    """Whether ``instr`` is the forward op of a recomputation checkpoint (its gradient, the
    same reshape under ``gradient_tape/``, is not)."""
    return (instr.opcode == "reshape" and bool(_CHECKPOINT.search(instr.source_op))
            and not _GRADIENT.search(instr.source_op))


def scoped_stage(source_op: str) -> int | None:
    """The stage named by the innermost stage scope of a TF op name, or None."""
    found = _SCOPE.findall(source_op)
    return int(found[-1]) if found else None


def assign_stages(module: ir_pb2.Module, stages: int, checkpoints: bool = False) -> list[int]:
    """Sets ``pipeline_stage`` on every instruction of ``module`` (and, with ``checkpoints``,
    ``recomputation_checkpoint`` on recomputation checkpoints); returns how many instructions
    each of the ``stages`` stages has. A scope naming a stage beyond ``stages - 1`` is a
    ValueError (the host's stage count is wrong)."""
    by_id = {c.id: c for c in module.computations}
    caller_stage: dict[int, int] = {}
    order = [module.entry_computation_id]
    seen = set(order)
    counts = [0] * stages
    k = 0
    while k < len(order):
        comp = by_id.get(order[k])
        k += 1
        if comp is None:
            continue
        default = caller_stage.get(comp.id)
        stage_of: dict[int, int | None] = {}
        for instr in comp.instructions:
            s = scoped_stage(instr.source_op)
            if s is not None and s >= stages:
                raise ValueError(f"instruction {instr.name} ({instr.source_op}) is in stage {s}, "
                                 f"but the program has {stages} stages.")
            if s is None:
                s = next((stage_of[o] for o in instr.operands if stage_of.get(o) is not None), None)
            stage_of[instr.id] = s
        users: dict[int, list[int]] = {}
        for instr in comp.instructions:
            for o in instr.operands:
                users.setdefault(o, []).append(instr.id)
        for instr in reversed(comp.instructions):
            if stage_of[instr.id] is None:
                found = [stage_of[u] for u in users.get(instr.id, ()) if stage_of.get(u) is not None]
                stage_of[instr.id] = min(found) if found else default
        for instr in comp.instructions:
            s = stage_of[instr.id]
            s = 0 if s is None else s
            instr.attrs[STAGE_ATTR].i = s
            if checkpoints and is_checkpoint(instr):
                instr.attrs[CHECKPOINT_ATTR].flag = True
            counts[s] += 1
            for called in instr.called_computations:
                caller_stage.setdefault(called, s)
                if called not in seen:
                    seen.add(called)
                    order.append(called)
    return counts


__all__ = ["CHECKPOINT_ATTR", "STAGE_ATTR", "assign_stages", "is_checkpoint", "scoped_stage"]
