"""The device servers of one ``tf-ipu-run`` as one machine: a replicated program across them.

    server 0 (MPI rank 0)                          server 1 (MPI rank 1)
    replicas 0, 1 (global 0, 1)                    replicas 0, 1 (global 2, 3)
      ReplicaGroup: the last local replica           ReplicaGroup: the last local replica
      to arrive at a collective ──────┐     ┌──────  to arrive at a collective
                                      ▼     ▼
          WorldRun: 1. Iallgather of a fixed header (kind, program digest, execution and
                       collective numbers, bytes, local replicas, a flag): checked equal
                    2. all-reduce: Iallgather of every local replica's operands (bytes)
                       -> every server folds ALL contributions in global replica order
          each request polled with Test + short sleeps; between polls: a posted Irecv of
          failure notices (any server's replica failed: the run is broken)

A replicated program compiled for ``instances`` > 1 (``CompileOptions.instances``; the
host's ``popdist.tensorflow.set_ipu_config``) is one program of ``instances x local
replicas`` replicas. Each server runs its local replicas (``emulator/replicas.py``); the
servers meet over MPI (the servers' own MPI job: ``python -m device_server --mpi-world``,
rank k serving instance k) wherever the replicas meet:

- ``tf_ipu_all_reduce``: the contributions of all replicas of the run, reduced in global
  replica order (``rank x local replicas + local index``) by a left fold, exactly as one
  server holding every replica adds them, so the result is bit-identical to it; ``mean``
  divides by the run's replicas. This is Graphcore's PopDistStrategy, whose "GCL reductions
  will then be performed across all the global replicas in the application" (its docstring,
  graphcore/tensorflow, tensorflow/python/ipu/distributed/popdist_strategy.py: a
  ``cross_replica_sum``, then ``ipu_replication_normalise`` for a mean). GCL reduces over
  IPU-Links and GW-Links, not through the hosts: here the hosts' MPI stands in for them.
- ``agree`` (end of a device loop's step: cancel, deadline, session closed, shutdown) and
  an infeed pull (a feed that ended): a flag combined by maximum, so every replica of the
  run stops at the same step.
- ``begin``, before the first step of each execution: every server checks that all run
  the same program (its executable's digest) with the same number of local replicas, and
  that they are at the same execution (the servers' world executions are counted).

Only buffer calls (mpi4py's uppercase methods on numpy arrays): nothing is pickled. Every
collective is started non-blocking and polled (a blocking MPI call spins its progress
engine; many processes share few cores here). World collectives are serialized per server
(one world execution at a time) and every one carries (program digest, execution number,
collective number): servers that disagree raise an error naming the instances that differ,
instead of waiting for each other or adding unrelated arrays. A world execution that finds
another holding its server waits for it in short slices and gives up when its own run is
stopped (deadline, cancel, session closed, shutdown): ``RunStopped``, naming the execution
that holds the server and since when, which the service returns as that stop's status
(DEADLINE_EXCEEDED for a deadline); it never got in, so it counts as no world execution.

A failure of one server's replica (any error but an agreed stop) breaks the run: that
server sends a notice (Isend, a fixed-size UTF-8 message) to every other server, whose
waits see it (a posted Irecv, tested at every poll) and stop with an error naming the
instance and its error; the world stays broken (its collectives can no longer be matched)
and later world executions on any server fail at once with that error. A server whose own
run is stopped (its client cancelled, its session closed) while the others do not come
to a collective gives up after ``STOPPED_WAIT_SECONDS`` and breaks the run the same way.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.emulator.cancel import RunStopped
from device_server.emulator.errors import ExecutionError

#: Polling of a pending request: first sleep, growth factor, longest sleep (seconds).
_POLL_FIRST, _POLL_GROWTH, _POLL_MAX = 0.0002, 1.5, 0.005
#: Bytes of a failure notice (its UTF-8 text, cut to fit).
NOTICE_BYTES = 4096
_NOTICE_TAG = 2701
#: A server whose own run was told to stop waits this long for the others to reach the
#: collective it is at, then breaks the run (they may be slow, or gone).
STOPPED_WAIT_SECONDS = 10.0
#: A world execution waiting for another to leave this server checks its own stop this often.
RUN_LOCK_SLICE_SECONDS = 0.05

# Header fields (int64 each).
_KIND, _DIGEST, _EXECUTION, _SEQ, _BYTES, _LOCAL, _VALUE, _RANK = range(8)
_HEADER = 8
BEGIN, ALL_REDUCE, AGREE, PULL = 1, 2, 3, 4
_KIND_NAMES = {BEGIN: "the start of an execution", ALL_REDUCE: "an all-reduce",
               AGREE: "a step's stop decision", PULL: "an infeed pull"}
#: Stop reasons as agreed codes (0: go on). The highest code of the servers wins.
STOP_REASONS = ("cancelled", "deadline", "session-closed", "shutdown")


class WorldBroken(ExecutionError):
    """The run's replicas on another server failed: this server's replicas stop."""


class WorldMismatch(ExecutionError):
    """The servers are not at the same collective of the same program (every server sees
    it at once and raises it: the run is not broken by it)."""


def _unnumbered(path: str) -> str:
    """``sequential_1/dense_3/MatMul`` -> ``sequential/dense/MatMul``: a TF op path without
    the counters that make names unique in one process (instances that built other models
    before, e.g. one that saved, number their layers differently)."""
    return "/".join(re.sub(r"_\d+$", "", part) for part in path.split("/"))


def program_digest(module: Any, options: str) -> int:
    """What the servers compare before a world execution, as one int64 (8 bytes of a
    sha256): the program (``ir_pb2.Module``) without its names (module, computations,
    instructions) and with its TF op paths unnumbered, and ``options`` (the compile
    options, as text)."""
    plain = type(module)()
    plain.CopyFrom(module)
    plain.name = ""
    for comp in plain.computations:
        comp.name = ""
        for instr in comp.instructions:
            instr.name = ""
            instr.source_op = _unnumbered(instr.source_op)
            instr.source_type = _unnumbered(instr.source_type)
    digest = hashlib.sha256(plain.SerializeToString(deterministic=True))
    digest.update(options.encode())
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def stop_code(reason: str | None) -> int:
    """``reason`` (a ``StopToken`` reason, or None) as an agreed code."""
    if reason is None:
        return 0
    return STOP_REASONS.index(reason) + 1 if reason in STOP_REASONS else 1


def stop_reason(code: int) -> str | None:
    """The reason of an agreed code (0: None)."""
    return STOP_REASONS[code - 1] if 0 < code <= len(STOP_REASONS) else None


@dataclass(frozen=True)
class _Holder:
    """The world execution that holds a server: its call, program, number, and since when
    (``time.time()`` and ``time.monotonic()``)."""

    what: str
    digest: int
    execution: int
    wall: float
    since: float


class World:
    """The device servers of one run, as MPI ranks: server ``rank`` serves instance
    ``rank``.

    Args:
        comm: an MPI communicator of the servers only (``MPI.COMM_WORLD`` of their job);
            duplicated twice (collectives, failure notices), so no other user of it can
            match these messages.
    """

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self.comm = comm.Dup()
        self.notices = comm.Dup()
        for c in (self.comm, self.notices):
            c.Set_errhandler(MPI.ERRORS_RETURN)  # an MPI error raises, never aborts the server
        self._mpi_lock = threading.RLock()
        self._run_lock = threading.Lock()  # one world execution at a time on this server
        self._holder: _Holder | None = None  # the world execution that holds it
        self._broken: str | None = None
        self._executions = 0
        self._notice = np.zeros(NOTICE_BYTES, np.uint8)
        self._notice_status = MPI.Status()
        self._notice_request = self.notices.Irecv([self._notice, MPI.BYTE],
                                                  source=MPI.ANY_SOURCE, tag=_NOTICE_TAG)
        self._sent: list[tuple[Any, np.ndarray]] = []
        self.stats = {"executions": 0, "collectives": 0, "all_reduce_bytes_sent": 0,
                      "all_reduce_bytes_received": 0, "failures_sent": 0,
                      "failures_received": 0, "run_waits_given_up": 0}

    @classmethod
    def from_mpi(cls) -> World:
        """The world of this MPI job (``COMM_WORLD``: the run's device servers)."""
        from mpi4py import MPI

        return cls(MPI.COMM_WORLD)

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size})"

    # -- failure ------------------------------------------------------------------------

    @property
    def broken(self) -> str | None:
        """Why the run is broken (then every world execution fails), or None."""
        self._poll_notice()
        return self._broken

    def _poll_notice(self) -> None:
        with self._mpi_lock:
            if self._broken is not None or self._notice_request is None:
                return
            if not self._notice_request.Test(self._notice_status):
                return
            source = self._notice_status.Get_source()
            size = self._notice_status.Get_count(self._mpi.BYTE)
            self._notice_request = None
        text = bytes(self._notice[:size]).decode("utf-8", "replace")
        self.stats["failures_received"] += 1
        self._broken = f"instance {source} (device server rank {source}) failed: {text}"

    def fail(self, message: str) -> None:
        """This server's replicas failed: tells every other server (the run is broken) and
        keeps the message for later world executions here."""
        with self._mpi_lock:
            if self._broken is not None:
                return
            self._broken = f"instance {self.rank} (device server rank {self.rank}) failed: " \
                           f"{message}"
            data = np.frombuffer(message.encode("utf-8")[:NOTICE_BYTES], np.uint8).copy()
            for peer in range(self.size):
                if peer != self.rank:
                    try:
                        request = self.notices.Isend([data, self._mpi.BYTE], dest=peer,
                                                     tag=_NOTICE_TAG)
                    except self._mpi.Exception:  # that server is gone: nobody to tell
                        continue
                    self._sent.append((request, data))
            self.stats["failures_sent"] += 1

    def _check(self, where: str) -> None:
        reason = self.broken
        if reason is not None:
            raise WorldBroken(f"{where}: the run is broken: {reason}")

    # -- waiting ------------------------------------------------------------------------

    def wait(self, request: Any, where: str, stopped: Any = None) -> None:
        """Polls ``request`` until it completes, sleeping between polls; raises
        ``WorldBroken`` when a failure notice arrives meanwhile. ``stopped()``: whether this
        server's run was told to stop (then the others get ``STOPPED_WAIT_SECONDS``)."""
        delay = _POLL_FIRST
        since: float | None = None
        while True:
            try:
                with self._mpi_lock:
                    done = request.Test()
            except self._mpi.Exception as e:  # e.g. another server died
                self.fail(f"MPI error at {where}: {e}")
                raise WorldBroken(f"{where}: {self._broken}") from e
            if done:
                return
            self._poll_notice()
            if self._broken is not None:
                with self._mpi_lock:
                    if request.Test():  # completed meanwhile: the failure is met later
                        return
                raise WorldBroken(f"{where}: stopped: {self._broken}")
            if stopped is not None and stopped():
                since = since if since is not None else time.monotonic()
                if time.monotonic() - since > STOPPED_WAIT_SECONDS:
                    message = (f"its run was stopped while it waited {STOPPED_WAIT_SECONDS:g} s "
                               f"for the other servers at {where}")
                    self.fail(message)
                    raise WorldBroken(f"{where}: instance {self.rank} {message}")
            time.sleep(delay)
            delay = min(delay * _POLL_GROWTH, _POLL_MAX)

    def allgather(self, mine: np.ndarray, where: str, stopped: Any = None) -> np.ndarray:
        """Every server's ``mine`` (same dtype and size everywhere), stacked in rank order."""
        out = np.empty((self.size, *mine.shape), mine.dtype)
        with self._mpi_lock:
            request = self.comm.Iallgather(np.ascontiguousarray(mine), out)
        self.wait(request, where, stopped)
        return out

    # -- runs ---------------------------------------------------------------------------

    @contextmanager
    def run(self, digest: int, local_replicas: int, what: str,
            stopped: Any = None) -> Iterator[WorldRun]:
        """One execution of the program of ``digest`` (``program_digest``) on this server's
        ``local_replicas`` replicas, joined with the same execution on every server:
        checked at once (``begin``), serialized with the other world executions here.

        ``stopped()``: whether this server's run was told to stop: its reason
        (``StopToken.reason``: ``"deadline"``, ``"cancelled"``, ...), or a bool (True reads
        as ``"deadline"``). While another world execution holds this server, the call waits
        for it in slices of ``RUN_LOCK_SLICE_SECONDS`` and gives up (``RunStopped``, naming
        the one that holds the server and since when) as soon as ``stopped()`` says so."""
        self._acquire_run(digest, stopped)
        try:
            self._check(what)
            run = WorldRun(self, digest, self._executions, local_replicas, what, stopped)
            self._holder = _Holder(what, digest, self._executions, time.time(),
                                   time.monotonic())
            self._executions += 1
            self.stats["executions"] += 1
            run.begin()
            yield run
        finally:
            self._holder = None
            self._run_lock.release()

    def _acquire_run(self, digest: int, stopped: Any) -> None:
        """Takes the server's world-execution lock, or raises ``RunStopped`` once
        ``stopped()`` says this call's run was stopped while another held it."""
        started = time.monotonic()
        while not self._run_lock.acquire(timeout=RUN_LOCK_SLICE_SECONDS):
            said = stopped() if stopped is not None else None
            if not said:
                continue
            if isinstance(said, str) and said in STOP_REASONS:
                reason, why = said, said
            else:  # a bare "stopped": its reason is not known here
                reason, why = "deadline", "its deadline, a cancel, its session closed or a shutdown"
            holder = self._holder
            held = (f"{holder.what} (program {holder.digest & 0xffffffffffffffff:016x}, world "
                    f"execution {holder.execution}) since "
                    f"{time.strftime('%H:%M:%S', time.gmtime(holder.wall))} UTC "
                    f"({time.monotonic() - holder.since:.1f} s)") if holder is not None \
                else "an execution that is just ending"
            self.stats["run_waits_given_up"] += 1
            raise RunStopped(
                f"not run: another world execution holds device server rank {self.rank} "
                f"(one at a time on a server): {held}; this call (program "
                f"{digest & 0xffffffffffffffff:016x}) waited {time.monotonic() - started:.1f} s "
                f"for it, then its run was stopped ({why})", reason)

    def close(self) -> None:
        """Withdraws the posted failure receive (before MPI is finalized at exit)."""
        with self._mpi_lock:
            request, self._notice_request = self._notice_request, None
            if request is not None:
                request.Cancel()
                request.Wait()

    def counters(self) -> dict[str, int]:
        """The world's counters, for the server's ``GetCounters``."""
        values = {f"world.{k}": v for k, v in self.stats.items()}
        values.update({"world.rank": self.rank, "world.size": self.size,
                       "world.broken": int(self._broken is not None)})
        return values


