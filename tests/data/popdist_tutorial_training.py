"""Graphcore's popdist TF2 training tutorial's calls, on generated data, under tf-ipu-run.

Makes the API calls of graphcore/tutorials, commit 7536e40,
feature_examples/tensorflow2/popdist/popdist_training.py (the same file is in
graphcore/examples, tutorials/feature_examples/tensorflow2/popdist/), in its order:

    popdist.tensorflow.set_ipu_config(config)        (no ipus_per_replica: the run's)
    config.configure_ipu_system()
    popdist_strategy.PopDistStrategy()
    Dataset.from_tensor_slices((x, y)).shard(popdist.getNumInstances(), popdist.getInstanceIndex())
        .shuffle(len(dataset)).batch(BATCH_SIZE, drop_remainder=True)
    steps_per_execution = len(dataset) // popdist.getNumLocalReplicas()
    with strategy.scope(): Sequential model without an input shape, SGD, compile with
        metrics=["accuracy"] and steps_per_execution, fit(dataset, epochs=...),
        and only instance 0 saves "saved_model.h5"

Written here, not copied: generated arrays instead of CIFAR-10's download, a smaller
model of the same kinds of layers, one epoch (TUTORIAL_SAMPLES, TUTORIAL_EPOCHS change
them). What it adds, for tests/test_distributed_tutorial.py to read: each instance writes
to OUT/instance<k>.json the sample indices of every batch it was given (a host-side map
after batching; sample i carries i in its first pixel), its model's weights and Dropout
seed states when training began (a callback), the weights it would have drawn alone,
its weights when training ended, the history, whether it saved, a sum over the instances
(host_collective_ops.all_reduce), and its own process and children (pid, command line).

Usage: tf-ipu-run --num-instances 2 --num-replicas 4 -- python popdist_tutorial_training.py OUT
(run from the folder the model is saved to).
"""

# ruff: noqa: I001  (popdist and tensorflow.python.ipu resolve once tf_ipu is imported)
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_ipu  # noqa: F401  (the one line the tutorial needs added: popdist, ipu modules)
import popdist
import popdist.tensorflow
from tensorflow.python import ipu
from tensorflow.python.ipu.distributed import popdist_strategy

from tf_ipu.distributed import host_collective_ops

OUT = sys.argv[1]
NUM_SAMPLES = int(os.environ.get("TUTORIAL_SAMPLES", "64"))
BATCH_SIZE = 4  # per replica, as the tutorial's 32
LEARNING_RATE = 0.05
NUM_EPOCHS = int(os.environ.get("TUTORIAL_EPOCHS", "1"))

k = popdist.getInstanceIndex()
SEED = 1234 + 17 * k  # each instance would draw weights of its own
keras.utils.set_random_seed(SEED)


def initialize_model() -> keras.Model:
    # The tutorial's kinds of layers, smaller; no input shape (built when fit starts).
    return keras.Sequential([
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPool2D((2, 2)),
        keras.layers.Dropout(0.25),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPool2D((2, 2)),
        keras.layers.Dropout(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10),
    ])


config = ipu.config.IPUConfig()
popdist.tensorflow.set_ipu_config(config)
config.configure_ipu_system()

strategy = popdist_strategy.PopDistStrategy()

# Generated in place of cifar10.load_data(): the same on every instance (seeded alike).
rng = np.random.RandomState(7)
train_x = rng.rand(NUM_SAMPLES, 12, 12, 3).astype(np.float32)
train_x[:, 0, 0, 0] = np.arange(NUM_SAMPLES, dtype=np.float32)  # sample i says i
train_y = rng.randint(0, 10, size=(NUM_SAMPLES, 1)).astype(np.int32)

dataset = tf.data.Dataset.from_tensor_slices((train_x, train_y))
dataset = dataset.shard(num_shards=popdist.getNumInstances(), index=popdist.getInstanceIndex())
dataset = dataset.shuffle(buffer_size=len(dataset))
dataset = dataset.batch(batch_size=BATCH_SIZE, drop_remainder=True)

seen: list[list[int]] = []  # the sample indices of each batch the pipeline handed out


def _record(x: np.ndarray) -> np.ndarray:
    seen.append([int(round(float(v))) for v in x[:, 0, 0, 0]])
    return x


