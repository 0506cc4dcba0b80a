"""Graphcore's recomputation-checkpoint tutorial model (graphcore/examples
tutorials/feature_examples/tensorflow2/recomputation_checkpoints/recompute_lstm.py, at
3cc8f81f): one ``PopnnLSTM`` run over ``checkpoints + 1`` equal slices of the sequence, each
slice starting from the previous one's ``(h, c)`` state, checkpointed between slices.

    stage 0 (IPU 0): Lambda x[:, b:e, :] per slice -> PopnnLSTM(units, return_state=True)
                     -> RecomputationCheckpoint([h, c]) (not after the last slice)
                     -> Concatenate(axis=1) of the slices' last outputs
    stage 1 (IPU 0): Dense(1)
    SGD(0.001), mse, steps_per_execution=4; PipelineSchedule.Sequential,
    RecomputationMode.RecomputeAndBackpropagateInterleaved, device_mapping=[0, 0]

The tutorial's sizes are the defaults (2,048 steps of 512 features, 256 units); the verdict
table (``bench/bench_fit_cases.py``) builds it at full size, ``tests/test_recomputation.py``
smaller. ``tests/test_graphcore_pipelined_examples.py`` keeps its own copy written as the
script is (Graphcore's API calls), on purpose.

    from tf_ipu.models.recompute_lstm import recompute_lstm
    model = recompute_lstm(2048, checkpoints=7)
    tf_ipu.estimate(model, 16, training=True, ipu_version="ipu2", recomputation=True)
"""

from __future__ import annotations

from typing import Any

__all__ = ["recompute_lstm"]


def recompute_lstm(sequence_length: int = 2048, checkpoints: int = 7, units: int = 256,
                   features: int = 512, gradient_accumulation: int = 4,
                   name: str | None = None) -> Any:
    """The tutorial's model (see the module docstring), built and compiled in an
    ``IPUStrategy`` scope with its pipelining options set.

    Args:
        sequence_length: Time steps of the input (the tutorial's ``--seq-len``).
        checkpoints: ``RecomputationCheckpoint`` layers (``--checkpoints``): the sequence is cut
            into ``checkpoints + 1`` slices at ``i * sequence_length // (checkpoints + 1)``.
        units: The LSTM's units.
        features: Features per time step.
        gradient_accumulation: ``gradient_accumulation_steps_per_replica`` (micro-batches per
            weight update).
        name: The model's name (default ``recompute_lstm_<steps>_<checkpoints>ckpt``).

    Returns:
        The compiled pipelined ``keras.Model``: input ``[batch, sequence_length, features]``,
        output ``[batch, 1]``.
    """
    # (Importing this module imported tf_ipu, which installs Graphcore's module paths.)
    import ipu_tensorflow_addons.keras.layers as ipu_layers
    import keras

    import tf_ipu
    from tf_ipu.pipelining import PipelineSchedule, RecomputationMode

    if checkpoints < 0 or sequence_length < checkpoints + 1:
        raise ValueError(f"cannot cut {sequence_length} steps into {checkpoints + 1} slices "
                         f"(checkpoints={checkpoints}).")
    slices = checkpoints + 1
    with tf_ipu.IPUStrategy().scope():
        inputs = keras.Input((sequence_length, features), name="sequence")
        with keras.ipu.PipelineStage(0):
            lstm = ipu_layers.PopnnLSTM(units, return_state=True)
            outs, state = [], None
            for i in range(slices):
                begin, end = i * sequence_length // slices, (i + 1) * sequence_length // slices
                part = keras.layers.Lambda(lambda x, b=0, e=0: x[:, b:e, :],
                                           arguments={"b": begin, "e": end})(inputs)
                out, h, c = lstm(part, initial_state=state)
                if i != slices - 1:
                    h, c = ipu_layers.RecomputationCheckpoint()([h, c])
                state = (h, c)
                outs.append(out)
            x = keras.layers.Concatenate(axis=1)(outs) if len(outs) > 1 else outs[0]
        with keras.ipu.PipelineStage(1):
            x = keras.layers.Dense(1)(x)
        model = keras.Model(inputs, x,
                            name=name or f"recompute_lstm_{sequence_length}_{checkpoints}ckpt")
        model.compile(keras.optimizers.SGD(0.001), loss="mse", steps_per_execution=4)
        model.set_pipelining_options(
            gradient_accumulation_steps_per_replica=int(gradient_accumulation),
            pipeline_schedule=PipelineSchedule.Sequential, device_mapping=[0, 0],
            recomputation_mode=RecomputationMode.RecomputeAndBackpropagateInterleaved)
    return model
