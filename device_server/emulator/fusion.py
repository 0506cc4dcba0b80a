"""Loop fusion: element-wise steps over big arrays run as one step, a block of rows at a time.

    before   v1 = add(conv, bias)     one pass over the whole array each,
             v2 = multiply(v1, scale)  and a whole-array temporary each
             v3 = maximum(v2, zero)
    after    v3 = fused(conv, bias, scale, zero):
               for each block of ~32K elements (in cache), on the emulator's threads:
                   t = add(conv[block], bias); t = multiply(t, scale); out[block] = maximum(t, zero)

A group is a producer-consumer cluster of element-wise steps of one output shape whose
intermediate values nobody else reads (XLA's loop fusion, at numpy's granularity). Each member
runs its own kernel function on the block, so results are those of the unfused program.
Operands that are not computed in the group ("inputs") are either of the full shape (cut into
the same blocks of rows) or broadcast over the leading dimensions that are cut (passed whole);
an input made by a broadcast is read from the broadcast's operand (the compiler passes it with
ones where it broadcasts). With the jit on (``jit.py``), the members that have a compiled form
run as compiled loops over the block instead, with the same results.

Planned by :func:`plan_groups` when a computation is compiled; :func:`fused_kernel` makes the
step's function. Only big outputs (at least :data:`MIN_ELEMENTS`) are fused: below that the
arrays stay in cache anyway and a single numpy call is cheaper than the block loop.

In a loop body the small arrays are fused too, differently (:func:`plan_small_groups`,
:func:`small_kernel`): a body runs once per step in Python, and its numpy calls on small
arrays cost about a microsecond each whatever their size, so a small model's step is mostly
the cost of calling. A group of compiled members (all must have a compiled form) runs as one
compiled loop nest over the whole result, and may have several outputs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator import jit, parallel

__all__ = ["BLOCK_ELEMENTS", "MIN_ELEMENTS", "Group", "Member", "SmallGroup", "fused_kernel", "plan_groups",
           "plan_small_groups", "small_kernel"]

# Elements of one block of the output (128 KiB of float32: a few of them fit in L2).
BLOCK_ELEMENTS = 1 << 15
# The same when the group runs as compiled loops (jit.py), which keep most intermediate values
# in registers: bigger blocks cost nothing in cache and save per-block work.
JIT_BLOCK_ELEMENTS = 1 << 16
# Outputs smaller than this are not fused.
MIN_ELEMENTS = 1 << 17


@dataclass(frozen=True)
class Member:
    """One fused step: ``fn`` (a kernel function, called with a list of operands) or, for a
    plain ufunc, ``ufunc``; ``args`` index the block's values (inputs first, then the
    members' results in order)."""

    fn: Callable[[Sequence[Any]], Any]
    ufunc: np.ufunc | None
    args: tuple[int, ...]
    dtype: np.dtype | None = None  # of the result
    expr: str | None = None        # its compiled form (jit.expression), if it has one


@dataclass(frozen=True)
class Group:
    """Steps ``members`` (indices into the computation's steps, in program order; the last
    one is the root, whose value the group produces) and their ``inputs`` (slots)."""

    members: tuple[int, ...]
    inputs: tuple[int, ...]


def plan_groups(
    ins: Sequence[tuple[int, ...]],
    outs: Sequence[int],
    fusible: Sequence[bool],
    dims: dict[int, tuple[int, ...] | None],
    keep: set[int],
) -> list[Group]:
    """Groups of steps to fuse.

    Step ``k`` reads slots ``ins[k]`` and writes slot ``outs[k]``; ``fusible[k]`` says it is
    element-wise; ``dims`` gives every slot's shape (None for tuples); slots in ``keep``
    (the result) must stay materialized. Groups are formed from the last step backwards: a
    fusible producer joins its consumer's group when it has the same output shape and every
    reader of its value is in the group.
    """
    producer = {o: k for k, o in enumerate(outs)}
    readers: dict[int, set[int]] = {}
    for k, slots in enumerate(ins):
        for s in slots:
            readers.setdefault(s, set()).add(k)
    grouped: set[int] = set()
    groups: list[Group] = []
    for root in range(len(outs) - 1, -1, -1):
        if not fusible[root] or root in grouped:
            continue
        shape = dims.get(outs[root])
        if shape is None or math.prod(shape) < MIN_ELEMENTS:
            continue
        members = {root}
        changed = True
        while changed:  # until no producer can join (a diamond may need two passes)
            changed = False
            for m in sorted(members, reverse=True):
                for s in ins[m]:
                    p = producer.get(s)
                    if p is None or p in members or p in grouped or not fusible[p] or s in keep:
                        continue
                    if dims.get(s) != shape or not readers.get(s, set()) <= members:
                        continue
                    members.add(p)
                    changed = True
        order = tuple(sorted(members))
        made = {outs[m] for m in order}
        inputs: list[int] = []
        for m in order:
            for s in ins[m]:
                if s not in made and s not in inputs:
                    inputs.append(s)
        if _blocking(shape, [dims.get(s) for s in inputs]) is None:
            continue
        grouped.update(members)
        groups.append(Group(order, tuple(inputs)))
    groups.sort(key=lambda g: g.members[-1])
    return groups


