"""Sessions, leases and IPU allocation on the device server.

A session is the unit of isolation: it owns the IPUs attached to it (exclusively), the
architecture it compiles for, its device-resident variables and its executable handles. A
session lives while its client keeps its lease alive (any call or a Heartbeat), or, with a
connection lease, while the client's connection is up; a reaper thread closes sessions whose
lease has run out and frees their IPUs.

Connection leases (``OpenSessionRequest.connection_lease``): a client whose Python is busy
(TensorFlow tracing a large model holds the GIL for tens of seconds) cannot send Heartbeats,
but gRPC's C core in its process still answers the server's keepalive pings, which the
server sends on every connection (``server.keepalive_options``): a connection that stops
answering is closed by the server, one whose process died is closed by the kernel. So the
session is tied to the TCP connections its OpenSession and Heartbeats came on (the call's
peer, ``ipv4:10.0.0.7:53122``), and when its lease runs out the reaper renews it if one of
them is still open. Which connections are open is read from gRPC's channelz
(``ConnectionTable``): one look per reaper pass, and only when a connection-leased session's
time is up or a new connection was bound, so it costs no thread, no RPC and nothing per call.
A client that is gone loses its connection, and then its session within the lease.

AttachIpus may wait,
within a bound, for IPUs to be freed (not first come, first served: a request that fits the
free IPUs goes ahead of one waiting for more).

Calls of one session are serialized by the session's lock (``Session.enter``); calls of
different sessions run concurrently. Heartbeats never wait for that lock.

Nothing here speaks gRPC beyond the status codes of ``ServiceError``; ``service.py`` turns
those into gRPC errors.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

logger = logging.getLogger(__name__)

#: Bounds on the lease a client may ask for.
MIN_LEASE_SECONDS = 0.2
MAX_LEASE_SECONDS = 24 * 3600.0
#: Connections one session may be tied to at once (a reconnecting client adds one each time;
#: closed ones are dropped at the reaper's next look).
MAX_SESSION_CONNECTIONS = 8
#: Peers that name one TCP connection (a Unix socket's peer is "unix:" for every client).
_CONNECTION_PEERS = ("ipv4:", "ipv6:")


class ServiceError(Exception):
    """An error to send back to the client as a gRPC status.

    Args:
        code: the gRPC status code.
        message: what went wrong, naming what was received.
        kind: a machine-readable refinement sent as trailing metadata ``tf-ipu-error-kind``
            (e.g. ``"out-of-memory"`` vs ``"no-free-ipus"``, both RESOURCE_EXHAUSTED).
    """

    def __init__(self, code: grpc.StatusCode, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind


class IpuPool:
    """The server's IPUs, handed out exclusively to sessions.

    Args:
        num_ipus: how many IPUs the server hosts (ids ``0 .. num_ipus-1``).
    """

    def __init__(self, num_ipus: int) -> None:
        if num_ipus < 1:
            raise ValueError(f"A device server needs at least one IPU. Received: num_ipus={num_ipus}")
        self.num_ipus = num_ipus
        self.description = ""  # what the IPUs are, for messages (e.g. the server's system)
        self._owner: dict[int, str] = {}
        self._changed = threading.Condition(threading.Lock())
        self._closed = False

    @property
    def free(self) -> int:
        """How many IPUs are not attached to any session."""
        with self._changed:
            return self.num_ipus - len(self._owner)

    def allocate(
        self,
        count: int,
        session_id: str,
        wait_seconds: float = 0.0,
        still_wanted: Callable[[], bool] | None = None,
        wanted: Sequence[int] = (),
    ) -> list[int]:
        """Attaches ``count`` free IPUs to ``session_id``, waiting for them if asked.

        Args:
            count: how many IPUs (the length of ``wanted`` if that is given; 0 is fine then).
            session_id: the owner.
            wanted: exactly these IPUs (IPUConfig.select_ipus), instead of any free ones.
            wait_seconds: how long to wait for enough IPUs to become free (0: not at all).
            still_wanted: polled while waiting; returning False ends the wait (the caller
                went away).

        Returns:
            The ids of the IPUs, ascending.

        Raises:
            ServiceError: INVALID_ARGUMENT for ``count < 1`` or ``count`` above what the
                server hosts; RESOURCE_EXHAUSTED naming the requested and free counts when
                not enough IPUs were free in time; UNAVAILABLE if the server shuts down.
        """
        wanted = list(wanted)
        if wanted:
            bad = [i for i in wanted if not 0 <= i < self.num_ipus]
            if bad or len(set(wanted)) != len(wanted) or count not in (0, len(wanted)):
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"AttachIpus: ipu_ids {wanted} "
                    + (f"name IPUs this server does not have (it has IPUs 0 to "
                       f"{self.num_ipus - 1})" if bad else
                       "repeat an IPU" if len(set(wanted)) != len(wanted) else
                       f"do not match num_ipus={count}") + ".",
                )
            count = len(wanted)
        if count < 1:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"AttachIpus needs num_ipus >= 1. Received: num_ipus={count}",
            )
        if count > self.num_ipus:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"AttachIpus: {count} IPUs asked for (IPUConfig.auto_select_ipus = {count}: "
                f"one per replica), but this server hosts {self.num_ipus}"
                f"{f' ({self.description})' if self.description else ''}: ask for at most "
                f"{self.num_ipus}, or use a server with more IPUs (--ipus {count}, or a "
                f"larger --system).",
                kind="too-many-ipus",
            )
        start = time.monotonic()
        end = start + max(0.0, wait_seconds)
        with self._changed:
            while True:
                if self._closed:
                    raise ServiceError(
                        grpc.StatusCode.UNAVAILABLE,
                        "The device server is shutting down; no IPUs are handed out.",
                        kind="shutting-down",
                    )
                free = [i for i in range(self.num_ipus) if i not in self._owner]
                if wanted and all(i in free for i in wanted):
                    for i in wanted:
                        self._owner[i] = session_id
                    return sorted(wanted)
                if not wanted and count <= len(free):
                    ids = free[:count]
                    for i in ids:
                        self._owner[i] = session_id
                    return ids
                remaining = end - time.monotonic()
                if (count > self.num_ipus or remaining <= 0
                        or (still_wanted is not None and not still_wanted())):
                    waited = time.monotonic() - start
                    if wanted:
                        taken = [i for i in wanted if i not in free]
                        raise ServiceError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"IPU {', '.join(map(str, taken))} (selected by ipu_ids) "
                            f"{'is' if len(taken) == 1 else 'are'} attached to another "
                            f"session; free IPUs: {free or 'none'}"
                            + (f" (after waiting {waited:.1f} s)" if wait_seconds > 0 else "")
                            + ".",
                            kind="no-free-ipus",
                        )
                    raise ServiceError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Not enough free IPUs: requested {count}, free {len(free)} "
                        f"of {self.num_ipus} on this server"
                        + (f" (after waiting {waited:.1f} s)" if wait_seconds > 0 else "")
                        + ".",
                        kind="no-free-ipus",
                    )
                self._changed.wait(min(remaining, 0.25))

    def release(self, ids: list[int]) -> None:
        """Returns IPUs to the pool (and wakes calls waiting for them)."""
        with self._changed:
            for i in ids:
                self._owner.pop(i, None)
            self._changed.notify_all()

    def close(self) -> None:
        """Ends every wait for IPUs (UNAVAILABLE) and refuses later allocations."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class ConnectionTable:
    """The client connections open on this process's gRPC servers, from gRPC's channelz.

    gRPC's C core keeps a channelz node for each connection a server holds (it is on by
    default, ``grpc.enable_channelz``), named after the peer as ``ServicerContext.peer()``
    gives it; grpcio reads them through ``grpc._cython.cygrpc.channelz_*`` (the functions the
    grpcio-channelz service wraps). Connection ids are never reused in a process. If channelz
    cannot be read (a future grpcio without these functions), ``snapshot`` returns None and
    sessions fall back to their time leases.
    """

    def __init__(self) -> None:
        try:
            from grpc._cython import cygrpc

            self._servers = cygrpc.channelz_get_servers
            self._sockets = cygrpc.channelz_get_server_sockets
        except (ImportError, AttributeError):
            self._servers = self._sockets = None
        self._warned = False

    @property
    def available(self) -> bool:
        """Whether channelz can be read here."""
        return self._servers is not None

    def snapshot(self) -> dict[str, int] | None:
        """``peer -> connection id`` of every client connection open right now (a peer seen
        on two connections, of two servers of this process, maps to -1: ambiguous); None if
        channelz cannot be read."""
        if self._servers is None or self._sockets is None:
            return None
        try:
            live: dict[str, int] = {}
            for server_id in self._pages(lambda start: self._servers(start), "server",
                                         lambda ref: int(ref["ref"]["serverId"])):
                for sock in self._pages(lambda start, sid=server_id: self._sockets(sid, start, 0),
                                        "socketRef", lambda ref: ref):
                    peer = str(sock.get("name", "")).partition(" ")[2]  # "chttp2 <peer>"
                    conn = int(sock["socketId"])
                    live[peer] = -1 if peer in live else conn
            return live
        except Exception as e:  # malformed or changed channelz output
            if not self._warned:
                self._warned = True
                logger.warning("cannot read gRPC's channelz (%s: %s): sessions are kept by "
                               "their time leases only", type(e).__name__, e)
            return None

    @staticmethod
    def _pages(fetch: Callable[[int], str], key: str, item: Callable[[Any], Any]) -> list[Any]:
        """Every entry of a paginated channelz listing (``fetch(start_id)`` -> JSON)."""
        out: list[Any] = []
        start = 0
        while True:
            page = json.loads(fetch(start))
            entries = page.get(key, [])
            out.extend(item(e) for e in entries)
            if page.get("end", True) or not entries:
                return out
            last = entries[-1]
            start = int(last["ref"]["serverId"] if key == "server" else last["socketId"]) + 1


