"""What the ranks of a ``tf-ipu-run`` run: a device server, or an instance of the program.

The launcher starts two MPI jobs with the same hosts and mapping, so that server k and
instance k share a host (``launcher.py``):

    mpirun ... -n N python -m tf_ipu.distributed.rank --server --run-dir D --ipus I
      server rank k: writes its pid to D/server-k/pid, sends its output to
                     D/server-k/device_server.log, and execs (same pid, still rank k of the
                     servers' MPI job, whose COMM_WORLD is exactly the run's servers)
                     python -m device_server --mpi-world --port 0 --port-file D/server-k/port
                         --ipus <local replicas x IPUs each> [--executable-cache-path DIR]
    mpirun ... -n N python -m tf_ipu.distributed.rank --run-dir D -- python train.py
      rank k:  1. identity: POPDIST_REPLICA_INDEX_OFFSET, POPDIST_LOCAL_INSTANCE_INDEX
               2. waits for server k's port file (``wait_for_server``): a server that ends
                  first, a servers' job that ended (D/servers-ended, written by the
                  launcher) or SERVER_STARTUP_SECONDS without a port is an error naming the
                  server and quoting its log
               3. TF_IPU_SERVER=127.0.0.1:<its port>
                  spawns   python -m tf_ipu.distributed.watchdog (its own session): the
                           liveness beat to the launcher, from outside the program's GIL
                           (watchdog.py); waits until it reached the launcher
               4. exec python -m tf_ipu.distributed.rank --program ... train.py
                  (same pid; the user's program is the MPI rank, and its MPI_COMM_WORLD
                  holds the instances only)
      program: runs train.py as mpi4py's launcher does; an exception is written to
               D/instance-k/failure (the launcher names it) and aborts the MPI job, so the
               other instances do not wait for it forever; a normal end writes
               D/instance-k/finished (so the launcher tells it from a killed instance).

A server does not watch its instance: the launcher ends the servers' job once the
instances' job ended (however it ended), and a watchdog whose launcher is gone stops its
instance and then its server.

Imports neither TensorFlow nor, before the program runs, MPI.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence

from tf_ipu.distributed import identity

SERVER_STARTUP_SECONDS = 120.0
FAILURE_FILE = "failure"
FINISHED_FILE = "finished"
WATCHDOG_STARTUP_SECONDS = 60.0
SERVER_PID_FILE = "pid"
SERVER_PORT_FILE = "port"
SERVER_LOG_FILE = "device_server.log"
#: In the run folder: the servers' mpirun ended (its exit status), written by the launcher.
SERVERS_ENDED_FILE = "servers-ended"
#: Seconds a device server of the run gets to finish its calls when told to stop (its only
#: clients are the run's instances, which are gone by then).
SERVER_SHUTDOWN_GRACE = 2.0


def instance_dir(run_dir: str, index: int) -> str:
    """Folder of instance ``index``'s files in the run folder."""
    return os.path.join(run_dir, f"instance-{index}")


def server_dir(run_dir: str, index: int) -> str:
    """Folder of device server ``index``'s files (pid, port, log) in the run folder."""
    return os.path.join(run_dir, f"server-{index}")