def _recorded(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    x2 = tf.numpy_function(_record, [x], tf.float32, stateful=True)
    x2.set_shape(x.shape)
    return x2, y


dataset = dataset.map(_recorded)

shard_batches = len(dataset)
steps_per_execution = shard_batches // popdist.getNumLocalReplicas()
if popdist.getInstanceIndex() == 0:
    print(f"{NUM_SAMPLES} samples, {popdist.getNumInstances()} instances, {shard_batches} "
          f"batches per shard, steps per execution {steps_per_execution}")


class _Weights(keras.callbacks.Callback):
    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial = [w.numpy().tolist() for w in self.model.weights]
        self.seed_states = [layer.seed_generator.state.numpy().tolist()
                            for layer in self.model.layers
                            if isinstance(layer, keras.layers.Dropout)]


weights = _Weights()
with strategy.scope():
    model = initialize_model()
    optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    history = model.fit(dataset, epochs=NUM_EPOCHS, callbacks=[weights])

    saved = False
    if popdist.getInstanceIndex() == 0:
        model.save("saved_model.h5")
        saved = True

# Beyond the tutorial: the samples every instance drew, summed over the instances with
# host_collective_ops.all_reduce (the name Graphcore's SDK 3.x gives allreduce).
drawn = host_collective_ops.all_reduce(
    tf.constant(len({i for batch in seen for i in batch}), tf.int64), tf.distribute.ReduceOp.SUM)

# Beyond the tutorial: one SGD step of a linear model, to read the step's scale. Each of
# the instance's replicas takes one batch of 4; the loss is scaled by
# 1 / strategy.num_replicas_in_sync (the run's replicas, as Graphcore's PopDistStrategy).
step_x = np.random.RandomState(50 + k).rand(4 * popdist.getNumLocalReplicas(), 3)
step_y = np.random.RandomState(60 + k).rand(4 * popdist.getNumLocalReplicas(), 1)
with strategy.scope():
    linear = keras.Sequential([keras.Input((3,)),
                               keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    linear.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    linear.fit(step_x.astype(np.float32), step_y.astype(np.float32), batch_size=4, epochs=1,
               shuffle=False, verbose=0)
    linear_kernel = linear.weights[0].numpy()

# The weights this instance would have started from on its own: the same model built
# again, outside the strategy, after the same seeding.
keras.utils.set_random_seed(SEED)
alone = initialize_model()
alone.build((None, *train_x.shape[1:]))


def _own_processes() -> list[list]:
    """This process (first), its children (the watchdog its rank started before becoming
    this program) and its device server (a rank of the servers' job: its pid in the run
    folder), as [pid, command line]: the test checks they are gone after the run."""
    argv = open("/proc/self/cmdline", "rb").read().decode().split("\0")
    run_dir = argv[argv.index("--run-dir") + 1]
    server = int(open(os.path.join(run_dir, f"server-{k}", "pid")).read())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode("utf-8", "replace")
        except (OSError, ValueError, IndexError):
            continue
        if int(pid) in (os.getpid(), server) or parent == os.getpid():
            found.append([int(pid), cmd])
    return sorted(found, key=lambda p: p[0] != os.getpid())


with open(os.path.join(OUT, f"instance{k}.json"), "w") as f:
    json.dump({"instance": k, "instances": popdist.getNumInstances(),
               "local_replicas": popdist.getNumLocalReplicas(), "joined": strategy.joined,
               "shard_batches": shard_batches, "steps_per_execution": steps_per_execution,
               "seen": seen, "initial": weights.initial,
               "own_initial": [w.numpy().tolist() for w in alone.weights],
               "seed_states": weights.seed_states, "drawn_by_all": int(drawn.numpy()),
               "num_replicas_in_sync": strategy.num_replicas_in_sync,
               "step_x": step_x.tolist(), "step_y": step_y.tolist(),
               "linear_kernel": linear_kernel.tolist(),
               "final": [w.numpy().tolist() for w in model.weights],
               "weight_names": [w.path for w in model.weights],
               "processes": _own_processes(), "saved": saved,
               "history": {key: [float(v) for v in values]
                           for key, values in history.history.items()}}, f)
