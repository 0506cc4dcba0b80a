"""A roofline model of a GPU running an ONNX graph: the GPU side of an IPU/GPU comparison.

    estimate(model, batch_size, precision="fp16", gpu=V100_SXM2) -> RooflineEstimate
      per ONNX node (one kernel each):  max(flops / (efficiency * peak),
                                            bytes / (efficiency * memory bandwidth)) + launch
      summed over the graph's nodes: the latency of one batch; throughput = batch / latency
    sweep(model, batch_sizes, ...)              one estimate per batch size
    check(estimates, published)                 ratio model / published at each point, and the
                                                typical error exp(mean |ln ratio|)
    fit_efficiency(model, published, ...)       ONE parameter (the share of the peaks reached)
                                                fitted on published points, with its in-sample
                                                error

The GPU's figures are named parameters (``GpuSpec``) with their sources; the default is an
NVIDIA V100 SXM2 (``V100_SXM2``). Peak FLOP/s: FP16 on Tensor Cores for Conv, ConvTranspose,
MatMul and Gemm at ``precision="fp16"``, the FP32 (CUDA core) peak for every other node and
for everything at ``precision="fp32"``. Bytes: every input (weights included) read once and
every output written once, float tensors at 2 bytes (fp16) or 4 (fp32). Nodes that move no
data on a GPU (Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout at inference, Shape,
Constant) and nodes whose inputs are all constants (folded before the run) cost nothing and
launch nothing. Nothing else is modelled: no caches, no kernel fusion, no framework time.

Imports onnx and numpy only (no TensorFlow).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto, shape_inference

#: Where the V100 figures come from. The peaks are NVIDIA's; the launch cost is an assumption.
V100_SOURCES: Mapping[str, str] = {
    "fp16_tensor_flops": "NVIDIA Tesla V100 datasheet (2017/2018), V100 SXM2: 'Deep Learning 125 "
                         "teraFLOPS' (Tensor Cores); NVIDIA Tesla V100 GPU Architecture whitepaper "
                         "WP-08608-001_v1.1 (2017), Table 1: 'Peak Tensor TFLOPS 125'",
    "fp32_flops": "NVIDIA Tesla V100 datasheet, V100 SXM2: 'Single-Precision 15.7 teraFLOPS'; "
                  "Volta whitepaper Table 1: 'Peak FP32 TFLOPS 15.7' (boost clock 1530 MHz)",
    "memory_bytes_per_s": "NVIDIA Tesla V100 datasheet: 'Memory Bandwidth 900 GB/s' (HBM2); "
                          "Volta whitepaper Table 1: 'Memory Bandwidth 900 GB/sec'",
    "launch_s": "ASSUMPTION, not a published figure: a CUDA kernel launch plus the framework's "
                "dispatch of one op, taken as 5 us (CUDA launch overheads of a few microseconds "
                "are commonly measured; no NVIDIA document states one)",
    "efficiency": "1.0 = the roofline itself (no published figure); fit_efficiency() fits it",
}


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's figures for the roofline (each a named parameter; ``sources`` says where)."""

    name: str
    fp16_tensor_flops: float        # FLOP/s, FP16 matrix products (Tensor Cores)
    fp32_flops: float               # FLOP/s, FP32 (CUDA cores)
    memory_bytes_per_s: float       # bytes/s, device memory
    launch_s: float                 # seconds per kernel (launch and dispatch)
    efficiency: float = 1.0         # the share of both peaks reached (1: the roofline)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    fitted: str = ""                # how ``efficiency`` was fitted ("" : not fitted)

    def with_efficiency(self, efficiency: float, how: str = "") -> GpuSpec:
        """The same GPU reaching ``efficiency`` of its peaks."""
        if not 0.0 < efficiency <= 1.0:
            raise ValueError(f"efficiency must be in (0, 1], not {efficiency}.")
        return dataclasses.replace(self, efficiency=float(efficiency), fitted=how)


V100_SXM2 = GpuSpec("NVIDIA V100 SXM2", fp16_tensor_flops=125e12, fp32_flops=15.7e12,
                    memory_bytes_per_s=900e9, launch_s=5e-6, sources=V100_SOURCES)

PRECISIONS = ("fp16", "fp32")
_FREE = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Shape",
                   "Constant", "Size"})
