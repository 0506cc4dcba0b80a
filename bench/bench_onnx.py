"""ONNX front end (issue 16): conformance, speed, and the ResNeXt-101 comparison with a GPU.

    (a) onnx's node tests of the families in tests/data/make_onnx_node_tests.py (the whole
        committed list, tests/data/onnx_node_tests.txt, without the tests of FP8, FP4, INT4,
        INT2 and E8M0 data types) and the nine model tests of real architectures, through
        onnx's own runner (onnx.backend.test.BackendTest) and reference outputs, for
        tf_ipu.onnx.backend and for onnxruntime's backend (onnxruntime.backend, as shipped;
        models stamped with an IR version above 13, which it cannot read, are re-stamped 13):
        the pass rate per family. Target for ours: >= 95%. Then the nine real architectures
        again with their weights re-drawn at random (bench/onnx_models.py light_model), ours
        against onnxruntime on the same weights.
    (b) ResNet-50 (keras.applications, weights=None, exported with tf2onnx) inference at
        batch 8, FP32: the wall time of OnnxModel.run (gRPC to the embedded device server
        included) after a warm-up, median of 5, over onnxruntime's on CPU
        (intra_op_num_threads=2, ORT_ENABLE_ALL), median of 5. Target: <= 2x.
    (c) ResNeXt-101 32x4d (tf_ipu/models/resnext.py, exported with tf2onnx) in FP16 (as
        PopRT converts), estimated by the tile model at batch sizes 1..64 on one GC2
        (ipu_version="ipu1") and on a C2 card's two IPUs (system="c2", a replica per IPU, the
        batch size per IPU); run numerically at batch 1 and checked against onnxruntime.
        Beside it the GPU roofline (tf_ipu/onnx/gpu_roofline.py, NVIDIA V100 SXM2) on the
        same ONNX graph, first checked against NVIDIA's published V100 figures for
        ResNeXt101-32x4d (bench/calibration/measurements.jsonl, source nvidia-dle-rnxt101),
        with ONE efficiency parameter fitted on them if it is off by more than 1.5x; then the
        IPU/GPU ratios at each batch size. The plot: bench/results/onnx-resnext.svg.

    .venv/bin/python bench/run.py --only onnx [--quick]

``--quick``: a fifth of the node tests, two real architectures, batch sizes 1, 8, 64.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
import time
import unittest
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "data" / "onnx_node_tests.txt"
SVG = ROOT / "bench" / "results" / "onnx-resnext.svg"
EXOTIC = re.compile(r"FLOAT8|FLOAT4|INT4|INT2|E8M0", re.IGNORECASE)
REAL = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
        "squeezenet", "vgg19", "zfnet512")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ORT_MAX_IR = 13  # onnxruntime 1.31.1 reads IR versions up to 13 (onnx 1.23.2 writes 14)


# ----------------------------------------------------------------------------- (a)


def _families() -> list[str]:
    sys.path.insert(0, str(LIST.parent))
    from make_onnx_node_tests import FAMILIES

    return sorted(FAMILIES, key=len, reverse=True)


def _family(name: str, families: list[str]) -> str:
    for f in families:  # longest first: "reduce_mean" before "reduce"
        if name == f"test_{f}" or name.startswith(f"test_{f}_"):
            return f
    return "?"


def _ort_backend() -> Any:
    import onnx
    import onnxruntime.backend as ort_backend
    from onnx.backend.base import Backend

    class OrtBackend(Backend):
        """onnxruntime.backend, with models of IR version > 13 re-stamped 13 (a format
        version it cannot read; nothing else changed)."""

        @classmethod
        def is_compatible(cls, model: Any, device: str = "CPU", **kwargs: Any) -> bool:
            return ort_backend.is_compatible(model, device, **kwargs)

        @classmethod
        def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> Any:
            if isinstance(model, onnx.ModelProto) and model.ir_version > ORT_MAX_IR:
                m = onnx.ModelProto()
                m.CopyFrom(model)
                m.ir_version = ORT_MAX_IR
                model = m
            return ort_backend.prepare(model, device, **kwargs)

        @classmethod
        def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> Any:
            return cls.prepare(model, device, **kwargs).run(inputs)

        @classmethod
        def supports_device(cls, device: str) -> bool:
            return ort_backend.supports_device(device)

    return OrtBackend


def _run_tests(backend: Any, kind: str, names: list[str]) -> dict[str, str]:
    """onnx's runner on each test: "pass", "fail", "error" or "skip"."""
    import onnx.backend.test

    bt = onnx.backend.test.BackendTest(backend, "bench_onnx")
    items = bt._test_items[kind]
    out = {}
    for n in names:
        item = items.get(f"{n}_cpu")
        if item is None:
            out[n] = "missing"
            continue
        case = type("T", (unittest.TestCase,), {"test": item.func})("test")
        result = unittest.TestResult()
        case.run(result)
        out[n] = ("skip" if result.skipped else "fail" if result.failures else "error" if result.errors
                  else "pass")
    return out


