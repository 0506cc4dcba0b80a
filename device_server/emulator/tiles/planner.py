"""The tile planner: every IR instruction gets a tile mapping for its output and a plan.

    IR module --plan_module--> ModulePlan (plan.py)
      per computation (CompPlan): program points (one per live instruction) with the buffers
      born there, the temporaries live only there and the called computations' peaks;
      supersteps (Step: compute / sync / exchange cycles of the slowest tile, repeated in loops)

    _Planner = the opcode planners (mixins of state.PlannerState), one concern each:
      elementwise.py   element-wise ops and their fusion, generators, generic tuple ops
      movement.py      constants, views, broadcasts, the exchange of operands, data movement
      products.py      dot and convolution (the search over splits: matmul.py)
      reductions.py    reduce, reduce-window, select-and-scatter, batch norm
      problems.py      sort; cholesky, triangular-solve, fft, topk, linear-algebra custom calls
      control.py       while (trip counts: loops.py), call, conditional
      collectives.py   tf_ipu_all_reduce and the replicas' syncs (the ring: replication.py)
    this module: the walk over computations (program points in order, fusion's consumer
    counts, entry parameters) and the dispatch of each instruction to its planner.

Entry parameters are *variables* (resident on the device), *arguments* (streamed from the host
each call) or *constants*; the lowering says which in ``source_type``, else a parameter whose
new value is an output (an alias) is a variable and any other an argument. A dynamic dimension
is planned at its bound (what Poplar allocates).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from device_server.emulator import calibration, cancel
from device_server.emulator.arch import Target
from device_server.emulator.tiles.collectives import CollectivePlanning
from device_server.emulator.tiles.control import ControlPlanning
from device_server.emulator.tiles.elementwise import ElementwisePlanning
from device_server.emulator.tiles.irinfo import (
    BATCH_NORM_OPS,
    ELEMENTWISE_OPS,
    MOVE_OPS,
    PROBLEM_CUSTOM_CALLS,
    PROBLEM_OPS,
    RNG_OPS,
    TINY_OPS,
    VIEW_OPS,
    attr_int,
    attr_str,
    layer_name,
    leaf_shapes,
    shape_elems,
    shape_itemsize,
)
from device_server.emulator.tiles.mapping import TileMapping
from device_server.emulator.tiles.movement import MovementPlanning
from device_server.emulator.tiles.plan import (
    Bcast,
    Buf,
    CompPlan,
    ModulePlan,
    OpRecord,
    Point,
    Step,
    Value,
    value_leaves,
)
from device_server.emulator.tiles.problems import ProblemPlanning
from device_server.emulator.tiles.products import ProductPlanning
from device_server.emulator.tiles.proportions import Entry, StageProportions
from device_server.emulator.tiles.reductions import ReductionPlanning
from device_server.emulator.tiles.replication import Replication
from device_server.emulator.tiles.state import LiveFn
from device_server.protocol import HOST_TARGETS, REPLICA_ID_TARGET, REPLICA_TARGETS, ir_pb2

__all__ = ["Buf", "CompPlan", "LiveFn", "ModulePlan", "OpRecord", "Step", "layer_name",
           "live_instructions", "plan_module"]


class _Planner(ElementwisePlanning, MovementPlanning, ProductPlanning, ReductionPlanning,
               ProblemPlanning, ControlPlanning, CollectivePlanning):
    """Walks the computations and sends every instruction to its opcode planner."""

    # -- computations -------------------------------------------------------------------
    def plan_entry(self) -> tuple[CompPlan, list[Buf]]:
        comp = self.comps[self.module.entry_computation_id]
        ctx = CompPlan(comp, None)
        params: dict[int, Buf] = {}
        self._plan_body(ctx, params=None, entry_params=params)
        return ctx, [params[n] for n in sorted(params)]

    def plan_comp(self, comp_id: int, args: list[Value], caller: ir_pb2.Instruction) -> CompPlan:
        comp = self.comps[comp_id]
        ctx = CompPlan(comp, caller)
        self._plan_body(ctx, params=args, entry_params=None)
        self.enter_stage(caller)
        return ctx

    def _consumers(self, live: list[ir_pb2.Instruction], root_id: int) -> dict[int, int]:
        """Consumers of each value, looking through views (for fusion)."""
        users: dict[int, list[int]] = {}
        by_id = {}
        for i in live:
            by_id[i.id] = i
            for o in set(i.operands):
                users.setdefault(o, []).append(i.id)
        eff: dict[int, int] = {}
        for i in reversed(live):
            n = 1 if i.id == root_id else 0
            for u in users.get(i.id, ()):
                n += eff.get(u, 1) if by_id[u].opcode in VIEW_OPS else 1
            eff[i.id] = n
        return eff

    def _plan_body(self, ctx: CompPlan, params: list[Value] | None,
                   entry_params: dict[int, Buf] | None) -> None:
        comp = ctx.comp
        live = self.live(comp)
        self.eff = self._consumers(live, comp.root_id)
        eff = self.eff
        values: dict[int, Value] = {}
        for k, instr in enumerate(live):
            cancel.checkpoint("planning the tile mapping")  # a Compile's client may cancel it
            ctx.points.append(Point(instr))
            self.enter_stage(instr)
            op = instr.opcode
            if op == "parameter":
                n = instr.parameter_number
                if entry_params is not None:
                    values[instr.id] = entry_params[n] = self._entry_param(instr)
                else:
                    values[instr.id] = params[n] if params is not None and n < len(params) else \
                        self.out_value(ctx, instr, k)
                continue
            ops = [values[o] for o in instr.operands]
            self.eff = eff
            values[instr.id] = self._plan_instr(ctx, instr, ops, k)
        ctx.root = values[comp.root_id]
        for instr in live:  # views, parameters, constants: the mapping of what they refer to
            if instr.name not in self.ops:
                leaf = next(value_leaves(values.get(instr.id)), None)
                if isinstance(leaf, Buf):
                    what = f"{leaf.kind} parameter" if instr.opcode == "parameter" else \
                        "constant" if instr.opcode == "constant" else f"view of '{leaf.instr.name}'"
                    rec = OpRecord(instr.name, instr.opcode, layer_name(instr), leaf.mapping, [], 0.0, what)
                    rec.buf = leaf
                else:
                    what = "replicated where used" if leaf is None or leaf.src is None else \
                        f"broadcast of '{leaf.src.instr.name}'"
                    rec = OpRecord(instr.name, instr.opcode, layer_name(instr), None, [], 0.0, what)
                self.ops[instr.name] = rec
        end = len(live)
        for leaf in value_leaves(ctx.root):
            b = leaf if isinstance(leaf, Buf) else leaf.src
            if b is not None and b.ctx is ctx:
                b.last = end
                b.fused = False  # results are stored
        ctx.steps.sort(key=lambda s: s.order)

    def _entry_param(self, instr: ir_pb2.Instruction) -> Buf:
        n = instr.parameter_number
        kind = self.kinds.get(n) or (instr.source_type if instr.source_type in
                                     ("argument", "variable", "constant") else "")
        if not kind:
            kind = "variable" if n in self.aliased_params else "argument"
        b = Buf(instr, shape_itemsize(instr.shape), max(1, shape_elems(instr.shape)), kind, None, 0)
        if instr.name in self.overrides:
            b.mapping = self.overrides[instr.name]
        return b

    # -- one instruction ----------------------------------------------------------------
    def _plan_instr(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        op = instr.opcode
        if op == "constant":
            return self._constant(ctx, instr, k)
        if op == "tuple":
            return tuple(ops)
        if op == "get-tuple-element":
            v = ops[0]
            idx = attr_int(instr, "index", 0)
            return v[idx] if isinstance(v, tuple) and idx < len(v) else v
        if op in VIEW_OPS:
            return self._view(ops[0], instr)
        if op in TINY_OPS or instr.shape.dtype == ir_pb2.TOKEN:
            return Bcast(None, 1, shape_itemsize(instr.shape))
        if op == "custom-call" and attr_str(instr, "custom_call_target") in REPLICA_TARGETS:
            if attr_str(instr, "custom_call_target") == REPLICA_ID_TARGET:
                return Bcast(None, 1, shape_itemsize(instr.shape))
            return self._all_reduce(ctx, instr, ops, k)
        if op == "broadcast":
            return self._broadcast(ops[0], instr)
        if op == "transpose" and self._trivial_transpose(instr, ops[0]):
            return self._view(ops[0], instr)
        if op in ("dot", "convolution"):
            return self._matmul(ctx, instr, ops, k)
        if op == "reduce":
            return self._reduce(ctx, instr, ops, k)
        if op in ("reduce-window", "select-and-scatter"):
            return self._window(ctx, instr, ops, k)
        if op == "sort":
            return self._sort(ctx, instr, ops, k)
        if op in PROBLEM_OPS or (op == "custom-call"
                               and attr_str(instr, "custom_call_target") in PROBLEM_CUSTOM_CALLS):
            return self._problems(ctx, instr, ops, k)
        if op in BATCH_NORM_OPS:
            return self._batch_norm(ctx, instr, ops, k)
        if op in MOVE_OPS:
            return self._move(ctx, instr, ops, k)
        if op == "while":
            return self._while(ctx, instr, ops, k)
        if op == "call":
            return self._call(ctx, instr, ops, k)
        if op == "conditional":
            return self._conditional(ctx, instr, ops, k)
        if op in RNG_OPS or op == "iota":
            return self._generate(ctx, instr, ops, k)
        if op not in ELEMENTWISE_OPS:
            self.notes.append(f"opcode '{op}' has no planner of its own: planned as "
                              f"{'one compute set' if instr.shape.is_tuple else 'element-wise'}")
        if instr.shape.is_tuple:  # variadic ops without a planner of their own
            return self._generic_tuple(ctx, instr, ops, k)
        return self._elementwise(ctx, instr, ops, k)


def live_instructions(comp: ir_pb2.Computation) -> list[ir_pb2.Instruction]:
    """The instructions the root depends on (and every parameter), in program order: the
    compiler's dead code elimination, for modules planned without compiling them."""
    by_id = {i.id: i for i in comp.instructions}
    needed = {comp.root_id} | {
        i.id for i in comp.instructions
        if i.opcode == "custom-call" and attr_str(i, "custom_call_target") in HOST_TARGETS | REPLICA_TARGETS
    }
    for instr in reversed(comp.instructions):
        if instr.id in needed:
            needed.update(instr.operands)
    return [i for i in comp.instructions if i.id in needed or i.opcode == "parameter"] if by_id else []


