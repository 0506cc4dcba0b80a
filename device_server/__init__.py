"""The tf_ipu device server: emulated IPUs behind a gRPC service.

    host process (tf_ipu client)  ==gRPC==>  device_server.service  ->  device_server.emulator

Run it with ``python -m device_server --port P --ipus N --ipu-version ipu1|ipu2|bow``.
"""

__version__ = "0.1.0"
