"""Keras integration: fit/evaluate/predict run their steps on the IPU, N steps per device call.

    model.fit ──> train_function(iterator)            (this module, host side)
                   ├─ pull up to N batches in one traced call (infeed side)
                   ├─ stack them: [N, batch, ...] per input
                   └─ device program: a loop of N train_steps  ──IpuExecute──> device server
                                          (outfeed: the last step's logs, or every step's
                                           predictions for predict)

Keras has no extension point for this in its TF backend, so ``install()`` replaces
``make_train_function``, ``make_test_function`` and ``make_predict_function`` of
``TensorFlowTrainer`` once; each checks whether the model's strategy is an ``IPUStrategy``
and otherwise calls Keras's own. The model's ``train_step``/``test_step``/``predict_step``
are reused, so user overrides keep working.

A program is lowered per input signature (the last, smaller batch of an epoch is another
signature, hence another program). With ``steps_per_execution=N`` every program loops over
N stacked batches; a call with fewer batches left pads the stack and tells the loop how
many steps to run, so it reuses the same program.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from device_server.protocol import DEVICE_LOOP_NAME, INFEED_TARGET
from tf_ipu import accumulation, errors, feeds, interrupt, notices, pipelining, replication
from tf_ipu.lowering.program import LoweredProgram, call_lowered, lower_function
from tf_ipu.summaries import refuse_summaries

_ORIGINALS: dict[str, Callable[..., Any]] = {}
#: Up to this many steps per call, the infeed pulls its batches with straight-line code.
_UNROLL_PULL = 64


def _is_ipu_model(model: Any) -> bool:
    from tf_ipu.strategy import IPUStrategy

    return isinstance(getattr(model, "_distribute_strategy", None), IPUStrategy)


def install() -> None:
    """Routes Keras's step functions to the IPU for models built under ``IPUStrategy``."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    if _ORIGINALS:
        return
    for kind in ("train", "test", "predict"):
        attr = f"make_{kind}_function"
        original = getattr(TensorFlowTrainer, attr)
        _ORIGINALS[attr] = original

        def make(self: Any, force: bool = False, _kind: str = kind, _orig: Any = original) -> Any:
            if _kind == "train":
                accumulation.prepare(self)  # on the CPU too: Keras's own accumulation
            if not _is_ipu_model(self):
                return _orig(self, force=force)
            if _kind == "train":
                accumulation.check_steps(self, max(1, int(self.steps_per_execution)))
            name = f"{_kind}_function"
            current = getattr(self, name, None)
            steps = max(1, int(self.steps_per_execution))
            siblings = None
            if isinstance(current, IPUStepFunction) and not force:
                # The same model's functions for other steps per execution (a call that
                # lowered it to its steps, _lower_steps_per_execution) keep their programs.
                siblings = current.siblings
                if steps in siblings:
                    setattr(self, name, siblings[steps])
                    return siblings[steps]
            fn = IPUStepFunction(self, _kind, siblings)
            setattr(self, name, fn)
            return fn

        setattr(TensorFlowTrainer, attr, make)
    TensorFlowTrainer.set_infeed_queue_options = set_infeed_queue_options
    TensorFlowTrainer.set_outfeed_queue_options = set_outfeed_queue_options
    TensorFlowTrainer.set_asynchronous_callbacks = set_asynchronous_callbacks
    TensorFlowTrainer.set_gradient_accumulation_options = (
        accumulation.set_gradient_accumulation_options)
    TensorFlowTrainer.set_replication_options = replication.set_replication_options
    for name in ("set_pipeline_stage_assignment", "get_pipeline_stage_assignment",
                 "reset_pipeline_stage_assignment", "print_pipeline_stage_assignment_summary",
                 "set_pipelining_options"):
        setattr(TensorFlowTrainer, name, getattr(pipelining, name))
    pipelining.install()
    replication.install_epoch_iterator()
    _install_steps_lowering()  # after the replicas' counting: it reads their steps
    replication.install_predict_marker()
    replication.install_logs()
    replication.install_replica_seeds()
    from tf_ipu import serving  # Graphcore's model.export_for_ipu_serving

    TensorFlowTrainer.export_for_ipu_serving = serving.export_for_ipu_serving
    _install_sync_points()


_log = logging.getLogger("tf_ipu")
#: The model's ``steps_per_execution`` as compiled, while its outermost fit/evaluate/predict
#: runs (the calls may lower the model's own attribute to their steps).
_COMPILED_STEPS_ATTR = "_tf_ipu_compiled_steps_per_execution"