def _conformance(quick: bool) -> list[dict[str, Any]]:
    import onnx

    from tf_ipu.onnx.backend import TfIpuBackend

    names = [ln.strip() for ln in LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    held = [n for n in names if not EXOTIC.search(n)]
    if quick:
        held = held[::5]
    real = [f"test_{r}" for r in (("squeezenet", "shufflenet") if quick else REAL)]
    families = _families()
    print(f"(a) onnx {onnx.__version__} node tests of {len(set(_family(n, families) for n in held))} families "
          f"({len(held)} of the {len(names)} listed: {len(names) - len(held)} of FP8/FP4/INT4/INT2/E8M0 "
          f"types left out of both{'; quick: every 5th' if quick else ''}) + {len(real)} real architectures, "
          "onnx's runner and reference outputs")
    results = {}
    for label, backend in (("tf_ipu", TfIpuBackend), ("onnxruntime", _ort_backend())):
        started = time.perf_counter()
        r = _run_tests(backend, "NodeModel", held)
        r.update(_run_tests(backend, "RealModel", real))
        results[label] = (r, time.perf_counter() - started)
    by_family: dict[str, list[str]] = {}
    for n in held:
        by_family.setdefault(_family(n, families), []).append(n)
    by_family["(real architectures)"] = real
    print(f"  {'family':<22}{'tests':>6}{'tf_ipu':>9}{'onnxruntime':>13}")
    rows = []
    for fam, tests in sorted(by_family.items(), key=lambda kv: (kv[0].startswith("("), kv[0])):
        ours = sum(results["tf_ipu"][0][t] == "pass" for t in tests)
        ort = sum(results["onnxruntime"][0][t] == "pass" for t in tests)
        rows.append({"part": "conformance", "family": fam, "tests": len(tests), "tf_ipu_passed": ours,
                     "onnxruntime_passed": ort})
        print(f"  {fam:<22}{len(tests):>6}{ours / len(tests):>9.0%}{ort / len(tests):>13.0%}")
    everything = held + real
    for label in ("tf_ipu", "onnxruntime"):
        r, seconds = results[label]
        passed = sum(r[t] == "pass" for t in everything)
        failed = sorted(t for t in everything if r[t] != "pass")
        rows.append({"part": "conformance", "backend": label, "tests": len(everything), "passed": passed,
                     "rate": passed / len(everything), "seconds": seconds, "not_passed": failed})
        shown = ", ".join(f"{t} ({r[t]})" for t in failed[:8]) + (" ..." if len(failed) > 8 else "")
        print(f"  {label}: {passed}/{len(everything)} = {passed / len(everything):.1%} in {seconds:.0f} s"
              f"{' (target >= 95%)' if label == 'tf_ipu' else ''}; not passed: {shown or 'none'}")
    return rows + _reseeded(real)


def _reseeded(real: list[str]) -> list[dict[str, Any]]:
    import onnxruntime as ort

    import tf_ipu.onnx as tox
    from bench.onnx_models import light_model, with_logits
    from tf_ipu import errors as tf_errors
    from tf_ipu.onnx import device as onnx_device

    print("  real architectures with random weights (seed 0; the input of a final Softmax compared "
          "too), tf_ipu vs onnxruntime, FP32:")
    rows = []
    for test in real:
        name = test[len("test_"):]
        model = with_logits(light_model(name, seed=0))
        inp = model.graph.input[0]
        x = np.random.default_rng(1).standard_normal(
            [d.dim_value for d in inp.type.tensor_type.shape.dim]).astype(np.float32)
        refs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {inp.name: x})
        got, precision = None, "fp32"
        for attempt in range(2):
            try:
                m = tox.load(model, allow_out_of_memory=True)
                if not m.estimate.fits:  # a program that does not fit cannot run: its FP16 form may
                    precision = "fp16"
                    m = tox.load(model, precision="fp16")
                got = m.run({inp.name: x})
                break
            except tf_errors.NotFoundError as e:  # a session lost to missed heartbeats (busy machine)
                print(f"    ({name}: {str(e)[:90]}...; retrying once on a new session)")
                onnx_device.close_all()
                if attempt:
                    raise
        del m
        onnx_device.close_all()  # the server drops the programs (VGG-19's is ~1 GB)
        worst = max(float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))
                    for g, r in zip(got.values(), refs, strict=True))
        rows.append({"part": "reseeded", "model": name, "max_error_over_max_abs": worst,
                     "precision": precision})
        print(f"    {name:<14} max |ours - onnxruntime| / max |onnxruntime| = {worst:.1e}"
              f"{'' if precision == 'fp32' else ' (FP16 weights and arithmetic: in FP32 it does not fit a GC200)'}")
    return rows


