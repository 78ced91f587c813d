"""The serving side of the control channel: one ROUTER, its ZAP handler and its monitor, one thread.

Why one thread: the handler (the peer protocol's server) is not thread-safe and is fast; ZAP
requests (one per new authenticated connection) and monitor events are answered between two
batches of requests, so a handshake waits at most for the request being handled.

Wire format (one ZMQ multipart message each way)::

    request   DEALER -> ROUTER   [request id (8 bytes, big-endian, never 0), payload]
    one-way   DEALER -> ROUTER   [0 (8 bytes), payload]      the handler runs, nothing is sent back
    reply     ROUTER -> DEALER   [request id, status (1 byte), body]
                                 status 0: body is the handler's reply
                                 status 1: the handler failed (or gave no reply); body says why

Refusals are counted by a closed set of reasons (:data:`REFUSAL_REASONS`), never by peer text:

- ``credentials``: the ZAP check refused the client's key (it holds no cluster token, or another);
- ``protocol``: the handshake failed on mechanism or cryptography (a plaintext client, a wrong
  server key, replayed or tampered bytes);
- ``handshake``: any other handshake failure (bytes that are not ZMTP at all);
- ``frame``: a connected peer sent a request that is not ``[id, payload]``; it is dropped.
- ``revoked``: (per-node identities) a request over a connection whose node key the peer directory
  no longer lists; it is refused (a request learns so, a one-way message is dropped).
- ``crowded``: a connection accepted while its host already holds ``max_connections_per_host``
  connections to this port; it is shut down at once, before its handshake.

Connections per host: libzmq accepts every TCP connection and keeps it until its handshake ends or
``ZMQ_HANDSHAKE_IVL`` passes, with no cap, and its monitor does not say which connection finished
a handshake. So the server counts connections per peer host from the monitor's ACCEPTED and
DISCONNECTED/CLOSED events (both carry the descriptor) and shuts down (never closes: the
descriptor stays libzmq's) a new one over the cap: a flood from one host holds at most the cap,
whatever its rate, and other hosts' connections are not touched.

The connection a request came over is named, for the handler, by the ROUTER's routing identity of
that connection and, with CURVE, the ZAP user id this server gave its handshake (a serial number
of this server's and the client's public key): libzmq attaches it to every message of the
connection, and a peer cannot choose it, so a peer that copies another's routing identity (after
that connection closed) still names another connection. With per-node identities the connection
also names its node (its public key, see :func:`kvcr.ports.control.node_of`); with a shared token
every node has the same key, so only the connection is named.

Warnings about refusals and dropped frames are rate-limited: one line per interval with the
count since the last one, so a flood cannot flood the log.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcr.adapters.zmq.curve import ZAP_ENDPOINT, Credentials, zap_reply
from kvcr.adapters.zmq.sockets import bind_with_retry
from kvcr.ports.control import ConnectionHandler, with_node
from kvcr.ports.errors import TransportError

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)

REFUSAL_REASONS = ("credentials", "protocol", "handshake", "frame", "revoked", "crowded")
MAX_CONNECTIONS_PER_HOST = 256
ONEWAY_ID = bytes(8)
_STATUS_OK = b"\x00"
_STATUS_FAILED = b"\x01"
_REQUEST_ID_BYTES = 8
_MONITOR_EVENT = struct.Struct("=HI")
_MONITOR_IDS = itertools.count()
_SLICE_S = 0.05  # longest single poll: how quickly close() is noticed
_BATCH = 64  # requests answered between two looks at ZAP, the monitor and the stop flag
_BIND_RETRY_S = 0.5  # a just-closed socket on a shared context frees its port asynchronously
_ROUTER_RCVHWM = 32  # requests queued per connection: bounds what one peer can make us buffer
_WARN_EVERY_S = 10.0
# With a monitor attached (we need it to count refusals), libzmq 4.3.5 does not close a connection
# whose frame fails CURVE authentication after the handshake: it only stops reading it. ZMTP
# heartbeats close such a connection (it can no longer answer a PING) within interval + timeout,
# so a tampered connection neither hangs its client for ever nor holds our descriptor.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 2000


class RateLimitedWarning:
    """Logs a WARNING at most once per interval, saying how many were suppressed in between."""

    def __init__(self, logger: logging.Logger, interval_s: float = _WARN_EVERY_S) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._next = 0.0
        self._suppressed = 0

    def warn(self, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            message += " (and %d more in the last %.0fs)"
            args = (*args, self._suppressed, self._interval_s)
        self._suppressed = 0
        self._next = now + self._interval_s
        self._log.warning(message, *args, exc_info=exc_info)


class ControlServer:
    """Binds the ROUTER in the caller's thread (so bind errors raise there) and serves on its own.

    Args:
        on_refusal: called on the server thread with a reason from :data:`REFUSAL_REASONS`.
        on_tick: called on the server thread about every poll slice (the client pool's idle sweep).
        on_stopped: called on the server thread once every server socket is closed.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        lib: Any,
        *,
        name: str,
        keyring: Credentials | None,
        max_message_bytes: int,
        handshake_ms: int,
        on_refusal: Callable[[str], None],
        on_tick: Callable[[], None],
        on_stopped: Callable[[], None],
        max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST,
    ) -> None:
        self._context = context
        self._zmq = lib
        self._name = name
        self._keyring = keyring
        self._max_message_bytes = max_message_bytes
        self._handshake_ms = handshake_ms
        self._on_refusal = on_refusal
        self._on_tick = on_tick
        self._on_stopped = on_stopped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refusal_warning = RateLimitedWarning(log)
        self._frame_warning = RateLimitedWarning(log)
        self._handler_warning = RateLimitedWarning(log)
        self._handshakes = itertools.count(1)  # ZAP user ids: one per admitted handshake, never reused
        fail = lib.EVENT_HANDSHAKE_FAILED_NO_DETAIL | lib.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._monitored = (
            fail | lib.EVENT_HANDSHAKE_FAILED_AUTH | lib.EVENT_ACCEPTED | lib.EVENT_DISCONNECTED | lib.EVENT_CLOSED
        )
        self._per_host_cap = max_connections_per_host
        self._port = 0  # ours, once bound: an accepted descriptor is counted only if it is on this port
        self._open: dict[int, str] = {}  # descriptor -> peer host, for connections accepted and not yet gone
        self._per_host: dict[str, int] = {}
        self._crowd_warning = RateLimitedWarning(log)

    @property
    def connections(self) -> int:
        """Connections accepted on our port and not yet gone (from the monitor's events)."""
        return len(self._open)

    def start(self, bind_address: str, handler: ConnectionHandler, *, ipv6: bool) -> None:
        """Bind and start serving.

        Raises:
            TransportError: the address could not be bound, or another authenticated server
                already owns this context's ZAP endpoint.
        """
        lib = self._zmq
        opened: list[zmq.Socket[bytes]] = []
        try:
            zap = None
            if self._keyring is not None:
                # Bound before the ROUTER: a CURVE handshake with no ZAP handler admits any client key.
                zap = self._context.socket(lib.REP)
                opened.append(zap)
                zap.setsockopt(lib.LINGER, 0)
                try:
                    zap.bind(ZAP_ENDPOINT)
                except lib.ZMQError as exc:
                    raise TransportError(
                        f"cannot serve control endpoint {bind_address} with CURVE: another authenticated "
                        f"channel owns this ZMQ context's ZAP handler ({exc}); give each its own context"
                    ) from exc
            sock = self._context.socket(lib.ROUTER)
            opened.append(sock)
            sock.setsockopt(lib.LINGER, 0)
            sock.setsockopt(lib.MAXMSGSIZE, self._max_message_bytes)
            sock.setsockopt(lib.RCVHWM, _ROUTER_RCVHWM)
            sock.setsockopt(lib.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
            sock.setsockopt(lib.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
            # A connection that never completes its greeting holds a descriptor until this expires;
            # libzmq has no cap on accepted-but-unauthenticated connections, so this is the bound.
            sock.setsockopt(lib.HANDSHAKE_IVL, self._handshake_ms)
            if ipv6:
                sock.setsockopt(lib.IPV6, 1)
            if self._keyring is not None:
                self._keyring.configure_server(sock)
            # Unique per server: an inproc name is released asynchronously after its socket closes.
            monitor_address = f"inproc://kvcr-control-server-monitor-{id(self):x}-{next(_MONITOR_IDS)}"
            sock.monitor(monitor_address, self._monitored)
            monitor = self._context.socket(lib.PAIR)
            opened.append(monitor)
            monitor.setsockopt(lib.LINGER, 0)
            monitor.connect(monitor_address)
            bind_with_retry(lib, sock, bind_address, _BIND_RETRY_S, "control endpoint")
            self._port = int(str(sock.getsockopt_string(lib.LAST_ENDPOINT)).rsplit(":", 1)[1])
        except BaseException as exc:
            for s in reversed(opened):
                s.close(linger=0)
            if isinstance(exc, lib.ZMQError):
                raise TransportError(f"cannot open the control server on {bind_address}: {exc}") from exc
            raise
        self._thread = threading.Thread(
            target=self._loop, args=(sock, zap, monitor, handler), name=f"kvcr-control-{self._name}", daemon=True
        )
        # Thread.start is a full memory barrier: the sockets migrate to the server thread here.
        self._thread.start()

    def stop(self, join_s: float) -> bool:
        """Ask the thread to stop; returns whether it did within ``join_s``."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(join_s)
        return not self._thread.is_alive()

    def _loop(
        self,
        sock: zmq.Socket[bytes],
        zap: zmq.Socket[bytes] | None,
        monitor: zmq.Socket[bytes],
        handler: ConnectionHandler,
    ) -> None:
        lib = self._zmq
        poller = lib.Poller()
        for s in (sock, monitor) if zap is None else (sock, zap, monitor):
            poller.register(s, lib.POLLIN)
        slice_ms = round(_SLICE_S * 1000)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(slice_ms))
                if zap is not None and zap in ready:
                    self._answer_zap(zap)
                if monitor in ready:
                    self._on_monitor_events(monitor)
                if sock in ready:
                    for _ in range(_BATCH):
                        if not sock.getsockopt(lib.EVENTS) & lib.POLLIN:
                            break
                        self._answer(sock, sock.recv_multipart(lib.NOBLOCK, copy=False), handler)
                self._on_tick()
        except lib.ZMQError as exc:
            if not self._stop.is_set():
                log.error("control server %s stopped: %s", self._name, exc)
        finally:
            with contextlib.suppress(lib.ZMQError):  # the context may be terminating under us
                sock.disable_monitor()
            sock.close(linger=0)  # before the ZAP handler: no handshake may start without it
            monitor.close(linger=0)
            if zap is not None:
                zap.close(linger=0)
            self._on_stopped()

    def _answer_zap(self, zap: zmq.Socket[bytes]) -> None:
        lib = self._zmq
        assert self._keyring is not None
        while zap.getsockopt(lib.EVENTS) & lib.POLLIN:
            reply, _ = zap_reply(zap.recv_multipart(lib.NOBLOCK), self._keyring, b"%d" % next(self._handshakes))
            zap.send_multipart(reply)  # a refusal is counted from the monitor's AUTH event

    def _on_monitor_events(self, monitor: zmq.Socket[bytes]) -> None:
        lib = self._zmq
        while monitor.getsockopt(lib.EVENTS) & lib.POLLIN:
            frames = monitor.recv_multipart(lib.NOBLOCK)
            if not frames or len(frames[0]) < _MONITOR_EVENT.size:
                continue
            event, value = _MONITOR_EVENT.unpack_from(frames[0])
            if event & lib.EVENT_ACCEPTED:
                self._accepted(value)
                continue
            if event & (lib.EVENT_DISCONNECTED | lib.EVENT_CLOSED):
                self._gone(value)
                continue
            if event & lib.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = "credentials"
            elif event & lib.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                reason = "protocol"
            elif event & lib.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                reason = "handshake"
            else:
                continue
            self._on_refusal(reason)
            self._refusal_warning.warn("control server %s refused a connection (%s)", self._name, reason)

    def _accepted(self, fd: int) -> None:
        """Count a new connection against its host; shut it down if the host is over the cap."""
        self._gone(fd)  # a descriptor number libzmq reused before we saw it go
        try:
            # One duplicate for the check and the shutdown: it holds the very socket checked, even if
            # libzmq closes ``fd`` meanwhile and the number is reused.
            with _borrowed(fd) as conn:
                host = _peer_host(conn, self._port)
                if host is None:  # gone already, or (reused) not a connection to our port
                    return
                crowded = self._per_host.get(host, 0) >= self._per_host_cap
                if crowded:
                    conn.shutdown(socket.SHUT_RDWR)  # libzmq sees it end and closes the descriptor itself
        except OSError:
            return
        if crowded:
            self._on_refusal("crowded")
            self._crowd_warning.warn(
                "control server %s shut a connection down: its host holds %d connections already",
                self._name,
                self._per_host_cap,
            )
            return
        self._open[fd] = host
        self._per_host[host] = self._per_host.get(host, 0) + 1

    def _gone(self, fd: int) -> None:
        host = self._open.pop(fd, None)
        if host is None:
            return
        left = self._per_host[host] - 1
        if left:
            self._per_host[host] = left
        else:
            del self._per_host[host]

    def _refuse_revoked(self, sock: zmq.Socket[bytes], identity: bytes, request_id: bytes, oneway: bool) -> None:
        self._on_refusal("revoked")
        self._refusal_warning.warn("control server %s refused a request: its node was revoked", self._name)
        if not oneway:
            with contextlib.suppress(self._zmq.Again):
                reply = b"revoked: this node's key is no longer in the peer directory"
                sock.send_multipart([identity, request_id, _STATUS_FAILED, reply], self._zmq.NOBLOCK)

    def _answer(self, sock: zmq.Socket[bytes], message: list[zmq.Frame], handler: ConnectionHandler) -> None:
        lib = self._zmq
        if len(message) != 3 or len(message[1]) != _REQUEST_ID_BYTES:
            self._on_refusal("frame")
            self._frame_warning.warn("control server %s dropped a malformed request", self._name)
            return
        identity, request_id, payload = (frame.bytes for frame in message)
        oneway = request_id == ONEWAY_ID
        node = b""
        connection = identity
        if self._keyring is not None:  # only a ZAP handler sets a user id (asking without one raises)
            user_id = str(message[0].get("User-Id"))
            connection += b"|" + user_id.encode()
            if self._keyring.per_node:
                node = bytes.fromhex(user_id.partition("/")[2])  # set by our own ZAP answer: well formed
                if not self._keyring.admits(node):
                    self._refuse_revoked(sock, identity, request_id, oneway)
                    return
        connection = with_node(node, connection)
        try:
            reply = handler(payload, connection)
            if oneway:
                return
            if reply is None:
                # The peer asked for a reply to a one-way message (e.g. RELEASE with a request id): its
                # mistake, not a handler failure, so no traceback; it learns there is no reply.
                self._frame_warning.warn("control server %s: a one-way message came as a request", self._name)
                status, reply = _STATUS_FAILED, b"no reply: a one-way message"
            elif not isinstance(reply, bytes):
                raise TypeError(f"handler gave {type(reply).__name__} to a request, not bytes")
            else:
                status = _STATUS_OK
        except Exception as exc:  # a handler bug must not stop the server; the peer learns it failed
            self._handler_warning.warn("control handler on %s failed", self._name, exc_info=True)
            if oneway:
                return
            status, reply = _STATUS_FAILED, f"handler failed: {type(exc).__name__}".encode()
        try:
            sock.send_multipart([identity, request_id, status, reply], lib.NOBLOCK)
        except lib.Again:
            self._frame_warning.warn("control server %s dropped a reply: the peer is not reading", self._name)


def _peer_host(conn: socket.socket, port: int) -> str | None:
    """The peer host of ``conn`` if it is a TCP connection to our ``port``; else None."""
    if conn.family not in (socket.AF_INET, socket.AF_INET6) or conn.type != socket.SOCK_STREAM:
        return None
    if conn.getsockname()[1] != port:
        return None
    return str(conn.getpeername()[0])


def _borrowed(fd: int) -> socket.socket:
    """A socket object over a duplicate of ``fd`` (its family read from the kernel): closing it leaves
    ``fd``, which is libzmq's, open."""
    dup = os.dup(fd)
    try:
        return socket.socket(fileno=dup)
    except OSError:  # not a socket (any more): the number was reused
        os.close(dup)
        raise
