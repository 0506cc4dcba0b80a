"""Fault injection, a test switch (``CompileOptions.fault_inject_opcode``).

    kernel fn --_faulty--> run(ops) = _perturb(fn(ops))
                           floats x * 1.01 + 1e-3,  integers x + 1,  booleans not x

so a test can prove that a comparison would catch a wrong kernel. Never on in production.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def _perturb(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_perturb(v) for v in value)
    a = np.asarray(value)
    if a.dtype == np.bool_:
        return np.logical_not(a)
    if a.dtype.kind in "iu":
        return (a + np.ones((), a.dtype)).astype(a.dtype)
    if a.dtype.kind in "fcV" or a.dtype.name == "bfloat16":
        return (a * a.dtype.type(1.01) + a.dtype.type(1e-3)).astype(a.dtype)
    return a


def _faulty(fn: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
    def run(ops: Sequence[Any]) -> Any:
        return _perturb(fn(ops))

    return run
