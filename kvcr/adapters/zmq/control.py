"""A ControlChannel over pyzmq: one ROUTER that serves, pooled DEALERs that ask.

Wire format (one ZMQ multipart message each way; the payload is opaque here, the peer protocol's
codec versions and authenticates it)::

    request   DEALER -> ROUTER   [request id (8 bytes), payload]
    reply     ROUTER -> DEALER   [request id, status (1 byte), body]
                                 status 0: body is the handler's reply
                                 status 1: the handler failed; body says why (PeerRefused here)

Server: ``serve`` binds the ROUTER in the caller's thread, so a bind failure raises there, then
hands the socket to a daemon thread that polls in short slices (``close`` stops it promptly) and
answers every request with the handler's reply. A handler that raises gets the peer a status-1
reply and a log line; the thread keeps serving.

Client: per peer endpoint a small pool of DEALER sockets, each used by one thread at a time (so
concurrent callers never share a socket and never wait on each other). Every socket has
``IMMEDIATE`` set, so it is writable only once a connection to the peer is up, and a socket
monitor, so a refused or dropped connection is seen within milliseconds rather than at the
deadline. Error mapping:

- no connection within ``timeout_s``, connection refused, handshake failed, connection lost
  -> :class:`PeerUnavailable`
- connected and sent, but no reply within ``timeout_s`` -> :class:`ControlTimeout` (the socket is
  dropped, so a late reply can never answer a later request; request ids guard that as well)
- the peer's handler failed -> :class:`PeerRefused`
- this channel is closed -> :class:`TransportError`

Every wait is bounded; LINGER is 0 on every socket.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from kvcr.adapters.zmq.sockets import WILDCARD_HOSTS, bind_with_retry, zmq_address
from kvcr.domain.errors import ConfigError
from kvcr.domain.hints import Endpoint
from kvcr.ports.control import Handler
from kvcr.ports.errors import ControlTimeout, PeerRefused, PeerUnavailable, TransportError

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)

_STATUS_OK = b"\x00"
_STATUS_FAILED = b"\x01"
_REQUEST_ID = struct.Struct(">Q")
_MONITOR_EVENT = struct.Struct("=HI")  # libzmq's monitor frame: uint16 event, uint32 value
_SLICE_S = 0.05  # longest single poll: how quickly close() is noticed by waiting threads
_BATCH = 64  # requests answered between two looks at the stop flag
_JOIN_S = 2.0  # how long close() waits for the server thread (a handler may be running)
_DRAIN_S = 1.0  # how long close() waits for in-flight requests to notice it
_BIND_RETRY_S = 0.5  # a just-closed socket on a shared context frees its port asynchronously
_MAX_IDLE_PER_PEER = 4
_MONITOR_IDS = itertools.count()


class _Conn:
    """One DEALER to one peer and its monitor; used by one thread at a time."""

    __slots__ = ("address", "connected", "failure", "monitor", "recv_poller", "send_poller", "sock")

    def __init__(self, address: str, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], lib: Any) -> None:
        self.address = address
        self.sock = sock
        self.monitor = monitor
        self.connected = False
        self.failure: str | None = None
        self.send_poller = lib.Poller()
        self.send_poller.register(sock, lib.POLLOUT)
        self.send_poller.register(monitor, lib.POLLIN)
        self.recv_poller = lib.Poller()
        self.recv_poller.register(sock, lib.POLLIN)
        self.recv_poller.register(monitor, lib.POLLIN)


class ZmqControlChannel:
    """Request/reply between peer runners over ZMQ ROUTER/DEALER. Thread-safe.

    Args:
        bind_host: the address ``serve`` binds (explicit; a wildcard needs ``advertise_host``).
        port: the TCP port ``serve`` binds, 1..65535.
        advertise_host: the address peers dial, when it differs from ``bind_host``.
        context: a ``zmq.Context`` to share; by default the channel owns (and terminates) its own.
        max_message_bytes: the largest request or reply accepted from a peer.

    Raises:
        ConfigError: an empty bind host, a wildcard (or missing) advertised host, a port outside 1..65535.
    """

    def __init__(
        self,
        bind_host: str,
        port: int,
        *,
        advertise_host: str | None = None,
        context: zmq.Context[Any] | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"control port must be in 1..65535, got {port!r}")
        if not isinstance(bind_host, str) or not bind_host:
            raise ConfigError(f"control bind_host must be an address, got {bind_host!r}")
        if advertise_host is not None and (not advertise_host or advertise_host in WILDCARD_HOSTS):
            raise ConfigError(f"control advertise_host must be a dialable address, got {advertise_host!r}")
        if advertise_host is None and bind_host in WILDCARD_HOSTS:
            raise ConfigError(f"control advertise_host is required when bind_host is the wildcard {bind_host!r}")
        if max_message_bytes <= 0:
            raise ConfigError(f"control max_message_bytes must be positive, got {max_message_bytes}")
        try:
            self._endpoint = str(Endpoint(advertise_host or bind_host, port))
        except ValueError as exc:
            raise ConfigError(f"control advertise_host: {exc}") from exc

        import zmq

        self._zmq: Any = zmq
        self._own_context = context is None
        self._context: zmq.Context[Any] = zmq.Context() if context is None else context
        self._bind_host = bind_host
        self._port = port
        self._max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._closed = False
        self._terminated = False
        self._idle: dict[str, list[_Conn]] = {}
        self._in_flight = 0
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._server_done = True

    @property
    def endpoint(self) -> str:
        return self._endpoint

    # ------------------------------------------------------------------ server

    def serve(self, handler: Handler) -> None:
        lib = self._zmq
        bind_address = self._bind_address()
        with self._lock:
            if self._closed:
                raise TransportError(f"control channel {self._endpoint} is closed")
            if self._server is not None:
                raise TransportError(f"control channel {self._endpoint} is already serving")
            try:
                sock = self._context.socket(lib.ROUTER)
            except lib.ZMQError as exc:
                raise TransportError(f"cannot open a control socket for {bind_address}: {exc}") from exc
            try:
                sock.setsockopt(lib.LINGER, 0)
                sock.setsockopt(lib.MAXMSGSIZE, self._max_message_bytes)
                if ":" in self._bind_host:
                    sock.setsockopt(lib.IPV6, 1)
                bind_with_retry(self._zmq, sock, bind_address, _BIND_RETRY_S, "control endpoint")
            except BaseException:
                sock.close(linger=0)
                raise
            self._server_done = False
            self._server = threading.Thread(
                target=self._serve_loop, args=(sock, handler), name=f"kvcr-control-{self._port}", daemon=True
            )
            # Thread.start is a full memory barrier: the socket migrates to the server thread here.
            self._server.start()

    def _bind_address(self) -> str:
        return zmq_address(self._bind_host, self._port)

    def _serve_loop(self, sock: zmq.Socket[bytes], handler: Handler) -> None:
        lib = self._zmq
        slice_ms = round(_SLICE_S * 1000)
        try:
            while not self._stop.is_set():
                if not sock.poll(slice_ms, lib.POLLIN):
                    continue
                for _ in range(_BATCH):
                    if not sock.getsockopt(lib.EVENTS) & lib.POLLIN:
                        break
                    self._answer(sock, sock.recv_multipart(lib.NOBLOCK), handler)
        except lib.ZMQError as exc:
            if not self._stop.is_set():
                log.error("control server %s stopped: %s", self._endpoint, exc)
        finally:
            sock.close(linger=0)
            with self._lock:
                self._server_done = True
            self._terminate_if_done()

    def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes], handler: Handler) -> None:
        lib = self._zmq
        if len(frames) != 3 or len(frames[1]) != _REQUEST_ID.size:
            log.warning("control server %s dropped a malformed request (%d frames)", self._endpoint, len(frames))
            return
        identity, request_id, payload = frames
        try:
            reply = handler(payload)
            if not isinstance(reply, bytes):
                raise TypeError(f"handler returned {type(reply).__name__}, not bytes")
            status = _STATUS_OK
        except Exception as exc:  # a handler bug must not stop the server; the peer learns it failed
            log.exception("control handler on %s failed", self._endpoint)
            status, reply = _STATUS_FAILED, f"handler failed: {type(exc).__name__}".encode()
        try:
            sock.send_multipart([identity, request_id, status, reply], lib.NOBLOCK)
        except lib.Again:
            log.warning("control server %s dropped a reply: the peer is not reading", self._endpoint)

    # ------------------------------------------------------------------ client

    def request(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        if not math.isfinite(timeout_s):
            raise ValueError(f"timeout_s must be finite, got {timeout_s}")
        if timeout_s <= 0:
            raise ControlTimeout(f"no time left to ask {endpoint}")
        deadline = time.monotonic() + timeout_s
        try:
            peer = Endpoint.parse(endpoint)
        except ValueError as exc:
            raise PeerUnavailable(f"cannot dial {endpoint!r}: {exc}") from exc
        if len(payload) > self._max_message_bytes:
            raise TransportError(
                f"control request of {len(payload)} bytes exceeds max_message_bytes={self._max_message_bytes}"
            )
        try:
            conn = self._checkout(str(peer), ipv6=":" in peer.host)
            reusable = False
            try:
                reply, reusable = self._exchange(conn, endpoint, payload, timeout_s, deadline)
                return reply
            finally:
                self._checkin(conn, reusable)
        except self._zmq.ZMQError as exc:  # e.g. a shared context terminated under us: translate, never leak
            raise TransportError(f"control request to {endpoint} failed: {exc}") from exc

    def _exchange(
        self, conn: _Conn, endpoint: str, payload: bytes, timeout_s: float, deadline: float
    ) -> tuple[bytes, bool]:
        """Send and wait for the matching reply; returns (reply, whether the socket is reusable)."""
        lib = self._zmq
        request_id = _REQUEST_ID.pack(next(self._ids))
        # Phase 1: with IMMEDIATE the DEALER takes the message only once a connection is up.
        while True:
            self._read_events(conn)
            if conn.failure is not None:
                raise PeerUnavailable(f"control peer {endpoint}: {conn.failure}")
            try:
                conn.sock.send_multipart([request_id, payload], lib.NOBLOCK)
                break
            except lib.Again:
                pass
            self._wait(conn.send_poller, deadline)
            if time.monotonic() >= deadline and not conn.sock.poll(0, lib.POLLOUT):
                raise PeerUnavailable(f"no control connection to {endpoint} within {timeout_s:g}s")
        # Phase 2: the peer has the request; only its reply (or its going away) ends the wait.
        while True:
            events = self._wait(conn.recv_poller, deadline)
            if conn.sock in events:
                while conn.sock.getsockopt(lib.EVENTS) & lib.POLLIN:
                    frames = conn.sock.recv_multipart(lib.NOBLOCK)
                    if not frames or frames[0] != request_id:
                        continue  # a reply to an earlier request that gave up waiting
                    if len(frames) != 3:
                        raise PeerRefused(f"control peer {endpoint} sent a malformed reply")
                    _, status, body = frames
                    if status == _STATUS_OK:
                        return body, True
                    reason = body.decode("utf-8", "replace")[:200]
                    raise PeerRefused(f"control peer {endpoint} could not answer: {reason}")
            self._read_events(conn)
            if conn.failure is not None:
                raise PeerUnavailable(f"control peer {endpoint} went away before answering: {conn.failure}")
            if time.monotonic() >= deadline:
                raise ControlTimeout(f"control peer {endpoint} did not answer within {timeout_s:g}s")

    def _wait(self, poller: zmq.Poller, deadline: float) -> dict[Any, int]:
        """Poll for at most one slice (and never past the deadline); raises if we were closed."""
        remaining = deadline - time.monotonic()
        timeout_ms = max(0, math.ceil(min(remaining, _SLICE_S) * 1000))
        events = dict(poller.poll(timeout_ms))
        if self._closed:
            raise TransportError(f"control channel {self._endpoint} was closed during a request")
        return events

    def _read_events(self, conn: _Conn) -> None:
        lib = self._zmq
        # Reading EVENTS first avoids raising (and catching) Again on every request: it is the hot path.
        while conn.monitor.getsockopt(lib.EVENTS) & lib.POLLIN:
            frames = conn.monitor.recv_multipart(lib.NOBLOCK)
            if not frames or len(frames[0]) < _MONITOR_EVENT.size:
                continue
            event, _ = _MONITOR_EVENT.unpack_from(frames[0])
            if event & lib.EVENT_HANDSHAKE_SUCCEEDED:
                conn.connected = True
            elif event & lib.EVENT_CONNECT_RETRIED and conn.failure is None:
                conn.failure = "connection refused" if not conn.connected else "connection lost"
            elif event & lib.EVENT_DISCONNECTED and conn.failure is None:
                conn.failure = "connection lost" if conn.connected else "connection dropped during the handshake"
            elif event & _handshake_failures(lib) and conn.failure is None:
                conn.failure = "handshake failed"

    def _checkout(self, address: str, *, ipv6: bool) -> _Conn:
        with self._lock:
            if self._closed:
                raise TransportError(f"control channel {self._endpoint} is closed")
            pool = self._idle.get(address)
            conn = pool.pop() if pool else None
            self._in_flight += 1
        try:
            if conn is not None:
                self._read_events(conn)
                if conn.failure is None:
                    return conn
                self._close_conn(conn)  # the peer went away (or restarted) since: dial afresh
            return self._open_conn(address, ipv6=ipv6)
        except BaseException:
            self._leave()
            raise

    def _open_conn(self, address: str, *, ipv6: bool) -> _Conn:
        lib = self._zmq
        sock: zmq.Socket[bytes] | None = None
        monitor: zmq.Socket[bytes] | None = None
        try:
            sock = self._context.socket(lib.DEALER)
            sock.setsockopt(lib.LINGER, 0)
            sock.setsockopt(lib.IMMEDIATE, 1)  # never queue a request to a connection that is not up
            sock.setsockopt(lib.MAXMSGSIZE, self._max_message_bytes)
            if ipv6:
                sock.setsockopt(lib.IPV6, 1)
            # Unique per socket: an inproc name is released asynchronously after its socket closes.
            monitor_address = f"inproc://kvcr-control-monitor-{id(self):x}-{next(_MONITOR_IDS)}"
            sock.monitor(
                monitor_address,
                lib.EVENT_HANDSHAKE_SUCCEEDED
                | lib.EVENT_CONNECT_RETRIED
                | lib.EVENT_DISCONNECTED
                | _handshake_failures(lib),
            )
            monitor = self._context.socket(lib.PAIR)
            monitor.setsockopt(lib.LINGER, 0)
            monitor.connect(monitor_address)  # before dialling, so no event is missed
            sock.connect(address)
            return _Conn(address, sock, monitor, lib)
        except BaseException as exc:
            if monitor is not None:
                monitor.close(linger=0)
            if sock is not None:
                sock.close(linger=0)
            if isinstance(exc, lib.ZMQError):
                raise TransportError(f"cannot open a control connection to {address}: {exc}") from exc
            raise

    def _checkin(self, conn: _Conn, reusable: bool) -> None:
        keep = None
        if reusable:
            with self._lock:
                pool = self._idle.setdefault(conn.address, [])
                if not self._closed and len(pool) < _MAX_IDLE_PER_PEER:
                    pool.append(conn)
                    keep = conn
        if keep is None:
            # After a timeout this drops whatever the peer still queues for us (a stale reply).
            self._close_conn(conn)
        self._leave()

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.notify_all()
        self._terminate_if_done()

    def _close_conn(self, conn: _Conn) -> None:
        lib = self._zmq
        with contextlib.suppress(lib.ZMQError):
            conn.sock.disable_monitor()
        conn.monitor.close(linger=0)
        conn.sock.close(linger=0)

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Closed under the lock: once _closed is set, the last thread out may destroy the context.
            for pool in self._idle.values():
                for conn in pool:
                    self._close_conn(conn)
            self._idle.clear()
            server = self._server
        self._stop.set()
        if server is not None:
            server.join(_JOIN_S)
            if server.is_alive():
                log.error(
                    "control server %s did not stop within %.1fs (a handler is still running); "
                    "its socket closes when the handler returns",
                    self._endpoint,
                    _JOIN_S,
                )
        with self._lock:
            if not self._drained.wait_for(lambda: self._in_flight == 0, timeout=_DRAIN_S):
                log.error("control channel %s closed with %d requests still in flight", self._endpoint, self._in_flight)
        self._terminate_if_done()

    def _terminate_if_done(self) -> None:
        """Terminate an owned context once closed and nothing uses a socket any more (last one out)."""
        with self._lock:
            if not self._closed or self._terminated or not self._own_context:
                return
            if self._in_flight or not self._server_done:
                return
            self._terminated = True
        # Every socket of ours is closed by now; destroy (not term) also closes any a bug leaked,
        # so this can never block.
        self._context.destroy(linger=0)


def _handshake_failures(lib: Any) -> int:
    failures: int = (
        lib.EVENT_HANDSHAKE_FAILED_NO_DETAIL | lib.EVENT_HANDSHAKE_FAILED_PROTOCOL | lib.EVENT_HANDSHAKE_FAILED_AUTH
    )
    return failures


if TYPE_CHECKING:
    from kvcr.ports.control import ControlChannel

    _: ControlChannel = ZmqControlChannel("127.0.0.1", 1)
