"""The client side's connections to peers: a bounded LRU of per-peer DEALER pools.

Why bounded: a target hinted towards hundreds of sources would otherwise keep a socket (and a
TCP connection, a monitor, file descriptors) open to each of them for ever. Here at most
``max_peers`` peers keep sockets; the least recently used peer is closed when a new one comes,
and a peer unused for ``idle_close_s`` is closed at the next sweep (run by every checkout and
send, and by the server thread when the channel serves).

Per peer:

- one request socket (DEALER with ``IMMEDIATE``: it takes a message only once a connection is
  up), with a socket monitor so a refused, failed or dropped connection is seen within
  milliseconds. It is used by one thread at a time (checked out, checked in); another thread that
  asks the same peer waits for it (within its own deadline) instead of opening a second
  connection, because a peer's server binds sessions to the connection that opened them
  (docs/security.md): a second connection would find its session refused.
- one-way messages go over that request socket: at once when it is idle, at its check-in when
  another thread holds it (at most ``_ONEWAY_HWM`` wait), and dropped when it failed (what they
  referred to was bound to the connection that is gone). Only when no request socket was ever
  opened to the peer is a one-way socket (DEALER without ``IMMEDIATE``, so a message queues while
  the connection is being made, up to a small high-water mark) opened for them.
- the index of the keyring entry whose keys last completed a handshake with it (token rotation).

With per-node identities a peer is dialled only if the directory lists it, expecting the key listed
for it; a connection opened expecting another key (the directory changed since) is closed at its
next checkout and the peer dialled afresh, or not at all once it is no longer listed.

A connection checked out while its peer is evicted or forgotten is closed at check-in.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcr.adapters.zmq.curve import Credentials
from kvcr.ports.errors import ControlTimeout, PeerUnavailable, TransportError

if TYPE_CHECKING:
    import zmq

MAX_IDLE_PER_PEER = 1  # one connection per peer: sessions are bound to it
_ONEWAY_HWM = 256  # one-way messages queued per peer while its connection is not up
_ONEWAY_MAX_INBOUND = 1024  # nothing ever answers a one-way socket: a peer that does is dropped
_REQUEST_RCVHWM = 8  # replies queued per request socket: one is expected, the rest are stale
_MONITOR_EVENT = struct.Struct("=HI")  # libzmq's monitor frame: uint16 event, uint32 value
_MONITOR_IDS = itertools.count()


class Conn:
    """One request DEALER to one peer and its monitor; used by one thread at a time."""

    __slots__ = (
        "address",
        "connected",
        "failure",
        "handshake_failed",
        "key_index",
        "link",
        "monitor",
        "recv_poller",
        "send_poller",
        "server_key",
        "sock",
    )

    def __init__(
        self,
        link: _Link,
        key_index: int,
        server_key: bytes | None,
        sock: zmq.Socket[bytes],
        monitor: zmq.Socket[bytes],
        lib: Any,
    ):
        self.address = link.address
        self.link = link
        self.key_index = key_index
        self.server_key = server_key  # the key the peer had to prove when this was dialled
        self.sock = sock
        self.monitor = monitor
        self.connected = False
        self.failure: str | None = None
        self.handshake_failed = False
        self.send_poller = lib.Poller()
        self.send_poller.register(sock, lib.POLLOUT)
        self.send_poller.register(monitor, lib.POLLIN)
        self.recv_poller = lib.Poller()
        self.recv_poller.register(sock, lib.POLLIN)
        self.recv_poller.register(monitor, lib.POLLIN)


class _Link:
    """Everything kept open to one peer."""

    __slots__ = ("address", "busy", "idle", "ipv6", "key_index", "last_used", "oneway", "pending")

    def __init__(self, address: str, ipv6: bool, now: float) -> None:
        self.address = address
        self.ipv6 = ipv6
        self.idle: list[Conn] = []  # the request connection while nobody holds it (at most one)
        self.busy = False  # a thread holds the request connection (or is opening it)
        self.pending: list[list[bytes]] = []  # one-way messages for it while it is held
        self.oneway: zmq.Socket[bytes] | None = None
        self.key_index = 0
        self.last_used = now


class PeerLinks:
    """Thread-safe pool of connections to peers, bounded in peers and in idle time."""

    def __init__(
        self,
        context: zmq.Context[Any],
        lib: Any,
        *,
        keyring: Credentials | None,
        max_message_bytes: int,
        max_peers: int,
        idle_close_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._context = context
        self._zmq = lib
        self._keyring = keyring
        self._max_message_bytes = max_message_bytes
        self._max_peers = max_peers
        self._idle_close_s = idle_close_s
        self._sweep_every_s = min(1.0, idle_close_s / 4)
        self._clock = clock
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)  # a link's request connection was checked in
        self._links: OrderedDict[str, _Link] = OrderedDict()  # least recently used first
        self._closed = False
        self._last_sweep = clock()
        self._failures = lib.EVENT_HANDSHAKE_FAILED_NO_DETAIL | lib.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._failures |= lib.EVENT_HANDSHAKE_FAILED_AUTH

    @property
    def key_count(self) -> int:
        """How many keyrings a dial may try (1 without CURVE)."""
        return len(self._keyring) if self._keyring is not None else 1

    def open_peers(self) -> int:
        """How many peers currently have sockets kept open (idle or one-way)."""
        with self._lock:
            return sum(1 for link in self._links.values() if link.idle or link.oneway is not None)

    # ------------------------------------------------------------------ request sockets

    def checkout(self, address: str, *, ipv6: bool, deadline: float) -> Conn:
        """The connection to ``address`` (waiting until ``deadline``, time.monotonic, while another
        thread holds it), or a new one (not yet connected) when there is none or it failed.

        Raises:
            TransportError: the pool is closed, or libzmq could not open a socket.
            ControlTimeout: another thread held the connection until ``deadline``.
        """
        with self._lock:
            while True:
                if self._closed:
                    raise TransportError("control channel is closed")
                link = self._touch(address, ipv6)  # again after each wait: it may have been evicted
                if not link.busy:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ControlTimeout(f"the control connection to {address} stayed busy until the deadline")
                self._free.wait(min(remaining, 0.05))
            link.busy = True
            conn = link.idle.pop() if link.idle else None
            key_index = link.key_index
        try:
            if conn is not None:
                self.read_events(conn)
                if conn.failure is None and self._still_trusted(conn):
                    return conn
                self._close_conn(conn)  # the peer went away (or restarted, or was re-keyed) since: dial afresh
            return self._open(link, key_index)
        except BaseException:
            self._release_link(link, None)
            raise

    def redial(self, conn: Conn) -> Conn | None:
        """Close ``conn``, whose handshake failed, and dial with the next token's keys (None: none left,
        and the checkout is over)."""
        self._close_conn(conn)
        if conn.key_index + 1 >= self.key_count:
            self._release_link(conn.link, None)
            return None
        try:
            return self._open(conn.link, conn.key_index + 1)
        except BaseException:
            self._release_link(conn.link, None)
            raise

    def checkin(self, conn: Conn, reusable: bool) -> None:
        """Return ``conn`` to its peer's pool, or close it (not reusable, pool full, peer evicted)."""
        self._release_link(conn.link, conn if reusable else None, closing=conn)

    def _release_link(self, link: _Link, keep: Conn | None, closing: Conn | None = None) -> None:
        """End a checkout of ``link``: keep ``keep`` as its connection (sending what waited for it)."""
        lib = self._zmq
        with self._lock:
            current = self._links.get(link.address) is link and not self._closed
            pending, link.pending = link.pending, []
            link.busy = False
            if keep is not None and current and len(link.idle) < MAX_IDLE_PER_PEER:
                link.idle.append(keep)
                link.key_index = keep.key_index  # these keys completed a handshake: dial with them next
                link.last_used = self._clock()
                for frames in pending:
                    try:
                        keep.sock.send_multipart(frames, lib.NOBLOCK)
                    except lib.Again:
                        break
                closing = None
            self._free.notify_all()
        if closing is not None:
            # After a timeout this drops whatever the peer still queues for us (a stale reply).
            self._close_conn(closing)

    def _still_trusted(self, conn: Conn) -> bool:
        """Whether the directory still lists, for the peer, the key ``conn`` was dialled expecting."""
        return self._keyring is None or self._keyring.server_key(conn.address) == conn.server_key

    def _server_key(self, address: str) -> bytes | None:
        if self._keyring is None:
            return None
        key = self._keyring.server_key(address)
        if key is None:
            raise PeerUnavailable(f"control peer {address} is not in the peer directory: not dialled")
        return key

    def _open(self, link: _Link, key_index: int) -> Conn:
        lib = self._zmq
        server_key = self._server_key(link.address)
        sock: zmq.Socket[bytes] | None = None
        monitor: zmq.Socket[bytes] | None = None
        try:
            sock = self._new_dealer(link, key_index)
            sock.setsockopt(lib.IMMEDIATE, 1)  # never queue a request to a connection that is not up
            sock.setsockopt(lib.MAXMSGSIZE, self._max_message_bytes)
            sock.setsockopt(lib.RCVHWM, _REQUEST_RCVHWM)
            # Unique per socket: an inproc name is released asynchronously after its socket closes.
            monitor_address = f"inproc://kvcr-control-monitor-{id(self):x}-{next(_MONITOR_IDS)}"
            events = lib.EVENT_HANDSHAKE_SUCCEEDED | lib.EVENT_CONNECT_RETRIED | lib.EVENT_DISCONNECTED
            sock.monitor(monitor_address, events | self._failures)
            monitor = self._context.socket(lib.PAIR)
            monitor.setsockopt(lib.LINGER, 0)
            monitor.connect(monitor_address)  # before dialling, so no event is missed
            sock.connect(link.address)
            return Conn(link, key_index, server_key, sock, monitor, lib)
        except BaseException as exc:
            if monitor is not None:
                monitor.close(linger=0)
            if sock is not None:
                sock.close(linger=0)
            if isinstance(exc, lib.ZMQError):
                raise TransportError(f"cannot open a control connection to {link.address}: {exc}") from exc
            raise

    def _new_dealer(self, link: _Link, key_index: int) -> zmq.Socket[bytes]:
        lib = self._zmq
        sock: zmq.Socket[bytes] = self._context.socket(lib.DEALER)
        try:
            sock.setsockopt(lib.LINGER, 0)
            if link.ipv6:
                sock.setsockopt(lib.IPV6, 1)
            if self._keyring is not None:
                self._keyring.configure_client(sock, key_index, link.address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def read_events(self, conn: Conn) -> None:
        """Fold the monitor's pending events into ``conn.connected`` / ``conn.failure``."""
        lib = self._zmq
        # Reading EVENTS first avoids raising (and catching) Again on every request: it is the hot path.
        while conn.monitor.getsockopt(lib.EVENTS) & lib.POLLIN:
            frames = conn.monitor.recv_multipart(lib.NOBLOCK)
            if not frames or len(frames[0]) < _MONITOR_EVENT.size:
                continue
            event, _ = _MONITOR_EVENT.unpack_from(frames[0])
            if conn.failure is not None:
                continue
            if event & lib.EVENT_HANDSHAKE_SUCCEEDED:
                conn.connected = True
            elif event & self._failures:
                conn.handshake_failed = not conn.connected
                if not conn.handshake_failed:
                    conn.failure = "a frame failed authentication, the connection is closed"
                elif self._keyring is not None:
                    conn.failure = "handshake failed (no shared cluster token, or not the same security)"
                else:  # no security here: nothing about tokens can be the cause
                    conn.failure = "handshake failed (the peer closed its greeting: restarting, or not a kvcr port)"
            elif event & lib.EVENT_CONNECT_RETRIED:
                conn.failure = "connection refused" if not conn.connected else "connection lost"
            elif event & lib.EVENT_DISCONNECTED:
                conn.failure = "connection lost" if conn.connected else "connection dropped during the handshake"
                conn.handshake_failed = not conn.connected

    # ------------------------------------------------------------------ one-way

    def send(self, address: str, frames: list[bytes], *, ipv6: bool) -> bool:
        """Queue a one-way message without blocking; False when it was dropped."""
        lib = self._zmq
        with self._lock:
            if self._closed:
                return False
            link = self._touch(address, ipv6)
            if link.busy:  # another thread holds the connection: it sends this at check-in
                if len(link.pending) >= _ONEWAY_HWM:
                    return False
                link.pending.append(frames)
                return True
            for conn in reversed(link.idle):  # idle, so ours while we hold the lock
                self.read_events(conn)
                if conn.connected and conn.failure is None and self._still_trusted(conn):
                    try:
                        conn.sock.send_multipart(frames, lib.NOBLOCK)
                        return True
                    except lib.Again:
                        return False
                return False  # it failed: what this message refers to was bound to it
            if link.oneway is None:
                sock = self._new_dealer(link, link.key_index)
                try:
                    sock.setsockopt(lib.SNDHWM, _ONEWAY_HWM)
                    sock.setsockopt(lib.RCVHWM, 1)
                    sock.setsockopt(lib.MAXMSGSIZE, _ONEWAY_MAX_INBOUND)
                    sock.connect(address)
                except BaseException:
                    sock.close(linger=0)
                    raise
                link.oneway = sock
            try:
                link.oneway.send_multipart(frames, lib.NOBLOCK)
                return True
            except lib.Again:
                return False

    # ------------------------------------------------------------------ bounds

    def _touch(self, address: str, ipv6: bool) -> _Link:
        """The link to ``address`` as the most recently used (created, evicting the oldest); lock held."""
        now = self._clock()
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = _Link(address, ipv6, now)
            while len(self._links) > self._max_peers:
                _, oldest = self._links.popitem(last=False)
                self._close_link(oldest)
        else:
            self._links.move_to_end(address)
        link.last_used = now
        if now - self._last_sweep >= self._sweep_every_s:
            self._sweep_locked(now)
        return link

    def sweep(self) -> None:
        """Close every peer unused for ``idle_close_s`` (cheap when nothing is due)."""
        now = self._clock()
        with self._lock:
            if not self._closed and now - self._last_sweep >= self._sweep_every_s:
                self._sweep_locked(now)

    def _sweep_locked(self, now: float) -> None:
        self._last_sweep = now
        while self._links:
            link = next(iter(self._links.values()))
            if now - link.last_used < self._idle_close_s:
                break  # the rest were used more recently
            del self._links[link.address]
            self._close_link(link)

    def forget(self, address: str) -> None:
        """Close everything kept open to ``address``; connections in use close at check-in."""
        with self._lock:
            link = self._links.pop(address, None)
            if link is not None:
                self._close_link(link)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for link in self._links.values():
                self._close_link(link)
            self._links.clear()

    def _close_link(self, link: _Link) -> None:
        """Close a link's idle and one-way sockets (lock held; nobody else uses them)."""
        for conn in link.idle:
            self._close_conn(conn)
        link.idle.clear()
        if link.oneway is not None:
            link.oneway.close(linger=0)
            link.oneway = None

    def _close_conn(self, conn: Conn) -> None:
        with contextlib.suppress(self._zmq.ZMQError):
            conn.sock.disable_monitor()
        conn.monitor.close(linger=0)
        conn.sock.close(linger=0)
