"""Socket helpers shared by the control channel and the KV-event publisher."""

from __future__ import annotations

import time
from typing import Any

from kvcr.domain.endpoints import WILDCARD_HOSTS, bracketed
from kvcr.ports.errors import AddressInUse, TransportError


def zmq_address(host: str, port: int) -> str:
    """The ZMQ address to bind ``host:port`` (wildcards become ``*``, IPv6 hosts get brackets)."""
    return f"tcp://{'*' if host in WILDCARD_HOSTS else bracketed(host)}:{port}"


def bind_with_retry(zmq: Any, sock: Any, address: str, retry_s: float, what: str) -> None:
    """Bind, retrying EADDRINUSE for ``retry_s`` (a just-closed socket frees its port asynchronously).

    Raises:
        TransportError: the address could not be bound; the message names ``what`` and the address.
    """
    give_up = time.monotonic() + retry_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EADDRINUSE and time.monotonic() < give_up:
                time.sleep(0.02)
                continue
            error = AddressInUse if exc.errno == zmq.EADDRINUSE else TransportError
            raise error(f"cannot bind {what} {address}: {exc}") from exc
