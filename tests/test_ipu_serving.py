"""Graphcore's ``model.export_for_ipu_serving`` and ``ipu.serving``: the SavedModel holds one
IpuExecute op with the lowered model, and a fresh process (which only imports tf_ipu) serves
it from the suite's device server, as Keras's ``predict`` on the CPU computes it; host-side
pre/postprocessing steps run around it; bad arguments are errors naming what was passed.
``ipu.serving.export_pipeline``: stage functions exported as a pipeline on the IPUs of
``device_mapping`` (replicated when more IPUs are attached), served by a fresh process that
attaches those IPUs, as the stages compute in plain TF on the CPU (relative L2 1e-5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_ipu
from tests.keras_util import attached_ipus, rel_l2
from tf_ipu.serving import read_requirements

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tf_ipu
    path, inputs = sys.argv[1], json.loads(sys.argv[2])
    loaded = tf.saved_model.load(path)
    sig = loaded.signatures["serving_default"]
    feed = {k: tf.constant(np.asarray(v, dtype=d)) for k, (v, d) in inputs.items()}
    out = {"inputs": sorted(sig.structured_input_signature[1]),
           "signature": {k: v.numpy().tolist() for k, v in sig(**feed).items()}}
    ordered = [feed[k] for k in json.loads(sys.argv[3])]
    direct = loaded.predict(*ordered)
    out["predict"] = [t.numpy().tolist() for t in tf.nest.flatten(direct)]
    print("RESULT " + json.dumps(out))
    """
)


def _serve_in_child(path: str, inputs: dict[str, np.ndarray], order: list[str]) -> dict:
    """Loads the SavedModel in a fresh process against this process's device server; calls
    its signature (by input name) and ``predict`` (positionally, in ``order``)."""
    client = tf_ipu.get_runtime().client
    env = dict(os.environ, TF_IPU_SERVER=client.address, TF_CPP_MIN_LOG_LEVEL="3")
    encoded = json.dumps({k: (v.tolist(), str(v.dtype) if v.dtype.kind != "U" else "str")
                          for k, v in inputs.items()})
    proc = subprocess.run([sys.executable, "-c", _CHILD, path, encoded, json.dumps(order)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _two_input_model() -> keras.Model:
    x1 = keras.Input((6,), name="features")
    x2 = keras.Input((3,), name="extra")
    h = keras.layers.Dense(8, activation="relu", name="hidden")(x1)
    h = keras.layers.Concatenate()([h, x2])
    logits = keras.layers.Dense(4, name="logits")(h)
    probs = keras.layers.Softmax(name="probs")(logits)
    return keras.Model([x1, x2], [logits, probs], name="two_in")


def _cpu_twin(model: keras.Model, build) -> keras.Model:
    cpu = build()
    cpu.set_weights(model.get_weights())
    return cpu


def _ipu_execute_ops(fn) -> int:
    graph = fn.get_concrete_function().graph
    return sum(op.type == "IpuExecute" for op in graph.get_operations())


def test_exported_keras_model_serves_in_a_fresh_process(ipu_system, tmp_path):
    strategy = tf_ipu.IPUStrategy()
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = _two_input_model()  # no batch size in its Inputs: given at export
        model.compile(steps_per_execution=8)
    rng = np.random.default_rng(0)
    x1 = rng.standard_normal((4, 6)).astype("float32")
    x2 = rng.standard_normal((4, 3)).astype("float32")
    cpu = _cpu_twin(model, _two_input_model).predict([x1, x2], verbose=0)

    path = tmp_path / "exported"
    path.mkdir()
    (path / "stale").write_text("from an earlier export")
    serve = model.export_for_ipu_serving(str(path), batch_size=4, purge_export_dir=True)
    assert not (path / "stale").exists()
    assert _ipu_execute_ops(serve) == 1
    here = serve(x1, x2)  # the returned function runs here
    for got, want in zip(here, cpu, strict=True):
        assert rel_l2(got.numpy(), want) <= 1e-5

    client = tf_ipu.get_runtime().client
    before = client.counters()["executions"]
    result = _serve_in_child(str(path), {"features": x1, "extra": x2}, ["features", "extra"])
    assert client.counters()["executions"] == before + 2  # the signature's and predict's calls
    assert result["inputs"] == ["extra", "features"]  # named after the model's Inputs
    assert sorted(result["signature"]) == ["output_0", "output_1"]
    for k, want in enumerate(cpu):
        assert rel_l2(np.array(result["signature"][f"output_{k}"]), want) <= 1e-5
        assert rel_l2(np.array(result["predict"][k]), want) <= 1e-5


def _sequential() -> keras.Model:
    return keras.Sequential([keras.Input((5,), batch_size=3), keras.layers.Dense(6, "tanh"),
                             keras.layers.Dense(2)], name="seq")


def test_host_pre_and_postprocessing_wrap_the_device_program(ipu_system, tmp_path):
    """Graphcore's _cpu_ example's shape: a preprocessing step of string ops (no XLA kernel:
    it runs on the host) reading a variable, a postprocessing step without a tf.function,
    output_names; the SavedModel's inputs are named after the preprocessing step's
    arguments."""
    strategy = tf_ipu.IPUStrategy()
    keras.utils.set_random_seed(4)
    with strategy.scope():
        model = _sequential()  # batch size 3 from its Input
    scale = tf.Variable(0.5)  # created outside the strategy: a host variable of the step
    offset = tf.Variable(2.0)

    @tf.function(input_signature=[tf.TensorSpec([3, 5], tf.string)])
    def parse(text):
        return tf.strings.to_number(text) * scale

    def finish(logits):
        return logits + offset, tf.argmax(logits, axis=1)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5)).astype("float32")
    text = np.array([[repr(float(v)) for v in row] for row in x])
    logits = _cpu_twin(model, _sequential).predict(x * 0.5, verbose=0)
    want = {"shifted": logits + 2.0, "label": np.argmax(logits, axis=1)}

    path = str(tmp_path / "with_steps")
    serve = model.export_for_ipu_serving(
        path, output_names=["shifted", "label"], preprocessing_step=parse,
        postprocessing_step=finish,
        postprocessing_step_signature=(tf.TensorSpec([3, 2], tf.float32),))
    assert _ipu_execute_ops(serve) == 1
    here = serve(tf.constant(text))
    assert rel_l2(here["shifted"].numpy(), want["shifted"]) <= 1e-5
    np.testing.assert_array_equal(here["label"].numpy(), want["label"])

    result = _serve_in_child(path, {"text": text}, ["text"])
    assert result["inputs"] == ["text"]
    assert sorted(result["signature"]) == ["label", "shifted"]
    assert rel_l2(np.array(result["signature"]["shifted"]), want["shifted"]) <= 1e-5
    np.testing.assert_array_equal(result["signature"]["label"], want["label"])


