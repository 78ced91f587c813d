"""A target's link to one source: its endpoint and region table, and how the link begins and ends.

A link begins with a handshake: the target posts the receive for the WELCOME, sends HELLO (its
name, incarnation and worker address, so the source can make an endpoint back), and waits for
the source's WELCOME, which carries the source's incarnation. It ends when the target drops it
(BYE, :meth:`UcxDataPlane.disconnect`), when UCX fails its endpoint (the close callback marks it
dead), or when the source closes and says GONE (:func:`farewells`).

The links themselves sit in the data plane's table, under its lock. Nothing here takes that
lock: ``mark_dead`` runs on whichever thread progressed, and the handshake waits outside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcr.adapters.ucx import wire
from kvcr.adapters.ucx.binding import STATUS_OK, Binding
from kvcr.ports.dataplane import PeerInfo


@dataclass(slots=True)
class Link:
    name: str
    description: bytes
    nonce: int
    address: bytes
    endpoint: Any
    regions: dict[int, wire.RegionWire]
    info: PeerInfo
    dead: list[bool] = field(default_factory=lambda: [False])  # set by UCX's close callback


def mark_dead(dead: list[bool]) -> None:
    """UCX's close callback (on whichever thread progressed): only flag it, take no lock."""
    dead[0] = True


@dataclass(slots=True)
class Handshake:
    """A HELLO sent and the receive posted for its WELCOME, with the buffers both use."""

    answer: Any  # the WELCOME's receive
    sent: Any  # the HELLO's send: until it completes, a zero-copy send still reads ``hello``
    welcome: bytearray
    hello: bytearray

    @classmethod
    def post(cls, binding: Binding, endpoint: Any, hello: wire.Hello) -> Handshake:
        """Post the receive for the WELCOME first, then send ``hello``; raises what UCX raised."""
        welcome = bytearray(wire.WELCOME_BYTES)
        payload = bytearray(wire.ENCODER.encode(hello))
        answer = endpoint.tag_recv(binding.array(welcome), binding.tag(wire.welcome_tag(hello.hello_id)))
        sent = endpoint.tag_send(binding.array(payload), binding.tag(wire.HELLO))
        return cls(answer, sent, welcome, payload)

    def outcome(self, binding: Binding, worker: Any, timeout_s: float, dead: list[bool], nonce: int) -> str:
        """Wait up to ``timeout_s`` for the WELCOME, progressing ``worker`` (no lock held).

        Returns why the source is unreachable, or "" when it answered as incarnation ``nonce``.
        A WELCOME not come is cancelled.
        """
        answer = self.answer
        deadline = time.monotonic() + timeout_s
        spins = 0
        while not answer.completed and time.monotonic() < deadline and not dead[0]:
            worker.progress()
            spins += 1
            if spins > 64:
                time.sleep(200e-6)
        if not answer.completed:
            binding.cancel(answer)
            return "its endpoint failed" if dead[0] else f"no WELCOME within {timeout_s:.1f}s"
        if answer.status != STATUS_OK:
            return f"its WELCOME failed (status {answer.status})"
        if wire.unpack_welcome(bytes(self.welcome)) != nonce:
            return "it restarted since this description was made"
        return ""


def farewells(binding: Binding, worker: Any, heard: Callable[[wire.Bye], None]) -> bool:
    """Take the GONE messages sources sent when they closed, calling ``heard`` on each (it marks
    the link dead, under the data plane's lock, so its reads fail at once); True if any came."""
    found = False
    tag, mask = binding.tag(wire.GONE), binding.mask(wire.KIND_MASK)
    while True:
        probe = worker.tag_probe(tag, mask, remove=True)
        if not probe.matched:
            return found
        found = True
        buffer = bytearray(max(probe.length, 1))
        receive = worker.tag_recv_with_handle(binding.array(buffer), probe)
        deadline = time.monotonic() + 0.1
        while not receive.completed and time.monotonic() < deadline:
            worker.progress()
        if not receive.completed or receive.status != STATUS_OK:
            binding.cancel(receive)
            continue
        try:
            gone = wire.decode_bye(bytes(buffer))
        except (ValueError, TypeError):
            continue
        heard(gone)