@dataclass
class ExecutableHandle:
    """A session's handle on a compiled executable (shared through the server's cache)."""

    handle_id: str
    cache_key: str
    executable: Any  # device_server.emulator Executable


class Session:
    """One client's session: IPUs, architecture, variables and executable handles.

    Fields other than ``last_seen`` are read and written only while the session has been
    entered (``with session.enter(): ...``).
    """

    def __init__(self, session_id: str, client_name: str, lease_seconds: float) -> None:
        self.session_id = session_id
        self.client_name = client_name
        self.lease_seconds = lease_seconds
        self.opened_at = time.monotonic()
        self.last_seen = self.opened_at
        self.closed = False
        # Connection lease: kept while one of these connections is open (peer -> channelz
        # connection id, 0 until the reaper looked it up); guarded by the manager's lock.
        self.connection_lease = False
        self.connections: dict[str, int] = {}
        self.ipu_ids: list[int] = []
        self.target: Any = None  # device_server.emulator Target while IPUs are attached
        self.ipu_version = ""
        self.tiles_per_ipu = 0
        self.variables: dict[str, np.ndarray] = {}
        # Replicated programs: each replica's own copy of a variable, replicas 1.. (replica 0's
        # is ``variables``). Made from replica 0's when a replicated run first binds it; a
        # host write replaces them all (the host's value goes to every replica, host reads
        # see replica 0's, as on Graphcore's replicated graphs).
        self.replica_variables: dict[str, list[np.ndarray | None]] = {}
        self.executables: dict[str, ExecutableHandle] = {}
        self.handle_by_key: dict[str, str] = {}
        self._lock = threading.Lock()
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self.data: Any = None  # device_server.data_path.SessionData, set by the service
        # Stop tokens of the runs in progress (emulator/cancel.py); guarded by _waiting_lock.
        self._runs: set[Any] = set()

    def run(self, token: Any) -> _Run:
        """Registers a run's stop token for the block (``with session.run(token):``), so
        that ``stop_runs`` reaches it."""
        return _Run(self, token)

    def stop_runs(self, reason: str) -> int:
        """Asks the session's runs in progress to stop (``reason`` as in
        ``emulator/cancel.py``); returns how many there were. Needs no lock held."""
        with self._waiting_lock:
            runs = list(self._runs)
        for token in runs:
            token.stop(reason)
        return len(runs)

    def __repr__(self) -> str:
        return (
            f"Session(id={self.session_id[:8]}.., client={self.client_name!r}, "
            f"ipus={self.ipu_ids}, ipu_version={self.ipu_version!r}, "
            f"variables={len(self.variables)}, executables={len(self.executables)})"
        )

    @property
    def short_id(self) -> str:
        """The id's first 8 characters, for logs (the whole id is a credential)."""
        return self.session_id[:8]

    def touch(self) -> None:
        """Renews the lease."""
        self.last_seen = time.monotonic()

    def expired(self, now: float) -> bool:
        """Whether the lease ran out before ``now`` (a ``time.monotonic()`` value)."""
        return now - self.last_seen > self.lease_seconds

    def variable_bytes(self) -> int:
        """Bytes of the session's resident variables, every replica's copy counted (read
        while the session is entered)."""
        return sum(v.nbytes for v in self.variables.values()) + sum(
            c.nbytes for copies in self.replica_variables.values() for c in copies if c is not None)

    def replica_variable(self, key: str, replica: int) -> np.ndarray:
        """Replica ``replica``'s copy of variable ``key`` (replica 0's is ``variables[key]``;
        another replica's is made from it the first time it is asked for)."""
        if replica == 0:
            return self.variables[key]
        copies = self.replica_variables.setdefault(key, [])
        if len(copies) < replica:
            copies.extend([None] * (replica - len(copies)))
        held = copies[replica - 1]
        if held is None:
            held = copies[replica - 1] = np.array(self.variables[key], copy=True, order="C")
        return held

    def set_replica_variable(self, key: str, replica: int, value: np.ndarray) -> None:
        """Makes ``value`` replica ``replica``'s copy (``replica`` >= 1) of variable ``key``."""
        copies = self.replica_variables.setdefault(key, [])
        if len(copies) < replica:
            copies.extend([None] * (replica - len(copies)))
        held = copies[replica - 1]
        if held is not None and held is not value and held.shape == value.shape \
                and held.dtype == value.dtype and held.flags.writeable:
            np.copyto(held, value)
        else:
            copies[replica - 1] = value if value.flags.owndata and value.flags.writeable \
                else np.array(value, copy=True, order="C")

    def enter(self, max_waiting: int, timeout: float | None = None) -> _Entered:
        """Serializes a call of this session (``with session.enter(...) as s:``); renews
        the lease on the way in and out.

        Args:
            max_waiting: how many calls of this session may wait for the lock at once; one
                more is refused (RESOURCE_EXHAUSTED) so that a single session cannot hold all
                of the server's worker threads.
            timeout: seconds to wait for the session's earlier call to finish (None: no
                bound); DEADLINE_EXCEEDED after it.

        Raises (on entering the block):
            ServiceError: RESOURCE_EXHAUSTED if ``max_waiting`` calls wait already;
                DEADLINE_EXCEEDED after ``timeout``; NOT_FOUND if the session was closed
                while the call waited.
        """
        return _Entered(self, max_waiting, timeout)

    def _acquire(self, max_waiting: int, timeout: float | None) -> None:
        """Takes the session's lock for ``enter``, by its rules."""
        # A class and a first try without waiting, not a generator: this is on the path of
        # every call, and usually no earlier call of the session is running.
        if not self._lock.acquire(blocking=False):
            with self._waiting_lock:
                if self._waiting >= max_waiting:
                    raise ServiceError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Session {self.session_id} already has {self._waiting} calls "
                        f"waiting; calls of one session run one at a time (limit "
                        f"{max_waiting} waiting).",
                        kind="too-many-calls",
                    )
                self._waiting += 1
            try:
                acquired = self._lock.acquire(
                    timeout=-1 if timeout is None else max(0.0, timeout))
            finally:
                with self._waiting_lock:
                    self._waiting -= 1
            if not acquired:
                raise ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"Session {self.session_id}: the call waited {timeout:.1f} s for the "
                    f"session's earlier call to finish (calls of one session run one at a "
                    f"time).",
                    kind="deadline",
                )
        if self.closed:
            self._lock.release()
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND, f"Session {self.session_id} was closed.",
                kind="unknown-session",
            )
        self.last_seen = time.monotonic()

    def try_enter(self) -> bool:
        """Takes the session's lock if it is free (the reaper's way in); see ``leave``."""
        return self._lock.acquire(blocking=False)

    def leave(self) -> None:
        """Releases the lock taken by ``try_enter``."""
        self._lock.release()


