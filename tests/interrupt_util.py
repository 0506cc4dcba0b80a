"""Programs that run for as long as one likes, for the Ctrl-C tests (test_interrupt_anywhere.py):
shared by the test process (which exports a SavedModel) and the child it interrupts.

    spin_model()        Dense -> Spin -> Dense; Spin's ``while`` ends after 5 trips, or
                        never while its non-trainable ``spin`` is 1 (train and inference)
    spin_onnx_model()   an ONNX Loop of 2^62 trips (never ends at the emulator's speed)
    chain_module(n)     hand-built IR: n dot+add+tanh layers, slow to plan (~14 s at 12000)
"""

from __future__ import annotations

import numpy as np

from device_server.protocol import ir_pb2


def spin_model():
    """A seeded Keras model whose Spin layer never ends while ``spin`` is 1."""
    import keras
    import tensorflow as tf

    class Spin(keras.layers.Layer):
        def build(self, shape) -> None:
            self.spin = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                        trainable=False, name="spin")

        def call(self, x):
            s = tf.identity(self.spin.value)
            j = tf.while_loop(lambda j: tf.logical_or(j < 5, s > 0), lambda j: j + 1,
                              [tf.constant(0)])[0]
            return x + tf.cast(j - 5, x.dtype)  # + 0 once the loop has ended

    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu", name="dense_in")(inp)
    h = Spin(name="spin")(h)
    return keras.Model(inp, keras.layers.Dense(1, name="dense_out")(h), name="spin_model")


def spin_onnx_model():
    """An ONNX model: ``y = x + trips`` by a Loop of 2^62 trips adding 1."""
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body)], "spin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.int64(2**62), "trips"),
         numpy_helper.from_array(np.float32(1), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def chain_module(n: int, dim: int = 64, name: str = "chain") -> ir_pb2.Module:
    """``h = tanh(h @ x + h)``, ``n`` times: 3n instructions, each planned apart (a server
    on this 2-core machine plans n = 12000 in ~14 s, 8000 in ~8.5 s; the program is too big
    for a tile's code memory, so it ends with OutOfMemoryError unless allow_out_of_memory)."""
    import server_util as su

    m = ir_pb2.Module(name=name, entry_computation_id=0, frontend="test")
    b = su.Builder(m, 0, "main")
    x = b.parameter(su.array_shape(np.float32, [dim, dim]))
    h = x
    for _ in range(n):
        h = b.op("tanh", [b.op("add", [b.dot(h, x, 1, 0, [dim, dim]), h])])
    b.root(h)
    return m
