"""Pipeline stages: which Keras layer call is in which stage (Graphcore's Keras API).

    with keras.ipu.PipelineStage(s): ...         a layer built, or a layer call made, in stage s
    model.set_pipeline_stage_assignment(...)     per layer (Sequential) or per call, with
    model.get_pipeline_stage_assignment()        Graphcore's assignment classes; nested models
                                                 have their own assignments inside
    subclassed models: the calls their call() made in its latest run (_Trace), each with the
                       scope entered around it in that call()
      --> stages_of(model): {path of a layer call: stage}, read by tf_ipu.pipelining's plan

The options, the plan and the tagging of ops while a program is lowered are in
``tf_ipu.pipelining``, which re-exports these names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

#: The name scope that tags a stage's ops; the IR takes the innermost one of an op's name.
STAGE_SCOPE = "tf_ipu_stage_"
_ASSIGNMENT_ATTR = "_tf_ipu_stage_assignment"   # model -> {(layer id, call index): stage}
_OPTIONS_ATTR = "_tf_ipu_pipelining_options"
_LAYER_STAGE_ATTR = "_tf_ipu_pipeline_stage"      # a layer built in a PipelineStage scope
_NODE_STAGES_ATTR = "_tf_ipu_node_stages"         # a layer's calls made in a scope: {node: stage}
_TRACE_ATTR = "_tf_ipu_traced_calls"              # a subclassed model: its call()'s layer calls
_RESET_ATTR = "_tf_ipu_pipeline_reset"            # reset_pipeline_stage_assignment: not pipelined

_state = threading.local()


class PipelineStage:
    """Assigns the Keras layers created, and the layer calls made, in its scope to pipeline
    stage ``stage`` (a call's stage overrides its layer's). Not nested; only under
    ``IPUStrategy``. Inside a subclassed model's ``call()`` it assigns the layer calls that
    ``call()`` makes in it (a nested model called in it: all its layers), read from a run of
    ``call()`` (``_Trace``), and tags the ops it traces. Entered inside the ``call()`` of a
    layer that is not a model, it is refused (at ``set_pipelining_options`` or the first
    ``fit``): that layer's weights are in one stage.

    Example:
        >>> with strategy.scope():                                     # doctest: +SKIP
        ...     with keras.ipu.PipelineStage(0):
        ...         x = keras.layers.Dense(4)(inputs)
    """

    def __init__(self, stage: int) -> None:
        self._stage = stage
        self._scope: Any = None

    def __enter__(self) -> PipelineStage:
        from tf_ipu.strategy import IPUStrategy

        if not isinstance(self._stage, int) or isinstance(self._stage, bool) or self._stage < 0:
            raise ValueError(f"PipelineStage: {self._stage!r} is not a valid pipeline stage "
                             f"(an int >= 0).")
        if not isinstance(tf.distribute.get_strategy(), IPUStrategy):
            raise RuntimeError("PipelineStage may only be used from within an IPUStrategy "
                               "scope (with strategy.scope(): ...).")
        if getattr(_state, "stage", None) is not None:
            raise RuntimeError(f"Pipeline stages must not be nested: PipelineStage("
                               f"{self._stage}) inside PipelineStage({_state.stage}).")
        _state.stage = self._stage
        # The model call whose layer calls this scope assigns (see _Frame), if one is running.
        frames = getattr(_state, "frames", None)
        top = frames[-1] if frames else None
        _state.scope_frame = top
        if top is not None and top.leaf is not None:
            leaf = top.leaf
            top.problems.append(
                f"PipelineStage({self._stage}) is entered inside the call of layer "
                f"{leaf.name!r} ({type(leaf).__name__}, not a keras.Model), whose weights "
                f"are all in the stage of its call: put the scope around the call of "
                f"{leaf.name!r} in {top.model.name}'s call(), or make {type(leaf).__name__} a "
                f"keras.Model (its own layer calls are then pipeline calls)")
        if tf.inside_function():  # a subclassed model's call being traced: tag its ops
            self._scope = tf.name_scope(f"{STAGE_SCOPE}{self._stage}")
            self._scope.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._scope is not None:
            self._scope.__exit__(*exc)
            self._scope = None
        _state.stage = None
        _state.scope_frame = None


def current_stage() -> int | None:
    """The stage of the PipelineStage scope open on this thread, or None."""
    return getattr(_state, "stage", None)


# -- assignments (Graphcore's classes) ---------------------------------------------------------


class SequentialLayerPipelineStageAssignment:
    """The pipeline stage of one layer of a ``Sequential`` model (None: unassigned)."""

    def __init__(self, layer: Any, pipeline_stage: int | None = None) -> None:
        self._layer = layer
        self.pipeline_stage = pipeline_stage

    @property
    def layer(self) -> Any:
        return self._layer

    @property
    def is_nested_model(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"Layer: {self.layer.name} is assigned to pipeline stage: {self.pipeline_stage}"


class ModelLayerPipelineStageAssignment:
    """The pipeline stage of one call (``node_index``: the layer's n-th call in the model) of a
    layer of a functional or subclassed model (None: unassigned)."""

    def __init__(self, layer: Any, node_index: int, pipeline_stage: int | None = None) -> None:
        self._layer = layer
        self._node_index = node_index
        self.pipeline_stage = pipeline_stage

    @property
    def layer(self) -> Any:
        return self._layer

    @property
    def node_index(self) -> int:
        return self._node_index

    @property
    def inbound_layers(self) -> list[Any]:
        """The layers whose outputs this call takes (to tell a layer's calls apart)."""
        nodes = getattr(self._layer, "_inbound_nodes", [])
        if self._node_index >= len(nodes):
            return []
        return [n.operation for n in getattr(nodes[self._node_index], "parent_nodes", [])]

    @property
    def is_nested_model(self) -> bool:
        return False

    def __str__(self) -> str:
        return (f"Layer: {self.layer.name} (node index {self.node_index}) is assigned to "
                f"pipeline stage: {self.pipeline_stage}")


class FunctionalLayerPipelineStageAssignment(ModelLayerPipelineStageAssignment):
    """A ``ModelLayerPipelineStageAssignment`` of a functional model."""


class SequentialNestedModelPipelineStageAssignment:
    """The assignments of the layers of a model nested in a ``Sequential`` model (Graphcore's
    class): ``pipeline_stage_assignments``, one per layer (call) of ``nested_model``, edited
    like the outer model's. In ``set_pipeline_stage_assignment`` an int (or a layer
    assignment) in its place puts the whole nested model in that stage."""

    def __init__(self, nested_model: Any, pipeline_stage_assignments: Sequence[Any]) -> None:
        self._nested_model = nested_model
        self._pipeline_stage_assignments = list(pipeline_stage_assignments)

    @property
    def nested_model(self) -> Any:
        return self._nested_model

    @property
    def layer(self) -> Any:
        """The nested model (the layer the outer model calls)."""
        return self._nested_model

    @property
    def pipeline_stage_assignments(self) -> list[Any]:
        """The nested model's assignments (the same objects: edit them in place)."""
        return self._pipeline_stage_assignments

    @property
    def is_nested_model(self) -> bool:
        return True

    def __str__(self) -> str:
        inner = "".join(f"\n  {a}" for a in self._pipeline_stage_assignments)
        return f"Model: {self.nested_model.name} has the following pipeline stage assignments:{inner}"


class NestedModelPipelineStageAssignment(SequentialNestedModelPipelineStageAssignment):
    """The assignments of the layers of one call (``node_index``) of a model nested in a
    functional or subclassed model (Graphcore's class); see
    ``SequentialNestedModelPipelineStageAssignment``."""

    def __init__(self, nested_model: Any, node_index: int,
                 pipeline_stage_assignments: Sequence[Any]) -> None:
        super().__init__(nested_model, pipeline_stage_assignments)
        self._node_index = node_index

    @property
    def node_index(self) -> int:
        return self._node_index

    @property
    def inbound_layers(self) -> list[Any]:
        nodes = getattr(self._nested_model, "_inbound_nodes", [])
        if self._node_index >= len(nodes):
            return []
        return [n.operation for n in getattr(nodes[self._node_index], "parent_nodes", [])]

    def __str__(self) -> str:
        inner = "".join(f"\n  {a}" for a in self._pipeline_stage_assignments)
        return (f"Model: {self.nested_model.name} (node index {self.node_index}) has the "
                f"following pipeline stage assignments:{inner}")


class FunctionalNestedModelPipelineStageAssignment(NestedModelPipelineStageAssignment):
    """A ``NestedModelPipelineStageAssignment`` of a functional model."""


def _is_sequential(model: Any) -> bool:
    import keras

    return isinstance(model, keras.Sequential)


def _is_model(layer: Any) -> bool:
    import keras

    return isinstance(layer, keras.Model)


_GRAPH_MODELS: tuple[type, ...] = ()  # keras.Sequential and functional models (set lazily)


def _is_subclassed(model: Any) -> bool:
    """A keras.Model whose layer calls only its ``call()`` knows (neither Sequential nor
    functional): its calls are read from a run of ``call()`` (``_Trace``)."""
    global _GRAPH_MODELS
    if not _GRAPH_MODELS:
        import keras
        from keras.src.models.functional import Functional

        _GRAPH_MODELS = (keras.Sequential, Functional)
    return _is_model(model) and not isinstance(model, _GRAPH_MODELS)


class _Trace:
    """The layer calls the latest run of a subclassed model's ``call()`` made (eager, traced
    by tf.function, or symbolic when Keras builds the model), each as (layer, its call
    index in that run, the stage of the PipelineStage scope entered in this ``call()``
    around it, or None), in the order it made them, and what made its stages unreadable."""

    __slots__ = ("calls", "problems", "stages")

    def __init__(self, calls: list[tuple[Any, int, int | None]], problems: list[str]) -> None:
        self.calls = calls
        self.problems = problems
        self.stages = {(id(layer), index): stage for layer, index, stage in calls}


def _trace(model: Any) -> _Trace | None:
    """The recorded run of ``call()`` of a subclassed model (None: other models, or its
    ``call()`` has not run yet)."""
    return getattr(model, _TRACE_ATTR, None) if _is_subclassed(model) else None


def _layer_calls(model: Any) -> list[tuple[Any, int]]:
    """(layer, node index) of every layer call of a functional model, in the order the model
    runs them (its nodes by depth, inputs first), without its inputs; of a subclassed model,
    (layer, call index) of the calls its ``call()`` made in its latest run, in their order."""
    trace = _trace(model)
    if trace is not None:
        return [(layer, index) for layer, index, _ in trace.calls]
    by_depth = getattr(model, "_nodes_by_depth", None)
    if _is_sequential(model) or not by_depth:
        return [(layer, 0) for layer in model.layers]
    calls = []
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            layer = getattr(node, "operation", None)
            if layer is None or getattr(node, "is_input", False) or layer is model:
                continue
            index = next((k for k, n in enumerate(getattr(layer, "_inbound_nodes", []))
                          if n is node), 0)
            calls.append((layer, index))
    return calls


#: A layer call's place in a model: the (id(layer), node index) of each call on the way to
#: it, the outer model's first (one pair for a layer of the model itself, more inside nested
#: models). A model's table maps paths to stages.
Path = tuple[tuple[int, int], ...]


def _stage_in(sources: list[tuple[dict[Path, int], int]], path: Path) -> int | None:
    """The stage ``path`` has in the first table of ``sources`` (table, depth of its model)
    that names it, or names the call of a nested model on the way to it (a whole nested
    model in one stage)."""
    for table, depth in sources:
        rel = path[depth:]
        for n in range(len(rel), 0, -1):
            if rel[:n] in table:
                return table[rel[:n]]
    return None


def _assignments(model: Any, sources: list[tuple[dict[Path, int], int]], prefix: Path) -> list[Any]:
    sequential = _is_sequential(model)
    # Graphcore's classes: Functional* for functional models, their bases for subclassed ones.
    subclassed = _is_subclassed(model)
    layer_class = (ModelLayerPipelineStageAssignment if subclassed
                   else FunctionalLayerPipelineStageAssignment)
    nested_class = (NestedModelPipelineStageAssignment if subclassed
                    else FunctionalNestedModelPipelineStageAssignment)
    out: list[Any] = []
    for layer, index in _layer_calls(model):
        path = prefix + ((id(layer), index),)
        if _is_model(layer):
            inner = _assignments(layer, sources + [(getattr(layer, _ASSIGNMENT_ATTR, {}), len(path))],
                                 path)
            whole = _stage_in(sources, path)
            if whole is None:
                whole = _call_stage(model, layer, index)
            if whole is not None:  # the nested model's call in a stage: its unassigned layers too
                for a in _leaves(inner):
                    if a.pipeline_stage is None:
                        a.pipeline_stage = whole
            out.append(SequentialNestedModelPipelineStageAssignment(layer, inner) if sequential
                       else nested_class(layer, index, inner))
            continue
        stage = _stage_in(sources, path)
        if stage is None:
            stage = _call_stage(model, layer, index)
        out.append(SequentialLayerPipelineStageAssignment(layer, stage) if sequential
                   else layer_class(layer, index, stage))
    return out


def _leaves(assignments: Sequence[Any]) -> Iterator[Any]:
    for a in assignments:
        if getattr(a, "is_nested_model", False):
            yield from _leaves(a.pipeline_stage_assignments)
        else:
            yield a


def get_pipeline_stage_assignment(self: Any) -> list[Any]:
    """Graphcore's ``model.get_pipeline_stage_assignment()``: one assignment per layer
    (Sequential) or per layer call (functional, in the order the model runs them), with the
    stage currently assigned (from ``set_pipeline_stage_assignment``, else a PipelineStage
    scope around the call, else around the layer's construction, else None). A nested model
    (a Sequential or functional model called as a layer) has a
    ``SequentialNestedModelPipelineStageAssignment`` / ``FunctionalNestedModelPipelineStageAssignment``
    holding the assignments of its own layers (its own ``set_pipeline_stage_assignment``,
    else its layers' scopes, are the defaults, as Graphcore's). A subclassed model has one
    ``ModelLayerPipelineStageAssignment`` per layer call its ``call()`` made in its latest
    run, in that order (``node_index``: the layer's n-th call in it), with the stage of the
    scope entered around the call in ``call()``."""
    return _assignments(self, [(getattr(self, _ASSIGNMENT_ATTR, {}), 0)], ())


def _scoped_stage(layer: Any, node_index: int) -> int | None:
    stages = getattr(layer, _NODE_STAGES_ATTR, {})
    if node_index in stages:
        return stages[node_index]
    return getattr(layer, _LAYER_STAGE_ATTR, None)


def _call_stage(model: Any, layer: Any, index: int) -> int | None:
    """The stage the scopes give call ``index`` of ``layer`` in ``model``: for a subclassed
    model, the scope entered around it in ``call()``, else the one around the layer's
    construction (none after ``reset_pipeline_stage_assignment``); for other models, the
    scope around the symbolic call (its node), else around the construction."""
    trace = _trace(model)
    if trace is None:
        return _scoped_stage(layer, index)
    if getattr(model, _RESET_ATTR, False):
        return None
    stage = trace.stages.get((id(layer), index))
    return stage if stage is not None else getattr(layer, _LAYER_STAGE_ATTR, None)


def _table(model: Any, given: Sequence[Any], where: str, prefix: Path = ()) -> dict[Path, int]:
    """The stages of ``given`` (ints or assignments, edited; for a nested model, its nested
    assignment or one stage for all of it), checked against the model's calls."""
    current = get_pipeline_stage_assignment(model)
    calls = _layer_calls(model)
    if len(given) != len(current):
        raise ValueError(
            f"{where}: {len(given)} stages given for {len(current)} "
            f"{'layers' if _is_sequential(model) else 'layer calls'} of {model.name} (one each: "
            f"{', '.join(str(layer.name) for layer, _ in calls)}).")
    table: dict[Path, int] = {}
    for k, (item, (layer, index)) in enumerate(zip(given, calls, strict=True)):
        owner = getattr(item, "nested_model", None) or getattr(item, "layer", None)
        if owner is not None and owner is not layer:
            raise ValueError(f"{where}: assignment {k} is for layer {owner.name!r}, the layer "
                             f"call {k} of {model.name} is {layer.name!r}; pass them in the order "
                             f"get_pipeline_stage_assignment() returns.")
        path = prefix + ((id(layer), index),)
        if getattr(item, "is_nested_model", False):
            if not _is_model(layer):
                raise ValueError(f"{where}: assignment {k} is a nested model's, but "
                                 f"{layer.name!r} is a layer.")
            table.update(_table(layer, list(item.pipeline_stage_assignments),
                                f"{where} (nested model {layer.name!r})", path))
            continue
        stage = item.pipeline_stage if hasattr(item, "pipeline_stage") else item
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise ValueError(f"{where}: layer {layer.name!r} has stage {stage!r}; every layer "
                             f"needs a stage, an int >= 0.")
        table[path] = stage
    return table


def set_pipeline_stage_assignment(self: Any, pipeline_stage_assignment: Sequence[Any]) -> None:
    """Graphcore's ``model.set_pipeline_stage_assignment``: a stage for every layer (a list
    of ints, or the assignments ``get_pipeline_stage_assignment`` returns, edited). Every
    layer (call) must have a stage. A nested model takes its nested assignment (a stage for
    each of its layers, as Graphcore's), or an int: all of it in that stage."""
    table = _table(self, list(pipeline_stage_assignment),
                   f"{self.name}.set_pipeline_stage_assignment")
    object.__setattr__(self, _ASSIGNMENT_ATTR, table)
    if hasattr(self, _RESET_ATTR):
        object.__delattr__(self, _RESET_ATTR)


def reset_pipeline_stage_assignment(self: Any) -> None:
    """Graphcore's ``model.reset_pipeline_stage_assignment``: the model is not pipelined
    (its scopes' stages, a subclassed model's in ``call()`` too, no longer count), until
    ``set_pipeline_stage_assignment``."""
    object.__setattr__(self, _ASSIGNMENT_ATTR, {})
    object.__setattr__(self, _RESET_ATTR, True)
    for layer in self._flatten_layers(include_self=False):
        if _is_subclassed(layer):
            object.__setattr__(layer, _RESET_ATTR, True)
    for layer in self.layers:
        for attr in (_LAYER_STAGE_ATTR, _NODE_STAGES_ATTR):
            if hasattr(layer, attr):
                delattr(layer, attr)


def print_pipeline_stage_assignment_summary(self: Any, line_length: int | None = None,
                                            print_fn: Any = None) -> None:
    """Graphcore's ``model.print_pipeline_stage_assignment_summary``: each layer (call) and
    its stage, and the IPU of each stage; a nested model's layers under its name."""
    print_fn = print_fn or print
    width = line_length or 80
    options = getattr(self, _OPTIONS_ATTR, {})
    rows = [("Layer", "Stage", "IPU")]
    mapping = options.get("device_mapping")

    def add(assignments: Sequence[Any], indent: str) -> None:
        for a in assignments:
            call = f" (call {a.node_index})" if getattr(a, "node_index", 0) else ""
            if getattr(a, "is_nested_model", False):
                rows.append((f"{indent}{a.nested_model.name}{call} (nested model)", "", ""))
                add(a.pipeline_stage_assignments, indent + "  ")
                continue
            stage = a.pipeline_stage
            ipu = "" if stage is None else str(mapping[stage] if mapping and stage < len(mapping)
                                               else stage)
            rows.append((f"{indent}{a.layer.name}{call}", "-" if stage is None else str(stage), ipu))

    add(get_pipeline_stage_assignment(self), "")
    col = max(len(r[0]) for r in rows) + 2
    print_fn(f"Model: {self.name}: pipeline stage assignment")
    print_fn("=" * width)
    for k, (name, stage, ipu) in enumerate(rows):
        print_fn(f"{name:<{col}}{stage:<8}{ipu}")
        if k == 0:
            print_fn("-" * width)
    print_fn("=" * width)


def _flat(model: Any) -> list[tuple[Path, Any, int | None]]:
    """(path, layer, stage) of every call of a layer that is not a nested model, in order."""
    out: list[tuple[Path, Any, int | None]] = []

    def walk(m: Any, assignments: Sequence[Any], prefix: Path) -> None:
        for a, (layer, index) in zip(assignments, _layer_calls(m), strict=True):
            path = prefix + ((id(layer), index),)
            if getattr(a, "is_nested_model", False):
                walk(layer, a.pipeline_stage_assignments, path)
            else:
                out.append((path, layer, a.pipeline_stage))

    walk(model, get_pipeline_stage_assignment(model), ())
    return out


def stages_of(model: Any) -> dict[Path, int]:
    """The model's stage of every layer call (nested models' layers included, by path:
    ``Path``); empty when the model is not pipelined (no layer has a stage)."""
    return {path: stage for path, _, stage in _flat(model) if stage is not None}


def _models(model: Any) -> Iterator[Any]:
    """``model`` and every model its calls reach (nested models), once each."""
    seen: set[int] = set()
    todo = [model]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        todo.extend(layer for layer, _ in _layer_calls(m) if _is_model(layer))


def _unreadable(model: Any) -> list[str]:
    """Why the stages of ``model``'s subclassed parts cannot be read from their ``call()``
    (empty: they can, or there is none)."""
    problems: list[str] = []
    for m in _models(model):
        trace = _trace(m)
        if trace is not None and not getattr(m, _RESET_ATTR, False):
            problems.extend(p for p in trace.problems if p not in problems)
    return problems


def _no_stages_reason(model: Any) -> str:
    """Why ``model`` has no pipeline stage, in the user's terms."""
    if getattr(model, _RESET_ATTR, False):
        return "reset_pipeline_stage_assignment() was called"
    if _is_subclassed(model):
        trace = _trace(model)
        if trace is None:
            return ("it is a subclassed model whose call() has not run yet, and its stages "
                    "are read from the PipelineStage scopes its call() enters: call the model "
                    "on a batch (or let fit/evaluate/predict build it) first")
        if not trace.calls:
            return ("its call() calls no Keras layer, and pipeline stages hold layer calls "
                    "(computations made with keras.ops or tf ops directly in call(), outside "
                    "layers, have no stage): put them in layers called in PipelineStage scopes")
        return ("its call() makes no layer call inside a keras.ipu.PipelineStage scope (a "
                "scope entered around model(x), outside call(), does not assign its layers)")
    return ("no layer (call) has a stage: neither set_pipeline_stage_assignment nor a "
            "keras.ipu.PipelineStage scope assigned one")