def _install_steps_lowering() -> None:
    """Graphcore's Keras runs at most the steps asked for in one device call: when an
    epoch of ``fit`` (``steps_per_epoch`` or the data's batches, per replica), or the
    ``steps`` of ``evaluate`` or ``predict``, are fewer than ``steps_per_execution``, it
    uses those steps as ``steps_per_execution`` for that call, with a warning
    (graphcore/keras, keras/ipu/extensions/data_adapter.py, ``IPUDataHandler``). Keras 3 on
    the CPU would run ``steps_per_execution`` steps anyway. Under IPUStrategy, each epoch
    iterator Keras makes lowers its own and the model's ``steps_per_execution`` so (the
    model's is restored when the call returns)."""
    import functools

    from keras.src.backend.tensorflow import trainer as tf_trainer

    cls = tf_trainer.TFEpochIterator
    if getattr(cls, "_tf_ipu_lowering", False):
        return
    original_init = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _lower_steps_per_execution(self)

    cls.__init__ = init
    cls._tf_ipu_lowering = True

    trainer = tf_trainer.TensorFlowTrainer
    for kind in ("fit", "evaluate", "predict"):
        original = getattr(trainer, kind)

        @functools.wraps(original)
        def restoring(self: Any, *args: Any, _orig: Any = original, **kwargs: Any) -> Any:
            if not _is_ipu_model(self):
                return _orig(self, *args, **kwargs)
            saved = self.steps_per_execution
            outermost = not hasattr(self, _COMPILED_STEPS_ATTR)
            if outermost:
                setattr(self, _COMPILED_STEPS_ATTR, saved)
            try:
                return _orig(self, *args, **kwargs)
            finally:
                self.steps_per_execution = saved
                if outermost:
                    delattr(self, _COMPILED_STEPS_ATTR)

        setattr(trainer, kind, restoring)


def _lower_steps_per_execution(iterator: Any) -> None:
    """Sets the steps per execution of a new epoch iterator of an IPU model's
    fit/evaluate/predict, and the model's, to the compiled ``steps_per_execution``, or to
    the iterator's steps when they are fewer (with a warning, as Graphcore's Keras)."""
    from tf_ipu.strategy import IPUStrategy

    call = replication.current_call()
    if call is None or not isinstance(getattr(iterator, "_distribute_strategy", None),
                                      IPUStrategy):
        return
    kind, model = call
    compiled = max(1, int(getattr(model, _COMPILED_STEPS_ATTR, model.steps_per_execution)))
    steps = iterator.num_batches  # per replica in fit and evaluate (replication's count)
    lowered = compiled
    if steps is not None and 0 < steps < compiled:
        lowered = int(steps)
        replicas = getattr(iterator, "_tf_ipu_replica_count", 1)
        _log.warning(
            "tf_ipu: %s.%s: steps_per_execution is %d, but the data given has only %d "
            "step(s)%s; each device call runs %d step(s) (steps_per_execution lowered to "
            "the steps asked for, as Graphcore's Keras does).",
            getattr(model, "name", "model"), kind, compiled, lowered,
            f" per replica ({replicas} replicas)" if replicas > 1 else "", lowered)
    iterator.steps_per_execution = lowered
    model.steps_per_execution = lowered


# Off by default: on a 2-core machine, a CPU-bound input pipeline pulled beside the device
# call competes with the emulator for the cores and the two take longer than one after the
# other. It pays when pulling waits (files, a slow source) or cores are spare.
_DEFAULT_PREFETCH_DEPTH = 0
_PREFETCH_ATTR = "_tf_ipu_prefetch_depth"
_DEFAULT_DEVICE_PULL = False
_DEVICE_PULL_ATTR = "_tf_ipu_device_pull"
#: Batches the host pulls (in one traced call) and pushes (in one PushInfeed) at a time when
#: the device pulls from an infeed.
_PUSH_GROUP = 8


def infeed_prefetch_depth(model: Any) -> int:
    """How many device calls ahead the infeed pulls batches for ``model`` (0: none)."""
    return int(getattr(model, _PREFETCH_ATTR, _DEFAULT_PREFETCH_DEPTH))


def infeed_device_pull(model: Any) -> bool:
    """Whether ``model``'s device loops pull their batches from an infeed during the call."""
    return bool(getattr(model, _DEVICE_PULL_ATTR, _DEFAULT_DEVICE_PULL))


def set_infeed_queue_options(self: Any, prefetch_depth: int | None = None,
                             device_pull: bool | None = None, **kwargs: Any) -> None:
    """Graphcore's ``model.set_infeed_queue_options``: ``prefetch_depth`` is how many device
    calls ahead the host pulls and stacks batches while the device computes (0: none, the
    default; None: the default). A depth above 1 is accepted and pulls one call ahead.
    ``device_pull=True``: the device loop of ``fit``/``evaluate`` pulls each step's batch
    from an infeed while it runs, as Graphcore's infeed queues work (the host pushes batches
    as its pipeline yields them, so the device starts on the first batch and the host
    prepares the next ones meanwhile); False (the default): the call takes its N batches
    stacked. Other options of Graphcore's infeed queue have no effect here and are named in a
    warning.

    Example:
        >>> model.set_infeed_queue_options(prefetch_depth=2)  # doctest: +SKIP
    """
    if prefetch_depth is None:
        prefetch_depth = _DEFAULT_PREFETCH_DEPTH
    if not isinstance(prefetch_depth, int) or isinstance(prefetch_depth, bool) or prefetch_depth < 0:
        raise ValueError(
            f"set_infeed_queue_options: prefetch_depth must be an int >= 0 (or None). "
            f"Received: prefetch_depth={prefetch_depth!r}"
        )
    for name, value in kwargs.items():
        notices.once(f"set_infeed_queue_options({name}={value!r})",
                     "has no effect here (only prefetch_depth and device_pull do).")
    setattr(self, _PREFETCH_ATTR, prefetch_depth)
    if device_pull is not None:
        setattr(self, _DEVICE_PULL_ATTR, bool(device_pull))


