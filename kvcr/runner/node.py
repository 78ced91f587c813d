"""A runner joined to the peer fabric: its data plane, control channel, server and client.

The node registers the runner's arenas with the data plane as *exposed* (what peers may read)
and the engine's host regions as *private* (where our reads land, never described to anyone),
serves the peer protocol on the control channel, and closes in the only safe order: refuse new
leases, give peers a bounded moment to release theirs (the control channel still takes their
RELEASEs), stop serving, wait until nothing of ours touches kvcr memory, deregister, free.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcr.domain.endpoints import WILDCARD_HOSTS
from kvcr.domain.errors import ConfigError, KvcrError
from kvcr.domain.hints import Endpoint
from kvcr.domain.layout import RegionDescriptor
from kvcr.ports.clock import Clock
from kvcr.ports.control import ControlChannel, NodeAdmission
from kvcr.ports.dataplane import BoundSideLinks, DataPlane
from kvcr.ports.errors import TransportError
from kvcr.ports.memory import HostMemory
from kvcr.ports.metrics import Metrics
from kvcr.runner.peer_client import LANDINGS, PeerClient, PeerSettings
from kvcr.runner.peer_server import PeerServer
from kvcr.runner.runner import KvcrRunner
from kvcr.runner.staging import StagingPool

log = logging.getLogger(__name__)

_WILDCARD = WILDCARD_HOSTS | {""}  # an empty advertise host names no host either


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); wildcards are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """Where this node's control server binds and how peers reach it; the cluster credentials.

    Without a ``token`` the control channel is unauthenticated: anyone who reaches the port gets
    the data-plane description and leases. That is allowed on loopback; binding anything else
    without a token needs ``allow_unauthenticated`` (the operator accepts it, with a warning).
    """

    control_host: str
    control_port: int
    advertise_host: str | None = None
    token: bytes | None = None
    rotation_tokens: tuple[bytes, ...] = ()
    node_secret_key: bytes | None = None  # per-node identities instead of a token: this node's own key
    peer_directory_file: str | None = None  # ... and the file listing every node's key and endpoint
    allow_unauthenticated: bool = False
    peer: PeerSettings = field(default_factory=PeerSettings)
    close_lease_wait_s: float = 2.0
    handshake_timeout_s: float = 2.0  # a connection to our control port that has not completed its handshake is closed

    def __post_init__(self) -> None:
        if not 0 < self.control_port < 65536:
            raise ConfigError(f"control_port must be in 1..65535, got {self.control_port}")
        if (self.advertise_host or self.control_host) in _WILDCARD:
            raise ConfigError(
                f"control_advertise_host must be a dialable address when control_host is {self.control_host!r}"
            )
        authenticated = self.token is not None or self.node_secret_key is not None
        if not authenticated and not is_loopback(self.control_host) and not self.allow_unauthenticated:
            raise ConfigError(
                f"control_host {self.control_host!r} is not loopback and neither auth_token_file nor "
                "node_key_file is set: any process that reaches it could read kvcr DRAM. Set one of them "
                "(recommended), or allow_unauthenticated: true to accept that"
            )
        if self.peer.landing not in LANDINGS:
            raise ConfigError(f"landing must be one of {', '.join(LANDINGS)}, got {self.peer.landing!r}")
        if self.peer.max_pages_per_read <= 0:
            raise ConfigError(f"read_batch_pages must be positive, got {self.peer.max_pages_per_read}")

    @property
    def endpoint(self) -> str:
        """What peers dial (``tcp://advertise:port``)."""
        return str(Endpoint(self.advertise_host or self.control_host, self.control_port))


class HostRegions:
    """The engine's host regions, registered *privately* with the data plane, once per layout.

    Reads land there; they are never described to a peer. The peer client asks for a pool's ids
    through :meth:`ids` (empty until the engine registered the pool).
    """

    def __init__(self, runner: KvcrRunner, data_plane: DataPlane) -> None:
        self._runner = runner
        self._data_plane = data_plane
        self._lock = threading.Lock()
        self._ids: dict[str, tuple[tuple[RegionDescriptor, ...], tuple[int, ...]]] = {}

    def ids(self, pool: str) -> tuple[int, ...]:
        """The data-plane ids of ``pool``'s host regions (LayoutError-free: empty when unregistered)."""
        with self._lock:
            entry = self._ids.get(pool)
        return entry[1] if entry is not None else ()

    def register(self, pool: str, regions: Sequence[RegionDescriptor]) -> tuple[RegionDescriptor, ...]:
        """Register an engine host pool with the runner and, once per layout, with the data plane."""
        canonical = self._runner.register_host_pool(pool, regions)
        with self._lock:
            previous = self._ids.get(pool)
            if previous is not None and previous[0] == canonical:
                return canonical
            if previous is not None:
                self._data_plane.deregister(previous[1])
            self._ids[pool] = (canonical, self._data_plane.register(canonical, exposed=False))
        return canonical


def expose_arenas(runner: KvcrRunner, data_plane: DataPlane) -> dict[str, tuple[int, ...]]:
    """Register every pool's arena with the data plane as *exposed*: what peers may read."""
    return {pool: data_plane.register(regions, exposed=True) for pool, regions in runner.pool_arenas().items()}


def make_staging_pool(memory: HostMemory, data_plane: DataPlane, settings: NodeSettings) -> StagingPool:
    """The bounce buffers a staged read lands in (sized by the peer settings)."""
    return StagingPool(memory, data_plane, settings.peer.max_pages_per_read, settings.peer.staging_buffers)


def make_peer_client(
    runner: KvcrRunner,
    control: ControlChannel,
    data_plane: DataPlane,
    memory: HostMemory,
    clock: Clock,
    metrics: Metrics,
    settings: NodeSettings,
    host_regions: HostRegions,
    staging: StagingPool,
) -> PeerClient:
    """The target side: reads peers' leased pages into the host regions ``host_regions`` knows."""
    return PeerClient(runner, control, data_plane, memory, clock, metrics, settings.peer, host_regions.ids, staging)


class RunnerNode:
    """One engine rank's kvcr: local tier, peer source and peer target, served and closed together.

    Its parts are built by the composition root (``kvcr.container``); the node starts serving
    the peer protocol and owns the close order.
    """

    def __init__(
        self,
        runner: KvcrRunner,
        data_plane: DataPlane,
        control: ControlChannel,
        *,
        server: PeerServer,
        client: PeerClient,
        staging: StagingPool,
        host_regions: HostRegions,
        settings: NodeSettings,
    ) -> None:
        self.runner = runner
        self.data_plane = data_plane
        self.control = control
        self.server = server
        self.client = client
        self.staging = staging
        self.host_regions = host_regions
        self.settings = settings
        self._lock = threading.Lock()
        self._closed = False
        if isinstance(data_plane, BoundSideLinks) and isinstance(control, NodeAdmission):
            data_plane.admit_side(control.node_admitted)  # a node revoked on the channel loses its side links
        try:
            control.serve_connections(self.server.handle)
        except BaseException:
            self.close()  # a port in use: free the arenas, registrations and sockets made so far
            raise

    @property
    def endpoint(self) -> str:
        return self.control.endpoint

    def register_host_pool(self, pool: str, regions: Sequence[RegionDescriptor]) -> tuple[RegionDescriptor, ...]:
        """Register an engine host pool with the runner and, once, privately with the data plane."""
        return self.host_regions.register(pool, regions)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.server.close_to_new_work()
        self.runner.stop_leasing()
        left = self.runner.wait_for_leases(self.settings.close_lease_wait_s)
        if left:
            log.info("kvcr: closing with %d peer leases still live; their pages are never reused", left)
        self.client.reap()  # reads that ended after all release their handles before the data plane closes
        self.client.close()
        self.control.close()

        def deregister() -> None:
            try:
                self.staging.close()
                self.data_plane.close()
            except (TransportError, KvcrError) as exc:
                log.error("kvcr: data plane did not close cleanly (memory stays registered): %s", exc)

        self.runner.close(on_quiescent=deregister)
