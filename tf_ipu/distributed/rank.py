"""What each MPI rank of a ``tf-ipu-run`` runs: start its instance's device server, then
become the user's program.

    mpirun ... python -m tf_ipu.distributed.rank --run-dir D -- python train.py
      rank k:  1. identity: POPDIST_REPLICA_INDEX_OFFSET, POPDIST_LOCAL_INSTANCE_INDEX
               2. spawns   python -m device_server --port 0 --port-file D/instance-k/port
                           --parent-pid <this pid> --ipus <local replicas x IPUs each>
                  (its own server: a child, not an MPI rank; it exits when this pid is gone)
               3. TF_IPU_SERVER=127.0.0.1:<its port>
                  spawns   python -m tf_ipu.distributed.watchdog (its own session): the
                           liveness beat to the launcher, from outside the program's GIL
                           (watchdog.py); waits until it reached the launcher
               4. exec python -m tf_ipu.distributed.rank --program ... train.py
                  (same pid, so the server keeps watching it; the user's program is the
                  MPI rank, and MPI_COMM_WORLD holds the instances only)
      program: runs train.py as mpi4py's launcher does; an exception is written to
               D/instance-k/failure (the launcher names it) and aborts the MPI job, so the
               other instances do not wait for it forever; a normal end writes
               D/instance-k/finished (so the launcher tells it from a killed instance).

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
SERVER_PID_FILE = "server.pid"


def instance_dir(run_dir: str, index: int) -> str:
    """Folder of instance ``index``'s files in the run folder."""
    return os.path.join(run_dir, f"instance-{index}")


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


def _server_env() -> dict[str, str]:
    """This environment with the folder holding ``device_server`` first on PYTHONPATH."""
    import importlib.util

    env = dict(os.environ)
    spec = importlib.util.find_spec("device_server")
    if spec is not None and spec.origin:
        root = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
        env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def start_server(folder: str, num_ipus: int, executable_cache_path: str = "",
                 timeout: float = SERVER_STARTUP_SECONDS) -> tuple[int, str]:
    """Starts this instance's device server (a child watching this process) and waits for
    its port; returns (pid, ``127.0.0.1:port``)."""
    os.makedirs(folder, exist_ok=True)
    port_file = os.path.join(folder, "port")
    log_path = os.path.join(folder, "device_server.log")
    cmd = [sys.executable, "-m", "device_server", "--host", "127.0.0.1", "--port", "0",
           "--port-file", port_file, "--parent-pid", str(os.getpid()),
           "--ipus", str(num_ipus), "--unix-socket", os.path.join(folder, "grpc.sock"),
           "--allow-test-options"]  # the instance's own server, as the embedded default is
    if executable_cache_path:
        cmd += ["--executable-cache-path", executable_cache_path]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env=_server_env(),
                                   start_new_session=True, close_fds=True)
    with open(os.path.join(folder, SERVER_PID_FILE), "w") as f:
        f.write(f"{process.pid}\n")
    end = time.monotonic() + timeout
    while True:
        try:
            with open(port_file) as f:
                text = f.read().strip()
            if text:
                return process.pid, f"127.0.0.1:{int(text)}"
        except (OSError, ValueError):
            pass
        if process.poll() is not None or time.monotonic() > end:
            why = (f"exited with code {process.returncode}" if process.returncode is not None
                   else f"did not serve within {timeout:g} s")
            if process.poll() is None:
                process.kill()
            with open(log_path, "rb") as f:
                tail = f.read()[-2000:].decode("utf-8", "replace").strip()
            raise RuntimeError(f"its device server ({' '.join(cmd[1:])}) {why}. Its log ends "
                               f"with:\n{tail or '(nothing)'}")
        time.sleep(0.02)


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


def bootstrap(run_dir: str, command: Sequence[str], executable_cache_path: str = "",
              only_output_from: int | None = None) -> None:
    """Steps 1-4 of the module docstring; does not return (execs the program)."""
    rank, size, local_rank = mpi_rank()
    os.environ.update(identity.instance_environment(rank, local_rank))
    index = identity.getInstanceIndex()
    if identity.getNumInstances() != size or index != rank:
        raise RuntimeError(f"the MPI job has {size} ranks but the run {identity.getNumInstances()} "
                           f"instances: start the run with tf-ipu-run.")
    folder = instance_dir(run_dir, index)
    ipus = identity.getNumLocalReplicas() * identity.getNumIpusPerReplica()
    server_pid, address = start_server(folder, ipus, executable_cache_path)
    os.environ["TF_IPU_SERVER"] = address
    if only_output_from is not None and only_output_from != index:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    start_watchdog(run_dir, index, server_pid)
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
    """``python -m tf_ipu.distributed.rank [--program] --run-dir D [...] -- command...``."""
    p = argparse.ArgumentParser(prog="python -m tf_ipu.distributed.rank")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--program", action="store_true")
    p.add_argument("--executable-cache-path", default="")
    p.add_argument("--only-output-from-instance", type=int, default=None)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command after --")
    if args.program:
        run_program(args.run_dir, command)
        return 0
    try:
        bootstrap(args.run_dir, command, args.executable_cache_path,
                  args.only_output_from_instance)
    except Exception as e:  # noqa: BLE001  (recorded for the launcher, then a non-zero exit)
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0") or 0)
        record_failure(args.run_dir, rank, f"could not start: {e}")
        print(f"tf-ipu-run: instance {rank} could not start: {e}", file=sys.stderr)
        return 1
    return 0  # not reached: bootstrap execs


if __name__ == "__main__":
    sys.exit(main())