@dataclass(frozen=True)
class SmallGroup:
    """Steps ``members`` (in program order; the group runs where the last one was), their
    ``inputs`` (slots) and ``exports``: the members whose values steps outside the group
    (or the computation's result) read, in order."""

    members: tuple[int, ...]
    inputs: tuple[int, ...]
    exports: tuple[int, ...]


def plan_small_groups(
    ins: Sequence[tuple[int, ...]],
    outs: Sequence[int],
    fusible: Sequence[bool],
    dims: dict[int, tuple[int, ...] | None],
    keep: set[int],
) -> list[SmallGroup]:
    """Groups of element-wise steps over small arrays to run as one compiled loop each
    (:func:`small_kernel`), where each step's own kernel call costs more than its
    arithmetic: an optimizer's update of a small variable is a dozen such steps.

    ``fusible[k]``: step ``k`` has a compiled form and a small output (the caller decides).
    Steps join in program order: a step joins the group of one of its operands' producers
    when its output has that group's shape and no step outside the group reads a member's
    value before this step (the group runs at its last member's place, so every value it
    reads is made before that, and every value it makes is read after). Several members
    may be read outside (multi-output groups: an Adam update makes the new moments and the
    new weights in one loop). Values in ``keep`` count as read at the end."""
    n = len(outs)
    producer = {o: k for k, o in enumerate(outs)}
    readers: dict[int, list[int]] = {}
    for k, slots in enumerate(ins):
        for s in slots:
            readers.setdefault(s, []).append(k)
    for s in keep:
        readers.setdefault(s, []).append(n)
    group_of: dict[int, int] = {}
    members: list[list[int]] = []
    # For each group, a heap of the steps outside it that read its members' values: it may
    # take a step k only while none of them comes before k (k itself then joins).
    later: list[list[int]] = []
    for k in range(n):
        if not fusible[k]:
            continue
        shape = dims.get(outs[k])
        found: set[int] = set()  # the groups of its operands' producers, of its shape
        for s in ins[k]:
            p = producer.get(s)
            if p is not None and p in group_of and dims.get(outs[p]) == shape:
                found.add(group_of[p])
        open_ = sorted((g for g in found if later[g][0] >= k), key=lambda g: -members[g][-1])
        # All the groups it reads from at once (the moments and the weights of one update
        # meet in its last steps), else the latest one, else a group of its own.
        chosen = open_ if len(open_) == len(found) else open_[:1]
        if not chosen:
            group_of[k] = len(members)
            members.append([k])
            later.append(sorted(readers.get(outs[k], [])) or [n])
            continue
        target = chosen[0]
        for g in chosen[1:]:
            for m in members[g]:
                group_of[m] = target
            members[target].extend(members[g])
            later[target].extend(later[g])
            members[g], later[g] = [], [n]
        members[target].sort()
        members[target].append(k)
        group_of[k] = target
        heap = [r for r in later[target] if r != k] + readers.get(outs[k], [])
        heapq.heapify(heap)
        later[target] = heap or [n]
    groups = []
    for ms in members:
        if len(ms) < 2:
            continue
        inside = set(ms)
        made = {outs[m] for m in ms}
        inputs: list[int] = []
        for m in ms:
            for s in ins[m]:
                if s not in made and s not in inputs:
                    inputs.append(s)
        exports = tuple(m for m in ms if any(r not in inside for r in readers.get(outs[m], ())))
        groups.append(SmallGroup(tuple(ms), tuple(inputs), exports))
    return groups


