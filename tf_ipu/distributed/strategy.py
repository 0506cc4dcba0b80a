"""PopDistStrategy: IPUStrategy for one instance of a ``tf-ipu-run`` (Graphcore's name).

    instance 0                                   instance k
    with strategy.scope(): model = ...           with strategy.scope(): model = ...
      each new variable's initial value ──Bcast(root 0)──> replaces k's own
    model.fit(shard 0)                           model.fit(shard k)
      device: its replicas on server 0 ══ one replicated program ══ its replicas on server k
              (all-reduce over every replica of the run: the servers' MPI world)
      host: each call's logs ─────────Allreduce (mean)──────── each call's logs
      epoch-end metrics    ─────────Allreduce (mean)──────── epoch-end metrics
    strategy.reduce(SUM/MEAN, v) ─────Allreduce──────────── strategy.reduce(...)

Only when the program was configured for the run (``popdist.tensorflow.set_ipu_config`` or
``update_ipu_config``); otherwise the instances run independently and a warning says so.
Keras's random seed states (``SeedGenerator``: Dropout's, the global one) are broadcast
too, unchanged: the device programs of a joined run are one replicated program over every
instance's replicas (``CompileOptions.instances``, device_server/emulator/world.py), whose
``tf_ipu_replica_id`` is the global replica index, so ``replication.install_replica_seeds``
moves replica j of instance k's seeds as replica k x local replicas + j of one program:
every replica of the run draws its own Dropout masks, as Graphcore's do. The gradient
all-reduce spans every replica of the run, in global replica order, so the instances'
weights stay identical, bit for bit those of one instance running all the replicas.
``num_replicas_in_sync`` is the run's replicas, as Graphcore's reports: Keras scales each
replica's loss by its inverse, and the all-reduced sum is the run's mean gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tf_ipu import notices
from tf_ipu.distributed import identity, mpi, popdist_api
from tf_ipu.strategy import IPUStrategy, _IPUExtended, _lowering_depth

_NOT_JOINED = "PopDistStrategy"


def _strategy_joined(strategy: Any) -> bool:
    return isinstance(strategy, PopDistStrategy) and strategy.joined


def _broadcast_tensor(t: Any, dtype: Any = None,
                      purpose: str = "a variable's initial value") -> tf.Tensor:
    """Instance 0's value of ``t`` (each instance passes its own of the same shape)."""
    t = tf.convert_to_tensor(t, dtype=dtype)
    if tf.executing_eagerly():
        return tf.constant(mpi.broadcast(t.numpy(), 0, purpose), dtype=t.dtype)
    if _lowering_depth() > 0:  # made while a device program is traced: no host call there
        notices.once("PopDistStrategy: a variable created inside a device program",
                     "keeps each instance's own initial value (create variables before the "
                     "first step, e.g. model.build, to have instance 0's everywhere).")
        return t
    out = tf.numpy_function(lambda a: mpi.broadcast(a, 0, purpose), [t], t.dtype, stateful=True,
                            name="broadcast_initial_value")
    out.set_shape(t.shape)
    return out


#: The name Keras gives a ``SeedGenerator``'s state variable ([seed, counter]).
_SEED_STATE_NAME = "seed_generator_state"


def _is_seed_state(kwargs: dict[str, Any]) -> bool:
    name = str(kwargs.get("name") or "")
    return name.rsplit("/", 1)[-1].split(":")[0] == _SEED_STATE_NAME


class _PopDistExtended(_IPUExtended):
    """IPUStrategy's extended, whose new variables start from instance 0's values (Keras's
    random seed states included: the device program moves them apart per global replica)
    and whose host-side reductions span the instances."""

    def _create_variable(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        strategy = self._container_strategy()
        if _strategy_joined(strategy) and "initial_value" in kwargs:
            initial, dtype = kwargs["initial_value"], kwargs.get("dtype")
            if callable(initial):
                kwargs["initial_value"] = lambda: _broadcast_tensor(initial(), dtype)
            else:
                kwargs["initial_value"] = _broadcast_tensor(initial, dtype)
        return super()._create_variable(next_creator, **kwargs)

    def _batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any,
                         options: Any) -> list[Any]:
        values = super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        if _lowering_depth() > 0 or not _strategy_joined(self._container_strategy()):
            return values
        from tf_ipu.distributed import host_collective_ops

        return [host_collective_ops.allreduce(v, reduce_op) for v in values]