_MATRIX = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
# Floating-point operations per output element of some element-wise nodes (others: 1).
_PER_ELEMENT = {"BatchNormalization": 2, "Softmax": 5, "LogSoftmax": 5, "LayerNormalization": 8,
                "Gelu": 8, "Erf": 8, "Sigmoid": 4, "Tanh": 4, "Exp": 4, "Log": 4, "HardSwish": 3}


@dataclass(frozen=True)
class NodeCost:
    """One node's share of the roofline estimate."""

    name: str
    op_type: str
    flops: float
    bytes: float
    seconds: float                  # 0 for a node that launches nothing
    bound: str                      # "compute", "memory" or "free"


@dataclass
class RooflineEstimate:
    """The roofline's estimate of one batch through the graph."""

    gpu: GpuSpec
    batch_size: int
    precision: str
    nodes: list[NodeCost]

    @property
    def latency_s(self) -> float:
        return sum(n.seconds for n in self.nodes)

    @property
    def throughput(self) -> float:
        """Items per second (one batch per ``latency_s``)."""
        return self.batch_size / self.latency_s if self.latency_s else 0.0

    @property
    def flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    @property
    def bytes(self) -> float:
        return sum(n.bytes for n in self.nodes)

    @property
    def kernels(self) -> int:
        return sum(1 for n in self.nodes if n.bound != "free")

    @property
    def launch_s(self) -> float:
        """The launch costs' part of ``latency_s``."""
        return self.kernels * self.gpu.launch_s

    def summary(self) -> str:
        return (f"{self.gpu.name} roofline, {self.precision}, batch {self.batch_size}: "
                f"{self.latency_s * 1e3:.3f} ms ({self.throughput:,.1f} items/s), "
                f"{self.flops / 1e9:.2f} GFLOP, {self.bytes / 1e6:.1f} MB, {self.kernels} kernels "
                f"({self.launch_s * 1e3:.3f} ms of launches), efficiency {self.gpu.efficiency:.3g}"
                f"{' (fitted: ' + self.gpu.fitted + ')' if self.gpu.fitted else ''}")


def _dims(value: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    t = value.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = []
    for d in t.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return tuple(dims)


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the values of its large float initializers (declared as inputs of
    their shapes instead): shape inference then copies kilobytes, not the weights."""
    m = onnx.ModelProto()
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    g, src = m.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    declared = {v.name for v in src.input}
    for init in src.initializer:
        if init.data_type in _FLOATS and math.prod(init.dims) > 64:
            if init.name not in declared:
                g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            g.initializer.append(init)
    return m


def _with_batch(model: onnx.ModelProto, batch_size: int,
                input_shapes: Mapping[str, Sequence[int]] | None) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs have static shapes: ``input_shapes`` where given,
    else the symbolic leading dimension set to ``batch_size``; shapes inferred throughout."""
    m = _skeleton(model)
    inits = {i.name for i in model.graph.initializer}
    for v in m.graph.input:
        if v.name in inits:
            continue
        dims = v.type.tensor_type.shape.dim
        if input_shapes and v.name in input_shapes:
            shape = list(input_shapes[v.name])
            del dims[:]
            for s in shape:
                dims.add().dim_value = int(s)
            continue
        for k, d in enumerate(dims):
            if not d.HasField("dim_value"):
                if k:
                    raise ValueError(f"input {v.name!r}: dimension {k} is symbolic; give its shape "
                                     "in input_shapes.")
                d.Clear()
                d.dim_value = int(batch_size)
    del m.graph.value_info[:]
    return shape_inference.infer_shapes(m, data_prop=True)


def _elements(shape: tuple[int, ...] | None) -> int:
    return math.prod(shape) if shape is not None else 0


def _node_flops(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...] | None]) -> float:
    out = shapes.get(node.output[0]) if node.output else None
    n_out = _elements(out)
    op = node.op_type
    if op in ("Conv", "ConvTranspose") and len(node.input) > 1:
        w = shapes.get(node.input[1])
        if w is None or out is None:
            return 0.0
        if op == "Conv":  # each output element: in/group x window multiply-adds
            return 2.0 * n_out * math.prod(w[1:])
        x = shapes.get(node.input[0])  # each input element scattered over out/group x window
        return 2.0 * _elements(x) * math.prod(w[1:]) if x is not None else 0.0
    if op in ("MatMul", "Gemm"):
        a = shapes.get(node.input[0])
        if a is None or out is None or not a:
            return 0.0
        trans_a = any(at.name == "transA" and at.i for at in node.attribute)
        k = a[-2] if op == "Gemm" and trans_a else a[-1]
        return 2.0 * n_out * k
    if op in ("MaxPool", "AveragePool", "LpPool"):
        kernel = next((list(at.ints) for at in node.attribute if at.name == "kernel_shape"), [1])
        return float(n_out * math.prod(kernel))
    if op.startswith("Reduce") or op.startswith("Global") or op in ("ArgMax", "ArgMin"):
        return float(_elements(shapes.get(node.input[0])))
    return float(n_out * _PER_ELEMENT.get(op, 1))


