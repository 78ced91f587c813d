"""A runner joined to the peer fabric: its data plane, control channel, server and client.

The node registers the runner's arenas (what peers read) and the engine's host regions (where
restores land) with the data plane once, serves the peer protocol on the control channel, and
closes in the only safe order: stop serving, wait until no lease or operation touches kvcr
memory, deregister, free.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcr.domain.errors import ConfigError
from kvcr.domain.hints import Endpoint
from kvcr.domain.layout import RegionDescriptor
from kvcr.ports.clock import Clock
from kvcr.ports.control import ControlChannel
from kvcr.ports.dataplane import DataPlane
from kvcr.ports.errors import TransportError
from kvcr.ports.metrics import Metrics
from kvcr.runner.peer_client import PeerClient, PeerSettings
from kvcr.runner.peer_server import PeerServer
from kvcr.runner.protocol import Codec
from kvcr.runner.runner import KvcrRunner

log = logging.getLogger(__name__)

_WILDCARD = frozenset({"*", "0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """Where this node's control server binds and how peers reach it; the cluster token."""

    control_host: str
    control_port: int
    advertise_host: str | None = None
    token: bytes | None = None
    peer: PeerSettings = field(default_factory=PeerSettings)

    def __post_init__(self) -> None:
        if not 0 < self.control_port < 65536:
            raise ConfigError(f"control_port must be in 1..65535, got {self.control_port}")
        if (self.advertise_host or self.control_host) in _WILDCARD:
            raise ConfigError(
                f"control_advertise_host must be a dialable address when control_host is {self.control_host!r}"
            )

    @property
    def endpoint(self) -> str:
        """What peers dial (``tcp://advertise:port``)."""
        return str(Endpoint(self.advertise_host or self.control_host, self.control_port))


class RunnerNode:
    """One engine rank's kvcr: local tier, peer source and peer target."""

    def __init__(
        self,
        runner: KvcrRunner,
        data_plane: DataPlane,
        control: ControlChannel,
        *,
        token: bytes | None,
        clock: Clock,
        metrics: Metrics,
        settings: PeerSettings,
    ) -> None:
        self.runner = runner
        self.data_plane = data_plane
        self.control = control
        codec = Codec(token)
        self._host_labels: dict[str, tuple[RegionDescriptor, ...]] = {}
        self._lock = threading.Lock()
        self._closed = False
        data_plane.register(runner.arena_regions())
        self.server = PeerServer(runner, data_plane, codec, metrics)
        self.client = PeerClient(runner, control, data_plane, codec, clock, metrics, settings)
        control.serve(self.server.handle)

    @property
    def endpoint(self) -> str:
        return self.control.endpoint

    def register_host_pool(self, pool: str, regions: Sequence[RegionDescriptor]) -> tuple[RegionDescriptor, ...]:
        """Register an engine host pool with the runner and, once, with the data plane."""
        canonical = self.runner.register_host_pool(pool, regions)
        with self._lock:
            previous = self._host_labels.get(pool)
            if previous == canonical:
                return canonical
            if previous is not None:
                self.data_plane.deregister([r.label for r in previous])
            self.data_plane.register(canonical)
            self._host_labels[pool] = canonical
        return canonical

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.control.close()  # no new leases from here on

        def deregister() -> None:
            try:
                self.data_plane.close()
            except TransportError as exc:
                log.error("data plane did not close cleanly: %s", exc)

        self.runner.close(on_quiescent=deregister)
