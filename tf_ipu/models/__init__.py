"""Reference models built with Keras layers (architectures that keras.applications lacks).

    from tf_ipu.models import bert_classifier, bert_encoder, half_batch_norm, resnext
    from tf_ipu.models import efficientnet_gn, gpt2, unet, vit   # published models (issue 24)
"""

from tf_ipu.models.bert import FP16Attention, PositionEmbedding, bert_classifier, bert_encoder
from tf_ipu.models.efficientnet_gn import efficientnet_gn
from tf_ipu.models.gpt2 import gpt2
from tf_ipu.models.normalization import (
           HalfBatchNormalization,
           HalfGroupNormalization,
           half_batch_norm,
)
from tf_ipu.models.recompute_lstm import recompute_lstm
from tf_ipu.models.resnext import resnext
from tf_ipu.models.unet import unet
from tf_ipu.models.vit import vit

__all__ = ["FP16Attention", "HalfBatchNormalization", "HalfGroupNormalization", "PositionEmbedding",
           "bert_classifier", "bert_encoder",
           "efficientnet_gn", "gpt2", "half_batch_norm", "recompute_lstm", "resnext", "unet", "vit"]
