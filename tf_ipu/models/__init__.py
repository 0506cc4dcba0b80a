"""Reference models built with Keras layers (architectures that keras.applications lacks).

    from tf_ipu.models import bert_classifier, bert_encoder, resnext
"""

from tf_ipu.models.bert import PositionEmbedding, bert_classifier, bert_encoder
from tf_ipu.models.resnext import resnext

__all__ = ["PositionEmbedding", "bert_classifier", "bert_encoder", "resnext"]
