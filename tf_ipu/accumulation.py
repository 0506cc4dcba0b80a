"""Gradient accumulation of Keras models: Graphcore's ``model.set_gradient_accumulation_options``.

    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4,
                                            gradient_accumulation_reduction_method="mean")
    step 1..3: gradients g_i  -> the optimizer's accumulators (no weight update)
    step 4:    one update with  sum(g_1..g_4)   ("sum", Graphcore's default)
                                mean(g_1..g_4)  ("mean"; "running_mean" is the same value)
    effective batch = batch x accumulation steps x replicas

The accumulation is Keras's own (``optimizer.gradient_accumulation_steps``: accumulators are
optimizer variables, the update is a conditional of the step), so it runs inside the device
loop as any other train step, on the IPU and on the CPU alike; "sum" scales the gradients by
the accumulation count before they reach it (Keras averages); a sparse gradient (the
``tf.IndexedSlices`` of an ``Embedding`` or a gather) has its values scaled and stays sparse,
and Keras adds it into its dense accumulator. Graphcore's rules are checked
when ``fit`` makes its train function: ``steps_per_execution`` is a multiple of the
accumulation count, and so is each device call's number of steps (the steps of an epoch).
"""

from __future__ import annotations

import logging
from typing import Any

from tf_ipu import notices

REDUCTIONS = ("sum", "mean", "running_mean")
_OPTIONS_ATTR = "_tf_ipu_gradient_accumulation"
_APPLY_ATTR = "_tf_ipu_apply_before_accumulation"
_log = logging.getLogger("tf_ipu")


def _method_name(method: Any) -> str:
    name = getattr(method, "name", method)  # an enum member (Graphcore's) or a string
    name = str(name).lower()
    if name not in REDUCTIONS:
        raise ValueError(
            f"gradient_accumulation_reduction_method must be one of "
            f"{', '.join(map(repr, REDUCTIONS))}. Received: {method!r}"
        )
    return name


def set_gradient_accumulation_options(
    self: Any,
    gradient_accumulation_steps_per_replica: int | None = None,
    gradient_accumulation_reduction_method: Any = "sum",
    use_v2_gradient_accumulation_optimizer: bool = False,
    **gradient_accumulation_optimizer_kwargs: Any,
) -> None:
    """Graphcore's ``model.set_gradient_accumulation_options`` (see the module docstring):
    each replica accumulates the gradients of ``gradient_accumulation_steps_per_replica``
    steps, then the weights are updated once. None or 1: no accumulation. The other
    arguments of Graphcore's optimizer wrapper are accepted and named once in a warning."""
    steps = gradient_accumulation_steps_per_replica
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(
            f"set_gradient_accumulation_options: gradient_accumulation_steps_per_replica must "
            f"be an int >= 1 (or None). Received: {steps!r}"
        )
    method = _method_name(gradient_accumulation_reduction_method)
    if use_v2_gradient_accumulation_optimizer:
        notices.once("set_gradient_accumulation_options(use_v2_gradient_accumulation_optimizer"
                     "=True)", "has no effect here: Keras's own accumulation is used.")
    for name, value in gradient_accumulation_optimizer_kwargs.items():
        notices.once(f"set_gradient_accumulation_options({name}={value!r})",
                     "has no effect here: Keras's own accumulation is used.")
    setattr(self, _OPTIONS_ATTR, (steps or 1, method))
    train_function = getattr(self, "train_function", None)
    if train_function is not None:
        self.train_function = None  # made again, with the new options, by the next fit


def options(model: Any) -> tuple[int, str]:
    """``(accumulation steps per replica, reduction method)`` of ``model``; (1, "sum") unset."""
    return getattr(model, _OPTIONS_ATTR, (1, "sum"))


