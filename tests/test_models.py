"""Real architectures on the emulator against XLA on CPU: a forward pass and a training step.

Models (reduced input sizes; full sizes are in ``bench/bench_models.py``):

- ``keras.applications`` ResNet50 (64x64, batch 4), MobileNetV2 (32x32, batch 4),
  EfficientNetB0 (32x32, batch 4), Xception (71x71, its minimum, batch 2), all
  ``weights=None, classes=10, classifier_activation=None`` (logits);
- ResNeXt 32x4d (``tf_ipu/models/resnext.py``) with one block per stage (32x32, batch 4);
- a BERT encoder (``tf_ipu/models/bert.py``: 2 layers, hidden 64, 4 heads, sequence 32,
  vocabulary 1000, dropout 0) under ``bert_classifier`` (batch 4).

Per model, one function is lowered (so one trace, one XLA compilation, one emulator
compilation cover both parts): ``model(x, training=False)`` followed by
``model.train_step((x, y))`` after ``compile`` with plain SGD and sparse categorical
cross-entropy on the logits. The forward pass reads the variables before the step updates
them. Both the emulator and XLA (``tf.function(jit_compile=True)``) run it from the same
variable values (``emulator_util.lower_step``). Compared, as relative L2 norms
``|emulator - xla| / |xla|``:

- the forward logits and the loss: at most 1e-4;
- every updated variable (weights, BatchNormalization moving statistics, the optimizer's
  iteration count, the loss tracker's totals): at most 1e-4;
- the update ``new - old`` of every trainable tensor (the gradient times the learning rate):
  at most ``UPDATE_RTOL``. Exempt: updates below ``NOISE`` times the tensor's norm, which
  are the rounding noise of gradients that are zero in exact arithmetic (a bias or a
  BatchNormalization offset feeding another BatchNormalization: ResNet50's convolution
  biases, MobileNetV2's and EfficientNet's projection offsets); the weight check covers them.

Weights: Keras' initializers, then biases, BatchNormalization offsets, scales and moving
statistics are drawn at random (so inference-mode normalization is not the identity and
no bias is zero). In the residual networks (ResNet50, ResNeXt, MobileNetV2) the scale of the
last BatchNormalization of each residual branch is drawn from [0.1, 0.3] (the usual
"zero-init residual" practice, not quite zero): with Keras' default scale of 1 these random
networks are chaotic in float32, and XLA, TensorFlow without XLA and the emulator each give
gradients ~2% away from a float64 run (ReLU masks flip on rounding differences), so no
float32 implementation could be compared with another at these tolerances.

Dropout: the BERT model is built with rate 0. ``keras.applications.EfficientNetB0`` takes
no rate (0.2 before the classifier, 0.2 drop-connect in the blocks): its Dropout layers get
``rate = 0`` after construction (Keras reads the rate at call time), so the training step
is compared too. The other models have no dropout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import emulator_util as eu
import keras
import numpy as np
import pytest
import tensorflow as tf

from device_server.emulator import CompileOptions, compile_module, get_target

TARGET = get_target("ipu2")
OPTIONS = CompileOptions(allow_out_of_memory=True)  # sizes are the tile model's business
RTOL = 1e-4          # logits, loss, updated variables
UPDATE_RTOL = 5e-3   # updates (new - old) of trainable tensors
NOISE = 1e-7         # updates below NOISE * |w| are rounding noise of an exactly zero gradient
LEARNING_RATE = 1e-3


@dataclass
class Case:
    build: Callable[[], keras.Model]
    inputs: Callable[[np.random.Generator], np.ndarray]
    damp: str = ""  # regex of the BatchNormalization layers ending residual branches
    opcodes: set[str] = field(default_factory=set)  # expected in the lowered program


def _image(size: int, batch: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal((batch, size, size, 3)).astype(np.float32)


def _app(name: str, size: int) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        ctor = getattr(keras.applications, name)
        return ctor(weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None)

    return build


def _resnext() -> keras.Model:
    from tf_ipu.models import resnext

    return resnext(depth=101, cardinality=32, width=4, blocks=(1, 1, 1, 1), input_shape=(32, 32, 3), classes=10)


def _bert() -> keras.Model:
    from tf_ipu.models import bert_classifier, bert_encoder

    encoder = bert_encoder(layers=2, hidden=64, heads=4, seq_len=32, vocab=1000, dropout=0.0)
    return bert_classifier(encoder, classes=10)


CASES = {
    "resnet50": Case(_app("ResNet50", 64), _image(64, 4), r"_3_bn$",
                     {"convolution", "reduce-window", "select-and-scatter"}),
    "mobilenet_v2": Case(_app("MobileNetV2", 32), _image(32, 4), r"_project_BN$", {"convolution", "clamp"}),
    "efficientnet_b0": Case(_app("EfficientNetB0", 32), _image(32, 4), "", {"convolution", "logistic"}),
    "xception": Case(_app("Xception", 71), _image(71, 2), "", {"convolution", "select-and-scatter"}),
    "resnext": Case(_resnext, _image(32, 4), r"_3_bn$", {"convolution", "select-and-scatter"}),
    "bert": Case(_bert, lambda rng: rng.integers(0, 1000, (4, 32)).astype(np.int32), "",
                 {"dot", "gather", "scatter"}),
}


def _rel(actual: np.ndarray, expected: np.ndarray) -> float:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    norm = float(np.linalg.norm(e))
    diff = float(np.linalg.norm(a - e))
    return diff / norm if norm else diff


def _prepare(model: keras.Model, damp: str, rng: np.random.Generator) -> None:
    """Random biases and normalization parameters; damped residual-branch scales."""
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    for v in model.variables:
        layer, _, leaf = v.path.rpartition("/")
        shape = tuple(v.shape)
        if leaf == "gamma" and damp and re.search(damp, layer):
            v.assign(rng.uniform(0.1, 0.3, shape).astype(np.float32))
        elif leaf in ("gamma", "moving_variance"):
            v.assign(rng.uniform(0.5, 1.5, shape).astype(np.float32))
        elif leaf in ("beta", "bias", "moving_mean"):
            v.assign((0.1 * rng.standard_normal(shape)).astype(np.float32))


def _variable_names(fn: Any, *args: Any) -> list[str]:
    concrete = fn.get_concrete_function(*args)
    by_handle = {id(v.handle): v.name for v in concrete.variables}
    return [by_handle.get(id(c), "<constant>") for c in concrete.captured_inputs]


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_train_step_match_xla(name: str) -> None:
    case = CASES[name]
    t0 = time.perf_counter()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = case.build()
    _prepare(model, case.damp, rng)
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)  # optimizer state outside the trace
    x = tf.constant(case.inputs(rng))
    y = tf.constant(rng.integers(0, 10, x.shape[0]).astype(np.int32))

    def forward_and_step(x: tf.Tensor, y: tf.Tensor) -> Any:
        logits = model(x, training=False)
        return logits, model.train_step((x, y))

    fn = tf.function(forward_and_step, jit_compile=True, autograph=False)
    module, params, expected = eu.lower_step(fn, x, y)
    names = _variable_names(fn, x, y)
    exe = compile_module(module, TARGET, OPTIONS)
    got = exe.run(params)
    elapsed = time.perf_counter() - t0

    opcodes = {i.opcode for c in module.computations for i in c.instructions}
    assert case.opcodes <= opcodes, f"{name}: lowered program lacks {case.opcodes - opcodes}"
    assert len(got) == len(expected)
    aliases = {a.output_index: a.parameter_number for a in module.aliases}
    trainable = {v.value.name for v in model.trainable_variables}
    n_results = len(expected) - len(aliases)
    assert n_results == 2 and all(k >= n_results for k in aliases), f"{name}: outputs {n_results}, {aliases}"

    errors: list[str] = []
    worst = {"logits": _rel(got[0], expected[0]), "loss": _rel(got[1], expected[1]), "weight": 0.0, "update": 0.0}
    for what in ("logits", "loss"):
        if not worst[what] <= RTOL:
            errors.append(f"{what}: relative error {worst[what]:.2e}")
    exempt = 0
    for k in sorted(aliases):
        var = names[aliases[k] - 2]
        old, new, ref = params[aliases[k]], got[k], expected[k]
        assert new.dtype == ref.dtype and new.shape == ref.shape, var
        if not np.issubdtype(ref.dtype, np.floating):
            if not np.array_equal(new, ref):
                errors.append(f"{var}: {new} != {ref}")
            continue
        err = _rel(new, ref)
        worst["weight"] = max(worst["weight"], err)
        if not err <= RTOL:
            errors.append(f"{var}: updated value, relative error {err:.2e}")
        if var not in trainable:
            continue
        step = ref.astype(np.float64) - old
        if np.linalg.norm(step) <= NOISE * np.linalg.norm(old):
            exempt += 1
            continue
        err = _rel(new.astype(np.float64) - old, step)
        worst["update"] = max(worst["update"], err)
        if not err <= UPDATE_RTOL:
            errors.append(f"{var}: update, relative error {err:.2e} (update/weight "
                          f"{np.linalg.norm(step) / np.linalg.norm(old):.1e})")
    print(f"\n{name}: {len(aliases)} updated variables ({exempt} noise-only updates exempt), "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + f"; {elapsed:.1f} s")
    assert not errors, f"{name}: emulator vs XLA:\n  " + "\n  ".join(errors)
