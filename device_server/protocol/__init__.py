"""Wire types shared by the host (tf_ipu) and the device server.

The ``*_pb2`` modules are generated from ``protos/device_server/protocol/*.proto`` at build
time (``make protos``, or ``pip install .``); they are never edited by hand.
"""
