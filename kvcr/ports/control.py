"""ControlChannel: request/reply and one-way messages between peer runners.

Call order: ``serve(handler)`` once to answer requests on our endpoint (the handler runs on the
channel's own thread, so an idle engine still answers); ``request`` and ``send`` any number of
times to peers' endpoints; ``forget`` a peer whose link is closed; ``close`` once. Payloads are
opaque bytes: the peer protocol encodes and checks them.

Security belongs to the channel: an adapter configured with cluster credentials authenticates
and encrypts every connection, and a peer without them never reaches the handler (it sees
PeerUnavailable). The handler therefore only ever sees frames from authenticated peers, or from
anyone when the channel runs without credentials (loopback only, or an operator's explicit opt-in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Handler = Callable[[bytes], bytes | None]
"""Answers one request frame; returns the reply, or None for a one-way message (nothing is sent)."""


class ControlChannel(Protocol):
    @property
    def endpoint(self) -> str:
        """Where peers reach us, e.g. ``tcp://10.0.0.1:32100``."""

    def serve(self, handler: Handler) -> None:
        """Start answering requests with ``handler``.

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