# ----------------------------------------------------------------------------- (b)


def _ort_session(model: Any) -> Any:
    import onnx
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _resnet50(model: Any, quick: bool) -> list[dict[str, Any]]:
    import tf_ipu.onnx as tox

    name = model.graph.input[0].name
    x = np.random.default_rng(0).random((8, 224, 224, 3), np.float32)
    m = tox.load(model, batch_size=8)
    sess = _ort_session(model)
    reps = 3 if quick else 5
    ours, ort = [], []
    m.run({name: x})
    (ref,) = sess.run(None, {name: x})
    for _ in range(reps):  # interleaved: both see the same machine load
        t0 = time.perf_counter()
        got = m.run({name: x})
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sess.run(None, {name: x})
        ort.append(time.perf_counter() - t0)
    err = float(np.abs(next(iter(got.values())) - ref).max())
    ratio = statistics.median(ours) / statistics.median(ort)
    print("(b) ResNet-50 (keras.applications, weights=None, tf2onnx) inference, batch 8, FP32, "
          f"median of {reps} after a warm-up")
    print(f"  tf_ipu.onnx (OnnxModel.run, gRPC to the embedded server): {statistics.median(ours):.3f} s "
          f"(device {m._session.client.last_device_seconds:.3f} s of the last); onnxruntime CPU "
          f"(2 threads, ORT_ENABLE_ALL): {statistics.median(ort):.3f} s; ratio {ratio:.2f}x (target <= 2x); "
          f"max |difference| {err:.1e}")
    return [{"part": "resnet50", "tf_ipu_s": ours, "onnxruntime_s": ort, "ratio": ratio, "max_abs_diff": err}]


# ----------------------------------------------------------------------------- (c)


def _nvidia_rows() -> list[Any]:
    from bench.calibration.table import load_measurements

    return [r for r in load_measurements() if r.source == "nvidia-dle-rnxt101" and r.chip == "V100"
            and r.op_class == "e2e_inference"]


def _ipu_sweep(model: Any, batches: tuple[int, ...]) -> list[dict[str, Any]]:
    import tf_ipu.onnx as tox

    points = []
    for b in batches:
        for label, kwargs in (("GC2", {"batch_size": b, "ipu_version": "ipu1"}),
                              ("C2", {"batch_size": 2 * b, "replicas": 2, "system": "c2"})):
            t0 = time.perf_counter()
            m = tox.load(model, precision="fp16", allow_out_of_memory=True, **kwargs)
            e = m.estimate
            latency = float(e.details.get("latency_s") or e.seconds)
            items = kwargs["batch_size"]
            points.append({"device": label, "batch_size": b, "items_per_call": items, "latency_s": latency,
                           "throughput": items / latency, "fits": e.fits, "peak_tile_bytes": e.peak_tile_bytes,
                           "tile_bytes_limit": e.tile_bytes_limit, "load_seconds": time.perf_counter() - t0,
                           "compile_seconds": m.compile_seconds})
    return points


