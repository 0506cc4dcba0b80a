"""Sizing a Keras model for an IPU without running it: latency, throughput, memory per tile.

    model (Keras) --lower_function--> IR module --tile model (device_server.emulator.tiles)-->
      Estimate: .latency_s .throughput .cycles .peak_tile_bytes .fits .to_json() .save_html()

Everything happens in this process: the model's step is lowered to IR (as ``IPUStrategy`` would
lower it) and planned onto the tiles of the chosen preset, without executing it, without a
device server and without ``configure_ipu_system``. Nothing is trained: the model's weights and
optimizer state are left as they were.

    report = tf_ipu.estimate(model, batch_size=8, ipu_version="bow")
    report.latency_s, report.throughput, report.fits
    report.save_html("resnet50_bow.html")
    sweep = tf_ipu.estimate_sweep(model, [1, 2, 4, 8, 16, 32])   # latency/throughput vs batch

From the command line (``keras.applications`` models are built with ``weights=None``)::

    python -m tf_ipu.estimate --model resnet50 --batch-size 8 --ipu-version bow --html out.html

Data parallelism: ``replicas=R`` (``--replicas R``) runs R copies of the step at once on a
system's IPUs (``system="bow2000"``, ``--system``; default: R plain IPUs of the version).
``batch_size`` is then per replica, ``throughput`` counts all replicas' items, and a training
step pays the all-reduce of its gradients over the IPU-Links (the one the program contains,
else one of the trainable variables' bytes per step, which the report notes).

    tf_ipu.estimate(model, 8, training=True, ipu_version="bow", replicas=4, system="bow2000")

Not ready yet: pipelining over several IPUs; models whose inputs have no static shape apart
from the batch dimension.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# ``python -m tf_ipu.estimate`` runs this module after the package imported it (for
# ``tf_ipu.estimate``); runpy warns about that, harmlessly.
warnings.filterwarnings("ignore", message=r".*'tf_ipu\.estimate' found in sys\.modules.*",
                        category=RuntimeWarning)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from device_server.emulator.arch import get_target  # noqa: E402
from device_server.emulator.tiles.replication import replication as _replication  # noqa: E402
from device_server.emulator.tiles.report import Estimate, estimate_module  # noqa: E402
from device_server.protocol import ALL_REDUCE_TARGET, hardware  # noqa: E402
from tf_ipu import report as _report  # noqa: E402,F401  (makes tf_ipu.report.save_html reachable)
from tf_ipu.lowering.program import lower_function  # noqa: E402

__all__ = ["Estimate", "Sweep", "estimate", "estimate_sweep", "main"]

_KIND_OF = {"arg": "argument", "var": "variable", "const": "constant"}


def _keras() -> Any:
    import keras

    return keras


def _input_specs(model: Any, batch_size: int, input_spec: Any) -> list[tf.TensorSpec]:
    if input_spec is not None:
        specs = input_spec if isinstance(input_spec, (list, tuple)) else [input_spec]
        out = []
        for s in specs:
            shape = [batch_size, *list(s.shape)[1:]] if s.shape.rank else list(s.shape)
            out.append(tf.TensorSpec(shape, s.dtype))
        return out
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError(
            f"tf_ipu.estimate needs the model's input shapes: model {getattr(model, 'name', model)!r} "
            "has no `inputs` (build it with keras.Input, or pass input_spec=tf.TensorSpec(...)). "
            f"Received: model.inputs={inputs!r}."
        )
    specs = []
    for x in inputs:
        shape = list(x.shape)
        if any(d is None for d in shape[1:]):
            raise ValueError(
                f"tf_ipu.estimate needs static input shapes apart from the batch: input "
                f"{getattr(x, 'name', '')!r} has shape {tuple(shape)}; pass input_spec=..."
            )
        specs.append(tf.TensorSpec([batch_size, *shape[1:]], tf.as_dtype(x.dtype)))
    return specs


def _label_specs(model: Any, batch_size: int, label_spec: Any) -> list[tf.TensorSpec]:
    if label_spec is not None:
        specs = label_spec if isinstance(label_spec, (list, tuple)) else [label_spec]
        return [tf.TensorSpec([batch_size, *list(s.shape)[1:]], s.dtype) for s in specs]
    outputs = getattr(model, "outputs", None) or []
    if not outputs:
        raise ValueError("tf_ipu.estimate(training=True) needs the model's outputs; pass label_spec=...")
    loss = getattr(model, "loss", None)
    losses = loss if isinstance(loss, (list, tuple)) else [loss] * len(outputs)
    specs = []
    for out, ls in zip(outputs, losses, strict=False):
        name = ls if isinstance(ls, str) else type(ls).__name__ if ls is not None else ""
        shape = list(out.shape)
        if "sparse" in str(name).lower():
            specs.append(tf.TensorSpec([batch_size, *shape[1:-1]], tf.int32))
        else:
            specs.append(tf.TensorSpec([batch_size, *shape[1:]], tf.as_dtype(out.dtype)))
    return specs


def _pack(specs_or_tensors: Sequence[Any]) -> Any:
    return specs_or_tensors[0] if len(specs_or_tensors) == 1 else tuple(specs_or_tensors)


def _prepare_training(model: Any, x_specs: list[tf.TensorSpec], y_specs: list[tf.TensorSpec]) -> None:
    """Creates the optimizer's and metrics' variables now (they are created lazily, and a
    traced step may not create them), without changing any weight."""
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError(
            f"tf_ipu.estimate(training=True) uses the model's compiled loss and optimizer: "
            f"call model.compile(optimizer=..., loss=...) first (model "
            f"{getattr(model, 'name', '')!r} is not compiled)."
        )
    opt = model.optimizer
    if not getattr(opt, "built", True):
        opt.build(model.trainable_variables)
    zeros_x = _pack([tf.zeros([1, *s.shape[1:]], s.dtype) for s in x_specs])
    zeros_y = _pack([tf.zeros([1, *s.shape[1:]], s.dtype) for s in y_specs])
    metrics = getattr(model, "_compile_metrics", None)
    if metrics is not None and not getattr(metrics, "built", True):
        y_pred = model(zeros_x, training=False)
        metrics.build(zeros_y, y_pred)
    loss = getattr(model, "_compile_loss", None)
    if loss is not None and not getattr(loss, "built", True):
        y_pred = model(zeros_x, training=False)
        loss.build(zeros_y, y_pred)


def _system(system: Any) -> hardware.System | None:
    if system is None or system == "":
        return None
    if isinstance(system, hardware.System):
        return system
    return hardware.get_system(str(system))


def _has_all_reduce(module: Any) -> bool:
    return any(i.opcode == "custom-call" and "custom_call_target" in i.attrs
               and i.attrs["custom_call_target"].s == ALL_REDUCE_TARGET
               for c in module.computations for i in c.instructions)


def _gradient_bytes(model: Any) -> int:
    """Bytes of the trainable variables (their gradients, summed across replicas each step)."""
    total = 0
    for v in getattr(model, "trainable_variables", []) or []:
        n = 1
        for d in v.shape:
            n *= int(d)
        total += n * tf.as_dtype(v.dtype).size
    return total


def estimate(model: Any, batch_size: int, training: bool = False, ipu_version: str = "ipu2",
             tiles_per_ipu: int = 0, *, input_spec: Any = None, label_spec: Any = None,
             replicas: int = 1, system: Any = None, ipu_ids: Sequence[int] = ()) -> Estimate:
    """Estimates one step of ``model`` on an IPU preset, without running it.

    Args:
        model: a built Keras model (its ``inputs`` give the input shapes).
        batch_size: items per step.
        training: estimate a training step (``model.train_step`` with the model's compiled
            loss and optimizer); else inference (``model(x, training=False)``).
        ipu_version: "ipu1" (GC2), "ipu2" (GC200) or "bow" (alias "ipu21").
        tiles_per_ipu: use that many tiles (0: all of the chip's).
        input_spec: ``tf.TensorSpec`` (or a list, one per input) overriding the model's input
            shapes; the first dimension is replaced by ``batch_size``.
        label_spec: the same for the labels of a training step (default: integer labels for
            sparse losses, else the outputs' shape and dtype).
        replicas: copies of the step running at once, one per IPU (data parallelism);
            ``batch_size`` is per replica.
        system: the system whose IPUs run them: a name ("bow2000", "dss8440", ...) or a
            ``device_server.protocol.hardware.System``; None: ``replicas`` plain IPUs.
        ipu_ids: which of the system's IPUs (default: the first ``replicas``).

    Returns:
        An :class:`Estimate`: ``.latency_s``, ``.throughput`` (items/s), ``.cycles``,
        ``.peak_tile_bytes``, ``.fits`` (False when it would not fit: never raises for
        that), ``.to_json()``, ``.save_html(path)``; with replicas, ``.all_reduce_cycles``,
        ``.all_reduce_share`` and the per-IPU figures of one replica.

    Raises:
        ValueError: a bad ``batch_size``, or replicas the system cannot run (more than its
            IPUs, ``ipu_ids`` not one per replica, IPUs of another version).

    Example:
        >>> model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        >>> r = tf_ipu.estimate(model, batch_size=32, ipu_version="bow")
        >>> r.fits, f"{r.latency_s * 1e6:.1f} us", f"{r.throughput:,.0f} items/s"
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int. Received: batch_size={batch_size!r}")
    target = get_target(ipu_version, tiles_per_ipu)
    system = _system(system)
    many = {"replicas": replicas, "system": system, "ipu_ids": tuple(ipu_ids)}
    _replication(replicas, system, tuple(ipu_ids), target)  # checked before lowering
    x_specs = _input_specs(model, batch_size, input_spec)
    name = getattr(model, "name", "model")
    t0 = time.perf_counter()
    # A model built under a strategy (IPUStrategy) is traced as its strategy runs it: its
    # variables (optimizer slots built here) in the strategy's scope, the step in a replica
    # context. Nothing runs; the model's state is left as fit would find it.
    strategy = getattr(model, "_distribute_strategy", None)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()

    def in_replica(fn: Any, *args: Any) -> Any:
        if strategy is None:
            return fn(*args)
        lowering = getattr(strategy, "lowering", None)
        with lowering() if lowering is not None else contextlib.nullcontext():
            return strategy.extended.call_for_each_replica(fn, args=args)

    with scope:
        if training:
            y_specs = _label_specs(model, batch_size, label_spec)
            _prepare_training(model, x_specs, y_specs)
            nx = len(x_specs)

            def step(*args: tf.Tensor) -> Any:
                return in_replica(model.train_step, (_pack(args[:nx]), _pack(args[nx:])))

            specs = [*x_specs, *y_specs]
            program = f"{name}/train_step[batch={batch_size}]"
        else:
            def step(*args: tf.Tensor) -> Any:
                return in_replica(lambda x: model(x, training=False), _pack(args))

            specs = x_specs
            program = f"{name}/predict[batch={batch_size}]"
        lowered = lower_function(step, specs, program)
    lower_s = time.perf_counter() - t0
    params = json.loads(lowered.signature)["params"]
    kinds = {n: _KIND_OF[p["kind"]] for n, p in enumerate(params)}
    implied = 0
    if training and replicas > 1 and not _has_all_reduce(lowered.module):
        implied = _gradient_bytes(model)  # the cross-replica gradient sum of each step
    t1 = time.perf_counter()
    report = estimate_module(lowered.module, None, target, param_kinds=kinds,
                             implied_all_reduce_bytes=implied, **many)
    plan_s = time.perf_counter() - t1
    report.items_per_call = batch_size
    report.context = {
        "model": name, "batch_size": batch_size, "training": bool(training),
        "inputs": ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in specs),
        "lower_seconds": round(lower_s, 3), "plan_seconds": round(plan_s, 3),
    }
    if report.replicas > 1:
        report.context["global_batch"] = batch_size * report.replicas
    return report


@dataclass
class Sweep:
    """Estimates of one model at several batch sizes."""

    estimates: list[Estimate]
    points: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"points": self.points, "estimates": [e.to_dict() for e in self.estimates]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"points": self.points}, indent=indent)

    def best(self) -> Estimate:
        """The highest-throughput estimate that fits (else the smallest batch)."""
        fitting = [e for e in self.estimates if e.fits]
        if not fitting:
            return min(self.estimates, key=lambda e: e.items_per_call)
        return max(fitting, key=lambda e: e.throughput)

    def save_html(self, path: str, batch_size: int | None = None) -> str:
        """The report of ``batch_size`` (default: :meth:`best`) with the sweep plotted."""
        chosen = self.best() if batch_size is None else \
            next(e for e in self.estimates if e.items_per_call == batch_size)
        return chosen.save_html(path)

    def __repr__(self) -> str:
        pts = ", ".join(f"{p['batch_size']}: {p['latency_s'] * 1e3:.3f} ms/{p['throughput']:,.0f}/s"
                        + ("" if p["fits"] else " (no fit)") for p in self.points)
        return f"Sweep({pts})"


