"""availableMemoryProportion per pipeline stage and pass (Graphcore's ``PipelineStageOptions``).

    set_pipelining_options(forward_propagation_stages_poplar_options=[...],    one per stage
                           backward_propagation_stages_poplar_options=[...],   one per stage
                           weight_update_poplar_options=...)                   one
      -> entries (phase, stage, kind, proportion)     CompileOptions.stage_memory_proportions
      -> StageProportions.of(instr)                   the proportion a dot / convolution of that
                                                      pass of that stage is planned with

Graphcore's TensorFlow (graphcore/tensorflow, ``tensorflow/compiler/plugin/poplar/driver/
passes/lower_frontend_attributes.cc``) copies a forward stage's ``PipelineStageOptions`` onto
every instruction of that stage's forward computation, and onto its recomputation ("Recomputation
stages use the forward stage options"), a backward stage's onto its backward computation, and
``weight_update_poplar_options`` onto the resource update. When it plans one matmul or
convolution (``tools/poplar_util.cc``, ``GetMatMulOptionsForInst`` /
``GetConvolutionOptionsForInst``) it starts from the global ``IPUConfig`` options and sets the
instruction's own over them, option by option: a stage's ``availableMemoryProportion`` replaces
the global one for that stage's pass, and a stage that sets none keeps the global one.

Here the pass of an instruction is ``pipeline.phases``' (forward, backward: a gradient op,
update: the weight update), its stage the IR's ``pipeline_stage`` attribute. A recomputed
forward is the forward's plan (the tile model plans an instruction once), as Graphcore gives it
the forward's options.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from device_server.emulator.tiles.irinfo import stage_of
from device_server.protocol import ir_pb2

__all__ = ["KINDS", "PHASES", "StageProportions", "Entry"]

#: The passes a stage's options are given for (Graphcore: forward, backward, weight update).
PHASES = ("forward", "backward", "update")
#: The products a proportion is given for, as the IR's opcodes.
KINDS = {"matmul": "dot", "dot": "dot", "convolution": "convolution"}

#: One proportion: (phase, stage, kind, proportion); the stage of "update" is not read.
Entry = tuple[str, int, str, float]


@dataclass(frozen=True)
class StageProportions:
    """The proportions given per (phase, stage, opcode); ``of`` answers for an instruction."""

    table: dict[tuple[str, int, str], float] = field(default_factory=dict)
    phase_of: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_entries(cls, entries: Iterable[Entry], stages: int,
                   phase_of: Mapping[str, str] | None = None) -> StageProportions:
        """Checked ``entries`` for a program of ``stages`` stages (``phase_of``: instruction
        name -> phase, ``pipeline.phases``). ValueError names a bad entry."""
        table: dict[tuple[str, int, str], float] = {}
        for entry in entries:
            phase, stage, kind, value = check_entry(entry, stages)
            table[(phase, 0 if phase == "update" else stage, KINDS[kind])] = value
        return cls(table, dict(phase_of or {}))

    def of(self, instr: ir_pb2.Instruction) -> float | None:
        """The proportion set for ``instr``'s pass of its stage (None: none set there)."""
        if not self.table:
            return None
        phase = self.phase_of.get(instr.name, "forward")
        stage = 0 if phase == "update" else stage_of(instr)
        return self.table.get((phase, stage, instr.opcode))

    def context(self, stages: int = 1) -> dict[str, list[float | None]]:
        """For a report: per "<phase> <kind>", the proportion of each of ``stages`` stages
        (None: the program's), and "update <kind>" as one value."""
        stages = max(stages, 1 + max((s for (_, s, _) in self.table), default=0))
        out: dict[str, list[float | None]] = {}
        for (phase, stage, opcode), value in sorted(self.table.items()):
            kind = "matmul" if opcode == "dot" else opcode
            row = out.setdefault(f"{phase} {kind}", [None] * (1 if phase == "update" else stages))
            row[stage] = value
        return out


def check_entry(entry: Entry, stages: int) -> Entry:
    """One entry checked (a stage of the program, a known phase and kind, a proportion in
    [0, 1], PopLibs' range: ``OptionHandler::createWithDouble(..., 0.)`` in
    graphcore/poplibs ``lib/poplin/MatMul.cpp``), else ValueError naming it."""
    try:
        phase, stage, kind, value = entry
    except (TypeError, ValueError):
        raise ValueError(f"a stage's availableMemoryProportion must be (phase, stage, kind, "
                         f"proportion). Received: {entry!r}") from None
    if phase not in PHASES:
        raise ValueError(f"stage availableMemoryProportion {entry!r}: the phase must be one of "
                         f"{', '.join(PHASES)}. Received: {phase!r}")
    if kind not in KINDS:
        raise ValueError(f"stage availableMemoryProportion {entry!r}: the kind must be 'matmul' "
                         f"or 'convolution'. Received: {kind!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < max(1, stages):
        raise ValueError(f"stage availableMemoryProportion {entry!r}: pipeline stage {stage!r} "
                         f"is not one of the program's {stages} stages (0 .. {stages - 1}).")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"stage availableMemoryProportion {entry!r}: the {phase} pass of "
                         f"pipeline stage {stage} has {kind} availableMemoryProportion "
                         f"{value!r}, not a number in [0, 1].")
    return str(phase), int(stage), str(kind), float(value)