class PopDistStrategy(IPUStrategy):
    """IPUStrategy for one instance of a multi-instance run (``tf-ipu-run``/poprun).

    Under a run whose program was configured with ``popdist.tensorflow.set_ipu_config``
    (or ``update_ipu_config``): variables created in its scope start from instance 0's
    values (an MPI broadcast; Keras's seed states then moved apart per instance, so each
    replica of the run draws its own random numbers), ``reduce`` and Keras's per-call and
    epoch-end logs are reduced over the instances; ``num_replicas_in_sync`` is the run's
    replicas. Outside a run it is IPUStrategy.

    Args:
        config: as IPUStrategy's.
        ipu_device: Graphcore's argument, accepted (one IPU device here).
        add_ipu_cross_replica_reductions: Graphcore's; reductions in a device program span
            every replica of the run; False is named in a warning.
        enable_dataset_iterators, enable_keras_extensions: as IPUStrategy's.

    Example:
        >>> cfg = ipu.config.IPUConfig()
        >>> popdist.tensorflow.set_ipu_config(cfg, ipus_per_replica=1)
        >>> cfg.configure_ipu_system()
        >>> strategy = PopDistStrategy()
        >>> with strategy.scope():
        ...     model = make_model(); model.compile(...); model.fit(shard)
    """

    def __init__(self, config: Any = None, ipu_device: str = "/device:IPU:0",
                 add_ipu_cross_replica_reductions: bool = True,
                 enable_dataset_iterators: bool = True,
                 enable_keras_extensions: bool = True) -> None:
        if isinstance(config, str):  # Graphcore's first positional argument: ipu_device
            config, ipu_device = None, config
        super().__init__(config, ipu_device=ipu_device,
                         enable_dataset_iterators=enable_dataset_iterators,
                         enable_keras_extensions=enable_keras_extensions)
        if not add_ipu_cross_replica_reductions:
            notices.once("PopDistStrategy(add_ipu_cross_replica_reductions=False)",
                         "has no effect here: a device program's reductions span every "
                         "replica of the run.")
        self.extended.__class__ = _PopDistExtended
        _install_keras_reduction()
        if identity.is_multi_instance():
            mpi.comm()  # join the run's MPI world now (and check it matches the run)

    def __repr__(self) -> str:
        return (f"PopDistStrategy(instance={identity.getInstanceIndex()}, "
                f"instances={identity.getNumInstances()})")

    def update_ipu_config(self, config: Any) -> Any:
        """Sets ``config``'s multi-replica distribution (process count and index) for this
        run, as Graphcore's does; returns ``config``."""
        popdist_api.set_ipu_config(config, configure_device=False)
        return config

    @property
    def num_replicas_in_sync(self) -> int:
        """The run's replicas (``popdist.getNumTotalReplicas()``), as Graphcore's
        PopDistStrategy reports them, when this instance is part of the run (joined, or the
        run's only instance); otherwise IPUStrategy's 1.

        Keras scales each replica's loss by ``1 / num_replicas_in_sync``, so the replicas'
        summed gradients are the run's mean gradient, as on Graphcore's (its tutorial's
        learning rate assumes so): the device program's all-reduce spans every replica of
        the run (device_server/emulator/world.py), so no correction by local / total
        replicas is needed."""
        if not identity.isPopdistEnvSet():
            return 1
        if identity.getNumInstances() == 1 or self.joined:
            return identity.getNumTotalReplicas()
        return 1

    @property
    def joined(self) -> bool:
        """Whether this instance broadcasts and reduces with the others: a run of several
        instances whose program's IPU configuration was made for it. Otherwise (with
        several instances) warns once that they run independently."""
        if not identity.is_multi_instance():
            return False
        from tf_ipu import runtime

        rt = runtime.get_runtime()
        # The configuration in force; before one is, the strategy's, else set_ipu_config's.
        config = rt.config if rt.configured else (
            self._ipu_config if self._ipu_config is not None else popdist_api.last_configured())
        if popdist_api.is_distributed(config):
            return True
        warn_independent("PopDistStrategy")
        return False

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """``value`` reduced over the instances (SUM or MEAN; with ``axis``, also along that
        dimension first: a MEAN then weighs every element of every instance alike)."""
        if _lowering_depth() > 0 or not self.joined:
            return super().reduce(reduce_op, value, axis)
        from tf_ipu.distributed import host_collective_ops

        op = host_collective_ops._op_name(reduce_op)  # noqa: SLF001
        if op not in ("sum", "mean"):
            raise ValueError(f"PopDistStrategy.reduce takes ReduceOp.SUM or MEAN. "
                             f"Received: {reduce_op!r}")

        def one(v: Any) -> tf.Tensor:
            v = tf.convert_to_tensor(v)
            if axis is None:
                return host_collective_ops.allreduce(v, op)
            total = host_collective_ops.allreduce(tf.reduce_sum(v, axis=axis), "sum")
            if op == "sum":
                return total
            count = host_collective_ops.allreduce(
                tf.constant(float(tf.shape(v)[axis]), tf.float64), "sum")
            return tf.cast(tf.cast(total, tf.float64) / count, total.dtype)

        return tf.nest.map_structure(one, value)


