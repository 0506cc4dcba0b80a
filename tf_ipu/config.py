"""IPUConfig: what the host asks of the device system (how many IPUs, which chip, which server).

The names follow Graphcore's IPU TensorFlow API (``IPUConfig``, ``auto_select_ipus``,
``ipu_model.version``, ``ipu_model.tiles_per_ipu``, ``floating_point_behaviour``,
``matmuls``, ``convolutions``, ``configure_ipu_system``) so that code written for it ports
over. Numerics options are described in docs/user_guide.md ("Numerics").

    cfg = tf_ipu.IPUConfig()
    cfg.auto_select_ipus = 1
    cfg.ipu_model.version = "ipu2"       # "ipu1" = GC2, "ipu2" = GC200, "bow" (or "ipu21") = Bow
    cfg.configure_ipu_system()           # no server given: starts a local device server

Environment variables:
    TF_IPU_SERVER=host:port   use that device server instead of starting a local one.
    TF_IPU_SERVER_TOKEN=...   the token to present to the device server (if it wants one).
"""

from __future__ import annotations

import difflib
import enum
import math
import os
from collections.abc import Mapping
from typing import Any

from device_server.protocol import hardware
from tf_ipu import notices

IPU_VERSIONS = {alias: v.name for v in hardware.VERSIONS.values() for alias in (v.name, *v.aliases)}
"""Accepted architecture names and the canonical name each stands for (from
``device_server.protocol.hardware``, where versions and systems are named once)."""
DATA_PATHS = ("auto", "shm", "stream")
DATA_PATH_ENV = "TF_IPU_DATA_PATH"
POPLAR_FLAGS_ENV = "TF_POPLAR_FLAGS"
_SECRET = frozenset({"server_token"})  # shown as *** by repr


class Effect(enum.Enum):
    """What an option does here: HONOURED (the emulator acts on it), KEPT (stored, read back,
    and named in one warning: what would act on it is not modelled yet), IGNORED (stored,
    read back, and named in one warning: it has no meaning on the emulated IPU)."""

    HONOURED = "honoured"
    KEPT = "kept"
    IGNORED = "ignored"


class _Section:
    """A group of options; refuses unknown attribute names (a typo must not pass silently).

    ``_fields`` maps each option to its default (a ``_Section`` subclass for a nested group);
    ``_notes`` maps the options that are KEPT or IGNORED to ``(effect, reason)``: setting one
    to something other than its default warns once (``tf_ipu.notices``). Values are checked
    against the default's type (an enum's class, bool, int, float, str, dict) unless the
    section's ``_check`` knows the option better.
    """

    _fields: dict[str, Any] = {}
    _notes: dict[str, tuple[Effect, str]] = {}
    _path = ""

    def __init__(self) -> None:
        for name, default in self._fields.items():
            if isinstance(default, type) and issubclass(default, _Section):
                default = default()
            elif isinstance(default, (dict, list)):
                default = type(default)(default)
            object.__setattr__(self, name, default)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            close = difflib.get_close_matches(name, list(self._fields), n=1)
            raise AttributeError(
                f"{self._path}.{name} is not an IPUConfig option."
                + (f" Did you mean {self._path}.{close[0]}?" if close else "")
                + f" Options here: {', '.join(sorted(self._fields))}."
            )
        default = self._fields[name]
        if isinstance(default, type) and issubclass(default, _Section):
            raise AttributeError(f"{self._path}.{name} is a group: set its fields instead.")
        value = self._check(name, value)
        object.__setattr__(self, name, value)
        self.__dict__.setdefault("_set_by_user", set()).add(name)
        note = self._note(name, value)
        if note is not None and value != default:
            effect, reason = note
            notices.once(f"{self._path}.{name}",
                         ("is kept but has no effect yet: " if effect is Effect.KEPT
                          else "has no effect on the emulated IPU: ") + reason)

    def _check(self, name: str, value: Any) -> Any:
        return _check_type(f"{self._path}.{name}", self._fields[name], value)

    def _note(self, name: str, value: Any) -> tuple[Effect, str] | None:
        """What to warn about once when ``name`` is set to ``value`` (not its default)."""
        return self._notes.get(name)

    def was_set(self, name: str) -> bool:
        """Whether option ``name`` of this group was assigned (even to its default)."""
        return name in self.__dict__.get("_set_by_user", ())

    def effect(self, name: str) -> Effect:
        """What option ``name`` of this group does here (``Effect``)."""
        if name not in self._fields:
            raise AttributeError(f"{self._path}.{name} is not an IPUConfig option.")
        note = self._notes.get(name)
        return note[0] if note else Effect.HONOURED

    def _as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._fields:
            value = getattr(self, name)
            out[name] = value._as_dict() if isinstance(value, _Section) else value
        return out

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{k}={'***' if k in _SECRET and v else repr(v)}" for k, v in self._as_dict().items()
        )
        return f"{type(self).__name__}({fields})"


