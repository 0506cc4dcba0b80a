"""The executable cache on disk: what a restarted device server saves on a real training step.

For each model's training step (forward, backward, Adam; lowered once with
``tf_ipu.lowering.program.lower_function``), a fresh ``python -m device_server`` with an empty
``--executable-cache-path`` compiles it and runs it twice ("cold"); then a new server process
on the same folder does the same ("disk"). Printed: the Compile call's time, the first and
second Execute, and the ratios disk/cold of the Compile call and of Compile plus the first
Execute (which, for an executable loaded from disk, generates its program: kernels, fused
loops compiled by numba). The outputs of both first runs must be equal bit for bit. Each
pair runs three times (once with ``--quick``) and the best of each kind (by Compile plus the
first Execute) is kept: on a shared 2-core machine single runs vary by a second.

    .venv/bin/python bench/run.py --only disk_cache
    .venv/bin/python bench/bench_disk_cache.py

Models: an MLP (16-32-16-4), a small ResNeXt (``tf_ipu.models.resnext``, one block per stage,
cardinality 4, 32x32x3, batch 8) and a 2-layer BERT classifier (hidden 128, 4 heads, sequence
64, batch 8).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_step(model: Any, x_spec: Any, y_spec: Any) -> Any:
    import keras
    import tensorflow as tf

    from tf_ipu.lowering.program import lower_function

    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt.build(model.trainable_variables)

    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return lower_function(step, [x_spec, y_spec], "train_step").module


def _models() -> list[tuple[str, Any]]:
    import keras
    import tensorflow as tf

    from tf_ipu.models.bert import bert_classifier, bert_encoder
    from tf_ipu.models.resnext import resnext

    mlp = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                            keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
    net = resnext(blocks=(1, 1, 1, 1), cardinality=4, width=4, input_shape=(32, 32, 3), classes=10)
    bert = bert_classifier(bert_encoder(layers=2, hidden=128, heads=4, seq_len=64, vocab=1000,
                                        dropout=0.0), 2)
    labels = tf.TensorSpec([8], tf.int64)
    return [
        ("mlp", _train_step(mlp, tf.TensorSpec([16, 16], tf.float32), tf.TensorSpec([16], tf.int64))),
        ("resnext", _train_step(net, tf.TensorSpec([8, 32, 32, 3], tf.float32), labels)),
        ("bert", _train_step(bert, tf.TensorSpec([8, 64], tf.int32), labels)),
    ]


def _once(folder: str, module: Any) -> dict[str, Any]:
    """Compile and two Executes in a new server process on ``folder``."""
    import numpy as np

    from tf_ipu.client import DeviceClient
    from tf_ipu.local_server import start_local_server

    server = start_local_server(extra_args=["--executable-cache-path", folder])
    try:
        with DeviceClient(server.address, run_timeout=600) as c:
            c.open_session()
            c.attach(1)
            t0 = time.perf_counter()
            compiled = c.compile(module)
            t1 = time.perf_counter()
            rng = np.random.default_rng(0)
            args = [rng.standard_normal(p.shape).astype(p.dtype) if p.dtype.kind == "f"
                    else np.zeros(p.shape, p.dtype) for p in compiled.parameters]
            out = c.execute(compiled.executable_id, args)
            t2 = time.perf_counter()
            c.execute(compiled.executable_id, args)
            t3 = time.perf_counter()
            counters = c.counters()
    finally:
        server.stop()
    return {"compile_s": t1 - t0, "first_s": t2 - t1, "second_s": t3 - t2,
            "cache_hit": compiled.cache_hit, "compiles": counters["compiles"],
            "disk_cache_hits": counters["disk_cache_hits"],
            "outputs": [o.tobytes() for o in out]}


def main(quick: bool = False) -> list[dict[str, Any]]:
    rows = []
    for name, module in _models():
        n = sum(len(c.instructions) for c in module.computations)
        colds, disks = [], []
        for _ in range(1 if quick else 3):
            folder = tempfile.mkdtemp(prefix="tf_ipu_bench_cache_")
            try:
                colds.append(_once(folder, module))
                disks.append(_once(folder, module))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        same = all(r["outputs"] == colds[0]["outputs"] for r in colds + disks)
        cold, disk = (dict(min(rs, key=lambda r: r["compile_s"] + r["first_s"])) for rs in (colds, disks))
        cold.pop("outputs")
        disk.pop("outputs")
        row = {"model": name, "instructions": n, "cold": cold, "disk": disk, "same_outputs": same,
               "compile_ratio": disk["compile_s"] / cold["compile_s"],
               "first_result_ratio": (disk["compile_s"] + disk["first_s"])
               / (cold["compile_s"] + cold["first_s"])}
        rows.append(row)
        for kind, r in (("cold", cold), ("disk", disk)):
            print(f"  {name:8s} ({n:5,} instr.) {kind}: Compile {r['compile_s']:6.3f} s, "
                  f"first Execute {r['first_s']:6.3f} s, second {r['second_s']:6.3f} s "
                  f"(cache_hit={r['cache_hit']}, compiles={r['compiles']}, "
                  f"disk_cache_hits={r['disk_cache_hits']})")
        print(f"  {name:8s} disk/cold: Compile {row['compile_ratio']:.3f}, Compile + first "
              f"Execute {row['first_result_ratio']:.3f}; outputs bit for bit: {same}")
    return rows


if __name__ == "__main__":
    main("--quick" in sys.argv)
