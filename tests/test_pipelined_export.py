"""``model.export_for_ipu_serving`` of pipelined and replicated models (issue 26, point 4).

A pipelined model is exported as its pipeline: its stages on the IPUs of its
``device_mapping``, one replica (Graphcore's user guide examples
exporting_pipelined_model_example.py and its pre/postprocessing variants, in graphcore/keras
keras/ipu/docs); a model on one IPU, exported with 2 IPUs attached, as 2 replicas. The export
records the IPUs its program needs (in the program's signature and in
``assets.extra/tf_ipu_serving.json``); a fresh process that only imports tf_ipu and loads the
SavedModel attaches them by itself, and one configured with too few is told how many to set.

Values are compared with the same Keras model (same weights, no stages) on the CPU within a
relative L2 distance of 1e-5 (float32 sums in another order).
"""

from __future__ import annotations

import contextlib
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

TOLERANCE = 1e-5  # relative L2 distance from Keras on the CPU
BATCH = 2


def _stage(staged: bool, stage: int):
    return keras.ipu.PipelineStage(stage) if staged else contextlib.nullcontext()


def _two_stage(staged: bool = True, name: str = "two_stage") -> keras.Model:
    """The user guide's exported pipeline (Multiply in stage 0, Add in stage 1, on IPUs 0
    and 1), with Dense layers so that weights travel with the SavedModel."""
    a = keras.Input((4,), batch_size=BATCH, name="input_1")
    b = keras.Input((4,), batch_size=BATCH, name="input_2")
    with _stage(staged, 0):
        x = keras.layers.Multiply()([a, b])
        x = keras.layers.Dense(6, activation="tanh", name="d0")(x)
    with _stage(staged, 1):
        x = keras.layers.Dense(4, name="d1")(x)
        x = keras.layers.Add()([x, b])
    model = keras.Model([a, b], x, name=name)
    if staged:
        model.set_pipelining_options(device_mapping=[0, 1])
    return model


def _four_stage(staged: bool = True) -> keras.Model:
    """The user guide's pipeline with pre- and postprocessing on the IPU: abs in stage 0,
    the model in stages 1 and 2, a reduction in stage 3; four IPUs."""
    a = keras.Input((4,), batch_size=BATCH, name="input_1")
    b = keras.Input((4,), batch_size=BATCH, name="input_2")
    with _stage(staged, 0):
        absolute = keras.layers.Lambda(tf.abs, name="abs")
        x, y = absolute(a), absolute(b)
    with _stage(staged, 1):
        x = keras.layers.Multiply()([x, y])
        x = keras.layers.Dense(4, name="d0")(x)
    with _stage(staged, 2):
        x = keras.layers.Add()([x, y])
    with _stage(staged, 3):
        x = keras.layers.Lambda(lambda t: tf.reduce_sum(t, axis=-1), name="total")(x)
    model = keras.Model([a, b], x, name="four_stage")
    if staged:
        model.set_pipelining_options(device_mapping=[0, 1, 2, 3])
    return model


def _single_ipu(staged: bool = False, name: str = "single_ipu") -> keras.Model:
    del staged  # a model on one IPU
    return keras.Sequential([keras.Input((5,), batch_size=BATCH, name="input_1"),
                             keras.layers.Dense(6, "relu"), keras.layers.Dense(3)], name=name)


def _cpu_predict(model: keras.Model, build, inputs) -> np.ndarray:
    cpu = build(staged=False)
    cpu.set_weights(model.get_weights())
    return np.asarray(cpu.predict(inputs, verbose=0))


@tf.function(input_signature=[tf.TensorSpec([BATCH, 4], tf.string)] * 2)
def _parse(lhs, rhs):
    """Host preprocessing (string ops: no XLA kernel)."""
    return tf.strings.to_number(lhs), tf.strings.to_number(rhs)


@tf.function(input_signature=[tf.TensorSpec([BATCH, 4], tf.float32)])
def _absolute(y):
    """Host postprocessing."""
    return tf.abs(y)


def _text(x: np.ndarray) -> np.ndarray:
    return np.array([[repr(float(v)) for v in row] for row in x])


def _report(name: str):
    """The runtime's compile report of model ``name``'s exported program."""
    found = [r for r in tf_ipu.get_runtime().reports
             if r.name.startswith(f"{name}/export_for_ipu_serving")]
    assert found, [r.name for r in tf_ipu.get_runtime().reports]
    return found[-1]


