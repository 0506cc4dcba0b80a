"""Real architectures on the emulator against XLA on CPU: a forward pass and a training step.

Models (reduced input sizes; full sizes are in ``bench/bench_models.py``):

- ``keras.applications`` ResNet50 (64x64, batch 4), MobileNetV2 (32x32, batch 4),
  EfficientNetB0 (32x32, batch 4), Xception (71x71, its minimum, batch 2), all
  ``weights=None, classes=10, classifier_activation=None`` (logits);
- ResNeXt-101 32x4d (``tf_ipu/models/resnext.py``) with one block per stage instead of
  (3, 4, 23, 3) (32x32, batch 4);
- a BERT encoder (``tf_ipu/models/bert.py``: 2 layers, hidden 64, 4 heads, sequence 32,
  vocabulary 1000, dropout 0) under ``bert_classifier`` (batch 4);
- a recurrent text classifier: Embedding (``mask_zero``, right-padded sequences of length 12),
  bidirectional LSTM (16 units, all steps), GRU (16), batch 4: ``while`` loops, masked steps.

Per model one function is lowered, so that one trace, one XLA compilation and one emulator
compilation cover both parts: ``model(x, training=False)`` followed by
``model.train_step((x, y))``, the model compiled with ``SGD(1e-5, momentum=0.9)`` and sparse
categorical cross-entropy on the logits. The forward pass reads the variables before the step
updates them. The emulator runs it in float32 from the variables' values
(``emulator_util.lower_step``, whose XLA run is printed beside it, not asserted on).

The reference is the same model, weights and step in float64 (a twin built under
``keras_util.float64_policy``: floatx and the global dtype policy float64, TensorFlow's own
kernels without XLA): float64 rounds alike on every CPU, where a float32 reference (XLA's or
TensorFlow's) depends on the host's instruction set (AVX512-FP16 and AMX hosts route some
float32 work differently; CI saw XLA's MobileNetV2 gradients 7-9e-3 away from the
emulator's on such a host; TensorFlow's float32 Xception gradients moved by 5.8e-3 with
oneDNN held to AVX, ``ONEDNN_MAX_CPU_ISA=AVX``). The twin's variables are checked to be
float64 (``set_floatx`` alone leaves a model float32 once Keras has cached its global
policy: the float64 references of the first version of this test were float32 ones). The
test stands for the IPU computing these models in float32 with float32 accumulation: the
emulator's error is that of a float32 implementation. Compared, as relative L2 norms
``|emulator - float64| / |float64|``:

- the forward logits and the loss: at most 1e-4;
- every updated variable (weights, BatchNormalization moving statistics, the loss tracker's
  totals; the iteration count exactly): at most 1e-4;
- the gradients: one step from zero momentum leaves ``-learning_rate * gradient`` in each
  momentum, so the momenta are the gradients, not rounded away by the weights they are
  added to: at most 1e-4, or the model's ``grad_rtol`` where float32 itself is that far off
  (below). Exempt: gradients that are zero in exact arithmetic, whose float32 values are
  rounding noise (a bias or normalization offset feeding a BatchNormalization through linear
  layers, e.g. ResNet50's convolution biases, MobileNetV2's and EfficientNet's projection
  offsets; the attention key bias): a bias or offset whose float64 gradient is below 1e-4 of
  its layer's kernel or scale gradient.

Weights: Keras' initializers, then biases, normalization offsets and scales and moving
statistics drawn at random (so inference-mode normalization is not the identity). In the
residual networks (ResNet50, ResNeXt, MobileNetV2) the scale of the last BatchNormalization
of each residual branch is drawn from [0.1, 0.3] (like "zero-init residual", not quite zero):
with a scale of 1 these random networks are chaotic in float32 (ReLU masks flip on rounding
differences; ResNet50's gradients ~2% from float64), so no float32 implementation meets a
useful tolerance. Damped, the emulator's worst gradient is 6e-6 (ResNet50), 5e-4
(MobileNetV2) and 1.4e-3 (EfficientNetB0, undamped: its squeeze-and-excitation gates) from
float64 on the development host (XLA's float32 ones: 7e-6, 5e-4, 8e-4; the other models
1.5e-5 or less), hence ``grad_rtol`` 1e-3, 5e-3 and 5e-3 for those three.

Dropout: the BERT model is built with rate 0. ``keras.applications.EfficientNetB0`` takes no
rate (0.2 before the classifier, 0.2 drop-connect in the blocks): its Dropout layers get
``rate = 0`` after construction (Keras reads the rate at call time), so its training step is
compared too. The other models have no dropout.
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
from tests.keras_util import float64_policy

TARGET = get_target("ipu2")
OPTIONS = CompileOptions(allow_out_of_memory=True)  # sizes are the tile model's business
RTOL = 1e-4            # logits, loss, updated variables; gradients unless a case says
LEARNING_RATE = 1e-5   # SGD, momentum 0.9: the largest relative update is a few percent


@dataclass
class Case:
    build: Callable[[], keras.Model]
    inputs: Callable[[np.random.Generator], np.ndarray]
    damp: str = ""  # regex of the BatchNormalization layers ending residual branches
    opcodes: set[str] = field(default_factory=set)  # expected in the lowered program
    grouped: bool = False  # holds a convolution with feature_group_count > 1
    grad_rtol: float = RTOL  # above RTOL where float32 itself is measured to be (see above)


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


def _rnn() -> keras.Model:
    inp = keras.Input((12,), dtype="int32")
    x = keras.layers.Embedding(200, 16, mask_zero=True)(inp)
    x = keras.layers.Bidirectional(keras.layers.LSTM(16, return_sequences=True))(x)
    x = keras.layers.GRU(16)(x)
    return keras.Model(inp, keras.layers.Dense(10)(x))


def _padded_ids(rng: np.random.Generator) -> np.ndarray:
    ids = rng.integers(1, 200, (4, 12)).astype(np.int32)
    for k, n in enumerate((12, 7, 3, 9)):  # right-padded: the mask stops each sequence early
        ids[k, n:] = 0
    return ids


CASES = {
    "resnet50": Case(_app("ResNet50", 64), _image(64, 4), r"_3_bn$",
                     {"convolution", "reduce-window", "select-and-scatter"}, grad_rtol=1e-3),
    "mobilenet_v2": Case(_app("MobileNetV2", 32), _image(32, 4), r"_project_BN$", {"convolution", "clamp"},
                         grouped=True, grad_rtol=5e-3),
    "efficientnet_b0": Case(_app("EfficientNetB0", 32), _image(32, 4), "", {"convolution", "logistic"},
                            grouped=True, grad_rtol=5e-3),
    "xception": Case(_app("Xception", 71), _image(71, 2), "", {"convolution", "select-and-scatter"},
                     grouped=True),
    "resnext": Case(_resnext, _image(32, 4), r"_3_bn$", {"convolution", "select-and-scatter"}, grouped=True),
    "bert": Case(_bert, lambda rng: rng.integers(0, 1000, (4, 32)).astype(np.int32), "",
                 {"dot", "gather", "scatter", "tanh"}),
    "rnn": Case(_rnn, _padded_ids, "", {"while", "dot", "logistic", "tanh", "select", "dynamic-update-slice"}),
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


def _float64_step(case: Case, model: keras.Model, x: np.ndarray, y: np.ndarray) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """The reference: the same model, weights and step in float64 (TensorFlow's own kernels,
    no XLA), so that it rounds alike on every CPU (float64 products and sums are not
    narrowed by any host's vector units, unlike float32 ones, which an ISA with AMX or
    AVX512-FP16 may route differently). Returns the logits and loss, and every variable's
    value after the step by its float32 twin's name (``Variable.value.name``); call it
    before the float32 model's step updates its variables."""
    with float64_policy():  # floatx alone would not do: Keras caches the global policy
        keras.utils.set_random_seed(0)
        twin = case.build()
    assert all(w.dtype in ("float64", "int64", "int32") for w in twin.weights), {w.dtype for w in twin.weights}
    _prepare(twin, "", np.random.default_rng(0))  # dropout rates; the values are copied next
    twin.set_weights([np.asarray(w, np.float64) for w in model.get_weights()])
    optimizer = keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)
    twin.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer.build(twin.trainable_variables)
    pairs = list(zip(model.variables, twin.variables, strict=True))
    pairs += list(zip(model.optimizer.variables, optimizer.variables, strict=True))
    xx = tf.constant(np.asarray(x, np.float64) if np.issubdtype(np.asarray(x).dtype, np.floating) else x)

    def forward_and_step(x: tf.Tensor, y: tf.Tensor) -> Any:
        logits = twin(x, training=False)
        return logits, twin.train_step((x, y))

    logits, metrics = tf.function(forward_and_step, autograph=False)(xx, tf.constant(y))
    pairs += list(zip(model.metrics_variables, twin.metrics_variables, strict=True))
    values = {a.value.name: np.asarray(b.numpy()) for a, b in pairs}
    return [np.asarray(logits), np.asarray(metrics["loss"])], values