def _check_type(path: str, default: Any, value: Any) -> Any:
    """``value`` if it has the type of ``default`` (ints pass for floats), else TypeError."""
    if isinstance(default, enum.Enum):
        ok, want = isinstance(value, type(default)), type(default).__name__
    elif isinstance(default, bool):
        ok, want = isinstance(value, bool), "bool"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "int"
    elif isinstance(default, float):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "float"
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "str"
    elif isinstance(default, dict):
        ok, want = isinstance(value, Mapping) and all(isinstance(k, str) for k in value), \
            "dict with str keys"
        value = dict(value) if ok else value
    else:
        return value
    if not ok:
        raise TypeError(f"{path} must be a {want}. Received: {value!r} ({type(value).__name__})")
    return value


class SelectionOrder(enum.Enum):
    """In which order a multi-IPU device's IPUs are taken (Graphcore's
    ``ipu.config.SelectionOrder``): AUTO, ZIGZAG (0, 1, 2, ...), SNAKE (each next IPU linked
    to the one before), HOOF (SNAKE, ending on the first IPU's card)."""

    AUTO = 0
    ZIGZAG = 1
    SNAKE = 2
    HOOF = 3


class StochasticRoundingBehaviour(enum.Enum):
    """``floating_point_behaviour.esr``: OFF, ON, or REPLICA_IDENTICAL_ONLY (only where
    every replica computes the same values; with one replica, everywhere, as ON)."""

    OFF = 0
    ON = 1
    REPLICA_IDENTICAL_ONLY = 2

    @staticmethod
    def from_bool(value: bool) -> StochasticRoundingBehaviour:
        """ON for True, OFF for False (the older bool spelling of ``esr``)."""
        return StochasticRoundingBehaviour.ON if value else StochasticRoundingBehaviour.OFF


class MergeRemoteBuffersBehaviour(enum.Enum):
    """``optimizations.merge_remote_buffers``: NO_MERGING, MERGE, IF_BENEFICIAL."""

    NO_MERGING = 0
    MERGE = 1
    IF_BENEFICIAL = 2


class SchedulingAlgorithm(enum.Enum):
    """``scheduling.algorithm``: how Poplar orders instructions (CHOOSE_BEST by default)."""

    CHOOSE_BEST = 0
    CLUSTERING = 1
    POST_ORDER = 2
    LOOK_AHEAD = 3
    SHORTEST_PATH = 4


_NO_TILE_PLAN = "the tile model plans every operation the same way whatever it says"
_NO_COMPILER_PASS = "the emulator runs the program as XLA lowered it, without this Poplar pass"
_NO_REMOTE = "the emulated IPU has no remote buffers (Streaming Memory)"
_NO_SCHEDULER = "the emulator runs instructions in the program's order"


class IpuModelOptions(_Section):
    """``ipu_model``: which emulated chip to compile for.

    Attributes:
        version: "ipu1" (GC2), "ipu2" (GC200), "bow" (Bow; "ipu21" is accepted too).
        tiles_per_ipu: 0 for the chip's full tile count, or fewer for quick experiments.
        compile_ipu_code: Graphcore's IPU Model switch for compiling tile code (ignored:
            the emulator always builds its tile program).
    """

    _fields = {"compile_ipu_code": True, "tiles_per_ipu": 0, "version": "ipu2"}
    _notes = {"compile_ipu_code": (Effect.IGNORED, "the emulator always builds its tile program")}
    _path = "IPUConfig.ipu_model"

    def _check(self, name: str, value: Any) -> Any:
        if name == "version":
            key = str(value).lower()
            if key not in IPU_VERSIONS:
                raise ValueError(
                    f"IPUConfig.ipu_model.version must be one of "
                    f"{sorted(IPU_VERSIONS)}. Received: version={value!r}"
                )
            return key
        if name == "tiles_per_ipu":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"IPUConfig.ipu_model.tiles_per_ipu must be an int >= 0. "
                    f"Received: tiles_per_ipu={value!r}"
                )
        return super()._check(name, value)


class FloatingPointBehaviour(_Section):
    """``floating_point_behaviour``: the IPU's floating-point control bits. All off by default.

    Attributes:
        inv: stop the step when an instruction produces NaN from operands that are not NaN.
        div0: stop the step when a division by zero produces +-inf.
        oflo: stop the step when an instruction produces +-inf from finite operands (leave it
            off with ``mixed_float16``: dynamic loss scaling overflows on purpose).
        esr: stochastic rounding of FP32 -> FP16 (conversions and FP16 arithmetic results):
            a ``StochasticRoundingBehaviour`` (ON, OFF, REPLICA_IDENTICAL_ONLY) or a bool.
        nanoo: an FP16 result that overflows becomes NaN (off: +-inf as in IEEE).
        set_all: turns all of the above on, whatever they say.
    """

    _fields = {"inv": False, "div0": False, "oflo": False,
               "esr": StochasticRoundingBehaviour.OFF, "nanoo": False, "set_all": False}
    _path = "IPUConfig.floating_point_behaviour"

    def _check(self, name: str, value: Any) -> Any:
        if name == "esr" and isinstance(value, (bool, StochasticRoundingBehaviour)):
            return value
        if not isinstance(value, bool):
            raise ValueError(
                f"{self._path}.{name} must be a bool"
                + (" or a StochasticRoundingBehaviour" if name == "esr" else "")
                + f". Received: {value!r}"
            )
        return value

    def flags(self) -> dict[str, bool]:
        """The five control bits as the device takes them (``set_all`` applied)."""
        esr = self.esr
        if isinstance(esr, StochasticRoundingBehaviour):
            esr = esr is not StochasticRoundingBehaviour.OFF  # one replica: all identical
        out = {"inv": self.inv, "div0": self.div0, "oflo": self.oflo, "esr": bool(esr),
               "nanoo": self.nanoo}
        return {k: True for k in out} if self.set_all else out


