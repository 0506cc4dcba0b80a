"""The embedded default: a device server started as a child process of this one.

    this process --spawns--> python -m device_server --port 0 --port-file F --parent-pid <pid>
                                 --unix-socket <workdir>/grpc.sock
                 <--reads--  F (the bound port, written atomically once serving)

The child watches this process and exits when it is gone, so it never outlives the host even
if the host is killed; ``stop()`` (also run at exit) ends it sooner. The child runs in its
own session (process group), so a Ctrl-C in the terminal reaches the host, which then stops
it in order. Does not import TensorFlow (nor does the server).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from tf_ipu import errors

STARTUP_TIMEOUT_SECONDS = 30.0
_STDERR_TAIL_CHARS = 3000


class LocalServer:
    """A device server running as a child process.

    Args:
        process: the child.
        address: ``127.0.0.1:port`` it serves on.
        workdir: temporary folder with its port file and log (removed by ``stop``).
    """

    def __init__(self, process: subprocess.Popen, address: str, workdir: str) -> None:
        self.process = process
        self.address = address
        self.workdir = workdir
        self.log_path = os.path.join(workdir, "device_server.log")
        atexit.register(self.stop)

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited({self.process.returncode})"
        return f"LocalServer(address={self.address!r}, pid={self.process.pid}, {state})"

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self.process.poll() is None

    def log_tail(self, chars: int = _STDERR_TAIL_CHARS) -> str:
        """The end of the server's log (its stderr)."""
        return _tail(self.log_path, chars)

    def stop(self, timeout: float = 5.0) -> int | None:
        """Stops the server: SIGTERM, then SIGKILL after ``timeout`` seconds. Idempotent.

        Returns:
            The server's exit code (None if it could not be reaped).
        """
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            except ProcessLookupError:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.process.returncode


def start_local_server(
    num_ipus: int = 1,
    ipu_version: str = "ipu2",
    extra_args: Sequence[str] = (),
    startup_timeout: float = STARTUP_TIMEOUT_SECONDS,
) -> LocalServer:
    """Starts ``python -m device_server`` (this interpreter) on a free loopback port and
    waits until its health service says SERVING.

    Args:
        num_ipus: IPUs the server hosts.
        ipu_version: its default architecture (``"ipu1"``, ``"ipu2"``, ``"bow"``).
        extra_args: more command line arguments, e.g. ``("--refuse-opcode", "dot")``.
        startup_timeout: seconds to wait for it to serve.

    Returns:
        A running ``LocalServer``.

    Raises:
        DeviceUnavailableError: it exited or did not serve in time; the message holds the
            end of its stderr.

    Example:
        >>> server = start_local_server(num_ipus=2)
        >>> client = DeviceClient(server.address)
        >>> server.stop()
    """
    workdir = tempfile.mkdtemp(prefix="tf_ipu_device_server_")
    port_file = os.path.join(workdir, "port")
    log_path = os.path.join(workdir, "device_server.log")
    cmd = [
        sys.executable, "-m", "device_server",
        "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
        "--parent-pid", str(os.getpid()),
        "--ipus", str(num_ipus), "--ipu-version", ipu_version,
        "--unix-socket", os.path.join(workdir, "grpc.sock"),
        "--allow-test-options",  # this process's own server: its debug switches are its own
        *[str(a) for a in extra_args],
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=_child_env(), start_new_session=True, close_fds=True,
        )
    server = LocalServer(process, "", workdir)
    end = time.monotonic() + startup_timeout

    def fail(why: str) -> errors.DeviceUnavailableError:
        tail = server.log_tail()
        server.stop(timeout=2.0)
        return errors.DeviceUnavailableError(
            f"The local device server ({' '.join(cmd[1:])}) {why}. "
            f"Its output ends with:\n{tail or '(nothing)'}"
        )

    port = None
    while port is None:
        if process.poll() is not None:
            raise fail(f"exited with code {process.returncode} before serving")
        if time.monotonic() > end:
            raise fail(f"did not write its port within {startup_timeout:g} s")
        port = _read_port(port_file)
        if port is None:
            time.sleep(0.02)
    server.address = f"127.0.0.1:{port}"

    from tf_ipu.client import DeviceClient  # grpc is only needed from here on

    probe = DeviceClient(server.address, timeout=max(1.0, end - time.monotonic()))
    try:
        probe.wait_for_server(max(0.5, end - time.monotonic()))
    except errors.DeviceUnavailableError as e:
        raise fail(f"did not become healthy: {e.message}") from None
    finally:
        probe.close()
    return server


def _read_port(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _tail(path: str, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _child_env() -> dict[str, str]:
    """This environment, with the folder holding ``device_server`` first on PYTHONPATH so a
    source checkout works without installing."""
    env = dict(os.environ)
    spec = importlib.util.find_spec("device_server")
    if spec is not None and spec.origin:
        root = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
        paths = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
