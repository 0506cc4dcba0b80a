"""Pipelines whose stages are PipelineStage scopes in a subclassed model's ``call()``, and in
nested models (tf_ipu/pipelining.py, ``_Trace``).

A subclassed model's layer calls are read from a run of its ``call()`` (Keras's build runs
it before ``fit`` counts steps per replica): each call in the stage of the scope entered
around it in that ``call()``. Each model here has a functional twin (the same layers,
called in the same scopes) and a CPU reference (the same layers without stages, plain
Keras at batch N x B, which is what N accumulated micro-batches of B make with reduction
'mean'; tests/test_pipelining.py). Tolerances, relative L2 of the weights: against the CPU,
1e-4 (FP32, as tests/test_pipelining.py; measured 2.5e-7); subclassed against its functional
twin, 1e-6 (measured 0: the same program, bit for bit); example11's script against the CPU
in float64, 1e-9 (measured 7.5e-16).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from keras_util import attached_ipus, float64_policy, rel_l2

RNG = np.random.default_rng(11)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = RNG.normal(size=(64, 2)).astype("float32")


def _stage(on: bool, stage: int):
    import keras

    return keras.ipu.PipelineStage(stage) if on else contextlib.nullcontext()


def _distance(got, want) -> float:
    return max(rel_l2(a, b) for a, b in zip(got, want, strict=True))


def _cpu(model, initial, lr: float, batch: int, epochs: int = 2):
    """``model`` (no stages) trained by plain Keras on the CPU from ``initial``."""
    import keras

    model(X[:1])
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    model.fit(X, Y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def _ipu_fit(model, initial, lr: float, steps: int, micro: int, mapping, epochs: int = 2):
    """``model`` (in the IPUStrategy's scope, stages in it) trained as a pipeline of ``micro``
    micro-batches of 4 per update; returns its weights, weight updates and plan."""
    import keras

    from tf_ipu import pipelining

    model(X[:1])
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", steps_per_execution=steps)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=micro,
                                 device_mapping=mapping,
                                 gradient_accumulation_reduction_method="mean")
    model.fit(X, Y, batch_size=4, epochs=epochs, shuffle=False, verbose=0)
    return (model.get_weights(), int(model.optimizer.iterations.numpy()),
            pipelining.plan(model, steps))


# -- example11's shape: one layer called four times over two stages ---------------------------


def _shared_layers():
    import keras

    return (keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8, activation="tanh"),
            keras.layers.Concatenate(), keras.layers.Dense(2))


def _shared_subclassed(stages: bool):
    """graphcore/keras example11's MyModel (small): dense_2 called twice in stage 1 and twice
    in stage 2, then a concatenation (stage 2) and the head (stage 3)."""
    import keras

    class Shared(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.d1, self.d2, self.concat, self.d3 = _shared_layers()

        def call(self, x):
            with _stage(stages, 0):
                x = self.d1(x)
            with _stage(stages, 1):
                a = self.d2(x)
                b = self.d2(x)
            with _stage(stages, 2):
                a = self.d2(a)
                b = self.d2(b)
                x = self.concat([a, b])
            with _stage(stages, 3):
                return self.d3(x)

    return Shared()


def _shared_functional(stages: bool):
    import keras

    d1, d2, concat, d3 = _shared_layers()
    inputs = keras.Input((6,))
    with _stage(stages, 0):
        x = d1(inputs)
    with _stage(stages, 1):
        a, b = d2(x), d2(x)
    with _stage(stages, 2):
        x = concat([d2(a), d2(b)])
    with _stage(stages, 3):
        x = d3(x)
    return keras.Model(inputs, x)


def test_a_subclassed_pipeline_is_its_functional_twin(ipu_system):
    """4 stages on IPUs [0, 1, 1, 0] (example11's mapping): one replica of 2 IPUs, 4
    micro-batches per update: 2 epochs x 16 batches / 4 = 8 weight updates (2 data-parallel
    replicas, what the model trained as before, make 4); the plan, the stage of each call
    and the weights are the functional twin's."""
    import keras

    import tf_ipu
    from device_server.protocol import ir_pb2
    from tf_ipu import runtime

    keras.utils.set_random_seed(3)
    initial = _shared_functional(False).get_weights()
    want = _cpu(_shared_subclassed(False), initial, 0.05, batch=16)
    mapping = [0, 1, 1, 0]
    with attached_ipus(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            sub = _shared_subclassed(True)
            got, updates, plan = _ipu_fit(sub, initial, 0.05, 8, 4, mapping)
            entry = [e for e in runtime.get_runtime()._programs if e.pipeline][-1]
            twin = _shared_functional(True)
            twin_got, twin_updates, twin_plan = _ipu_fit(twin, initial, 0.05, 8, 4, mapping)
            assignments = sub.get_pipeline_stage_assignment()
            stages = [a.pipeline_stage for a in assignments]
            calls = _calls_by_layer(sub)
            twin_calls = _calls_by_layer(twin)
    assert stages == [0, 1, 1, 2, 2, 2, 3]  # the order call() makes them
    assert type(assignments[1]) is keras.ipu.ModelLayerPipelineStageAssignment  # Graphcore's
    assert assignments[1].layer is sub.d2 and assignments[4].node_index == 3
    assert calls == twin_calls == [(0, 0), (1, 1), (1, 1), (1, 2), (1, 2), (2, 2), (3, 3)]
    assert plan is not None and plan == twin_plan
    assert plan["stages"] == 4 and plan["stage_ipus"] == mapping
    assert plan["ipus_per_replica"] == 2
    assert updates == twin_updates == 2 * 64 // 16
    assert _distance(got, want) <= 1e-4
    assert _distance(got, twin_got) <= 1e-6
    # The program's instructions: each layer's matrix products in its calls' stages.
    module = ir_pb2.Module.FromString(entry.program)
    seen = set()
    for comp in module.computations:
        for instr in comp.instructions:
            stage = instr.attrs["pipeline_stage"].i
            seen.add(stage)
            if instr.opcode == "dot" and f"/{sub.d1.name}/" in instr.source_op:
                assert stage == 0, instr.source_op
            if instr.opcode == "dot" and f"/{sub.d3.name}/" in instr.source_op:
                assert stage == 3, instr.source_op
    assert seen == {0, 1, 2, 3}


def _calls_by_layer(model) -> list[tuple[int, int]]:
    """(the layer's place among the model's layers, stage) of each layer call, sorted (a
    functional model lists its calls by depth, a subclassed one in the order call() makes
    them)."""
    import keras

    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    return sorted((layers.index(a.layer), a.pipeline_stage)
                  for a in model.get_pipeline_stage_assignment())


# -- nested models ----------------------------------------------------------------------------


def _tail_class():
    import keras

    class Tail(keras.Model):
        """A subclassed model whose call() puts its two layers in stage 1."""

        def __init__(self, stages: bool) -> None:
            super().__init__()
            self.stages = stages
            self.hidden = keras.layers.Dense(8, activation="tanh")
            self.out = keras.layers.Dense(2)

        def call(self, x):
            with _stage(self.stages, 1):
                return self.out(self.hidden(x))

    return Tail


def _nested(kind: str, stages: bool):
    """Dense(8) x 3 and Dense(2), stages [0, 0, 1, 1], through nested models:

    - functional: a functional submodel (its layers built in scopes 0, 0, 1), then Dense(2)
      called in scope 1;
    - sequential: a Sequential holding that submodel, then Dense(2) built in scope 1;
    - subclassed: a subclassed model calling a Sequential block in scope 0, then a
      subclassed Tail whose call() has scope 1;
    - functional_of_subclassed: a functional model calling the Sequential block in scope 0,
      then the Tail."""
    import keras

    def sub():
        inputs = keras.Input((6,))
        with _stage(stages, 0):
            x = keras.layers.Dense(8, activation="tanh")(inputs)
            x = keras.layers.Dense(8, activation="tanh")(x)
        with _stage(stages, 1):
            x = keras.layers.Dense(8, activation="tanh")(x)
        return keras.Model(inputs, x)

    def block():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(8, activation="tanh")])

    if kind == "functional":
        inputs = keras.Input((6,))
        x = sub()(inputs)
        head = keras.layers.Dense(2)
        with _stage(stages, 1):
            x = head(x)
        return keras.Model(inputs, x)
    if kind == "sequential":
        inner = sub()
        with _stage(stages, 1):
            head = keras.layers.Dense(2)
        return keras.Sequential([keras.Input((6,)), inner, head])
    tail_class = _tail_class()
    if kind == "subclassed":
        class Outer(keras.Model):
            def __init__(self) -> None:
                super().__init__()
                self.block = block()
                self.tail = tail_class(stages)

            def call(self, x):
                with _stage(stages, 0):
                    x = self.block(x)
                return self.tail(x)

        return Outer()
    assert kind == "functional_of_subclassed"
    inputs = keras.Input((6,))
    first = block()
    with _stage(stages, 0):
        x = first(inputs)
    x = tail_class(stages)(x)
    return keras.Model(inputs, x)


def _flat_twin(stages: bool):
    import keras

    inputs = keras.Input((6,))
    x = inputs
    for k, width in enumerate((8, 8, 8, 2)):
        with _stage(stages, 0 if k < 2 else 1):
            x = keras.layers.Dense(width, activation="tanh" if width > 2 else None)(x)
    return keras.Model(inputs, x)


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed",
                                  "functional_of_subclassed"])
