"""bench/parallel.py: a part's independent calls in spawned workers give the same values, in the
same order, with the same printed text, as in process; the worker count (BENCH_JOBS, CPUs,
memory); mlperf_pods' plan counts when its rounds are estimated apart. Without TensorFlow
(the workers import only this module); about 5 s."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from bench import bench_mlperf, parallel


def synthetic_case(case: dict) -> dict:
    """A stand-in for bench_fit_cases.run_case: a deterministic row from the case (work that
    takes a while, more for larger cases, so workers finish out of order), printed as well."""
    digest = case["id"].encode()
    for _ in range(case["work"]):
        digest = hashlib.sha256(digest).digest()
    time.sleep(0.05 * case["work"] / 10_000)
    row = {"id": case["id"], "peak_tile_bytes": int.from_bytes(digest[:4], "big"),
           "verdict": "fits" if digest[0] % 2 else "out of memory", "pid": os.getpid()}
    print(f"  {case['id']}: {row['verdict']} {row['peak_tile_bytes']:,} B")
    return row


def failing_case(case: dict) -> dict:
    raise ValueError(f"case {case['id']} failed")


CASES = [{"id": f"case-{i}", "work": w} for i, w in enumerate((40_000, 1_000, 30_000, 5, 20_000))]


def _calls(function: str = "synthetic_case") -> list[parallel.Call]:
    return [(__name__, function, (case,)) for case in CASES]


def test_parallel_rows_and_output_equal_the_sequential(capsys: pytest.CaptureFixture[str]) -> None:
    sequential = list(parallel.run(_calls(), 1))
    printed_sequential = capsys.readouterr().out
    # Cost puts the smallest case first, so the workers finish out of the calls' order.
    side_by_side = list(parallel.run(_calls(), 2, cost=[-c["work"] for c in CASES]))
    printed_parallel = capsys.readouterr().out

    def without_pid(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "pid"} for r in rows]

    assert [r["id"] for r in side_by_side] == [c["id"] for c in CASES]
    assert without_pid(side_by_side) == without_pid(sequential)
    assert printed_parallel == printed_sequential
    assert printed_parallel.index("case-0") < printed_parallel.index("case-4")
    assert {r["pid"] for r in sequential} == {os.getpid()}
    assert os.getpid() not in {r["pid"] for r in side_by_side}   # made in workers


def worker_threads(_: int) -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in parallel.WORKER_THREADS}


def test_workers_run_one_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in parallel.WORKER_THREADS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")   # set by the user: kept
    seen = list(parallel.run([(__name__, "worker_threads", (i,)) for i in range(2)], 2))
    for env in seen:
        assert env == {k: "3" if k == "OMP_NUM_THREADS" else "1" for k in parallel.WORKER_THREADS}
    assert all(k not in os.environ for k in parallel.WORKER_THREADS if k != "OMP_NUM_THREADS")


def test_an_error_in_a_worker_is_raised_here() -> None:
    with pytest.raises(ValueError, match="case case-0 failed"):
        list(parallel.run(_calls("failing_case"), 2))


def test_worker_count() -> None:
    cpus = os.cpu_count() or 1
    assert parallel.workers(8, {}, available_gb=1000)[0] == min(cpus, 8)
    assert parallel.workers(8, {"BENCH_JOBS": "1"}, available_gb=1000) == (1, "BENCH_JOBS=1")
    n, why = parallel.workers(8, {"BENCH_JOBS": "4"}, available_gb=13.5)
    assert n == 2 and "14 GB available: at most 2" in why          # one per 6 GB
    assert parallel.workers(8, {"BENCH_JOBS": "4"}, available_gb=2)[0] == 1
    n, why = parallel.workers(3, {"BENCH_JOBS": "4"}, available_gb=100)
    assert n == 3 and "3 calls" in why
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match=f"BENCH_JOBS='{bad}'"):
            parallel.workers(8, {"BENCH_JOBS": bad})


def test_mem_available_reads_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert parallel.mem_available_gb(str(meminfo)) == pytest.approx(12.288)
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert parallel.mem_available_gb(str(meminfo)) is None
    assert parallel.mem_available_gb(str(tmp_path / "absent")) is None


def test_plan_counts_of_rounds_estimated_apart_are_those_of_one_run() -> None:
    # Counts as _bert_pod_rows gives them per round (v1.0: Pod16 + Pod64; v1.1: Pod16 + Pod64
    # + Pod128 sharing the pods' plan; v2.0: Pod16 + three pods), and as the saved sequential
    # run (bench/results/mlperf_pods.json, one _plan_once around all rounds) recorded them.
    per_round = [[{"planned_once": {"plans": 2, "reused": 0}}],
                 [{"planned_once": {"plans": 2, "reused": 0}},
                  {"planned_once": {"plans": 2, "reused": 1}}],
                 [{"planned_once": {"plans": 2, "reused": 0}},
                  {"planned_once": {"plans": 2, "reused": 1}},
                  {"planned_once": {"plans": 2, "reused": 2}}]]
    rows = bench_mlperf.cumulative_plan_counts(per_round)
    assert [(r["planned_once"]["plans"], r["planned_once"]["reused"]) for r in rows] == [
        (2, 0), (4, 0), (4, 1), (6, 1), (6, 2), (6, 3)]


def test_the_whole_sequence_runs_fuzz_quick_and_only_fuzz_the_million(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import run

    asked: dict[str, list[bool]] = {}

    def part(name: str):
        return lambda quick: asked.setdefault(name, []).append(quick)

    monkeypatch.setattr(run, "BENCHES", {"estimate": part("estimate"), "fuzz": part("fuzz")})
    run.main(["--results", ""])
    assert asked == {"estimate": [False], "fuzz": [True]}
    out = capsys.readouterr().out
    assert "python bench/run.py --only fuzz" in out and "(fuzz: " in out and "minutes: " in out
    run.main(["--only", "fuzz", "--results", ""])
    assert asked["fuzz"] == [True, False]
