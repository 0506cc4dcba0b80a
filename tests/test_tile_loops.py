"""The tile model's loops: a while loop's per-iteration stash (TensorListPushBack, a
dynamic-update-slice into a loop-carried buffer) is laid out as popops' createSliceableTensor
lays out a tensor sliced along its first dimension: spread over many tiles, each holding its
part of every step (docs/tile_model.md, "Loops")."""

from __future__ import annotations

from typing import Any

import pytest

from device_server.emulator.tiles import TileMapping
from device_server.emulator.tiles import report as tile_report
from device_server.emulator.tiles.mapping import Allocator


def _lstm_training_plan(monkeypatch: pytest.MonkeyPatch, steps: int) -> tuple[Any, Any]:
    """(estimate, plan) of one training step of a small Keras LSTM over ``steps`` steps."""
    import tf_ipu

    captured: dict[str, Any] = {}
    plan_module = tile_report.plan_module

    def keep(module: Any, *args: Any, **kwargs: Any) -> Any:
        captured["plan"] = plan_module(module, *args, **kwargs)
        return captured["plan"]

    monkeypatch.setattr(tile_report, "plan_module", keep)
    estimate = tf_ipu.estimate(_model(steps), 16, training=True, ipu_version="ipu2")
    return estimate, captured["plan"]


def _stashes(plan: Any, steps: int) -> list[Any]:
    """The dynamic-update-slices writing into a sliceable stack of ``steps`` positions."""
    return [r for r in plan.ops.values() if r.opcode == "dynamic-update-slice"
            and r.mapping is not None and r.mapping.slices == steps]


def test_lstm_stash_is_spread_over_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = 64
    estimate, plan = _lstm_training_plan(monkeypatch, steps)
    stashes = _stashes(plan, steps)
    # The forward loop pushes its per-step values (gates, states, inputs) onto stacks of
    # [steps, 16, ...]: each is sliceable over hundreds of tiles, not the few of one step.
    assert len(stashes) >= 3
    for r in stashes:
        unsliced = r.mapping.elements // steps  # split as createSliceableTensor does
        assert r.mapping.tiles == -(-unsliced // -(-unsliced // 1472)) >= 128, r
        assert r.mapping.max_elements <= steps * -(-r.mapping.elements // steps // r.mapping.tiles)

    # The same step with every stash forced onto one tile (what a layout by the per-step
    # slice would approach): that tile holds them all, and the peak is far higher.
    def one_tile(self: Allocator, elements: int, itemsize: int, slices: int) -> TileMapping:
        return TileMapping(0, 1, max(1, int(elements)), self.total_tiles)

    monkeypatch.setattr(Allocator, "sliceable", one_tile)
    import tf_ipu

    packed = tf_ipu.estimate(_model(steps), 16, training=True, ipu_version="ipu2")
    assert estimate.peak_tile_bytes < packed.peak_tile_bytes / 2, (
        estimate.peak_tile_bytes, packed.peak_tile_bytes)


def _model(steps: int) -> Any:
    """A Keras LSTM (32 units) over ``steps`` steps of 8 features, then a Dense."""
    import keras

    inputs = keras.Input((steps, 8))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(32)(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _computations(plan: Any) -> list[Any]:
    """The plan's computation plans: the entry and everything it calls (loop bodies too)."""
    found: list[Any] = []
    todo = [plan.entry]
    while todo:
        comp = todo.pop()
        if any(comp is c for c in found):
            continue
        found.append(comp)
        todo += [c for p in comp.points for alts in p.subs for c in alts]
    return found


def test_a_stash_update_is_written_over_the_loop_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The body's dynamic-update-slice of a stash writes one step's slice in place into the
    loop state, which the caller holds live across the loop: the updated stash is the same
    buffer, not a second one (docs/tile_model.md, "Loops")."""
    import tf_ipu
    from device_server.emulator.tiles import control
    from device_server.emulator.tiles.liveness import stored

    steps = 64
    estimate, plan = _lstm_training_plan(monkeypatch, steps)
    updates = [(comp, b) for comp in _computations(plan) for b in comp.bufs
               if b.instr.opcode == "dynamic-update-slice" and b.mapping is not None
               and b.mapping.slices == steps]
    assert len(updates) >= 3
    for comp, b in updates:
        assert b.inplace and not any(b is s for s in stored(comp)), b
    # Stored a second time (what the tile model did before), the stashes count twice while
    # the forward loop runs: the fullest tile gains about one more copy of them.
    per_tile = sum(b.mapping.max_elements * b.itemsize for _, b in updates)
    monkeypatch.setattr(control, "_write_over", lambda body, old, new: None)
    twice = tf_ipu.estimate(_model(steps), 16, training=True, ipu_version="ipu2")
    assert twice.peak_tile_bytes - estimate.peak_tile_bytes > 0.5 * per_tile, (
        twice.peak_tile_bytes, estimate.peak_tile_bytes, per_tile)
