"""A ``DeviceClient``'s session: opening it, its IPUs, its lease and heartbeat, closing it.

    open_session ──OpenSession (connection lease)──> server
        │  heartbeat thread: Heartbeat three times per lease, on the session's own connection
        │  data path set up (shared memory or streaming: tf_ipu.transport), maybe a move to
        │  the server's Unix socket
    attach / detach ──AttachIpus / DetachIpus──> the session's IPUs
    close (CloseSession, best effort) | abandon (nothing sent): the channel closed

``Sessions`` is one part of ``DeviceClient`` (``tf_ipu.client``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from device_server.protocol import device_pb2
from tf_ipu import errors
from tf_ipu.client_types import Attachment, SessionInfo

logger = logging.getLogger("tf_ipu.client")


@dataclass
class _Heartbeat:
    thread: threading.Thread
    stop: threading.Event = field(default_factory=threading.Event)


class Sessions:
    """Session, IPUs, lease and heartbeat of a DeviceClient (module docstring)."""

    @property
    def session_id(self) -> str:
        """The open session's id (raises ``FailedPreconditionError`` if none)."""
        if self._session is None:
            raise errors.FailedPreconditionError(
                "No session is open on this client; call open_session() first.", self.address
            )
        return self._session.session_id

    @property
    def session(self) -> SessionInfo | None:
        """What OpenSession returned, or None."""
        return self._session

    @property
    def attachment(self) -> Attachment | None:
        """What AttachIpus returned, or None."""
        return self._attachment

    def open_session(self, lease_seconds: float = 0.0) -> SessionInfo:
        """Opens this client's session and starts its heartbeat.

        The session asks for a connection lease: the server keeps it while this client's
        connection is up, also when no call or heartbeat comes for longer than the lease
        (TensorFlow holding the GIL for a long trace, a large transfer in flight); a client
        that is gone loses it within the lease. ``session.connection_lease`` says whether the
        server agreed (not behind a proxy, for example); if not, the heartbeat alone keeps it.

        Args:
            lease_seconds: the lease; 0 for the server's default. The heartbeat renews it
                three times per lease.

        Returns:
            A ``SessionInfo``.

        Raises:
            FailedPreconditionError: a session is already open on this client.
        """
        with self._lock:
            if self._session is not None:
                raise errors.FailedPreconditionError(
                    f"Session {self._session.session_id} is already open on this client.",
                    self.address,
                )
            reply = self._call(
                "OpenSession",
                device_pb2.OpenSessionRequest(client_name=self.client_name,
                                              lease_seconds=lease_seconds, connection_lease=True),
            )
            self._session = SessionInfo(
                session_id=reply.session_id,
                server_version=reply.server_version,
                default_ipu_version=reply.default_ipu_version,
                num_ipus=reply.num_ipus,
                free_ipus=reply.free_ipus,
                max_message_bytes=reply.max_message_bytes,
                lease_seconds=reply.lease_seconds,
                max_session_bytes=reply.max_session_bytes,
                unix_socket=reply.unix_socket,
                system=reply.system,
                connection_lease=reply.connection_lease,
            )
            self._lease_stub = self._stub  # stays on this connection after a move
            self._start_heartbeat(reply.session_id, reply.lease_seconds)
            logger.debug("opened session %s on %s", reply.session_id, self.address)
        try:
            self.data.setup()
        except BaseException:
            self.close()
            raise
        if self.data.kind == "shm" and self._session.unix_socket and not self._tls:
            self._move_to_unix_socket(self._session.unix_socket)
        logger.debug("data path to %s: %s", self.address, self.data.describe())
        return self._session

    def attach(
        self,
        num_ipus: int = 1,
        ipu_version: str = "",
        tiles_per_ipu: int = 0,
        wait_seconds: float = 0.0,
        ipu_ids: Sequence[int] = (),
    ) -> Attachment:
        """Attaches IPUs to the session, exclusively.

        Args:
            num_ipus: how many (ignored when ``ipu_ids`` is given).
            ipu_version: ``"ipu1"``, ``"ipu2"``, ``"bow"``; ``""`` for the server's default.
            tiles_per_ipu: 0 for the version's full tile count.
            wait_seconds: how long the server may wait for enough IPUs to become free.
            ipu_ids: exactly these IPUs of the server (``IPUConfig.select_ipus``).

        Returns:
            An ``Attachment`` (ids, canonical version, tiles per IPU).

        Raises:
            ResourceExhaustedError: fewer free IPUs than asked, also after ``wait_seconds``
                (the message says how many were requested and free).
        """
        reply = self._call(
            "AttachIpus",
            device_pb2.AttachIpusRequest(
                session_id=self.session_id, num_ipus=0 if ipu_ids else num_ipus,
                ipu_version=ipu_version, tiles_per_ipu=tiles_per_ipu,
                wait_seconds=wait_seconds, ipu_ids=list(ipu_ids),
            ),
            self.timeout + max(0.0, wait_seconds),
        )
        self._attachment = Attachment(list(reply.ipu_ids), reply.ipu_version, reply.tiles_per_ipu)
        return self._attachment

    def detach(self) -> None:
        """Releases the session's IPUs (its executable handles go with them)."""
        self._call("DetachIpus", device_pb2.SessionRef(session_id=self.session_id))
        self._attachment = None

    def close(self) -> None:
        """Closes the session (best effort if the server is gone) and the channel.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._stop_heartbeat()
            self._drop_stream()  # its handler on the server returns
            if self._session is not None:
                try:
                    self._stub.CloseSession(
                        device_pb2.SessionRef(session_id=self._session.session_id),
                        timeout=min(self.timeout, 5.0), metadata=self._metadata,
                    )
                except grpc.RpcError as e:
                    logger.debug("CloseSession on %s: %s", self.address, e.code().name)
            self._shut()

    def abandon(self) -> None:
        """Drops the connection without telling the server (for a server that is gone or
        that forgot the session): stops the heartbeat, closes the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._heartbeat is not None:
                self._heartbeat.stop.set()  # not joined: it may be inside a call
                self._heartbeat = None
            self._drop_stream(cancel=True)
            self._shut()

    def _shut(self) -> None:
        """Forgets the session and its IPUs, closes the channels and the data path (with
        ``_lock`` held, the heartbeat and the stream stopped)."""
        self._session = None
        self._attachment = None
        self._closed = True
        self._channel.close()
        if self._tcp_channel is not None:
            self._tcp_channel.close()
        self.data.close()

    def _start_heartbeat(self, session_id: str, lease_seconds: float) -> None:
        """Renews the lease three times per lease from a thread, over the connection the
        session was opened on (with a connection lease, a heartbeat after a reconnect ties
        the session to the new connection). A thread that cannot get the GIL misses its
        beats; the connection lease covers that."""
        interval = max(0.05, lease_seconds / 3.0)
        stop = threading.Event()
        stub = self._lease_stub

        def beat() -> None:
            request = device_pb2.SessionRef(session_id=session_id)
            failing = False  # a run of failures is logged once, as a warning
            while not stop.wait(interval):
                try:
                    stub.Heartbeat(request, timeout=max(interval, 1.0), metadata=self._metadata)
                    self.heartbeats += 1
                    failing = False
                except grpc.RpcError as e:
                    self.heartbeat_failures += 1
                    logger.log(logging.DEBUG if failing else logging.WARNING,
                               "heartbeat of session %s to %s failed: %s %s", session_id,
                               self.address, e.code().name, e.details())
                    failing = True
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        return  # the session is gone; nothing left to keep alive
                except ValueError:  # channel closed under us
                    return

        thread = threading.Thread(target=beat, name=f"tf-ipu-heartbeat-{session_id[:8]}", daemon=True)
        self._heartbeat = _Heartbeat(thread, stop)
        thread.start()

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop.set()
            if self._heartbeat.thread is not threading.current_thread():
                self._heartbeat.thread.join(timeout=self.timeout)
            self._heartbeat = None