_PARTIALS = ("float", "half")

# PopLibs' option names (poplin's matMul and convolution option specs, SDK 3), which it
# refuses others than (poplar::invalid_option). The two the emulator honours first.
_HONOURED_POPLAR = ("availableMemoryProportion", "partialsType")
_MATMUL_POPLAR = (*_HONOURED_POPLAR, "enableFastReduce", "enableMultiStageReduce",
                  "fullyConnectedPass", "gatherOutput", "inputRHSIsPreArranged",
                  "planConstraints", "remapOutputTensor", "use128BitConvUnitLoad")
_CONV_POPLAR = (*_HONOURED_POPLAR, "disableTransformations", "enableConvDithering",
                "enableFastReduce", "enableMultiStageReduce", "enableTransformsConvTable",
                "gatherConvOutput", "insertTransformsCycleCountProgs", "partialsType.interIPU",
                "partialsType.interTile", "pass", "planConstraints",
                "planConstraintsOutputFilename", "remapOutputTensor", "use128BitConvUnitLoad")


def _memory_proportion(what: str, value: Any) -> float:
    """PopLibs' ``availableMemoryProportion`` (``what`` names where it was given): a number or
    its string ("0.6"), 0 .. 1."""
    try:
        amp = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        amp = math.nan
    if not 0.0 <= amp <= 1.0:  # also NaN
        raise ValueError(
            f"{what} must be a number in [0, 1] (a float or its string, e.g. \"0.6\": the "
            f"share of a tile's memory a plan may use for temporaries). Received: {value!r}"
        )
    return amp


def _check_poplar_options(path: str, value: Any, known: tuple[str, ...] = (),
                          kind: str = "") -> dict[str, Any]:
    """A PopLibs option dict: str keys; ``partialsType`` and ``availableMemoryProportion``
    (the two the emulator reads) checked here; with ``known`` (the names of PopLibs'
    ``kind`` options), any other key is refused as PopLibs does, naming it and those."""
    options = _check_type(path, {}, value)
    if known:
        for key in options:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                raise ValueError(
                    f"{path}: {key!r} is not a PopLibs {kind} option."
                    + (f" Did you mean {close[0]!r}?" if close else "")
                    + f" Accepted: {', '.join(known)}."
                )
    partials = options.get("partialsType")
    if partials is not None and str(partials).lower() not in _PARTIALS:
        raise ValueError(f"{path}['partialsType'] must be 'float' or 'half'. Received: {partials!r}")
    if "availableMemoryProportion" in options:
        _memory_proportion(f"{path}['availableMemoryProportion']", options["availableMemoryProportion"])
    return options


class _PartialsOptions(_Section):
    _fields = {"partials_type": "float", "poplar_options": {}}
    _known: tuple[str, ...] = ()  # the PopLibs option names this group's poplar_options take
    _kind = ""                    # ... of PopLibs' options of this kind

    def _check(self, name: str, value: Any) -> Any:
        if name == "poplar_options":
            options = _check_poplar_options(f"{self._path}.poplar_options", value, self._known,
                                            self._kind)
            self._check_agree(options.get("partialsType"), self.partials_type
                              if self.was_set("partials_type") else None)
            return options
        key = str(value).lower()
        if key not in _PARTIALS:
            raise ValueError(
                f"{self._path}.partials_type must be 'float' or 'half'. Received: {value!r}"
            )
        self._check_agree(self.poplar_options.get("partialsType"), key)
        return key

    def _check_agree(self, poplar: Any, ours: str | None) -> None:
        """ValueError when ``poplar_options['partialsType']`` and ``partials_type`` (its alias)
        are both given and say different things."""
        if poplar is not None and ours is not None and str(poplar).lower() != ours:
            raise ValueError(
                f"{self._path}.poplar_options['partialsType'] is {poplar!r} but "
                f"{self._path}.partials_type is {ours!r}: they are the same option (give one, "
                f"or the same value to both)."
            )

    def _note(self, name: str, value: Any) -> tuple[Effect, str] | None:
        if name == "poplar_options":
            kept = sorted(set(value) - set(_HONOURED_POPLAR))
            if not kept:
                return None  # partialsType and availableMemoryProportion: honoured
            return (Effect.KEPT, f"the emulator does not model these PopLibs options "
                    f"({', '.join(kept)}); 'partialsType' and 'availableMemoryProportion' "
                    f"are honoured")
        return super()._note(name, value)

    @property
    def effective_partials_type(self) -> str:
        """``poplar_options['partialsType']`` if given (Graphcore's spelling), else
        ``partials_type`` (its alias)."""
        partials = self.poplar_options.get("partialsType")
        return str(partials).lower() if partials is not None else self.partials_type

    @property
    def available_memory_proportion(self) -> float | None:
        """``poplar_options['availableMemoryProportion']`` as a float, or None (unset: the
        preset's, 0.6)."""
        amp = self.poplar_options.get("availableMemoryProportion")
        return None if amp is None else _memory_proportion(
            f"{self._path}.poplar_options['availableMemoryProportion']", amp)


