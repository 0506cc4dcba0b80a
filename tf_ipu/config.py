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

import enum
import os
from typing import Any

IPU_VERSIONS = {"ipu1": "ipu1", "ipu2": "ipu2", "bow": "bow", "ipu21": "bow"}
"""Accepted architecture names and the canonical name each stands for."""

_TILES = {"ipu1": 1216, "ipu2": 1472, "bow": 1472}
DATA_PATHS = ("auto", "shm", "stream")
DATA_PATH_ENV = "TF_IPU_DATA_PATH"
_SECRET = frozenset({"server_token"})  # shown as *** by repr


class _Section:
    """A group of options; refuses unknown attribute names (a typo must not pass silently)."""

    _fields: dict[str, Any] = {}
    _path = ""

    def __init__(self) -> None:
        for name, default in self._fields.items():
            object.__setattr__(self, name, default)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise AttributeError(
                f"{self._path}.{name} is not an IPUConfig option. "
                f"Options here: {', '.join(sorted(self._fields))}."
            )
        object.__setattr__(self, name, self._check(name, value))

    def _check(self, name: str, value: Any) -> Any:
        return value

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


class IpuModelOptions(_Section):
    """``ipu_model``: which emulated chip to compile for.

    Attributes:
        version: "ipu1" (GC2), "ipu2" (GC200), "bow" (Bow; "ipu21" is accepted too).
        tiles_per_ipu: 0 for the chip's full tile count, or fewer for quick experiments.
    """

    _fields = {"version": "ipu2", "tiles_per_ipu": 0}
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
            if not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"IPUConfig.ipu_model.tiles_per_ipu must be an int >= 0. "
                    f"Received: tiles_per_ipu={value!r}"
                )
        return value


class FloatingPointBehaviour(_Section):
    """``floating_point_behaviour``: the IPU's floating-point control bits. All off by default.

    Attributes:
        inv: stop the step when an instruction produces NaN from operands that are not NaN.
        div0: stop the step when a division by zero produces +-inf.
        oflo: stop the step when an instruction produces +-inf from finite operands (leave it
            off with ``mixed_float16``: dynamic loss scaling overflows on purpose).
        esr: stochastic rounding of FP32 -> FP16 (conversions and FP16 arithmetic results).
        nanoo: an FP16 result that overflows becomes NaN (off: +-inf as in IEEE).
    """

    _fields = {"inv": False, "div0": False, "oflo": False, "esr": False, "nanoo": False}
    _path = "IPUConfig.floating_point_behaviour"

    def _check(self, name: str, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"{self._path}.{name} must be a bool. Received: {value!r}")
        return value


class _PartialsOptions(_Section):
    _fields = {"partials_type": "float"}

    def _check(self, name: str, value: Any) -> Any:
        key = str(value).lower()
        if key not in ("float", "half"):
            raise ValueError(
                f"{self._path}.partials_type must be 'float' or 'half'. Received: {value!r}"
            )
        return key


class MatmulOptions(_PartialsOptions):
    """``matmuls``: FP16 matrix products (``dot``).

    Attributes:
        partials_type: "float" (default: products accumulate in FP32 and are rounded once to
            the result type) or "half" (an FP16 accumulator, rounded after every chunk of
            the AMP's accumulation width: faster on the IPU, less precise).
    """

    _path = "IPUConfig.matmuls"


class ConvolutionOptions(_PartialsOptions):
    """``convolutions``: FP16 convolutions.

    Attributes:
        partials_type: "float" (default) or "half", as for ``matmuls``.
    """

    _path = "IPUConfig.convolutions"


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
    """

    _fields = {"type": DeviceConnectionType.ALWAYS, "version": "", "enable_remote_buffers": False}
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
        if name == "enable_remote_buffers" and not isinstance(value, bool):
            raise ValueError(f"{self._path}.{name} must be a bool. Received: {value!r}")
        return str(value).lower() if name == "version" else value


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

    Attributes:
        auto_select_ipus: how many IPUs to attach (exclusively) on the device server.
        ipu_model: an ``IpuModelOptions`` (``version``, ``tiles_per_ipu``).
        server_address: "host:port" of a device server; None: ``$TF_IPU_SERVER`` if set,
            else a local server started for this process.
        floating_point_behaviour: a ``FloatingPointBehaviour`` (inv, div0, oflo, esr, nanoo).
        matmuls: ``MatmulOptions`` (``partials_type``).
        convolutions: ``ConvolutionOptions`` (``partials_type``).
        debug: ``DebugOptions`` (test switches).
        device_connection: ``DeviceConnectionOptions`` (``type``: when to attach, or never;
            ``DeviceConnectionType``).
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

    Example:
        >>> cfg = IPUConfig()
        >>> cfg.auto_select_ipus = 1
        >>> cfg.ipu_model.version = "bow"
        >>> cfg.ipu_model.version
        'bow'
    """

    _path = "IPUConfig"

    def __init__(self) -> None:
        object.__setattr__(
            self,
            "_fields",
            {
                "auto_select_ipus": 1,
                "ipu_model": IpuModelOptions(),
                "server_address": None,
                "floating_point_behaviour": FloatingPointBehaviour(),
                "matmuls": MatmulOptions(),
                "convolutions": ConvolutionOptions(),
                "debug": DebugOptions(),
                "device_connection": DeviceConnectionOptions(),
                "connect_timeout": 5.0,
                "server_token": None,
                "server_tls_ca": None,
                "run_deadline": 0.0,
                "data_path": "auto",
            },
        )
        super().__init__()

    def _check(self, name: str, value: Any) -> Any:
        if name == "auto_select_ipus":
            if isinstance(value, (list, tuple)):
                if len(value) != 1:
                    raise ValueError(
                        "IPUConfig.auto_select_ipus: one group of IPUs is supported. "
                        f"Received: auto_select_ipus={value!r}"
                    )
                value = value[0]
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"IPUConfig.auto_select_ipus must be an int >= 1. "
                    f"Received: auto_select_ipus={value!r}"
                )
        if name in ("ipu_model", "floating_point_behaviour", "matmuls", "convolutions", "debug",
                    "device_connection"):
            raise AttributeError(f"IPUConfig.{name} is a group: set its fields instead.")
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
        if name == "server_address" and value is not None:
            value = str(value)
            if ":" not in value:
                raise ValueError(
                    f"IPUConfig.server_address must be 'host:port'. Received: {value!r}"
                )
        return value

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
        """The numerics options every compile sends (``DeviceClient.compile`` keywords)."""
        return {
            "matmul_partials_type": self.matmuls.partials_type,
            "convolution_partials_type": self.convolutions.partials_type,
            "floating_point_behaviour": self.floating_point_behaviour._as_dict(),
        }

    @property
    def ipu_version(self) -> str:
        """The canonical architecture name ("ipu1", "ipu2" or "bow")."""
        return IPU_VERSIONS[self.ipu_model.version]

    def configure_ipu_system(self) -> None:
        """Connects this process to a device server and attaches its IPUs.

        With no server configured, starts a local device server as a subprocess on a free
        loopback port; it lives as long as this process. Calling it again (a re-run notebook
        cell) reuses the connection when nothing changed, or reattaches as the new config asks.
        """
        from tf_ipu import runtime

        runtime.get_runtime().configure(self)


def default_tiles(version: str) -> int:
    """Full tile count of a canonical architecture name."""
    return _TILES[IPU_VERSIONS[version]]
