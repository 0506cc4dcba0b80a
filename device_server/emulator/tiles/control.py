"""Planning of control flow: ``while``, ``call``, ``conditional``.

    while:        condition and body planned once (their own CompPlans), repeated by the trip
                  count (loops.py) as one "loop" step; + the copy of the new loop state per
                  trip (not of a stash updated in place); the device loop (a while of the entry
                  computation) syncs the replicas each trip. A loop-carried buffer the body
                  writes one slice of per trip (dynamic-update-slice or scatter along its first
                  dimension: TensorListPushBack / SetItem, an RNN's stash) is laid out
                  sliceable (mapping.Allocator.sliceable), as popops' createSliceableTensor
                  lays out a tensor sliced along that dimension; the loop of a PopLibs RNN
                  layer (PopnnLSTM / PopnnGRU) lays out its sequences as PopLibs does, and its
                  backward holds PopLibs' backward buffers (rnn.py)
    call:         the callee planned in place; its results belong to the caller
    conditional:  every branch planned; cycles of the costliest, memory of the largest
"""

from __future__ import annotations

from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles import rnn
from device_server.emulator.tiles.irinfo import shape_elems
from device_server.emulator.tiles.loops import (
    TripCount,
    loop_trip_count,
    sliced_reads,
    stash_slices,
)
from device_server.emulator.tiles.plan import Buf, CompPlan, Step, Value, value_leaves
from device_server.emulator.tiles.state import PlannerState
from device_server.protocol import ir_pb2

__all__ = ["ControlPlanning"]


def _write_over(body: CompPlan, old: Buf, new: Buf) -> None:
    """Marks ``new`` (a dynamic-update-slice or scatter of the body, in place on the loop-state
    buffer ``old``) as written over ``old``: not stored a second time. Only when nothing else in
    the body reads ``old`` (XLA would copy the state before an in-place write another read
    still needs, and the copy would be real memory)."""
    if new.ctx is not body or old.ctx is body:
        return
    readers = sum(1 for p in body.points
                  if p.instr.opcode not in ("tuple", "get-tuple-element")
                  and any(b is old for b in p.uses))
    if readers <= 1:  # the update itself
        new.inplace = True


def _leaf(state: Value, path: tuple[int, ...]) -> Value | None:
    leaf: Value | None = state
    for index in path:
        leaf = leaf[index] if isinstance(leaf, tuple) and index < len(leaf) else None
    return leaf


def _subshape(shape: ir_pb2.Shape, path: tuple[int, ...]) -> ir_pb2.Shape | None:
    for index in path:
        if not shape.is_tuple or index >= len(shape.tuple_shapes):
            return None
        shape = shape.tuple_shapes[index]
    return None if shape.is_tuple else shape


