"""Command line of the device server: ``python -m device_server`` or ``device_server``.

    python -m device_server --port 0 --port-file /tmp/port --ipus 4 --ipu-version ipu2
    python -m device_server --system dss8440      # the launch article's 16 GC2 IPUs

Runs until SIGTERM/SIGINT, or until the ``--parent-pid`` process is gone (the embedded
default, ``tf_ipu.local_server``, passes its own pid so that the server never outlives it).
Then it drains: new work is refused (UNAVAILABLE), calls in flight get ``--shutdown-grace``
seconds, and the process exits 0. Does not import TensorFlow.

Environment variables:
    TF_IPU_SERVER_TOKEN   the token clients must present (unless --token-file is given).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence

from device_server import __version__
from device_server.protocol import hardware
from device_server.server import DEFAULT_MAX_MESSAGE_BYTES, serve
from device_server.service import ServiceConfig

logger = logging.getLogger("device_server")

PARENT_POLL_SECONDS = 1.0
TOKEN_ENV = "TF_IPU_SERVER_TOKEN"
_DEFAULTS = ServiceConfig()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (see ``--help``)."""
    p = argparse.ArgumentParser(
        prog="device_server",
        description="tf_ipu device server: emulated Graphcore IPUs behind a gRPC service.",
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1, this machine only; on another "
                        "interface use --token-file and --tls-cert/--tls-key)")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (default)")
    p.add_argument("--port-file", default="",
                   help="write the bound port to this file (atomically) once serving")
    p.add_argument("--ipus", type=int, default=1, help="number of IPUs hosted (default 1)")
    p.add_argument("--system", default="", choices=["", *sorted(hardware.SYSTEMS)],
                   metavar="NAME",
                   help="host a named system instead of --ipus/--ipu-version: "
                        + ", ".join(f"{s.name} ({s.description})"
                                    for s in hardware.SYSTEMS.values()))
    p.add_argument("--ipu-version", default="ipu2",
                   help="default architecture: ipu1, ipu2 or bow (default ipu2)")
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when the process with this pid is gone (polled every second)")
    p.add_argument("--refuse-opcode", action="append", default=[], metavar="OP",
                   help="refuse this opcode in every compile (repeatable)")
    p.add_argument("--fault-inject", default="", metavar="OP",
                   help="perturb this opcode's results in every compiled program")
    p.add_argument("--allow-test-options", action="store_true",
                   help="accept clients' test switches (a Compile's fault_inject_opcode and "
                        "refuse_opcodes); "
                        "refused with PERMISSION_DENIED by default")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help=f"largest gRPC message either way; a larger request gets "
                        f"RESOURCE_EXHAUSTED (default {DEFAULT_MAX_MESSAGE_BYTES})")
    p.add_argument("--lease-seconds", type=float, default=_DEFAULTS.lease_seconds,
                   help="default session lease: a session not heard from for this long (and, "
                        "if its client asked for a connection lease, whose connection closed) "
                        f"is closed and its IPUs freed (default {_DEFAULTS.lease_seconds:g})")
    p.add_argument("--keepalive-seconds", type=float, default=_DEFAULTS.keepalive_seconds,
                   help="ping each client connection quiet for this long and close it if the "
                        "ping goes unanswered for twice that; 0: gRPC's default (2 h) and no "
                        f"connection leases (default {_DEFAULTS.keepalive_seconds:g})")
    p.add_argument("--no-connection-leases", dest="connection_leases", action="store_false",
                   help="keep sessions by their time leases only (Heartbeats), not while "
                        "their client's connection is up: use behind a proxy that pools "
                        "connections")
    p.add_argument("--cache-entries", type=int, default=_DEFAULTS.cache_entries,
                   help=f"executables kept in the server's cache (default "
                        f"{_DEFAULTS.cache_entries})")
    p.add_argument("--executable-cache-path", "--executable_cache_path",
                   dest="executable_cache_path", default="", metavar="DIR",
                   help="keep compiled programs in this folder (made with mode 0700 if absent) "
                        "across restarts; several servers may share it (default: none)")
    p.add_argument("--executable-cache-bytes", type=int,
                   default=_DEFAULTS.executable_cache_bytes, metavar="N",
                   help="bound of --executable-cache-path's entries in bytes; the least "
                        f"recently used go first (default {_DEFAULTS.executable_cache_bytes})")
    p.add_argument("--max-session-bytes", type=int, default=_DEFAULTS.max_session_bytes,
                   help="bytes of resident variables one session may hold, and the largest "
                        "array a program may make; 0 for no limit (default "
                        f"{_DEFAULTS.max_session_bytes})")
    p.add_argument("--request-deadline", type=float, default=_DEFAULTS.request_deadline_seconds,
                   help="longest a call may wait for its session's earlier call or for free "
                        "IPUs, on top of the client's deadline; 0 for the client's only "
                        f"(default {_DEFAULTS.request_deadline_seconds:g})")
    p.add_argument("--max-waiting-calls", type=int, default=_DEFAULTS.max_waiting_calls,
                   help="calls of one session that may queue behind its running call "
                        f"(default {_DEFAULTS.max_waiting_calls})")
    p.add_argument("--workers", type=int, default=16, help="RPC worker threads (default 16)")
    p.add_argument("--emulator-threads", type=int, default=0,
                   help="threads one big emulator kernel (convolution, matrix product, fused "
                        "element-wise ops) may split its work over; 0: "
                        "$TF_IPU_EMULATOR_THREADS if set, else one per CPU (default 0)")
    p.add_argument("--no-emulator-jit", dest="emulator_jit", action="store_false",
                   help="run fused element-wise ops as numpy calls instead of compiled loops "
                        "(same results, slower; also TF_IPU_EMULATOR_JIT=0)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds the calls in flight get to finish "
                        "(default 10)")
    p.add_argument("--unix-socket", default="", metavar="PATH",
                   help="also serve on this Unix socket (in a private folder); clients on this "
                        "machine move their calls there after the shared-memory probe")
    p.add_argument("--token-file", default="",
                   help=f"file holding the token clients must present as 'authorization: "
                        f"Bearer <token>' (default: ${TOKEN_ENV} if set, else no token)")
    p.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS only")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="logging level (default info)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text, or json: one JSON object a line, with one line per RPC "
                        "(method, session, status, duration, bytes) (default text)")
    p.add_argument("--mpi-world", action="store_true",
                   help="this server is a rank of an MPI job of device servers (tf-ipu-run starts "
                        "it so: rank k serves instance k); replicated programs compiled for "
                        "several instances run as one program across them (needs mpi4py). "
                        "'{rank}' in --port-file is replaced by the rank")
    p.add_argument("--version", action="version", version=f"device_server {__version__}")
    return p


