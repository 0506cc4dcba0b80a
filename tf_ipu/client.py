"""The host side of the device protocol: a thin, typed wrapper over the gRPC stub.

    tf_ipu.runtime -> DeviceClient (this module) ==gRPC==> device_server.service.DeviceService
                      |- one session, kept while this client's connection is up (the
                      |  server's keepalive pings, answered by gRPC's C core even while
                      |  Python holds the GIL) and by a heartbeat thread
                      |- Execute calls over one ExecuteStream (no call set-up each time)
                      '- numpy arrays <-> wire Tensors (raw bytes + dtype + dims; no pickle)

Every call has a deadline; a server that cannot be reached raises ``DeviceUnavailableError``
naming the address within ``connect_timeout`` (10 s by default), never a hang. gRPC errors
are re-raised as ``tf_ipu.errors.DeviceError`` subclasses carrying the server's message,
address and error kind. A server that wants a token gets it as ``authorization: Bearer``
metadata on every call; ``tls_ca`` makes the channel TLS, checked against that CA. Does not
import TensorFlow.

The client is split by concern; every name stays importable from here:

    tf_ipu.client            DeviceClient: its state, compile, counters
      ├─ client_channel      ChannelCalls: channel options, calls and deadlines, errors, health
      ├─ client_sessions     Sessions: open/attach/detach/close/abandon, lease heartbeat
      ├─ client_execute      Execution: execute over an ExecuteStream, push_infeed, cancel_running
      ├─ client_variables    Variables: write_variables, read_variables
      └─ client_types        VariableRef, TensorSpec, Estimate, CompiledProgram, SessionInfo,
                             Attachment

Example:
    >>> client = DeviceClient("127.0.0.1:50051")
    >>> client.open_session()
    >>> client.attach(1, "ipu2")
    >>> program = client.compile(module)
    >>> [y] = client.execute(program.executable_id, [x])
    >>> client.close()
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2_grpc

from device_server.protocol import device_pb2, device_pb2_grpc, ir_pb2
from tf_ipu.client_channel import _GRPC_INT_MAX as _GRPC_INT_MAX
from tf_ipu.client_channel import _SERVICE as _SERVICE
from tf_ipu.client_channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TOKEN_ENV,
    ChannelCalls,
    channel_options,
)
from tf_ipu.client_channel import ERROR_KIND_METADATA as ERROR_KIND_METADATA
from tf_ipu.client_channel import KEEPALIVE_SECONDS as KEEPALIVE_SECONDS
from tf_ipu.client_channel import _error_kind as _error_kind
from tf_ipu.client_execute import _NO_OUTPUTS as _NO_OUTPUTS
from tf_ipu.client_execute import STREAM_IDLE_SECONDS as STREAM_IDLE_SECONDS
from tf_ipu.client_execute import STREAM_REFUSED_SECONDS as STREAM_REFUSED_SECONDS
from tf_ipu.client_execute import Execution, _ExecuteStream
from tf_ipu.client_sessions import Sessions, _Heartbeat
from tf_ipu.client_types import (
    Attachment,
    CompiledProgram,
    Estimate,
    SessionInfo,
    TensorSpec,
    _spec,
)
from tf_ipu.client_types import VariableRef as VariableRef
from tf_ipu.client_types import _count as _count
from tf_ipu.client_variables import Variables
from tf_ipu.transport import DataPath

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "ERROR_KIND_METADATA", "KEEPALIVE_SECONDS", "STREAM_IDLE_SECONDS",
    "STREAM_REFUSED_SECONDS", "TOKEN_ENV", "Attachment", "CompiledProgram", "DeviceClient", "Estimate",
    "SessionInfo", "TensorSpec", "VariableRef", "channel_options",
]

logger = logging.getLogger(__name__)


class DeviceClient(ChannelCalls, Sessions, Execution, Variables):
    """A connection to a device server, with at most one session.

    Args:
        address: ``host:port`` of the server.
        timeout: deadline in seconds of control calls (sessions, IPUs, heartbeats,
            counters), and of reaching the server at all (``connect_timeout``).
        run_timeout: deadline of Compile, Execute and variable transfers, which can
            legitimately take long on an emulated device.
        max_message_bytes: largest message either way (the server's is 1 GiB by default).
        client_name: shown in the server's logs.
        token: sent as ``authorization: Bearer <token>`` with every call; None reads
            ``$TF_IPU_SERVER_TOKEN`` ("" sends none).
        tls_ca: PEM bytes, or the path of a PEM file, of the CA that signed the server's
            certificate: the channel then speaks TLS. None: plaintext.
        tls_server_name: the name to check the server's certificate against, if not the
            address's host.
        data_path: ``"auto"`` (shared memory if the server is on this machine, as a probe
            at ``open_session`` finds, else streaming), ``"shm"`` or ``"stream"``
            (``tf_ipu.transport``); None reads ``$TF_IPU_DATA_PATH`` (default ``"auto"``).

    Raises:
        ValueError: an empty address or non-positive timeouts.
        OSError: ``tls_ca`` names a file that cannot be read.

    Example:
        >>> client = DeviceClient("ipus.example.com:5005", token="s3cret", tls_ca="ca.pem")
    """

    def __init__(
        self,
        address: str,
        timeout: float = 10.0,
        run_timeout: float = 600.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        client_name: str = "",
        token: str | None = None,
        tls_ca: bytes | str | None = None,
        tls_server_name: str = "",
        data_path: str | None = None,
    ) -> None:
        if not address or not isinstance(address, str):
            raise ValueError(f"DeviceClient needs a 'host:port' address. Received: {address!r}")
        if not timeout > 0 or not run_timeout > 0:
            raise ValueError(
                f"Timeouts must be > 0. Received: timeout={timeout}, run_timeout={run_timeout}"
            )
        self.address = address
        self.timeout = float(timeout)
        self.run_timeout = float(run_timeout)
        self.last_device_seconds = 0.0  # the server's time for the last Execute
        # What the last Execute's program handed to outfeeds: feed -> (count, stacked values)
        self.last_outfeeds: dict[str, tuple[int, list[np.ndarray]]] = {}
        self.client_name = client_name or f"tf_ipu pid {os.getpid()}"
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self._metadata = (("authorization", f"Bearer {token.strip()}"),) if token else None
        options = channel_options(max_message_bytes)
        self._options = list(options)
        self._tls = tls_ca is not None
        self._tcp_channel: Any = None  # the TCP channel, once calls moved to a Unix socket
        if tls_ca is not None:
            if isinstance(tls_ca, str):
                tls_ca = Path(tls_ca).read_bytes()
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=tls_ca), options=options
            )
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = device_pb2_grpc.DeviceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._session: SessionInfo | None = None
        self._attachment: Attachment | None = None
        self._heartbeat: _Heartbeat | None = None
        self._lease_stub = self._stub  # the session's connection (TCP), for its heartbeats
        self._reachable = False
        self._closed = False
        self._lock = threading.Lock()
        self.heartbeats = 0  # sent and answered
        self.heartbeat_failures = 0
        if data_path is None:
            data_path = os.environ.get("TF_IPU_DATA_PATH", "").strip() or "auto"
        self.data = DataPath(self, data_path)
        self._running = 0   # device calls in progress (cancel_running stops them)
        self._lock_running = threading.Lock()
        # executable id -> (output specs, outputs that update a variable)
        self._outputs_of: dict[str, tuple[list[TensorSpec], set[int]]] = {}
        self._variable_specs: dict[str, TensorSpec] = {}    # key -> spec, as last written
        self._stream: _ExecuteStream | None = None  # Execute calls go over it when they can
        self._stream_lock = threading.Lock()
        self._streams_off_until = 0.0  # time.monotonic() until which Execute is unary

    def __repr__(self) -> str:
        sid = self._session.session_id[:8] + ".." if self._session else None
        return (
            f"DeviceClient(address={self.address!r}, session={sid}, "
            f"ipus={self._attachment.ipu_ids if self._attachment else []})"
        )

    def __enter__(self) -> DeviceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- programs -----------------------------------------------------------------------

    def compile(
        self,
        module: ir_pb2.Module,
        options: device_pb2.CompileOptions | None = None,
        *,
        refuse_opcodes: Iterable[str] = (),
        fault_inject_opcode: str = "",
        allow_out_of_memory: bool = False,
        matmul_partials_type: str = "",
        convolution_partials_type: str = "",
        matmul_available_memory_proportion: float | None = None,
        convolution_available_memory_proportion: float | None = None,
        floating_point_behaviour: Mapping[str, bool] | None = None,
        stochastic_rounding_seed: int = 0,
        replicas: int = 1,
        pipeline: Mapping[str, Any] | None = None,
        recomputation: bool = False,
        instances: int = 1,
    ) -> CompiledProgram:
        """Compiles a program for the session's IPUs (cached on the server by content).

        Args:
            module: the IR program.
            options: compile options as a message; or give the keyword arguments, which
                are added to it.
            refuse_opcodes: opcodes to refuse (debugging).
            fault_inject_opcode: opcode whose results to perturb (debugging).
            allow_out_of_memory: compile (and report) even if it does not fit.
            matmul_partials_type, convolution_partials_type: "float" (default) or "half":
                the accumulator of FP16 matrix products / convolutions.
            matmul_available_memory_proportion, convolution_available_memory_proportion:
                PopLibs' availableMemoryProportion (0 .. 1) the tile model plans matrix
                products / convolutions with (None: the preset's, 0.6).
            floating_point_behaviour: ``inv``, ``div0``, ``oflo``, ``esr``, ``nanoo`` flags
                (``IPUConfig.floating_point_behaviour``); unnamed flags stay off.
            stochastic_rounding_seed: seed of stochastic rounding (0: from the program).
            replicas: how many replicas run the program at once, one per attached IPU
                (1: not replicated); every output then has a leading dimension of replicas.
            pipeline: a pipelined program's stages (``tf_ipu.pipelining.plan``: "stages",
                "stage_ipus", "ipus_per_replica", "schedule", "micro_batches",
                "recomputation", "stage_memory_proportions"); the module's instructions
                carry their stage.
            recomputation: ``IPUConfig.allow_recompute`` for a program without a pipeline
                (the tile model's cheap remaking; a pipeline says its own).
            instances: the ``tf-ipu-run`` instances whose servers run the program as one
                program of ``instances x replicas`` replicas (1: this server's only).

        Returns:
            A ``CompiledProgram``.

        Raises:
            UnsupportedOpError, OutOfMemoryError, InvalidArgumentError,
            FailedPreconditionError (no IPUs attached).
        """
        opts = device_pb2.CompileOptions()
        if options is not None:
            opts.CopyFrom(options)
        opts.refuse_opcodes.extend(refuse_opcodes)
        if fault_inject_opcode:
            opts.fault_inject_opcode = fault_inject_opcode
        if allow_out_of_memory:
            opts.allow_out_of_memory = True
        if matmul_partials_type:
            opts.matmul_partials_type = matmul_partials_type
        if convolution_partials_type:
            opts.convolution_partials_type = convolution_partials_type
        if matmul_available_memory_proportion is not None:
            opts.matmul_available_memory_proportion = float(matmul_available_memory_proportion)
        if convolution_available_memory_proportion is not None:
            opts.convolution_available_memory_proportion = float(convolution_available_memory_proportion)
        for name, value in (floating_point_behaviour or {}).items():
            if name not in ("inv", "div0", "oflo", "esr", "nanoo"):
                raise ValueError(f"floating_point_behaviour: unknown flag {name!r}.")
            if value:
                setattr(opts.floating_point_behaviour, name, True)
        if stochastic_rounding_seed:
            opts.stochastic_rounding_seed = int(stochastic_rounding_seed)
        if replicas > 1:
            opts.replicas = int(replicas)
        if instances > 1:
            opts.instances = int(instances)
        opts.recomputation = bool(recomputation)
        if pipeline:
            opts.pipeline_stages = int(pipeline["stages"])
            opts.stage_ipus.extend(int(i) for i in pipeline["stage_ipus"])
            opts.ipus_per_replica = int(pipeline["ipus_per_replica"])
            opts.pipeline_schedule = str(pipeline["schedule"])
            opts.micro_batches = int(pipeline["micro_batches"])
            opts.recomputation = bool(pipeline.get("recomputation", False))
            offload = pipeline.get("offload")
            opts.optimizer_state_offload = {True: "on", False: "off", None: "auto"}.get(
                offload, str(offload or "auto"))
            opts.optimizer_state_sharding = bool(pipeline.get("sharding", False))
            # PipelineStageOptions' availableMemoryProportion, per stage and pass.
            for phase, stage, kind, value in pipeline.get("stage_memory_proportions") or ():
                opts.stage_memory_proportions.add(phase=phase, stage=int(stage), kind=kind,
                                                  proportion=float(value))
        request = device_pb2.CompileRequest(session_id=self.session_id, options=opts)
        limit = self._session.max_message_bytes if self._session else 0
        if limit > 0 and module.ByteSize() > limit // 2:  # too big for one message: a blob
            request.module_blob_id = self.data.put_blob(module.SerializeToString())
        else:
            request.module.CopyFrom(module)
        # Stoppable as a run is: cancel_running (Ctrl-C) stops the server's planning too.
        reply = self._call_stoppable("Compile", request, self.run_timeout)
        e = reply.estimate
        outputs = [_spec(o) for o in reply.outputs]
        aliased = {int(a.output_index) for a in reply.aliases}
        self._outputs_of[reply.executable_id] = (outputs, aliased)
        return CompiledProgram(
            executable_id=reply.executable_id,
            cache_hit=reply.cache_hit,
            parameters=[_spec(s) for s in reply.parameters],
            outputs=outputs,
            aliases={int(a.output_index): int(a.parameter_number) for a in reply.aliases},
            estimate=Estimate(
                ipu_version=e.ipu_version, tiles_per_ipu=e.tiles_per_ipu, clock_hz=e.clock_hz,
                cycles=e.cycles, seconds=e.seconds, peak_tile_bytes=e.peak_tile_bytes,
                tile_bytes_limit=e.tile_bytes_limit, total_bytes=e.total_bytes,
                fits=e.fits or _unknown_fit(e.json), json=e.json,
            ),
            compile_seconds=reply.compile_seconds,
        )

    def counters(self) -> dict[str, int]:
        """The server's counters (``sessions_opened``, ``compiles``, ``cache_hits``,
        ``executions``, ``bytes_in``, ``bytes_out``, ``errors.<CODE>``, ...)."""
        return dict(self._call("GetCounters", device_pb2.Empty()).counters)

    def prometheus_text(self) -> str:
        """The server's counters in the Prometheus text format."""
        return self._call("GetCounters", device_pb2.Empty()).prometheus_text


def _unknown_fit(report: str) -> bool | None:
    """For a reply whose ``fits`` is False: None if its report says the fit is unknown (the
    tile model failed; the proto's bool cannot say so), else False."""
    try:
        return None if report and json.loads(report).get("fits", False) is None else False
    except (ValueError, AttributeError):
        return False