def _itemsize(elem_type: int, precision: str) -> int:
    if elem_type in _FLOATS:
        return 2 if precision == "fp16" else 4
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 4


def estimate(model: onnx.ModelProto, batch_size: int, precision: str = "fp16",
             gpu: GpuSpec = V100_SXM2, input_shapes: Mapping[str, Sequence[int]] | None = None
             ) -> RooflineEstimate:
    """The roofline's latency and throughput of ``model`` at ``batch_size`` on ``gpu``.

    Args:
        model: an ONNX model (its symbolic leading input dimension is the batch).
        batch_size: the leading dimension of every input without a static shape.
        precision: ``"fp16"`` (float tensors in 2 bytes, matrix products on Tensor Cores) or
            ``"fp32"``.
        gpu: the GPU's figures (default ``V100_SXM2``).
        input_shapes: input name -> whole static shape, for inputs with other symbolic dims.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}.")
    inferred = _with_batch(model, batch_size, input_shapes)
    g = inferred.graph
    shapes: dict[str, tuple[int, ...] | None] = {}
    types: dict[str, int] = {}
    for v in (*g.input, *g.value_info, *g.output):
        shapes[v.name] = _dims(v)
        types[v.name] = v.type.tensor_type.elem_type
    constant = {i.name for i in model.graph.initializer}  # (the skeleton declares big ones as inputs)
    for init in g.initializer:
        shapes[init.name] = tuple(int(d) for d in init.dims)
        types[init.name] = init.data_type
        constant.add(init.name)
    costs = []
    for node in g.node:
        inputs = [i for i in node.input if i]
        folded = bool(inputs) and all(i in constant for i in inputs)
        if node.op_type in ("Constant", "ConstantOfShape") and not inputs or folded or (
                node.op_type == "ConstantOfShape" and all(i in constant for i in inputs)):
            constant.update(o for o in node.output if o)
        if node.op_type in _FREE or folded or node.op_type == "ConstantOfShape" and node.output[0] in constant:
            costs.append(NodeCost(node.name, node.op_type, 0.0, 0.0, 0.0, "free"))
            continue
        flops = _node_flops(node, shapes)
        data = sum(_elements(shapes.get(t)) * _itemsize(types.get(t, TensorProto.FLOAT), precision)
                   for t in dict.fromkeys([*inputs, *(o for o in node.output if o)]))
        peak = gpu.fp16_tensor_flops if precision == "fp16" and node.op_type in _MATRIX else gpu.fp32_flops
        compute = flops / (gpu.efficiency * peak)
        memory = data / (gpu.efficiency * gpu.memory_bytes_per_s)
        costs.append(NodeCost(node.name, node.op_type, flops, float(data),
                              max(compute, memory) + gpu.launch_s,
                              "compute" if compute >= memory else "memory"))
    return RooflineEstimate(gpu, int(batch_size), precision, costs)


def sweep(model: onnx.ModelProto, batch_sizes: Iterable[int], precision: str = "fp16",
          gpu: GpuSpec = V100_SXM2) -> list[RooflineEstimate]:
    """``estimate`` at each batch size (ascending)."""
    return [estimate(model, b, precision, gpu) for b in sorted({int(b) for b in batch_sizes})]


# ----------------------------------------------------------------------- published points


@dataclass(frozen=True)
class Published:
    """One published measurement to compare with: throughput (items/s) or mean latency (s)."""

    batch_size: int
    precision: str                  # "fp16" or "fp32"
    metric: str                     # "throughput" or "latency_s"
    value: float
    id: str = ""


@dataclass(frozen=True)
class CheckPoint:
    published: Published
    model: float                    # the roofline's figure for the same metric

    @property
    def ratio(self) -> float:
        """model / published."""
        return self.model / self.published.value


@dataclass(frozen=True)
class Check:
    points: list[CheckPoint]

    @property
    def typical_error(self) -> float:
        """exp(mean |ln(model / published)|): 1.0 is exact, 2.0 a factor of 2 either way."""
        if not self.points:
            return float("nan")
        return math.exp(sum(abs(math.log(p.ratio)) for p in self.points) / len(self.points))


def published_from_rows(rows: Iterable[Any]) -> list[Published]:
    """Published points from calibration-table rows (``bench.calibration.table.Measurement``
    or dicts of the same fields): ``items_per_s`` and ``latency_ms`` with a value, precision
    FP32, or FP16/AMP ("mixed precision") as fp16."""
    out = []
    for r in rows:
        get = r.get if isinstance(r, Mapping) else (lambda k, r=r: getattr(r, k))
        value, metric, params = get("value"), get("metric"), get("params") or {}
        if value is None or metric not in ("items_per_s", "latency_ms"):
            continue
        text = str(params.get("precision", "")).lower()
        precision = "fp32" if text == "fp32" else "fp16" if ("fp16" in text or "mixed" in text or
                                                              "amp" in text) else ""
        if not precision or params.get("batch_size") is None:
            continue
        out.append(Published(int(params["batch_size"]), precision,
                             "throughput" if metric == "items_per_s" else "latency_s",
                             float(value) if metric == "items_per_s" else float(value) / 1e3,
                             str(get("id"))))
    return out


def check(estimates: Iterable[RooflineEstimate], published: Iterable[Published]) -> Check:
    """The roofline against each published point of a batch size and precision it has."""
    by = {(e.batch_size, e.precision): e for e in estimates}
    points = []
    for p in published:
        e = by.get((p.batch_size, p.precision))
        if e is not None:
            points.append(CheckPoint(p, e.throughput if p.metric == "throughput" else e.latency_s))
    return Check(points)


@dataclass(frozen=True)
class Fit:
    gpu: GpuSpec                    # the GPU with the fitted efficiency
    check: Check                    # in-sample: the points it was fitted on
    before: Check                   # the same points at the original efficiency


def fit_efficiency(model: onnx.ModelProto, published: Sequence[Published],
                   gpu: GpuSpec = V100_SXM2) -> Fit:
    """Fits ``efficiency`` (ONE parameter: the share of both peaks reached; launch cost
    unchanged) to minimize the mean |ln(model / published)| over ``published``; the error
    reported is in-sample (the fitted points themselves)."""
    keys = sorted({(p.batch_size, p.precision) for p in published})
    unit = gpu.with_efficiency(1.0)
    base = {k: estimate(model, k[0], k[1], unit) for k in keys}
    # At efficiency e every launching node's time is roofline / e + launch.
    roof = {k: sum(n.seconds - unit.launch_s for n in est.nodes if n.bound != "free") for k, est in base.items()}
    launches = {k: est.launch_s for k, est in base.items()}

    def error(e: float) -> float:
        total = 0.0
        for p in published:
            k = (p.batch_size, p.precision)
            latency = roof[k] / e + launches[k]
            figure = k[0] / latency if p.metric == "throughput" else latency
            total += abs(math.log(figure / p.value))
        return total / max(1, len(published))

    lo, hi = math.log(1e-4), 0.0  # golden-section search on ln(efficiency) in [1e-4, 1]
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    for _ in range(80):
        if error(math.exp(a)) < error(math.exp(b)):
            hi = b
        else:
            lo = a
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    best = math.exp((lo + hi) / 2)
    fitted = gpu.with_efficiency(best, f"share of peak fitted on {len(published)} published points, "
                                       f"in-sample error x{math.exp(error(best)):.2f}")
    before = check([estimate(model, k[0], k[1], gpu) for k in keys], published)
    after = check([estimate(model, k[0], k[1], fitted) for k in keys], published)
    return Fit(fitted, after, before)


__all__ = ["PRECISIONS", "V100_SOURCES", "V100_SXM2", "Check", "CheckPoint", "Fit", "GpuSpec", "NodeCost",
           "Published", "RooflineEstimate", "check", "estimate", "fit_efficiency", "published_from_rows",
           "sweep"]