class MatmulOptions(_PartialsOptions):
    """``matmuls``: matrix products (``dot``).

    Attributes:
        partials_type: "float" (default: FP16 products accumulate in FP32 and are rounded
            once to the result type) or "half" (an FP16 accumulator, rounded after every
            chunk of the AMP's accumulation width: faster on the IPU, less precise).
        poplar_options: PopLibs ``matMul`` options (Graphcore's spelling, string values):
            ``partialsType`` ("float" or "half"; ``partials_type`` is its alias, and both
            given must agree) and ``availableMemoryProportion`` ("0" .. "1", or a float: the
            share of a tile's memory a plan may use for temporaries; lower: fewer
            temporaries, more cycles; unset: 0.6) are honoured; PopLibs' other matMul
            options are checked by name and kept; any other key is refused.
        clear_pass_type: Graphcore's switch that hides the pass type from PopLibs (ignored).
    """

    _fields = {"clear_pass_type": False, **_PartialsOptions._fields}
    _notes = {"clear_pass_type": (Effect.IGNORED, _NO_TILE_PLAN)}
    _path = "IPUConfig.matmuls"
    _known, _kind = _MATMUL_POPLAR, "matMul"

    def _check(self, name: str, value: Any) -> Any:
        if name == "clear_pass_type":
            return _check_type(f"{self._path}.{name}", False, value)
        return super()._check(name, value)


class ConvolutionOptions(_PartialsOptions):
    """``convolutions``: convolutions.

    Attributes:
        partials_type: "float" (default) or "half", as for ``matmuls``.
        poplar_options: PopLibs convolution options, as for ``matmuls``
            (``partialsType``, ``availableMemoryProportion`` honoured; PopLibs' other
            convolution options kept; other keys refused).
    """

    _path = "IPUConfig.convolutions"
    _known, _kind = _CONV_POPLAR, "convolution"


class _PoplarOptionsOnly(_Section):
    _fields = {"poplar_options": {}}
    _notes = {"poplar_options": (Effect.IGNORED, _NO_TILE_PLAN)}

    def _check(self, name: str, value: Any) -> Any:
        return _check_poplar_options(f"{self._path}.poplar_options", value)


class SliceOptions(_PoplarOptionsOnly):
    """``slices``: ``poplar_options`` of PopLibs' embedding slices (checked, no effect here)."""

    _path = "IPUConfig.slices"


class PoolingOptions(_PoplarOptionsOnly):
    """``pooling``: ``poplar_options`` of PopLibs' pooling (checked, no effect here)."""

    _path = "IPUConfig.pooling"


class DeviceConnectionType(enum.Enum):
    """How the process reaches its IPUs (Graphcore's ``ipu.config.DeviceConnectionType``).

    * ``ALWAYS``: attach when the system is configured (the default).
    * ``ON_DEMAND``: attach at the first device call.
    * ``PRE_COMPILE``: compile (filling the server's executable cache) and size every
      program, and answer device calls with zeros without running them.
    * ``NEVER``: compile and size; a device call is an error.
    """

    ALWAYS = 0
    ON_DEMAND = 1
    PRE_COMPILE = 2
    NEVER = 3


class DeviceConnectionOptions(_Section):
    """``device_connection``: when the process attaches to its IPUs.

    Attributes:
        type: a ``DeviceConnectionType`` (``ALWAYS`` by default).
        version: the IPU version to compile for when not attaching ("" or one of
            ``ipu_model.version``'s values; "" means ``ipu_model.version``).
        enable_remote_buffers: Graphcore's flag for remote buffers when not attaching;
            accepted and kept (there are no remote buffers to use here).
        allow_stale_weights: when a new configuration closes a session whose newer variable
            values cannot be read back (the server went away), go on from the host's copies
            (logged, naming the step they hold) instead of raising ``DeviceStateLostError``
            from ``configure_ipu_system`` (False, the default). This project's option.
    """

    _fields = {"type": DeviceConnectionType.ALWAYS, "version": "", "enable_remote_buffers": False,
               "allow_stale_weights": False}
    _notes = {"enable_remote_buffers": (Effect.IGNORED, _NO_REMOTE)}
    _path = "IPUConfig.device_connection"

    def _check(self, name: str, value: Any) -> Any:
        if name == "type" and not isinstance(value, DeviceConnectionType):
            raise ValueError(
                f"IPUConfig.device_connection.type must be a DeviceConnectionType "
                f"(ALWAYS, ON_DEMAND, PRE_COMPILE, NEVER). Received: {value!r}"
            )
        if name == "version" and value and str(value).lower() not in IPU_VERSIONS:
            raise ValueError(
                f"IPUConfig.device_connection.version must be '' or one of "
                f"{sorted(IPU_VERSIONS)}. Received: {value!r}"
            )
        if name in ("enable_remote_buffers", "allow_stale_weights") and not isinstance(value, bool):
            raise ValueError(f"{self._path}.{name} must be a bool. Received: {value!r}")
        return str(value).lower() if name == "version" else value