def _resnext(model: Any, quick: bool) -> list[dict[str, Any]]:
    import onnx

    import tf_ipu.onnx as tox
    from tf_ipu.onnx import gpu_roofline as gr

    batches = (1, 8, 64) if quick else BATCHES
    print(f"(c) ResNeXt-101 32x4d (tf_ipu/models/resnext.py, 224x224, random weights) -> tf2onnx "
          f"({len(model.graph.node)} ONNX nodes), FP16")
    # numerics at batch 1: the emulator against onnxruntime (FP32) on the same graph
    name = model.graph.input[0].name
    x = np.random.default_rng(0).random((1, 224, 224, 3), np.float32)
    t0 = time.perf_counter()
    m1 = tox.load(model, batch_size=1, precision="fp16", ipu_version="ipu1")
    got = next(iter(m1.run({name: x}).values()))
    run_s = time.perf_counter() - t0
    (ref,) = _ort_session(model).run(None, {name: x})
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    ok = rel <= 1e-2
    print(f"  batch 1 run on the emulated GC2 (FP16) vs onnxruntime (FP32): max |diff| / max |ref| = "
          f"{rel:.1e} (tolerance 1e-2: {'ok' if ok else 'EXCEEDED'}); load + compile + run {run_s:.1f} s")
    ipu = _ipu_sweep(model, batches)

    # the GPU roofline, checked against NVIDIA's published figures first
    published = gr.published_from_rows(_nvidia_rows())
    keys = sorted({(p.batch_size, p.precision) for p in published})
    raw = [gr.estimate(model, b, p) for b, p in keys]
    before = gr.check(raw, published)
    gpu = gr.V100_SXM2
    print(f"  GPU roofline: {gpu.name}: FP16 Tensor Core {gpu.fp16_tensor_flops / 1e12:g} TFLOP/s, FP32 "
          f"{gpu.fp32_flops / 1e12:g} TFLOP/s, {gpu.memory_bytes_per_s / 1e9:g} GB/s (NVIDIA V100 datasheet; "
          f"Volta whitepaper), {gpu.launch_s * 1e6:g} us a kernel (an ASSUMPTION)")
    print(f"  check against NVIDIA's published V100 ResNeXt101-32x4d inference (DeepLearningExamples, "
          f"PyTorch 20.06; {len(published)} points): roofline / published")
    for prec in ("fp16", "fp32"):
        cells = []
        for b in sorted({p.batch_size for p in published if p.precision == prec}):
            th = [p for p in before.points if p.published.batch_size == b and p.published.precision == prec]
            cells.append(f"b{b}: " + "/".join(f"{p.ratio:.2f}" for p in sorted(th, key=lambda p: p.published.metric,
                                                                                  reverse=True)))
        print(f"    {prec} (throughput/latency): " + ", ".join(cells))
    print(f"    typical error exp(mean |ln ratio|) = {before.typical_error:.2f}x")
    fitted = None
    if before.typical_error > 1.5:
        fit = gr.fit_efficiency(model, published)
        fitted = fit.gpu
        print(f"    off by more than 1.5x: ONE parameter fitted, efficiency (share of both peaks) = "
              f"{fitted.efficiency:.3f}, IN-SAMPLE typical error {fit.check.typical_error:.2f}x on the same "
              f"{len(published)} points (fitted on them: not a validation)")
        for prec in ("fp16", "fp32"):
            cells = [f"b{p.published.batch_size}: {p.ratio:.2f}" for p in fit.check.points
                     if p.published.precision == prec and p.published.metric == "latency_s"]
            print(f"      fitted, latency ratio {prec}: " + ", ".join(cells))
    gpu_model = fitted or gpu
    gpu_points = {b: gr.estimate(model, b, "fp16", gpu_model) for b in batches}
    peak_points = {b: gr.estimate(model, b, "fp16", gpu) for b in batches}
    nv = {(p.batch_size, p.metric): p.value for p in published if p.precision == "fp16"}

    print("  IPU: tile model estimates (FP16; the C2's batch size is per IPU, 2x the items per call); "
          "published IPU figures: NONE in the calibration table (Kacher et al. 2020 and Graphcore's C2 "
          "figures are not available here)")
    print("  GPU: the roofline " + (f"with the fitted efficiency {gpu_model.efficiency:.3f}" if fitted else
                                    "at peak") + "; NVIDIA's published V100 AMP figures beside it")
    head = (f"  {'batch':>5} | {'GC2 ms':>7} {'img/s':>7} | {'C2 ms':>7} {'img/s':>7} | {'V100 model ms':>13} "
            f"{'img/s':>7} | {'V100 publ. ms':>13} {'img/s':>7} | {'C2/V100 thr':>11} {'V100/GC2 lat':>12} | "
            f"{'vs publ.: thr':>13} {'lat':>6}")
    print(head)
    rows = []
    for b in batches:
        g1 = next(p for p in ipu if p["device"] == "GC2" and p["batch_size"] == b)
        c2 = next(p for p in ipu if p["device"] == "C2" and p["batch_size"] == b)
        gm = gpu_points[b]
        pub_lat, pub_thr = nv.get((b, "latency_s")), nv.get((b, "throughput"))
        thr_ratio, lat_ratio = c2["throughput"] / gm.throughput, gm.latency_s / g1["latency_s"]
        pub_thr_ratio = c2["throughput"] / pub_thr if pub_thr else None
        pub_lat_ratio = pub_lat / g1["latency_s"] if pub_lat else None
        fits = ("" if g1["fits"] else " GC2 does not fit") + ("" if c2["fits"] else " C2 does not fit")
        print(f"  {b:>5} | {g1['latency_s'] * 1e3:7.2f} {g1['throughput']:7.0f} | {c2['latency_s'] * 1e3:7.2f} "
              f"{c2['throughput']:7.0f} | {gm.latency_s * 1e3:13.2f} {gm.throughput:7.0f} | "
              f"{(pub_lat or math.nan) * 1e3:13.2f} {pub_thr or math.nan:7.0f} | {thr_ratio:10.2f}x "
              f"{lat_ratio:11.1f}x | {pub_thr_ratio or math.nan:12.2f}x {pub_lat_ratio or math.nan:5.1f}x{fits}")
        rows.append({"part": "resnext", "batch_size": b, "gc2": g1, "c2": c2,
                     "v100_model": {"latency_s": gm.latency_s, "throughput": gm.throughput,
                                    "efficiency": gpu_model.efficiency},
                     "v100_peak_roofline": {"latency_s": peak_points[b].latency_s,
                                            "throughput": peak_points[b].throughput},
                     "v100_published_amp": {"latency_s": pub_lat, "throughput": pub_thr},
                     "c2_over_v100_throughput": thr_ratio, "v100_over_gc2_latency": lat_ratio,
                     "c2_over_published_throughput": pub_thr_ratio, "published_over_gc2_latency": pub_lat_ratio})
    best_ipu = max(p["throughput"] for p in ipu if p["device"] == "C2" and p["fits"]) if any(
        p["fits"] for p in ipu if p["device"] == "C2") else math.nan
    best_gpu = max(e.throughput for e in gpu_points.values())
    best_pub = max((v for (_, k), v in nv.items() if k == "throughput"), default=math.nan)
    print(f"  best throughput: C2 (fitting) {best_ipu:,.0f} img/s; V100 model {best_gpu:,.0f} "
          f"({best_ipu / best_gpu:.2f}x); V100 published AMP {best_pub:,.0f} ({best_ipu / best_pub:.2f}x); "
          "the launch article: 3.4x throughput, up to 40x lower latency")
    print(f"  compile (tile model) per load: {min(p['compile_seconds'] for p in ipu):.1f}-"
          f"{max(p['compile_seconds'] for p in ipu):.1f} s")
    svg = SVG.with_name("onnx-resnext-quick.svg") if quick else SVG
    _plot(ipu, gpu_points, peak_points, nv, gpu_model, svg)
    print(f"  plot: {svg.relative_to(ROOT)}")
    rows.append({"part": "resnext", "roofline_check": [
        {"id": p.published.id, "batch_size": p.published.batch_size, "precision": p.published.precision,
         "metric": p.published.metric, "published": p.published.value, "roofline": p.model, "ratio": p.ratio}
        for p in before.points], "typical_error": before.typical_error,
        "fitted_efficiency": fitted.efficiency if fitted else None,
        "fitted_in_sample_error": gr.check([gr.estimate(model, b, p, fitted) for b, p in keys],
                                           published).typical_error if fitted else None,
        "batch1_rel_error": rel, "onnx_nodes": len(model.graph.node), "opset": onnx.defs.onnx_opset_version()})
    return rows