def _ipu_execute_ops(fn) -> int:
    graph = fn.get_concrete_function().graph
    return sum(op.type == "IpuExecute" for op in graph.get_operations())


@pytest.fixture(scope="module")
def exports(ipu_system, tmp_path_factory):
    """Exports each case with the IPUs its program needs attached; records what the export
    reported, what its function returns here and what Keras computes on the CPU."""
    root = tmp_path_factory.mktemp("pipelined_export")
    rng = np.random.default_rng(7)
    x1 = rng.standard_normal((BATCH, 4)).astype("float32")
    x2 = rng.standard_normal((BATCH, 4)).astype("float32")
    x5 = rng.standard_normal((BATCH, 5)).astype("float32")
    strategy = tf_ipu.IPUStrategy()
    cases: dict[str, dict] = {}

    def export(key, model, build, cpu_inputs, feed, call_args, want_fn=None, **kwargs):
        path = str(root / key)
        serve = model.export_for_ipu_serving(path, **kwargs)
        assert _ipu_execute_ops(serve) == 1
        here = serve(*call_args)
        want = _cpu_predict(model, build, cpu_inputs)
        if want_fn is not None:
            want = want_fn(want)
        cases[key] = {"model": model, "path": path, "serve": serve, "report": _report(model.name),
                      "here": np.asarray(tf.nest.flatten(here)[0]), "want": want,
                      "feed": {k: (v.tolist(), "str" if v.dtype.kind == "U" else str(v.dtype))
                               for k, v in feed.items()}}

    with attached_ipus(ipu_system, 2):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            two = _two_stage()
            two.compile(steps_per_execution=16)  # as in the guide: no effect on the export
            two_cpu_steps = _two_stage(name="two_stage_host_steps")
            single = _single_ipu()
            single_steps = _single_ipu(name="single_ipu_host_steps")
        export("pipeline", two, _two_stage, [x1, x2], {"input_1": x1, "input_2": x2},
               (x1, x2))
        export("pipeline_host_steps", two_cpu_steps, _two_stage, [x1, x2],
               {"lhs": _text(x1), "rhs": _text(x2)}, (tf.constant(_text(x1)),
                                                      tf.constant(_text(x2))),
               want_fn=np.abs, preprocessing_step=_parse, postprocessing_step=_absolute)
        export("replicas", single, _single_ipu, x5, {"input_1": x5}, (x5,))

        @tf.function(input_signature=[tf.TensorSpec([BATCH, 5], tf.float32)])
        def halve(x):
            return x * 0.5

        export("replicas_host_steps", single_steps, _single_ipu, x5 * 0.5, {"x": x5}, (x5,),
               want_fn=lambda y: np.argmax(y, axis=1), preprocessing_step=halve,
               postprocessing_step=lambda y: tf.argmax(y, axis=1))
    with attached_ipus(ipu_system, 4):
        keras.utils.set_random_seed(2)
        with strategy.scope():
            four = _four_stage()
        export("pipeline_ipu_steps", four, _four_stage, [x1, x2],
               {"input_1": x1, "input_2": x2}, (x1, x2))
    return cases


# (stages, stage IPUs, replicas, IPUs) each export must report and record
EXPECTED = {
    "pipeline": (2, [0, 1], 1, 2),
    "pipeline_host_steps": (2, [0, 1], 1, 2),
    "pipeline_ipu_steps": (4, [0, 1, 2, 3], 1, 4),
    "replicas": (1, [0], 2, 2),
    "replicas_host_steps": (1, [0], 2, 2),
}


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_export_reports_its_stages_replicas_and_ipus(exports, key):
    stages, stage_ipus, replicas, ipus = EXPECTED[key]
    case = exports[key]
    report = case["report"]
    assert (report.stages, report.replicas, report.ipus) == (stages, replicas, ipus), \
        report.summary()
    if stages > 1:
        assert report.details["stage_ipus"] == stage_ipus
        assert f"pipeline of {stages} stages on IPUs {stage_ipus} ({ipus} IPUs)" \
            in report.summary()
    recorded = read_requirements(case["path"])
    assert recorded["ipus"] == ipus
    (program,) = recorded["programs"]
    assert (program["stages"], program["stage_ipus"], program["replicas"], program["ipus"]) \
        == (stages, stage_ipus, replicas, ipus)
    # The function the export returned runs the program here, as Keras on the CPU.
    if case["want"].dtype.kind == "i":
        np.testing.assert_array_equal(case["here"], case["want"])
    else:
        assert rel_l2(case["here"], case["want"]) <= TOLERANCE