def _variable_names(fn: Any, *args: Any) -> list[str]:
    concrete = fn.get_concrete_function(*args)
    by_handle = {id(v.handle): v.name for v in concrete.variables}
    return [by_handle.get(id(c), "<constant>") for c in concrete.captured_inputs]


def _noise_only(path: str, grads: dict[str, np.ndarray]) -> bool:
    """Whether the gradient of ``path`` (a bias or a normalization offset) is rounding noise:
    below 1e-4 times the gradient of its layer's kernel or scale (real ones are within ~30x
    of it; those of exactly zero gradients are ~1e-7 of it or exactly 0)."""
    layer, _, leaf = path.rpartition("/")
    if leaf not in ("bias", "beta"):
        return False
    for sibling in ("kernel", "gamma", "depthwise_kernel", "pointwise_kernel"):
        if f"{layer}/{sibling}" in grads:
            return bool(np.linalg.norm(grads[path]) <= 1e-4 * np.linalg.norm(grads[f"{layer}/{sibling}"]))
    return False


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_train_step_match_xla(name: str) -> None:
    case = CASES[name]
    t0 = time.perf_counter()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = case.build()
    _prepare(model, case.damp, rng)
    optimizer = keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer.build(model.trainable_variables)  # optimizer state outside the trace
    # From zero, the step sets each momentum to -learning_rate * gradient: the gradients,
    # unrounded by the weights they are added to.
    momentum_of = {m.value.name: v.path for v, m in zip(model.trainable_variables, optimizer.momentums, strict=True)}
    trainable = {v.value.name for v in model.trainable_variables}
    x = tf.constant(case.inputs(rng))
    y = tf.constant(rng.integers(0, 10, x.shape[0]).astype(np.int32))

    def forward_and_step(x: tf.Tensor, y: tf.Tensor) -> Any:
        logits = model(x, training=False)
        return logits, model.train_step((x, y))

    fn = tf.function(forward_and_step, jit_compile=True, autograph=False)
    exact_results, exact = _float64_step(case, model, x.numpy(), y.numpy())
    module, params, xla = eu.lower_step(fn, x, y)
    names = _variable_names(fn, x, y)
    got = compile_module(module, TARGET, OPTIONS).run(params)
    elapsed = time.perf_counter() - t0

    opcodes = {i.opcode for c in module.computations for i in c.instructions}
    assert case.opcodes <= opcodes, f"{name}: lowered program lacks {case.opcodes - opcodes}"
    groups = {i.attrs["feature_group_count"].i for c in module.computations for i in c.instructions
              if i.opcode == "convolution" and "feature_group_count" in i.attrs}
    assert case.grouped == any(g > 1 for g in groups), f"{name}: feature group counts {groups}"
    assert len(got) == len(xla)
    aliases = {a.output_index: a.parameter_number for a in module.aliases}
    n_results = len(xla) - len(aliases)
    assert n_results == 2 and all(k >= n_results for k in aliases), f"{name}: outputs {n_results}, {aliases}"
    assert len(momentum_of) == len(model.trainable_variables)

    errors: list[str] = []
    worst = {"logits": _rel(got[0], exact_results[0]), "loss": _rel(got[1], exact_results[1]), "variable": 0.0,
             "gradient": 0.0}
    xla_worst = {"logits": _rel(xla[0], exact_results[0]), "gradient": 0.0}
    for what in ("logits", "loss"):
        if not worst[what] <= RTOL:
            errors.append(f"{what}: relative error {worst[what]:.2e}")
    grads: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    xla_grads: dict[str, np.ndarray] = {}
    largest_step = 0.0  # the largest relative update of a trainable tensor (XLA's)
    for k in sorted(aliases):
        var = names[aliases[k] - 2]
        new, ref = got[k], exact[var]
        assert new.dtype == xla[k].dtype and new.shape == ref.shape, var
        if var in momentum_of:
            grads[momentum_of[var]] = (new, ref)
            xla_grads[momentum_of[var]] = xla[k]
        elif not np.issubdtype(ref.dtype, np.floating):
            if not np.array_equal(new, ref.astype(new.dtype)):
                errors.append(f"{var}: {new} != {ref}")
        else:
            err = _rel(new, ref)
            worst["variable"] = max(worst["variable"], err)
            if not err <= RTOL:
                errors.append(f"{var}: updated value, relative error {err:.2e}")
            if var in trainable:
                largest_step = max(largest_step, _rel(ref, params[aliases[k]]))
    assert len(grads) == len(momentum_of), f"{name}: not every momentum is updated"
    reference = {path: ref for path, (_, ref) in grads.items()}
    exempt = [path for path in grads if _noise_only(path, reference)]
    for path, (new, ref) in grads.items():
        if path in exempt:
            continue
        err = _rel(new, ref)
        worst["gradient"] = max(worst["gradient"], err)
        xla_worst["gradient"] = max(xla_worst["gradient"], _rel(xla_grads[path], ref))
        if not err <= case.grad_rtol:
            errors.append(f"{path}: gradient, relative error {err:.2e}")
    print(f"\n{name}: {len(aliases)} updated variables, {len(grads) - len(exempt)} gradients compared "
          f"({len(exempt)} noise-only exempt); worst relative errors: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
          + f"; largest update {largest_step:.0e} of its tensor; {elapsed:.1f} s; XLA's own (float32) "
          + ", ".join(f"{k} {v:.1e}" for k, v in xla_worst.items()))
    assert not errors, f"{name}: emulator vs float64:\n  " + "\n  ".join(errors)


def test_float32_sums_over_leading_axes_stay_accurate() -> None:
    """BatchNormalization's moments sum N*H*W values per channel. numpy summing them one row
    after another in float32 was off by ~1e-6 (2-5x XLA), which MobileNetV2's training step
    amplified to 1e-2 gradient errors; the reduce kernel accumulates such sums in float64."""
    x = (np.random.default_rng(0).standard_normal((8, 32, 32, 64)) + 3).astype(np.float32)
    exact = [x.astype(np.float64).sum(axis=(0, 1, 2)), (x.astype(np.float64) ** 2).mean(axis=(0, 1, 2))]
    module, expected = eu.lower(lambda x: (tf.reduce_sum(x, [0, 1, 2]), tf.reduce_mean(x * x, [0, 1, 2])), x)
    got = eu.run_ir(module, [x])
    assert "reduce" in {i.opcode for c in module.computations for i in c.instructions}
    for g, e in zip(got, exact, strict=True):
        assert _rel(g, e) <= 1e-7  # float32 rounding of the exact sum, and of x * x
    eu.assert_same(got, expected, rtol=1e-5)
