"""A ControlChannel over the in-process fabric.

Requests are delivered to the handler the peer registered with ``serve``; the handler runs in
the caller's thread (the fake has no sockets to wait on). Each client channel is one connection to
each peer (its endpoint names it), as a ZMQ channel keeps one connection per peer. Faults model this endpoint as a
server (see :class:`ControlFaults`) and are constructor arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcr.adapters.mock.fabric import ControlFaults, MockFabric
from kvcr.adapters.mock.intercept import Interceptable
from kvcr.ports.clock import Clock
from kvcr.ports.control import ConnectionHandler, Handler, with_node
from kvcr.ports.errors import ControlTimeout, PeerRefused, PeerUnavailable, TransportError


class MockControlChannel(Interceptable):
    INTERCEPTABLE = frozenset({"request", "send", "forget", "close"})

    def __init__(self, fabric: MockFabric, endpoint: str, clock: Clock, faults: ControlFaults | None = None) -> None:
        self._fabric = fabric
        self._endpoint = endpoint
        self._clock = clock
        self._closed = False
        with fabric.lock:
            fabric.node(endpoint).control_faults = faults or ControlFaults()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def requests_served(self) -> int:
        return self._fabric.node(self._endpoint).served

    def set_faults(self, faults: ControlFaults) -> None:
        with self._fabric.lock:
            self._fabric.node(self._endpoint).control_faults = faults

    def serve(self, handler: Handler) -> None:
        self.serve_connections(lambda payload, _connection: handler(payload))

    def serve_connections(self, handler: ConnectionHandler) -> None:
        if self._closed:
            raise TransportError(f"control channel {self._endpoint!r} is closed")
        node = self._fabric.node(self._endpoint)
        with self._fabric.lock:
            if node.control_up and node.handler is not None:
                raise TransportError(f"endpoint {self._endpoint!r} is already served")
            node.handler = handler
            node.control_up = True

    def request(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        if self._closed:
            raise TransportError(f"control channel {self._endpoint!r} is closed")
        with self._fabric.lock:
            node = self._fabric.find(endpoint)
            handler = node.handler if node is not None and node.control_up else None
            faults = node.control_faults if node is not None else ControlFaults()
        if handler is None or faults.down:
            raise PeerUnavailable(f"nothing answers at {endpoint}")
        if faults.stall:
            self._clock.sleep(timeout_s)
            raise ControlTimeout(f"{endpoint} did not answer within {timeout_s:g}s")
        if faults.garble:
            return b"\x00garbled\xff"
        reply = handler(bytes(payload), with_node(b"", self._endpoint.encode()))
        with self._fabric.lock:
            if node is not None:
                node.served += 1
        if reply is None:
            raise PeerRefused(f"{endpoint} sent no reply to a request")
        return reply

    def send(self, endpoint: str, payload: bytes) -> None:
        if self._closed:
            return
        with self._fabric.lock:
            node = self._fabric.find(endpoint)
            handler = node.handler if node is not None and node.control_up else None
            faults = node.control_faults if node is not None else ControlFaults()
        if handler is None or faults.down or faults.stall or faults.garble:
            return  # one-way messages are best effort: a dead or stalled peer just loses them
        handler(bytes(payload), with_node(b"", self._endpoint.encode()))
        with self._fabric.lock:
            if node is not None:
                node.served += 1

    def forget(self, endpoint: str) -> None:
        del endpoint  # the fake keeps no connections

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._fabric.lock:
            node = self._fabric.find(self._endpoint)
            if node is not None:
                node.control_up = False
                node.handler = None


if TYPE_CHECKING:
    from kvcr.adapters.mock.clock import FakeClock
    from kvcr.ports.control import ControlChannel

    _: ControlChannel = MockControlChannel(MockFabric(), "tcp://127.0.0.1:1", FakeClock())
