"""Replicas: one program run by R emulated IPUs at once, meeting at its collectives.

    run_replicated(exe, args per replica, stop)
        replica 0 (this thread)    replica 1 (a thread)   ...   replica R-1
        exe.run(args[0])           exe.run(args[1])             exe.run(args[R-1])
            │ tf_ipu_all_reduce        │ tf_ipu_all_reduce          │
            └───────────── ReplicaGroup.all_reduce ─────────────────┘
                 the last replica to arrive reduces (in replica order), all go on
            │ device loop step boundary: ReplicaGroup.agree (stop now? one answer for all)

A replicated program is the program of one replica (data parallelism: every replica holds
the whole model and its own variables); ``tf_ipu_replica_id`` tells each which it is, and
``tf_ipu_all_reduce`` combines values across replicas, as Graphcore's replicated graphs do
with their cross-replica sums (GCL). Replicas stop together: whether to end a device loop
is decided once per step for all of them, so none waits at a collective the others never
reach; a replica that fails breaks the group, and the others stop at their next collective.
The reduction adds in replica order, so results do not depend on thread timing.

Across device servers (``emulator/world.py``): a program compiled for several instances runs
its local replicas here as replicas ``first_replica .. first_replica + R - 1`` of the run
(``tf_ipu_replica_id`` gives that global index); where it meets (all-reduce, a step's stop
decision, an infeed pull), the last local replica to arrive also meets the other servers
(a ``WorldRun``), so sums span every replica of the run, in global order, and stop
decisions are the run's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from device_server.emulator import cancel
from device_server.emulator.errors import EmulatorError, ExecutionError
from device_server.emulator.world import (
    PULL,
    WorldBroken,
    WorldMismatch,
    WorldRun,
    stop_code,
    stop_reason,
)

#: Reductions ``tf_ipu_all_reduce`` knows (its ``backend_config``), as Graphcore's GCL names
#: ADD, MEAN, MAX, MIN, MUL.
REDUCTIONS = ("sum", "mean", "max", "min", "prod")
_UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
          "prod": np.multiply}
#: How often a replica waiting at a collective looks whether the group broke.
_POLL_SECONDS = 0.05


class GroupBroken(EmulatorError):
    """Another replica of the run failed: this one stops at its next collective."""


class ReplicaGroup:
    """The replicas of one run: where they meet.

    Args:
        count: how many replicas run the program here.
        token: the run's stop token (``cancel.StopToken``) or None.
        world: the run's meeting with the other device servers (a program of several
            instances that meets), or None.
        first_replica: the global index of this server's first replica (a program of
            several instances: its server's rank x ``count``), else 0.
    """

    def __init__(self, count: int, token: cancel.StopToken | None = None,
                 world: WorldRun | None = None, first_replica: int = 0) -> None:
        if count < 1:
            raise ValueError(f"a replica group needs at least one replica, not {count}")
        self.count = count
        self.token = token
        self.world = world
        self.first_replica = world.first_replica if world is not None else first_replica
        self._cond = threading.Condition(threading.Lock())
        self._arrived = 0
        self._generation = 0
        self._values: list[Any] = [None] * count
        self._where: list[str] = [""] * count
        self._results: list[Any] = [None] * count
        self._broken: BaseException | None = None
        #: Collectives completed (each all-reduce or agreement counts once for the group).
        self.meetings = 0
        #: Bytes each replica contributed to all-reduces (one replica's share).
        self.all_reduce_bytes = 0

    def fail(self, error: BaseException) -> None:
        """Breaks the group: replicas waiting at a collective, or arriving at one, stop."""
        with self._cond:
            if self._broken is None:
                self._broken = error
            self._cond.notify_all()

    def _meet(self, replica: int, where: str, value: Any, combine: Any) -> Any:
        """Waits until every replica arrived at the collective ``where`` with its ``value``;
        the last one computes ``combine(values) -> per-replica results``."""
        with self._cond:
            if self._broken is not None:
                raise GroupBroken(f"{where}: replica {replica} stops: another replica failed")
            generation = self._generation
            self._values[replica] = value
            self._where[replica] = where
            self._arrived += 1
            if self._arrived == self.count:
                try:
                    if len(set(self._where)) != 1:
                        raise ExecutionError(
                            "the replicas reached different collectives at once ("
                            + "; ".join(f"replica {r}: {w}" for r, w in enumerate(self._where))
                            + "): a collective inside a branch only some replicas took")
                    self._results = combine(self._values)
                except BaseException as e:
                    self._broken = e
                    self._cond.notify_all()
                    raise
                self._values = [None] * self.count
                self._arrived = 0
                self._generation += 1
                self.meetings += 1
                self._cond.notify_all()
                return self._results[replica]
            while self._generation == generation:
                if self._broken is not None:
                    raise GroupBroken(f"{where}: replica {replica} stops: another replica failed")
                self._cond.wait(_POLL_SECONDS)
            return self._results[replica]

    def all_reduce(self, replica: int, op: str, arrays: Sequence[np.ndarray],
                   where: str) -> list[np.ndarray]:
        """``arrays`` of this replica reduced with those of every replica (``op`` one of
        ``REDUCTIONS``); each replica gets arrays of its own."""
        ufunc = _UFUNC[op]

        def combine(values: list[Any]) -> list[Any]:
            # Every replica's operands in (global) replica order: this server's, or the run's.
            everyone = values if self.world is None else self.world.contributions(values, where)
            reduced = []
            for k in range(len(values[0])):
                total = np.array(everyone[0][k], copy=True)
                for r in range(1, len(everyone)):
                    ufunc(total, everyone[r][k], out=total)
                if op == "mean":
                    total = (total / total.dtype.type(len(everyone))).astype(total.dtype,
                                                                            copy=False)
                reduced.append(total)
            self.all_reduce_bytes += sum(int(np.asarray(a).nbytes) for a in values[0])
            # Replica 0 keeps the reduced arrays; the others get copies (a program may write
            # into a value it was given).
            return [reduced] + [[a.copy() for a in reduced] for _ in range(1, self.count)]

        return self._meet(replica, where, list(arrays), combine)

    def agree(self, replica: int, where: str, ask: Any) -> Any:
        """One answer for all replicas: ``ask()`` called once, by the last to arrive."""
        return self._meet(replica, where, None, lambda _: [ask()] * self.count)

    def stop_now(self, replica: int, where: str, token: cancel.StopToken) -> bool:
        """Whether the run stops at this step: one answer for all replicas of the run (of
        every server: the highest stop reason of any wins, and becomes this token's)."""
        world = self.world
        if world is None:
            return bool(self.agree(replica, where, token.at_step))

        def ask() -> bool:
            code = world.agree(stop_code(token.reason if token.at_step() else None), where)
            if code and token.reason is None:
                token.stop(stop_reason(code) or "cancelled")  # another instance's stop
            return bool(code)

        return bool(self.agree(replica, where, ask))


class ReplicaToken:
    """A replica's view of the run's stop token: device loops of all replicas end at the
    same step (``at_step`` is agreed by the group); infeeds and outfeeds are the run's."""

    def __init__(self, group: ReplicaGroup, replica: int, parent: cancel.StopToken | None) -> None:
        self.group = group
        self.replica = replica
        self.parent = parent
        self.infeed = self._pull if parent is not None and parent.infeed is not None else None
        self.outfeed = parent.outfeed if parent is not None else None
        self._loops = 0
        self._steps = 0
        self.steps_completed: int | None = None

    @property
    def reason(self) -> str | None:
        return self.parent.reason if self.parent is not None else None

    def _pull(self, feed: str, token: Any, where: str) -> Any:
        """A pull from infeed ``feed``: the replicas meet, the last to arrive pulls one
        batch per replica in replica order (replica r gets the feed's batches r, r+R, ...,
        as Graphcore's infeeds feed replicas), and a group the feed cannot fill ends it
        for all (its batches are dropped, as Graphcore drops them)."""
        parent = self.parent
        assert parent is not None and parent.infeed is not None

        world = self.group.world

        def combine(_: list[Any]) -> list[Any]:
            batches = []
            for _r in range(self.group.count):
                batch = parent.infeed(feed, parent, where)
                if batch is None:
                    break
                batches.append(batch)
            ended = len(batches) < self.group.count
            if world is not None:  # the feed of any instance ended: it ends for the run
                ended = bool(world.agree(int(ended), f"{where} pull", PULL))
            return [None] * self.group.count if ended else batches

        return self.group._meet(self.replica, f"{where} pull", None, combine)

    def at_step(self) -> bool:
        parent = self.parent
        if parent is None:
            return False
        self._steps += 1
        return self.group.stop_now(self.replica, f"step {self._steps} of the device loop", parent)

    def in_loop(self) -> bool:
        return self.parent.in_loop() if self.parent is not None else False

    def device_loop(self) -> Any:
        token = self

        class _Loop:
            def __enter__(self) -> None:
                token._loops += 1
                if token.parent is not None:
                    token._parent_loop = token.parent.device_loop()
                    token._parent_loop.__enter__()

            def __exit__(self, *exc: object) -> None:
                token._loops -= 1
                if token.parent is not None:
                    token._parent_loop.__exit__(*exc)

        return _Loop()

    def ended_early(self, completed: int) -> None:
        if self._loops <= 1:
            self.steps_completed = completed

    def stopped(self, where: str) -> cancel.RunStopped:
        if self.parent is not None:
            return self.parent.stopped(f"{where} (replica {self.group.first_replica + self.replica})")
        return cancel.RunStopped(
            f"stopped at {where} (replica {self.group.first_replica + self.replica})", "cancelled")


_local = threading.local()


def current() -> tuple[ReplicaGroup, int] | None:
    """(group, replica index) of the replica running on this thread, or None."""
    return getattr(_local, "replica", None)


def run_replicated(exe: Any, args: Sequence[Sequence[np.ndarray]],
                   donated: Sequence[Iterable[int]] | None = None,
                   stop: cancel.StopToken | None = None, world: WorldRun | None = None,
                   first_replica: int = 0) -> tuple[list[list[np.ndarray]], ReplicaGroup]:
    """Runs ``exe`` (an ``Executable``) once per replica, replica ``r`` on ``args[r]`` (the
    replicas may share arrays they only read), all at once; returns each replica's outputs
    and the group (its counters). ``donated[r]``: as ``Executable.run``'s, per replica.
    A device loop stopped early leaves ``stop.steps_completed`` set, as for one replica.
    ``world``: the run's meeting with the other servers (their replicas are the run's
    too); ``first_replica``: the global index of replica 0 here when there is no meeting.
    Raises the first replica's error (not a ``GroupBroken`` of the others); with a world, an
    error of this server's replicas is first sent to the other servers (the run breaks)."""
    count = len(args)
    group = ReplicaGroup(count, stop, world, first_replica)
    donated = list(donated) if donated is not None else [()] * count
    tokens = [ReplicaToken(group, r, stop) for r in range(count)]
    # Each replica's outfeed items, handed on after the run as one item per step holding
    # every replica's values (a leading dimension of replicas), as Graphcore's outfeeds do.
    outfed: list[list[tuple[str, list[np.ndarray]]]] = [[] for _ in range(count)]
    if stop is not None and stop.outfeed is not None:
        for r, t in enumerate(tokens):
            t.outfeed = lambda feed, arrays, r=r: outfed[r].append((feed, arrays))
    results: list[list[np.ndarray] | None] = [None] * count
    errors: list[BaseException | None] = [None] * count

    def one(r: int) -> None:
        previous = getattr(_local, "replica", None)
        _local.replica = (group, r)
        try:
            results[r] = exe.run(args[r], donated[r], stop=tokens[r])  # type: ignore[arg-type]
        except BaseException as e:  # handed to the caller below
            errors[r] = e
            group.fail(e)
        finally:
            _local.replica = previous

    threads = [threading.Thread(target=one, args=(r,), name=f"tf_ipu-replica-{r}", daemon=True)
               for r in range(1, count)]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, GroupBroken)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        if world is not None and not isinstance(first, (WorldBroken, WorldMismatch)):
            # Not agreed by the run (as a mismatch or a stop is): the others must not wait.
            world.world.fail(f"{type(first).__name__}: {first}")
        raise first
    if stop is not None:
        completed = [t.steps_completed for t in tokens]
        if completed[0] is not None:
            stop.steps_completed = completed[0]
        if any(outfed):
            if len({len(items) for items in outfed}) != 1:
                raise ExecutionError(
                    "the replicas enqueued different numbers of outfeed items ("
                    + ", ".join(str(len(items)) for items in outfed) + ")")
            for step in zip(*outfed, strict=True):
                feed = step[0][0]
                stop.outfeed(feed, [np.stack([item[1][k] for item in step])
                                    for k in range(len(step[0][1]))])
    return [list(r) for r in results if r is not None], group
