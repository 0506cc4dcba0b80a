"""IPUStrategy: a tf.distribute strategy whose replica runs on the emulated IPU.

    with strategy.scope():  model = ...; model.compile(...); model.fit(...)
        Keras's step functions -> tf_ipu.keras_integration (N steps per device call)
    strategy.run(fn, args)  inside a tf.function (e.g. a serving function to save)
        -> fn lowered for the concrete args -> one IpuExecute op in the traced graph

Variables created in the scope are ``tf_ipu.variables.IPUVariable``s: ordinary TF resource
variables on the host whose newest value lives on the device once a device call has updated
them. A host read fetches it (on demand, and at every epoch end and checkpoint); a host
write reaches the device before the next call.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx as autograph_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.distribute.one_device_strategy import OneDeviceExtended

from tf_ipu import errors, interrupt, notices
from tf_ipu.lowering.program import LoweredProgram, call_lowered, lower_function

_state = threading.local()


def _lowering_depth() -> int:
    return getattr(_state, "depth", 0)


def _after_operation(value: Any) -> Any:
    """``value``, or for an operation its first output (a loop's: its iteration count), or
    a scalar 0 computed after it. A data dependency: XLA keeps only what outputs use."""
    if not isinstance(value, tf.Operation):
        return value
    if value.outputs:
        return tf.identity(value.outputs[0])
    with tf.control_dependencies([value]):
        return tf.constant(0, tf.int32)


def _as_tensor(value: Any) -> tf.Tensor | None:
    """``value`` as a tensor argument of a device program, or None if it is an object the
    program uses as it is (a model, an optimizer, a queue)."""
    if tf.is_tensor(value) or isinstance(value, (int, float, bool, np.ndarray, np.generic)):
        return tf.convert_to_tensor(value)
    try:
        return tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        return None


class _IPUExtended(OneDeviceExtended):
    """OneDeviceExtended whose variables are IPUVariables (device-resident), and whose
    reductions in a replicated device program are all-reduces across its replicas."""

    def _create_variable(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        from tf_ipu.variables import make_ipu_variable

        return make_ipu_variable(super()._create_variable(next_creator, **kwargs))

    def _update(self, var: Any, fn: Callable, args: Any, kwargs: Any, group: Any) -> Any:
        """A variable's update; in a pipelined program being lowered, in the stage of the
        layer that owns the variable (tf_ipu.pipelining)."""
        from tf_ipu import pipelining

        scope = pipelining.variable_scope(var) if _lowering_depth() > 0 else None
        if scope is None:
            return super()._update(var, fn, args, kwargs, group)
        with scope:
            return super()._update(var, fn, args, kwargs, group)

    def _reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any) -> Any:
        return self._batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def _batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any,
                         options: Any) -> list[Any]:
        """Inside a device program of R > 1 replicas: one all-reduce of every value across
        the replicas (``tf_ipu_all_reduce``, a sum or a mean), as Graphcore's IPUStrategy
        reduces with its cross-replica sum and mean. Keras's optimizer sums its gradients
        this way. Elsewhere (one replica, or on the host): the values as they are."""
        values = [v for v, _ in value_destination_pairs]
        replicas = _lowering_replicas()
        if (replicas <= 1 and not _lowering_world()) or not values:
            return values
        op = {tf.distribute.ReduceOp.SUM: "sum", tf.distribute.ReduceOp.MEAN: "mean"}.get(reduce_op)
        if op is None:
            raise ValueError(f"IPUStrategy reduces across replicas with SUM or MEAN, not {reduce_op}.")
        return all_reduce(values, op)


def _replica_zero(lowered: LoweredProgram, result: Any) -> Any:
    """The results of ``strategy.run`` from a replicated program: replica 0's (an outfeed
    carries every replica's values)."""
    if lowered.replicas <= 1 or result is None:
        return result
    return tf.nest.map_structure(lambda t: t[0], result)


def _lowering_replicas() -> int:
    """Replicas of the device program being lowered on this thread (1 outside one)."""
    return getattr(_state, "replicas", 1) if _lowering_depth() > 0 else 1


def _lowering_world() -> bool:
    """Whether the device program being lowered is one program of several instances'
    replicas (``tf-ipu-run`` with ``popdist.tensorflow.set_ipu_config``): it all-reduces
    and draws its seeds by global replica index even with one replica per instance."""
    if _lowering_depth() == 0:
        return False
    from tf_ipu import runtime

    return runtime.get_runtime().world_instances() > 1


def all_reduce(values: list[Any], op: str = "sum") -> list[tf.Tensor]:
    """``values`` reduced across the replicas of the device program being lowered: one
    ``tf_ipu_all_reduce`` for all of them (docs/ir.md). Sparse gradients (IndexedSlices)
    are reduced as dense tensors."""
    from tensorflow.compiler.tf2xla.python import xla

    from device_server.protocol import ALL_REDUCE_TARGET

    dense = [tf.convert_to_tensor(v) for v in values]
    return list(xla.custom_call_v2(
        ALL_REDUCE_TARGET, dense, [tf.TensorSpec(t.shape, t.dtype) for t in dense],
        backend_config=op, has_side_effect=True))


def replica_id() -> tf.Tensor:
    """This replica's index (int32, 0 .. replicas-1) in the device program being lowered; in
    a program of several instances, its index in the whole run (instance x local replicas +
    local index)."""
    from tensorflow.compiler.tf2xla.python import xla

    from device_server.protocol import REPLICA_ID_TARGET

    (rid,) = xla.custom_call_v2(REPLICA_ID_TARGET, [], [tf.TensorSpec([], tf.int32)])
    return rid


class IPUStrategy(tf.distribute.OneDeviceStrategy):
    """Runs Keras models and ``strategy.run`` functions on the emulated IPU.

    Args:
        config: optional ``IPUConfig``; if given and the system is not configured yet, it
            is configured on first use. Usually you call ``cfg.configure_ipu_system()``
            before creating the strategy, as with Graphcore's API.
        ipu_device, cpu_device, enable_dataset_iterators, enable_keras_extensions:
            Graphcore's arguments, accepted. The device is the one IPU device of this
            process, iterators given to ``run`` always feed the device, and Keras always
            runs its steps on the IPU; a value other than the default is named once in a
            warning.

    Example:
        >>> cfg = tf_ipu.IPUConfig(); cfg.configure_ipu_system()
        >>> strategy = tf_ipu.IPUStrategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        ...     model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    """

    def __init__(self, config: Any = None, ipu_device: str = "/device:IPU:0",
                 cpu_device: str = "/device:CPU:0", enable_dataset_iterators: bool = True,
                 enable_keras_extensions: bool = True) -> None:
        if isinstance(config, str):  # Graphcore's first positional argument: ipu_device
            config, ipu_device = None, config
        for name, value, default in (
                ("ipu_device", ipu_device, "/device:IPU:0"), ("cpu_device", cpu_device,
                                                            "/device:CPU:0"),
                ("enable_dataset_iterators", enable_dataset_iterators, True),
                ("enable_keras_extensions", enable_keras_extensions, True)):
            if value != default:
                notices.once(f"IPUStrategy({name}={value!r})",
                             "has no effect here: the strategy has one IPU device, iterators "
                             "given to run() feed it, and Keras runs its steps on it.")
        super().__init__("/device:CPU:0")
        self.extended.__class__ = _IPUExtended
        self._ipu_config = config
        self._run_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        from tf_ipu import keras_integration

        keras_integration.install()

    def __repr__(self) -> str:
        return "IPUStrategy()"

    def experimental_run_v2(self, fn: Callable, args: tuple = (), kwargs: dict | None = None,
                            options: Any = None) -> Any:
        """TF 2.1's name of ``run``, which Graphcore's older examples call."""
        return self.run(fn, args=args, kwargs=kwargs, options=options)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def reports(self) -> list[Any]:
        """The emulator's report of every program compiled in this process so far."""
        from tf_ipu import runtime

        return list(runtime.get_runtime().reports)

    def experimental_distribute_dataset(self, dataset: tf.data.Dataset, options: Any = None) -> Any:
        """Returns ``dataset`` itself: one replica, fed from the host, so no per-device
        iterator is needed (Keras then pulls batches through a plain tf.data iterator,
        which the infeed gathers N at a time)."""
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Calls ``dataset_fn`` with the one input pipeline's context."""
        return dataset_fn(tf.distribute.InputContext(1, 0, 1))

    @contextlib.contextmanager
    def lowering(self, replicas: int | None = None) -> Iterator[None]:
        """Marks code being traced into a device program (``run`` then runs inline) of
        ``replicas`` replicas (None: as the enclosing program, else 1)."""
        previous = getattr(_state, "replicas", 1)
        _state.depth = _lowering_depth() + 1
        if replicas is not None:
            _state.replicas = replicas
        try:
            yield
        finally:
            _state.depth -= 1
            _state.replicas = previous

    @property
    def replication_factor(self) -> int:
        """How many replicas a model on one IPU runs as: one per IPU the configuration
        attaches (``IPUConfig.auto_select_ipus``), each with the whole model and its own
        batches (a pipelined model's replicas span several IPUs each: this over its IPUs per
        replica, ``tf_ipu.replication.replicas_for(model)``). ``num_replicas_in_sync`` stays
        1, as on Graphcore's IPUStrategy, so Keras sums the replicas' gradients without
        scaling the loss (docs/porting.md)."""
        from tf_ipu import runtime

        self._ensure_configured()
        return runtime.get_runtime().replication_factor()

    # Not converted by autograph when called inside a user's tf.function: its compile step
    # talks to the device server (autograph would otherwise walk into the gRPC client and warn
    # about every compiled function it meets). The user's fn is lowered, and converted, apart.
    @tf.autograph.experimental.do_not_convert
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        options: Any = None,
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` on the IPU as one device call.

        Inside a device program being lowered, runs ``fn`` inline in the replica context.
        Otherwise ``fn`` is lowered for the concrete shapes of ``args`` (cached) and called
        through the IpuExecute op, eagerly or in the graph being traced (so a saved
        ``tf.function`` carries the lowered program).
        """
        kwargs = kwargs or {}
        if _lowering_depth() > 0:
            return self.extended.call_for_each_replica(fn, args=args, kwargs=kwargs)
        self._ensure_configured()
        from tf_ipu import feeds

        name = getattr(fn, "__name__", None) or type(fn).__name__
        structure = (args, kwargs)
        leaves = tf.nest.flatten(structure)
        # Tensors become the program's arguments; iterators become infeeds; other objects
        # (a model, an optimizer, an outfeed queue) are used as they are while lowering.
        flat: list[tf.Tensor] = []
        static: dict[int, Any] = {}
        infeeds: dict[str, Any] = {}
        for k, leaf in enumerate(leaves):
            if feeds.is_host_iterator(leaf):
                iterator = feeds.host_iterator(leaf)
                feed = f"run:{name}:arg{k}"
                static[k] = feeds.DeviceIterator(feed, iterator.element_spec)
                infeeds[feed] = iterator
                continue
            tensor = _as_tensor(leaf)
            if tensor is None:
                static[k] = leaf
            else:
                flat.append(tensor)
        if infeeds and tf.inside_function():
            raise ValueError(
                f"strategy.run({name}) takes an iterator: call it eagerly (not inside a "
                f"tf.function), so that the host can feed the device while it runs."
            )
        specs = tuple(tf.TensorSpec(t.shape, t.dtype) for t in flat)
        replicas = self.replication_factor
        key = (replicas, specs, tuple(sorted(
            (k, ("infeed", v.feed, repr(v.element_spec)) if isinstance(v, feeds.DeviceIterator)
             else ("object", id(v))) for k, v in static.items())))
        try:
            per_fn = self._run_cache.setdefault(fn, {})
        except TypeError:  # not weak-referenceable: no cache
            per_fn = {}
        cached: tuple[LoweredProgram, dict[str, Any]] | None = per_fn.get(key)
        if cached is None:

            def flat_fn(*tensors: tf.Tensor) -> Any:
                given = iter(tensors)
                values = [static[k] if k in static else next(given) for k in range(len(leaves))]
                a, kw = tf.nest.pack_sequence_as(structure, values)
                # Converted by autograph as tf.distribute's run does: a plain function's
                # Python loops and conditions over tensors become tf.while_loop / tf.cond.
                converted = autograph.tf_convert(fn, autograph_ctx.control_status_ctx(),
                                                 convert_by_default=False)
                with self.lowering(replicas):
                    out = self.extended.call_for_each_replica(converted, args=a, kwargs=kw)
                # An operation (Graphcore's loops return one when nothing is loop-carried)
                # is something to wait for: the call returns a value computed from it.
                return tf.nest.map_structure(_after_operation, out)

            with feeds.collecting_infeeds() as queues:  # infeed queues fn's closure holds
                lowered = lower_function(flat_fn, list(specs), f"run:{name}", replicas)
            from tf_ipu import runtime

            runtime.get_runtime().compile(lowered.program, lowered.signature)
            cached = per_fn[key] = (lowered, queues)
        lowered, queues = cached
        if queues and tf.inside_function():
            raise ValueError(
                f"strategy.run({name}) takes from an infeed queue: call it eagerly (not inside "
                f"a tf.function), so that the host can feed the device while it runs."
            )
        infeeds.update({feed: feeds.host_iterator(q) for feed, q in queues.items()})
        if not infeeds:
            # Called eagerly: Ctrl-C raises KeyboardInterrupt once the call stopped. (In a
            # tf.function this only adds the op; tf_ipu.interrupt covers its calls.)
            with interrupt.deferred_interrupt(), errors.plain_device_errors():
                return _replica_zero(lowered, call_lowered(lowered, flat))
        from tf_ipu import runtime

        client = runtime.get_runtime().client
        with contextlib.ExitStack() as stack:
            feeders = [stack.enter_context(feeds.Feeder(client, feed, it))
                       for feed, it in infeeds.items()]
            try:
                with interrupt.deferred_interrupt(), errors.plain_device_errors():
                    result = call_lowered(lowered, flat)
            except Exception:
                stack.close()  # the feeders stop; one that failed says why the call did
                for feeder in feeders:
                    if feeder.failure is not None:
                        raise feeder.failure from None
                raise
        for feeder in feeders:
            if feeder.failure is not None:
                raise feeder.failure
        return _replica_zero(lowered, result)

    def _ensure_configured(self) -> None:
        from tf_ipu import runtime

        rt = runtime.get_runtime()
        if not rt.configured:
            if self._ipu_config is not None:
                self._ipu_config.configure_ipu_system()
            else:
                rt.ensure_configured()
