"""Training throughput of Graphcore's MLPerf Training runs, read from their result logs.

    mlcommons/training_results_v1.0 | v1.1 | v2.0  (fetched git mirrors)
        Graphcore/results/<system>/<benchmark>/result_<n>.txt   (MLLOG lines)
          --> one ``<time-to-train row id>-throughput`` row per run (metric items_per_s)

The time-to-train rows of ``measurements.jsonl`` (run_start to run_stop) mix training,
evaluation and host work; these rows isolate training: ResNet-50, the median over the run's
epochs of 1,281,167 images / (epoch_stop - epoch_start); BERT, the median over the run's
training blocks of the samples the block trained (the ``epoch_num`` of the evaluation that
ends it, minus the previous one) / (block_stop - block_start). Each row also carries what the
log states of the configuration (``gradient_accumulation_steps``) and the micro-batch per
replica it implies for ResNet-50 (one IPU per replica: global batch / (IPUs x accumulation)).
BERT's pipeline depth, and so its replicas and micro-batch, are in the submission's
configuration files, not in the log (bench/bench_mlperf.py states the ones it uses); its
samples are sequences, packed about 2 to a 512-token row in the closed division.

This is a data-extraction tool, run once per table update (the rows are in the table; CI
does not fetch the mirrors)::

    .venv/bin/python -m bench.calibration.mlperf_logs /work/.mirror/mlcommons+training_results_v{1.0,1.1,2.0}/repo > rows.jsonl
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from bench.calibration.table import Measurement, load_measurements

IMAGENET_TRAIN = 1_281_167
SEQUENCES_PER_ROW = 2  # sequences per packed row in the closed BERT configs (avg_seq_per_pack)


def _mllog(repo: str, path: str) -> list[dict[str, Any]]:
    text = subprocess.run(["git", "--git-dir", repo, "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout
    out = []
    for line in text.splitlines():
        if line.startswith(":::MLLOG "):
            out.append(json.loads(line[len(":::MLLOG "):]))
    return out


def _value(log: list[dict[str, Any]], key: str) -> Any:
    return next((e["value"] for e in log if e["key"] == key), None)


def resnet_throughput(log: list[dict[str, Any]]) -> tuple[float, int]:
    """Median images/s over the run's epochs, and the number of epochs."""
    starts = {e["metadata"]["epoch_num"]: e["time_ms"] for e in log if e["key"] == "epoch_start"}
    stops = {e["metadata"]["epoch_num"]: e["time_ms"] for e in log if e["key"] == "epoch_stop"}
    rates = [IMAGENET_TRAIN / ((stops[n] - starts[n]) / 1e3) for n in starts if n in stops
             and stops[n] > starts[n]]
    return statistics.median(rates), len(rates)


def bert_throughput(log: list[dict[str, Any]]) -> tuple[float, int]:
    """Median sequences/s over the run's training blocks, and the number of blocks."""
    rates, start, done = [], None, 0
    block_ms: float | None = None  # the training block the next evaluation ends
    for e in log:
        if e["key"] == "block_start":
            start = e["time_ms"]
        elif e["key"] == "block_stop" and start is not None:
            block_ms, start = e["time_ms"] - start, None
        elif e["key"] == "eval_accuracy" and block_ms is not None:
            samples = e["metadata"]["epoch_num"]
            if samples > done:
                rates.append((samples - done) / (block_ms / 1e3))
            done, block_ms = samples, None
    return statistics.median(rates), len(rates)


def rows_for(repo: str, time_rows: Sequence[Measurement]) -> list[dict[str, Any]]:
    """The throughput row of each time-to-train row's run, read from its log in ``repo``."""
    out = []
    for row in time_rows:
        path = row.where.split(" ", 1)[0]
        p = dict(row.params)
        log = _mllog(repo, path)
        accumulation = _value(log, "gradient_accumulation_steps")
        if p["benchmark"] == "resnet":
            rate, n = resnet_throughput(log)
            replicas, how = p["n_devices"], f"median over the run's {n} epochs of {IMAGENET_TRAIN:,} images / (epoch_stop - epoch_start)"
            micro = p["global_batch_size"] / (replicas * accumulation) if accumulation else None
        elif p["benchmark"] == "bert":
            rate, n = bert_throughput(log)
            # the pipeline's depth (IPUs per replica) is in the submission's configuration
            # files, not in the log: neither replicas nor micro-batch are derived here
            replicas, micro = None, None
            how = f"median over the run's {n} training blocks of the samples trained in the block / (block_stop - block_start)"
        else:
            continue
        params = {**p, "gradient_accumulation_steps": accumulation, "replicas": replicas,
                  "micro_batch_per_replica": (round(micro, 3) if micro is not None else None)}
        out.append({
            "id": f"{row.id}-throughput", "source": row.source, "chip": row.chip,
            "op_class": "e2e_training", "params": params, "metric": "items_per_s",
            "value": round(rate, 1), "uncertainty": 0.0, "how": "text",
            "where": f"{path} (MLLOG epoch/block start and stop time_ms; {how})",
            "excluded": row.excluded,
            "notes": ("Training throughput of the run whose time-to-train row is "
                      f"{row.id}. BERT samples are sequences (closed division: packed, about "
                      f"{SEQUENCES_PER_ROW} per 512-token row). "
                      "End-to-end training: not in the declared validation set (README), never fitted."),
        })
    return out


def main(repos: list[str]) -> int:
    rows = load_measurements()
    for repo in repos:
        version = next(v for v in ("v1.0", "v1.1", "v2.0") if f"training_results_{v}" in repo)
        mine = [r for r in rows if r.source == f"mlperf-train-{version}"
                and r.op_class == "e2e_training" and r.metric == "seconds"]
        for r in rows_for(repo, mine):
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