def test_ipu_serving_export_keras_and_export_single_step(ipu_system, tmp_path):
    from tensorflow.python.ipu import serving  # Graphcore's path: tf_ipu/graphcore/serving.py

    strategy = tf_ipu.IPUStrategy()
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = _sequential()
    x = np.random.default_rng(2).standard_normal((3, 5)).astype("float32")
    cpu = _cpu_twin(model, _sequential).predict(x, verbose=0)
    serve = serving.export_keras(model, str(tmp_path / "keras"), output_names="y")
    assert rel_l2(serve(x)["y"].numpy(), cpu) <= 1e-5

    w = tf.Variable(np.arange(6, dtype="float32").reshape(3, 2))

    @tf.function(input_signature=[tf.TensorSpec([2, 3], tf.float32)])
    def predict_step(rows):
        return tf.nn.relu(tf.matmul(rows, w) - 4.0)

    a = np.array([[1, 0, 2], [0, 1, -1]], "float32")
    path = str(tmp_path / "single")
    step = serving.export_single_step(predict_step, path, iterations=16)
    assert _ipu_execute_ops(step) == 1
    expected = np.maximum(a @ w.numpy() - 4.0, 0.0)
    np.testing.assert_allclose(step(a).numpy(), expected, rtol=1e-6)
    loaded = tf.saved_model.load(path)
    out = loaded.signatures["serving_default"](rows=tf.constant(a))
    np.testing.assert_allclose(out["output_0"].numpy(), expected, rtol=1e-6)

    # A dataset gives the signature; a plain function is fine then.
    dataset = tf.data.Dataset.from_tensors(tf.zeros([2, 3])).repeat()
    step2 = serving.export_single_step(lambda rows: rows * 2.0, str(tmp_path / "ds"), 4,
                                       input_dataset=dataset)
    np.testing.assert_allclose(step2(a).numpy(), a * 2.0)


@pytest.fixture(scope="module")
def exportable(ipu_system):
    strategy = tf_ipu.IPUStrategy()
    with strategy.scope():
        fixed = _sequential()
        unknown = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)], name="nobatch")
    return fixed, unknown


