"""ControlChannel: request/reply messages between peer runners.

Call order: ``serve(handler)`` once to answer requests on our endpoint (the handler runs on the
channel's own thread, so an idle engine still answers); ``request`` any number of times to a
peer's endpoint; ``close`` once. Payloads are opaque bytes: the peer protocol encodes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Handler = Callable[[bytes], bytes]


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
            PeerUnavailable: the peer cannot be reached.
            ControlTimeout: no reply within ``timeout_s``.
        """

    def close(self) -> None:
        """Stop serving and drop connections."""
