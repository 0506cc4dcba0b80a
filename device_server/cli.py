"""Command line of the device server: ``python -m device_server`` or ``device_server``.

    python -m device_server --port 0 --port-file /tmp/port --ipus 4 --ipu-version ipu2

Runs until SIGTERM/SIGINT, or until the ``--parent-pid`` process is gone (the embedded
default, ``tf_ipu.local_server``, passes its own pid so that the server never outlives it).
Does not import TensorFlow.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence

from device_server import __version__
from device_server.server import DEFAULT_MAX_MESSAGE_BYTES, serve
from device_server.service import ServiceConfig

logger = logging.getLogger("device_server")

PARENT_POLL_SECONDS = 1.0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (see ``--help``)."""
    p = argparse.ArgumentParser(
        prog="device_server",
        description="tf_ipu device server: emulated Graphcore IPUs behind a gRPC service.",
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1; the service has no authentication)")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (default)")
    p.add_argument("--port-file", default="",
                   help="write the bound port to this file (atomically) once serving")
    p.add_argument("--ipus", type=int, default=1, help="number of IPUs hosted (default 1)")
    p.add_argument("--ipu-version", default="ipu2",
                   help="default architecture: ipu1, ipu2 or bow (default ipu2)")
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when the process with this pid is gone (polled every second)")
    p.add_argument("--refuse-opcode", action="append", default=[], metavar="OP",
                   help="refuse this opcode in every compile (repeatable)")
    p.add_argument("--fault-inject", default="", metavar="OP",
                   help="perturb this opcode's results in every compiled program")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help=f"largest gRPC message either way (default {DEFAULT_MAX_MESSAGE_BYTES})")
    p.add_argument("--lease-seconds", type=float, default=60.0,
                   help="default session lease (default 60)")
    p.add_argument("--cache-entries", type=int, default=128,
                   help="executables kept in the server's cache (default 128)")
    p.add_argument("--workers", type=int, default=16, help="RPC worker threads (default 16)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="logging level (default info)")
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
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s device_server[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.ipus < 1:
        print(f"device_server: --ipus must be >= 1. Received: {args.ipus}", file=sys.stderr)
        return 2
    if args.parent_pid and not process_alive(args.parent_pid, False):
        print(f"device_server: --parent-pid {args.parent_pid} is not running", file=sys.stderr)
        return 2
    config = ServiceConfig(
        num_ipus=args.ipus,
        ipu_version=args.ipu_version,
        lease_seconds=args.lease_seconds,
        max_message_bytes=args.max_message_bytes,
        refuse_opcodes=tuple(args.refuse_opcode),
        fault_inject_opcode=args.fault_inject,
        cache_entries=args.cache_entries,
    )
    try:
        handle = serve(port=args.port, host=args.host, config=config, max_workers=args.workers)
    except (ValueError, RuntimeError) as e:
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
        write_port_file(args.port_file, handle.port)
    # Wake up now and then so that signals are handled promptly on the main thread.
    while not stop.wait(0.5):
        pass
    handle.stop(grace=1.0)
    return 0