def server_pid(run_dir: str, index: int) -> int | None:
    """The pid device server ``index`` wrote, or None (not yet, or unreadable)."""
    try:
        with open(os.path.join(server_dir(run_dir, index), SERVER_PID_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def is_run_server(pid: int, run_dir: str) -> bool:
    """Whether ``pid`` is still a running device server of this run (its command line
    names the run folder), not a process that reused the id."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode("utf-8", "replace")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and "device_server" in args and run_dir in args


def mpi_rank() -> tuple[int, int, int]:
    """(rank, size, rank on this host) as Open MPI tells a process it started."""
    try:
        return (int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"]),
                int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    except (KeyError, ValueError):
        raise RuntimeError("tf_ipu.distributed.rank runs as a rank of the MPI job that "
                           "tf-ipu-run starts (no OMPI_COMM_WORLD_RANK here).") from None


def record_failure(run_dir: str, index: int, message: str) -> None:
    """Writes why instance ``index`` failed where the launcher looks."""
    folder = instance_dir(run_dir, index)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, FAILURE_FILE), "w", encoding="utf-8") as f:
            f.write(message.strip() + "\n")
    except OSError:
        pass


def record_finished(run_dir: str, index: int) -> None:
    """Marks instance ``index``'s program as having ended normally."""
    try:
        with open(os.path.join(instance_dir(run_dir, index), FINISHED_FILE), "w") as f:
            f.write("0\n")
    except OSError:
        pass


def start_watchdog(run_dir: str, index: int, server_pid: int,
                   timeout: float = WATCHDOG_STARTUP_SECONDS) -> int:
    """Starts this instance's watchdog (``tf_ipu.distributed.watchdog``) and waits until it
    has reached the launcher; returns its pid. Does nothing (returns 0) outside a launcher
    that watches (no ``TF_IPU_RUN_WATCH``)."""
    from tf_ipu.distributed import watchdog

    if not os.environ.get(watchdog.ADDRESS_ENV):
        return 0
    read_end, write_end = os.pipe()
    cmd = [sys.executable, "-m", "tf_ipu.distributed.watchdog", "--run-dir", run_dir,
           "--index", str(index), "--instance-pid", str(os.getpid()),
           "--server-pid", str(server_pid), "--ready-fd", str(write_end)]
    try:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   pass_fds=(write_end,), start_new_session=True)
    finally:
        os.close(write_end)
    try:
        end = time.monotonic() + timeout
        got = b""
        while b"\n" not in got:
            left = end - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                process.kill()
                raise RuntimeError(f"its watchdog did not reach the launcher within {timeout:g} s")
            chunk = os.read(read_end, 16)
            if not chunk:
                process.wait()
                raise RuntimeError(f"its watchdog exited with code {process.returncode} "
                                   f"before reaching the launcher (see its message above)")
            got += chunk
    finally:
        os.close(read_end)
    return process.pid


def server_command(run_dir: str, index: int, num_ipus: int,
                   executable_cache_path: str = "") -> list[str]:
    """The command device server ``index`` of the run runs (one rank of the servers' MPI
    job, ``--mpi-world``), serving ``num_ipus`` IPUs to instance ``index`` on this host."""
    folder = server_dir(run_dir, index)
    cmd = [sys.executable, "-m", "device_server", "--mpi-world", "--host", "127.0.0.1",
           "--port", "0", "--port-file", os.path.join(folder, SERVER_PORT_FILE),
           "--ipus", str(num_ipus), "--unix-socket", os.path.join(folder, "grpc.sock"),
           "--shutdown-grace", f"{SERVER_SHUTDOWN_GRACE:g}",
           "--allow-test-options"]  # the instance's own server, as the embedded default is
    if executable_cache_path:
        cmd += ["--executable-cache-path", executable_cache_path]
    return cmd


def become_server(run_dir: str, num_ipus: int, executable_cache_path: str = "") -> None:
    """A rank of the servers' MPI job: records its pid and becomes device server k (k its
    rank; see the module docstring). Does not return (execs the server)."""
    index, _, _ = mpi_rank()
    folder = server_dir(run_dir, index)
    os.makedirs(folder, exist_ok=True)
    cmd = server_command(run_dir, index, num_ipus, executable_cache_path)
    tmp = os.path.join(folder, f".{SERVER_PID_FILE}.tmp")
    with open(tmp, "w") as f:  # the exec keeps this pid
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, os.path.join(folder, SERVER_PID_FILE))
    log = os.open(os.path.join(folder, SERVER_LOG_FILE),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.execv(sys.executable, cmd)


def _log_tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-limit:].decode("utf-8", "replace").strip()
    except OSError:
        return ""


def wait_for_server(run_dir: str, index: int, num_ipus: int,
                    timeout: float = SERVER_STARTUP_SECONDS) -> tuple[int, str]:
    """Waits until device server ``index`` of the run serves (its port file); returns
    (its pid, ``127.0.0.1:port``).

    Raises:
        RuntimeError: the server ended before serving, the servers' MPI job ended, or no
            port came within ``timeout`` s; the message names the server, its command and
            what its log says.
    """
    from tf_ipu.distributed import watchdog

    folder = server_dir(run_dir, index)
    port_file = os.path.join(folder, SERVER_PORT_FILE)
    end = time.monotonic() + timeout
    why = ""
    while not why:
        pid = server_pid(run_dir, index)
        try:
            with open(port_file) as f:
                text = f.read().strip()
            if text and pid is not None:
                return pid, f"127.0.0.1:{int(text)}"
        except (OSError, ValueError):
            pass
        if pid is not None and watchdog.proc_state(pid)[0] in ("", "Z", "X"):
            why = f"(pid {pid}) ended before serving"
        elif os.path.exists(os.path.join(run_dir, SERVERS_ENDED_FILE)):
            status = _log_tail(os.path.join(run_dir, SERVERS_ENDED_FILE), 100)
            why = (f"did not serve: the servers' MPI job ended (mpirun status {status}; its "
                   f"message is in tf-ipu-run's output)")
        elif time.monotonic() > end:
            why = (f"did not serve within {timeout:g} s"
                   + ("" if pid is not None else " (it never started: no pid file)"))
        else:
            time.sleep(0.02)
    tail = _log_tail(os.path.join(folder, SERVER_LOG_FILE))
    raise RuntimeError(f"its device server (server {index} of the run, rank {index} of the "
                       f"servers' MPI job, serving {num_ipus} IPU{'s' if num_ipus != 1 else ''}) {why}. Its log ends "
                       f"with:\n{tail or '(nothing)'}")


