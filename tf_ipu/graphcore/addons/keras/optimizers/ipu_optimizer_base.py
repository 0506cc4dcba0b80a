"""``ipu_tensorflow_addons.keras.optimizers.IpuOptimizerBase``: what Graphcore's IPU optimizers
share, on a Keras 3 optimizer.

    IpuOptimizerBase(keras.optimizers.Optimizer)
      optimizer_compute_precisions  dtypes the stages of the update compute in (Adam, SGD: 1
                                    stage; LAMB: 2, the second for lr x trust ratio x update)
      get_slot_dtype(var, slot)     a slot's dtype (the subclass's m_dtype, v_dtype, ...; None:
                                    the variable's), used by add_slot / add_slot_with_dtype
      get_slot(var, slot)           the slot variable, as Keras 2's optimizers had it
      lr=..., decay=...             Keras 2's arguments: learning_rate, and inverse time decay
                                    lr / (1 + decay x iterations) (a Keras 3 schedule)
      outline_apply_gradients(_kwargs)  accepted and kept in the config; no effect (the
                                    emulator has no outlined functions: named once)

An update reads each slot, casts it to the compute dtype, computes there and casts the new
state back to the slot's dtype; the variable gets the update cast to its own dtype. Every step
is TensorFlow ops only, so it lowers to the device program under ``IPUStrategy``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_ipu import notices

DTypeLike = Any


def register(cls: type) -> type:
    """Registers an optimizer class for Keras serialization as ``ipu_tensorflow_addons>Name``
    (so a ``.keras`` file holding it loads without ``custom_objects``)."""
    return keras.saving.register_keras_serializable(package="ipu_tensorflow_addons")(cls)


def as_dtype(dtype: DTypeLike) -> tf.DType | None:
    """``dtype`` (a name such as "float16", a TF or NumPy dtype) as a TF dtype; None stays
    None."""
    if dtype is None:
        return None
    return tf.as_dtype(dtype)


def dtype_name(dtype: DTypeLike) -> str | None:
    d = as_dtype(dtype)
    return None if d is None else d.name


def value_of(hyper: Any) -> Any:
    """A hyperparameter that may be a callable (as Keras allows), called."""
    return hyper() if callable(hyper) else hyper


def legacy_arguments(kwargs: dict[str, Any], learning_rate: Any) -> Any:
    """Keras 2's ``lr`` (for ``learning_rate``) and ``decay`` (inverse time decay per
    iteration), which Graphcore's optimizers accepted, taken out of ``kwargs``: the learning
    rate to give Keras 3 (a float or a schedule)."""
    if "lr" in kwargs:
        learning_rate = kwargs.pop("lr")
    decay = kwargs.pop("decay", None)
    if decay:
        if not isinstance(learning_rate, (int, float)):
            raise ValueError(f"decay={decay!r} (Keras 2's inverse time decay) needs a float "
                             f"learning rate, not {learning_rate!r}: give a "
                             f"keras.optimizers.schedules.InverseTimeDecay instead.")
        learning_rate = keras.optimizers.schedules.InverseTimeDecay(
            float(learning_rate), decay_steps=1, decay_rate=float(decay))
    if isinstance(learning_rate, int) and not isinstance(learning_rate, bool):
        learning_rate = float(learning_rate)
    return learning_rate


@register
class IpuOptimizerBase(keras.optimizers.Optimizer):
    """Base class of the IPU optimizers (``AdamIpuOptimizer``, ``LAMBIpuOptimizer``,
    ``SGDIpuOptimizer``): compute precisions and slots of their own dtypes. Not used
    directly; a subclass implements ``build`` and ``update_step`` as any Keras 3 optimizer.

    Args:
        name: the optimizer's name.
        optimizer_compute_precisions: dtypes of the stages of the update's computation.
        outline_apply_gradients, outline_apply_gradients_kwargs: Graphcore's outlining of
            the update (a memory saving on the IPU); accepted, no effect here.
        **kwargs: Keras 3's optimizer arguments (``learning_rate``, ``clipnorm``, ...), and
            Keras 2's ``lr`` and ``decay``.
    """

    def __init__(self, name: str | None = None,
                 optimizer_compute_precisions: tuple[DTypeLike, ...] = (tf.float32,),
                 outline_apply_gradients: bool = False,
                 outline_apply_gradients_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        kwargs["learning_rate"] = legacy_arguments(kwargs, kwargs.get("learning_rate", 0.001))
        super().__init__(name=name, **kwargs)
        precisions = optimizer_compute_precisions
        if not isinstance(precisions, (list, tuple)):
            precisions = (precisions,)
        self.opt_dtypes = tuple(as_dtype(d) for d in precisions)
        if not self.opt_dtypes or any(not d.is_floating for d in self.opt_dtypes):
            raise ValueError(f"optimizer_compute_precisions must be floating dtypes; got "
                             f"{optimizer_compute_precisions!r}")
        self.outline_apply_gradients = bool(outline_apply_gradients)
        self.outline_apply_gradients_kwargs = dict(outline_apply_gradients_kwargs or {})
        if self.outline_apply_gradients:
            notices.once(f"{type(self).__name__}(outline_apply_gradients=True)",
                         "has no effect: the update is computed where it stands (the "
                         "emulator has no outlined functions); the values are the same.")
        # A plain dict, kept from Keras's and TF's attribute tracking (its keys are not names;
        # the slots are tracked as Keras optimizer variables by add_variable).
        object.__setattr__(self, "_slots_by_var", {})

    @property
    def optimizer_compute_precisions(self) -> tuple[tf.DType, ...]:
        """The compute dtypes, as TF dtypes."""
        return self.opt_dtypes

    def compute_dtype(self, stage: int = 0) -> tf.DType:
        """The dtype of stage ``stage`` of the update."""
        return self.opt_dtypes[stage]

    def adam_moments(self, gradient: Any, m: Any, v: Any, c: tf.DType) -> tuple[Any, Any, Any, Any]:
        """Adam's and LAMB's moments in dtype ``c``: the next m and v (to store) and the ones
        the update reads (bias-corrected unless ``debiasing`` is off)."""
        g = tf.cast(tf.convert_to_tensor(gradient), c)
        b1 = tf.cast(value_of(self.beta_1), c)
        b2 = tf.cast(value_of(self.beta_2), c)
        next_m = tf.cast(m, c) * b1 + g * (1.0 - b1)
        next_v = tf.cast(v, c) * b2 + tf.square(g) * (1.0 - b2)
        if not self.debiasing:
            return next_m, next_v, next_m, next_v
        t = tf.cast(self.iterations + 1, c)
        return next_m, next_v, next_m / (1.0 - tf.pow(b1, t)), next_v / (1.0 - tf.pow(b2, t))

    def get_slot_dtype(self, var: Any, slot_name: str) -> tf.DType | None:
        """The dtype of ``var``'s slot ``slot_name`` (None: the variable's); subclasses answer
        their ``m_dtype``, ``v_dtype``, ..."""
        return None

    def add_slot(self, var: Any, slot_name: str, initializer: Any = "zeros",
                 shape: Any = None, dtype: DTypeLike = None) -> Any:
        """A new optimizer variable for ``var`` (its shape unless ``shape``; ``dtype``, else
        ``get_slot_dtype``, else the variable's), or the one made before."""
        key = (self._var_key(var), slot_name)
        if key in self._slots_by_var:
            return self._slots_by_var[key]
        dtype = as_dtype(dtype) or as_dtype(self.get_slot_dtype(var, slot_name)) or \
            as_dtype(var.dtype)
        where = getattr(var, "path", None) or str(var.name).split(":")[0]
        slot = self.add_variable(shape=tuple(var.shape if shape is None else shape),
                                 initializer=initializer, dtype=dtype.name,
                                 name=f"{where.replace('/', '_')}_{slot_name}")
        self._slots_by_var[key] = slot
        return slot

    def add_slot_with_dtype(self, var: Any, slot_name: str, dtype: DTypeLike,
                            initializer: Any = "zeros") -> Any:
        """``add_slot`` with ``dtype`` given (Graphcore's spelling)."""
        return self.add_slot(var, slot_name, initializer=initializer, dtype=dtype)

    def get_slot(self, var: Any, slot_name: str) -> Any:
        """``var``'s slot ``slot_name`` (KeyError if the optimizer has not made it)."""
        return self._slots_by_var[(self._var_key(var), slot_name)]

    def get_config(self) -> dict[str, Any]:
        """Keras's config plus the compute precisions (dtype names) and outlining options."""
        config = super().get_config()
        config.update({
            "optimizer_compute_precisions": [d.name for d in self.opt_dtypes],
            "outline_apply_gradients": self.outline_apply_gradients,
            "outline_apply_gradients_kwargs": dict(self.outline_apply_gradients_kwargs),
        })
        return config


__all__ = ["IpuOptimizerBase"]
