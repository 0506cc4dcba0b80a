"""``ipu_tensorflow_addons.keras.layers``: Graphcore's IPU Keras layers, as Keras 3 layers.

    Embedding                     keras.layers.Embedding (+ serialization_factor, checked)
    PopnnLSTM = LSTM              keras.layers.LSTM (+ time_major, PopLibs options accepted)
    PopnnGRU = GRU                keras.layers.GRU (+ time_major, PopLibs options accepted)
    Dropout                       keras.layers.Dropout (+ Graphcore's seed pair, ``ref``)
    LayerNorm(alization)          keras.layers.LayerNormalization
    GroupNorm(alization)          group norm, PopLibs' strided grouping or Keras's contiguous
    InstanceNorm(alization)       group norm with one group per channel
    SerialDense                   keras.layers.Dense, its matmul split into pieces
    Dense                         keras.layers.Dense (Graphcore's FP8 arguments accepted)
    RecomputationCheckpoint       identity (no recomputation here)
    AssumeEqualAcrossReplicas     identity (the emulator needs no mark)

Not here (an ``ImportError``/``AttributeError``, never a placeholder): ``CTCLoss``,
``CTCInferenceLayer``, ``CTCPredictionsLayer``, ``EffectiveTransformer``, ``ConvertToF8`` and
``ConvertFromF8`` (docs/porting.md says why). Every layer lowers to XLA, so it runs under ``IPUStrategy``, and is registered
for Keras serialization under the package name ``ipu_tensorflow_addons``.
"""

from tf_ipu.graphcore.addons.keras.layers import (
    assume_equal_across_replicas,
    dense,
    dropout,
    embedding_lookup,
    normalization,
    recomputation,
    rnn,
)
from tf_ipu.graphcore.addons.keras.layers.assume_equal_across_replicas import (
    AssumeEqualAcrossReplicas,
)
from tf_ipu.graphcore.addons.keras.layers.dense import Dense, SerialDense
from tf_ipu.graphcore.addons.keras.layers.dropout import Dropout
from tf_ipu.graphcore.addons.keras.layers.embedding_lookup import Embedding
from tf_ipu.graphcore.addons.keras.layers.normalization import (
    GroupNorm,
    GroupNormalization,
    InstanceNorm,
    InstanceNormalization,
    LayerNorm,
    LayerNormalization,
)
from tf_ipu.graphcore.addons.keras.layers.recomputation import RecomputationCheckpoint
from tf_ipu.graphcore.addons.keras.layers.rnn import GRU, LSTM, PopnnGRU, PopnnLSTM

#: Graphcore's module names under ``ipu_tensorflow_addons.keras.layers``, and ours.
MODULES = {"assume_equal_across_replicas": assume_equal_across_replicas, "dense": dense,
           "dropout": dropout, "embedding_lookup": embedding_lookup,
           "normalization": normalization, "recomputation": recomputation, "rnn": rnn}

__all__ = ["GRU", "LSTM", "MODULES", "AssumeEqualAcrossReplicas", "Dense", "Dropout", "Embedding",
           "GroupNorm", "GroupNormalization", "InstanceNorm", "InstanceNormalization",
           "LayerNorm", "LayerNormalization", "PopnnGRU", "PopnnLSTM",
           "RecomputationCheckpoint", "SerialDense"]