def split_interpreter_options(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``python``'s own options (``-u``, ``-O``, ``-X dev``, ``-W error``, ...) and the rest
    (``script args``, ``-m mod args`` or ``-c cmd args``) of a Python command line."""
    args = list(args)
    k = 0
    while k < len(args) and args[k].startswith("-") and args[k] not in ("-m", "-c", "-"):
        k += 2 if args[k] in ("-W", "-X") else 1
    return args[:k], args[k:]


def _is_python(program: str) -> bool:
    return os.path.basename(program).startswith("python")


def bootstrap(run_dir: str, command: Sequence[str],
              only_output_from: int | None = None) -> None:
    """Steps 1-4 of the module docstring; does not return (execs the program)."""
    rank, size, local_rank = mpi_rank()
    os.environ.update(identity.instance_environment(rank, local_rank))
    index = identity.getInstanceIndex()
    if identity.getNumInstances() != size or index != rank:
        raise RuntimeError(f"the MPI job has {size} ranks but the run {identity.getNumInstances()} "
                           f"instances: start the run with tf-ipu-run.")
    os.makedirs(instance_dir(run_dir, index), exist_ok=True)
    ipus = identity.getNumLocalReplicas() * identity.getNumIpusPerReplica()
    pid, address = wait_for_server(run_dir, index, ipus)
    os.environ["TF_IPU_SERVER"] = address
    if only_output_from is not None and only_output_from != index:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    start_watchdog(run_dir, index, pid)
    program = shutil.which(command[0]) or command[0]
    if _is_python(program):
        options, rest = split_interpreter_options(command[1:])
        argv = [program, *options, "-m", "tf_ipu.distributed.rank", "--program",
                "--run-dir", run_dir, "--", *rest]
    else:
        argv = [program, *command[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(program, argv)


def run_program(run_dir: str, args: Sequence[str]) -> None:
    """Runs ``[pyfile | -m mod | -c cmd] [arg] ...`` as ``python -m mpi4py`` does; an
    exception (or a non-zero exit) is recorded for the launcher and aborts the MPI job."""
    from mpi4py.run import run_command_line, set_abort_status

    index = identity.getInstanceIndex()
    try:
        run_command_line(list(args))
    except SystemExit as e:
        if e.code not in (None, 0):
            record_failure(run_dir, index, f"exited with status {e.code!r}")
        else:
            record_finished(run_dir, index)
        set_abort_status(e)
        raise
    except BaseException as e:
        frames = traceback.extract_tb(e.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        record_failure(run_dir, index, f"{type(e).__name__}: {e}{where}")
        set_abort_status(e if isinstance(e, KeyboardInterrupt) else 1)
        raise
    record_finished(run_dir, index)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tf_ipu.distributed.rank [--program] --run-dir D [...] -- command...``, or
    ``python -m tf_ipu.distributed.rank --server --run-dir D --ipus I [...]``."""
    p = argparse.ArgumentParser(prog="python -m tf_ipu.distributed.rank")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--program", action="store_true")
    p.add_argument("--server", action="store_true", help="a rank of the servers' job")
    p.add_argument("--ipus", type=int, default=1, help="IPUs of a --server rank's server")
    p.add_argument("--executable-cache-path", default="")
    p.add_argument("--only-output-from-instance", type=int, default=None)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.server:
        become_server(args.run_dir, args.ipus, args.executable_cache_path)
        return 0  # not reached: execs the server
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command after --")
    if args.program:
        run_program(args.run_dir, command)
        return 0
    try:
        bootstrap(args.run_dir, command, args.only_output_from_instance)
    except Exception as e:  # noqa: BLE001  (recorded for the launcher, then a non-zero exit)
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0") or 0)
        record_failure(args.run_dir, rank, f"could not start: {e}")
        print(f"tf-ipu-run: instance {rank} could not start: {e}", file=sys.stderr)
        return 1
    return 0  # not reached: bootstrap execs


if __name__ == "__main__":
    sys.exit(main())