@pytest.mark.parametrize("kwargs, error, names", [
    ({"batch_size": 0}, ValueError, "batch_size=0"),
    ({"batch_size": "4"}, ValueError, "batch_size='4'"),
    ({"output_names": 3}, TypeError, "output_names=3"),
    ({"output_names": ["a", "b"]}, ValueError, "output_names names 2 outputs"),
    ({"preprocessing_step": 7}, TypeError, "preprocessing_step=7"),
    ({"preprocessing_step": lambda x: x}, ValueError, "preprocessing_step '<lambda>'"),
    ({"preprocessing_step": lambda x: x, "preprocessing_step_signature": [3]}, TypeError,
     "preprocessing_step_signature[0]"),
    ({"preprocessing_step": lambda x: x, "preprocessing_step_signature": ()}, ValueError,
     "preprocessing_step_signature=()"),
    ({"preprocessing_step": lambda x: x[:, :4],
      "preprocessing_step_signature": [tf.TensorSpec([3, 5], tf.float32)]}, ValueError,
     "shape (3, 4)"),
    ({"postprocessing_step": tf.abs,
      "postprocessing_step_signature": [tf.TensorSpec([3, 7], tf.float32)]}, ValueError,
     "shape (3, 7)"),
])
def test_bad_arguments_name_what_was_passed(exportable, tmp_path, kwargs, error, names):
    fixed, _ = exportable
    path = tmp_path / "out"
    path.mkdir()
    (path / "keep.txt").write_text("an earlier export")
    with pytest.raises(error) as info:
        fixed.export_for_ipu_serving(str(path), purge_export_dir=True, **kwargs)
    assert names in str(info.value)
    assert [p.name for p in path.iterdir()] == ["keep.txt"]  # not purged, nothing saved


