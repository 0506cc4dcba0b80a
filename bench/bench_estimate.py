"""The tile model at full size: ResNet50 (keras.applications, weights=None) on every preset,
and BERT-Base training.

    ResNet50 inference at batch 1 and a training step (SGD, sparse cross-entropy) at batch 8;
    BERT-Base (tf_ipu.models.bert_encoder: 12 layers, hidden 768, sequence 128, no dropout,
    with a 2-class classifier, Adam) training at batch 8; each lowered once and planned for
    GC2, GC200 and Bow: compile-and-plan time (target < 30 s each on a 2-core machine),
    latency, throughput, peak tile memory in the memory-aware schedule beside HLO emission
    order's (docs/tile_model.md, "The schedule"), fits or not.

Run::

    .venv/bin/python bench/run.py --only estimate [--quick]
    .venv/bin/python bench/bench_estimate.py [--quick]

``--quick`` plans each program once instead of keeping the best of two plannings.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESETS = ("ipu1", "ipu2", "bow")


def _lowered(model, training: bool, batch: int, name: str = "resnet50"):
    import json

    import tensorflow as tf

    from tf_ipu.lowering.program import lower_function

    shape = [batch, *model.inputs[0].shape[1:]]
    if training:
        def fn(x, y):
            return model.train_step((x, y))

        specs = [tf.TensorSpec(shape, model.inputs[0].dtype), tf.TensorSpec([batch], tf.int32)]
    else:
        def fn(x):
            return model(x, training=False)

        specs = [tf.TensorSpec(shape, tf.float32)]
    t0 = time.perf_counter()
    lowered = lower_function(fn, specs, f"{name}/{'train_step' if training else 'predict'}[batch={batch}]")
    kinds = {n: {"arg": "argument", "var": "variable", "const": "constant"}[p["kind"]]
             for n, p in enumerate(json.loads(lowered.signature)["params"])}
    return lowered, kinds, time.perf_counter() - t0


def main(quick: bool = False) -> None:
    import keras

    from device_server.emulator import compile_module, get_target
    from device_server.emulator.compiler import CompileOptions
    from device_server.emulator.tiles import estimate_module
    from tf_ipu.models import bert_classifier, bert_encoder

    t0 = time.perf_counter()
    model = keras.applications.ResNet50(weights=None)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy())
    print(f"  build ResNet50: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    bert = bert_classifier(bert_encoder(12, 768, 12, 128, dropout=0.0), 2)
    bert.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    print(f"  build BERT-Base: {time.perf_counter() - t0:.1f} s")
    programs = ((model, "resnet50", False, 1, "img"), (model, "resnet50", True, 8, "img"),
                (bert, "bert-base", True, 8, "seq"))
    for net, name, training, batch, unit in programs:
        what = f"{name} {'training step' if training else 'inference'} batch {batch}"
        lowered, kinds, lower_s = _lowered(net, training, batch, name)
        n = sum(len(c.instructions) for c in lowered.module.computations)
        print(f"  {what}: lowered in {lower_s:.1f} s ({n:,} IR instructions)")
        for preset in PRESETS:
            target = get_target(preset)
            best = float("inf")
            for _ in range(1 if quick else 2):
                t1 = time.perf_counter()
                est = estimate_module(lowered.module, None, target, param_kinds=kinds)
                best = min(best, time.perf_counter() - t1)
            est.items_per_call = batch
            # The server's path: compile (kernels + plan) with the program as it arrives.
            t2 = time.perf_counter()
            compile_module(lowered.module, target, CompileOptions(allow_out_of_memory=True))
            compile_s = time.perf_counter() - t2
            print(f"    {target.product:6s} plan {best:5.2f} s, compile+plan {compile_s:5.2f} s, "
                  f"lower+plan {lower_s + best:5.1f} s | {est.seconds * 1e3:8.3f} ms/step "
                  f"{est.throughput:9,.1f} {unit}/s | {est.supersteps:5,} supersteps, "
                  f"{est.efficiency:5.1%} of FP16 peak | peak tile {est.peak_tile_bytes:,} B "
                  f"(HLO order {est.hlo_order_peak_tile_bytes:,} B, "
                  f"{_saved(est)}) of {est.tile_bytes_limit:,} B: "
                  f"{'fits' if est.fits else 'DOES NOT FIT'}")


def _saved(est) -> str:
    """What the schedule saved on the fullest tile, and which order was kept."""
    hlo = est.hlo_order_peak_tile_bytes
    if est.memory_order != "scheduled" or hlo <= 0:
        return "HLO order kept"
    if est.peak_tile_bytes >= hlo:
        return "the same scheduled"
    return f"schedule -{(hlo - est.peak_tile_bytes) / hlo:.1%}"


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
