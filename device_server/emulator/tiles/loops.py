"""Trip counts of ``while`` loops, found at compile time from the loop's IR.

* A *counting* loop (``i = c0; while i < bound: i += step``, XLA's and TF's usual shape, also
  through the call wrapper and 1-tuples TF puts around the condition) whose start, bound and
  step are constants has a known trip count.
* A *parameter-bound* loop is a counting loop whose bound is not a constant (an entry
  parameter, as in the Keras device loop ``while i < n_steps``). Its count is only known at
  run time; when the body indexes a loop-carried array with the counter along its first
  dimension (``xs[i]``, a ``dynamic-slice``), that dimension bounds it and the plan assumes the
  loop runs to it (the Keras loop over N stacked batches runs N - 1 times after its first step).
* Anything else runs an unknown number of times; the plan counts one iteration and says so.

``stash_slices`` finds the loop-carried buffers a body writes one slice of per trip (a
``dynamic-update-slice`` or ``scatter`` into a tuple element along its first dimension: TF's
TensorListPushBack / TensorListSetItem, the stash an RNN keeps for its backward pass);
``sliced_reads`` those it reads one slice of per trip (TensorListGetItem: an RNN's input).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from device_server.protocol import dtypes, ir_pb2

__all__ = ["TripCount", "loop_trip_count", "sliced_reads", "stash_slices", "while_trip_count"]


@dataclass(frozen=True)
class TripCount:
    """How many times a loop's body runs, and how that was found."""

    trips: int
    kind: str          # "constant", "parameter-bound" or "unknown"
    note: str = ""


def _const_of(i: ir_pb2.Instruction | None) -> int | None:
    if i is None or i.opcode != "constant" or i.shape.dims or i.shape.is_tuple:
        return None
    lit = i.attrs["value"].literal
    dt = dtypes.to_numpy(lit.shape.dtype)
    if dt.kind not in "iu":
        return None
    return int(np.frombuffer(lit.data, dtype=dt.newbyteorder("<"))[0])


def _strip(ids: dict[int, ir_pb2.Instruction], i: ir_pb2.Instruction) -> ir_pb2.Instruction:
    while i.opcode in ("reshape", "copy", "convert", "bitcast") and i.operands:
        i = ids[i.operands[0]]
    return i


def _gte_index(ids: dict[int, ir_pb2.Instruction], i: ir_pb2.Instruction) -> int | None:
    i = _strip(ids, i)
    if i.opcode == "get-tuple-element" and ids[i.operands[0]].opcode == "parameter":
        return int(i.attrs["index"].i) if "index" in i.attrs else 0
    return None


@dataclass(frozen=True)
class _Counter:
    index: int                               # tuple element of the counter
    start: int | None
    bound: int | None
    bound_init: ir_pb2.Instruction | None    # the init value of the bound (if a tuple element)
    inclusive: bool
    step: int | None


def _analyse(module: ir_pb2.Module, instr: ir_pb2.Instruction,
             by_id: dict[int, ir_pb2.Instruction]) -> _Counter | None:
    comps = {c.id: c for c in module.computations}
    if len(instr.called_computations) < 2 or not instr.operands:
        return None
    cond, body = comps.get(instr.called_computations[0]), comps.get(instr.called_computations[1])
    init = by_id.get(instr.operands[0])
    if cond is None or body is None or init is None or init.opcode != "tuple":
        return None
    c = cond
    ids = {x.id: x for x in c.instructions}
    root = _strip(ids, ids[c.root_id])
    for _ in range(4):
        if root.opcode == "get-tuple-element":
            src = ids[root.operands[0]]
            if src.opcode == "call":
                c = comps[src.called_computations[0]]
                ids = {x.id: x for x in c.instructions}
                root = _strip(ids, ids[c.root_id])
                continue
        if root.opcode == "tuple" and len(root.operands) == 1:
            root = _strip(ids, ids[root.operands[0]])
            continue
        break
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = root.attrs["direction"].s if "direction" in root.attrs else ""
    a, b = (ids[o] for o in root.operands)
    ia, ib = _gte_index(ids, a), _gte_index(ids, b)
    init_elems = [by_id.get(o) for o in init.operands]
    if direction in ("GT", "GE"):
        a, b, ia, ib = b, a, ib, ia
        direction = "LT" if direction == "GT" else "LE"
    if direction not in ("LT", "LE") or ia is None or ia >= len(init_elems):
        return None

    def init_value(i: ir_pb2.Instruction, idx: int | None) -> tuple[int | None, ir_pb2.Instruction | None]:
        if idx is not None:
            e = init_elems[idx] if idx < len(init_elems) else None
            e = _strip(by_id, e) if e is not None else None
            return _const_of(e), e
        return _const_of(_strip(ids, i)), None

    start, _ = init_value(a, ia)
    bound, bound_init = init_value(b, ib)
    bids = {x.id: x for x in body.instructions}
    broot = bids[body.root_id]
    step = None
    if broot.opcode == "tuple" and ia < len(broot.operands):
        upd = _strip(bids, bids[broot.operands[ia]])
        if upd.opcode == "add" and len(upd.operands) == 2:
            x, y = (_strip(bids, bids[o]) for o in upd.operands)
            if _gte_index(bids, x) != ia:
                x, y = y, x
            if _gte_index(bids, x) == ia:
                step = _const_of(y)
    return _Counter(ia, start, bound, bound_init, direction == "LE", step)