def _partials_types(given: Mapping[str, str] | None) -> dict[str, str]:
    out = {}
    for opcode, kind in (given or {}).items():
        kind = str(kind).lower()
        if kind not in ("float", "half"):
            raise ValueError(f"partials type of {opcode!r} must be 'float' or 'half' (PopLibs' "
                             f"partialsType). Received: {kind!r}")
        out[str(opcode)] = kind
    return out


def plan_module(module: ir_pb2.Module, target: Target, live: LiveFn | None = None, *,
                param_kinds: dict[int, str] | None = None,
                mappings: dict[str, TileMapping] | None = None,
                replication: Replication | None = None,
                implied_all_reduce_bytes: int = 0, stages: int = 1,
                memory_proportions: Mapping[str, float] | None = None,
                partials_types: Mapping[str, str] | None = None,
                stage_memory_proportions: Iterable[Entry] = ()) -> ModulePlan:
    """Plans ``module`` for ``target`` (see module docstring).

    Args:
        module: the IR module.
        target: the IPU preset (``arch.get_target``).
        live: each computation's live instructions in program order (the compiler's dead
            code elimination); by default :func:`live_instructions`.
        param_kinds: entry parameter number -> "argument" | "variable" | "constant",
            overriding what the module says.
        mappings: instruction name -> :class:`TileMapping` for entry parameters and
            constants (to study a given layout, e.g. a tensor on one tile).
        replication: the replicas running the program (``replication.replication``); None
            or one replica: a single-IPU program.
        implied_all_reduce_bytes: bytes per replica of an all-reduce the replicated run
            implies but the module does not contain (a training step lowered without its
            cross-replica gradient sum), charged once per call at the end of the program.
        stages: pipeline stages (1: not pipelined). Each instruction is planned on the tiles
            of its stage's IPU (its ``pipeline_stage`` attribute): layouts, code and exchange
            code per stage (``ModulePlan.stage_code_bytes``); ``pipeline.py`` sizes them.
        memory_proportions: ``"dot"`` / ``"convolution"`` -> the share of a tile the plans
            of those products may use for temporaries (PopLibs' availableMemoryProportion,
            0 .. 1; ``matmul.plan_matmul``); an opcode not named: the preset's
            ``available_memory_proportion``.
        stage_memory_proportions: (phase, stage, kind, proportion) entries: the
            availableMemoryProportion of the ``"matmul"`` / ``"convolution"`` products of one
            pass ("forward", "backward", "update") of one pipeline stage, which replaces
            ``memory_proportions`` there (Graphcore's ``PipelineStageOptions``,
            ``proportions.py``).
        partials_types: ``"dot"`` / ``"convolution"`` -> PopLibs' partialsType of those
            products' plans, ``"float"`` or ``"half"``: FP16 products planned with "half"
            hold and exchange FP16 partial sums (half the bytes); an opcode not named, or
            FP32 operands: FP32 partials.

    Returns:
        The :class:`ModulePlan`.
    """
    planner = _Planner(module, target, live or live_instructions, param_kinds, mappings, replication,
                       stages)
    planner.memory_proportions = {str(k): float(v) for k, v in (memory_proportions or {}).items()}
    entries = list(stage_memory_proportions or ())
    if entries:
        from device_server.emulator.tiles.pipeline import phases

        planner.stage_proportions = StageProportions.of_entries(entries, planner.stages,
                                                                phases(module))
    planner.partials_types = _partials_types(partials_types)
    entry, params = planner.plan_entry()
    if planner.rep is not None:
        planner.replica_sync(entry, "replica sync of the call", -1)
        entry.steps.insert(0, entry.steps.pop())  # at the start of the call
        if implied_all_reduce_bytes > 0:
            planner.implied_all_reduce(entry, int(implied_all_reduce_bytes))
    # The end-to-end cycle scales (calibration.json; 1.0 unless an adopted fit set them).
    calibration.apply_cycle_scales(entry, target, planner.collectives)
    for b in params:
        planner.enter_stage(b.instr)
        planner.mapping_of(b)
    for rec in planner.ops.values():
        if rec.mapping is None and rec.buf is not None:
            rec.mapping = rec.buf.mapping
    stage_code = []
    for code, codelets in zip(planner.stage_code, planner.stage_codelets, strict=True):
        for cov in codelets.values():
            code = code + cov * target.codelet_bytes
        stage_code.append(code)
    code = stage_code[0] if len(stage_code) == 1 else sum(stage_code)
    exch_code = planner.stage_exch_code[0] if planner.stages == 1 else sum(planner.stage_exch_code)
    # Host transfers: arguments in; results that are not updated variables out.
    host_in = sum(b.nbytes for b in params if b.kind == "argument")
    root_instr = next(i for i in entry.comp.instructions if i.id == entry.comp.root_id)
    aliased = {int(a.output_index): int(a.parameter_number) for a in module.aliases}
    host_out = 0
    for n, shape in enumerate(leaf_shapes(root_instr.shape)):
        if n not in aliased and shape.dtype != ir_pb2.TOKEN:
            host_out += shape_elems(shape) * shape_itemsize(shape)
    # Updated variables are written over their parameters (in place).
    root_leaves = list(value_leaves(entry.root))
    by_number = {b.instr.parameter_number: b for b in params}
    overwrites = []
    for n, number in aliased.items():
        if n < len(root_leaves) and isinstance(root_leaves[n], Buf) and root_leaves[n].ctx is entry:
            root_leaves[n].inplace = True
            if number in by_number:
                overwrites.append((root_leaves[n], by_number[number]))
    flops = entry.totals()[3]
    return ModulePlan(target, entry, planner.ops, params, planner.constants, code,
                      exch_code, int(host_in), int(host_out), planner.loops,
                      list(dict.fromkeys(planner.notes)), flops, replication, planner.collectives,
                      overwrites, planner.stages, stage_code, list(planner.stage_exch_code))