class _MultiReplicaDistributionOptions(_Section):
    _fields = {"process_index": 0, "process_count": 0}
    _notes = {k: (Effect.KEPT, "one host process drives the device server's IPUs")
              for k in _fields}
    _path = "IPUConfig.experimental.multi_replica_distribution"


class ExperimentalOptions(_Section):
    """``experimental``: Graphcore's experimental switches (accepted; none acts here)."""

    _fields = {"always_rearrange_copies_on_the_host": False,
               "enable_remote_buffer_embedding": False, "enable_prng_stability": False,
               "multi_replica_distribution": _MultiReplicaDistributionOptions}
    _notes = {
        "always_rearrange_copies_on_the_host": (
            Effect.IGNORED, "host and device hold tensors in the same layout here"),
        "enable_remote_buffer_embedding": (Effect.IGNORED, _NO_REMOTE),
        "enable_prng_stability": (
            Effect.IGNORED, "the emulator's stochastic rounding is seeded per program"),
    }
    _path = "IPUConfig.experimental"


class IOTilesOptions(_Section):
    """``io_tiles``: tiles set aside for host I/O (checked and kept; the tile model does not
    set tiles aside yet)."""

    _fields = {"num_io_tiles": 0, "place_ops_on_io_tiles": False,
               "available_memory_proportion": 0.9}
    _notes = {k: (Effect.KEPT, "the tile model does not set I/O tiles aside") for k in _fields}
    _path = "IPUConfig.io_tiles"

    def _check(self, name: str, value: Any) -> Any:
        value = super()._check(name, value)
        if name == "num_io_tiles" and value < 0:
            raise ValueError(f"{self._path}.num_io_tiles must be >= 0. Received: {value}")
        if name == "available_memory_proportion" and not 0.0 < value <= 1.0:
            raise ValueError(
                f"{self._path}.available_memory_proportion must be in (0, 1]. Received: {value}"
            )
        return value


class _NormsExperimentalOptions(_Section):
    _fields = {"distributed_batch_norm_replica_group_size": 1}
    _notes = {"distributed_batch_norm_replica_group_size": (
        Effect.KEPT, "batch-norm statistics are per replica, one replica per device call")}
    _path = "IPUConfig.norms.experimental"

    def _check(self, name: str, value: Any) -> Any:
        value = super()._check(name, value)
        if value < 1:
            raise ValueError(f"{self._path}.{name} must be at least 1. Received: {value}")
        return value


class NormOptions(_Section):
    """``norms``: normalisation layers (accepted; batch-norm statistics are what the TF
    graph computes, as XLA lowered it)."""

    _fields = {"use_stable_statistics": False, "experimental": _NormsExperimentalOptions}
    _notes = {"use_stable_statistics": (
        Effect.IGNORED, "statistics are computed as the TensorFlow graph says")}
    _path = "IPUConfig.norms"


class _MathOptions(_Section):
    _fields = {"fast": False, "dot_strength": True}
    _notes = {k: (Effect.IGNORED, _NO_COMPILER_PASS) for k in _fields}
    _path = "IPUConfig.optimizations.math"


class OptimizationOptions(_Section):
    """``optimizations``: Poplar's graph optimisations (accepted; the emulator runs the
    program as XLA lowered it, so none changes results or estimates here)."""

    _fields = {
        "math": _MathOptions, "prefetch_data_streams": True, "combine_embedding_lookups": False,
        "combine_matmuls": False, "enable_graph_outlining": True, "merge_infeed_io_copies": False,
        "maximum_cross_replica_sum_buffer_size": 0, "maximum_reduce_scatter_buffer_size": 0,
        "maximum_inter_ipu_copies_buffer_size": 0, "maximum_send_recv_cluster_size": 0,
        "maximum_reduce_many_buffer_size": 0, "maximum_all_gather_buffer_size": 0,
        "minimum_remote_tensor_size": 128,
        "merge_remote_buffers": MergeRemoteBuffersBehaviour.IF_BENEFICIAL,
        "enable_gather_simplifier": True, "triangular_solve_expander_block_size": 0,
        "cholesky_block_size": 0, "enable_fast_math": False,
    }
    _notes = {
        **{k: (Effect.IGNORED, _NO_COMPILER_PASS) for k in _fields if k != "math"},
        "prefetch_data_streams": (
            Effect.IGNORED, "set model.set_infeed_queue_options(prefetch_depth=...) instead"),
        "minimum_remote_tensor_size": (Effect.IGNORED, _NO_REMOTE),
        "merge_remote_buffers": (Effect.IGNORED, _NO_REMOTE),
        "enable_fast_math": (Effect.IGNORED, "it is Graphcore's old name of "
                             "optimizations.math.fast, which has no effect here either"),
    }
    _path = "IPUConfig.optimizations"


