"""The checks of an export's arguments and the signatures of its steps (``tf_ipu.serving``).

    export_dir, purge_export_dir      -> _check_export_dir (a new or purged folder)
    *_signature, output_names, batch  -> _check_signature / _check_output_names / _batch_size
    predict_step, pre/postprocessing  -> _step_signatures: the exported signature and the
                                         device step's, from the given signatures, a dataset's
                                         element spec, or the functions' own
    values across a step boundary     -> _match (count, dtype and shape, named in the error)

Every error is a ValueError (or TypeError) that names the export function and the argument.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

Signature = Sequence[tf.TensorSpec]


def _check_export_dir(export_dir: Any, purge_export_dir: bool, what: str) -> str:
    """``export_dir`` as a path; an existing non-empty directory is an error unless
    ``purge_export_dir`` (``_export`` empties it once the serving function is traced)."""
    try:
        path = os.fspath(export_dir)
    except TypeError:
        raise TypeError(f"{what}: export_dir must be a path (str or os.PathLike). "
                        f"Received: export_dir={export_dir!r}") from None
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what}: export_dir must be a non-empty path. "
                         f"Received: export_dir={export_dir!r}")
    if not isinstance(purge_export_dir, bool):
        raise TypeError(f"{what}: purge_export_dir must be a bool. "
                        f"Received: purge_export_dir={purge_export_dir!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what}: export_dir {path!r} is a file, not a directory.")
    if os.path.isdir(path) and os.listdir(path) and not purge_export_dir:
        raise ValueError(f"{what}: directory {path!r} is not empty. Give an empty or new "
                         f"directory, or purge_export_dir=True to empty it first.")
    return path


def _check_signature(signature: Any, name: str, what: str) -> list[tf.TensorSpec] | None:
    """A step's signature argument: None, or a non-empty tuple/list of TensorSpecs."""
    if signature is None:
        return None
    if not isinstance(signature, (tuple, list)):
        raise TypeError(f"{what}: {name} must be a tuple or list of tf.TensorSpec. "
                        f"Received: {name}={signature!r}")
    if not signature:
        raise ValueError(f"{what}: {name} must not be empty. Received: {name}={signature!r}")
    for i, spec in enumerate(signature):
        if not isinstance(spec, tf.TensorSpec):
            raise TypeError(f"{what}: {name}[{i}] must be a tf.TensorSpec. "
                            f"Received: {spec!r}")
    return list(signature)


def _check_callable(fn: Any, name: str, what: str) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{what}: {name} must be a function (or a tf.function). "
                        f"Received: {name}={fn!r}")


def _check_output_names(output_names: Any, what: str) -> list[str] | None:
    if output_names is None:
        return None
    if isinstance(output_names, str):
        output_names = [output_names]
    if not isinstance(output_names, (list, tuple)) or not all(
            isinstance(n, str) and n for n in output_names):
        raise TypeError(f"{what}: output_names must be a string or a list of non-empty "
                        f"strings. Received: output_names={output_names!r}")
    if len(set(output_names)) != len(output_names):
        raise ValueError(f"{what}: output_names must be distinct. "
                         f"Received: output_names={list(output_names)!r}")
    return list(output_names)


def _batch_size(batch_size: Any, what: str) -> int | None:
    """Graphcore's ``batch_size``: an int, or an integer scalar tensor/array, > 0."""
    if batch_size is None:
        return None
    value = batch_size
    if tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.shape == () and np.issubdtype(array.dtype, np.integer):
            value = int(array)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what}: batch_size must be a positive int. "
                         f"Received: batch_size={batch_size!r}")
    return value


def _step_signature(fn: Callable[..., Any],
                    given: list[tf.TensorSpec] | None) -> list[tf.TensorSpec] | None:
    """The signature given for a step, or its tf.function's ``input_signature``."""
    if given is not None:
        return given
    declared = getattr(fn, "input_signature", None)
    if declared is None:
        return None
    return list(declared)