def test_nested_models_pipeline_as_their_flat_twin(ipu_system, kind):
    """Each nesting: the flat functional twin's plan (2 stages on IPUs [0, 1]), its
    2 x 16 / 8 = 4 weight updates, and the CPU's weights."""

    import tf_ipu

    initial, want = _flat_reference()
    with attached_ipus(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            model = _nested(kind, True)
            got, updates, plan = _ipu_fit(model, initial, 0.05, 16, 8, None)
            twin_plan = _ipu_plan(_flat_twin(True), 16, 8)
            leaves = _leaf_stages(model.get_pipeline_stage_assignment())
    assert leaves == [0, 0, 1, 1]
    assert plan is not None and plan == twin_plan
    assert plan["stages"] == 2 and plan["stage_ipus"] == [0, 1] and plan["ipus_per_replica"] == 2
    assert updates == 2 * 64 // 32
    assert _distance(got, want) <= 1e-4


_REFERENCE: list = []


def _flat_reference():
    """The flat twin's initial weights and its CPU training at batch 32 (made once)."""
    import keras

    if not _REFERENCE:
        keras.utils.set_random_seed(4)
        initial = _flat_twin(False).get_weights()
        _REFERENCE.extend([initial, _cpu(_flat_twin(False), initial, 0.05, batch=32)])
    return _REFERENCE[0], _REFERENCE[1]


def _ipu_plan(model, steps: int, micro: int):
    from tf_ipu import pipelining

    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=micro,
                                 gradient_accumulation_reduction_method="mean")
    return pipelining.plan(model, steps)


