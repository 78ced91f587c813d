"""The in-process fabric: named endpoints that mock data planes and control channels reach.

An endpoint is *up* from registration until it closes or a test takes it down (``kill``),
which models a replica dying: its control server stops answering and reads from its memory
fail from then on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvcr.domain.layout import RegionDescriptor
from kvcr.ports.control import ConnectionHandler


@dataclass(frozen=True, slots=True)
class Faults:
    """Failures of reads served by an endpoint.

    peer_down: reads from it are refused (as if the process were gone).
    stall: its reads never complete on their own.
    error: its reads end FAILED without copying.
    partial_runs: copy only the first N runs, then end FAILED.
    corrupt: copy, then flip the first byte of every run, and report DONE.
    uncertain_cancel: a cancel cannot be confirmed (UNCERTAIN); the read may still land later,
        but a disconnect stops it (it then ends FAILED).
    late_writes: like uncertain_cancel, and not even a disconnect stops it (a transport that
        cannot fence a given-up read, e.g. emulated RMA over TCP); connect reports it.
    latency_s: time from post to completion on the injected clock.
    """

    peer_down: bool = False
    stall: bool = False
    error: bool = False
    partial_runs: int | None = None
    corrupt: bool = False
    uncertain_cancel: bool = False
    late_writes: bool = False
    latency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ControlFaults:
    """Failures of an endpoint's control server.

    down: refuses every request. stall: never answers (the requester waits out its timeout on
    the injected clock). garble: answers with junk bytes.
    """

    down: bool = False
    stall: bool = False
    garble: bool = False


@dataclass
class _Node:
    exposed: dict[int, RegionDescriptor] = field(default_factory=dict)
    private: dict[int, RegionDescriptor] = field(default_factory=dict)
    next_region: int = 1
    faults: Faults = Faults()
    control_faults: ControlFaults = ControlFaults()
    served: int = 0
    data_up: bool = False
    handler: ConnectionHandler | None = None
    control_up: bool = False
    incarnation: int = 0


class MockFabric:
    """Shared by every mock adapter of one test; thread-safe."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self.lock = threading.RLock()

    def node(self, name: str) -> _Node:
        with self.lock:
            return self._nodes.setdefault(name, _Node())

    def find(self, name: str) -> _Node | None:
        with self.lock:
            return self._nodes.get(name)

    def kill(self, name: str) -> None:
        """Take an endpoint down at once: no more replies, no more reads from its memory."""
        with self.lock:
            node = self._nodes.get(name)
            if node is not None:
                node.data_up = False
                node.control_up = False
                node.handler = None
                node.exposed.clear()
                node.private.clear()
