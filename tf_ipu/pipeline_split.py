"""A suggested pipeline split: stages that balance estimated cycles within each IPU's memory.

    suggest_pipeline(model, ipus=4, batch_size=1, ipu_version="ipu2")
      1. the tile model estimates one training (or inference) step on one IPU, per layer:
         cycles of its forward and backward ops  (tf_ipu.estimate, est.layers)
      2. each layer call's memory: its weights, their gradient and optimizer state (the
         optimizer's variables for them), and its output activations kept for the backward
         pass (x the micro-batches a Grouped pipeline keeps in flight on the first stage;
         x 1 with recomputation)
      3. contiguous stages over the calls in the order the model runs them: the split that
         minimises the slowest stage's cycles, each stage's memory within an IPU's
         (dynamic programming over split points, exact for that objective)
      4. checked by the tile model (``check``): the pipelined model planned stage by stage
         on its IPUs, as tf_ipu.estimate plans it; a stage whose IPU does not fit gets a
         budget smaller by its overflow and 3 is run again (at most ``_CHECK_ROUNDS`` times)
    ->  PipelineSuggestion: .stages (what set_pipeline_stage_assignment takes), per stage
        cycles, bytes and its layers, the balance (slowest / mean)

Graphcore's popliner finds split points from a compiled profile of the real hardware; this
one balances the tile model's estimated cycles as well as memory, with no hardware and no
profile. Each IPU's budget leaves a fraction of its memory for what the per-layer sums do
not see (code, exchange buffers, temporaries): ``memory_fraction``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tf_ipu import pipelining

__all__ = ["PipelineSuggestion", "suggest_pipeline"]


@dataclass
class PipelineSuggestion:
    """A stage per layer call (iterating it gives them, so
    ``model.set_pipeline_stage_assignment(suggestion)`` takes it), and why."""

    stages: list[int]
    layers: list[str]                       # the layer call of each entry of ``stages``
    stage_cycles: list[float]               # estimated cycles of each stage (fwd + bwd)
    stage_bytes: list[int]                  # estimated memory of each stage
    ipu_bytes: int                          # the budget of one IPU
    ipu_version: str
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[int]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def balance(self) -> float:
        """The slowest stage's cycles over the stages' mean (1.0: perfectly balanced)."""
        mean = sum(self.stage_cycles) / len(self.stage_cycles)
        return max(self.stage_cycles) / mean if mean > 0 else 1.0

    def summary(self) -> str:
        lines = [f"suggested pipeline of {len(self.stage_cycles)} stages on {self.ipu_version} "
                 f"IPUs (balance {self.balance:.2f}: slowest stage / mean):"]
        for s, (cycles, nbytes) in enumerate(zip(self.stage_cycles, self.stage_bytes, strict=True)):
            names = [n for n, st in zip(self.layers, self.stages, strict=True) if st == s]
            lines.append(f"  stage {s}: {cycles:,.0f} cycles, {nbytes / 2**20:,.1f} MiB of "
                         f"{self.ipu_bytes / 2**20:,.0f} MiB; layers {names[0]} .. {names[-1]} "
                         f"({len(names)})")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _itemsize(dtype: Any) -> int:
    return int(np.dtype(getattr(dtype, "name", dtype) if dtype is not None else "float32").itemsize)


def _output_bytes(layer: Any, node_index: int, batch_size: int) -> int:
    nodes = getattr(layer, "_inbound_nodes", [])
    outputs = []
    if node_index < len(nodes):
        outputs = list(getattr(nodes[node_index], "output_tensors", []) or [])
    if not outputs:
        try:  # a layer called only inside a subclassed model's call() has no node, no output
            out = getattr(layer, "output", None)
        except ValueError:
            out = None
        outputs = out if isinstance(out, (list, tuple)) else [out] if out is not None else []
    total = 0
    for t in outputs:
        shape = [batch_size if d is None else int(d) for d in getattr(t, "shape", ())]
        total += int(math.prod(shape)) * _itemsize(getattr(t, "dtype", "float32"))
    return total


def _weight_bytes(layer: Any, optimizer: Any) -> int:
    """A layer's weights, their gradients, and the optimizer's variables for them (slots of
    the same shape: momenta, accumulators)."""
    slots = 0
    if optimizer is not None:
        shapes = [tuple(v.shape) for v in getattr(optimizer, "variables", [])]
        trainable = [tuple(v.shape) for v in getattr(optimizer, "_trainable_variables", [])]
        slots = max(0, round((len(shapes) - 1) / max(1, len(trainable)))) if trainable else 0
    total = 0
    for w in getattr(layer, "weights", []):
        n = int(math.prod(int(d) for d in w.shape)) * _itemsize(w.dtype)
        total += n * ((2 + slots) if w.trainable else 1)
    return total


def _layer_cycles(est: Any) -> dict[str, float]:
    """Estimated cycles per Keras layer, forward and backward together."""
    cycles: dict[str, float] = {}
    for row in est.layers:
        name = str(row.get("layer", ""))
        if name.endswith(" (backward)"):
            name = name[: -len(" (backward)")]
        cycles[name] = cycles.get(name, 0.0) + float(row.get("cycles", 0.0))
    return cycles


_CHECK_ROUNDS = 4


def _split(cycles: list[float], nbytes: list[int], stages: int,
           budget: int | list[int]) -> list[int] | None:
    """Contiguous groups of the items into ``stages`` stages, minimising the slowest stage's
    cycles with every stage's bytes within ``budget`` (one for all, or one per stage; None:
    no such split). Exact: dynamic programming over (items placed, stages used)."""
    budgets = list(budget) if isinstance(budget, list) else [budget] * stages
    n = len(cycles)
    c = [0.0, *np.cumsum(cycles).tolist()]
    b = [0, *np.cumsum(nbytes).tolist()]
    inf = float("inf")
    best = [[inf] * (stages + 1) for _ in range(n + 1)]
    cut = [[-1] * (stages + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):  # stage k takes items j .. i-1
                if best[j][k - 1] == inf or b[i] - b[j] > budgets[k - 1]:
                    continue
                worst = max(best[j][k - 1], c[i] - c[j])
                if worst < best[i][k]:
                    best[i][k], cut[i][k] = worst, j
    if best[n][stages] == inf:
        return None
    assignment = [0] * n
    i, k = n, stages
    while k > 0:
        j = cut[i][k]
        for item in range(j, i):
            assignment[item] = k - 1
        i, k = j, k - 1
    return assignment


def suggest_pipeline(model: Any, ipus: int, batch_size: int = 1, ipu_version: str = "ipu2",
                     training: bool = True, memory_fraction: float = 0.85,
                     micro_batches_in_flight: int | None = None, recomputation: bool = False,
                     check: bool = True, **estimate_kwargs: Any) -> PipelineSuggestion:
    """Suggests a stage for each layer call of ``model`` over ``ipus`` IPUs (one stage each).

    Args:
        model: a built Keras model (compiled, for ``training``).
        ipus: stages, one per IPU.
        batch_size: the micro-batch.
        ipu_version: the IPUs' version ("ipu1", "ipu2", "bow").
        training: balance a training step (forward and backward), else inference.
        memory_fraction: of each IPU's memory, what the stage's weights, optimizer state and
            activations may take (the rest: code, exchange, temporaries).
        micro_batches_in_flight: activations a stage keeps per layer output (a Grouped
            pipeline keeps up to 2 (S - 1) + 1 on its first stage); default that bound for
            training, 1 for inference.
        recomputation: the backward pass recomputes each stage's forward activations from
            its input: a layer's outputs are kept for one micro-batch, not for all in flight
            (the stage's input checkpoints, a small part, are not counted).
        check: plan the suggested pipeline with the tile model (stage ``s`` on IPU ``s``,
            ``2 * ipus`` micro-batches per weight update, Grouped) and, while an IPU does
            not fit, split again with that stage's budget cut by its overflow; the notes
            say what the tile model found. Costs one pipelined estimate per round.
        **estimate_kwargs: passed to ``tf_ipu.estimate`` (``input_spec``, ``label_spec``, ...).

    Returns:
        A ``PipelineSuggestion`` (``model.set_pipeline_stage_assignment(suggestion)``).

    Raises:
        ValueError: fewer IPUs than 1, more IPUs than layer calls, or no split that fits
            (naming the largest layer and the budget).
        TileModelError: the tile model failed on the model (from ``tf_ipu.estimate``).
    """
    from device_server.emulator.arch import get_target
    from tf_ipu.estimate import estimate

    if not isinstance(ipus, int) or isinstance(ipus, bool) or ipus < 1:
        raise ValueError(f"suggest_pipeline: ipus must be an int >= 1. Received: {ipus!r}")
    calls = [(a.layer, getattr(a, "node_index", 0))
             for a in pipelining.get_pipeline_stage_assignment(model)]
    if ipus > len(calls):
        raise ValueError(f"suggest_pipeline: {ipus} stages for {len(calls)} layer calls: at "
                         f"most {len(calls)}.")
    target = get_target(ipu_version, int(estimate_kwargs.get("tiles_per_ipu", 0) or 0))
    budget = int(target.tiles_per_ipu * target.sram_bytes_per_tile * memory_fraction)
    est = estimate(model, batch_size, training=training, ipu_version=ipu_version, **estimate_kwargs)
    step = getattr(est, "step", est)  # a TrainingEstimate wraps the step's Estimate
    per_layer = _layer_cycles(step)
    in_flight = micro_batches_in_flight or (2 * (ipus - 1) + 1 if training and not recomputation
                                            else 1)
    optimizer = getattr(model, "optimizer", None) if training else None
    seen: set[int] = set()
    names, cycles, nbytes = [], [], []
    counted = 0.0
    for layer, index in calls:
        calls_of_layer = sum(1 for lyr, _ in calls if lyr is layer)
        c = per_layer.get(layer.name, 0.0) / calls_of_layer
        counted += c
        weights = 0 if id(layer) in seen else _weight_bytes(layer, optimizer)
        seen.add(id(layer))
        acts = _output_bytes(layer, index, batch_size) * (in_flight if training else 1)
        names.append(layer.name + (f" (call {index})" if index else ""))
        cycles.append(c)
        nbytes.append(weights + acts)
    notes = []
    total = sum(float(r.get("cycles", 0.0)) for r in step.layers)
    if total > 0 and counted < 0.5 * total:
        notes.append(f"only {counted / total:.0%} of the step's estimated cycles are in the "
                     f"model's layers (the rest: loss, optimizer, plumbing), which are not split")
    assignment = _split(cycles, nbytes, ipus, budget)
    if assignment is None:
        largest = int(np.argmax(nbytes))
        raise ValueError(
            f"suggest_pipeline: no split of {getattr(model, 'name', 'the model')} over {ipus} "
            f"{target.product} IPUs keeps every stage within {budget:,} bytes "
            f"({memory_fraction:.0%} of an IPU's memory); the largest layer, "
            f"{names[largest]!r}, needs {nbytes[largest]:,} bytes. Use more IPUs, a smaller "
            f"batch, or recomputation.")
    if check and ipus > 1:
        assignment = _checked(model, assignment, cycles, nbytes, ipus, budget, batch_size,
                              ipu_version, training, recomputation, notes, estimate_kwargs)
    stage_cycles = [sum(c for c, s in zip(cycles, assignment, strict=True) if s == k)
                    for k in range(ipus)]
    stage_bytes = [sum(b for b, s in zip(nbytes, assignment, strict=True) if s == k)
                   for k in range(ipus)]
    return PipelineSuggestion(assignment, names, stage_cycles, stage_bytes, budget,
                              target.product, notes)


def _checked(model: Any, assignment: list[int], cycles: list[float], nbytes: list[int],
             ipus: int, budget: int, batch_size: int, ipu_version: str, training: bool,
             recomputation: bool, notes: list[str], estimate_kwargs: dict[str, Any]) -> list[int]:
    """``assignment`` checked by the tile model, re-split while an IPU does not fit (see
    ``suggest_pipeline``); the model's own stages and options are restored."""
    from tf_ipu import accumulation
    from tf_ipu.estimate import estimate

    attrs = (pipelining._ASSIGNMENT_ATTR, pipelining._OPTIONS_ATTR, accumulation._OPTIONS_ATTR)
    saved = {a: getattr(model, a) for a in attrs if hasattr(model, a)}
    budgets = [budget] * ipus
    try:
        for round_ in range(1, _CHECK_ROUNDS + 1):
            pipelining.set_pipeline_stage_assignment(model, assignment)
            pipelining.set_pipelining_options(
                model, gradient_accumulation_steps_per_replica=2 * ipus,
                device_mapping=list(range(ipus)))
            est = estimate(model, batch_size, training=training, ipu_version=ipu_version,
                           recomputation=recomputation, **estimate_kwargs)
            step = getattr(est, "step", est)
            over = {int(i["ipu"]): i["peak_tile_bytes"] / step.tile_bytes_limit
                    for i in step.ipus if not i["fits"]}
            if not over:
                notes.append("checked by the tile model: every IPU fits (peak tiles "
                             + ", ".join(f"{i['peak_tile_bytes']:,}" for i in step.ipus)
                             + f" of {step.tile_bytes_limit:,} B; round {round_})")
                return assignment
            for s, ratio in over.items():
                used = sum(b for b, st in zip(nbytes, assignment, strict=True) if st == s)
                budgets[s] = int(min(budgets[s], used) / ratio * 0.98)
            again = _split(cycles, nbytes, ipus, budgets)
            what = ", ".join(f"IPU {s} by {ratio - 1:.1%}" for s, ratio in sorted(over.items()))
            if again is None or again == assignment:
                notes.append(f"the tile model finds the split does not fit ({what}) and no "
                             f"split within tighter budgets exists: use more IPUs, "
                             f"recomputation or a smaller micro-batch")
                return assignment
            notes.append(f"round {round_}: the tile model found {what} over; split again "
                         f"with that budget cut")
            assignment = again
        notes.append(f"still over after {_CHECK_ROUNDS} rounds of the tile model's check")
        return assignment
    finally:
        for a in attrs:
            if a in saved:
                object.__setattr__(model, a, saved[a])
            elif hasattr(model, a):
                object.__delattr__(model, a)