def _leaf_stages(assignments) -> list:
    out = []
    for a in assignments:
        if a.is_nested_model:
            out.extend(_leaf_stages(a.pipeline_stage_assignments))
        else:
            out.append(a.pipeline_stage)
    return out


# -- what cannot be read raises ----------------------------------------------------------------


def test_unreadable_stages_raise_and_never_train_unpipelined(ipu_system):
    import keras

    import tf_ipu
    from tf_ipu import pipelining

    class NoScopes(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.a = keras.layers.Dense(8)
            self.b = keras.layers.Dense(2)

        def call(self, x):
            return self.b(self.a(x))

    class OneOutside(NoScopes):
        def call(self, x):
            with keras.ipu.PipelineStage(0):
                x = self.a(x)
            return self.b(x)

    class Block(keras.layers.Layer):
        """A layer (not a model) whose call() enters stages."""

        def __init__(self) -> None:
            super().__init__()
            self.a = keras.layers.Dense(8)
            self.b = keras.layers.Dense(2)

        def call(self, x):
            with keras.ipu.PipelineStage(0):
                x = self.a(x)
            with keras.ipu.PipelineStage(1):
                return self.b(x)

    class InLayer(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def call(self, x):
            return self.block(x)

    class TrainingOnly(NoScopes):
        """A layer called only in training (the build's trace has training=False), outside
        the stages."""

        def __init__(self) -> None:
            super().__init__()
            self.noise = keras.layers.Activation("tanh")

        def call(self, x, training=False):
            with keras.ipu.PipelineStage(0):
                x = self.a(x)
            if training:
                x = self.noise(x)
            with keras.ipu.PipelineStage(1):
                return self.b(x)

    def compiled(model):
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
        return model

    def fit(model):
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0)

    with attached_ipus(ipu_system, 2):
        with tf_ipu.IPUStrategy().scope():
            no_scopes = compiled(NoScopes())
            one_outside = compiled(OneOutside())
            in_layer = compiled(InLayer())
            training_only = compiled(TrainingOnly())
            with keras.ipu.PipelineStage(1):  # around the model's call, not in call()
                no_scopes(X[:4])
        with pytest.raises(ValueError, match=r"set_pipelining_options was called, but the model "
                                             r"has no pipeline stage: its call\(\) makes no "
                                             r"layer call inside a keras.ipu.PipelineStage"):
            fit(no_scopes)
        with pytest.raises(ValueError, match=rf"layers \['{one_outside.b.name}'\] have no "
                                             r"pipeline stage"):
            fit(one_outside)
        with pytest.raises(ValueError, match=rf"cannot be read: PipelineStage\(0\) is entered "
                                             rf"inside the call of layer '{in_layer.block.name}' "
                                             r"\(Block, not a keras.Model\)"):
            fit(in_layer)
        with tf_ipu.IPUStrategy().scope():  # its call() has run: known at once now
            with pytest.raises(ValueError, match=r"set_pipelining_options: the pipeline stages "
                                                 r"of .* cannot be read"):
                in_layer.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
        with pytest.raises(ValueError, match=rf"layers \['{training_only.noise.name}'\] have "
                                             r"no pipeline stage.*; found as its call\(\) was traced "
                                             r"for the device program, with training=True"):
            fit(training_only)
        for model in (no_scopes, one_outside, in_layer, training_only):
            assert int(model.optimizer.iterations.numpy()) == 0, model.name
        with tf_ipu.IPUStrategy().scope():
            plain = compiled(_flat_twin(False))  # a functional model without stages
            with pytest.raises(ValueError, match=r"has no pipeline stage: no layer \(call\) has "
                                                 r"a stage"):
                pipelining.plan(plain, 4)
            staged = compiled(_shared_subclassed(True))
            staged.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                          device_mapping=[0, 1, 1, 0])
            staged(X[:4])
            assert pipelining.plan(staged, 4)["stages"] == 4
            staged.reset_pipeline_stage_assignment()  # Graphcore's: no longer pipelined
            assert pipelining.plan(staged, 4) is None
            staged.set_pipeline_stage_assignment([0, 0, 0, 1, 1, 1, 1])  # per call()'s call
            staged.set_pipelining_options(gradient_accumulation_steps_per_replica=4,
                                          device_mapping=[0, 0])
            assert pipelining.plan(staged, 4)["stages"] == 2


