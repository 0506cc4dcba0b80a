"""The process's device runtime: the link between IpuExecute kernels and the device server.

    Keras traced function -> IpuExecute kernel (C++) -> ctypes -> DeviceRuntime.execute
        -> tf_ipu.client.DeviceClient ==gRPC==> device server (emulated IPUs)

One runtime per process. It owns the connection (and the local server it may have
started), the session and its attached IPUs, the programs registered by kernels (compiled
lazily per session, cached by content), and the record of where each variable's newest value
is (``tf_ipu.residency``), so that:

- variables stay on the device between calls: a call sends its arguments and gets back its
  results (losses, metrics, predictions), never the variables it updated;
- a host read of a variable the device has updated (``numpy()``, ``get_weights()``, a
  checkpoint) fetches it first (``refresh``), and ``sync_to_host`` fetches all of them, at
  every epoch end and checkpoint (``tf_ipu.keras_integration``);
- a host write (``assign``, ``set_weights``, a learning-rate change) marks the variable, which
  is uploaded before the next call that uses it; no bytes are compared for variables whose
  writes are hooked (``tf_ipu.variables``).
- an output whose size depends on the data (a bounded dynamic shape, e.g. ``tf.boolean_mask``)
  comes back from the server at its run-time size; the kernel's buffer for it is at the
  bound, so the value fills its leading corner (zeros the rest) and its run-time dims go to
  an extra int32 output the traced function slices by (``tf_ipu.lowering.program``).

Losing the session now costs what the device held and the host had not read back, bounded by
the sync points. When a call finds the server gone (UNAVAILABLE: it died, is restarting, or is
shutting down) the error reaches the caller at once (Keras raises it from ``fit``), naming what
was lost and the last step whose weights the host holds; the connection is dropped and the
host's copies become the truth. The next device call or ``configure_ipu_system()`` connects
again with the last configuration, opens a new session, re-attaches, recompiles programs as
they are used and uploads every variable from the host. When a call finds the server up but
the session forgotten (its lease ran out, or the server restarted between calls), it fails
the same way with ``DeviceStateLostError`` if the device held newer values, else reconnects
and retries once: nothing ran on the device, so nothing is lost.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_server.protocol import ir_pb2
from tf_ipu import errors, interrupt
from tf_ipu.client import DeviceClient, VariableRef
from tf_ipu.config import IPU_VERSIONS, DeviceConnectionType
from tf_ipu.residency import Residency

_log = logging.getLogger("tf_ipu")


@dataclass
class ProgramEntry:
    """A program registered by a kernel (or by lowering), by content."""

    digest: str
    program: bytes
    name: str
    params: list[dict[str, Any]]
    executable_id: str | None = None     # valid in the current session only
    aliases: dict[int, int] = field(default_factory=dict)
    estimate: Any = None
    cache_hit: bool = False
    reported_for: tuple | None = None    # the configuration its last report was made for
    # Outputs of data-dependent size (the signature's "dynamic_outputs"): output index ->
    # which dims are dynamic, in the order of the kernel's extra dims outputs.
    dynamic_outputs: dict[int, tuple[bool, ...]] = field(default_factory=dict)
    # The entry outputs the kernel has, in its order (the signature's "op_outputs"; the
    # new values of resident variables stay on the device and are not among them).
    op_outputs: list[int] | None = None
    # Replicas that run it at once (the signature's "replicas"): its outputs then have a
    # leading dimension of replicas.
    replicas: int = 1
    # A pipelined program's stages (the signature's "pipeline", tf_ipu.pipelining.plan).
    pipeline: dict[str, Any] | None = None
    # The IPUs it runs on (program_ipus): attached for it when the runtime configured itself.
    ipus: int = 1


def program_ipus(signature: dict[str, Any]) -> int:
    """The IPUs a program of this (parsed) signature needs: its replicas times the IPUs one
    replica spans (a pipeline's ``ipus_per_replica``), or the count an export recorded
    (``"ipus"``, tf_ipu.serving), whichever is more."""
    pipeline = signature.get("pipeline") or {}
    derived = max(1, int(signature.get("replicas", 1) or 1)) * max(
        1, int(pipeline.get("ipus_per_replica", 1) or 1))
    return max(derived, int(signature.get("ipus", 1) or 1))


@dataclass
class CompileReport:
    """What one compile reported: the program and the emulator's estimate."""

    name: str
    digest: str
    ipu_version: str
    tiles_per_ipu: int
    cycles: int
    seconds: float
    peak_tile_bytes: int
    tile_bytes_limit: int
    total_bytes: int
    fits: bool | None  # peak <= SRAM; None: unknown (the tile model failed, details["failure"])
    cache_hit: bool
    compile_seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    data_path: str = ""  # how tensors cross to the device (tf_ipu.transport)

    @property
    def replicas(self) -> int:
        """Replicas the program runs as (1: not replicated)."""
        return int(self.details.get("replicas", 1) or 1)

    @property
    def stages(self) -> int:
        """Pipeline stages of the program (1: not pipelined)."""
        return int(self.details.get("pipeline_stages", 1) or 1)

    @property
    def ipus(self) -> int:
        """The IPUs the program runs on: its replicas x the IPUs one replica spans."""
        return self.replicas * int(self.details.get("ipus_per_replica", 1) or 1)

    @property
    def all_reduce_share(self) -> float:
        """The replicas' all-reduces' share of the call's estimated time (0 for one)."""
        cycles = float(self.details.get("cycles", 0) or 0)
        return float(self.details.get("all_reduce_cycles", 0) or 0) / cycles if cycles else 0.0

    def summary(self) -> str:
        replicated = ""
        if self.stages > 1:
            replicated = (f" as a pipeline of {self.stages} stages on IPUs "
                          f"{self.details.get('stage_ipus')} ({self.ipus} IPUs)")
        if self.replicas > 1:
            replicated += (f" x {self.replicas} replicas on "
                           f"{self.details.get('system') or 'plain IPUs'}, all-reduce "
                           f"{self.all_reduce_share:.1%} of the call; memory per IPU")
        return (
            f"{self.name} [{self.digest}] on {self.ipu_version} ({self.tiles_per_ipu} tiles)"
            f"{replicated}: "
            f"est. {self.cycles:,} cycles = {self.seconds * 1e3:.3f} ms per device call; "
            f"peak tile memory {self.peak_tile_bytes:,} B of {self.tile_bytes_limit:,} B"
            f"{self._verdict()}; total {self.total_bytes:,} B"
            + (f"; data path: {self.data_path}" if self.data_path else "")
        )

    def _verdict(self) -> str:
        """"", " (DOES NOT FIT)", its margin, or " (FIT UNKNOWN: ...)"."""
        if self.fits is None:
            return f" (FIT UNKNOWN: {self.details.get('failure') or 'the tile model failed'})"
        if self.fits:
            return ""
        if self.details.get("within_margin"):
            return (f" (DOES NOT FIT: {self.peak_tile_bytes - self.tile_bytes_limit:,} B over, "
                    f"within the tile model's margin of {self.details.get('margin_bytes', 0):,} B: "
                    "it runs)")
        return " (DOES NOT FIT)"

    def save_html(self, path: str) -> str:
        """Writes the emulator's full report (``details``) as a self-contained HTML page."""
        from tf_ipu.report import save_html

        return save_html(self, path)


def local_server_args(cfg: Any) -> list[str]:
    """Command line arguments of the embedded device server for configuration ``cfg``:
    ``--system`` when ``cfg.system`` names one, and ``--executable-cache-path`` when
    ``cfg.resolved_executable_cache_path`` (the IPUConfig field, else
    ``--executable_cache_path`` of ``$TF_POPLAR_FLAGS``) names a folder."""
    args = ["--system", cfg.system] if getattr(cfg, "system", "") else []
    path = getattr(cfg, "resolved_executable_cache_path", "") if cfg is not None else ""
    if path:
        args += ["--executable-cache-path", os.path.abspath(os.path.expanduser(path))]
    return args


def _flag(args: list[str], name: str, absent: str) -> str:
    return args[args.index(name) + 1] if name in args else absent


def _cache_folder(args: list[str]) -> str:
    return _flag(args, "--executable-cache-path", "none")


class DeviceRuntime:
    """Process-wide connection to the device server (see module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._client: DeviceClient | None = None
        self._local_server: Any = None
        self._local_server_args: list[str] = []  # what the embedded server was started with
        self._told_args: list[list[str]] = []  # other arguments a configuration asked for
        self._config_key: tuple | None = None
        self._config: Any = None
        # The configuration this runtime made itself (no configure_ipu_system() call): it
        # attaches more IPUs when a program needs them (_attach_for).
        self._default_config: Any = None
        self._programs: list[ProgramEntry] = []
        self._by_digest: dict[str, int] = {}
        self._refs: dict[str, VariableRef] = {}  # variable key -> its binding, made once
        self.residency = Residency()
        self.reports: list[CompileReport] = []
        self.device_calls = 0
        self._stats = {"calls": 0, "client_seconds": 0.0, "device_seconds": 0.0}
        self._in_flight = 0
        self.interrupts = 0   # Ctrl-Cs that cancelled a device call
        self._close_registered = False
        self._chasing = False  # a thread cancels calls while a Ctrl-C is pending
        # Newer device values a closing session could not give back (reconfigure, shutdown):
        # the next device call raises it once, naming the step the host's copies hold.
        self._pending_loss: errors.DeviceStateLostError | None = None

    # -- configuration -------------------------------------------------------------------
    @property
    def configured(self) -> bool:
        """Whether the IPU system was configured (a lost connection is re-made on use)."""
        return self._config is not None

    @property
    def connected(self) -> bool:
        """Whether a session on the device server is open now."""
        return self._client is not None

    def replication_factor(self) -> int:
        """The IPUs the user's configuration attaches (``select_ipus`` or
        ``auto_select_ipus``): the replicas of a program on one IPU, as Graphcore derives
        them. A pipelined program's replica spans several IPUs, so its callers divide this by
        the IPUs one replica spans (``tf_ipu.replication.replicas_for``, the serving exports).
        Configures the system first if it is not. Without a configuration from the user, 1
        (IPUs attached for a loaded program that needs more, ``_attach_for``, are its own)."""
        if self._config is None:
            self.ensure_configured()
        cfg = self._config
        if cfg is None or cfg is self._default_config:
            return 1
        return _ipus_of(cfg)

    def world_instances(self) -> int:
        """The instances whose replicas run this process's programs as one program: those of
        the ``tf-ipu-run`` when the configuration in force was made for it
        (``popdist.tensorflow.set_ipu_config``), else 1 (this instance's replicas only)."""
        from tf_ipu.distributed import identity, popdist_api

        cfg = self._config
        if cfg is None or not identity.is_multi_instance() or not popdist_api.is_distributed(cfg):
            return 1
        return identity.getNumInstances()

    @property
    def client(self) -> DeviceClient:
        if self._client is None:
            raise errors.DeviceError(
                "FAILED_PRECONDITION",
                "The IPU system is not configured: call IPUConfig().configure_ipu_system().",
            )
        return self._client

    @property
    def config(self) -> Any:
        return self._config

    def configure(self, cfg: Any, on_demand_now: bool = False) -> None:
        """Connects, opens a session and attaches IPUs as ``cfg`` says (reusing what it can:
        a healthy connection with the same configuration is kept). With
        ``device_connection.type = ON_DEMAND`` the connection waits for the first device
        call (``on_demand_now`` is that call)."""
        from tf_ipu.config import DeviceConnectionType, default_tiles

        with self._lock:
            if cfg.device_connection.type is DeviceConnectionType.ON_DEMAND and not on_demand_now:
                if self._client is not None:
                    self._disconnect()
                self._config = cfg
                self._config_key = None
                self.ensure_handler()
                return
            address = cfg.resolved_server_address
            token = cfg.resolved_server_token
            key = (
                address,
                cfg.auto_select_ipus,
                tuple(cfg.select_ipus),
                cfg.system,
                cfg.ipu_version,
                cfg.ipu_model.tiles_per_ipu,
                tuple(cfg.debug.refuse_opcodes),
                cfg.debug.fault_inject_opcode,
                cfg.debug.allow_out_of_memory,
                repr(cfg.compile_numerics()),
                token,
                cfg.server_tls_ca,
                cfg.resolved_data_path,
            )
            if self._client is not None and key == self._config_key and self._client.healthy():
                self._config = cfg
                return
            if address is None:
                address = self._ensure_local_server(cfg)
            if self._client is not None and self._client.address == address:
                self._disconnect()  # release this server's IPUs before attaching again
            try:
                client = DeviceClient(address, timeout=cfg.connect_timeout, token=token,
                                      tls_ca=cfg.server_tls_ca, data_path=cfg.resolved_data_path)
            except OSError as e:
                raise ValueError(
                    f"IPUConfig.server_tls_ca: cannot read {cfg.server_tls_ca!r}: {e}"
                ) from None
            try:
                client.wait_for_server(cfg.connect_timeout)
                client.open_session()
                hosted = client.session.system
                if cfg.system and hosted != cfg.system:
                    raise errors.FailedPreconditionError(
                        f"IPUConfig.system is {cfg.system!r} but the device server at "
                        f"{address} hosts {hosted or f'{client.session.num_ipus} IPUs'!r}: "
                        f"start it with --system {cfg.system}, or leave IPUConfig.system "
                        f"'' to use its IPUs.", address)
                client.attach(
                    cfg.auto_select_ipus,
                    cfg.ipu_version,
                    cfg.ipu_model.tiles_per_ipu or default_tiles(cfg.ipu_version),
                    ipu_ids=cfg.select_ipus,
                )
            except BaseException:
                client.close()
                raise
            self._disconnect()  # a previous connection to another server, if any
            self._client = client
            if not self._close_registered:  # e.g. a script ended by Ctrl-C: free the IPUs now
                atexit.register(self._close_at_exit)
                self._close_registered = True
            self._config = cfg
            self._config_key = key
            self.residency.lose_session()  # all stale values were fetched by _disconnect
            for entry in self._programs:
                entry.executable_id = None
            self.ensure_handler()
            interrupt.on_interrupt(self._on_interrupt)
            interrupt.install()
            if self._pending_loss is not None:  # the old session's newer values are gone
                loss = self._pending_loss
                if not cfg.device_connection.allow_stale_weights:
                    self._pending_loss = None
                    raise loss
                _log.warning("tf_ipu: IPUConfig.device_connection.allow_stale_weights is set: "
                             "training goes on from the host's copies (%s)", loss)
                self._pending_loss = None

    def _on_interrupt(self) -> None:
        """Ctrl-C (on the watcher thread, tf_ipu.interrupt): cancels the device call in
        progress, which the device stops at its next step."""
        with interrupt.cancelling() as now:
            client = self._client
            if now and client is not None and client.cancel_running():
                self.interrupts += 1
                _log.info("tf_ipu: Ctrl-C: the device call stops at its next step")
        if interrupt.pending() and not self._chasing:
            self._chasing = True
            threading.Thread(target=self._cancel_while_pending, name="tf-ipu-sigint-cancel",
                             daemon=True).start()

    def _cancel_while_pending(self) -> None:
        """Until the KeyboardInterrupt is raised (30 s at most): cancels any device call that
        started after the Ctrl-C all the same (it had checked for one just before)."""
        try:
            end = time.monotonic() + 30.0
            while interrupt.pending() and time.monotonic() < end:
                time.sleep(0.05)
                with interrupt.cancelling() as now:
                    client = self._client
                    if now and interrupt.pending() and client is not None \
                            and client.cancel_running():
                        self.interrupts += 1
        finally:
            self._chasing = False

    def _close_at_exit(self) -> None:
        """At exit: closes the session, so that its IPUs are free for the next client at once
        (not at its lease's end). Nothing is read back: the process is ending."""
        client = self._client
        if client is not None and self._local_server is None:  # else shutdown() closes it
            try:
                client.close()
            except Exception:  # the server may be gone
                pass

    def ensure_configured(self) -> None:
        """Connects if there is no connection: with the last configuration (after a lost
        connection), else with defaults (``$TF_IPU_SERVER`` or a local server)."""
        if self._client is None:
            from tf_ipu.config import IPUConfig

            if self._config is not None and self._config_key is not None:
                _log.info("tf_ipu: reconnecting to the device server")
            if self._config is None:
                self._default_config = IPUConfig()
            self.configure(self._config if self._config is not None else self._default_config,
                           on_demand_now=True)

    def _attach_for(self, entry: ProgramEntry) -> None:
        """Makes sure the session holds the IPUs ``entry`` needs. A process that configured
        nothing (e.g. it loaded a SavedModel: its programs carry their IPU count, as
        Graphcore's exported executables did) attaches them now; with a configuration that
        attaches fewer, an error says how many to configure."""
        needed = entry.ipus
        if needed <= 1:
            return
        cfg = self._config
        if cfg is None or cfg is self._default_config:
            if cfg is not None and _ipus_of(cfg) >= needed:
                return
            from tf_ipu.config import IPUConfig

            chosen = IPUConfig()
            chosen.auto_select_ipus = needed
            _log.info("tf_ipu: %s runs on %d IPUs (%s): attaching them", entry.name, needed,
                      _layout(entry))
            self._default_config = chosen
            self.configure(chosen, on_demand_now=True)
            return
        attached = _ipus_of(cfg)
        if attached < needed:
            raise errors.FailedPreconditionError(
                f"{entry.name}: the program runs on {needed} IPUs ({_layout(entry)}), but the "
                f"IPU system is configured with {attached} IPU{'s' if attached != 1 else ''}: "
                f"set IPUConfig.auto_select_ipus = {needed} before configure_ipu_system() (or "
                f"configure nothing: the program then attaches the {needed} IPUs itself).",
                self._client.address if self._client is not None else "",
                "too-few-ipus")

    def _drop_connection(self, error: errors.DeviceError) -> errors.DeviceError:
        """Forgets a connection whose server is gone or forgot the session; the next
        device call (or ``configure``) makes a new one and re-uploads every variable.
        Returns the error to raise (naming what was lost), or ``error`` itself."""
        client = self._client
        if client is None:
            return error
        lost = self.residency.lose_session()
        _log.warning(
            "tf_ipu: lost the session on the device server at %s (%s: %s); %s The next "
            "device call reconnects and uploads every variable again from the host's copies.",
            client.address, error.code, error.message,
            lost.describe() if lost else "nothing was lost.",
        )
        client.abandon()
        self._client = None
        self._config_key = None
        for entry in self._programs:
            entry.executable_id = None
        if lost is None:
            return error
        text = f"{error.message}; lost with the session: {lost.describe()}"
        if error.code == "UNAVAILABLE":
            return type(error)(text, error.address, error.kind) if isinstance(
                error, errors._CodedError) else errors.DeviceError(error.code, text, error.address, error.kind)
        return errors.DeviceStateLostError(
            f"The session on the device server was lost ({error.code}: {error.message}); "
            f"{lost.describe()}", error.address, "device-state-lost",
        )

    def _on_device(self, fn: Any) -> Any:
        """Runs ``fn()`` (device calls through ``self.client``) with the connection rules of
        the module docstring: a lost server drops the connection and raises; a forgotten
        session drops it and raises if the device held newer values, else reconnects and
        retries once."""
        for attempt in (0, 1):
            self.ensure_configured()
            if self._pending_loss is not None:  # said once: the host's copies are the truth now
                loss, self._pending_loss = self._pending_loss, None
                raise loss
            try:
                return fn()
            except errors.DeviceError as e:
                if not _connection_lost(e):
                    raise
                raised = self._drop_connection(e)
                if attempt or e.code == "UNAVAILABLE" or raised is not e:
                    raise raised from None
        raise AssertionError("unreachable")

    def embedded_server_address(self) -> str:
        """The address of this process's embedded device server, started now if it does not
        run (the ONNX front end, ``tf_ipu.onnx``, shares it with Keras programs)."""
        with self._lock:
            return self._ensure_local_server(self._config)

    def _ensure_local_server(self, cfg: Any = None) -> str:
        """The address of the embedded server, started now if it does not run (with the
        disk cache folder of ``cfg``, see ``local_server_args``). A running one keeps the
        folder it was started with: a later configuration asking for another one is told
        so (once) and shares the running server's."""
        from tf_ipu.local_server import start_local_server

        args = local_server_args(cfg)
        if (self._local_server is not None and self._local_server.alive()
                and _flag(args, "--system", "") != _flag(self._local_server_args, "--system", "")):
            # Another system: other IPUs. Read back what only the device holds, then restart.
            _log.info("tf_ipu: restarting the embedded device server with system %s",
                      _flag(args, "--system", "(16 IPUs of any version)"))
            self._disconnect()
            self._local_server.stop()
            self._local_server = None
        if self._local_server is not None and self._local_server.alive():
            if args != self._local_server_args and args not in self._told_args:
                self._told_args.append(args)
                _log.warning(
                    "tf_ipu: the embedded device server keeps the executable cache folder it "
                    "was started with (%s); IPUConfig.executable_cache_path (or "
                    "TF_POPLAR_FLAGS) now says %s, which takes effect when it next starts "
                    "(tf_ipu.get_runtime().shutdown(), then configure again).",
                    _cache_folder(self._local_server_args), _cache_folder(args))
            return self._local_server.address
        self._local_server = start_local_server(num_ipus=16, ipu_version="ipu2", extra_args=args)
        self._local_server_args = args
        # atexit runs last-registered first: close the session (and its heartbeat) before
        # the local server, registered by start_local_server, is stopped.
        atexit.register(self.shutdown)
        return self._local_server.address

    def _disconnect(self) -> None:
        if self._client is not None:
            try:
                # Nothing is lost by a close: fetch what only the device holds first.
                self._refresh_keys(self.residency.stale_keys(), guarded=False)
            except Exception as e:  # the server may be gone: what it held is lost then
                lost = self.residency.lose_session()
                what = lost.describe() if lost else "nothing was lost."
                _log.error("tf_ipu: could not read the device's variables back before closing "
                           "the session (%s: %s); %s", type(e).__name__, e, what)
                if lost is not None:
                    self._pending_loss = errors.DeviceStateLostError(
                        f"The session on the device server was closed (a new configuration or "
                        f"shutdown) but its variables could not be read back ({type(e).__name__}: "
                        f"{e}); {what}", self._client.address, "device-state-lost")
            try:
                self._client.close()
            except Exception:  # the server may be gone; nothing to release then
                pass
            self._client = None
            self._config_key = None

    def shutdown(self) -> None:
        """Closes the session and stops a local server this process started."""
        with self._lock:
            self._disconnect()
            if self._local_server is not None:
                self._local_server.stop()
                self._local_server = None

    # -- programs ------------------------------------------------------------------------
    def ensure_handler(self) -> None:
        """Makes this runtime the handler of IpuExecute kernels (if another is installed,
        e.g. by a test, it is replaced)."""
        import tf_ipu_ops

        # Ctrl-C reaches device calls from the start: a SavedModel loaded in a fresh process
        # configures the system lazily, from the kernel, off the main thread.
        interrupt.on_interrupt(self._on_interrupt)
        interrupt.install()
        current = tf_ipu_ops.get_device_handler()
        if isinstance(current, _Handler) and current.runtime is self:
            return
        tf_ipu_ops.set_device_handler(_Handler(self))

    def register_program(self, program: bytes, signature: str) -> int:
        """Registers a program by content; returns its id (the same for the same bytes)."""
        sig = json.loads(signature)
        replicas = int(sig.get("replicas", 1))  # a pipeline's stages are in the program
        # The same module run by several replicas is another executable.
        digest = hashlib.sha256(program + (f"|replicas={replicas}".encode() if replicas > 1
                                           else b"")).hexdigest()
        with self._lock:
            if digest in self._by_digest:
                return self._by_digest[digest]
            entry = ProgramEntry(
                digest=digest,
                program=program,
                name=str(sig.get("name", "program")),
                params=list(sig["params"]),
                dynamic_outputs={
                    int(d["output"]): tuple(bool(f) for f in d["dynamic"])
                    for d in sig.get("dynamic_outputs", ())
                },
                op_outputs=[int(k) for k in sig["op_outputs"]] if "op_outputs" in sig else None,
                replicas=replicas,
                pipeline=sig.get("pipeline"),
                ipus=program_ipus(sig),
            )
            self._programs.append(entry)
            pid = len(self._programs) - 1
            self._by_digest[digest] = pid
            return pid

    def compile(self, program: bytes, signature: str) -> CompileReport:
        """Registers and compiles a program now (errors surface here, at lowering time)."""
        pid = self.register_program(program, signature)
        _check_interrupt(signature)
        with self._lock:
            entry = self._programs[pid]
            self._attach_for(entry)
            self._on_device(lambda: self._compile_entry(entry))
            return self._report_of(entry)

    def _compile_entry(self, entry: ProgramEntry) -> None:
        if entry.executable_id is not None:
            return
        _check_interrupt(entry.name)
        cfg = self._config
        module = ir_pb2.Module.FromString(entry.program)
        with _CompileProgress(entry.name):
            compiled = self.client.compile(
                module,
                refuse_opcodes=tuple(cfg.debug.refuse_opcodes) if cfg else (),
                fault_inject_opcode=cfg.debug.fault_inject_opcode if cfg else "",
                allow_out_of_memory=cfg.debug.allow_out_of_memory if cfg else False,
                recomputation=bool(getattr(cfg, "allow_recompute", False)),
                **(cfg.compile_numerics() if cfg else {}),
                replicas=entry.replicas,
                pipeline=entry.pipeline,
                instances=self.world_instances(),
            )
        entry.executable_id = compiled.executable_id
        entry.aliases = dict(compiled.aliases)
        entry.estimate = compiled.estimate
        entry.cache_hit = compiled.cache_hit
        if entry.reported_for == self._config_key:
            return  # recompiled after a reconnect: same program, same report
        entry.reported_for = self._config_key
        report = self._report_of(entry, compiled.compile_seconds)
        self.reports.append(report)
        if report.fits is None or report.details.get("within_margin"):  # it runs; say so
            _log.warning("tf_ipu: compiled %s", report.summary())
        else:
            _log.info("tf_ipu: compiled %s", report.summary())

    def _report_of(self, entry: ProgramEntry, compile_seconds: float = 0.0) -> CompileReport:
        est = entry.estimate
        details: dict[str, Any] = {}
        if getattr(est, "json", ""):
            try:
                details = json.loads(est.json)
            except ValueError:
                details = {}
        return CompileReport(
            name=entry.name,
            digest=entry.digest[:12],
            ipu_version=IPU_VERSIONS.get(est.ipu_version, est.ipu_version),
            tiles_per_ipu=est.tiles_per_ipu,
            cycles=int(est.cycles),
            seconds=float(est.seconds),
            peak_tile_bytes=int(est.peak_tile_bytes),
            tile_bytes_limit=int(est.tile_bytes_limit),
            total_bytes=int(est.total_bytes),
            fits=None if est.fits is None else bool(est.fits),
            cache_hit=entry.cache_hit,
            compile_seconds=compile_seconds,
            details=details,
            data_path=self._client.data.describe() if self._client is not None else "",
        )

    def execute(self, pid: int, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        """Runs program ``pid``: uploads changed variables, executes, fills ``outputs``.

        ``outputs`` are the kernel's buffers: one per program output, at its static shape
        (a dynamic output's at its bound), then one int32[rank] per dynamic output for its
        run-time dims (see tf_ipu.lowering.program). A dynamic output's value goes into the
        leading corner of its buffer, zeros fill the rest.
        """
        with self._lock:
            entry = self._programs[pid]
            self._attach_for(entry)
            if self._answer_without_device(entry, outputs):
                return
            if len(inputs) != len(entry.params):
                raise errors.InvalidArgumentError(
                    f"{entry.name}: the kernel passed {len(inputs)} inputs, the program "
                    f"has {len(entry.params)} parameters."
                )
            start = time.perf_counter()
            if threading.get_ident() == _MAIN_THREAD:
                interrupt.install()  # in case the wakeup fd was replaced since
            _check_interrupt(entry.name)
            self._in_flight += 1
            try:
                with interrupt.held_back():  # KeyboardInterrupt once TF has returned
                    results = self._on_device(lambda: self._run(entry, inputs))
            except KeyboardInterrupt:
                # Ctrl-C while this (main) thread waited: stop the call on the device too.
                self._on_interrupt()
                raise
            finally:
                self._in_flight -= 1
            self.device_calls += 1
            if entry.op_outputs is not None:
                results = [results[k] for k in entry.op_outputs]
            n_dims = len(entry.dynamic_outputs)
            if len(results) + n_dims != len(outputs):
                raise errors.DeviceError(
                    "INTERNAL",
                    f"{entry.name}: the device returned {len(results)} outputs, "
                    f"the kernel expects {len(outputs) - n_dims}.",
                )
            for k, (out, res) in enumerate(zip(outputs, results, strict=False)):
                if res.shape == out.shape:
                    out[...] = res
                elif k in entry.dynamic_outputs:
                    _fill_corner(out, res, entry.dynamic_outputs[k], f"{entry.name}: output {k}")
                else:
                    raise errors.DeviceError(
                        "INTERNAL",
                        f"{entry.name}: the device returned output {k} with shape "
                        f"{list(res.shape)}, the kernel expects {list(out.shape)}.",
                    )
            for k, dims in zip(entry.dynamic_outputs, outputs[len(results):], strict=True):
                dims[...] = results[k].shape
            stats = self._stats
            stats["calls"] += 1
            stats["client_seconds"] += time.perf_counter() - start
            stats["device_seconds"] += self.client.last_device_seconds

    def _answer_without_device(self, entry: ProgramEntry, outputs: list[np.ndarray]) -> bool:
        """``device_connection.type`` PRE_COMPILE: compile, answer zeros (True); NEVER: an
        error; otherwise False (the call goes to the device)."""
        kind = self._config.device_connection.type if self._config is not None else None
        if kind not in _WITHOUT_DEVICE:
            return False
        self._on_device(lambda: self._compile_entry(entry))
        if kind is DeviceConnectionType.NEVER:
            raise errors.FailedPreconditionError(
                f"{entry.name}: IPUConfig.device_connection.type is NEVER: programs are "
                f"compiled and sized (strategy.reports), never run."
            )
        for out in outputs:
            out[...] = 0
        return True

    def call_in_flight(self) -> bool:
        """Whether a device call is running now (from entry into ``execute`` to its end)."""
        return self._in_flight > 0

    def call_stats(self) -> dict[str, float]:
        """Device calls so far: how many, their wall time as this runtime saw them (entry
        into ``execute`` to its return) and the time the server spent running them."""
        with self._lock:
            return dict(self._stats)

    def _run(self, entry: ProgramEntry, inputs: list[np.ndarray]) -> list[Any]:
        """One device call: compile if needed, upload the variables the host wrote (or the
        device does not hold), execute. Updated variables stay on the device."""
        self._compile_entry(entry)
        _check_interrupt(entry.name)  # (a Ctrl-C during the compile or the connecting)
        res = self.residency
        bindings: list[Any] = []
        writes: dict[str, np.ndarray] = {}
        states: dict[int, Any] = {}
        for number, (value, param) in enumerate(zip(inputs, entry.params, strict=True)):
            if param["kind"] == "var":
                st = res.get(param["key"])
                states[number] = st
                if res.needs_upload(st, value):
                    writes[st.key] = np.array(value, copy=True)
                ref = self._refs.get(st.key)
                if ref is None:
                    ref = self._refs[st.key] = VariableRef(st.key)
                bindings.append(ref)
            else:
                bindings.append(value)
        # Watched variables the traced call assigns on the host need their new values back.
        want_back = any(
            states[p].watched for p in entry.aliases.values() if p in states
        )
        client = self.client
        try:
            if writes:
                client.write_variables(writes)
                for key, value in writes.items():
                    res.uploaded(res.states[key], value)
            results = client.execute(
                entry.executable_id, bindings, return_updated_variables=want_back,
                run_deadline=self._config.run_deadline if self._config is not None else 0.0,
            )
        except errors.DeviceError as e:
            if e.kind in _STOPPED_KINDS or e.code in ("CANCELLED", "DEADLINE_EXCEEDED"):
                # Stopped (Ctrl-C, run deadline): the device holds the variables of the last
                # step it completed, newer than the host's.
                for param_index in entry.aliases.values():
                    if param_index in states:
                        res.device_updated(states[param_index], None)
                raise
            if not _connection_lost(e):
                # The call may have run partly (e.g. a deadline passed while it ran): the
                # device's values are uncertain, so the next call uploads the host's again.
                for st in states.values():
                    if not st.stale:
                        st.on_device = False
            raise
        for out_index, param_index in entry.aliases.items():
            st = states.get(param_index)
            if st is not None:
                res.device_updated(st, results[out_index] if st.watched else None)
        if client.last_outfeeds:
            from tf_ipu import feeds

            feeds.deliver(client.last_outfeeds)
        return results

    # -- variables: host copies on demand ----------------------------------------------------
    def track(self, variable: Any) -> None:
        """Registers a host variable whose reads and writes ``tf_ipu.variables`` hooks."""
        from tf_ipu.lowering.program import variable_key

        with self._lock:
            self.residency.track(variable_key(variable), variable)

    def note_host_write(self, variable: Any) -> None:
        """The host wrote ``variable``: upload it before the next call that uses it."""
        from tf_ipu.lowering.program import variable_key

        with self._lock:
            self.residency.note_host_write(variable_key(variable))

    def forget_device_value(self, variable: Any) -> None:
        """The host is about to overwrite ``variable`` whole: no need to fetch it first."""
        from tf_ipu.lowering.program import variable_key

        with self._lock:
            self.residency.forget_device_value(variable_key(variable))

    def watch(self, variable: Any) -> None:
        """From now on, compare ``variable``'s bytes before each call (its writes are not
        hooked: a CPU graph may make them)."""
        from tf_ipu.lowering.program import variable_key

        with self._lock:
            self.residency.get(variable_key(variable)).watched = True

    def refresh(self, variables: Any) -> None:
        """Brings the host copies of ``variables`` up to date with the device (one
        ReadVariables call for those the device holds newer values of; none otherwise)."""
        from tf_ipu.lowering.program import variable_key

        with self._lock:
            keys = self.residency.stale_keys([variable_key(v) for v in variables])
            if keys:
                self._refresh_keys(keys)

    def sync_to_host(self, label: str | None = None) -> int:
        """Brings every host copy up to date; ``label`` (e.g. "step 120 (end of epoch 3)")
        then names what the host holds, in the error a lost session raises. Returns the
        number of variables fetched."""
        with self._lock:
            keys = self.residency.stale_keys()
            if keys:
                self._refresh_keys(keys)
            if label is not None:
                self.residency.host_holds = label
            return len(keys)

    def _refresh_keys(self, keys: list[str], guarded: bool = True) -> None:
        """Reads ``keys`` from the device (in messages of at most a quarter of the message
        limit) and writes them into their host variables, without marking them written.
        ``guarded``: with the connection rules of ``_on_device`` (else errors pass as
        they are)."""
        client = self._client
        if not keys or client is None:
            return
        import tensorflow as tf
        from tensorflow.python.ops import gen_resource_variable_ops

        res = self.residency
        session = client.session
        limit = max(1, (session.max_message_bytes if session and session.max_message_bytes > 0
                        else 1 << 30) // 4)
        batch: list[str] = []
        batch_bytes = 0

        def flush() -> None:
            if not batch:
                return
            read = lambda: self.client.read_variables(batch)  # noqa: E731
            values = self._on_device(read) if guarded else read()
            for key in batch:
                st = res.states[key]
                var = st.variable()
                value = values[key]
                if var is not None:
                    with tf.init_scope():
                        gen_resource_variable_ops.assign_variable_op(
                            var.handle, tf.constant(value, dtype=var.dtype)
                        )
                res.refreshed(st, int(value.nbytes))
            batch.clear()

        for key in keys:
            var = res.states[key].variable()
            nbytes = 0 if var is None else int(np.prod(var.shape)) * var.dtype.size
            if batch and batch_bytes + nbytes > limit:
                flush()
                batch_bytes = 0
            batch.append(key)
            batch_bytes += nbytes
        flush()

    def counters(self) -> dict[str, int]:
        """The host side's transfer counters: ``host_bytes_compared``,
        ``variable_bytes_uploaded``, ``variable_bytes_refreshed``, ``variables_refreshed``,
        ``device_calls``."""
        with self._lock:
            return {**self.residency.counters, "device_calls": self.device_calls}


class _CompileProgress:
    """Says on stderr that a compile is under way once it has taken ``AFTER`` seconds, then
    every ``EVERY`` seconds, and how long it took (Graphcore's compile progress bar did the
    same job): a notebook waiting for a big model's first step is not left silent."""

    AFTER = 1.0
    EVERY = 5.0

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()
        self._shown = False
        self._start = 0.0

    def __enter__(self) -> _CompileProgress:
        self._start = time.perf_counter()
        threading.Thread(target=self._watch, name="tf_ipu-compile-progress", daemon=True).start()
        return self

    def _watch(self) -> None:
        wait = self.AFTER
        while not self._done.wait(wait):
            self._shown = True
            print(f"tf_ipu: compiling {self.name} for the IPU ... "
                  f"{time.perf_counter() - self._start:.0f} s", file=sys.stderr, flush=True)
            wait = self.EVERY

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._shown:
            print(f"tf_ipu: compiled {self.name} in {time.perf_counter() - self._start:.1f} s",
                  file=sys.stderr, flush=True)


def _ipus_of(cfg: Any) -> int:
    """The IPUs configuration ``cfg`` attaches (``select_ipus`` or ``auto_select_ipus``)."""
    if cfg.select_ipus:
        return max(1, len(cfg.select_ipus))
    count = cfg.auto_select_ipus
    if isinstance(count, (list, tuple)):
        count = count[0] if count else 1
    return max(1, int(count))


def _layout(entry: ProgramEntry) -> str:
    """How ``entry`` spreads over its IPUs, for messages."""
    replicas = f"{entry.replicas} replica{'s' if entry.replicas != 1 else ''}"
    if entry.pipeline:
        return (f"a pipeline of {entry.pipeline.get('stages')} stages on IPUs "
                f"{entry.pipeline.get('stage_ipus')}, {replicas} of "
                f"{entry.pipeline.get('ipus_per_replica')} IPUs")
    return f"{replicas}, one per IPU"


def _fill_corner(out: np.ndarray, value: np.ndarray, dynamic: tuple[bool, ...], what: str) -> None:
    """Writes ``value`` (a dynamic output at its run-time size) into the leading corner of
    ``out`` (its buffer, at the bounds) and zeros elsewhere, after checking that each size is
    within its bound (a dynamic dimension) or equal to it (a static one)."""
    ok = value.ndim == out.ndim == len(dynamic) and all(
        (0 <= v <= b) if dy else v == b
        for v, b, dy in zip(value.shape, out.shape, dynamic, strict=True)
    )
    if not ok:
        bound = ",".join(("<=" if dy else "") + str(b) for b, dy in zip(out.shape, dynamic, strict=False))
        raise errors.DeviceError(
            "INTERNAL",
            f"{what}: the device returned shape {list(value.shape)}, outside the output's "
            f"bounds [{bound}] (a dynamic dimension may be smaller than its bound, never "
            f"larger).",
        )
    out[...] = 0
    out[tuple(slice(0, v) for v in value.shape)] = value


#: The main thread's ident (Ctrl-C reaches a device call made on it, ``tf_ipu.interrupt``).
_MAIN_THREAD = threading.main_thread().ident

#: ``device_connection.type`` values whose calls are answered without the device.
_WITHOUT_DEVICE = frozenset({DeviceConnectionType.PRE_COMPILE, DeviceConnectionType.NEVER})

#: Error kinds of a call the device stopped at a step boundary (or before it began); the
#: server stops a run whose client cancelled or whose deadline passed the same way.
_STOPPED_KINDS = frozenset({"cancelled", "deadline", "session-closed"})


def _connection_lost(error: errors.DeviceError) -> bool:
    """Whether ``error`` says the session is gone: the server is unreachable or shutting
    down (UNAVAILABLE), or it does not know the session (NOT_FOUND, kind unknown-session)."""
    if error.code == "UNAVAILABLE":
        return True
    return error.code == "NOT_FOUND" and (
        error.kind == "unknown-session" or error.message.startswith("No open session")
    )


def _check_interrupt(what: str) -> None:
    """Fails a device call (or compile) at once while a Ctrl-C is on its way to the main
    thread as KeyboardInterrupt (tf_ipu.interrupt): so a host loop of device calls (a
    ``tf.while_loop`` around ``strategy.run``) ends at its next call."""
    if interrupt.pending():
        if what.startswith("{"):  # a program's signature (JSON)
            what = str(json.loads(what).get("name", "program"))
        raise errors.CancelledError(
            f"{what}: not run: Ctrl-C (KeyboardInterrupt) interrupted this process's device "
            f"calls", kind="cancelled")


class _Handler:
    """Adapter from the op library's DeviceHandler protocol to the runtime."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime

    def register_program(self, program: bytes, signature: str) -> int:
        return self.runtime.register_program(program, signature)

    def execute(self, program_id: int, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        self.runtime.execute(program_id, inputs, outputs)


_RUNTIME: DeviceRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def get_runtime() -> DeviceRuntime:
    """The process's device runtime (created on first use)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = DeviceRuntime()
        return _RUNTIME