def _arg_names(fn: Callable[..., Any], count: int) -> list[str] | None:
    """The names of ``fn``'s first ``count`` positional parameters, if it has that many
    (Graphcore names the SavedModel's inputs after them)."""
    target = getattr(fn, "python_function", fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    if len(names) < count:
        return None
    return names[:count]


def _named(specs: Sequence[tf.TensorSpec], names: Sequence[str] | None) -> list[tf.TensorSpec]:
    """``specs`` renamed (distinct names, so that each is one input of the signature)."""
    chosen = list(names) if names is not None else [s.name for s in specs]
    if any(not n for n in chosen) or len(set(chosen)) != len(chosen):
        chosen = [f"input_{i}" for i in range(len(specs))]
    return [tf.TensorSpec(s.shape, s.dtype, name=n) for s, n in zip(specs, chosen, strict=True)]


def _unnamed(specs: Sequence[tf.TensorSpec]) -> list[tf.TensorSpec]:
    return [tf.TensorSpec(s.shape, s.dtype) for s in specs]


def _fully_defined(specs: Sequence[tf.TensorSpec], what: str, where: str) -> None:
    for i, s in enumerate(specs):
        if not s.shape.is_fully_defined():
            raise ValueError(
                f"{what}: {where} input {i} ({s.name or 'unnamed'}) has shape {s.shape}; an "
                f"exported program has static shapes. Give every dimension (the batch size: "
                f"batch_size=..., or the model's Input(batch_size=...)).")


def _match(values: Sequence[Any], specs: Sequence[tf.TensorSpec], source: str, target: str,
           what: str) -> list[tf.Tensor]:
    """``values`` (what ``source`` returned) checked against ``target``'s signature; shapes
    that are only compatible are pinned to the signature's."""
    if len(values) != len(specs):
        raise ValueError(f"{what}: {source} returns {len(values)} tensors, but {target} "
                         f"takes {len(specs)} ({list(specs)}).")
    out = []
    for i, (value, spec) in enumerate(zip(values, specs, strict=True)):
        if not tf.is_tensor(value):
            raise ValueError(f"{what}: {source} returns {value!r} at position {i}, not a "
                             f"tensor.")
        if value.dtype != spec.dtype or not value.shape.is_compatible_with(spec.shape):
            raise ValueError(
                f"{what}: {source} returns a tensor of shape {value.shape} and dtype "
                f"{value.dtype.name} at position {i}, but {target} takes shape "
                f"{spec.shape} and dtype {spec.dtype.name} there.")
        if not value.shape.is_fully_defined():
            value = tf.ensure_shape(value, spec.shape)
        out.append(value)
    return out


def _as_function(fn: Callable[..., Any], signature: list[tf.TensorSpec] | None) -> Any:
    """``fn`` as a tf.function (a host step traced once into the serving function)."""
    if isinstance(fn, tf.types.experimental.PolymorphicFunction):
        return fn
    return tf.function(fn, input_signature=signature)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _dataset_signature(input_dataset: Any, what: str) -> list[tf.TensorSpec] | None:
    """The specs of ``input_dataset``'s elements (None without a dataset)."""
    if input_dataset is None:
        return None
    if not isinstance(input_dataset, tf.data.Dataset):
        raise TypeError(f"{what}: input_dataset must be a tf.data.Dataset. "
                        f"Received: input_dataset={input_dataset!r}")
    specs = list(tf.nest.flatten(input_dataset.element_spec))
    for i, s in enumerate(specs):
        if not isinstance(s, tf.TensorSpec):
            raise TypeError(f"{what}: input_dataset's element {i} is {s!r}, not a "
                            f"tensor: only datasets of tensors give an input signature.")
    return specs


def _positional_count(fn: Callable[..., Any]) -> tuple[int, int] | None:
    """How many positional arguments ``fn`` needs and takes at most (None: any number, or
    not known)."""
    target = getattr(fn, "python_function", fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in kinds]
    return sum(p.default is inspect.Parameter.empty for p in positional), len(positional)


def _declared(fn: Callable[..., Any], skip: int) -> list[tf.TensorSpec] | None:
    """``fn``'s tf.function ``input_signature`` without its first ``skip`` specs (arguments
    given otherwise: ``export_pipeline``'s ``inputs``), if it declares one."""
    declared = _step_signature(fn, None)
    if declared is None:
        return None
    return declared[skip:] if len(declared) > skip else declared


def _step_signatures(what: str, device_fn: Callable[..., Any], label: str,
                     device_given: list[tf.TensorSpec] | None,
                     dataset_sig: list[tf.TensorSpec] | None,
                     preprocessing_step: Callable[..., Any] | None,
                     pre_given: list[tf.TensorSpec] | None,
                     skip: int = 0) -> tuple[list[tf.TensorSpec], list[tf.TensorSpec]]:
    """The exported function's input signature (named) and the device function's, from
    what was given (Graphcore's rules): without a preprocessing step the device function's
    signature, the dataset's, or its tf.function's; with one, the preprocessing step's (given,
    the dataset's, or its tf.function's) and the device function's (given, its tf.function's,
    or what the preprocessing step returns). ``skip``: the device function's first arguments
    that are not fed (``export_pipeline``'s ``inputs``): the names are those after them."""
    if preprocessing_step is None:
        if device_given is not None and dataset_sig is not None:
            raise ValueError(f"{what}: give predict_step_signature or input_dataset, not "
                             f"both (each gives {label}'s inputs).")
        device_sig = device_given or dataset_sig or _declared(device_fn, skip)
        if device_sig is None:
            raise ValueError(
                f"{what}: the inputs of {label} {_fn_name(device_fn)} are not known: "
                f"make it a tf.function with an input_signature, or pass "
                f"predict_step_signature or input_dataset.")
        names = _arg_names(device_fn, skip + len(device_sig))
        input_signature = _named(device_sig, names[skip:] if names is not None else None)
        return input_signature, list(device_sig)
    if pre_given is not None and dataset_sig is not None:
        raise ValueError(f"{what}: give preprocessing_step_signature or input_dataset, "
                         f"not both (each gives preprocessing_step's inputs).")
    pre_specs = pre_given or dataset_sig or _step_signature(preprocessing_step, None)
    if pre_specs is None:
        raise ValueError(
            f"{what}: the inputs of preprocessing_step {_fn_name(preprocessing_step)} "
            f"are not known: make it a tf.function with an input_signature, or pass "
            f"preprocessing_step_signature or input_dataset.")
    input_signature = _named(pre_specs, _arg_names(preprocessing_step, len(pre_specs)))
    device_sig = device_given or _declared(device_fn, skip)
    if device_sig is None:  # what the preprocessing step returns
        traced = _as_function(preprocessing_step, input_signature)
        returned = tf.nest.flatten(traced.get_concrete_function(
            *_unnamed(input_signature)).structured_outputs)
        device_sig = [tf.TensorSpec(t.shape, t.dtype) for t in returned]
    return input_signature, list(device_sig)


def _fn_name(fn: Any) -> str:
    return repr(getattr(fn, "__name__", None) or type(fn).__name__)
