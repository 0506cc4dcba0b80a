"""Each instance's watchdog: the liveness beat, sent from outside the instance's GIL.

    servers' job, rank k: device server S (same host; its pid in D/server-k/pid)
    instances' job, rank k (pid P) ── waits for S's port
                 └─ spawns ── watchdog W (its own session; argv names the run folder)
                                │ pidfd(P), pidfd(S): woken the moment either ends
                                │ every beat interval: /proc/P/stat, /proc/S/stat
                                └─TCP─> launcher:  hello <token> k P S W
                                                   beat             (both scheduled)
                                                   hold <why>       (one is stopped: no beat)
                                                   ended {json}     (P is gone: when,
                                                     how, and what it recorded: finished,
                                                     or its exception and when)
                                                   server-lost <t> <how>  (S gone, P alive)
                                        launcher ─> stop <now> <message>

The beat says "this instance's process and its server exist and can be scheduled"; it is
sent by another process, so an instance holding its GIL for minutes (a long C call,
tracing, planning) or busy in Python keeps beating. It stops when the instance (or its
server) is stopped (SIGSTOP, a debugger, ``kill -STOP``), when the watchdog is gone, or
when its host or the network to the launcher is: the launcher counts the instance as stuck
after ``beat timeout`` seconds without a beat. An instance that is alive but deadlocked
(waiting forever on a lock) keeps beating: nothing outside it can tell that from a slow one.

On ``stop`` (another instance failed, or this one), the watchdog prints the message on the
instance's stderr, sends SIGTERM to the instance (SIGKILL at once if ``now``, else after
the grace), and exits once it is gone; the launcher then ends the servers' job. If the
launcher's connection closes, it stops the instance the same way, then its device server
(SIGTERM, SIGKILL after the grace): nobody would be watching the run, or ending the
servers' job, any more. The server is not the instance's child (it is a rank of the
servers' job, on the same host): a pidfd watches it all the same, but how it ended is
known only if the watchdog sees it as a zombie, before its mpirun reaps it (else "ended").
Imports neither TensorFlow nor MPI.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from tf_ipu.distributed import rank

TOKEN_ENV = "TF_IPU_RUN_TOKEN"
ADDRESS_ENV = "TF_IPU_RUN_WATCH"
BEAT_TIMEOUT_ENV = "TF_IPU_RUN_BEAT_TIMEOUT"
EXIT_TIMEOUT_ENV = "TF_IPU_RUN_EXIT_TIMEOUT"
#: An instance with no beat for this long is stuck (seconds; issue 27).
DEFAULT_BEAT_TIMEOUT = 10.0
#: The other instances are gone within this long of a failure (seconds; issue 27).
DEFAULT_EXIT_TIMEOUT = 30.0
#: States of /proc/<pid>/stat in which a process cannot run.
_STOPPED = {"T": "stopped (SIGSTOP or job control)", "t": "stopped by a debugger (ptrace)",
            "Z": "ended (a zombie)", "X": "ended"}


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def beat_timeout() -> float:
    """Seconds without a beat after which an instance is stuck (``$TF_IPU_RUN_BEAT_TIMEOUT``,
    default 10)."""
    return _env_seconds(BEAT_TIMEOUT_ENV, DEFAULT_BEAT_TIMEOUT)


def exit_timeout() -> float:
    """Seconds within which the instances are gone after a failure
    (``$TF_IPU_RUN_EXIT_TIMEOUT``, default 30)."""
    return _env_seconds(EXIT_TIMEOUT_ENV, DEFAULT_EXIT_TIMEOUT)


def beat_interval(timeout: float) -> float:
    """Seconds between beats: five per timeout, at most one a second."""
    return min(1.0, timeout / 5)


def stop_grace(exit_within: float, beat_within: float) -> float:
    """Seconds an instance told to stop gets between SIGTERM and SIGKILL."""
    return max(0.5, min(5.0, (exit_within - beat_within) / 4))


def proc_state(pid: int) -> tuple[str, int | None]:
    """(state letter, exit status in waitpid's form if a zombie's is readable) of ``pid``;
    ``("", None)`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "", None
    state = fields[0]
    status = None
    if state in ("Z", "X") and len(fields) >= 50:  # field 52, exit_code (Linux >= 3.5)
        try:
            status = int(fields[49])
        except ValueError:
            status = None
    return state, status


def describe_status(status: int | None) -> str:
    """``killed by SIGKILL`` / ``exited with status 3`` / ``ended`` for a waitpid status."""
    if status is None:
        return "ended"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return "ended"


class _Process:
    """A process watched through a pidfd (never confused with a later one of its pid)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except OSError:  # already gone
            self.fd = None

    def gone(self) -> bool:
        if self.fd is None:
            return True
        return bool(select.select([self.fd], [], [], 0)[0])

    def how(self) -> str:
        """How it ended, if a zombie still tells (else ``ended``)."""
        return describe_status(proc_state(self.pid)[1])

    def signal(self, sig: int) -> None:
        if self.fd is not None:
            try:
                signal.pidfd_send_signal(self.fd, sig)
            except OSError:
                pass


def _say(text: str) -> None:
    try:
        os.write(2, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _stop_server(server: _Process, grace: float) -> None:
    """SIGTERM to the instance's device server, SIGKILL after ``grace`` s (the launcher is
    gone: nobody else would end it)."""
    if server.gone():
        return
    server.signal(signal.SIGTERM)
    if server.fd is not None and not select.select([server.fd], [], [], grace)[0]:
        server.signal(signal.SIGKILL)
        select.select([server.fd], [], [], 2.0)


def _stop_instance(instance: _Process, index: int, message: str, now: bool,
                   grace: float) -> None:
    if instance.gone():
        return
    if now:
        _say(f"tf-ipu-run: instance {index} is killed (SIGKILL): {message}")
    else:
        _say(f"tf-ipu-run: instance {index} stops: {message}")
    if now:  # the failed instance: after the others were told (they print first)
        time.sleep(0.2)
        instance.signal(signal.SIGKILL)
    else:
        instance.signal(signal.SIGTERM)
        if instance.fd is not None:
            select.select([instance.fd], [], [], grace)
        instance.signal(signal.SIGKILL)
    if instance.fd is not None:
        select.select([instance.fd], [], [], 2.0)


def outcome(run_dir: str, index: int, when: float, how: str) -> dict[str, Any]:
    """What instance ``index`` left in its folder when it ended (read on its own host):
    ``finished`` (a normal end), else its recorded exception (``failure``) and when it was
    written; ``when`` and ``how`` it ended."""
    folder = rank.instance_dir(run_dir, index)
    out: dict[str, Any] = {"when": when, "how": how, "finished": os.path.exists(
        os.path.join(folder, rank.FINISHED_FILE)), "failure": None, "failure_time": None}
    path = os.path.join(folder, rank.FAILURE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            out["failure"] = f.read().strip()
        out["failure_time"] = os.stat(path).st_mtime
    except OSError:
        pass
    return out


def watch(run_dir: str, address: tuple[str, int], token: str, index: int, instance_pid: int,
          server_pid: int, timeout: float, grace: float, ready_fd: int = -1) -> int:
    """Watches instance ``index`` (pid ``instance_pid``) and its device server until the
    instance ends; see the module docstring. Returns the exit status."""
    instance, server = _Process(instance_pid), _Process(server_pid)
    conn = socket.create_connection(address, timeout=30)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(line: str) -> bool:
        try:
            conn.sendall((line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
            return True
        except OSError:
            return False

    send(f"hello {token} {index} {instance_pid} {server_pid} {os.getpid()}")
    if ready_fd >= 0:  # the rank waits for this before it becomes the program
        os.write(ready_fd, b"ok\n")
        os.close(ready_fd)
    interval = beat_interval(timeout)
    server_reported = False
    buffer = b""
    next_beat = 0.0
    while True:
        fds = [conn.fileno()] + [p.fd for p in (instance, server)
                                 if p.fd is not None and not (p is server and server_reported)]
        wait = max(0.0, next_beat - time.monotonic())
        readable = select.select(fds, [], [], wait)[0]
        if instance.gone():
            send("ended " + json.dumps(outcome(run_dir, index, time.time(), instance.how())))
            return 0
        if not server_reported and server.gone():
            server_reported = True
            send(f"server-lost {time.time():.6f} {server.how()}")
        if conn.fileno() in readable:
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            if not data:  # the launcher is gone: nobody watches the run any more
                _stop_instance(instance, index, "the launcher (tf-ipu-run) is gone", False,
                               grace)
                _stop_server(server, grace)
                return 1
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                parts = line.decode("utf-8", "replace").split(" ", 2)
                if parts[0] == "stop" and len(parts) == 3:
                    _stop_instance(instance, index, parts[2], parts[1] == "1", grace)
                    if instance.gone():
                        send("ended " + json.dumps(
                            outcome(run_dir, index, time.time(), "stopped")))
                    return 1
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + interval
            holds = []
            for what, proc in (("its process", instance), ("its device server", server)):
                state = proc_state(proc.pid)[0]
                if state in ("T", "t"):
                    holds.append(f"{what} (pid {proc.pid}) is {_STOPPED[state]}")
            send(f"hold {'; '.join(holds)}" if holds else "beat")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tf_ipu.distributed.watchdog --run-dir D --index K --instance-pid P
    --server-pid S [--ready-fd N]`` (address and token from the environment)."""
    p = argparse.ArgumentParser(prog="python -m tf_ipu.distributed.watchdog")
    p.add_argument("--run-dir", required=True, help="the run folder (names the process)")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--instance-pid", type=int, required=True)
    p.add_argument("--server-pid", type=int, required=True)
    p.add_argument("--ready-fd", type=int, default=-1)
    args = p.parse_args(argv)
    host, _, port = os.environ[ADDRESS_ENV].rpartition(":")
    timeout = beat_timeout()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C goes to the launcher
    try:
        return watch(args.run_dir, (host, int(port)), os.environ.get(TOKEN_ENV, ""), args.index,
                     args.instance_pid, args.server_pid, timeout,
                     stop_grace(exit_timeout(), timeout), args.ready_fd)
    except OSError as e:
        _say(f"tf-ipu-run: the watchdog of instance {args.index} cannot reach the launcher "
             f"at {os.environ[ADDRESS_ENV]}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