def warn_independent(where: str) -> None:
    """Warns once that this program's instances run independently."""
    notices.once(
        f"{where} under tf-ipu-run",
        f"(instance {identity.getInstanceIndex()} of {identity.getNumInstances()}): the IPU "
        f"configuration was not made with popdist.tensorflow.set_ipu_config (or "
        f"PopDistStrategy.update_ipu_config), so the instances run independently: no "
        f"broadcast of instance 0's initial values, no reduction across instances.")


# -- Keras: logs reduced over the instances --------------------------------------------


class _AcrossInstances:
    """Keras's train/test function of a PopDist model: the wrapped function's logs, reduced
    (mean) over the instances after each call. Every instance must make as many calls; one
    that runs out of data before the others makes all of them stop with an error."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def __call__(self, data: Any) -> Any:
        try:
            logs, has = self.inner(data), 1
        except StopIteration:
            logs, has = None, 0
        flags = mpi.allreduce(np.array([has, -has], np.int64), "max",
                              f"{self.name}: a step (data left?)")
        if flags[0] == 0:
            raise StopIteration
        if -flags[1] == 0:  # some instance ended, some did not
            raise RuntimeError(
                f"{self.name}: instance {identity.getInstanceIndex()} "
                f"{'ran out of data' if not has else 'has more data'} while another instance "
                f"{'has more' if not has else 'ran out'}: every instance must run the same "
                f"number of steps (shard the dataset into equal parts, e.g. "
                f"dataset.shard(popdist.getNumInstances(), popdist.getInstanceIndex()) "
                f"with drop_remainder, or set steps_per_epoch).")
        return reduce_logs(logs, f"{self.name}: a step's logs")


def reduce_logs(logs: Any, purpose: str = "Keras logs") -> Any:
    """Every numeric leaf of ``logs`` averaged over the instances (one MPI call); leaves
    keep their type (tensors stay tensors of their dtype)."""
    leaves = tf.nest.flatten(logs)
    arrays, slots = [], []
    for k, leaf in enumerate(leaves):
        try:
            a = np.asarray(leaf.numpy() if hasattr(leaf, "numpy") else leaf)
        except (TypeError, ValueError):
            continue
        if a.dtype.kind in "biuf":
            arrays.append(a)
            slots.append(k)
    if not arrays:
        return logs
    flat = np.concatenate([a.astype(np.float64).ravel() for a in arrays])
    mean = mpi.allreduce(flat, "mean", purpose)
    out, at = list(leaves), 0
    for k, a in zip(slots, arrays, strict=True):
        value = mean[at:at + a.size].reshape(a.shape)
        at += a.size
        leaf = leaves[k]
        if tf.is_tensor(leaf):
            out[k] = tf.constant(value, dtype=leaf.dtype) if leaf.dtype.is_floating \
                else tf.constant(value)
        elif isinstance(leaf, (float, int, np.generic)) and a.ndim == 0:
            out[k] = float(value)
        else:
            out[k] = value
    return tf.nest.pack_sequence_as(logs, out)


_KERAS_HOOKED = {"done": False}


def _install_keras_reduction() -> None:
    """Wraps Keras's make_train_function / make_test_function (after tf_ipu's own) and the
    epoch-end logs, for models built under a joined PopDistStrategy only."""
    if _KERAS_HOOKED["done"]:
        return
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.trainers.trainer import Trainer

    from tf_ipu import keras_integration

    keras_integration.install()  # tf_ipu's functions first: these wrap them
    for kind in ("train", "test"):
        attr, name = f"make_{kind}_function", f"{kind}_function"
        inner_make = getattr(TensorFlowTrainer, attr)

        def make(self: Any, force: bool = False, _inner: Any = inner_make,
                 _name: str = name) -> Any:
            current = getattr(self, _name, None)
            if isinstance(current, _AcrossInstances):
                setattr(self, _name, current.inner)  # tf_ipu's make reuses its own function
            fn = _inner(self, force=force)
            if not _strategy_joined(getattr(self, "_distribute_strategy", None)):
                return fn
            wrapped = current if isinstance(current, _AcrossInstances) and current.inner is fn \
                else _AcrossInstances(fn, f"{getattr(self, 'name', 'model')}.{_name}")
            setattr(self, _name, wrapped)
            return wrapped

        setattr(TensorFlowTrainer, attr, make)

    original = Trainer._get_metrics_result_or_logs

    def metrics_result_or_logs(self: Any, logs: Any) -> Any:
        result = original(self, logs)
        if _strategy_joined(getattr(self, "_distribute_strategy", None)):
            return reduce_logs(result, "Keras's logs at the end of fit/evaluate")
        return result

    Trainer._get_metrics_result_or_logs = metrics_result_or_logs
    _KERAS_HOOKED["done"] = True


__all__ = ["PopDistStrategy", "reduce_logs", "warn_independent"]
