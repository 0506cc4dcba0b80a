"""Lowering from TensorFlow/XLA to the device IR (``device_server/protocol/ir.proto``).

``hlo_to_ir.hlo_module_to_ir`` converts an unoptimized XLA ``HloModuleProto`` (as given by
``tf.function(...).experimental_get_compiler_ir(*args)(stage="hlo_serialized")``) into the
IR the emulator compiles. The attributes of each opcode are listed in ``docs/ir.md``.
"""