def write_port_file(path: str, port: int) -> None:
    """Writes ``port`` and a newline to ``path`` atomically (temp file in the same folder,
    then rename), so a reader never sees a partial number."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".port-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def process_alive(pid: int, was_parent: bool) -> bool:
    """Whether process ``pid`` still runs.

    Args:
        pid: the process to watch.
        was_parent: ``pid`` was this process's parent at start; once the parent dies this
            process is re-parented, which is the surest sign.
    """
    if was_parent and os.getppid() != pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:  # a dead but unreaped process (zombie) still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the fields of an RPC
    record (``record.rpc``: method, session, status, duration_ms, bytes_in, bytes_out, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        rpc = getattr(record, "rpc", None)
        if isinstance(rpc, dict):
            out.update(rpc)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, log_format: str) -> None:
    """Logs to stderr at ``level``. Per-RPC records (``device_server.rpc``) of calls that
    went well show in json format, or in text format at ``debug``."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s device_server[%(process)d] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    rpc = logging.getLogger("device_server.rpc")
    if log_format == "text" and level != "debug":
        rpc.setLevel(max(logging.WARNING, root.level))
    else:
        rpc.setLevel(logging.NOTSET)


def read_token(path: str) -> str:
    """The token of ``--token-file`` (surrounding whitespace stripped), else
    ``$TF_IPU_SERVER_TOKEN``, else ""."""
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"--token-file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip()


def _read_bytes(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _watch_parent(pid: int, stop: threading.Event) -> None:
    was_parent = os.getppid() == pid
    while not stop.wait(PARENT_POLL_SECONDS):
        if not process_alive(pid, was_parent):
            logger.warning("parent process %d is gone; shutting down", pid)
            stop.set()
            return


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the device server until it is told to stop.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` by default.

    Returns:
        The process exit code (0 on a clean shutdown, 2 for bad arguments).
    """
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    if args.ipus < 1:
        print(f"device_server: --ipus must be >= 1. Received: {args.ipus}", file=sys.stderr)
        return 2
    if args.emulator_threads < 0:
        print(f"device_server: --emulator-threads must be >= 0. Received: {args.emulator_threads}",
              file=sys.stderr)
        return 2
    if args.emulator_threads:
        from device_server.emulator import parallel

        parallel.set_threads(args.emulator_threads)
    if not args.emulator_jit:
        from device_server.emulator import jit

        jit.set_enabled(False)
    if args.parent_pid and not process_alive(args.parent_pid, False):
        print(f"device_server: --parent-pid {args.parent_pid} is not running", file=sys.stderr)
        return 2
    world = None
    if args.mpi_world:
        try:
            from device_server.emulator.world import World

            world = World.from_mpi()
        except ImportError as e:
            print(f"device_server: --mpi-world needs mpi4py ({e})", file=sys.stderr)
            return 2
        logger.info("device server rank %d of %d (--mpi-world)", world.rank, world.size)
    config = ServiceConfig(
        system=args.system,
        num_ipus=args.ipus,
        ipu_version=args.ipu_version,
        lease_seconds=args.lease_seconds,
        max_message_bytes=args.max_message_bytes,
        refuse_opcodes=tuple(args.refuse_opcode),
        fault_inject_opcode=args.fault_inject,
        allow_test_options=args.allow_test_options,
        cache_entries=args.cache_entries,
        max_session_bytes=args.max_session_bytes,
        request_deadline_seconds=args.request_deadline,
        max_waiting_calls=args.max_waiting_calls,
        executable_cache_path=args.executable_cache_path,
        executable_cache_bytes=args.executable_cache_bytes,
        keepalive_seconds=args.keepalive_seconds,
        connection_leases=args.connection_leases,
    )
    try:
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        handle = serve(
            port=args.port, host=args.host, config=config, max_workers=args.workers,
            token=read_token(args.token_file), tls_cert_chain=_read_bytes(args.tls_cert),
            tls_private_key=_read_bytes(args.tls_key), unix_socket=args.unix_socket,
            world=world,
        )
    except (ValueError, RuntimeError, OSError) as e:
        print(f"device_server: {e}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, stop),
                         name="parent-watch", daemon=True).start()
    if args.port_file:
        write_port_file(args.port_file.replace("{rank}", str(world.rank if world else 0)),
                        handle.port)
    # Wake up now and then so that signals are handled promptly on the main thread.
    while not stop.wait(0.5):
        pass
    drained = handle.stop(grace=args.shutdown_grace)
    if world is not None:
        world.close()
    if not drained:
        # A program still runs in a worker thread (it cannot be interrupted); the
        # interpreter would wait for it at exit.
        logging.shutdown()
        os._exit(0)
    return 0
