"""The tile model's calibration: its errors on published points, and what the assumptions move.

    (a) every published IPU point of bench/calibration/measurements.jsonl: measured,
        estimated, ratio, held out or fitted (or why not compared); the fitted figures; per
        operation class the held-out error exp(mean |ln(estimated / measured)|) and the worst,
        "uncalibrated" below 3 held-out points from 2 sources (bench/calibration/fit.py);
        and whether device_server/emulator/calibration.json holds what the fit gives
    (a2) the end-to-end fit on the one-host MLPerf runs, replayed from their cached breakdowns
        (bench/results/mlperf_breakdowns.json, bench/calibration/e2e.py): per fold the scales
        fitted, per run and per class the held-out error of the fit beside the single
        constant's, whether it is adopted, and whether calibration.json holds it
    (b) each preset: how many of its figures are published, fitted, assumed
    (c) sensitivity: each assumed figure of the GC200 preset halved and doubled, the change
        of the main estimates (ResNet-50 and BERT-Base inference at batch 8: time, peak tile)
    (d) the end-to-end validation set named in bench/calibration/README.md (Graphcore's Mk2
        inference tables, Kacher et al. on GC2): its points, estimated where present
    (e) the launch article's case at small batch: ResNeXt-101 32x4d and BERT-Base (sequence
        128) inference on one GC2, FP16, batch 1 to 64: latency and throughput, the published
        figures beside them where the table has them

    .venv/bin/python bench/run.py --only calibration [--quick]

``--quick``: (c) on ResNet-50 only with 4 figures, (e) at batch 1 and 8.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SWEEP = (1, 2, 4, 8, 16, 32, 64)


def _fit() -> list[dict[str, Any]]:
    from bench.calibration import fit

    t0 = time.perf_counter()
    result = fit.calibrate()
    print("(a) calibration against the published measurements")
    fit.report(result)
    e2e_res = fit.e2e_result()
    section = fit.e2e.data_section(e2e_res, fit.e2e.load_cache())
    diffs = fit.agrees(result, section)
    print("(a2) end to end")
    fit.e2e.report(e2e_res)
    check = section.get("replay_check") or {}
    if check:
        print(f"  replay check (re-estimated once with {check['scales']}): worst |ln(replayed / "
              f"re-estimated)| {check['worst_ln_difference']:.4f} "
              f"({'within' if check['accurate'] else 'OUTSIDE'} {check['tolerance']})")
    print("  device_server/emulator/calibration.json " + (
        "holds what the fits give" if not diffs else "DIFFERS: " + "; ".join(diffs)))
    print(f"  ({time.perf_counter() - t0:.1f} s)")
    rows: list[dict[str, Any]] = [{"part": "a", "class": c, **e} for c, e in result["classes"].items()]
    rows.append({"part": "a", "figures": {f.name: result["figures"][f.name] for f in fit.FIGURES},
                 "agrees": not diffs})
    rows.append({"part": "a2", **{k: e2e_res[k] for k in ("folds", "runs", "fit", "baseline",
                                                          "unfitted", "classes", "fitted",
                                                          "adopted", "why")},
                 "replay_check": check or None})
    for p in result["points"]:
        if p.m.is_ipu:
            rows.append({"part": "a", "id": p.m.id, "measured": p.m.value, "estimated": p.estimated,
                         "held_out_estimate": p.held_out_estimate, "status": p.status})
    return rows


def _presets() -> list[dict[str, Any]]:
    from device_server.emulator import arch

    print("(b) the presets' figures: published (with a source), fitted (bench/calibration), assumed")
    rows = []
    for name, t in arch.PRESETS.items():
        n = arch.calibration_summary(name)
        total = sum(n.values())
        print(f"  {t.product:<6} ({name}): {n['published']} published, {n['fitted']} fitted, "
              f"{n['assumed']} assumed of {total} figures ({(n['published'] + n['fitted']) / total:.0%} "
              f"published or fitted)")
        rows.append({"part": "b", "preset": name, **n})
    return rows


def _captured(model: Any, batch: int, ipu_version: str) -> tuple[Any, dict[int, str]]:
    """The lowered program and parameter kinds ``tf_ipu.estimate`` plans (lowered once)."""
    import importlib

    est_mod = importlib.import_module("tf_ipu.estimate")
    seen: dict[str, Any] = {}
    original = est_mod.estimate_module

    def capture(module: Any, live: Any, target: Any, **kw: Any) -> Any:
        seen["module"], seen["kinds"] = module, kw.get("param_kinds")
        return original(module, live, target, **kw)

    est_mod.estimate_module = capture
    try:
        est_mod.estimate(model, batch, ipu_version=ipu_version)
    finally:
        est_mod.estimate_module = original
    return seen["module"], seen["kinds"]


def _sensitivity(quick: bool) -> list[dict[str, Any]]:
    import keras

    from device_server.emulator import arch
    from device_server.emulator.tiles import estimate_module
    from tf_ipu.models.bert import bert_encoder

    preset = "ipu2"
    base = arch.get_target(preset)
    assumed = [f for f, (kind, _) in arch.provenance(preset).items() if kind == "assumed"
               and isinstance(getattr(base, f), (int, float)) and getattr(base, f)
               and not f.endswith("_cycle_scale")]  # a class's cycles times the factor, no more
    if quick:
        assumed = assumed[:4]
    models = [("ResNet-50", keras.applications.ResNet50(weights=None))]
    if not quick:
        models.append(("BERT-Base", bert_encoder(layers=12, hidden=768, heads=12, seq_len=128,
                                                 vocab=30522, dropout=0.0)))
    print(f"(c) sensitivity of the main estimates to each assumed figure of {base.product}: the "
          f"figure x0.5 and x2, estimated time and peak tile over the preset's (inference, batch 8)")
    rows = []
    for label, model in models:
        t0 = time.perf_counter()
        module, kinds = _captured(model, 8, preset)
        ref = estimate_module(module, None, base, param_kinds=kinds)
        print(f"  {label}: {ref.seconds * 1e3:.3f} ms, peak tile {ref.peak_tile_bytes:,} B "
              f"(lowered in {time.perf_counter() - t0:.1f} s)")
        for name in assumed:
            value = getattr(base, name)
            cells = []
            for factor in (0.5, 2.0):
                v = type(value)(max(1, round(value * factor)) if isinstance(value, int) else value * factor)
                if name.endswith("_efficiency") or name == "available_memory_proportion":
                    v = min(1.0, v)
                est = estimate_module(module, None, dataclasses.replace(base, **{name: v}),
                                      param_kinds=kinds)
                cells.append((factor, est.seconds / ref.seconds, est.peak_tile_bytes / ref.peak_tile_bytes))
                rows.append({"part": "c", "model": label, "figure": name, "factor": factor,
                             "time_ratio": est.seconds / ref.seconds,
                             "peak_ratio": est.peak_tile_bytes / ref.peak_tile_bytes})
            print(f"    {name:<38} " + "   ".join(f"x{f:g}: time {tr:.3f}x, peak {pr:.3f}x"
                                                   for f, tr, pr in cells))
    return rows


def _validation() -> list[dict[str, Any]]:
    from bench.calibration.table import load_measurements, load_sources

    sources = load_sources()
    named = ("graphcore-mk2-perf", "kacher2020")
    ms = [m for m in load_measurements() if m.source in named and m.usable]
    print("(d) end-to-end validation set (named in bench/calibration/README.md before any fit; "
          "never fitted; target within 1.5x)")
    for key in named:
        src = sources.get(key)
        got = [m for m in ms if m.source == key]
        status = f"read: {src.read}" if src is not None else "not in sources.json"
        print(f"  {key}: {len(got)} usable point(s) ({status})"
              + ("" if got else ": its figures could not be read here, so nothing is validated "
                                "end to end yet"))
    return [{"part": "d", "source": key, "points": sum(1 for m in ms if m.source == key)}
            for key in named]


def _small_batch(quick: bool) -> list[dict[str, Any]]:
    import keras

    import tf_ipu
    from bench.calibration.table import load_measurements
    from tf_ipu.models.bert import bert_encoder
    from tf_ipu.models.resnext import resnext

    sizes = (1, 8) if quick else _SWEEP
    published = [m for m in load_measurements() if m.op_class == "e2e_inference" and m.is_ipu
                 and m.chip == "GC2"]
    print(f"(e) inference at small batch on one GC2 (FP16, estimates), batch {', '.join(map(str, sizes))}")
    rows = []
    keras.mixed_precision.set_global_policy("float16")
    try:
        for label, build in (("ResNeXt-101 32x4d", lambda: resnext(depth=101)),
                             ("BERT-Base seq 128", lambda: bert_encoder(
                                 layers=12, hidden=768, heads=12, seq_len=128, vocab=30522,
                                 dropout=0.0))):
            model = build()
            t0 = time.perf_counter()
            sweep = tf_ipu.estimate_sweep(model, list(sizes), ipu_version="ipu1")
            print(f"  {label} ({time.perf_counter() - t0:.0f} s):")
            for pt in sweep.points:
                print(f"    batch {pt['batch_size']:3d}: {pt['latency_s'] * 1e3:8.3f} ms, "
                      f"{pt['throughput']:10,.1f} items/s{'' if pt['fits'] else ' (DOES NOT FIT)'}")
                rows.append({"part": "e", "model": label, **pt})
            last = sweep.estimates[-1]
            print("    " + next((n for n in last.notes if n.startswith("expected error")),
                                "expected error: -"))
            mine = [m for m in published if label.split()[0].lower() in str(m.params.get("model", "")).lower()]
            print(f"    published GC2 figures: {len(mine)}" + (
                "" if mine else " (Kacher et al. and Graphcore's 2019 C2 figures could not be "
                                "read here: bench/calibration/sources.json)"))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return rows


def main(quick: bool = False) -> list[dict[str, Any]]:
    rows = _fit()
    rows += _presets()
    rows += _validation()
    rows += _sensitivity(quick)
    rows += _small_batch(quick)
    return rows


if __name__ == "__main__":
    main("--quick" in sys.argv)