@dataclass
class WorldRun:
    """One execution of a world program on this server (``world.run``): its collectives,
    numbered. ``digest``: the program's; ``execution``: the world executions before it here;
    ``local``: this server's replicas; ``what``: the call, for messages; ``stopped()``:
    whether this server's run was told to stop."""

    world: World
    digest: int
    execution: int
    local: int
    what: str
    stopped: Any = None
    seq: int = 0

    @property
    def first_replica(self) -> int:
        """The global index of this server's first replica."""
        return self.world.rank * self.local

    @property
    def replicas(self) -> int:
        """The run's replicas (every server runs as many)."""
        return self.world.size * self.local

    def _exchange(self, kind: int, where: str, nbytes: int = 0, value: int = 0) -> np.ndarray:
        """Every server's header for this collective, checked to be the same collective of
        the same program; returns the headers [servers, fields]."""
        w = self.world
        header = np.zeros(_HEADER, np.int64)
        header[[_KIND, _DIGEST, _EXECUTION, _SEQ, _BYTES, _LOCAL, _VALUE, _RANK]] = (
            kind, self.digest, self.execution, self.seq, nbytes, self.local, value, w.rank)
        self.seq += 1
        w._check(where)
        headers = w.allgather(header, f"{self.what}: {where}", self.stopped)
        w.stats["collectives"] += 1
        same = (_KIND, _DIGEST, _EXECUTION, _SEQ, _BYTES, _LOCAL)
        if (headers[:, same] == headers[0, same]).all():
            return headers
        # Every server sees the same headers, so every one raises this (none waits).
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(w.size):
            groups.setdefault(tuple(int(v) for v in headers[r, same]), []).append(r)
        parts = []
        for fields, ranks in groups.items():
            k, digest, execution, seq, nb, local = fields
            names = ", ".join(str(r) for r in ranks)
            parts.append(f"instance{'s' if len(ranks) > 1 else ''} {names}: "
                         f"{_KIND_NAMES.get(k, k)} (collective {seq}) of world execution "
                         f"{execution}, program {digest & 0xffffffffffffffff:016x}, "
                         f"{local} local replica{'s' if local != 1 else ''}, {nb} bytes")
        if kind == BEGIN and len({int(d) for d in headers[:, _DIGEST]}) > 1:
            lead = "the instances did not all compile the same program"
        elif len({int(v) for v in headers[:, _LOCAL]}) > 1:
            lead = "the instances run different numbers of local replicas"
        else:
            lead = "the instances reached different collectives"
        raise WorldMismatch(f"{self.what}: {where}: {lead} ({'; '.join(parts)}); every "
                             f"instance must run the same program, step for step.")

    def begin(self) -> None:
        """Checks that every server starts the same program with as many local replicas."""
        self._exchange(BEGIN, "before the first step")

    def agree(self, code: int, where: str, kind: int = AGREE) -> int:
        """The highest of every server's ``code`` (0: go on)."""
        headers = self._exchange(kind, where, value=int(code))
        return int(headers[:, _VALUE].max())

    def contributions(self, values: Sequence[Sequence[np.ndarray]],
                      where: str) -> list[list[np.ndarray]]:
        """``values[l][k]``: operand k of local replica l. Returns the operands of every
        replica of the run in global replica order (server rank, then local index), for the
        caller to reduce left to right as one server holding them all would."""
        local = [[np.ascontiguousarray(a) for a in replica] for replica in values]
        specs = [(a.dtype, a.shape) for a in local[0]]
        for replica in local[1:]:
            if [(a.dtype, a.shape) for a in replica] != specs:
                raise ExecutionError(f"{where}: the local replicas' operands differ in type")
        mine = np.concatenate([a.reshape(-1).view(np.uint8) for replica in local
                               for a in replica]) if specs else np.zeros(0, np.uint8)
        self._exchange(ALL_REDUCE, where, nbytes=int(mine.size))
        w = self.world
        gathered = w.allgather(mine, f"{self.what}: {where}", self.stopped)
        # What crossed MPI for this server: its operands to each other server, theirs to it.
        w.stats["all_reduce_bytes_sent"] += int(mine.size) * (w.size - 1)
        w.stats["all_reduce_bytes_received"] += int(mine.size) * (w.size - 1)
        everyone: list[list[np.ndarray]] = []
        for r in range(w.size):
            at = 0
            for _ in range(self.local):
                ops = []
                for dt, shape in specs:
                    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                    ops.append(gathered[r, at:at + n].view(dt).reshape(shape))
                    at += n
                everyone.append(ops)
        return everyone


__all__ = ["ALL_REDUCE", "AGREE", "BEGIN", "PULL", "STOP_REASONS", "World", "WorldBroken",
           "WorldMismatch", "WorldRun", "program_digest", "stop_code", "stop_reason"]