def estimate_sweep(model: Any, batch_sizes: Sequence[int], training: bool = False,
                   ipu_version: str = "ipu2", tiles_per_ipu: int = 0, **kwargs: Any) -> Sweep:
    """:func:`estimate` at each of ``batch_sizes``: latency and throughput vs batch size.

    Every estimate carries the sweep (``report.sweep``), so its HTML page plots it. With
    ``replicas=R`` (and ``system=...``) in ``kwargs`` the batch sizes are per replica and each
    point's throughput counts all R replicas' items.

    Example:
        >>> sweep = tf_ipu.estimate_sweep(model, [1, 2, 4, 8, 16])
        >>> [(p["batch_size"], p["latency_s"], p["throughput"]) for p in sweep.points]
        >>> sweep.save_html("sweep.html")
    """
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"batch_sizes must be positive ints. Received: {list(batch_sizes)!r}")
    estimates = [estimate(model, b, training, ipu_version, tiles_per_ipu, **kwargs) for b in sizes]
    points = [{"batch_size": e.items_per_call, "latency_s": e.latency_s, "throughput": e.throughput,
               "fits": e.fits, "peak_tile_bytes": e.peak_tile_bytes, "cycles": e.cycles,
               "replicas": e.replicas, "all_reduce_share": e.all_reduce_share}
              for e in estimates]
    for e in estimates:
        e.sweep = points
    return Sweep(estimates, points)