def check_steps(model: Any, steps_per_execution: int) -> None:
    """Graphcore's rule, with the fix in the message: ``steps_per_execution`` is a multiple
    of the accumulation count."""
    steps, _ = options(model)
    if steps > 1 and steps_per_execution % steps:
        lower = steps_per_execution // steps * steps
        fixes = [str(m) for m in (lower, lower + steps) if m > 0]
        divisors = [str(d) for d in range(1, steps_per_execution + 1) if steps_per_execution % d == 0]
        raise ValueError(
            f"{model.name}: steps_per_execution ({steps_per_execution}) must be a multiple of "
            f"gradient_accumulation_steps_per_replica ({steps}), so that every device call "
            f"ends on a weight update: compile with steps_per_execution="
            f"{' or '.join(fixes)}, or set gradient_accumulation_steps_per_replica to one of "
            f"{', '.join(divisors)}."
        )


def check_call(model: Any, steps_in_call: int, steps_per_execution: int) -> None:
    """A device call of ``steps_in_call`` steps (an epoch's last may run fewer than
    ``steps_per_execution``) must end on a weight update too."""
    steps, _ = options(model)
    if steps > 1 and steps_in_call % steps:
        raise ValueError(
            f"{model.name}: this device call has {steps_in_call} steps (the rest of an epoch "
            f"after its full calls of {steps_per_execution}), not a multiple of "
            f"gradient_accumulation_steps_per_replica ({steps}), so its last gradients would "
            f"be accumulated and never applied: make the steps of an epoch (samples / batch "
            f"size, or steps_per_epoch) a multiple of {steps}."
        )


def prepare(model: Any) -> None:
    """Configures ``model``'s optimizer for its accumulation options (Keras's
    ``gradient_accumulation_steps``, its accumulators, and the scaling for "sum"). Called
    when ``fit`` makes its train function."""
    if not hasattr(model, _OPTIONS_ATTR):  # never set: Keras's own options stand
        return
    steps, method = options(model)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    wanted = steps if steps > 1 else None
    if inner.gradient_accumulation_steps != wanted:
        inner.gradient_accumulation_steps = wanted
        if wanted and inner.built and not getattr(inner, "_accumulated_gradients", None):
            with model.distribute_strategy.scope():
                inner._accumulated_gradients = [
                    inner.add_variable_from_reference(v, name="gradient_accumulator")
                    for v in inner._trainable_variables
                ]
    # "sum": the accumulating optimizer (the inner one of a loss-scaling wrapper, after it
    # unscaled and counted the gradients) gets them times the count; Keras then averages.
    original = getattr(inner, _APPLY_ATTR, None)
    if original is not None:  # undo an earlier "sum" scaling
        object.__setattr__(inner, "apply", original)
        object.__delattr__(inner, _APPLY_ATTR)
    if wanted and method == "sum":
        unscaled = inner.apply

        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            return unscaled([_scaled(g, wanted) for g in grads], trainable_variables)

        object.__setattr__(inner, _APPLY_ATTR, unscaled)
        object.__setattr__(inner, "apply", apply)


def _scaled(gradient: Any, factor: int) -> Any:
    """``gradient`` times ``factor``, keeping its kind: a dense tensor, ``None`` (no gradient),
    or a sparse ``tf.IndexedSlices`` (an ``Embedding``'s, a gather's), whose values are scaled
    and whose rows stay as they are (Keras accumulates and applies it sparse or dense as it
    does without tf_ipu)."""
    if gradient is None:
        return None
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


def log_effective_batch(model: Any, batch_size: int, replicas: int = 1) -> str:
    """Logs (at INFO, once per model and figures) and returns the effective batch: batch x
    accumulation steps x replicas."""
    steps, method = options(model)
    said = (f"{model.name}: effective batch {batch_size * steps * replicas} = batch "
            f"{batch_size} x gradient accumulation {steps} ({method}) x replicas {replicas}")
    if getattr(model, "_tf_ipu_effective_batch", None) != said:
        object.__setattr__(model, "_tf_ipu_effective_batch", said)
        _log.info("tf_ipu: %s", said)
    return said


__all__ = ["REDUCTIONS", "check_call", "check_steps", "log_effective_batch", "options", "prepare",
           "set_gradient_accumulation_options"]
