"""``tensorflow.python.ipu.distributed.host_collective_ops``: collectives of tensors between
the instances of a run, on the host, over MPI (``tf_ipu.distributed.host_collective_ops``).

    allreduce(value, reduce_op) (SDK 3's all_reduce too)  broadcast(value, root_rank=0)
    allgather(value)
"""

from __future__ import annotations

from tf_ipu.distributed.host_collective_ops import all_reduce, allgather, allreduce, broadcast

__all__ = ["all_reduce", "allgather", "allreduce", "broadcast"]
