"""IR rewrites and step-list passes: the compiler's planning, one pure function each.

    module, computation (IR)                          steps [(_Step, instr)] of a computation
      _add_into_slice   add(x, dus(0, u)) -> dus(x, ..)   _used_steps        drop unread steps
      _host_computations  what talks to the host (never dropped)
      _loop_bodies      what runs once per iteration      _dots_into_fused   a dot inside its user
      _is_identity      ops that return their operand     _reuse_buffers     ufunc writes in place
      _sliced_operand   a slice of a concatenate          _mark_donations    writes into donated
      _lazy_broadcasts  broadcasts left unexpanded                           parameters
      _broadcast_source an expanded broadcast's operand

The IR rewrites return new instructions or facts about them; the step-list passes return a
new list or set fields of the ``_Step``s (``into``, ``donate``). Each keeps the program's
result bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_server.emulator import dynamic, kernels, parallel
from device_server.emulator.codegen import _Step
from device_server.emulator.values import literal_to_value
from device_server.protocol import HOST_TARGETS, REPLICA_TARGETS, ir_pb2

# custom-call targets that talk to the host at run time (never folded, never dead code).
_RUN_TIME_TARGETS = HOST_TARGETS | REPLICA_TARGETS
# Element-wise opcodes whose kernels broadcast operands like numpy (and whose results do not
# depend on the operands' memory layout), so a broadcast operand may stay unexpanded.
_NUMPY_BROADCASTING = frozenset(
    {"add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select",
     "and", "or", "xor"}
)


def _is_identity(instr: ir_pb2.Instruction, operands: list[ir_pb2.Instruction]) -> bool:
    """Whether ``instr`` returns its only operand unchanged (same shape and type)."""
    if len(operands) != 1 or instr.shape.is_tuple or operands[0].shape.is_tuple:
        return False
    src = operands[0].shape
    if src.dtype != instr.shape.dtype or tuple(src.dims) != tuple(instr.shape.dims):
        return False
    if dynamic.dynamic_flags(src) != dynamic.dynamic_flags(instr.shape):
        return False  # a run-time size becomes a bound, or the other way round
    op = instr.opcode
    if op in ("reshape", "bitcast", "convert", "concatenate"):
        return True
    if op == "slice":
        strides = instr.attrs["strides"].ints.values if "strides" in instr.attrs else ()
        return all(int(s) == 1 for s in strides)
    if op == "transpose":
        perm = tuple(instr.attrs["permutation"].ints.values) if "permutation" in instr.attrs else ()
        return perm == tuple(range(len(perm)))
    if op == "broadcast":
        dims = tuple(instr.attrs["dimensions"].ints.values) if "dimensions" in instr.attrs else ()
        return dims == tuple(range(len(dims)))
    return False


def _sliced_operand(instr: ir_pb2.Instruction, concat: ir_pb2.Instruction,
                    by_id: dict[int, ir_pb2.Instruction]) -> int | None:
    """The id of the operand of ``concat`` that the slice ``instr`` takes whole (the same
    dtype and shape), or None."""
    shapes = [instr.shape, concat.shape] + [by_id[o].shape for o in concat.operands]
    if any(s.is_tuple or dynamic.has_dynamic(s) or s.dtype != instr.shape.dtype for s in shapes):
        return None
    if not all(k in instr.attrs for k in ("start_indices", "limit_indices")) \
            or "dimension" not in concat.attrs:
        return None
    starts = tuple(int(v) for v in instr.attrs["start_indices"].ints.values)
    limits = tuple(int(v) for v in instr.attrs["limit_indices"].ints.values)
    strides = tuple(int(v) for v in instr.attrs["strides"].ints.values) \
        if "strides" in instr.attrs else (1,) * len(starts)
    axis = int(concat.attrs["dimension"].i)
    dims = tuple(int(d) for d in instr.shape.dims)
    if any(st != 1 for st in strides) or not 0 <= axis < len(dims) or len(starts) != len(dims):
        return None
    offset = 0
    for o in concat.operands:
        od = tuple(int(d) for d in by_id[o].shape.dims)
        if od == dims and starts[axis] == offset and all(
                (a, b) == (0, d) for k, (a, b, d) in enumerate(zip(starts, limits, od, strict=True))
                if k != axis):
            return o
        if len(od) != len(dims):
            return None
        offset += od[axis]
    return None


def _element(instr: ir_pb2.Instruction | None,
             by_id: dict[int, ir_pb2.Instruction]) -> ir_pb2.Instruction | None:
    """``instr``, or what a get-tuple-element of a tuple made in the same computation reads."""
    for _ in range(16):
        if instr is None or instr.opcode != "get-tuple-element" or not instr.operands:
            return instr
        src = by_id.get(instr.operands[0])
        if src is None or src.opcode != "tuple":
            return instr
        k = int(instr.attrs["index"].i) if "index" in instr.attrs else 0
        if not 0 <= k < len(src.operands):
            return None
        instr = by_id.get(src.operands[k])
    return instr


def _is_zeros(instr: ir_pb2.Instruction, by_id: dict[int, ir_pb2.Instruction]) -> bool:
    """A constant of zeros, or a broadcast of one (also taken out of a tuple just made)."""
    found = _element(instr, by_id)
    if found is not None and found.opcode == "broadcast" and len(found.operands) == 1:
        found = _element(by_id.get(found.operands[0]), by_id)
    if found is None:
        return False
    instr = found
    if instr.opcode != "constant" or "value" not in instr.attrs or instr.shape.is_tuple:
        return False
    try:
        value = literal_to_value(instr.attrs["value"].literal)
    except Exception:  # noqa: BLE001 - a bad literal is reported when the constant compiles
        return False
    return isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and not np.any(value)


def _add_into_slice(comp: ir_pb2.Computation, next_id: list[int]) -> ir_pb2.Computation:
    """``add(x, dynamic-update-slice(zeros, u, i...))`` becomes ``dynamic-update-slice(x,
    add(dynamic-slice(x, i...), u), i...)`` (as XLA's simplifier does): the gradient of a
    TensorArray read, added into the accumulated gradient every iteration of a backward loop,
    then touches one slice instead of the whole buffer, and can be done in place
    (``mark_in_place``). Equal except that ``-0 + 0`` stays ``-0`` outside the slice. Returns
    ``comp`` itself when nothing matches."""
    by_id = {i.id: i for i in comp.instructions}
    plan: dict[int, tuple[int, ir_pb2.Instruction]] = {}  # add id -> (x id, the update)
    for i in comp.instructions:
        if i.opcode != "add" or len(i.operands) != 2 or i.shape.is_tuple or dynamic.has_dynamic(i.shape):
            continue
        for side in (0, 1):
            d, x = _element(by_id.get(i.operands[side]), by_id), by_id.get(i.operands[1 - side])
            if d is None or x is None or d.opcode != "dynamic-update-slice" \
                    or len(d.operands) < 3 or not all(o in by_id for o in d.operands):
                continue
            u = by_id[d.operands[1]]
            if not _is_zeros(by_id[d.operands[0]], by_id) or u.shape.is_tuple or dynamic.has_dynamic(u.shape) \
                    or x.shape.dtype != i.shape.dtype or u.shape.dtype != i.shape.dtype \
                    or list(x.shape.dims) != list(i.shape.dims) or len(u.shape.dims) != len(i.shape.dims):
                continue
            plan[i.id] = (x.id, d)
            break
    if not plan:
        return comp
    out = ir_pb2.Computation()
    out.CopyFrom(comp)
    del out.instructions[:]
    for i in comp.instructions:
        if i.id not in plan:
            out.instructions.add().CopyFrom(i)
            continue
        x_id, d = plan[i.id]
        index = list(d.operands[2:])
        ds = out.instructions.add(id=next_id[0], name=f"{i.name}.slice", opcode="dynamic-slice",
                                  operands=[x_id, *index], source_op=i.source_op)
        ds.shape.CopyFrom(by_id[d.operands[1]].shape)
        ds.attrs["slice_sizes"].ints.values.extend(int(v) for v in ds.shape.dims)
        total = out.instructions.add(id=next_id[0] + 1, name=f"{i.name}.sum", opcode="add",
                                     operands=[ds.id, d.operands[1]], source_op=i.source_op)
        total.shape.CopyFrom(ds.shape)
        next_id[0] += 2
        new = out.instructions.add()
        new.CopyFrom(i)
        new.opcode = "dynamic-update-slice"
        del new.operands[:]
        new.operands.extend([x_id, total.id, *index])
    return out


def _loop_bodies(module: ir_pb2.Module) -> set[int]:
    """The computations that run once per iteration of a ``while``: its bodies, and what
    they call (``call``, ``conditional``, nested loops)."""
    comps = {c.id: c for c in module.computations}
    stack = [i.called_computations[1] for c in module.computations for i in c.instructions
             if i.opcode == "while" and len(i.called_computations) == 2]
    found: set[int] = set()
    while stack:
        cid = stack.pop()
        if cid in found or cid not in comps:
            continue
        found.add(cid)
        stack.extend(callee for i in comps[cid].instructions
                     if i.opcode in ("call", "conditional", "while") for callee in i.called_computations)
    return found


def _used_steps(
    steps: list[tuple[_Step, ir_pb2.Instruction]], root_slot: int,
    host_computations: frozenset[int] = frozenset(),
) -> list[tuple[_Step, ir_pb2.Instruction]]:
    """``steps`` without those whose value the result does not need (``host_computations``:
    see ``_talks_to_host``)."""
    needed = {root_slot}
    kept: list[tuple[_Step, ir_pb2.Instruction]] = []
    for step, instr in reversed(steps):
        if step.out in needed or _talks_to_host(instr, host_computations):
            needed.update(step.ins)
            kept.append((step, instr))
    return kept[::-1]


def _talks_to_host(instr: ir_pb2.Instruction,
                   host_computations: frozenset[int] = frozenset()) -> bool:
    """An infeed or outfeed custom-call, or a ``call``, ``conditional`` or ``while`` whose
    computations hold one (``host_computations``, from ``_host_computations``): kept even
    when nothing reads its result."""
    if instr.opcode == "custom-call":
        return kernels.custom_call_target(instr) in _RUN_TIME_TARGETS
    return instr.opcode in ("call", "conditional", "while") and any(
        c in host_computations for c in instr.called_computations)


def _host_computations(module: ir_pb2.Module) -> frozenset[int]:
    """The computations that talk to the host when they run: those holding an infeed or
    outfeed custom-call, and those calling one of them (``call``, ``conditional``,
    ``while``), so that a branch or a loop that enqueues is never dropped as unused."""
    found: set[int] = set()
    changed = True
    while changed:  # to a fixed point: a caller of a caller of ... an outfeed
        changed = False
        for comp in module.computations:
            if comp.id not in found and any(
                    _talks_to_host(i, frozenset(found)) for i in comp.instructions):
                found.add(comp.id)
                changed = True
    return frozenset(found)


def _broadcast_source(
    made: tuple[_Step, ir_pb2.Instruction] | None, dims: dict[int, tuple[int, ...] | None]
) -> tuple[int, tuple[int, ...]] | None:
    """For a value made by an (expanded) ``broadcast`` that does not transpose: its operand's
    slot and the operand's shape with ones inserted where the broadcast adds dimensions."""
    if made is None or made[1].opcode != "broadcast" or len(made[0].ins) != 1:
        return None
    step, instr = made
    bdims = tuple(int(d) for d in instr.attrs["dimensions"].ints.values) \
        if "dimensions" in instr.attrs else ()
    src_dims = dims.get(step.ins[0])
    out_dims = dims.get(step.out)
    if src_dims is None or out_dims is None or len(bdims) != len(src_dims) \
            or list(bdims) != sorted(set(bdims)):
        return None
    if any(not 0 <= d < len(out_dims) or src_dims[i] != out_dims[d] for i, d in enumerate(bdims)):
        return None
    expanded = [1] * len(out_dims)
    for i, d in enumerate(bdims):
        expanded[d] = src_dims[i]
    return step.ins[0], tuple(expanded)


def _lazy_broadcasts(
    live: list[ir_pb2.Instruction], by_id: dict[int, ir_pb2.Instruction], root_id: int, fault: str
) -> dict[int, tuple[int, ...] | None]:
    """Broadcasts that need not be expanded: every user is an element-wise op that
    broadcasts like numpy and has another operand of the full shape (not a broadcast, or an
    earlier broadcast that is expanded).
    Maps the broadcast's id to None (its operand can be used as it is: it lines up with the
    trailing dimensions) or to the shape to reshape its operand to."""
    users: dict[int, list[ir_pb2.Instruction]] = {}
    for instr in live:
        for o in instr.operands:
            users.setdefault(o, []).append(instr)
    out: dict[int, tuple[int, ...] | None] = {}
    expanded_ids: set[int] = set()  # broadcasts decided to be expanded (full-shaped values)
    for instr in live:
        if instr.opcode != "broadcast":
            continue
        expanded_ids.add(instr.id)  # until it qualifies below
        if instr.opcode == fault or instr.id == root_id:
            continue
        if instr.shape.is_tuple or len(instr.operands) != 1:
            continue
        if dynamic.has_dynamic(instr.shape) or any(
            dynamic.has_dynamic(u.shape) or any(dynamic.has_dynamic(by_id[o].shape) for o in u.operands)
            for u in users.get(instr.id, [])
        ):
            continue  # users with run-time sizes get whole operands (see dynamic.py)
        dims = tuple(int(d) for d in instr.attrs["dimensions"].ints.values) \
            if "dimensions" in instr.attrs else ()
        src = by_id[instr.operands[0]].shape
        out_dims = tuple(int(d) for d in instr.shape.dims)
        in_dims = tuple(int(d) for d in src.dims)
        if src.is_tuple or src.dtype != instr.shape.dtype or len(dims) != len(in_dims):
            continue
        if list(dims) != sorted(dims) or len(set(dims)) != len(dims):
            continue  # a transposing broadcast
        if any(not 0 <= d < len(out_dims) or in_dims[i] != out_dims[d] for i, d in enumerate(dims)):
            continue
        us = users.get(instr.id, [])
        if not us:
            continue
        ok = True
        for u in us:
            if u.opcode not in _NUMPY_BROADCASTING or u.shape.is_tuple:
                ok = False
                break
            full = tuple(u.shape.dims)
            if not any(
                o != instr.id and (by_id[o].opcode != "broadcast" or o in expanded_ids)
                and not by_id[o].shape.is_tuple and tuple(by_id[o].shape.dims) == full
                for o in u.operands
            ):
                ok = False
                break
        if not ok:
            continue
        expanded_ids.discard(instr.id)
        if dims == tuple(range(len(out_dims) - len(dims), len(out_dims))):
            out[instr.id] = None
        else:
            expanded = [1] * len(out_dims)
            for i, d in enumerate(dims):
                expanded[d] = in_dims[i]
            out[instr.id] = tuple(expanded)
    return out


def _reuse_buffers(steps: list[tuple[_Step, ir_pb2.Instruction]], root_slot: int) -> None:
    """Lets a plain-ufunc step write into an operand's buffer when that operand is a new
    array made by another plain-ufunc step (same dtype and shape) and this step is its only
    user, so no other value can see the buffer (sets ``_Step.into``)."""
    producer: dict[int, ir_pb2.Instruction] = {}
    users: dict[int, set[int]] = {}
    for k, (step, instr) in enumerate(steps):
        for s in step.ins:
            users.setdefault(s, set()).add(k)
        if getattr(step.fn, "ufunc", None) is not None and not instr.shape.is_tuple \
                and len(instr.shape.dims) > 0:
            producer[step.out] = instr
    for k, (step, instr) in enumerate(steps):
        if getattr(step.fn, "ufunc", None) is None or instr.shape.is_tuple or not instr.shape.dims:
            continue
        for j, s in enumerate(step.ins):
            made = producer.get(s)
            if made is None or s == root_slot or users.get(s) != {k}:
                continue
            if made.shape.dtype == instr.shape.dtype and tuple(made.shape.dims) == tuple(instr.shape.dims):
                step.into = j
                break


def _dots_into_fused(steps: list[tuple[_Step, ir_pb2.Instruction]], root_slot: int,
                     dims: dict[int, Any], dtypes_: dict[int, Any]) -> list[tuple[_Step, ir_pb2.Instruction]]:
    """A matrix product read only by one fused element-wise step, at the step's own index
    (a full-shaped input of a step whose blocks are rows of a 2-D result), is computed there
    a block of rows at a time instead of whole: ``w - lr * x.T @ dy`` never makes the
    gradient of ``w`` (XLA's CPU backend fuses a dot into its consumer the same way). The
    product's rows come from the same BLAS call on row ranges that ``parallel.matmul``
    makes when it cuts by rows."""
    users: dict[int, int] = {}
    for st, _ in steps:
        for slot in st.ins:
            users[slot] = users.get(slot, 0) + 1
    producer = {st.out: k for k, (st, _) in enumerate(steps)}
    dropped: set[int] = set()
    for k, (st, instr) in enumerate(steps):
        fused = getattr(st.fn, "fused_inputs", None)
        out_dims = dims.get(st.out)
        lead = getattr(st.fn, "block_lead", 0)
        if fused is None or out_dims is None or len(out_dims) != 2 or st.donate >= 0:
            continue
        # Blocks are rows of the result (lead 1), or runs of elements that are whole rows.
        if not (lead == 1 or (lead == 2 and getattr(st.fn, "block_rows", 1) % out_dims[1] == 0)):
            continue
        for j, slot in enumerate(st.ins):
            d = producer.get(slot)
            if not fused[j] or d is None or d in dropped or users.get(slot) != 1 \
                    or slot == root_slot or st.ins.count(slot) != 1:
                continue
            dot = steps[d][0]
            rows = getattr(dot.fn, "rows", None)
            if rows is None or dims.get(slot) != out_dims or dtypes_.get(slot) is None:
                continue
            n_cols, dt, n_ins = out_dims[1], np.dtype(dtypes_[slot]), len(st.ins)

            def fn(ops: Sequence[Any], into: np.ndarray | None = None, _f: Any = st.fn,
                   _rows: Any = rows, _j: int = j, _n: int = n_ins, _c: int = n_cols,
                   _dt: np.dtype = dt, _flat: bool = lead == 2) -> np.ndarray:
                lhs, rhs = ops[_j], ops[_n]

                def rows_of(a: int, b: int) -> np.ndarray:
                    if _flat:  # a run of elements: whole rows a // c to b // c
                        a, b = a // _c, b // _c
                    buf = parallel.scratch((b - a) * _c, _dt).reshape(b - a, _c)
                    out = _rows([lhs, rhs], a, b, buf)
                    return out.reshape(-1) if _flat else out

                return _f(ops[:_n], into, lazy={_j: rows_of})

            fn.fused_inputs = tuple(f and i != j for i, f in enumerate(fused)) + (False,)  # type: ignore[attr-defined]
            fn.block_lead = lead  # type: ignore[attr-defined]
            fn.block_rows = getattr(st.fn, "block_rows", 1)  # type: ignore[attr-defined]
            ins = list(st.ins)
            ins[j] = dot.ins[0]
            ins.append(dot.ins[1])
            steps[k] = (_Step(fn, tuple(ins), st.out), instr)
            dropped.add(d)
            break
    return [s for k, s in enumerate(steps) if k not in dropped]


def _mark_donations(steps: list[tuple[_Step, ir_pb2.Instruction]], root: ir_pb2.Instruction,
                    root_slot: int, params: dict[int, int], dims: dict[int, Any],
                    aliases: dict[int, int]) -> None:
    """Lets the fused step that makes an aliased output write it into its parameter's buffer
    when the caller donates that parameter (a resident variable: XLA's donated buffers).

    Safe when the step reads the parameter element by element at the output's own index (a
    full-shaped input of an element-wise fused group), no later step reads the parameter, and
    the parameter is not itself an output. Sets ``_Step.donate``; nothing changes for
    callers that donate nothing."""
    if root.opcode != "tuple" or not root.shape.is_tuple:
        return
    root_step = next((st for st, _ in steps if st.out == root_slot), None)
    if root_step is None:
        return
    outputs = root_step.ins
    if any(leaf.is_tuple for leaf in root.shape.tuple_shapes):
        return  # nested tuples: flat output indices do not map to the root's operands
    position = {st.out: k for k, (st, _) in enumerate(steps)}
    last_read: dict[int, int] = {}
    for k, (st, _) in enumerate(steps):
        for slot in st.ins:
            last_read[slot] = k
    for out_index, number in aliases.items():
        if not 0 <= out_index < len(outputs) or number not in params:
            continue
        p_slot, out_slot = params[number], outputs[out_index]
        k = position.get(out_slot)
        if k is None or p_slot in outputs:
            continue
        st = steps[k][0]
        fused = getattr(st.fn, "fused_inputs", None)
        if fused is None or st.ins.count(p_slot) != 1:
            continue
        j = st.ins.index(p_slot)
        if not fused[j] or dims.get(p_slot) != dims.get(out_slot):
            continue
        if any(p_slot in other.ins for other, _ in steps[k + 1:] if other is not root_step):
            continue
        st.donate, st.donate_param = j, number