def _plot(ipu: list[dict[str, Any]], gpu: dict[int, Any], peak: dict[int, Any], nv: dict[tuple, float],
          gpu_model: Any, path: Path) -> None:
    """Two log-log panels (throughput, latency vs batch size) as a self-contained SVG."""
    series = [
        ("GC2 (tile model)", "#d62728", [(p["batch_size"], p["throughput"], p["latency_s"] * 1e3, p["fits"])
                                         for p in ipu if p["device"] == "GC2"]),
        ("C2, 2 IPUs (tile model)", "#ff7f0e", [(p["batch_size"], p["throughput"], p["latency_s"] * 1e3, p["fits"])
                                                for p in ipu if p["device"] == "C2"]),
        (f"V100 roofline, efficiency {gpu_model.efficiency:.2f}", "#1f77b4",
         [(b, e.throughput, e.latency_s * 1e3, True) for b, e in sorted(gpu.items())]),
        ("V100 roofline at peak", "#9ecae1", [(b, e.throughput, e.latency_s * 1e3, True)
                                              for b, e in sorted(peak.items())]),
        ("V100 published (NVIDIA, AMP)", "#2ca02c",
         [(b, nv[(b, "throughput")], nv[(b, "latency_s")] * 1e3, True)
          for b in sorted({k[0] for k in nv}) if (b, "throughput") in nv and (b, "latency_s") in nv]),
    ]
    w, h, pad = 460, 320, 60
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w + 40}" height="{h + 150}" '
             'font-family="sans-serif" font-size="11">',
             '<text x="20" y="18" font-size="14">ResNeXt-101 32x4d inference, FP16: emulated IPUs (tile model) '
             'vs a V100 roofline and NVIDIA\'s published V100 figures</text>']
    for panel, (title, col, unit) in enumerate((("throughput", 1, "images/s"), ("latency", 2, "ms"))):
        x0 = 20 + panel * (w + 20)
        vals = [pt[col] for _, _, pts in series for pt in pts if pt[col] > 0]
        bs = [pt[0] for _, _, pts in series for pt in pts]
        lo, hi = math.log10(min(vals)) - 0.1, math.log10(max(vals)) + 0.1
        blo, bhi = math.log10(min(bs)), math.log10(max(bs))

        def px(b: float, v: float, x0: float = x0, lo: float = lo, hi: float = hi, blo: float = blo,
               bhi: float = bhi) -> tuple[float, float]:
            return (x0 + pad + (math.log10(b) - blo) / max(1e-9, bhi - blo) * (w - pad - 10),
                    30 + (h - 40) - (math.log10(v) - lo) / (hi - lo) * (h - 60))

        parts.append(f'<rect x="{x0 + pad}" y="30" width="{w - pad - 10}" height="{h - 40}" fill="none" '
                     'stroke="#999"/>')
        parts.append(f'<text x="{x0 + pad}" y="{h + 5}">{title} ({unit}) vs batch size (per IPU / per GPU), '
                     'log-log</text>')
        for b in sorted(set(bs)):
            x, _ = px(b, 10 ** lo)
            parts.append(f'<text x="{x:.0f}" y="{h - 0:.0f}" text-anchor="middle">{b}</text>')
        for e in range(math.ceil(lo), math.floor(hi) + 1):
            _, y = px(10 ** blo, 10 ** e)
            parts.append(f'<text x="{x0 + pad - 4}" y="{y + 4:.0f}" text-anchor="end">{10 ** e:g}</text>'
                         f'<line x1="{x0 + pad}" x2="{x0 + w - 10}" y1="{y:.0f}" y2="{y:.0f}" stroke="#eee"/>')
        for label, color, pts in series:
            coords = [px(pt[0], pt[col]) for pt in pts if pt[col] > 0]
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                         + " ".join(f"{x:.1f},{y:.1f}" for x, y in coords) + '"/>')
            for (x, y), pt in zip(coords, pts, strict=False):
                fill = color if pt[3] else "white"
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{fill}" stroke="{color}">'
                             f'<title>{label}, batch {pt[0]}: {pt[col]:.4g} {unit}'
                             f'{"" if pt[3] else " (does not fit)"}</title></circle>')
    for i, (label, color, _) in enumerate(series):
        y = h + 30 + 16 * i
        parts.append(f'<rect x="30" y="{y - 9}" width="12" height="10" fill="{color}"/>'
                     f'<text x="48" y="{y}">{label}</text>')
    parts.append(f'<text x="420" y="{h + 30}">open circles: does not fit the tiles (estimate with '
                 'allow_out_of_memory)</text>')
    parts.append(f'<text x="420" y="{h + 46}">published IPU figures (Kacher et al. 2020, Graphcore C2): '
                 'not available here</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def main(quick: bool = False) -> list[dict[str, Any]]:
    from bench.onnx_models import resnet50_onnx, resnext101_onnx

    started = time.perf_counter()
    rows = _conformance(quick)
    t_a = time.perf_counter()
    r50 = resnet50_onnx()
    rows += _resnet50(r50, quick)
    del r50
    t_b = time.perf_counter()
    rows += _resnext(resnext101_onnx(), quick)
    t_c = time.perf_counter()
    print(f"(bench seconds: conformance {t_a - started:.0f}, ResNet-50 (export included) {t_b - t_a:.0f}, "
          f"ResNeXt (export included) {t_c - t_b:.0f}; total {t_c - started:.0f})")
    return rows


if __name__ == "__main__":
    main("--quick" in sys.argv)
