"""Reference models built with Keras layers (architectures that keras.applications lacks).

    from tf_ipu.models import bert_classifier, bert_encoder, half_batch_norm, resnext
"""

from tf_ipu.models.bert import FP16Attention, PositionEmbedding, bert_classifier, bert_encoder
from tf_ipu.models.normalization import HalfBatchNormalization, half_batch_norm
from tf_ipu.models.recompute_lstm import recompute_lstm
from tf_ipu.models.resnext import resnext

__all__ = ["FP16Attention", "HalfBatchNormalization", "PositionEmbedding", "bert_classifier", "bert_encoder",
           "half_batch_norm", "recompute_lstm", "resnext"]
