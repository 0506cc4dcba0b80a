"""When ``import tf_ipu`` does its TensorFlow set-up: at once if TensorFlow is loaded, else
as soon as it is.

    import tf_ipu ──(tensorflow in sys.modules?)── yes ──> set_up() now
                   └─ no ──> TensorFlowWatch on sys.meta_path
                               import tensorflow / keras / tf_ipu.<TF-facing module>
                                 └─ the outermost of these imports ends ──> set_up()
                   tf_ipu.IPUStrategy, tf_ipu.IPUConfig, ... (first access) ──> set_up()

``set_up`` is what ``import tf_ipu`` always did (the op library's handler, Graphcore's import
paths). Running it in the middle of an import that it needs itself (``tf_ipu.strategy``
importing TensorFlow, Keras importing TensorFlow) would meet half-initialised modules, so
the watch counts the imports it wraps and runs ``set_up`` when the outermost one has ended.
``import tf_ipu.onnx`` never imports TensorFlow, so it never triggers it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: Top-level packages whose import the watch wraps (besides tf_ipu's own modules).
_WATCHED = frozenset({"tensorflow", "keras"})
#: tf_ipu modules that never import TensorFlow (their import is not waited for).
_TF_FREE_PREFIXES = ("tf_ipu.onnx", "tf_ipu.errors", "tf_ipu._lazy_start")


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then tells the watch the import has ended."""

    def __init__(self, real: importlib.abc.Loader, watch: TensorFlowWatch) -> None:
        self.real = real
        self.watch = watch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.watch.depth += 1
        try:
            self.real.exec_module(module)
        finally:
            self.watch.depth -= 1
        self.watch.import_ended()

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ...
        return getattr(self.real, name)


class TensorFlowWatch(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: it wraps the loaders of TensorFlow, Keras and
    tf_ipu's TF-facing modules, and calls ``set_up`` once TensorFlow is loaded and the
    outermost wrapped import has ended."""

    def __init__(self, set_up: Callable[[], None]) -> None:
        self.set_up = set_up
        self.depth = 0
        self._finding = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        watched = fullname in _WATCHED or (
            top == "tf_ipu" and "." in fullname and not fullname.startswith(_TF_FREE_PREFIXES))
        if not watched or getattr(self._finding, "active", False):
            return None
        self._finding.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding.active = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self)
        return spec

    def import_ended(self) -> None:
        if self.depth == 0 and "tensorflow" in sys.modules:
            self.remove()
            self.set_up()

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)
