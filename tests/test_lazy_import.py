"""``import tf_ipu`` starts lazily (no TensorFlow) and still does its TensorFlow set-up — the
IpuExecute handler, Graphcore's import paths — as soon as TensorFlow is imported, in either
order (tf_ipu/_lazy_start.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = textwrap.dedent("""
    import sys
    import tf_ipu
    assert "tensorflow" not in sys.modules, "import tf_ipu imported TensorFlow"
    import tensorflow as tf
    import tf_ipu_ops
    from tf_ipu.runtime import _Handler
    assert isinstance(tf_ipu_ops.get_device_handler(), _Handler), "no IpuExecute handler"
    from tensorflow.python import ipu
    assert ipu.config.IPUConfig is tf_ipu.IPUConfig
    import keras
    assert keras.ipu is ipu.keras
    assert callable(tf_ipu.estimate)
    print("OK")
""")


def test_import_tf_ipu_then_tensorflow_sets_up_tensorflow():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout
