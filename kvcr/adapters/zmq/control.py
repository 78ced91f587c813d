"""A ControlChannel over pyzmq: one ROUTER that serves, pooled DEALERs that ask.

Security: with a cluster token every connection uses ZMQ's CURVE mechanism (CurveZMQ:
Curve25519 key exchange, then authenticated encryption of every frame with per-connection
short-term keys and message counters), keyed from the token (:mod:`kvcr.adapters.zmq.curve`).
A peer without the token, with another token, or speaking plaintext fails the handshake: our
server never hands it to the handler, and our client sees :class:`PeerUnavailable` within
milliseconds. Bytes recorded on the wire and replayed on a new connection fail the handshake; bytes
tampered with in flight break the connection. Without a token the channel is plaintext, and only a
loopback bind is allowed unless ``allow_unauthenticated`` says the operator means it.

Server: :mod:`kvcr.adapters.zmq.server` (wire format, refusal reasons). Client: per peer a small
pool of DEALER sockets in a bounded LRU (:mod:`kvcr.adapters.zmq.links`). Error mapping:

- no connection within ``timeout_s``, connection refused, handshake failed (credentials),
  connection lost -> :class:`PeerUnavailable`
- connected and sent, but no reply within ``timeout_s`` -> :class:`ControlTimeout` (the socket is
  dropped, so a late reply can never answer a later request; request ids guard that as well)
- the peer's handler failed -> :class:`PeerRefused`
- this channel is closed -> :class:`TransportError`

One-way ``send`` queues without blocking and never raises; a message it cannot queue is dropped
and counted in :attr:`ZmqControlChannel.dropped_sends`. Every wait is bounded; LINGER is 0 on
every socket.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import math
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcr.adapters.zmq.curve import Credentials, Keyring
from kvcr.adapters.zmq.identity import NodeIdentity, PeerDirectory
from kvcr.adapters.zmq.links import Conn, PeerLinks
from kvcr.adapters.zmq.server import MAX_CONNECTIONS_PER_HOST, ONEWAY_ID, REFUSAL_REASONS, ControlServer
from kvcr.adapters.zmq.sockets import zmq_address
from kvcr.domain.endpoints import WILDCARD_HOSTS
from kvcr.domain.errors import ConfigError
from kvcr.domain.hints import Endpoint
from kvcr.ports.control import ConnectionHandler, Handler
from kvcr.ports.errors import ControlTimeout, PeerRefused, PeerUnavailable, TransportError

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)

_STATUS_OK = b"\x00"
_REQUEST_ID = struct.Struct(">Q")
_SLICE_S = 0.05  # longest single poll: how quickly close() is noticed by waiting threads
_JOIN_S = 2.0  # how long close() waits for the server thread (a handler may be running)
_DRAIN_S = 1.0  # how long close() waits for in-flight requests to notice it
_SOCKETS_PER_PEER = 16  # an owned context's socket limit: idle DEALERs + monitors + one-way, per peer


class _HandshakeFailed(Exception):
    """The connection failed before its handshake completed: worth dialling with the next token's keys."""