class _Entered:
    """``Session.enter``'s block: the session's lock is held inside it."""

    __slots__ = ("_session", "_max_waiting", "_timeout")

    def __init__(self, session: Session, max_waiting: int, timeout: float | None) -> None:
        self._session = session
        self._max_waiting = max_waiting
        self._timeout = timeout

    def __enter__(self) -> Session:
        self._session._acquire(self._max_waiting, self._timeout)
        return self._session

    def __exit__(self, *exc: object) -> None:
        session = self._session
        session.last_seen = time.monotonic()  # the lease runs from the call's end
        session._lock.release()


class _Run:
    """``Session.run``'s block: the run's stop token is registered inside it."""

    __slots__ = ("_session", "_token")

    def __init__(self, session: Session, token: Any) -> None:
        self._session = session
        self._token = token

    def __enter__(self) -> Any:
        with self._session._waiting_lock:
            self._session._runs.add(self._token)
        return self._token

    def __exit__(self, *exc: object) -> None:
        with self._session._waiting_lock:
            self._session._runs.discard(self._token)


class SessionManager:
    """All open sessions, the IPU pool, and the reaper that enforces leases.

    Args:
        pool: the server's IPUs.
        default_lease_seconds: the lease of a session that does not ask for one.
        max_waiting_calls: see ``Session.enter``.
        on_close: called with ``(session, reason)`` after a session is closed
            (``reason`` is ``"closed"`` or ``"expired"``); used for counters.
        reaper_period: seconds between lease checks.
        connections: where to see which client connections are open; None: no connection
            leases (every session keeps its time lease only).
    """

    def __init__(
        self,
        pool: IpuPool,
        default_lease_seconds: float = 60.0,
        max_waiting_calls: int = 8,
        on_close: Callable[[Session, str], None] | None = None,
        reaper_period: float = 0.25,
        connections: ConnectionTable | None = None,
    ) -> None:
        self.pool = pool
        self.connections = connections if connections is not None and connections.available \
            else None
        self._unresolved = False  # a session was bound to a connection not looked up yet
        self.default_lease_seconds = default_lease_seconds
        self.max_waiting_calls = max_waiting_calls
        self._on_close = on_close
        self._reaper_period = reaper_period
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the reaper thread."""
        if self._reaper is None:
            self._reaper = threading.Thread(
                target=self._reap_loop, name="device-server-reaper", daemon=True
            )
            self._reaper.start()

    def stop(self) -> None:
        """Stops the reaper, asks runs in progress to stop, and closes every session not
        inside a call (at shutdown, a call still running is not waited for)."""
        self._stop.set()
        self.pool.close()
        if self._reaper is not None:
            self._reaper.join(timeout=2.0)
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.stop_runs("shutdown")
            if s.try_enter():
                try:
                    self._close_locked(s, "closed")
                finally:
                    s.leave()

    # -- sessions -----------------------------------------------------------------------

    def open(self, client_name: str, lease_seconds: float, peer: str = "") -> Session:
        """Opens a session with a fresh random id.

        Args:
            client_name: free text for logs.
            lease_seconds: 0 for the server's default; otherwise within
                [MIN_LEASE_SECONDS, MAX_LEASE_SECONDS].
            peer: for a connection lease, the peer of the connection the request came on
                (``ServicerContext.peer()``); "": a time lease only. A peer that does not
                name one connection (a Unix socket's) gives a time lease too (see
                ``Session.connection_lease``).
        """
        if lease_seconds != lease_seconds or lease_seconds < 0:  # NaN or negative
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_seconds must be >= 0 (0 = server default). Received: {lease_seconds}",
            )
        if lease_seconds == 0:
            lease_seconds = self.default_lease_seconds
        if not MIN_LEASE_SECONDS <= lease_seconds <= MAX_LEASE_SECONDS:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_seconds must be within [{MIN_LEASE_SECONDS}, {MAX_LEASE_SECONDS}]. "
                f"Received: {lease_seconds}",
            )
        session = Session(secrets.token_hex(16), client_name[:200], float(lease_seconds))
        session.connection_lease = self.connections is not None and peer.startswith(
            _CONNECTION_PEERS)
        with self._lock:
            self._sessions[session.session_id] = session
        if session.connection_lease:
            self.bind(session, peer)
        logger.info("opened session %s for %r (lease %.1f s%s)", session.short_id,
                    session.client_name, session.lease_seconds,
                    f", kept while {peer} is connected" if session.connection_lease else "")
        return session

    def bind(self, session: Session, peer: str) -> None:
        """Ties a connection-leased session to the connection of ``peer`` as well (a
        Heartbeat's: the client reconnected); nothing for other sessions and peers. Cheap
        when already bound: on the path of every Heartbeat."""
        if not session.connection_lease or peer in session.connections \
                or not peer.startswith(_CONNECTION_PEERS):
            return
        with self._lock:
            if len(session.connections) >= MAX_SESSION_CONNECTIONS:
                session.connections.pop(next(iter(session.connections)))  # the oldest
            session.connections[peer] = 0
            self._unresolved = True

    def get(self, session_id: str) -> Session:
        """The open session ``session_id``; renews its lease.

        Raises:
            ServiceError: NOT_FOUND naming the id.
        """
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed:
            shown = session_id if len(session_id) <= 80 else session_id[:80] + "..."
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"No open session {shown!r} on this server (never opened, closed, its "
                f"lease expired, or the server restarted).",
                kind="unknown-session",
            )
        session.touch()
        return session

    def close(self, session_id: str) -> None:
        """Closes a session: stops its run in progress at its next step, then detaches its
        IPUs, drops its variables and executables."""
        session = self.get(session_id)
        session.stop_runs("session-closed")
        with session.enter(self.max_waiting_calls):
            self._close_locked(session, "closed")

    def stop_runs(self, reason: str) -> int:
        """Asks every session's runs in progress to stop; returns how many there were."""
        with self._lock:
            sessions = list(self._sessions.values())
        return sum(s.stop_runs(reason) for s in sessions)

    def count(self) -> int:
        """How many sessions are open."""
        with self._lock:
            return len(self._sessions)

    def detach(self, session: Session) -> None:
        """Releases a session's IPUs and drops its executable handles (they were compiled for
        the architecture the session had). The session's lock must be held."""
        if session.ipu_ids:
            self.pool.release(session.ipu_ids)
            logger.info("session %s detached IPUs %s", session.short_id, session.ipu_ids)
        session.ipu_ids = []
        session.target = None
        session.ipu_version = ""
        session.tiles_per_ipu = 0
        session.executables.clear()
        session.handle_by_key.clear()

    def _close_locked(self, session: Session, reason: str) -> None:
        if session.closed:
            return
        self.detach(session)
        session.variables.clear()
        session.replica_variables.clear()
        if session.data is not None:
            session.data.close()
        session.closed = True
        with self._lock:
            self._sessions.pop(session.session_id, None)
        logger.info("session %s %s", session.short_id, reason)
        if self._on_close is not None:
            self._on_close(session, reason)

    # -- leases -------------------------------------------------------------------------

    def reap_once(self) -> list[str]:
        """Closes sessions whose lease expired and that are not inside a call; renews the
        lease of a connection-leased session instead while one of its connections is open.

        Returns:
            The ids of the sessions closed.
        """
        now = time.monotonic()
        with self._lock:
            candidates = [s for s in self._sessions.values() if s.expired(now)]
            look = self.connections is not None and (
                self._unresolved or any(s.connections for s in candidates))
        if look:
            candidates = self._renew_connected(candidates)
        reaped = []
        for s in candidates:
            if not s.try_enter():
                continue  # inside a call: alive
            try:
                if s.expired(time.monotonic()) and not s.closed:
                    logger.warning(
                        "session %s (%s) missed its %.1f s lease; closing it and freeing IPUs %s",
                        s.short_id, s.client_name, s.lease_seconds, s.ipu_ids,
                    )
                    self._close_locked(s, "expired")
                    reaped.append(s.session_id)
            finally:
                s.leave()
        return reaped

    def _renew_connected(self, candidates: list[Session]) -> list[Session]:
        """Looks up the connections sessions are bound to (one channelz read): resolves new
        bindings, forgets closed connections, renews the lease of each of ``candidates``
        that still has one open. Returns the candidates left to reap."""
        assert self.connections is not None
        live = self.connections.snapshot()
        if live is None:
            return candidates  # channelz unreadable: time leases only
        open_ids = set(live.values())
        with self._lock:
            self._unresolved = False
            for session in self._sessions.values():
                for peer, conn in list(session.connections.items()):
                    if conn == 0:  # bound since the last look: which connection is it?
                        found = live.get(peer, -1)
                        if found > 0:
                            session.connections[peer] = found
                        else:  # closed already, or ambiguous: the time lease decides
                            del session.connections[peer]
                    elif conn not in open_ids:
                        del session.connections[peer]
                        logger.info("session %s: its client's connection %s closed; the "
                                    "lease (%.1f s) runs from its last sign of life",
                                    session.short_id, peer, session.lease_seconds)
            kept = [s for s in candidates if s.connections]
        for s in kept:
            s.touch()
        return [s for s in candidates if not s.connections]

    def _reap_loop(self) -> None:
        while not self._stop.wait(self._reaper_period):
            try:
                self.reap_once()
            except Exception:  # never let the reaper die
                logger.exception("lease reaper failed")
