"""The composition root: the only module that knows which adapter implements which port.

Build a runner (local tier only) or a node (runner + peer server and client), and the restorer an
engine integration calls (local then remote, with the hit query's prefetch leases), with::

    container = build_container(RunnerConfig(...), transport="nixl", control="zmq", node=NodeSettings(...))
    runner = container.runner()
    node = container.node()
    restorer = container.restorer()        # over the node; container.local_restorer() without one

Typed inputs are ``providers.Dependency(instance_of=...)``: a wrong type fails where it is passed
in, so nothing downstream re-checks it. Adapter choices (memory, clock, transport, control,
inventory) are names picked by ``providers.Selector`` over the string configuration. The
runner's inventory port is a name (``"none"``, ``"recording"``) or, to publish KV events, a
factory that wraps the container's KV-event publisher (a ZMQ PUB) in a sink::

    container = build_container(config, kv_events=KvEventsSettings("tcp://127.0.0.1:5557"),
                                inventory=lambda publisher: SomeSink(publisher, ...))

Tests swap an adapter with ``container.memory.override(...)``. Adapter modules are imported by
the build functions below, only when their provider is first used. The ``mock`` transport
shares one in-process fabric per process (so two SGLang backends in one test process can reach
each other); ``container.fabric.override(MockFabric())`` isolates a test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dependency_injector import containers, providers

from kvcr.domain.transports import SHARES_MEMORY, Transport
from kvcr.runner.config import RunnerConfig
from kvcr.runner.node import HostRegions, NodeSettings, RunnerNode, expose_arenas, make_peer_client, make_staging_pool
from kvcr.runner.peer_server import PeerServer
from kvcr.runner.prefetch import PrefetchBook
from kvcr.runner.restore import Restorer
from kvcr.runner.runner import KvcrRunner

if TYPE_CHECKING:
    from kvcr.adapters.mock import MockFabric
    from kvcr.ports.clock import Clock
    from kvcr.ports.control import ControlChannel
    from kvcr.ports.dataplane import DataPlane
    from kvcr.ports.inventory import InventorySink, KvEventPublisher
    from kvcr.ports.memory import HostMemory
    from kvcr.ports.metrics import Metrics


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    """Where the KV-event publisher binds, its topic, and the DP rank its batches carry."""

    endpoint: str
    topic: str = "kv-events"
    dp_rank: int | None = 0


InventoryFactory = Callable[["KvEventPublisher"], "InventorySink"]
"""Builds the runner's inventory sink around the container's KV-event publisher."""


def _mmap_memory(config: RunnerConfig) -> HostMemory:
    from kvcr.adapters.local import MmapHostMemory

    return MmapHostMemory(page_digest=config.page_digest)


def _shared_memory(config: RunnerConfig) -> HostMemory:
    from kvcr.adapters.local import MmapHostMemory

    return MmapHostMemory(shared=True, page_digest=config.page_digest)


def _mock_memory(config: RunnerConfig) -> HostMemory:
    from kvcr.adapters.mock import MockHostMemory

    return MockHostMemory(page_digest=config.page_digest)


def _monotonic_clock() -> Clock:
    from kvcr.adapters.local import MonotonicClock

    return MonotonicClock()


def _fake_clock() -> Clock:
    from kvcr.adapters.mock import FakeClock

    return FakeClock()


def _memory_metrics(strict: bool) -> Metrics:
    from kvcr.adapters.local import InMemoryMetrics

    return InMemoryMetrics(strict=strict)


def _prometheus_metrics() -> Metrics:
    from prometheus_client import CollectorRegistry

    from kvcr.adapters.prometheus import PrometheusMetrics

    return PrometheusMetrics(CollectorRegistry())


def _engine_metrics() -> Metrics:
    from kvcr.adapters.prometheus import engine_metrics

    metrics = engine_metrics(True)
    assert metrics is not None  # enabled=True always gives this process's metrics
    return metrics


def _null_inventory() -> InventorySink:
    from kvcr.adapters.local import NullInventory

    return NullInventory()


def _recording_inventory() -> InventorySink:
    from kvcr.adapters.local import RecordingInventory

    return RecordingInventory()


def _zmq_event_publisher(settings: KvEventsSettings) -> KvEventPublisher:
    from kvcr.adapters.zmq import ZmqEventPublisher

    return ZmqEventPublisher(settings.endpoint, settings.topic, settings.dp_rank)


def _event_inventory(factory: InventoryFactory, publisher: KvEventPublisher) -> InventorySink:
    return factory(publisher)


_FABRIC_LOCK = threading.Lock()
_FABRIC: list[MockFabric] = []


def _shared_fabric() -> MockFabric:
    """One in-process fabric per process for the ``mock`` transport."""
    from kvcr.adapters.mock import MockFabric

    with _FABRIC_LOCK:
        if not _FABRIC:
            _FABRIC.append(MockFabric())
        return _FABRIC[0]


def _mock_data_plane(fabric: MockFabric, config: RunnerConfig, clock: Clock) -> DataPlane:
    from kvcr.adapters.mock import MockDataPlane

    return MockDataPlane(fabric, config.name, clock)


def _nixl_data_plane(config: RunnerConfig) -> DataPlane:
    from kvcr.adapters.nixl import NixlDataPlane

    return NixlDataPlane(config.name)


def _shm_data_plane(config: RunnerConfig, memory: HostMemory) -> DataPlane:
    from kvcr.adapters.shm import ShmDataPlane
    from kvcr.ports.errors import TransportError
    from kvcr.ports.memory import SharesMemory

    if not isinstance(memory, SharesMemory) or not getattr(memory, "shared", False):
        raise TransportError("transport shm/auto needs shared host memory (memory: shared)")
    return ShmDataPlane(config.name, memory)


def _auto_data_plane(config: RunnerConfig, memory: HostMemory) -> DataPlane:
    from kvcr.adapters.shm import SameHostFirst

    return SameHostFirst(_shm_data_plane(config, memory), _nixl_data_plane(config))


def _ucx_data_plane(config: RunnerConfig) -> DataPlane:
    from kvcr.adapters.ucx import UcxDataPlane

    # A source that has not answered a read by the operation deadline never will in time.
    timing = config.timing
    # peer: a source that dies mid-read fails the read; with none, UCX aborts the target (docs/ucx.md).
    return UcxDataPlane(
        config.name,
        backend_params={"ucx_error_handling_mode": "peer"},
        connect_timeout_s=timing.connect_s,
        reply_timeout_s=timing.operation_s,
    )


def _mock_control(fabric: MockFabric, settings: NodeSettings, clock: Clock) -> ControlChannel:
    from kvcr.adapters.mock import MockControlChannel

    return MockControlChannel(fabric, settings.endpoint, clock)


def _zmq_control(settings: NodeSettings, metrics: Metrics) -> ControlChannel:
    from kvcr.adapters.zmq import ZmqControlChannel
    from kvcr.ports.metric_catalogue import MetricName, RefusalReason

    def refused(reason: str) -> None:
        metrics.increment(MetricName.PEER_REQUESTS_REFUSED, 1, {"reason": RefusalReason(reason)})

    return ZmqControlChannel(
        settings.control_host,
        settings.control_port,
        advertise_host=settings.advertise_host,
        token=settings.token,
        rotation_tokens=settings.rotation_tokens,
        node_secret_key=settings.node_secret_key,
        peer_directory_file=settings.peer_directory_file,
        allow_unauthenticated=settings.allow_unauthenticated,
        handshake_timeout_s=settings.handshake_timeout_s,
        # Sessions are bound to the control connection: it outlives the peer link that uses it, so
        # an idle link's next restore does not find its session gone (and say HELLO again).
        idle_close_s=settings.peer.link_idle_s + 30.0,
        on_refusal=refused,
    )


def _prefetch_book(node: RunnerNode, metrics: Metrics) -> PrefetchBook:
    return PrefetchBook(node.client, metrics)


def _restorer(node: RunnerNode, book: PrefetchBook, metrics: Metrics) -> Restorer:
    return Restorer(node.runner, node.client, book, metrics)


class Container(containers.DeclarativeContainer):
    """Providers for one runner; ``config`` holds adapter names and is strict (a missing name is an error)."""

    config = providers.Configuration(strict=True)
    runner_config = providers.Dependency(instance_of=RunnerConfig)
    node_settings = providers.Dependency(instance_of=NodeSettings)
    kv_events = providers.Dependency(instance_of=KvEventsSettings)
    inventory_factory: providers.Dependency[Any] = providers.Dependency()

    memory = providers.Selector(
        config.memory,
        mmap=providers.Singleton(_mmap_memory, runner_config),
        shared=providers.Singleton(_shared_memory, runner_config),
        mock=providers.Singleton(_mock_memory, runner_config),
    )
    clock = providers.Selector(
        config.clock,
        monotonic=providers.Singleton(_monotonic_clock),
        fake=providers.Singleton(_fake_clock),
    )
    # memory: kept in-process (stats pages); strict: the same, raising on an emission the
    # catalogue refuses (tests); prometheus: a registry a standalone process exports with
    # --metrics-port; engine: the engine's own /metrics (SGLang's multiprocess collection).
    metrics = providers.Selector(
        config.metrics,
        memory=providers.Singleton(_memory_metrics, False),
        strict=providers.Singleton(_memory_metrics, True),
        prometheus=providers.Singleton(_prometheus_metrics),
        engine=providers.Singleton(_engine_metrics),
    )
    kv_event_publisher = providers.Singleton(_zmq_event_publisher, kv_events)
    inventory = providers.Selector(
        config.inventory,
        none=providers.Singleton(_null_inventory),
        recording=providers.Singleton(_recording_inventory),
        kv_events=providers.Singleton(_event_inventory, inventory_factory, kv_event_publisher),
    )
    runner = providers.Singleton(
        KvcrRunner,
        runner_config,
        memory=memory,
        clock=clock,
        metrics=metrics,
        inventory=inventory,
    )
    fabric = providers.Singleton(_shared_fabric)
    data_plane = providers.Selector(
        config.transport,
        mock=providers.Singleton(_mock_data_plane, fabric, runner_config, clock),
        nixl=providers.Singleton(_nixl_data_plane, runner_config),
        ucx=providers.Singleton(_ucx_data_plane, runner_config),
        shm=providers.Singleton(_shm_data_plane, runner_config, memory),
        auto=providers.Singleton(_auto_data_plane, runner_config, memory),
    )
    control = providers.Selector(
        config.control,
        mock=providers.Singleton(_mock_control, fabric, node_settings, clock),
        zmq=providers.Singleton(_zmq_control, node_settings, metrics),
    )
    # The node's parts, in the order they register with the data plane: the arenas peers read
    # (exposed), the staging buffers, then the engine's host regions as the engine registers them.
    exposed_arenas = providers.Singleton(expose_arenas, runner, data_plane)
    peer_server = providers.Singleton(PeerServer, runner, data_plane, exposed_arenas, metrics)
    staging = providers.Singleton(make_staging_pool, memory, data_plane, node_settings)
    host_regions = providers.Singleton(HostRegions, runner, data_plane)
    peer_client = providers.Singleton(
        make_peer_client, runner, control, data_plane, memory, clock, metrics, node_settings, host_regions, staging
    )
    node = providers.Singleton(
        RunnerNode,
        runner,
        data_plane,
        control,
        server=peer_server,
        client=peer_client,
        staging=staging,
        host_regions=host_regions,
        settings=node_settings,
    )
    prefetch_book = providers.Singleton(_prefetch_book, node, metrics)
    restorer = providers.Singleton(_restorer, node, prefetch_book, metrics)
    local_restorer = providers.Singleton(Restorer, runner, None, None)


DEFAULTS = {
    "memory": "mmap",
    "clock": "monotonic",
    "inventory": "none",
    "transport": Transport.NIXL.value,
    "control": "zmq",
    "metrics": "memory",
}


def serve_engine_metrics(port: int) -> Any:
    """Serve this process's engine metrics (prometheus_client's default registry) on loopback ``port``.

    For a process that hosts SGLang's classes itself, without SGLang's HTTP server (the Dynamo
    worker's ``--metrics-port``); returns the running exporter (``.url``, ``.close()``).
    """
    from prometheus_client import REGISTRY

    from kvcr.adapters.prometheus import start_exporter

    return start_exporter(REGISTRY, port)


def build_container(
    runner_config: RunnerConfig,
    *,
    node: NodeSettings | None = None,
    kv_events: KvEventsSettings | KvEventPublisher | None = None,
    inventory: str | InventoryFactory | None = None,
    **choices: str,
) -> Container:
    """A container for ``runner_config``; ``choices`` pick adapters (memory, clock, transport,
    control); ``node`` is needed only to build a node.

    ``inventory`` is an adapter name or a factory around the KV-event publisher, which then
    needs ``kv_events``: where kvcr's own ZMQ publisher binds, or a publisher built elsewhere
    (an engine's own event stream).
    """
    container = Container()
    names: dict[str, object] = {**DEFAULTS, **choices}
    if names["transport"] in SHARES_MEMORY and "memory" not in choices:
        names["memory"] = "shared"  # a same-host peer maps the arenas: they live in sealed memfds
    container.runner_config.override(runner_config)
    if callable(inventory):
        if kv_events is None:
            raise TypeError("an inventory factory publishes KV events: kv_events settings are required")
        names["inventory"] = "kv_events"
        container.inventory_factory.override(providers.Object(inventory))
    elif inventory is not None:
        names["inventory"] = inventory
    if isinstance(kv_events, KvEventsSettings):
        container.kv_events.override(kv_events)
    elif kv_events is not None:
        container.kv_event_publisher.override(providers.Object(kv_events))
    if node is not None:
        container.node_settings.override(node)
    container.config.from_dict(names)
    return container