class ZmqControlChannel:
    """Request/reply and one-way messages between peer runners over ZMQ ROUTER/DEALER. Thread-safe.

    Args:
        bind_host: the address ``serve`` binds (explicit; a wildcard needs ``advertise_host``).
        port: the TCP port ``serve`` binds, 1..65535.
        advertise_host: the address peers dial, when it differs from ``bind_host``.
        token: the cluster token; with it every connection is CURVE-authenticated and encrypted,
            without it the channel is plaintext.
        rotation_tokens: further tokens during a token rotation: their holders are admitted by our
            server, and our client dials with them when the current token's handshake fails.
        node_secret_key: instead of a token, this node's own CURVE secret key (Z85, as ``kvcr keygen``
            writes it); needs ``peer_directory_file`` (:mod:`kvcr.adapters.zmq.identity`).
        peer_directory_file: the file listing every node's public key and control endpoint; read again
            when it changes, so a removed line revokes that node at once.
        allow_unauthenticated: permit a plaintext channel (no ``token``) on a non-loopback bind.
        context: a ``zmq.Context`` to share; by default the channel owns (and terminates) its own.
            With a token, one serving channel per context (libzmq has one ZAP handler per context).
        max_message_bytes: the largest request or reply accepted from a peer.
        max_peers: how many peers may keep sockets open at once (least recently used closed first).
        idle_close_s: a peer unused this long has its sockets closed.
        handshake_timeout_s: a connection to our server that has not completed its ZMTP (and CURVE)
            handshake this long after it was accepted is closed (``ZMQ_HANDSHAKE_IVL``; libzmq's
            own default is 30 s): a flood of half-open greetings holds descriptors only this long.
        on_refusal: called (on the server thread) with a reason from ``REFUSAL_REASONS`` each
            time the server refuses a connection or drops a frame; must not block.

    Raises:
        ConfigError: an empty bind host, a wildcard (or missing) advertised host, a port outside
            1..65535, a non-loopback bind without a token (unless ``allow_unauthenticated``),
            rotation tokens without a token, an empty token, a limit out of range.
    """

    REFUSAL_REASONS = REFUSAL_REASONS

    def __init__(
        self,
        bind_host: str,
        port: int,
        *,
        advertise_host: str | None = None,
        token: bytes | None = None,
        rotation_tokens: Sequence[bytes] = (),
        node_secret_key: bytes | None = None,
        peer_directory_file: str | None = None,
        allow_unauthenticated: bool = False,
        context: zmq.Context[Any] | None = None,
        max_message_bytes: int = 64 << 20,
        max_peers: int = 256,
        idle_close_s: float = 30.0,
        handshake_timeout_s: float = 2.0,
        max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST,
        on_refusal: Callable[[str], None] | None = None,
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
        if not isinstance(max_peers, int) or max_peers < 1:
            raise ConfigError(f"control max_peers must be a positive integer, got {max_peers!r}")
        if not isinstance(idle_close_s, (int, float)) or not math.isfinite(idle_close_s) or idle_close_s <= 0:
            raise ConfigError(f"control idle_close_s must be a positive number of seconds, got {idle_close_s!r}")
        if (
            not isinstance(handshake_timeout_s, (int, float))
            or not math.isfinite(handshake_timeout_s)
            or not 0.001 <= handshake_timeout_s <= 3600
        ):
            raise ConfigError(
                f"control handshake_timeout_s must be in 0.001..3600 seconds, got {handshake_timeout_s!r}"
            )
        if token is None and rotation_tokens:
            raise ConfigError("control rotation_tokens need a current token")
        if (node_secret_key is None) != (peer_directory_file is None):
            raise ConfigError("control node_secret_key and peer_directory_file go together (per-node identities)")
        if token is not None and node_secret_key is not None:
            raise ConfigError("control: a cluster token or per-node identities, not both")
        authenticated = token is not None or node_secret_key is not None
        if not authenticated and not allow_unauthenticated and not _is_loopback(bind_host):
            raise ConfigError(
                f"control bind_host {bind_host!r} is not a loopback address and no cluster token is set: "
                "set a token, or allow_unauthenticated to let anyone who reaches the port use it"
            )
        try:
            self._endpoint = str(Endpoint(advertise_host or bind_host, port))
        except ValueError as exc:
            raise ConfigError(f"control advertise_host: {exc}") from exc

        import zmq

        keyring: Credentials | None = None
        if token is not None:
            keyring = Keyring(token, rotation_tokens)
        elif node_secret_key is not None and peer_directory_file is not None:
            keyring = NodeIdentity(node_secret_key, PeerDirectory(peer_directory_file), self._endpoint)
        self._zmq: Any = zmq
        self._own_context = context is None
        if context is None:
            context = zmq.Context()
            context.set(zmq.MAX_SOCKETS, max(1024, max_peers * _SOCKETS_PER_PEER + 64))
        self._context: zmq.Context[Any] = context
        self._bind_host = bind_host
        self._port = port
        self._keyring = keyring
        self._unauthenticated_remote = not authenticated and not _is_loopback(bind_host)
        self._max_message_bytes = max_message_bytes
        self._handshake_ms = max(1, round(handshake_timeout_s * 1000))
        if not isinstance(max_connections_per_host, int) or max_connections_per_host < 1:
            raise ConfigError(
                f"control max_connections_per_host must be a positive integer, got {max_connections_per_host!r}"
            )
        self._max_per_host = max_connections_per_host
        self._on_refusal = on_refusal
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._closed = False
        self._terminated = False
        self._in_flight = 0
        self._ids = itertools.count(1)  # 0 marks a one-way message
        self._refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self.dropped_sends = 0
        """One-way messages dropped locally (closed channel, bad endpoint, queue full, too large)."""
        self._links = PeerLinks(
            self._context,
            zmq,
            keyring=keyring,
            max_message_bytes=max_message_bytes,
            max_peers=max_peers,
            idle_close_s=float(idle_close_s),
        )
        self._server: ControlServer | None = None
        self._server_done = True

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def authenticated(self) -> bool:
        """Whether connections are CURVE-authenticated (a token, or this node's own key, was given)."""
        return self._keyring is not None

    def node_admitted(self, node: bytes) -> bool:
        """Whether ``node`` (a client's raw public key) is listed now; any node when keys are not per node."""
        keyring = self._keyring
        return not node or keyring is None or not keyring.per_node or keyring.admits(node)

    @property
    def refusals(self) -> dict[str, int]:
        """Connections refused and frames dropped by our server so far, by reason (a snapshot)."""
        return dict(self._refusals)

    def open_peers(self) -> int:
        """How many peers this channel keeps sockets open to right now."""
        return self._links.open_peers()

    # ------------------------------------------------------------------ server

    def serve(self, handler: Handler) -> None:
        self.serve_connections(lambda payload, _connection: handler(payload))

    def serve_connections(self, handler: ConnectionHandler) -> None:
        with self._lock:
            if self._closed:
                raise TransportError(f"control channel {self._endpoint} is closed")
            if self._server is not None:
                raise TransportError(f"control channel {self._endpoint} is already serving")
            server = ControlServer(
                self._context,
                self._zmq,
                name=str(self._port),
                keyring=self._keyring,
                max_message_bytes=self._max_message_bytes,
                handshake_ms=self._handshake_ms,
                on_refusal=self._count_refusal,
                on_tick=self._links.sweep,
                on_stopped=self._server_stopped,
                max_connections_per_host=self._max_per_host,
            )
            server.start(zmq_address(self._bind_host, self._port), handler, ipv6=":" in self._bind_host)
            self._server, self._server_done = server, False
        if self._unauthenticated_remote:
            log.warning(
                "control channel %s serves WITHOUT authentication on %s (allow_unauthenticated): "
                "anyone who reaches the port can ask for leases and transport metadata",
                self._endpoint,
                self._bind_host,
            )

    def _count_refusal(self, reason: str) -> None:
        self._refusals[reason] += 1  # only the server thread writes
        if self._on_refusal is not None:
            try:
                self._on_refusal(reason)
            except Exception:  # a metrics bug must not stop the server
                log.exception("control channel %s: the refusal callback failed", self._endpoint)

    def _server_stopped(self) -> None:
        with self._lock:
            self._server_done = True
        self._terminate_if_done()

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
        self._enter()
        conn: Conn | None = None
        reusable = False
        try:
            conn = self._links.checkout(str(peer), ipv6=":" in peer.host, deadline=deadline)
            while True:
                try:
                    reply = self._exchange(conn, endpoint, payload, timeout_s, deadline)
                except _HandshakeFailed as failed:
                    # Token rotation: the peer may already (or still) use another token on our ring.
                    failed_conn, conn = conn, None
                    conn = self._links.redial(failed_conn)
                    if conn is None:
                        raise PeerUnavailable(f"control peer {endpoint}: {failed}") from None
                    continue
                reusable = True
                return reply
        except self._zmq.ZMQError as exc:  # e.g. a shared context terminated under us: translate, never leak
            raise TransportError(f"control request to {endpoint} failed: {exc}") from exc
        finally:
            if conn is not None:
                self._links.checkin(conn, reusable)
            self._leave()

    def _exchange(self, conn: Conn, endpoint: str, payload: bytes, timeout_s: float, deadline: float) -> bytes:
        """Send and wait for the matching reply."""
        lib = self._zmq
        request_id = _REQUEST_ID.pack(next(self._ids))
        # Phase 1: with IMMEDIATE the DEALER takes the message only once a connection is up.
        while True:
            self._links.read_events(conn)
            if conn.failure is not None:
                if conn.handshake_failed:
                    raise _HandshakeFailed(conn.failure)
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
                        return body
                    reason = body.decode("utf-8", "replace")[:200]
                    raise PeerRefused(f"control peer {endpoint} could not answer: {reason}")
            self._links.read_events(conn)
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

    def send(self, endpoint: str, payload: bytes) -> None:
        try:
            if self._closed or len(payload) > self._max_message_bytes:
                raise TransportError("closed, or the message is larger than max_message_bytes")
            peer = Endpoint.parse(endpoint)
            self._enter()
            try:
                sent = self._links.send(str(peer), [ONEWAY_ID, payload], ipv6=":" in peer.host)
            finally:
                self._leave()
        except Exception as exc:  # best effort by contract: a one-way message never raises
            log.debug("control channel %s dropped a one-way message to %r: %s", self._endpoint, endpoint, exc)
            sent = False
        if not sent:
            with self._lock:
                self.dropped_sends += 1

    def forget(self, endpoint: str) -> None:
        try:
            peer = str(Endpoint.parse(endpoint))
        except ValueError:
            return  # nothing can be open to an endpoint we could never dial
        self._links.forget(peer)

    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise TransportError(f"control channel {self._endpoint} is closed")
            self._in_flight += 1

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.notify_all()
        self._terminate_if_done()

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server = self._server
        self._links.close()
        if server is not None and not server.stop(_JOIN_S):
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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a wildcard or a host name: not provably loopback


if TYPE_CHECKING:
    from kvcr.ports.control import ControlChannel

    _: ControlChannel = ZmqControlChannel("127.0.0.1", 1)