def small_kernel(
    shape: tuple[int, ...],
    input_dims: Sequence[tuple[int, ...]],
    members: Sequence[Member],
    jit_inputs: Sequence[tuple[np.dtype, Any]],
    exports: Sequence[int],
) -> Callable[[Sequence[Any]], Any] | None:
    """The function of a small group (:func:`plan_small_groups`): takes the group's inputs,
    returns the exported members' values (``exports``: indices into ``members``; a tuple
    when there are several), computed by one compiled loop nest (``jit.group_function``),
    bit for bit what the members' own kernels give. ``jit_inputs``: each input's dtype and,
    for a one-element constant, its value. None when the loop does not compile (the members
    then stay as they are)."""
    n_in = len(input_dims)

    def numpy_path(ops: Sequence[Any]) -> Any:
        """The members one after another with their own kernels (inputs the compiled loop
        cannot take)."""
        vals = list(ops)
        for m in members:
            args = [vals[j] for j in m.args]
            vals.append(m.ufunc(*args) if m.ufunc is not None else m.fn(args))
        if len(exports) == 1:
            return vals[n_in + exports[0]]
        return tuple(vals[n_in + e] for e in exports)

    if any(m.expr is None or m.dtype is None for m in members):
        return None
    nodes = [jit.Node(m.expr, m.args, np.dtype(m.dtype), _numpy_runner(m)) for m in members]
    inputs = [(np.dtype(d), tuple(dims), c) for (d, c), dims
              in zip(jit_inputs, input_dims, strict=True)]
    run = jit.group_function(tuple(shape), inputs, nodes, list(exports), numpy_path)
    if run is not None:
        run.compiled_group = True  # type: ignore[attr-defined]
    return run


