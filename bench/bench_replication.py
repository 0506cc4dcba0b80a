"""Replication: the emulator's wall time for a replicated training step over one IPU's, and
the estimated throughput of ResNet-50 training on 1, 4 and 16 Bow IPUs.

    (a) BERT-Base with 4 layers (hidden 768, 12 heads), sequence length 128, FP32, SGD,
    effective batch 64 per weight update:
      one IPU:     micro-batch 4 x gradient accumulation 16          (16 micro-steps a call)
      2 replicas:  micro-batch 4 x gradient accumulation 8 x 2       (8 micro-steps each)
    target: 2 replicas <= 1.3x one IPU (emulating several IPUs costs their arithmetic, not
    more); the arithmetic of both is the same.

Each side runs ``fit`` for 2 epochs of one device call each (one weight update), under
IPUStrategy on the embedded device server; the first epoch (tracing, lowering, compiling,
the emulator's first run) is not timed. The time compared is the server's own Execute time
of the second call (``ExecuteReply.device_seconds``), so the host's side does not count.
The vocabulary is cut to 8,192 tokens (BERT's is 30,522): with the whole table, its gradient
accumulator and its gradient, the FP32 step does not fit in one IPU's tiles (the compile says
so, naming the tile), on one IPU or on each of two.

    (b) ResNet-50 (keras.applications, weights=None) training, mixed_float16, SGD, batch 4 per
    replica (batch 8 does not fit in a Bow IPU's tiles), on a Bow Pod16 (``bow-pod16``):
    ``tf_ipu.estimate(..., replicas=R, system="bow-pod16")`` for R = 1, 4, 16: images per
    second, the all-reduce of the gradients' share of the step, memory per IPU; without
    gradient accumulation (a weight update every step), then with 16 micro-batches of 4 per
    replica per weight update (``gradient_accumulation_steps_per_replica=16``: the all-reduce
    and the optimizer's update once per 16 micro-batches); and the time to train on
    ImageNet-1k (1,281,167 images, 90 epochs) on the 16 IPUs with that configuration.

    .venv/bin/python bench/run.py --only replication [--quick]

``--quick``: 2 layers, sequence length 64 (a smoke run; the target is for the full size).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

EFFECTIVE_BATCH = 64
MICRO_BATCH = 4
VOCAB = 8192  # see the module docstring


def _side(replicas: int, accumulation: int, layers: int, seq_len: int,
          data: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    import keras

    import tf_ipu
    from tf_ipu import runtime
    from tf_ipu.models.bert import bert_classifier, bert_encoder

    cfg = tf_ipu.IPUConfig()
    cfg.auto_select_ipus = replicas
    cfg.configure_ipu_system()
    keras.utils.set_random_seed(0)
    strategy = tf_ipu.IPUStrategy()
    with strategy.scope():
        model = bert_classifier(bert_encoder(layers=layers, hidden=768, heads=12,
                                             seq_len=seq_len, vocab=VOCAB), classes=2)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=accumulation)
        model.set_gradient_accumulation_options(
            gradient_accumulation_steps_per_replica=accumulation,
            gradient_accumulation_reduction_method="mean")
    rt = runtime.get_runtime()
    x, y = data
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    warm = time.perf_counter() - t0
    before = rt.call_stats()
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    wall = time.perf_counter() - t0
    after = rt.call_stats()
    calls = after["calls"] - before["calls"]
    return {"replicas": replicas, "accumulation": accumulation, "calls": int(calls),
            "device_seconds": (after["device_seconds"] - before["device_seconds"]) / calls,
            "client_seconds": (after["client_seconds"] - before["client_seconds"]) / calls,
            "epoch_seconds": wall, "first_epoch_seconds": warm,
            "updates": int(model.optimizer.iterations.numpy())}


def main(quick: bool = False) -> list[dict[str, Any]]:
    layers, seq_len = (2, 64) if quick else (4, 128)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (EFFECTIVE_BATCH, seq_len)).astype(np.int32)
    y = rng.integers(0, 2, EFFECTIVE_BATCH).astype(np.int32)
    print(f"(a) BERT-Base, {layers} layers, hidden 768, sequence {seq_len}, vocabulary {VOCAB}, FP32, "
          f"micro-batch {MICRO_BATCH}, effective batch {EFFECTIVE_BATCH} per weight update "
          f"(one device call); server Execute seconds of the second call")
    one = _side(1, EFFECTIVE_BATCH // MICRO_BATCH, layers, seq_len, (x, y))
    print(f"  one IPU:    accumulation {one['accumulation']:2d}: "
          f"{one['device_seconds']:.2f} s per call (client {one['client_seconds']:.2f} s; "
          f"first epoch {one['first_epoch_seconds']:.1f} s)")
    two = _side(2, EFFECTIVE_BATCH // MICRO_BATCH // 2, layers, seq_len, (x, y))
    print(f"  2 replicas: accumulation {two['accumulation']:2d}: "
          f"{two['device_seconds']:.2f} s per call (client {two['client_seconds']:.2f} s; "
          f"first epoch {two['first_epoch_seconds']:.1f} s)")
    ratio = two["device_seconds"] / one["device_seconds"]
    print(f"  2 replicas / one IPU at effective batch {EFFECTIVE_BATCH}: {ratio:.2f}x "
          f"(target <= 1.3x){'' if not quick else ' [quick: smaller model]'}")
    assert one["updates"] == two["updates"] == 2, (one["updates"], two["updates"])
    rows = [{"part": "bert", **one}, {"part": "bert", **two}, {"part": "bert", "ratio": ratio}]
    return rows + _resnet50_on_bow()


ACCUMULATION = 16            # part (b): micro-batches per replica per weight update
IMAGENET_1K = 1_281_167      # ImageNet-1k training images
EPOCHS = 90


def _resnet50_on_bow() -> list[dict[str, Any]]:
    import keras

    from tf_ipu.estimate import build_model, estimate

    policy = keras.mixed_precision.global_policy()
    model = build_model("resnet50", "fp16")
    try:
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
        print("(b) ResNet-50 training, mixed_float16, SGD, batch 4 per replica, Bow Pod16 "
              "(tf_ipu.estimate, the tile model)")
        # One estimate per replica count: its step is the row without accumulation, the same
        # step with the weight update once per ACCUMULATION micro-batches the row with it.
        trains = {r: estimate(model, 4, training=True, ipu_version="bow", replicas=r,
                              system="bow-pod16", gradient_accumulation_steps_per_replica=ACCUMULATION,
                              dataset_size=IMAGENET_1K, epochs=EPOCHS) for r in (1, 4, 16)}
        rows = []
        print("  without gradient accumulation (a weight update every step of 4 per replica):")
        single = trains[1].step.throughput
        for replicas, train in trains.items():
            est = train.step
            rows.append({"part": "resnet50", "replicas": replicas, "images_per_s": est.throughput,
                         "seconds": est.seconds, "all_reduce_share": est.all_reduce_share,
                         "peak_tile_bytes": est.peak_tile_bytes, "fits": est.fits})
            print(f"  {replicas:2d} Bow IPU{'s' if replicas > 1 else ' '}: "
                  f"{est.throughput:9,.0f} images/s ({est.throughput / single:5.2f}x one IPU), "
                  f"{est.seconds * 1e3:6.2f} ms a step, all-reduce {est.all_reduce_share:5.1%} "
                  f"of it; peak tile {est.peak_tile_bytes:,} B per IPU"
                  f"{'' if est.fits else ' (DOES NOT FIT)'}")
        print(f"  with gradient accumulation {ACCUMULATION} ({ACCUMULATION} micro-batches of 4 per "
              f"replica per weight update; all-reduce and optimizer update once per update):")
        single = trains[1].throughput
        for replicas, train in trains.items():
            rows.append({"part": "resnet50", "replicas": replicas, "accumulation": ACCUMULATION,
                         "effective_batch": train.effective_batch, "images_per_s": train.throughput,
                         "seconds_per_micro_batch": train.seconds,
                         "seconds_per_update": train.seconds_per_update,
                         "all_reduce_share": train.all_reduce_share,
                         "update_cycles": train.update_cycles,
                         "accumulate_cycles": train.accumulate_cycles,
                         "peak_tile_bytes": train.peak_tile_bytes, "fits": train.fits})
            print(f"  {replicas:2d} Bow IPU{'s' if replicas > 1 else ' '}: "
                  f"{train.throughput:9,.0f} images/s ({train.throughput / single:5.2f}x one IPU), "
                  f"{train.seconds * 1e3:6.2f} ms a micro-batch, {train.seconds_per_update * 1e3:6.1f} "
                  f"ms an update of {train.effective_batch:,} images, all-reduce "
                  f"{train.all_reduce_share:5.1%} of it; peak tile {train.peak_tile_bytes:,} B "
                  f"per IPU with the accumulators{'' if train.fits else ' (DOES NOT FIT)'}")
        pod = trains[16]
        print(f"  ImageNet-1k with the estimate's configuration (batch 4, FP32 images streamed "
              f"in, no pipelining): {pod.time_to_train_summary()}")
        rows.append({"part": "resnet50", "time_to_train_s": pod.time_to_train_s,
                     "dataset_size": IMAGENET_1K, "epochs": EPOCHS, "updates": pod.updates(),
                     "system": "bow-pod16", "replicas": 16, "accumulation": ACCUMULATION,
                     "effective_batch": pod.effective_batch, "configuration": pod.configuration()})
        return rows
    finally:
        keras.mixed_precision.set_global_policy(policy)


if __name__ == "__main__":
    main("--quick" in sys.argv)