def test_unknown_batch_size_non_empty_dir_and_foreign_models(exportable, tmp_path):
    fixed, unknown = exportable
    with pytest.raises(ValueError, match=r"batch size of model 'nobatch'.*\(None, 5\)"):
        unknown.export_for_ipu_serving(str(tmp_path / "a"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        fixed.export_for_ipu_serving(str(full))
    assert (full / "keep.txt").exists()
    cpu = keras.Sequential([keras.Input((5,), batch_size=2), keras.layers.Dense(2)], name="cpu")
    with pytest.raises(ValueError, match="model 'cpu' was not created inside an IPU strategy"):
        cpu.export_for_ipu_serving(str(tmp_path / "b"))
    from tf_ipu.serving import export_single_step

    with pytest.raises(ValueError, match="iterations=0"):
        export_single_step(tf.abs, str(tmp_path / "c"), 0)
    with pytest.raises(ValueError, match="inputs of predict_step 'abs' are not known"):
        export_single_step(tf.abs, str(tmp_path / "c"), 1)


# -- ipu.serving.export_pipeline -----------------------------------------------------------------

_PIPELINE_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tf_ipu
    runtime = tf_ipu.get_runtime()
    out = {}
    for job in json.loads(sys.argv[1]):  # nothing configured: each attaches its IPUs
        loaded = tf.saved_model.load(job["path"])
        sig = loaded.signatures["serving_default"]
        feed = {k: tf.constant(np.asarray(v, dtype=d)) for k, (v, d) in job["feed"].items()}
        result = sig(**feed)
        report = [r for r in runtime.reports if r.name == job["program"]][-1]
        out[job["key"]] = {"inputs": sorted(sig.structured_input_signature[1]),
                           "outputs": {k: v.numpy().tolist() for k, v in result.items()},
                           "attached": len(runtime.client.attachment.ipu_ids),
                           "report": [report.stages, report.details["stage_ipus"],
                                      report.replicas, report.ipus]}
    print("RESULT " + json.dumps(out))
    """
)

_ROWS, _WIDTH = 2, 4


def _pipeline_stages():
    """Three stages over two IPUs: the first takes ``inputs``' scale before the fed values
    and reads a variable, the second gets a dict (keyword arguments), the third a tuple."""
    w = tf.Variable(np.random.default_rng(8).standard_normal((_WIDTH, 3)).astype("float32"))

    @tf.function
    def mix(scale, lhs, rhs):
        return {"h": tf.tanh(tf.matmul(lhs * rhs, w) * scale), "rhs": rhs}

    def shift(h, rhs):
        return h + tf.reduce_mean(rhs, axis=1, keepdims=True), h

    def finish(y, h):
        return y * 2.0, tf.reduce_sum(h, axis=1)

    return [mix, shift, finish]


def _on_cpu(stages, first_args):
    """The stages computed one after the other in plain TF on the CPU, as Graphcore's
    pipeline chains them (a dict as keyword arguments, a tuple as positional ones, a tensor
    as the one argument)."""
    with tf.device("/CPU:0"):
        values = first_args
        for stage in stages:
            if isinstance(values, dict):
                values = stage(**values)
            elif isinstance(values, (tuple, list)):
                values = stage(*values)
            else:
                values = stage(values)
    return [np.asarray(v) for v in tf.nest.flatten(values)]


@pytest.fixture(scope="module")
def pipeline_exports(ipu_system, tmp_path_factory):
    """Two export_pipeline exports: three stages on IPUs [0, 1, 1] with 2 IPUs attached (one
    replica), and two stages with a host preprocessing step (string parsing) and a dataset
    giving its signature, exported with 4 IPUs attached (two replicas of 2 IPUs)."""
    from tensorflow.python.ipu import serving

    root = tmp_path_factory.mktemp("export_pipeline")
    rng = np.random.default_rng(9)
    lhs = rng.standard_normal((_ROWS, _WIDTH)).astype("float32")
    rhs = rng.standard_normal((_ROWS, _WIDTH)).astype("float32")
    cases = {}
    with attached_ipus(ipu_system, 2):
        stages = _pipeline_stages()
        spec = tf.TensorSpec([_ROWS, _WIDTH], tf.float32)
        path = str(root / "three_stages")
        serve = serving.export_pipeline(
            stages, path, iterations=8, inputs=[np.float32(0.5)], device_mapping=[0, 1, 1],
            name="mixer", output_names=["y", "total"],
            # Graphcore's rule: a signature of all the first stage's arguments drops inputs'.
            predict_step_signature=[tf.TensorSpec([], tf.float32), spec, spec])
        assert _ipu_execute_ops(serve) == 1
        here = serve(lhs, rhs)
        cases["three_stages"] = {
            "path": path, "program": "mixer/export_pipeline[stages=3]",
            "here": [here["y"].numpy(), here["total"].numpy()],
            "want": _on_cpu(stages, [tf.constant(0.5), lhs, rhs]),
            "names": ["y", "total"], "inputs": ["lhs", "rhs"],
            "feed": {"lhs": lhs, "rhs": rhs}, "layout": [3, [0, 1, 1], 1, 2]}
    with attached_ipus(ipu_system, 4):
        v = tf.Variable(np.linspace(-1, 1, _WIDTH, dtype="float32"))

        @tf.function(input_signature=[tf.TensorSpec([_ROWS, _WIDTH], tf.string)])
        def parse(text):
            return tf.strings.to_number(text)

        def stage1(x):
            return x * v

        def stage2(x):
            return tf.nn.softplus(x) - 1.0

        text = np.array([[repr(float(t)) for t in row] for row in lhs])
        path = str(root / "replicated")
        dataset = tf.data.Dataset.from_tensors(tf.constant(text)).repeat()
        serve = serving.export_pipeline(
            [stage1, stage2], path, 4, device_mapping=[0, 1], pipeline_schedule="Interleaved",
            input_dataset=dataset, preprocessing_step=parse)
        here = serve(tf.constant(text))
        cases["replicated"] = {
            "path": path, "program": "pipeline/export_pipeline[stages=2, replicas=2]",
            "here": [here.numpy()], "want": _on_cpu([stage1, stage2], [lhs]),
            "names": ["output_0"], "inputs": ["text"], "feed": {"text": text},
            "layout": [2, [0, 1], 2, 4]}
    return cases


@pytest.mark.parametrize("key", ["three_stages", "replicated"])
def test_export_pipeline_computes_the_stages_and_records_their_ipus(pipeline_exports, key):
    case = pipeline_exports[key]
    for got, want in zip(case["here"], case["want"], strict=True):
        assert rel_l2(got, want) <= 1e-5
    stages, stage_ipus, replicas, ipus = case["layout"]
    report = [r for r in tf_ipu.get_runtime().reports if r.name == case["program"]][-1]
    assert [report.stages, report.details["stage_ipus"], report.replicas, report.ipus] \
        == case["layout"], report.summary()
    assert f"pipeline of {stages} stages on IPUs {stage_ipus} ({ipus} IPUs)" \
        in report.summary()
    recorded = read_requirements(case["path"])
    assert recorded["exported_by"] == "tf_ipu export_pipeline"
    assert recorded["ipus"] == ipus
    (program,) = recorded["programs"]
    assert [program["stages"], program["stage_ipus"], program["replicas"], program["ipus"]] \
        == case["layout"]


def test_export_pipeline_serves_in_a_fresh_process(pipeline_exports):
    jobs = [{"key": k, "path": c["path"], "program": c["program"],
             "feed": {n: (v.tolist(), "str" if v.dtype.kind == "U" else str(v.dtype))
                      for n, v in c["feed"].items()}} for k, c in pipeline_exports.items()]
    client = tf_ipu.get_runtime().client
    before = client.counters()["executions"]
    env = dict(os.environ, TF_IPU_SERVER=client.address, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _PIPELINE_CHILD, json.dumps(jobs)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert client.counters()["executions"] == before + len(jobs)
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")][-1]
    served = json.loads(line[len("RESULT "):])
    for key, case in pipeline_exports.items():
        got = served[key]
        assert got["inputs"] == sorted(case["inputs"]), key
        assert sorted(got["outputs"]) == sorted(case["names"]), key
        for name, want in zip(case["names"], case["want"], strict=True):
            assert rel_l2(np.array(got["outputs"][name]), want) <= 1e-5, (key, name)
        assert got["report"] == case["layout"], key
        assert got["attached"] == case["layout"][3], key  # the IPUs it needs, attached


def test_export_pipeline_bad_arguments_and_too_few_ipus(ipu_system, tmp_path):
    from tensorflow.python.ipu import serving

    spec = [tf.TensorSpec([2], tf.float32)]
    path = tmp_path / "out"

    def stage(x):
        return x + 1.0

    bad = [
        ({"device_mapping": [0]}, ValueError, "device_mapping [0] names 1 IPUs for 2"),
        ({"device_mapping": [0, -1]}, ValueError, "device_mapping=[0, -1]"),
        ({"pipeline_schedule": "Fastest"}, ValueError, "pipeline_schedule='Fastest'"),
        ({"poplar_options": [None]}, ValueError, "poplar_options=[None]"),
        ({"variable_initializer": lambda session: None}, ValueError, "no session"),
        ({"input_signature": spec}, ValueError, "not both"),
        ({"predict_step_signature": None}, ValueError,
         "inputs of computational_stages[0] 'stage' are not known"),
        ({"iterations": 0}, ValueError, "iterations=0"),
        ({"predict_step_signature": spec * 2}, ValueError,
         "takes 1 arguments, but it would get 0 from inputs and 2 fed ones"),
        ({"output_names": ["a", "b"], "device_mapping": [0, 0]}, ValueError,
         "output_names names 2 outputs"),
    ]
    for kwargs, error, message in bad:
        args = {"iterations": 4, "predict_step_signature": spec, **kwargs}
        with pytest.raises(error) as info:
            serving.export_pipeline([stage, stage], str(path), **args)
        assert message in str(info.value), (kwargs, str(info.value))
    with pytest.raises(TypeError, match="computational_stages must be a non-empty list"):
        serving.export_pipeline([], str(path), 4, predict_step_signature=spec)
    with pytest.raises(TypeError, match=r"computational_stages\[1\] must be a function"):
        serving.export_pipeline([stage, 3], str(path), 4, predict_step_signature=spec)
    # The suite's one IPU cannot hold a pipeline over IPUs 0 and 1: refused, nothing written.
    with pytest.raises(ValueError, match=r"1 IPU is attached.*needs 2 IPUs per replica.*"
                                         r"auto_select_ipus"):
        serving.export_pipeline([stage, stage], str(path), 4, predict_step_signature=spec)
    assert not path.exists()
    # Two stages mapped to one IPU fit: one IPU, no replication. (input_signature: the name
    # SDK 2 gave predict_step_signature; it describes the fed values, after inputs'.)
    serve = serving.export_pipeline([lambda k, x: x * k, stage], str(path), 4,
                                    inputs=[np.float32(-1.0)], device_mapping=[0, 0],
                                    input_signature=spec)
    np.testing.assert_allclose(serve(np.array([1.0, -2.0], "float32")).numpy(), [0.0, 3.0])
    assert read_requirements(path)["programs"][0]["stage_ipus"] == [0, 0]
    assert read_requirements(path)["ipus"] == 1