# ------------------------------------------------------------------------------- CLI


def build_model(name: str, precision: str = "fp32") -> Any:
    """A model by name: "mlp", "cnn", or a ``keras.applications`` model (``weights=None``)."""
    keras = _keras()
    if precision == "fp16":
        keras.mixed_precision.set_global_policy("mixed_float16")
    key = name.lower().replace("-", "").replace("_", "")
    if key == "mlp":
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                 keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)],
                                name="mlp")
    if key == "cnn":
        return keras.Sequential([
            keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)], name="cnn")
    apps = {n.lower(): n for n in dir(keras.applications) if n[:1].isupper()}
    if key not in apps:
        known = ", ".join(sorted(["mlp", "cnn", *apps]))
        raise ValueError(f"Unknown model {name!r}; accepted: {known}.")
    return getattr(keras.applications, apps[key])(weights=None)


def main(argv: list[str] | None = None) -> int:
    """``python -m tf_ipu.estimate``: see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m tf_ipu.estimate",
                                description="Estimate a Keras model on an emulated IPU preset.")
    p.add_argument("--model", default="resnet50", help="mlp, cnn or a keras.applications name")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--training", action="store_true", help="a training step (SGD, sparse CE loss)")
    p.add_argument("--optimizer", default="sgd", help="optimizer for --training (default sgd)")
    p.add_argument("--ipu-version", default="ipu2", help="ipu1 (GC2), ipu2 (GC200), bow")
    p.add_argument("--tiles-per-ipu", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas, one per IPU")
    p.add_argument("--system", default="", help="the replicas' system: " + ", ".join(hardware.SYSTEMS))
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="fp16: Keras mixed_float16 policy")
    p.add_argument("--sweep", default="", help="batch sizes to sweep, e.g. 1,2,4,8")
    p.add_argument("--html", default="", help="write the HTML report here")
    p.add_argument("--json", default="", help="write the JSON report here")
    args = p.parse_args(argv)
    model = build_model(args.model, args.precision)
    if args.training:
        model.compile(optimizer=args.optimizer, loss=_keras().losses.SparseCategoricalCrossentropy(from_logits=True))
    many = {"replicas": args.replicas, "system": args.system or None}
    if args.sweep:
        sizes = [int(s) for s in args.sweep.split(",") if s.strip()]
        sweep = estimate_sweep(model, sorted({*sizes, args.batch_size}), args.training,
                               args.ipu_version, args.tiles_per_ipu, **many)
        report = next(e for e in sweep.estimates if e.items_per_call == args.batch_size)
        for pt in sweep.points:
            print(f"  batch {pt['batch_size']:5d}: {pt['latency_s'] * 1e3:9.3f} ms  "
                  f"{pt['throughput']:12,.1f} items/s  {'fits' if pt['fits'] else 'DOES NOT FIT'}")
    else:
        report = estimate(model, args.batch_size, args.training, args.ipu_version, args.tiles_per_ipu,
                          **many)
    print(report.summary())
    print(f"  lowering {report.context['lower_seconds']:.2f} s, planning "
          f"{report.context['plan_seconds']:.2f} s; {report.supersteps:,} supersteps; "
          f"compute {report.compute_cycles:,} / exchange {report.exchange_cycles:,} / sync "
          f"{report.sync_cycles:,} / host {report.host_cycles:,} cycles"
          + (f" / all-reduce {report.all_reduce_cycles:,} / replica syncs "
             f"{report.replica_sync_cycles:,}" if report.replicas > 1 else ""))
    for op in report.top_ops[:5]:
        print(f"    {op['cycles']:12,.0f} cycles  {op['name']} ({op['opcode']}) {op['layer']}")
    if not report.fits:
        print(report.oom_message())
    if args.html:
        print(f"HTML report: {report.save_html(args.html)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(report.to_json(indent=1))
        print(f"JSON report: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