def while_trip_count(module: ir_pb2.Module, instr: ir_pb2.Instruction,
                     by_id: dict[int, ir_pb2.Instruction]) -> int | None:
    """Trip count of a counting ``while`` (``i = c0; while i < bound: i += step``) whose
    start, bound and step are constants, else ``None``."""
    c = _analyse(module, instr, by_id)
    if c is None or c.start is None or c.bound is None or not c.step or c.step <= 0:
        return None
    span = c.bound - c.start + (1 if c.inclusive else 0)
    return max(0, -(-span // c.step))


def _indexed_extent(body: ir_pb2.Computation, counter: int) -> int | None:
    """First-dimension size of loop-carried arrays the body slices with the counter."""
    ids = {x.id: x for x in body.instructions}

    def reaches_counter(i: ir_pb2.Instruction, depth: int = 0) -> bool:
        if _gte_index(ids, i) == counter:
            return True
        if depth > 12 or i.shape.is_tuple or int(np.prod(i.shape.dims, dtype=np.int64)) > 1 \
                or i.opcode in ("parameter", "constant"):
            return False
        return any(reaches_counter(ids[o], depth + 1) for o in i.operands)

    extents = []
    for i in body.instructions:
        if i.opcode != "dynamic-slice" or len(i.operands) < 2:
            continue
        src = _strip(ids, ids[i.operands[0]])
        if src.opcode != "get-tuple-element" or not src.shape.dims:
            continue
        if reaches_counter(ids[i.operands[1]]):
            extents.append(int(src.shape.dims[0]))
    return min(extents) if extents else None


def loop_trip_count(module: ir_pb2.Module, instr: ir_pb2.Instruction,
                    by_id: dict[int, ir_pb2.Instruction]) -> TripCount:
    """The trip count the plan uses for ``instr`` (a ``while``), see module docstring."""
    n = while_trip_count(module, instr, by_id)
    if n is not None:
        return TripCount(n, "constant")
    c = _analyse(module, instr, by_id)
    if c is not None and c.start is not None and c.step and c.step > 0:
        comps = {x.id: x for x in module.computations}
        extent = _indexed_extent(comps[instr.called_computations[1]], c.index)
        if extent is not None:
            span = extent - c.start
            trips = max(0, -(-span // c.step))
            what = "an entry parameter" if c.bound_init is not None and c.bound_init.opcode == "parameter" \
                else "a value known at run time"
            return TripCount(trips, "parameter-bound",
                             f"loop '{instr.name}' is bounded by {what}; assumed to run over all "
                             f"{extent} entries the body indexes: {trips} trip(s) from {c.start}")
    return TripCount(1, "unknown", f"loop '{instr.name}' has no trip count known at compile time; "
                                   "counted as one iteration")


def _gte_path(ids: dict[int, ir_pb2.Instruction], i: ir_pb2.Instruction) -> tuple[int, ...] | None:
    """Tuple indices (outermost first) from the computation's parameter to ``i``, through
    views and nested ``get-tuple-element``s; None if ``i`` is not such an element."""
    path: list[int] = []
    i = _strip(ids, i)
    while i.opcode == "get-tuple-element" and i.operands:
        path.append(int(i.attrs["index"].i) if "index" in i.attrs else 0)
        i = _strip(ids, ids[i.operands[0]])
    return tuple(reversed(path)) if path and i.opcode == "parameter" else None


def stash_slices(body: ir_pb2.Computation) -> dict[tuple[int, ...], int]:
    """Path of tuple indices into the loop state -> positions along its first dimension, for every
    loop-carried buffer ``body`` updates one slice of per trip: a ``dynamic-update-slice``
    whose update is thinner than the buffer along the first dimension only, or a ``scatter``
    whose updates hold at most one slice, written into the buffer read from the loop's
    parameter (through views)."""
    ids = {x.id: x for x in body.instructions}
    found: dict[tuple[int, ...], int] = {}
    for i in body.instructions:
        if i.opcode not in ("dynamic-update-slice", "scatter") or len(i.operands) < 2:
            continue
        dims = list(i.shape.dims)
        if i.shape.is_tuple or len(dims) < 2 or dims[0] < 2:
            continue
        index = _gte_path(ids, ids[i.operands[0]])
        if index is None:
            continue
        upd = ids[i.operands[1] if i.opcode == "dynamic-update-slice" else i.operands[-1]]
        udims = list(upd.shape.dims)
        per_slice = int(np.prod(dims[1:], dtype=np.int64))
        if i.opcode == "dynamic-update-slice":
            if len(udims) != len(dims) or udims[0] >= dims[0] or udims[1:] != dims[1:]:
                continue
        elif int(np.prod(udims, dtype=np.int64)) > per_slice:
            continue
        found[index] = int(dims[0])
    return found


def sliced_reads(body: ir_pb2.Computation) -> dict[tuple[int, ...], int]:
    """Path of tuple indices into the loop state -> positions along its first dimension, for every
    loop-carried buffer ``body`` reads one slice of (a ``dynamic-slice`` thinner than the
    buffer along the first dimension only: TF's TensorListGetItem, an RNN reading its input
    sequence step by step)."""
    ids = {x.id: x for x in body.instructions}
    found: dict[tuple[int, ...], int] = {}
    for i in body.instructions:
        if i.opcode != "dynamic-slice" or not i.operands:
            continue
        src = ids[i.operands[0]]
        dims, sdims = list(i.shape.dims), list(src.shape.dims)
        if src.shape.is_tuple or len(sdims) < 2 or len(dims) != len(sdims) or dims[0] >= sdims[0] \
                or dims[1:] != sdims[1:]:
            continue
        index = _gte_path(ids, src)
        if index is not None:
            found[index] = int(sdims[0])
    return found