def set_outfeed_queue_options(self: Any, **kwargs: Any) -> None:
    """Graphcore's ``model.set_outfeed_queue_options``: options of the outfeed queue that
    carries ``fit``/``evaluate``/``predict`` results to the host (``buffer_depth``, ...).
    Here results come back with the reply of each device call, so no option changes
    anything; each is accepted and named in one warning."""
    for name, value in kwargs.items():
        notices.once(f"set_outfeed_queue_options({name}={value!r})",
                     "has no effect here: results come back with each device call's reply.")


def set_asynchronous_callbacks(self: Any, asynchronous: bool = False) -> None:
    """Graphcore's ``model.set_asynchronous_callbacks``: with ``asynchronous=True`` Graphcore
    calls batch callbacks after every step from a polling thread. Here callbacks run once a
    device call (every ``steps_per_execution`` steps), as Keras calls them; True is accepted
    and said once to have no effect."""
    if not isinstance(asynchronous, bool):
        raise ValueError(f"set_asynchronous_callbacks: asynchronous must be a bool. "
                         f"Received: {asynchronous!r}")
    if asynchronous:
        notices.once("set_asynchronous_callbacks(True)",
                     "has no effect here: batch callbacks run once per device call (every "
                     "steps_per_execution steps), with that call's logs.")


def sync_weights(model: Any, where: str) -> None:
    """Brings every host copy up to date with the device (``DeviceRuntime.sync_to_host``),
    labelled with the model's step count: what a lost session would leave the host with."""
    from tf_ipu import runtime

    rt = runtime.get_runtime()
    if not rt.connected:
        return
    optimizer = getattr(model, "optimizer", None)
    iterations = getattr(optimizer, "iterations", None)
    step = f"step {int(iterations.numpy())}" if iterations is not None else "the last call"
    named = rt.residency.host_holds.startswith(f"{step} (")  # the first name of a step stays
    rt.sync_to_host(None if named else f"{step} ({where})")


def _install_sync_points() -> None:
    """The host refreshes its copies at every epoch end (before the callbacks, so
    ModelCheckpoint, BackupAndRestore and EarlyStopping see the device's values in one
    transfer), at the end of training, and before every save of weights or of the model
    (the checkpoints callbacks write at other frequencies)."""
    from keras.src.callbacks.callback_list import CallbackList
    from keras.src.models.model import Model

    def at(owner: type, name: str, where: Any, model_of: Any) -> None:
        original = getattr(owner, name)

        def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
            model = model_of(self)
            if model is not None and _is_ipu_model(model):
                sync_weights(model, where(*args, **kwargs))
            return original(self, *args, **kwargs)

        hooked.__name__ = name
        hooked.__doc__ = original.__doc__
        hooked.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(owner, name, hooked)

    def callbacks_model(cbs: Any) -> Any:
        return getattr(cbs, "_model", None)

    at(CallbackList, "on_epoch_end", lambda epoch, *a, **k: f"end of epoch {epoch + 1}",
       callbacks_model)
    at(CallbackList, "on_train_end", lambda *a, **k: "end of training", callbacks_model)
    at(Model, "save_weights", lambda *a, **k: "weights saved", lambda m: m)
    at(Model, "save", lambda *a, **k: "model saved", lambda m: m)


def _compiled(device_loop: Any, specs: list[tf.TensorSpec], name: str,
              replicas: int = 1, model: Any = None,
              pipeline: dict[str, Any] | None = None) -> tuple[LoweredProgram, Any]:
    """Lowers a device loop (of ``replicas`` replicas; a pipelined ``model``'s ops tagged
    with their stages) and compiles it now (so that errors, an unsupported op or out of
    memory, name the model's layers here, and the estimate is reported before the first
    step); returns it with the traced runner that calls it through IpuExecute."""
    from tf_ipu import runtime

    if pipeline is not None:
        with pipelining.tagging(model, pipelining.stages_of(model)):
            lowered = lower_function(device_loop, specs, name, replicas, pipeline)
    else:
        lowered = lower_function(device_loop, specs, name, replicas)
    runtime.get_runtime().compile(lowered.program, lowered.signature)

    @tf.function(autograph=False)
    def runner(*args: tf.Tensor) -> Any:
        return call_lowered(lowered, list(args))

    return lowered, runner


