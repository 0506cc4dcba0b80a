"""``ipu.serving``: Graphcore's export functions for TensorFlow Serving (``tf_ipu.serving``).

    from tensorflow.python.ipu import serving
    serving.export_keras(model, export_dir, batch_size, ...)   == model.export_for_ipu_serving(...)
    serving.export_single_step(predict_step, export_dir, iterations, ...)
    serving.export_pipeline([stage1, stage2], export_dir, iterations, device_mapping=[0, 1], ...)

A pipelined Keras model (``keras.ipu.PipelineStage``, ``set_pipelining_options``) is exported
by ``export_keras`` as its pipeline, and ``export_pipeline``'s stage functions as theirs (stage
i on IPU ``device_mapping[i]``), each export's IPU count recorded for the process that loads it.
"""

from __future__ import annotations

from tf_ipu.serving import export_keras, export_pipeline, export_single_step

__all__ = ["export_keras", "export_pipeline", "export_single_step"]