def _blocking(
    shape: tuple[int, ...], input_dims: Sequence[tuple[int, ...] | None],
    block_elements: int | None = None,
) -> tuple[int, list[bool]] | None:
    """How to cut ``shape`` into blocks: ``(lead, full)`` where the first ``lead``
    dimensions are cut (flattened into rows) and ``full[j]`` says input j has them (else it
    broadcasts over them); None when no cut gives at least two blocks."""
    rank = len(shape)
    block_elements = block_elements or BLOCK_ELEMENTS
    for lead in range(rank, 0, -1):
        rows = math.prod(shape[:lead])
        block_rows = max(1, block_elements // max(1, math.prod(shape[lead:])))
        if rows <= block_rows:
            continue  # one block: nothing to gain
        full: list[bool] = []
        for d in input_dims:
            if d is None or len(d) > rank:
                return None
            padded = (1,) * (rank - len(d)) + tuple(d)
            if padded[:lead] == shape[:lead]:
                full.append(True)
            elif all(v == 1 for v in padded[:lead]):
                full.append(False)
            else:
                break
            if any(v not in (1, s) for v, s in zip(padded[lead:], shape[lead:], strict=True)):
                return None
        else:
            return lead, full
    return None


def fused_kernel(
    shape: tuple[int, ...],
    dtype: np.dtype,
    input_dims: Sequence[tuple[int, ...]],
    members: Sequence[Member],
    jit_inputs: Sequence[tuple[np.dtype, Any]] | None = None,
) -> Callable[[Sequence[Any]], np.ndarray]:
    """The function of a fused step: takes the group's inputs, returns the root's value
    (a new C-ordered array of ``shape`` and ``dtype``). With ``jit_inputs`` (each input's
    dtype, and its value if it is a one-element constant) and the jit on, members with a
    compiled form run as compiled loops (``jit.py``)."""
    block_elements = BLOCK_ELEMENTS
    plan = None
    use_jit = jit_inputs is not None and jit.enabled() and any(m.expr for m in members) \
        and all(m.dtype is not None for m in members)
    if use_jit:
        block_elements = JIT_BLOCK_ELEMENTS
        plan = _blocking(shape, list(input_dims), block_elements)
    if plan is None:
        block_elements = BLOCK_ELEMENTS
        plan = _blocking(shape, list(input_dims))
    if plan is None:
        raise ValueError(f"no blocking of {list(shape)} for inputs {list(input_dims)}")
    lead, full = plan
    rank = len(shape)
    rows = math.prod(shape[:lead])
    inner = shape[lead:]
    block_rows = max(1, block_elements // max(1, math.prod(inner)))
    starts = list(range(0, rows, block_rows))
    views = []
    for d, f in zip(input_dims, full, strict=True):
        padded = (1,) * (rank - len(d)) + tuple(d)
        views.append((rows, *padded[lead:]) if f else (None if not d else padded[lead:]))
    n_in = len(views)
    body = list(members[:-1])
    last = members[-1]
    last_args = last.args
    # A ufunc member may write its result into the block buffer of an earlier member's
    # result of the same dtype that nothing reads afterwards (fewer allocations).
    last_read = {}
    for k, m in enumerate(members):
        for j in m.args:
            last_read[j] = k
    # Values of the block's whole shape (the others broadcast: made from broadcast inputs only).
    whole = [f and tuple(v[1:]) == tuple(inner) for v, f in zip(views, full, strict=True)]
    for m in members:
        whole.append(any(whole[j] for j in m.args))
    into: list[int] = []
    for k, m in enumerate(body):
        target = -1
        if m.ufunc is not None and m.dtype is not None:
            for j in m.args:
                if j >= n_in and whole[j] and last_read.get(j) == k \
                        and members[j - n_in].dtype == m.dtype and m.args.count(j) == 1:
                    target = j
                    break
        into.append(target)
    steps = list(zip(body, into, strict=True))
    compiled = None
    if use_jit:
        assert jit_inputs is not None
        compiled = jit.block_function(
            tuple(inner), views, jit_inputs,
            [jit.Node(m.expr, m.args, np.dtype(m.dtype), _numpy_runner(m)) for m in members],
        )

    def run(ops: Sequence[Any], into: np.ndarray | None = None,
            lazy: dict[int, Callable[[int, int], np.ndarray]] | None = None) -> np.ndarray:
        """``into``: a C-contiguous array of the result's dtype and shape to write the
        result into; it may be one of the full-shaped inputs (each block reads its own
        elements before writing them), as for a donated parameter. ``lazy``: full-shaped
        inputs that are not arrays but functions giving rows a:b (``ops[j]`` is then
        ignored), computed block by block in a buffer of the thread that runs the block."""
        src = []
        for j, (v, view) in enumerate(zip(ops, views, strict=True)):
            if lazy and j in lazy:
                src.append(None)
                continue
            if view is not None:
                v = np.reshape(v, view)
                if compiled is not None:
                    v = np.ascontiguousarray(v)  # compiled loops take C-ordered arrays
            src.append(v)
        if into is not None and not (into.dtype == dtype and into.shape == tuple(shape)
                                     and into.flags.c_contiguous and into.flags.writeable):
            into = None
        out = np.empty((rows, *inner), dtype) if into is None else into.reshape((rows, *inner))

        def block(i: int) -> None:
            a = starts[i]
            b = a + block_rows
            vals = [v[a:b] if f and v is not None else v for v, f in zip(src, full, strict=True)]
            if lazy:
                for j, rows_of in lazy.items():
                    vals[j] = rows_of(a, min(b, rows))
            if compiled is not None:
                compiled(vals, out[a:b])
                return
            for m, t in steps:
                args = [vals[j] for j in m.args]
                if t >= 0:
                    vals.append(m.ufunc(*args, out=vals[t]))
                else:
                    vals.append(m.ufunc(*args) if m.ufunc is not None else m.fn(args))
            args = [vals[j] for j in last_args]
            dst = out[a:b]
            if last.ufunc is not None:
                last.ufunc(*args, out=dst)
            else:
                dst[...] = last.fn(args)

        parallel.run_parts(block, len(starts))
        return out.reshape(shape) if into is None else into

    run.jit = compiled is not None  # type: ignore[attr-defined]
    run.block_lead = lead  # type: ignore[attr-defined]  # leading dims cut into rows
    run.block_rows = block_rows  # type: ignore[attr-defined]  # rows (of those dims) a block
    # Which inputs are read at the result's own index (full shape): they may be ``into``.
    run.fused_inputs = tuple(  # type: ignore[attr-defined]
        bool(f) and tuple(v[1:]) == tuple(inner) for v, f in zip(views, full, strict=True)
    )
    return run


def _numpy_runner(m: Member) -> Callable[[list[Any], Any], Any]:
    """``m`` on numpy arrays: ``(args, out)`` -> its value (written into ``out`` if given)."""
    fn, ufunc = m.fn, m.ufunc

    def run(args: list[Any], out: Any) -> Any:
        if out is None:
            return ufunc(*args) if ufunc is not None else fn(args)
        if ufunc is not None:
            return ufunc(*args, out=out)
        out[...] = fn(args)
        return out

    return run
