"""ControlChannel: request/reply and one-way messages between peer runners.

Call order: ``serve(handler)`` (or ``serve_connections``) once to answer requests on our endpoint
(the handler runs on the channel's own thread, so an idle engine still answers); ``request`` and
``send`` any number of
times to peers' endpoints; ``forget`` a peer whose link is closed; ``close`` once. Payloads are
opaque bytes: the peer protocol encodes and checks them.

Security belongs to the channel: an adapter configured with cluster credentials authenticates
and encrypts every connection, and a peer without them never reaches the handler (it sees
PeerUnavailable). The handler therefore only ever sees frames from authenticated peers, or from
anyone when the channel runs without credentials (loopback only, or an operator's explicit opt-in).

Connections: every request and one-way message a channel sends to one peer travels over one
connection for as long as that connection lives (a second thread waits for it rather than opening
another), so a server can bind state to the connection a request came over
(``serve_connections``): nobody else can send over it, even with the same credentials.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

Handler = Callable[[bytes], bytes | None]
"""Answers one request frame; returns the reply, or None for a one-way message (nothing is sent)."""

ConnectionHandler = Callable[[bytes, bytes], bytes | None]
"""Like :data:`Handler`, also given the connection the frame came over: opaque bytes, equal for every
frame of one connection and never equal for two connections of the channel's life (with credentials,
bound to the handshake that authenticated it, so no other peer can present it).

Its first byte is the length of the *node* the connection belongs to, then that node's name, then the
rest: a channel that authenticates each node with its own key names it there (every connection of
one node the same name), one that cannot tell nodes apart (a shared token, no credentials) leaves it
empty. Read it with :func:`node_of`."""


def node_of(connection: bytes) -> bytes | None:
    """The authenticated node a connection belongs to, or None where only the connection is known."""
    size = connection[0] if connection else 0
    return connection[1 : 1 + size] if size and len(connection) > size else None


def with_node(node: bytes, rest: bytes) -> bytes:
    """A connection's bytes naming ``node`` (b"": none) before ``rest``; see :data:`ConnectionHandler`."""
    if len(node) > 255:
        raise ValueError(f"a node name is at most 255 bytes, got {len(node)}")
    return bytes([len(node)]) + node + rest


class ControlChannel(Protocol):
    @property
    def endpoint(self) -> str:
        """Where peers reach us, e.g. ``tcp://10.0.0.1:32100``."""

    def serve(self, handler: Handler) -> None:
        """Start answering requests with ``handler``.

        Raises:
            TransportError: the endpoint could not be bound.
        """

    def serve_connections(self, handler: ConnectionHandler) -> None:
        """Like ``serve``, with the connection each frame came over passed to ``handler``.

        Raises:
            TransportError: the endpoint could not be bound.
        """

    def request(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        """Send ``payload`` to ``endpoint`` and return its reply.

        Raises:
            PeerUnavailable: the peer cannot be reached (or refused our credentials).
            ControlTimeout: no reply within ``timeout_s``.
            PeerRefused: the peer's handler failed.
        """

    def send(self, endpoint: str, payload: bytes) -> None:
        """Send a one-way message; never blocks and never raises (best effort: it may be dropped)."""

    def forget(self, endpoint: str) -> None:
        """Close every connection to ``endpoint`` (its link was evicted or the peer went away)."""

    def close(self) -> None:
        """Stop serving and drop connections."""


@runtime_checkable
class NodeAdmission(Protocol):
    """Optional: a channel that knows nodes by their own keys can say whether one is still admitted.

    Other links a node opened (the same-host plane's side links) follow it: a node revoked on the
    channel loses them too (see ``BoundSideLinks``).
    """

    def node_admitted(self, node: bytes) -> bool:
        """Whether ``node`` (as :func:`node_of` names it) may still be served; b"" (no node known): True."""
