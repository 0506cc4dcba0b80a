"""Wire types shared by the host (tf_ipu) and the device server.

The ``*_pb2`` modules are generated from ``protos/device_server/protocol/*.proto`` at build
time (``make protos``, or ``pip install .``); they are never edited by hand.
"""

#: The TF op name of the loop a host wrote to run N steps in one device call (the while's
#: ``source_op`` in the IR): a stopped run ends it at a step boundary (emulator/cancel.py).
DEVICE_LOOP_NAME = "tf_ipu_device_loop"
#: The custom-call target by which a running program pulls the next batch of an infeed
#: (emulator/kernels/infeed.py, docs/ir.md).
INFEED_TARGET = "tf_ipu_infeed"
#: The custom-call target by which a running program hands values to an outfeed of the
#: session, which the host dequeues (emulator/kernels/infeed.py, docs/ir.md).
OUTFEED_TARGET = "tf_ipu_outfeed"
#: The custom-call target of an all-reduce across the replicas of a replicated program
#: (emulator/kernels/collectives.py, docs/ir.md): operands in, their reduction over replicas
#: out (a tuple for several operands); ``backend_config`` names the reduction.
ALL_REDUCE_TARGET = "tf_ipu_all_reduce"
#: The custom-call target that gives a replica its index (s32[], 0 .. replicas-1).
REPLICA_ID_TARGET = "tf_ipu_replica_id"
#: Custom-call targets that talk to the host while the program runs: never folded at compile
#: time, never removed as dead code, run in program order.
HOST_TARGETS = frozenset({INFEED_TARGET, OUTFEED_TARGET})
#: Custom-call targets whose value depends on the replica, or that meet the other replicas:
#: never folded at compile time, never removed as dead code, run in program order.
REPLICA_TARGETS = frozenset({ALL_REDUCE_TARGET, REPLICA_ID_TARGET})