# -- graphcore/keras example11 -------------------------------------------------------------------


def test_user_guide_example11_subclassed_pipeline(ipu_system):
    """The API calls of graphcore/keras keras/ipu/docs/example11.py (commit
    29c92929e97bd439edebb9ba29edd5bfb5ffea07), written here at small sizes: a subclassed
    model whose call() puts dense_layer_2's four calls in stages 1, 1, 2, 2;
    ``compile(rmsprop, SparseCategoricalCrossentropy, accuracy, steps_per_execution)``;
    ``set_pipelining_options(gradient_accumulation_steps_per_replica=16,
    device_mapping=[0, 1, 1, 0])``; ``fit(dataset, epochs=2, steps_per_epoch=...)`` on 2
    IPUs. Differences: 12 features instead of 28 x 28 MNIST images, 4 classes from a
    Dense(4) (Keras 3 refuses the Dense(1) output for the sparse cross-entropy),
    ``from_logits=True``, steps_per_execution 16 and 16 steps per epoch instead of 256 and
    128: 2 weight updates instead of 16 (a data-parallel run makes 1). Reference: the same
    model and dataset on the CPU with Keras's gradient accumulation (16), both in float64
    (RMSprop's first updates are about lr * sign(g): see tests/test_graphcore_examples.py,
    ``_cpu_then_ipu``): weights within 1e-9 relative L2."""
    import keras
    import tensorflow as tf
    from tensorflow.python import ipu

    from tf_ipu import pipelining

    rng = np.random.default_rng(12)
    features = rng.normal(size=(32 * 8, 12)).astype("float32")
    labels = rng.integers(0, 4, size=(32 * 8,)).astype("int32")

    def create_dataset():
        train_ds = tf.data.Dataset.from_tensor_slices((features, labels)).batch(
            8, drop_remainder=True)
        train_ds = train_ds.map(lambda d, label: (tf.cast(d, tf.float64), label))
        return train_ds.repeat().prefetch(16)

    def my_model(stages: bool):
        class MyModel(keras.Model):
            def __init__(self) -> None:
                super().__init__()
                self.dense_layer_1 = keras.layers.Dense(8)
                self.dense_layer_2 = keras.layers.Dense(8)
                self.concat_layer = keras.layers.Concatenate()
                self.dense_layer_3 = keras.layers.Dense(4)

            def call(self, inputs):
                with _stage(stages, 0):
                    x = self.dense_layer_1(inputs)
                with _stage(stages, 1):
                    x1 = self.dense_layer_2(x)
                    x2 = self.dense_layer_2(x)
                with _stage(stages, 2):
                    x1 = self.dense_layer_2(x1)
                    x2 = self.dense_layer_2(x2)
                    x = self.concat_layer([x1, x2])
                with _stage(stages, 3):
                    x = self.dense_layer_3(x)
                return x

        return MyModel()

    def train(on_ipu: bool):
        model = my_model(on_ipu)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer="rmsprop", metrics=["accuracy"], steps_per_execution=16)
        if on_ipu:
            model.set_pipelining_options(gradient_accumulation_steps_per_replica=16,
                                         device_mapping=[0, 1, 1, 0])
        else:
            model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=16)
        model.fit(create_dataset(), epochs=2, steps_per_epoch=16, verbose=0)
        return model

    with float64_policy():
        keras.utils.set_random_seed(13)
        reference = train(False)
        cfg = ipu.config.IPUConfig()  # example11's configuration calls, on the suite's server
        cfg.server_address = ipu_system.server_address
        cfg.ipu_model.version = "ipu2"
        cfg.auto_select_ipus = 2
        cfg.configure_ipu_system()
        try:
            keras.utils.set_random_seed(13)
            strategy = ipu.ipu_strategy.IPUStrategy()
            with strategy.scope():
                model = train(True)
                plan = pipelining.plan(model, 16)
        finally:
            ipu_system.configure_ipu_system()
    assert plan["stages"] == 4 and plan["stage_ipus"] == [0, 1, 1, 0]
    assert plan["ipus_per_replica"] == 2 and plan["micro_batches"] == 16
    assert int(model.optimizer.iterations.numpy()) == 2
    assert int(reference.optimizer.iterations.numpy()) == 2
    assert _distance(model.get_weights(), reference.get_weights()) <= 1e-9
