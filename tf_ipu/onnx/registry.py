"""The table of ONNX operators the importer maps: op_type -> handler, attributes it reads,
the opsets it covers. Handlers live in ``ops_*.py``; ``docs/onnx.md`` lists the same table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OpDef:
    op_type: str
    fn: Callable[[Any], list[Any]]
    attrs: frozenset[str]
    since: int = 1        # the oldest opset of the operator the handler maps


OPS: dict[str, OpDef] = {}


def register(*op_types: str, attrs: tuple[str, ...] = (), since: int = 1) -> Callable:
    """Registers ``fn(ctx) -> outputs`` for ``op_types``, reading attributes ``attrs``
    (any other attribute on a node is refused at load)."""

    def deco(fn: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
        for op_type in op_types:
            OPS[op_type] = OpDef(op_type, fn, frozenset(attrs), since)
        return fn

    return deco