_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tf_ipu
    jobs = json.loads(sys.argv[1])
    runtime = tf_ipu.get_runtime()
    out = {}
    for job in jobs:  # nothing configured: each program attaches the IPUs it needs
        loaded = tf.saved_model.load(job["path"])
        feed = {k: tf.constant(np.asarray(v, dtype=d)) for k, (v, d) in job["feed"].items()}
        result = loaded.signatures["serving_default"](**feed)
        report = [r for r in runtime.reports if r.name == job["program"]][-1]
        out[job["key"]] = {"output": result["output_0"].numpy().tolist(),
                           "attached": len(runtime.client.attachment.ipu_ids),
                           "report": [report.stages, report.replicas, report.ipus]}
    # Those IPUs are the loaded programs': a Keras model made here would run on one.
    out["replication_factor"] = runtime.replication_factor()
    # Configured with one IPU: the 2-IPU pipeline says how many to configure.
    cfg = tf_ipu.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.configure_ipu_system()
    job = jobs[0]
    loaded = tf.saved_model.load(job["path"])
    feed = {k: tf.constant(np.asarray(v, dtype=d)) for k, (v, d) in job["feed"].items()}
    try:
        loaded.signatures["serving_default"](**feed)
        out["error"] = None
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def served(exports, device_server):
    """One fresh process (only ``import tf_ipu``, pointed at the suite's device server by
    $TF_IPU_SERVER, nothing configured) loading and calling every export."""
    order = ["pipeline", "pipeline_ipu_steps", "replicas", "pipeline_host_steps",
             "replicas_host_steps"]
    jobs = [{"key": k, "path": exports[k]["path"], "feed": exports[k]["feed"],
             "program": read_requirements(exports[k]["path"])["programs"][0]["program"]}
            for k in order]
    client = tf_ipu.get_runtime().client
    before = client.counters()["executions"]
    env = dict(os.environ, TF_IPU_SERVER=device_server, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(jobs)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    result["executions"] = client.counters()["executions"] - before
    return result


def test_fresh_process_attaches_the_ipus_and_serves_as_keras_on_cpu(exports, served):
    assert served["executions"] == len(EXPECTED)  # every call ran on the device server
    for key, (stages, _, replicas, ipus) in EXPECTED.items():
        got = served[key]
        assert got["report"] == [stages, replicas, ipus], key
        assert got["attached"] >= ipus, key
        want = exports[key]["want"]
        if want.dtype.kind == "i":
            np.testing.assert_array_equal(got["output"], want)
        else:
            assert rel_l2(np.array(got["output"]), want) <= TOLERANCE, key
    # The first call attached exactly its pipeline's 2 IPUs, the 4-stage one then 4.
    assert served["pipeline"]["attached"] == 2
    assert served["pipeline_ipu_steps"]["attached"] == 4
    assert served["replication_factor"] == 1


def test_too_few_ipus_is_an_error_naming_the_count(exports, served, ipu_system, tmp_path):
    # The loading process, configured with 1 IPU, is told to configure 2.
    error = served["error"]
    assert error is not None
    assert "runs on 2 IPUs (a pipeline of 2 stages on IPUs [0, 1]" in error
    assert "IPUConfig.auto_select_ipus = 2" in error
    # Here, with the suite's 1 IPU: the returned function says the same ...
    pipeline = exports["pipeline"]
    x = [np.asarray(v, dtype="float32") for v, _ in pipeline["feed"].values()]
    with pytest.raises(Exception, match=r"IPUConfig\.auto_select_ipus = 2"):
        pipeline["serve"](*x)
    # ... and exporting the pipeline again is refused before anything is written.
    path = tmp_path / "refused"
    with pytest.raises(ValueError, match=r"export_for_ipu_serving: .*1 IPU is attached.*"
                                         r"needs 2 IPUs per replica"):
        pipeline["model"].export_for_ipu_serving(str(path))
    assert not path.exists()
