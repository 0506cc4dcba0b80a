"""Compile options: what a caller may ask of :func:`compiler.compile_module`.

    CompileOptions --_checked_options--> a checked copy --+--> numerics(target)      (numerics.py)
    (frozen dataclass)                                    +--> memory_proportions()  (tiles/)
                                                          +--> stage_memory_proportions (tiles/)
                                                          +--> partials_types()      (tiles/)

Numerics, fault injection, out-of-memory policy, replication and pipelining are all switched
here; the estimate-only ones change the tile model's figures, never what the program computes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from device_server.emulator import numerics
from device_server.emulator.arch import Target
from device_server.emulator.tiles.mapping import check_variable_mapping
from device_server.emulator.tiles.proportions import check_entry

__all__ = ["CompileOptions"]


@dataclass(frozen=True)
class CompileOptions:
    """Options of :func:`compile_module`.

    ``refuse_opcodes``: opcodes to treat as unsupported (raises :class:`UnsupportedOpError`
    at compile time, as a real backend lacking them would).
    ``fault_inject_opcode``: a *test switch*: every result of this opcode is perturbed at
    run time (floats ``x * (1 + 1e-2) + 1e-3``, integers ``x + 1``, booleans negated), so
    tests can prove a comparison would catch a wrong kernel. Never set it in production.
    ``allow_out_of_memory``: compile even if the estimate does not fit the tile memory
    (Poplar's ``allowOutOfMemory``), so the estimate can be inspected.

    Numerics (``numerics.py``; all off by default):
    ``partials_type``: ``"float"`` (FP16 dot/convolution accumulate in FP32, the default) or
    ``"half"`` (an FP16 accumulator, rounded after every ``Target.amp_fp16_partials_chunk``
    products); ``matmul_partials_type`` / ``convolution_partials_type`` override it for
    ``dot`` / ``convolution`` ("" = ``partials_type``).
    ``esr``: stochastic rounding of FP32 -> FP16; ``stochastic_rounding_seed``: its seed
    (0: derived from the module).
    ``inv``, ``div0``, ``oflo``: floating-point exception checks after every floating-point
    instruction (:class:`FloatingPointExceptionError`); ``nanoo``: an FP16 overflow gives NaN.

    Planning (the estimate only): ``matmul_available_memory_proportion`` /
    ``convolution_available_memory_proportion``: PopLibs' availableMemoryProportion of the
    ``dot`` / ``convolution`` plans, 0 .. 1 (None: the preset's, 0.6); lower plans hold fewer
    temporaries per tile and cost as many cycles or more (``tiles/matmul.py``).
    ``stage_memory_proportions``: (phase, stage, kind, proportion) entries, a pipeline's
    ``PipelineStageOptions``: the proportion of the "matmul" / "convolution" products of one
    pass ("forward", "backward", "update") of one stage, in place of the two above there
    (``tiles/proportions.py``).
    ``variable_mapping``: how the variables are laid out: "consumer" (the default: as their
    first consumer wants them, as Graphcore's TensorFlow does) or "linear" (each mapped with
    ``poputil::mapTensorLinearly``, as a Poplar program may; a matmul or convolution that
    broadcasts one to more than 7 tiles then holds a rearranged copy, ``tiles/matmul.py``).

    Replication (``emulator/replicas.py``): ``replicas``: how many replicas run the program
    at once (1: not replicated); ``system``: the ``protocol.hardware.System`` whose IPUs run
    them (None: the target's IPUs without links), ``ipu_ids``: which of its IPUs, one per
    replica (empty: the first ``replicas``). The estimate charges the collectives over the
    system's IPU-Links and the host transfers over its shared host links.

    Pipelining (docs/tile_model.md): ``pipeline_stages`` S (1: not pipelined), the stage of
    each instruction in its ``pipeline_stage`` attribute; ``stage_ipus``: the IPU within a
    replica of each stage (Graphcore's device_mapping; empty: stage i on IPU i);
    ``ipus_per_replica``: the IPUs a replica spans; ``pipeline_schedule``: "grouped",
    "interleaved" or "sequential"; ``micro_batches``: the micro-batches of one weight
    update (gradient accumulation); ``recomputation``: the backward pass recomputes the
    forward activations. They change the estimate only: the program computes the same.
    """

    refuse_opcodes: frozenset[str] = frozenset()
    fault_inject_opcode: str = ""
    allow_out_of_memory: bool = False
    partials_type: str = "float"
    matmul_partials_type: str = ""
    convolution_partials_type: str = ""
    esr: bool = False
    stochastic_rounding_seed: int = 0
    inv: bool = False
    div0: bool = False
    oflo: bool = False
    nanoo: bool = False
    matmul_available_memory_proportion: float | None = None
    convolution_available_memory_proportion: float | None = None
    replicas: int = 1
    instances: int = 1  # servers whose replicas run it as one program (emulator/world.py)
    system: Any = None
    ipu_ids: tuple[int, ...] = ()
    pipeline_stages: int = 1
    stage_ipus: tuple[int, ...] = ()
    ipus_per_replica: int = 1
    pipeline_schedule: str = "grouped"
    micro_batches: int = 1
    recomputation: bool = False
    optimizer_state_offload: str = "auto"    # "auto" | "on" | "off" (pipeline.placement)
    optimizer_state_sharding: bool = False
    stage_memory_proportions: tuple[tuple[str, int, str, float], ...] = ()
    variable_mapping: str = "consumer"     # "consumer" | "linear" (tiles/mapping.py)

    def memory_proportions(self) -> dict[str, float]:
        """Opcode -> availableMemoryProportion of the options that set one (checked)."""
        out = {}
        for opcode, name in (("dot", "matmul_available_memory_proportion"),
                             ("convolution", "convolution_available_memory_proportion")):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"CompileOptions.{name} must be a number in [0, 1] (PopLibs' "
                                 f"availableMemoryProportion), not {value!r}.")
            out[opcode] = float(value)
        return out

    def partials_types(self) -> dict[str, str]:
        """Opcode -> the partialsType its products are planned with ("float" or "half")."""
        return {"dot": self.matmul_partials_type or self.partials_type,
                "convolution": self.convolution_partials_type or self.partials_type}

    def numerics(self, target: Target) -> numerics.Numerics:
        """The numerics these options ask for on ``target``."""
        kinds = {}
        for name, value in (("partials_type", self.partials_type),
                            ("matmul_partials_type", self.matmul_partials_type or self.partials_type),
                            ("convolution_partials_type", self.convolution_partials_type or self.partials_type)):
            if value not in ("float", "half"):
                raise ValueError(f"CompileOptions.{name} must be 'float' or 'half', not {value!r}.")
            kinds[name] = value
        return numerics.Numerics(
            matmul_partials=kinds["matmul_partials_type"],
            conv_partials=kinds["convolution_partials_type"],
            partials_chunk=target.amp_fp16_partials_chunk,
            esr=bool(self.esr), inv=bool(self.inv), div0=bool(self.div0), oflo=bool(self.oflo),
            nanoo=bool(self.nanoo), seed=int(self.stochastic_rounding_seed),
        )


def _checked_options(options: CompileOptions) -> CompileOptions:
    if not isinstance(options, CompileOptions):
        raise TypeError(f"options must be CompileOptions, got {type(options).__name__}.")
    options.memory_proportions()  # ValueError: a proportion outside [0, 1]
    check_variable_mapping(options.variable_mapping, "CompileOptions.variable_mapping")
    for entry in options.stage_memory_proportions:  # ValueError naming the stage
        check_entry(entry, options.pipeline_stages)
    return dataclasses.replace(options, refuse_opcodes=frozenset(options.refuse_opcodes))
