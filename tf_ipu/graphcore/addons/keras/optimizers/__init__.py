"""``ipu_tensorflow_addons.keras.optimizers``: Graphcore's IPU optimizers, as Keras 3 optimizers.

    IpuOptimizerBase   ipu_optimizer_base.py  compute precisions, slots of their own dtypes
    AdamIpuOptimizer   adam_optimizer.py      a keras.optimizers.Adam (m_dtype, v_dtype,
                                              vhat_dtype, debiasing)
    LAMBIpuOptimizer   lamb_optimizer.py      a keras.optimizers.Lamb with Graphcore's weight
                                              decay, exclusions, trust ratio and norm clip
    SGDIpuOptimizer    sgd_optimizer.py       a keras.optimizers.SGD (momentum_accum_dtype)

Each computes its update in ``optimizer_compute_precisions`` and keeps its state in the dtypes
asked for; the updates are TensorFlow ops, so they run on the CPU as Keras and lower to the
device program under ``IPUStrategy``. Sparse gradients are densified, as Keras 3 does.
"""

from tf_ipu.graphcore.addons.keras.optimizers import (
    adam_optimizer,
    ipu_optimizer_base,
    lamb_optimizer,
    sgd_optimizer,
)
from tf_ipu.graphcore.addons.keras.optimizers.adam_optimizer import AdamIpuOptimizer
from tf_ipu.graphcore.addons.keras.optimizers.ipu_optimizer_base import IpuOptimizerBase
from tf_ipu.graphcore.addons.keras.optimizers.lamb_optimizer import LAMBIpuOptimizer
from tf_ipu.graphcore.addons.keras.optimizers.sgd_optimizer import SGDIpuOptimizer

#: Graphcore's module names under ``ipu_tensorflow_addons.keras.optimizers``, and ours.
MODULES = {"adam_optimizer": adam_optimizer, "ipu_optimizer_base": ipu_optimizer_base,
           "lamb_optimizer": lamb_optimizer, "sgd_optimizer": sgd_optimizer}

__all__ = ["MODULES", "AdamIpuOptimizer", "IpuOptimizerBase", "LAMBIpuOptimizer",
           "SGDIpuOptimizer"]
