"""A serving function saved under IPUStrategy carries its lowered program and runs on the
device from a fresh process (which only imports tf_ipu): proved by the server's counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import tensorflow as tf

import tf_ipu
from tests.keras_util import classification_data, mlp, rel_l2

_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import tensorflow as tf
    import tf_ipu
    x = np.load(sys.argv[2])
    loaded = tf.saved_model.load(sys.argv[1])
    out = {"remote": loaded.serve(tf.constant(x)).numpy().tolist()}
    # Now without TF_IPU_SERVER: a local device server is started for this process.
    tf_ipu.get_runtime().shutdown()
    del os.environ["TF_IPU_SERVER"]
    out["local"] = loaded.serve(tf.constant(x)).numpy().tolist()
    out["local_address"] = tf_ipu.get_runtime().client.address
    out["local_executions"] = tf_ipu.get_runtime().client.counters()["executions"]
    print("RESULT " + json.dumps(out))
    """
)


class _Serving(tf.Module):
    def __init__(self, model: keras.Model, strategy: tf_ipu.IPUStrategy) -> None:
        super().__init__()
        self.model = model
        self._strategy = strategy

    @tf.function(input_signature=[tf.TensorSpec([8, 16], tf.float32)])
    def serve(self, x):
        return self._strategy.run(self.model, args=(x,))


def test_saved_serving_function_runs_on_device_in_fresh_process(ipu_system, tmp_path):
    strategy = tf_ipu.IPUStrategy()
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = classification_data(64, (16,))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    serving = _Serving(model, strategy)
    x8 = x[:8]
    on_device = serving.serve(tf.constant(x8)).numpy()
    keras.utils.set_random_seed(0)
    cpu = mlp()
    cpu.set_weights(model.get_weights())
    assert rel_l2(on_device, cpu.predict(x8, verbose=0)) <= 1e-5

    graph = serving.serve.get_concrete_function().graph
    assert "IpuExecute" in [op.type for op in graph.get_operations()]

    path = str(tmp_path / "saved")
    tf.saved_model.save(serving, path)
    np.save(tmp_path / "x.npy", x8)
    client = tf_ipu.get_runtime().client
    before = client.counters()["executions"]
    env = dict(os.environ, TF_IPU_SERVER=client.address, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, path, str(tmp_path / "x.npy")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert client.counters()["executions"] == before + 1  # the remote call ran here
    np.testing.assert_allclose(np.array(result["remote"]), on_device, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.array(result["local"]), on_device, rtol=1e-6, atol=1e-7)
    assert result["local_address"] != client.address
    assert result["local_executions"] == 1
