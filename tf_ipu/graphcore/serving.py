"""``ipu.serving``: Graphcore's export functions for TensorFlow Serving (``tf_ipu.serving``).

    from tensorflow.python.ipu import serving
    serving.export_keras(model, export_dir, batch_size, ...)   == model.export_for_ipu_serving(...)
    serving.export_single_step(predict_step, export_dir, iterations, ...)

A pipelined Keras model (``keras.ipu.PipelineStage``, ``set_pipelining_options``) is exported
by ``export_keras`` as its pipeline, its IPU count recorded for the process that loads it.
``export_pipeline`` (stages given as a list of functions) is absent: an ``AttributeError``.
"""

from __future__ import annotations

from tf_ipu.serving import export_keras, export_single_step

__all__ = ["export_keras", "export_single_step"]