class ControlPlanning(PlannerState):
    """``while``, ``call`` and ``conditional``."""

    # -- control flow -------------------------------------------------------------------
    def _while(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        t = self.t
        state = self._materialize(ctx, ops[0], instr, k)
        self.use(ctx, state, k)
        self._lay_out_stashes(state, instr)
        by_id = {i.id: i for i in ctx.comp.instructions}
        trips: TripCount = loop_trip_count(self.module, instr, by_id)
        cond_id, body_id = instr.called_computations[0], instr.called_computations[1]
        saved = self.eff
        cond = self.plan_comp(cond_id, [state], instr)
        body = self.plan_comp(body_id, [state], instr)
        self.eff = saved
        # The body's new state is copied into the loop's state buffers at the end of a trip.
        copy_bytes = 0.0
        state_leaves = list(value_leaves(state))
        for old, new in zip(state_leaves, value_leaves(body.root), strict=False):
            if isinstance(new, Buf) and isinstance(old, Buf) and new.mapping is old.mapping \
                    and new.instr.opcode in ("dynamic-update-slice", "scatter"):
                # Updated in place (the stash): no copy of the whole buffer, and no second
                # buffer either; the new value is written over the loop state, which the
                # caller holds live across the loop.
                _write_over(body, old, new)
                continue
            if new is not old and isinstance(old, Buf):
                copy_bytes = max(copy_bytes, self.mapping_of(old).max_elements * old.itemsize)
        if ctx.caller is None:  # the device loop: each step syncs the replicas
            self.replica_sync(body, f"replica sync of {instr.name}", len(body.points))
        loop = Step(instr, "loop", 0.0, 0.0, 0.0, self.T, 0.0, k, repeat=max(0, trips.trips))
        loop.children = [cond, body]
        if copy_bytes:
            loop.compute = cyc.compute_cycles(t, 0.0, 2 * copy_bytes, 1.0, t.worker_threads_per_tile)
            loop.sync = float(t.sync_cycles)
        ctx.steps.append(loop)
        ctx.points[k].subs.append([cond, body])
        self.loops.append({"name": instr.name, "trips": trips.trips, "kind": trips.kind,
                           "note": trips.note, "cycles_per_trip": loop.cycles})
        if trips.note:
            self.notes.append(trips.note)
        self.record(instr, None, [loop], 0.0, f"{trips.trips} trip(s) ({trips.kind})")
        self._rnn_backward(ctx, instr, state, body, k)
        return state

    def _lay_out_stashes(self, state: Value, instr: ir_pb2.Instruction) -> None:
        """Lays out sliceable the loop-carried buffers the body writes one slice of per trip
        (``loops.stash_slices``), as Poplar creates a tensor that is dynamically sliced and
        updated: each tile holds its part of every slice, so a trip's write and a later read
        of one slice touch every tile a little, not a few tiles a lot. Only buffers this
        program makes (not entry parameters, not a mapping forced by the caller) are laid out
        again; one already sliceable is kept."""
        if not isinstance(state, tuple):
            return
        body = self.comps.get(instr.called_computations[1]) if len(instr.called_computations) > 1 else None
        if body is None:
            return
        stashes = stash_slices(body)
        if self._rnn_forward(state, instr, body, stashes):
            return
        for path, slices in stashes.items():
            leaf = _leaf(state, path)
            if not isinstance(leaf, Buf) or leaf.kind != "activation" or leaf.elements < 2 * slices:
                continue
            if leaf.mapping is not None and leaf.mapping.slices > 1:
                continue
            leaf.mapping = self.alloc.sliceable(leaf.elements, leaf.itemsize, slices)

    def _rnn_layouts(self) -> dict[int, rnn.RnnLayer]:
        """id of a sequence's mapping -> the PopLibs RNN layer it belongs to."""
        return self.__dict__.setdefault("_rnn_by_mapping", {})

    def _rnn_forward(self, state: Value, instr: ir_pb2.Instruction, body: ir_pb2.Computation,
                     stashes: dict[tuple[int, ...], int]) -> bool:
        """The forward loop of a PopLibs RNN layer (``rnn.kind_of`` its ``source_op``): its
        per-step stashes and the input sequence it reads step by step laid out as PopLibs lays
        out the layer's sequences (``rnn.sequence_mapping``). False (nothing done) for any other
        loop, or one whose sequences do not share their steps and batch."""
        kind = rnn.kind_of(instr.source_op)
        if not kind or instr.source_op.startswith("gradient_tape/") or not isinstance(state, tuple):
            return False
        shape = self._operand_shape(instr, 0)
        reads = sliced_reads(body)
        seqs: list[tuple[Buf, int, bool]] = []  # (buffer, features per step, read as input)
        sizes: set[tuple[int, int]] = set()      # (steps, batch) of every sequence
        for path, steps in list(stashes.items()) + [(p, n) for p, n in reads.items() if p not in stashes]:
            leaf, sub = _leaf(state, path), _subshape(shape, path)
            if not isinstance(leaf, Buf) or sub is None or len(sub.dims) < 3 or int(sub.dims[0]) != steps:
                continue
            sizes.add((steps, int(sub.dims[1])))
            seqs.append((leaf, shape_elems(sub) // (steps * int(sub.dims[1])), path not in stashes))
        inputs = [size for _, size, read in seqs if read]
        outputs = [size for _, size, read in seqs if not read and size not in inputs]
        if len(sizes) != 1 or not inputs:
            return False
        steps, batch = sizes.pop()
        out_size = max(set(outputs), key=lambda s: (outputs.count(s), -s)) if outputs else inputs[0]
        layer = rnn.rnn_layer(kind, steps, batch, max(inputs), out_size, seqs[0][0].itemsize,
                              self.T, self.t.sram_bytes_per_tile)
        layouts = self._rnn_layouts()
        for leaf, size, _ in seqs:
            if leaf.kind != "activation" or leaf.elements != steps * batch * size:
                continue
            leaf.mapping = rnn.sequence_mapping(layer, size)
            layouts[id(leaf.mapping)] = layer
        return True

    def _rnn_backward(self, ctx: CompPlan, instr: ir_pb2.Instruction, state: Value,
                      body: CompPlan, k: int) -> None:
        """The backward loop of a PopLibs RNN layer: PopLibs' backward kernel holds, across its
        loop, sequences the lowered loop does not (``rnn.backward_sequences``): each a buffer
        of the loop's instruction, live at its point only, laid out as the layer's sequences."""
        kind = rnn.kind_of(instr.source_op)
        if not kind or not instr.source_op.startswith("gradient_tape/"):
            return
        layouts = self._rnn_layouts()
        layer = next((layouts[id(leaf.mapping)] for leaf in value_leaves(state)
                      if isinstance(leaf, Buf) and id(leaf.mapping) in layouts), None)
        if layer is None:
            return
        # The lowered backward already makes the input's gradient if it writes a sequence of
        # the input's size per step.
        shape = self._operand_shape(instr, 0)
        writes_input = any((sub := _subshape(shape, p)) is not None and len(sub.dims) >= 3
                           and shape_elems(sub) // (sub.dims[0] * sub.dims[1]) == layer.input_size
                           for p in stash_slices(body.comp))
        held = rnn.backward_sequences(layer, self.t.sram_bytes_per_tile, input_gradient=not writes_input)
        for _, size, count in held:
            mapping = rnn.sequence_mapping(layer, size, count)
            ctx.bufs.append(Buf(instr, layer.itemsize, mapping.elements, "activation", ctx, k, mapping))
        self.notes.append(
            f"'{instr.name}': the backward of PopLibs' {kind.split('_')[0].upper()} over "
            f"{layer.steps} steps ({layer.shards} shard(s) of its sequences, on the tiles PopLibs "
            f"gives them) holds PopLibs' backward sequences: " + ", ".join(w for w, _, _ in held))

    def _call(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        self.use(ctx, ops, k)
        saved = self.eff
        callee = self.plan_comp(instr.called_computations[0], list(ops), instr)
        self.eff = saved
        step = Step(instr, "call", 0.0, 0.0, 0.0, self.T, 0.0, k)
        step.children = [callee]
        ctx.steps.append(step)
        ctx.points[k].subs.append([callee])
        for leaf in value_leaves(callee.root):  # results now belong to the caller
            if isinstance(leaf, Buf) and leaf.ctx is callee:
                leaf.ctx, leaf.born, leaf.last, leaf.fused = ctx, k, k, False
                ctx.bufs.append(leaf)
        self.record(instr, None, [step])
        return callee.root

    def _conditional(self, ctx: CompPlan, instr: ir_pb2.Instruction, ops: list[Value], k: int) -> Value:
        self.use(ctx, ops, k)
        saved = self.eff
        branches = [self.plan_comp(c, [ops[1 + n]] if 1 + n < len(ops) else [], instr)
                    for n, c in enumerate(instr.called_computations)]
        self.eff = saved
        step = Step(instr, "call", 0.0, 0.0, float(self.t.sync_cycles), self.T, 0.0, k)
        if branches:
            step.children = [max(branches, key=lambda b: b.cycles)]
        ctx.steps.append(step)
        ctx.points[k].subs.append(branches)
        out = self.out_value(ctx, instr, k)
        self.record(instr, None, [step], 0.0, f"costliest of {len(branches)} branch(es)")
        return out