def runtime_config() -> Any:
    """The IPU system's configuration (IPUConfig), or None before it is configured."""
    from tf_ipu import runtime

    return runtime.get_runtime().config


def _signature(batch: list[tf.Tensor]) -> tuple:
    return tuple((t.dtype, tuple(t.shape)) for t in batch)


def _is_tf_iterator(obj: Any) -> bool:
    return isinstance(obj, (tf.data.Iterator, tf.distribute.DistributedIterator))


def _leaf_is_data(x: Any) -> bool:
    return x is not None and not isinstance(x, tf.experimental.Optional)


class IPUStepFunction:
    """What Keras calls as ``model.train_function`` (or test/predict) under IPUStrategy."""

    def __init__(self, model: Any, kind: str,
                 siblings: dict[int, IPUStepFunction] | None = None) -> None:
        self.model = model
        self.kind = kind
        self.steps_per_execution = max(1, int(model.steps_per_execution))
        #: This model's functions of this kind, by steps per execution (this one's included).
        self.siblings: dict[int, IPUStepFunction] = {} if siblings is None else siblings
        self.siblings[self.steps_per_execution] = self
        #: Replicas of its device programs, the steps each runs per call, and the batches
        #: a call takes (step i of replica r takes batch i * replicas + r).
        #: A pipelined model's stages (tf_ipu.pipelining.plan), or None.
        self.pipeline = pipelining.plan(model, self.steps_per_execution)
        if self.pipeline is not None:
            if kind == "train":
                pipelining.check_training(model, self.pipeline)
            cfg = runtime_config()
            self.pipeline["recomputation"] = bool(getattr(cfg, "allow_recompute", False))
        self.replicas = replication.replicas_for(model)
        self.steps_per_call = replication.per_call_steps(self.steps_per_execution,
                                                         self.replicas, kind)
        self.batches_per_call = self.steps_per_call * self.replicas
        self._programs: dict[tuple, tuple[LoweredProgram, Any]] = {}
        self._pull_fn: Any = None
        self._group_pull_fn: Any = None
        self._carry: Any = None  # a batch of another shape, pulled ahead (device pull)
        self.device_calls = 0
        # The infeed's next pull, run on a worker thread while the device computes:
        # (iterator, future of its groups), or None.
        self._next: tuple[Any, concurrent.futures.Future] | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.pulls_overlapped = 0  # pulls that ran while a device call was in flight

    # -- host side: the infeed ---------------------------------------------------------
    def __call__(self, data: Any) -> Any:
        if self.kind == "predict":
            groups = self._group([self._strip(b) for b in data])
        elif (_is_tf_iterator(data) and self.kind != "predict" and self.steps_per_execution > 1
                and infeed_device_pull(self.model) and self.replicas == 1
                and self.pipeline is None):
            return self._device_pull(data)
        elif _is_tf_iterator(data):
            if self.replicas > 1 and infeed_device_pull(self.model):
                notices.once("device_pull with replicas",
                             "set_infeed_queue_options(device_pull=True) has no effect with "
                             "replicas yet: each call takes its batches stacked.")
            groups = self._take(data)
            if groups and infeed_prefetch_depth(self.model) > 0:
                self._prefetch(data)  # the next call's batches, pulled while this one runs
        else:  # a Python iterable (train_on_batch/test_on_batch)
            batches = []
            for item in data:
                batches.append(self._strip(item))
                if len(batches) == self.batches_per_call:
                    break
            if self.replicas > 1 and len(batches) % self.replicas:
                raise ValueError(
                    f"{self.model.name}: {self.kind}_on_batch got {len(batches)} batch(es) for "
                    f"{self.replicas} replicas, which take one batch each: call fit/evaluate "
                    f"(the replicas share out the dataset's batches), or attach one IPU.")
            groups = self._group(batches)
        if not groups:
            raise StopIteration
        with errors.plain_device_errors():
            outputs = [self._run_group(*g) for g in groups]
        if self.kind != "predict":
            if self.replicas > 1:
                return replication.reduce_logs(self.model, outputs[-1])
            return outputs[-1]
        result = outputs[0]
        for more in outputs[1:]:
            result = tf.nest.map_structure(lambda a, b: tf.concat([a, b], 0), result, more)
        return result

    @staticmethod
    def _strip(batch: Any) -> Any:
        """Data structure with Optionals made None and arrays made tensors (as Keras does)."""
        return tf.nest.map_structure(
            lambda x: None if not _leaf_is_data(x) else tf.convert_to_tensor(x), batch
        )

    @staticmethod
    def _group(batches: list[Any]) -> list[tuple[Any, list[tf.Tensor], int]]:
        """Runs of batches with the same shapes -> (template, stacked inputs, count)."""
        runs: list[list[Any]] = []
        last = None
        for b in batches:
            sig = tuple(
                None if x is None else (x.dtype, tuple(x.shape)) for x in tf.nest.flatten(b)
            )
            if runs and sig == last:
                runs[-1].append(b)
            else:
                runs.append([b])
                last = sig
        groups = []
        for run in runs:
            flats = [tf.nest.flatten(b) for b in run]
            stacked = [
                tf.stack([f[i] for f in flats])
                for i, x in enumerate(flats[0])
                if x is not None
            ]
            groups.append((run[0], stacked, len(run)))
        return groups

    def _take(self, iterator: Any) -> list[tuple[Any, list[tf.Tensor], int]]:
        """This call's batches: those pulled ahead from ``iterator`` if there are, else
        pulled now. Batches pulled ahead from another iterator (an epoch's, which Keras has
        left) are dropped: Keras would not have read them either."""
        pending, self._next = self._next, None
        if pending is not None:
            source, future = pending
            groups = future.result()  # re-raises what the pull raised
            if source is iterator:
                return groups
        return self._pull(iterator)

    def _prefetch(self, iterator: Any) -> None:
        """Starts pulling the next call's batches from ``iterator`` on the worker thread
        (``set_infeed_queue_options(prefetch_depth=...)``)."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tf_ipu-infeed")

        from tf_ipu import runtime

        rt = runtime.get_runtime()

        def pull() -> list[tuple[Any, list[tf.Tensor], int]]:
            calls, busy = rt.device_calls, rt.call_in_flight()
            groups = self._pull(iterator)
            if busy or rt.call_in_flight() or rt.device_calls != calls:
                self.pulls_overlapped += 1  # a device call ran while this pull did
            return groups

        self._next = (iterator, self._worker.submit(pull))

    def _pull(self, iterator: Any) -> list[tuple[Any, list[tf.Tensor], int]]:
        """Pulls up to N batches (N x replicas) from a tf iterator in one traced call,
        stacked per input."""
        if self._pull_fn is None:
            self._pull_fn = self._make_pull(iterator)
        count, sizes, flat = self._pull_fn(iterator)
        count = int(count)
        sizes = sizes.numpy()
        if self.replicas > 1 and count:
            count = replication.usable_batches([int(b) for b in sizes[:count]], self.replicas,
                                               f"{self.model.name}.{self.kind}")
        if count == 0:
            return []
        spec = iterator.element_spec
        leaves = tf.nest.flatten(spec)
        keep = [i for i, s in enumerate(leaves) if isinstance(s, tf.TensorSpec)]
        # Runs of equal batch size (all of them, but for an epoch's last, smaller batch).
        groups = []
        start = 0
        while start < count:
            end = start
            while end < count and sizes[end] == sizes[start]:
                end += 1
            b = int(sizes[start])
            lo, hi = int(sizes[:start].sum()), int(sizes[:end].sum())
            stacked = []
            template: list[Any] = [None] * len(leaves)
            for j, i in enumerate(keep):
                t = flat[j] if (lo, hi) == (0, flat[j].shape[0]) else flat[j][lo:hi]
                t = tf.reshape(t, [end - start, b, *t.shape[1:]])
                stacked.append(t)
                template[i] = True  # a placeholder: this input is present
            groups.append((tf.nest.pack_sequence_as(spec, template), stacked, end - start))
            start = end
        return groups

    def _make_pull(self, iterator: Any, n: int | None = None) -> Any:
        n = self.batches_per_call if n is None else n
        spec = iterator.element_spec
        leaves = tf.nest.flatten(spec)
        keep = [i for i, s in enumerate(leaves) if isinstance(s, tf.TensorSpec)]
        for i in keep:
            if leaves[i].shape.rank == 0:
                raise ValueError(
                    "IPU input pipelines need a batch dimension on every input; "
                    f"received an element with spec {leaves[i]}."
                )

        if n <= _UNROLL_PULL and all(leaves[i].shape[1:].is_fully_defined() for i in keep):

            @tf.function
            def pull_unrolled(it: Any) -> Any:
                # N get_next calls in a row (an exhausted iterator stays exhausted): no
                # loop, so no per-iteration cost of TF's while (~0.2 ms a batch here).
                have, sizes = [], []
                parts: list[list[Any]] = [[] for _ in keep]
                empty = [tf.zeros([0, *leaves[i].shape[1:]], leaves[i].dtype) for i in keep]
                for _ in range(n):
                    opt = it.get_next_as_optional()
                    present = opt.has_value()
                    have.append(tf.cast(present, tf.int32))
                    values = tf.cond(
                        present,
                        lambda opt=opt: [tf.nest.flatten(opt.get_value())[i] for i in keep],
                        lambda: empty,
                    )
                    for j, value in enumerate(tf.nest.flatten(values)):
                        parts[j].append(value)
                    sizes.append(tf.shape(parts[0][-1])[0])
                return tf.add_n(have), tf.stack(sizes), [tf.concat(p, 0) for p in parts]

            return pull_unrolled

        @tf.function
        def pull(it: Any) -> Any:
            tas = [
                tf.TensorArray(
                    leaves[i].dtype, size=0, dynamic_size=True, infer_shape=False,
                    element_shape=leaves[i].shape,
                )
                for i in keep
            ]
            sizes = tf.TensorArray(tf.int32, size=0, dynamic_size=True)
            first = it.get_next_as_optional()

            def cond(i: Any, opt: Any, sizes: Any, *tas: Any) -> Any:
                return tf.logical_and(tf.less(i, n), opt.has_value())

            def body(i: Any, opt: Any, sizes: Any, *tas: Any) -> Any:
                values = tf.nest.flatten(opt.get_value())
                tas = [ta.write(i, values[k]) for ta, k in zip(tas, keep, strict=True)]
                sizes = sizes.write(i, tf.shape(values[keep[0]])[0])
                nxt = tf.cond(
                    tf.less(i + 1, n), lambda: it.get_next_as_optional(), lambda: opt
                )
                return (i + 1, nxt, sizes, *tas)

            out = tf.while_loop(cond, body, (tf.constant(0), first, sizes, *tas))
            count, _, sizes, *tas = out
            return count, sizes.stack(), [ta.concat() for ta in tas]

        return pull

    # -- the device pulls: an infeed fed while the call runs ------------------------------
    def _device_pull(self, iterator: Any) -> Any:
        """``fit``/``evaluate`` steps whose device loop pulls each batch from an infeed while
        it runs (``set_infeed_queue_options(device_pull=True)``): the host pushes the first
        batches, starts the call, and goes on pulling and pushing batches while the device
        computes. A batch of another shape (an epoch's last) ends this call's feed and starts
        the next call (another program). Returns the logs of the last step; StopIteration
        when the iterator had no batch left."""
        n = self.steps_per_execution
        if self._group_pull_fn is None:
            # Small groups, so that the device starts early and the rest is pulled while it
            # computes; not too small, each push costs an RPC.
            self._group_pull_fn = self._make_pull(iterator, max(1, min(_PUSH_GROUP, n // 4)))
        carried, self._carry = self._carry, None
        pending = carried[1] if carried is not None and carried[0] is iterator else []
        logs, done = None, 0
        while done < n:
            if not pending:
                pending = self._pull_batches(iterator)
                if not pending:
                    break
            steps, logs, pending = self._run_pulled(iterator, pending, n - done)
            done += steps
        if pending:
            self._carry = (iterator, pending)
        if logs is None:
            raise StopIteration
        return logs

    def _pull_batches(self, iterator: Any) -> list[list[tf.Tensor]]:
        """Up to ``_PUSH_GROUP`` batches from the iterator (one traced pull), each the list
        of its data leaves."""
        count, sizes, flat = self._group_pull_fn(iterator)
        count = int(count)
        sizes = sizes.numpy()
        batches, start = [], 0
        for k in range(count):
            end = start + int(sizes[k])
            batches.append([t[start:end] for t in flat])
            start = end
        return batches

    def _run_pulled(self, iterator: Any, pending: list[list[tf.Tensor]],
                    limit: int) -> tuple[int, Any, list[list[tf.Tensor]]]:
        """One device call of up to ``limit`` steps on batches shaped as ``pending[0]``, fed
        while it runs. Returns (steps run, their logs, batches pulled but not used)."""
        from tf_ipu import runtime

        rt = runtime.get_runtime()
        rt.ensure_configured()
        client = rt.client
        sig = _signature(pending[0])
        entry = self._programs.get(("pull", sig))
        if entry is None:
            entry = self._lower_pull(iterator.element_spec, pending[0])
            self._programs[("pull", sig)] = entry
        (_, runner), feed = entry[:2], entry[2]
        leftover: list[list[tf.Tensor]] = []
        sent = [0]

        def push(batches: list[list[tf.Tensor]], reset: bool = False) -> bool:
            """Pushes the batches of this call's shape (up to ``limit``); keeps the rest.
            Returns whether the feed may go on."""
            same = []
            for b in batches:
                if not leftover and sent[0] + len(same) < limit and _signature(b) == sig:
                    same.append(b)
                else:
                    leftover.append(b)
            if same or reset:
                client.push_infeed(feed, [[t.numpy() for t in b] for b in same], reset=reset)
            sent[0] += len(same)
            return not leftover and sent[0] < limit

        stop = threading.Event()
        failure: list[BaseException] = []

        def feeder() -> None:
            try:
                while not stop.is_set():
                    busy = rt.call_in_flight()
                    batches = self._pull_batches(iterator)
                    if busy and batches:
                        self.pulls_overlapped += 1  # pulled while the device computed
                    if not batches or not push(batches):
                        break
            except BaseException as e:  # re-raised by the caller, after the call
                failure.append(e)
            finally:
                try:
                    client.push_infeed(feed, [], end=True)  # the loop stops at its next pull
                except Exception as e:
                    failure.append(e)

        more = push(pending, reset=True)  # the first batches, before the call starts
        thread = None
        if more:
            thread = threading.Thread(target=feeder, name="tf_ipu-infeed-push", daemon=True)
            thread.start()
        else:
            client.push_infeed(feed, [], end=True)
        try:
            with interrupt.deferred_interrupt():  # Ctrl-C: KeyboardInterrupt once it stops
                steps, logs = runner(tf.constant(limit, tf.int32))
        finally:
            stop.set()
            if thread is not None:
                thread.join()
        self.device_calls += 1
        if failure:
            raise failure[0]
        return int(steps), logs, leftover

    def _lower_pull(self, spec: Any, example: list[tf.Tensor]) -> tuple[Any, Any, str]:
        """The device program of ``_run_pulled``: a loop of up to ``n_steps`` steps, each
        batch pulled from infeed ``feed`` (custom-call ``tf_ipu_infeed``, docs/ir.md) at the
        end of the step before (the first before the loop); the loop ends early when the
        host ends the feed. Outputs (steps run, the last step's logs)."""

        model = self.model
        strategy = model.distribute_strategy
        kind = self.kind
        step_fn = {"train": model.train_step, "test": model.test_step}[kind]
        leaves = tf.nest.flatten(spec)
        present = [i for i, sp in enumerate(leaves) if isinstance(sp, tf.TensorSpec)]
        leaf_specs = [tf.TensorSpec(t.shape, t.dtype) for t in example]
        feed = f"{getattr(model, 'name', 'model')}/{kind}"

        def one_step(values: list[Any]) -> Any:
            flat: list[Any] = [None] * len(leaves)
            for j, idx in enumerate(present):
                flat[idx] = values[j]
            batch = tf.nest.pack_sequence_as(spec, flat)
            return strategy.extended.call_for_each_replica(step_fn, args=(batch,))

        def pull(i: Any) -> tuple[Any, list[Any]]:
            got = xla.custom_call_v2(
                INFEED_TARGET, [i], [tf.TensorSpec([], tf.bool), *leaf_specs],
                backend_config=feed, has_side_effect=True,
            )
            return got[0], list(got[1:])

        with strategy.lowering(), feeds.scratch_trace():
            out_spec = tf.function(lambda *v: one_step(list(v))).get_concrete_function(
                *leaf_specs).structured_outputs
        flat_spec = tf.nest.flatten(out_spec)
        n_in = len(leaf_specs)

        def device_loop(n_steps: tf.Tensor) -> Any:
            with strategy.lowering():
                ok, first = pull(tf.constant(0))

                def cond(i: Any, ok: Any, *state: Any) -> Any:
                    return tf.logical_and(tf.less(i, n_steps), ok)

                def body(i: Any, ok: Any, *state: Any) -> Any:
                    outs = tf.nest.flatten(one_step(list(state[:n_in])))
                    ok_next, nxt = pull(i + 1)
                    logs = [tf.cast(o, t.dtype) for o, t in zip(outs, flat_spec, strict=True)]
                    return (i + 1, ok_next, *nxt, *logs)

                initial = [tf.zeros(t.shape, t.dtype) for t in flat_spec]
                steps, _, *rest = tf.while_loop(
                    cond, body, (tf.constant(0), ok, *first, *initial), name=DEVICE_LOOP_NAME,
                )
                return steps, tf.nest.pack_sequence_as(out_spec, rest[n_in:])

        name = f"{getattr(model, 'name', 'model')}/{kind}_function[steps={self.steps_per_execution}, infeed]"
        lowered, runner = _compiled(device_loop, [tf.TensorSpec([], tf.int32)], name)
        return lowered, runner, feed

    def _run_group(self, structure: Any, stacked: list[tf.Tensor], k: int) -> Any:
        """One device call over ``k`` stacked batches (padded to N x replicas)."""
        n = self.batches_per_call
        replicas = self.replicas
        steps = -(-k // replicas)  # each replica's (a predict call's last group may pad)
        if self.kind == "train":
            accumulation.check_call(self.model, steps, self.steps_per_execution)
        present = [i for i, x in enumerate(tf.nest.flatten(structure)) if x is not None]
        if k < n:
            stacked = [
                tf.pad(t, [[0, n - k]] + [[0, 0]] * (t.shape.rank - 1)) for t in stacked
            ]
        key = (
            tuple(present),
            tuple((t.dtype, tuple(t.shape)) for t in stacked),
        )
        entry = self._programs.get(key)
        if entry is None:
            entry = self._lower(structure, present, stacked)
            self._programs[key] = entry
            if self.kind == "train" and stacked and stacked[0].shape.rank > 1:
                accumulation.log_effective_batch(self.model, int(stacked[0].shape[1]), replicas)
        _, runner = entry
        with interrupt.deferred_interrupt():  # Ctrl-C: KeyboardInterrupt once the call stops
            result = runner(tf.constant(steps, tf.int32), *stacked)
        self.device_calls += 1
        if self.kind == "predict" and replicas > 1:
            return tf.nest.map_structure(
                lambda t: replication.predictions_in_order(t, k), result)
        if self.kind == "predict":
            # [N, batch, ...] per output: keep the k real steps, merge steps into the batch.
            def unstack(t: tf.Tensor) -> tf.Tensor:
                t = t[:k]
                return tf.reshape(t, [-1, *t.shape[2:]])

            return tf.nest.map_structure(unstack, result)
        return result

    # -- the device program ----------------------------------------------------------------
    def _lower(self, structure: Any, present: list[int], stacked: list[tf.Tensor]) -> Any:

        model = self.model
        strategy = model.distribute_strategy
        n = self.steps_per_call
        replicas = self.replicas
        kind = self.kind
        step_fn = {
            "train": model.train_step,
            "test": model.test_step,
            "predict": model.predict_step,
        }[kind]
        n_leaves = len(tf.nest.flatten(structure))
        rid: list[Any] = []  # this replica's index, made once per program (replicated only)

        def batch_at(flat_stacked: tuple, i: Any) -> Any:
            # One dynamic-slice per input (indexing t[i] would add strided_slice's bounds
            # arithmetic to every step of the program). Replica r's step i takes batch
            # i * replicas + r.
            if replicas > 1:
                i = i * replicas + rid[0]
            values: list[Any] = [None] * n_leaves
            for j, idx in enumerate(present):
                t = flat_stacked[j]
                start = [i] + [0] * (t.shape.rank - 1)
                values[idx] = tf.reshape(xla.dynamic_slice(t, start, [1, *t.shape[1:]]), t.shape[1:])
            return tf.nest.pack_sequence_as(structure, values)

        def one_step(flat_stacked: tuple, i: Any) -> Any:
            batch = batch_at(flat_stacked, i)
            return strategy.extended.call_for_each_replica(step_fn, args=(batch,))

        specs = [tf.TensorSpec([], tf.int32)] + [
            tf.TensorSpec(t.shape, t.dtype) for t in stacked
        ]
        # The step's results (logs, or predictions): their structure, dtypes and shapes give
        # the loop its initial state, so that the program holds the step once, in the loop
        # body. Found by tracing one step in a scratch graph (not lowered, not compiled).
        def scratch_step(*flat: Any) -> Any:
            if replicas > 1:
                rid[:] = [tf.constant(0)]
            return one_step(flat, 0)

        with strategy.lowering(replicas), feeds.scratch_trace():
            scratch = tf.function(scratch_step).get_concrete_function(*specs[1:])
        # tf.summary calls in the step (traced under a default writer): an error naming them.
        refuse_summaries(scratch.graph, f"{getattr(model, 'name', 'model')}/{kind}_function")
        out_spec = scratch.structured_outputs
        flat_spec = tf.nest.flatten(out_spec)

        def device_loop(n_steps: tf.Tensor, *flat_stacked: tf.Tensor) -> Any:
            with strategy.lowering(replicas):
                if replicas > 1:
                    from tf_ipu.strategy import replica_id

                    # Its index among this instance's replicas (the id is global in a
                    # program of several instances: instance x replicas + local index).
                    rid[:] = [tf.math.floormod(replica_id(), replicas)]
                if n == 1:
                    # One step a call: no loop (n_steps is always 1). Variable updates are
                    # then at the program's top level, where the device writes them into
                    # the variables' buffers (donation, docs/architecture.md).
                    out = one_step(flat_stacked, 0)
                    if kind == "predict":
                        return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), out)
                    return out
                if kind == "predict":
                    tas = [
                        tf.TensorArray(t.dtype, size=n, element_shape=t.shape) for t in flat_spec
                    ]

                    def body(i: Any, *tas: Any) -> Any:
                        outs = tf.nest.flatten(one_step(flat_stacked, i))
                        return (i + 1, *[ta.write(i, o) for ta, o in zip(tas, outs, strict=True)])

                    _, *tas = tf.while_loop(
                        lambda i, *_: tf.less(i, n_steps), body, (tf.constant(0), *tas),
                        name=DEVICE_LOOP_NAME,
                    )
                    return tf.nest.pack_sequence_as(out_spec, [ta.stack() for ta in tas])

                def body(i: Any, *logs: Any) -> Any:
                    outs = tf.nest.flatten(one_step(flat_stacked, i))
                    return (i + 1, *[tf.cast(o, t.dtype) for o, t in zip(outs, flat_spec, strict=True)])

                initial = [tf.zeros(t.shape, t.dtype) for t in flat_spec]
                _, *final = tf.while_loop(
                    lambda i, *_: tf.less(i, n_steps), body, (tf.constant(0), *initial),
                    name=DEVICE_LOOP_NAME,
                )
                return tf.nest.pack_sequence_as(out_spec, final)

        model_name = getattr(model, "name", "model")
        shown = (f"steps={n}" + (f", replicas={replicas}" if replicas > 1 else "")
                 + (f", stages={self.pipeline['stages']}" if self.pipeline else ""))
        return _compiled(device_loop, specs, f"{model_name}/{kind}_function[{shown}]", replicas,
                         model, self.pipeline)