class SchedulingOptions(_Section):
    """``scheduling``: Poplar's instruction scheduler (accepted; no effect here)."""

    _fields = {"algorithm": SchedulingAlgorithm.CHOOSE_BEST,
               "maximum_scheduler_lookahead_depth": 5, "maximum_scheduler_search_space_size": 64}
    _notes = {k: (Effect.IGNORED, _NO_SCHEDULER) for k in _fields}
    _path = "IPUConfig.scheduling"


class DebugOptions(_Section):
    """``debug``: test switches passed to every compile.

    Attributes:
        refuse_opcodes: opcodes the emulator must refuse at compile time.
        fault_inject_opcode: an opcode whose results the emulator perturbs at run time.
        allow_out_of_memory: compile (and report) programs that do not fit.
    """

    _fields = {"refuse_opcodes": (), "fault_inject_opcode": "", "allow_out_of_memory": False}
    _path = "IPUConfig.debug"

    def _check(self, name: str, value: Any) -> Any:
        if name == "refuse_opcodes":
            if isinstance(value, str):
                value = (value,)
            return tuple(str(v) for v in value)
        return value


class IPUConfig(_Section):
    """Configuration of the IPU system this process uses.

    Graphcore's whole ``IPUConfig`` tree (SDK 3) is accepted and reads back what was set;
    ``effect(name)`` of a group says whether an option is honoured here, kept for a later
    part of the emulator, or ignored (setting one of the last two warns once, naming it).
    docs/porting.md lists them all.

    Attributes:
        auto_select_ipus: how many IPUs to attach (exclusively) on the device server.
        select_ipus: the index of one IPU of the device server to attach, instead of
            ``auto_select_ipus`` (an int or a one-element list; ``[]``: not used).
        ipu_model: an ``IpuModelOptions`` (``version``, ``tiles_per_ipu``).
        server_address: "host:port" of a device server; None: ``$TF_IPU_SERVER`` if set,
            else a local server started for this process.
        floating_point_behaviour: a ``FloatingPointBehaviour`` (inv, div0, oflo, esr, nanoo,
            set_all).
        matmuls: ``MatmulOptions`` (``partials_type``, ``poplar_options``).
        convolutions: ``ConvolutionOptions`` (``partials_type``, ``poplar_options``).
        debug: ``DebugOptions`` (test switches).
        device_connection: ``DeviceConnectionOptions`` (``type``: when to attach, or never;
            ``DeviceConnectionType``).
        allow_recompute, selection_order, serialization_output_folder,
        compilation_poplar_options, gcl_poplar_options, slices, pooling, experimental,
        io_tiles, norms, optimizations, scheduling: Graphcore's options, accepted, checked
            and read back (see ``effect``).
        connect_timeout: seconds to wait for the server before failing.
        server_token: the token a server started with ``--token-file`` wants; None:
            ``$TF_IPU_SERVER_TOKEN`` if set.
        server_tls_ca: path of the PEM CA certificate (or the PEM bytes) that signed the
            server's TLS certificate; None: plaintext.
        run_deadline: seconds a device call may run (0: no limit). Past it the device stops
            the call at its next step, keeps the variables of the last completed step, and
            the step raises ``tf.errors.DeadlineExceededError``.
        data_path: how tensors cross to the device: ``"auto"`` (shared memory when the
            server is on this machine, as a probe finds, else streaming), ``"shm"`` (shared
            memory, or an error saying why not), ``"stream"`` (gRPC messages and chunked
            streams). ``$TF_IPU_DATA_PATH`` overrides it.
        executable_cache_path: a folder where the (embedded) device server keeps compiled
            programs across restarts; "": ``--executable_cache_path`` of
            ``$TF_POPLAR_FLAGS`` (Graphcore's spelling) if given there, else no disk cache.
        system: the multi-IPU system to run on ("c2", "dss8440", "m2000", "bow2000",
            "pod16", "bow-pod16": ``device_server.protocol.hardware.SYSTEMS``); the embedded
            server then hosts it, and a server given by address must host it. Its IPUs'
            version is the one compiled for. "": the server's IPUs, of ``ipu_model.version``.

    Example:
        >>> cfg = IPUConfig()
        >>> cfg.auto_select_ipus = 1
        >>> cfg.ipu_model.version = "bow"
        >>> cfg.ipu_model.version
        'bow'
    """

    _path = "IPUConfig"
    _fields = {
        "auto_select_ipus": 1,
        "select_ipus": [],
        "ipu_model": IpuModelOptions,
        "server_address": None,
        "floating_point_behaviour": FloatingPointBehaviour,
        "matmuls": MatmulOptions,
        "convolutions": ConvolutionOptions,
        "slices": SliceOptions,
        "pooling": PoolingOptions,
        "norms": NormOptions,
        "io_tiles": IOTilesOptions,
        "optimizations": OptimizationOptions,
        "scheduling": SchedulingOptions,
        "experimental": ExperimentalOptions,
        "debug": DebugOptions,
        "device_connection": DeviceConnectionOptions,
        "allow_recompute": False,
        "selection_order": SelectionOrder.AUTO,
        "serialization_output_folder": "",
        "compilation_poplar_options": {},
        "gcl_poplar_options": {},
        "connect_timeout": 5.0,
        "server_token": None,
        "server_tls_ca": None,
        "run_deadline": 0.0,
        "data_path": "auto",
        "executable_cache_path": "",
        "system": "",
    }
    _notes = {
        "allow_recompute": (Effect.KEPT, "results never change; the tile model remakes "
                            "pipeline stages' segments between recomputation checkpoints, and "
                            "in programs without a pipeline the cheap element-wise results the "
                            "backward reads (docs/tile_model.md, \"Recomputation\")"),
        "selection_order": (Effect.KEPT, "the replicas' IPUs are the session's, in id order"),
        "serialization_output_folder": (
            Effect.IGNORED, "set IPUConfig.executable_cache_path (or --executable_cache_path "
            "in $TF_POPLAR_FLAGS) to keep compiled programs on disk"),
        "compilation_poplar_options": (Effect.IGNORED, "the emulator is not Poplar's engine"),
        "gcl_poplar_options": (Effect.IGNORED, "the emulator's collectives are not GCL's"),
    }

    def _check(self, name: str, value: Any) -> Any:
        if name == "auto_select_ipus":
            if isinstance(value, (list, tuple)):
                if len(value) != 1:
                    raise ValueError(
                        "IPUConfig.auto_select_ipus: one group of IPUs is supported. "
                        f"Received: auto_select_ipus={value!r}"
                    )
                value = value[0]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"IPUConfig.auto_select_ipus must be an int >= 1. "
                    f"Received: auto_select_ipus={value!r}"
                )
            return value
        if name == "select_ipus":
            indices = list(value) if isinstance(value, (list, tuple)) else [value]
            if (len(indices) > 1 or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and i >= 0 for i in indices)):
                raise ValueError(
                    "IPUConfig.select_ipus must be one IPU index >= 0 (an int or a "
                    f"one-element list; [] for none). Received: select_ipus={value!r}"
                )
            return indices
        if name in ("compilation_poplar_options", "gcl_poplar_options"):
            return _check_poplar_options(f"IPUConfig.{name}", value)
        if name in ("allow_recompute", "selection_order", "serialization_output_folder"):
            return super()._check(name, value)
        if name == "server_token" and value is not None and not isinstance(value, str):
            raise ValueError(f"IPUConfig.server_token must be a str. Received: {type(value).__name__}")
        if name == "server_tls_ca" and value is not None and not isinstance(value, (str, bytes)):
            raise ValueError(
                f"IPUConfig.server_tls_ca must be a path or PEM bytes. Received: {type(value).__name__}"
            )
        if name == "run_deadline":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(
                    f"IPUConfig.run_deadline must be seconds >= 0 (0: no limit). Received: {value!r}"
                )
            value = float(value)
        if name == "data_path" and value not in DATA_PATHS:
            raise ValueError(
                f"IPUConfig.data_path must be one of {', '.join(map(repr, DATA_PATHS))}. "
                f"Received: {value!r}"
            )
        if name == "system":
            if not isinstance(value, str) or (value and value.lower() not in hardware.SYSTEMS):
                raise ValueError(
                    f"IPUConfig.system must be '' (any IPUs of the server) or one of "
                    f"{', '.join(sorted(hardware.SYSTEMS))}. Received: {value!r}"
                )
            return value.lower()
        if name == "executable_cache_path" and not isinstance(value, (str, os.PathLike)):
            raise ValueError(
                f"IPUConfig.executable_cache_path must be a folder path. Received: {value!r}"
            )
        if name == "executable_cache_path":
            value = os.fspath(value)
        if name == "server_address" and value is not None:
            value = str(value)
            if ":" not in value:
                raise ValueError(
                    f"IPUConfig.server_address must be 'host:port'. Received: {value!r}"
                )
        return value

    def check_consistency(self) -> None:
        """Raises ValueError for options that contradict each other (checked when the system
        is configured, as Graphcore does)."""
        if self.system:
            system = hardware.get_system(self.system)
            if self.ipu_model.was_set("version") and \
                    IPU_VERSIONS[self.ipu_model.version] != system.ipu_version:
                raise ValueError(
                    f"IPUConfig.system {self.system!r} has {system.product} IPUs "
                    f"({system.ipu_version!r}) but ipu_model.version is "
                    f"{self.ipu_model.version!r}: set one of them to match the other."
                )
            if self.auto_select_ipus > system.num_ipus:
                raise ValueError(
                    f"IPUConfig.auto_select_ipus is {self.auto_select_ipus} but the "
                    f"{self.system} system has {system.num_ipus} IPUs: ask for at most "
                    f"{system.num_ipus}, or choose a larger system."
                )
        if self.select_ipus and self.auto_select_ipus != 1:
            raise ValueError(
                f"IPUConfig: only one of auto_select_ipus ({self.auto_select_ipus}) and "
                f"select_ipus ({self.select_ipus}) can be set: set select_ipus = [] to attach "
                f"{self.auto_select_ipus} IPUs, or auto_select_ipus = 1 to attach IPU "
                f"{self.select_ipus[0]}."
            )
        if self.io_tiles.place_ops_on_io_tiles and self.io_tiles.num_io_tiles == 0:
            raise ValueError("IPUConfig.io_tiles.place_ops_on_io_tiles needs "
                             "IPUConfig.io_tiles.num_io_tiles > 0 (it is 0).")
        group = self.norms.experimental.distributed_batch_norm_replica_group_size
        if self.io_tiles.num_io_tiles > 0 and group > 1:
            raise ValueError(
                "IPUConfig.norms.experimental.distributed_batch_norm_replica_group_size "
                f"({group}) cannot be used with I/O tiles (io_tiles.num_io_tiles="
                f"{self.io_tiles.num_io_tiles}): set one of them back to its default."
            )

    @property
    def resolved_data_path(self) -> str:
        """``$TF_IPU_DATA_PATH`` if set (and valid), else ``data_path``."""
        env = os.environ.get(DATA_PATH_ENV, "").strip()
        if env:
            if env not in DATA_PATHS:
                raise ValueError(
                    f"${DATA_PATH_ENV} must be one of {', '.join(DATA_PATHS)}. Received: {env!r}"
                )
            return env
        return self.data_path

    @property
    def resolved_executable_cache_path(self) -> str:
        """``executable_cache_path``, else ``--executable_cache_path`` in ``$TF_POPLAR_FLAGS``,
        else "" (no disk cache)."""
        if self.executable_cache_path:
            return self.executable_cache_path
        return poplar_flag("executable_cache_path")

    @property
    def resolved_server_address(self) -> str | None:
        """The server to use: ``server_address``, else ``$TF_IPU_SERVER``, else None (local)."""
        return self.server_address or os.environ.get("TF_IPU_SERVER") or None

    @property
    def resolved_server_token(self) -> str:
        """The token to present: ``server_token``, else ``$TF_IPU_SERVER_TOKEN``, else ""."""
        if self.server_token is not None:
            return self.server_token
        return os.environ.get("TF_IPU_SERVER_TOKEN", "")

    def compile_numerics(self) -> dict[str, Any]:
        """The numerics and planning options every compile sends (``DeviceClient.compile``
        keywords)."""
        return {
            "matmul_partials_type": self.matmuls.effective_partials_type,
            "convolution_partials_type": self.convolutions.effective_partials_type,
            "matmul_available_memory_proportion": self.matmuls.available_memory_proportion,
            "convolution_available_memory_proportion":
                self.convolutions.available_memory_proportion,
            "floating_point_behaviour": self.floating_point_behaviour.flags(),
        }

    @property
    def ipu_version(self) -> str:
        """The canonical architecture name ("ipu1", "ipu2" or "bow"): the system's IPUs' if
        ``system`` is set, else ``ipu_model.version``'s."""
        if self.system:
            return hardware.get_system(self.system).ipu_version
        return IPU_VERSIONS[self.ipu_model.version]

    def configure_ipu_system(self) -> None:
        """Connects this process to a device server and attaches its IPUs.

        With no server configured, starts a local device server as a subprocess on a free
        loopback port; it lives as long as this process. Calling it again (a re-run notebook
        cell) reuses the connection when nothing changed, or reattaches as the new config asks.
        """
        from tf_ipu import runtime

        self.check_consistency()
        runtime.get_runtime().configure(self)


def poplar_flag(name: str) -> str:
    """The value of ``--<name>=...`` (or ``--<name> ...``) in ``$TF_POPLAR_FLAGS``; "" if absent."""
    words = os.environ.get(POPLAR_FLAGS_ENV, "").split()
    for k, word in enumerate(words):
        if word.startswith(f"--{name}="):
            return word.split("=", 1)[1]
        if word == f"--{name}" and k + 1 < len(words) and not words[k + 1].startswith("--"):
            return words[k + 1]
    return ""


def default_tiles(version: str) -> int:
    """Full tile count of a canonical architecture name."""
    return hardware.VERSIONS[IPU_VERSIONS[version]].tiles
