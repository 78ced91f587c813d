"""The source side of memory sharing: an abstract UNIX socket that hands exposed regions' memfds out.

A peer that connects must run as our uid (``SO_PEERCRED``, checked as it is accepted: another
uid's connection is closed at once and never held) and send, within ``handshake_s``, the ticket
from our description (which only authenticated peers receive, each its own: ``wire.make_ticket``)
of an owner we still admit; it then gets the grant and the descriptors with it (SCM_RIGHTS), and
keeps the connection open: our end closing (at ``close``, or because this process died) is how the
peer learns that we are gone. Anything else is closed without a byte back.

Capacity: connections still handshaking (unauthenticated) and granted ones are capped apart,
so connections without the secret never take a granted link's place: past ``max_pending`` the
oldest handshake is dropped (a target sends its request as it connects, and the request is read
as the connection is accepted, so it is rarely pending at all), and past ``max_connections``
granted links (or ``max_per_node`` of one named owner, or ``max_per_process`` of one process: with
a cluster token no node is named) a new grant is refused. A reply that would block (a peer that
does not read its replies) drops that link at once: no peer can stall the broker's one thread.

Owners: each granted link is bound to its ticket's owner, and frames over it reach the handler
as that node's (``with_node``). ``admit`` installs the control channel's view of who is still
admitted: a frame from an owner it refuses drops its link, and while links of named owners are
open the broker looks at all of them every ``SIDE_RECHECK_S``, so a revoked node's links close
even when they are silent.

Once granted, the connection is also a *side link*: each frame the peer sends is answered by
``serve``'s handler, with this connection's own id (random, never reused) as the connection the
frame came over. One thread serves every connection from a
selector, blocked when nothing happens (no idle cost).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvcr.adapters.shm.wire import MAX_TICKET_BYTES, REQUEST_MAGIC, ticket_owner
from kvcr.ports.control import ConnectionHandler, with_node
from kvcr.ports.dataplane import SIDE_FRAME_BYTES, SIDE_RECHECK_S

log = logging.getLogger(__name__)

GrantSource = Callable[[], tuple[bytes, list[int]]]
"""Returns the grant to send now (encoded) and the descriptors that go with it."""

_REQUEST_BYTES = len(REQUEST_MAGIC) + MAX_TICKET_BYTES  # at most


class Broker:
    """Serves grants on an abstract socket named ``address`` until ``close``. Thread-safe."""

    def __init__(
        self,
        secret: bytes,
        grant: GrantSource,
        *,
        max_connections: int = 256,
        max_pending: int = 32,
        max_per_node: int = 16,
        max_per_process: int = 16,
        handshake_s: float = 1.0,
    ) -> None:
        self._secret = secret
        self._grant = grant
        self._max = max_connections
        self._max_pending = max_pending
        self._max_per_node = max_per_node
        self._max_per_process = max_per_process
        self._admitted: Callable[[bytes], bool] = lambda node: True
        self._next_recheck = 0.0
        self._handshake_s = handshake_s
        self.address = f"\0kvcr-shm-{os.getpid()}-{os.urandom(8).hex()}"
        self.refused = 0  # connections closed without a grant (bad secret, uid, timeout, over a cap)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(self.address)
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._pending: dict[socket.socket, float] = {}  # connection -> handshake deadline
        self._granted: dict[socket.socket, tuple[bytes, bytes]] = {}  # connection -> (owner, its id for the handler)
        self._pids: dict[socket.socket, int] = {}  # granted connection -> the process at its other end
        self._handler: ConnectionHandler | None = None
        self.side_frames = 0  # frames answered over side links
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvcr-shm-broker", daemon=True)
        self._thread.start()

    def serve(self, handler: ConnectionHandler) -> None:
        """Answer frames over granted connections with ``handler`` (else such a frame drops its connection)."""
        self._handler = handler

    def admit(self, admitted: Callable[[bytes], bool]) -> None:
        """Serve a named owner's links only while ``admitted(owner)`` (see the module docstring)."""
        self._admitted = admitted
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"r")  # look at the links already open now

    @property
    def connections(self) -> int:
        """Connections held now (granted and pending)."""
        return len(self._pending) + len(self._granted)

    @property
    def granted(self) -> int:
        """Granted connections (side links) held now."""
        return len(self._granted)

    def close(self) -> None:
        """Stop serving and close every connection (each peer sees us gone). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5.0)
        for conn in [*self._pending, *self._granted]:
            conn.close()
        self._pending.clear()
        self._granted.clear()
        self._selector.close()
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _serve(self) -> None:
        while not self._closed.is_set():
            wakes = list(self._pending.values())
            if any(owner for owner, _ in self._granted.values()):
                wakes.append(self._next_recheck)
            timeout = max(0.0, min(wakes) - time.monotonic()) if wakes else None
            for key, _ in self._selector.select(timeout):
                if self._closed.is_set():
                    return
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 64)
                    self._next_recheck = 0.0
                else:
                    assert isinstance(key.fileobj, socket.socket)
                    self._readable(key.fileobj)
            now = time.monotonic()
            for conn in [c for c, deadline in self._pending.items() if deadline <= now]:
                self._drop(conn, refused=True)
            if now >= self._next_recheck:
                self._next_recheck = now + SIDE_RECHECK_S
                self._drop_revoked()

    def _drop_revoked(self) -> None:
        """Close every link whose named owner is no longer admitted."""
        verdicts: dict[bytes, bool] = {}
        for conn, (owner, _) in list(self._granted.items()):
            if owner and not verdicts.setdefault(owner, self._still_admitted(owner)):
                self._drop(conn, refused=True)

    def _still_admitted(self, owner: bytes) -> bool:
        try:
            return bool(self._admitted(owner))
        except Exception:  # the channel's check failed: fail closed, never kill the broker thread
            log.exception("kvcr: shm broker could not check whether a node is still admitted")
            return False

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("kvcr: shm broker accept failed: %s", exc)
                return
            if _peer_uid(conn) != os.getuid():  # can never be granted: not even held
                self.refused += 1
                conn.close()
                continue
            conn.setblocking(False)
            while len(self._pending) >= self._max_pending:  # make room: the oldest handshake goes
                oldest = min(self._pending, key=self._pending.__getitem__)
                self._readable(oldest)  # unless its request came since it was accepted
                if oldest in self._pending:
                    self._drop(oldest, refused=True)
            self._pending[conn] = time.monotonic() + self._handshake_s
            self._selector.register(conn, selectors.EVENT_READ)
            self._readable(conn)  # a target sends its request as it connects: usually here already

    def _readable(self, conn: socket.socket) -> None:
        if conn in self._granted:
            self._side_frame(conn)
            return
        try:
            data = conn.recv(_REQUEST_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        owner = self._authorised(data)
        pid = _peer_pid(conn)
        if owner is None or not self._room_for(owner, pid):
            self._drop(conn, refused=True)
            return
        try:
            blob, fds = self._grant()
            socket.send_fds(conn, [blob], fds)
        except OSError as exc:
            log.warning("kvcr: shm grant could not be sent: %s", exc)
            self._drop(conn, refused=True)
            return
        del self._pending[conn]
        self._granted[conn] = (owner, with_node(owner, b"shm-side:" + os.urandom(16)))
        self._pids[conn] = pid

    def _room_for(self, owner: bytes, pid: int) -> bool:
        """Whether one more link fits: in all, for its node (if named), and for its process."""
        if len(self._granted) >= self._max:
            return False
        if sum(p == pid for p in self._pids.values()) >= self._max_per_process:
            return False  # one process, whatever tickets it holds (a cluster token names no node)
        return not owner or sum(o == owner for o, _ in self._granted.values()) < self._max_per_node

    def _side_frame(self, conn: socket.socket) -> None:
        """One frame over a side link, answered by the handler; EOF, a cut frame or no handler drop the link."""
        try:
            data, _, flags, _ = conn.recvmsg(SIDE_FRAME_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, flags = b"", 0
        handler = self._handler
        if not data or flags & socket.MSG_TRUNC or len(data) > SIDE_FRAME_BYTES or handler is None:
            self._drop(conn, refused=False)  # the peer left (or broke the framing)
            return
        owner, link = self._granted[conn]
        if owner and not self._still_admitted(owner):
            self._drop(conn, refused=True)  # revoked since the last look: not one more frame
            return
        reply = handler(data, link)
        self.side_frames += 1
        if reply is None:
            return
        try:
            conn.send(reply, socket.MSG_DONTWAIT)  # one record: sent whole or not at all
        except OSError:  # closed, or a full buffer: a peer that does not read its replies loses its link
            self._drop(conn, refused=False)

    def _authorised(self, data: bytes) -> bytes | None:
        """The owner of the request's ticket, if it is ours and its owner is admitted; else None."""
        if len(data) > _REQUEST_BYTES or not data.startswith(REQUEST_MAGIC):
            return None
        owner = ticket_owner(self._secret, data[len(REQUEST_MAGIC) :])
        if owner is None or (owner and not self._still_admitted(owner)):
            return None
        return owner

    def _drop(self, conn: socket.socket, *, refused: bool) -> None:
        if refused:
            self.refused += 1
        self._pending.pop(conn, None)
        self._granted.pop(conn, None)
        self._pids.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()


def _credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel recorded them at connect ((-1, -1): unknown)."""
    try:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return -1, -1
    return int(pid), int(uid)


def _peer_uid(conn: socket.socket) -> int:
    return _credentials(conn)[1]


def _peer_pid(conn: socket.socket) -> int:
    return _credentials(conn)[0]
