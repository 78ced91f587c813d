"""Receiving a backend's KV events: a SUB per endpoint, the wait for it to attach, one batch at a time.

Shared by the SGLang start-up tests and the Dynamo event tests, which watch the same publisher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq


def subscribers() -> Iterator[Callable[[str], zmq.Socket[bytes]]]:
    """The body of a ``sub`` fixture: ``sub(endpoint)`` gives a SUB on every topic; all closed after."""
    context = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []

    def connect(endpoint: str) -> zmq.Socket[bytes]:
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close(linger=0)
    context.term()


def subscribed(store: Any, sock: zmq.Socket[bytes], timeout_s: float = 5.0) -> bool:
    """Wait until ``store``'s publisher sees ``sock`` (polling keeps the SUB's handshake moving)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.poll(20)
        if store.kv_events.publisher.wait_for_subscriber(0):
            return True
    return False


def next_batch(sock: zmq.Socket[bytes], timeout_s: float = 5.0) -> tuple[bytes, int, Any]:
    """The next (topic, sequence number, decoded payload) on ``sock``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            topic, seq, payload = sock.recv_multipart()
            return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)
    raise AssertionError("no KV event batch arrived")
