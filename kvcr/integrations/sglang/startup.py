"""Start one rank's kvcr from SGLang's storage config, kvcr's settings and the registered host pools.

Everything SGLang-specific about composition lives here: the rank's place (including the DP
replica index SGLang does not hand storage under pure DP), which pools are replicated (MLA KV)
and which TP-sharded (Mamba state), the namespace, the runner and node settings, and the KV-event
sink. The node itself is built by the composition root.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcr import __version__
from kvcr.container import InventoryFactory, KvEventsSettings, build_container
from kvcr.domain.endpoints import bracketed, split_host_port
from kvcr.domain.errors import ConfigError, LayoutError
from kvcr.domain.hints import Endpoint
from kvcr.domain.keys import NamespaceSpec
from kvcr.domain.pools import HitPolicy
from kvcr.domain.topology import RankLayout
from kvcr.domain.transports import Transport
from kvcr.integrations.sglang import hook_points
from kvcr.integrations.sglang.engine_events import EngineEventStream, engine_publishes_events
from kvcr.integrations.sglang.pools import DescribedPool, describe_host_pool
from kvcr.integrations.shared.kv_events import DynamoInventorySink
from kvcr.integrations.shared.page_tokens import default_registry
from kvcr.integrations.shared.settings import KvcrSettings
from kvcr.ports.errors import AddressInUse
from kvcr.ports.inventory import KvEventPublisher
from kvcr.ports.metric_catalogue import MetricName
from kvcr.ports.metrics import Metrics
from kvcr.runner.config import RunnerConfig
from kvcr.runner.node import NodeSettings, RunnerNode
from kvcr.runner.peer_client import PeerSettings
from kvcr.runner.restore import Restorer
from kvcr.runner.runner import KvcrRunner

log = logging.getLogger(__name__)

KV = "kv"
SHARDED_POOLS = frozenset({"mamba"})  # TP-sharded state next to replicated MLA KV (Mamba, KDA)
TRAILING_POOLS = frozenset({"mamba", "swa", "auxiliary_swa", "draft_swa"})  # checkpoints: a window suffices


def hit_policy(pool: str) -> HitPolicy:
    """How a pool's pages must be present for a prefix (SGLang names state and window pools)."""
    if pool in TRAILING_POOLS or pool.endswith("_state"):
        return HitPolicy.TRAILING_PAGES
    return HitPolicy.ALL_PAGES


def rank_layout(config: Any) -> RankLayout:
    """This rank's TP/CP coordinates and its DP replica index."""
    return RankLayout(
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        cp_rank=config.attn_cp_rank,
        cp_size=max(1, config.attn_cp_size),
        dp_rank=dp_index(config),
    )


def data_plane(settings: KvcrSettings) -> str:
    """The transport to build: ``auto`` without same-host sharing is NIXL alone."""
    if settings.transport == Transport.AUTO.value and not settings.same_host_shm:
        return Transport.NIXL.value
    return settings.transport


def control_plane(transport: str) -> str:
    """The control channel a data plane pairs with: the in-process fabric's own for ``mock``, ZMQ
    (CURVE when a token is set) for every data plane that reaches another process."""
    return "mock" if transport == Transport.MOCK.value else "zmq"


def dp_index(config: Any) -> int:
    """Which DP replica (or attention-DP group) this rank belongs to.

    SGLang sets ``dp_rank`` only under DP attention; under pure DP every replica sees 0 and the
    replica index lives in SGLang's parallel context (``dp_rank``, or ``SGLANG_DP_RANK`` when the
    context has not published it). Both combine: replica * attention-DP groups + group. Each
    field is read on its own: SGLang raises on a name not yet published, and one missing field
    must not discard the other.
    """
    replica = _parallel_field("dp_rank", unpublished=os.environ.get("SGLANG_DP_RANK", "0"))
    groups = _parallel_field("attn_dp_size", unpublished=1)
    return int(replica or 0) * int(groups or 1) + int(config.dp_rank)


def _parallel_field(name: str, *, unpublished: Any) -> Any:
    """``name`` from SGLang's parallel context, or ``unpublished`` (no context, or not published yet)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return getattr(get_parallel(), name)
    except Exception:  # SGLang raises RuntimeError / ValueError for unpublished names; tools run without it
        return unpublished


def replicated(pool: str, config: Any) -> bool:
    """Whether ``pool``'s bytes are identical on every TP rank (MLA KV and its companions)."""
    return bool(config.is_mla_model) and pool not in SHARDED_POOLS


def check_topology(config: Any, settings: KvcrSettings) -> None:
    """Refuse, at construction, what kvcr cannot serve correctly; each message names what to change."""
    if config.pp_size > 1:
        raise ConfigError(
            "kvcr refuses pipeline parallelism (pp_size > 1): storage keys carry no stage identity, so a "
            "peer could serve another stage's KV"
        )
    if config.should_split_heads:
        raise ConfigError(
            "kvcr refuses heterogeneous TP head splitting: a peer's shard would not match this rank's heads"
        )
    if getattr(config, "dcp_size", 1) > 1:  # SGLang 0.5.23 added decode CP; 0.5.22 has no such field
        raise ConfigError("kvcr does not support decode context parallelism (dcp_size > 1) yet")
    if config.attn_cp_size > 1:
        # Under DP attention SGLang hands storage the attention-TP rank, so rank 0 of every CP group
        # is a writer of the same rank-agnostic keys; and a CP strategy may leave each rank a slice
        # of a page (SGLang's own unified key scheme refuses CP for that reason). See docs/sglang.md.
        raise ConfigError(
            f"kvcr refuses attention context parallelism (--attn-cp-size {config.attn_cp_size}): SGLang does not "
            "tell storage whether a CP rank's pages are whole or its slice, so no shard identity could keep a "
            "peer from serving another rank's bytes; use --attn-cp-size 1"
        )
    if config.is_mla_model and config.tp_size > 1 and not settings.control_port:
        raise ConfigError(
            "MLA at TP > 1 needs control_port: only TP rank 0 backs up the replicated KV and the other ranks "
            "read it from rank 0's kvcr; with control_port 0 they could never hit. Set control_port "
            "(e.g. 32100)"
        )


@dataclass
class Started:
    """One rank's kvcr, running."""

    runner: KvcrRunner
    node: RunnerNode | None
    restorer: Restorer
    metrics: Metrics
    described: dict[str, DescribedPool]
    layout: RankLayout
    kv_events: DynamoInventorySink | None

    @property
    def page_size(self) -> int:
        return self.described[KV].page_size

    def close(self) -> None:
        try:
            if self.node is not None:
                self.node.close()
            else:
                self.runner.close()
        finally:
            if self.kv_events is not None:
                self.kv_events.close()  # the router forgets this replica's pages


def start(
    config: Any,
    settings: KvcrSettings,
    token: bytes | None,
    rotation: tuple[bytes, ...],
    host_pools: Mapping[str, Any],
    node_key: bytes | None = None,
) -> Started:
    """Describe the host pools, build the runner (and node), and register the pools with them."""
    if KV not in host_pools:
        raise LayoutError("no KV host pool was registered")
    layout = rank_layout(config)
    described = {
        name: _with_shard(
            describe_host_pool(name, pool, anchor=name == KV, hit_policy=hit_policy(name)), layout, config
        )
        for name, pool in host_pools.items()
    }
    anchor = described[KV]
    runner_config = RunnerConfig(
        # NIXL agent names must be unique across the cluster (and across backends in one process).
        name=f"kvcr-{socket.gethostname()}-{os.getpid()}-dp{layout.dp_rank}-r{layout.rank_offset}-{uuid.uuid4().hex[:8]}",
        namespace=NamespaceSpec(config.model_name or "unknown", anchor.page_size, anchor.dtype, anchor.layout),
        pools=tuple(d.spec for d in described.values()),
        dram_bytes=settings.dram_bytes,
        policy=settings.policy,
        timing=settings.timing(),
        verify_bytes=settings.verify_bytes,
        page_digest=settings.digest(),
        max_peer_leased_fraction=settings.peer_lease_share,
    )
    node_settings = None
    if settings.control_port:
        node_settings = NodeSettings(
            settings.control_host,
            layout.control_port(settings.control_port),
            advertise_host=settings.control_advertise_host,
            token=token,
            rotation_tokens=rotation,
            node_secret_key=node_key,
            peer_directory_file=settings.peer_directory_file,
            allow_unauthenticated=settings.allow_unauthenticated,
            handshake_timeout_s=settings.control_handshake_ms / 1000,
            peer=PeerSettings(
                max_pages_per_read=settings.read_batch_pages,
                landing=settings.landing,
                recompute_tokens_per_s=settings.recompute_tokens_per_s,
                tokens_per_page=anchor.page_size,
                max_links=settings.max_peer_links,
            ),
        )
    sink: list[DynamoInventorySink] = []
    kv_events, inventory = _kv_events(settings, layout, anchor.page_size, sink)
    control = control_plane(settings.transport)
    container = build_container(
        runner_config,
        node=node_settings,
        kv_events=kv_events,
        inventory=inventory,
        transport=data_plane(settings),
        control=control,
        # SGLang's switch: its --enable-metrics sets enable_storage_metrics and collects every
        # scheduler's series on its own /metrics; otherwise kvcr keeps them for kvcr_stats().
        metrics="engine" if getattr(config, "enable_storage_metrics", False) else "memory",
    )
    try:
        node: RunnerNode | None = _node(container, settings, layout) if node_settings is not None else None
        runner = node.runner if node is not None else container.runner()
        for name, d in described.items():
            if d.spec.physical:
                (node or runner).register_host_pool(name, d.regions)
    except BaseException:
        for published in sink:  # the publisher was bound: free its port for a retry
            published.close()
        raise
    metrics = container.metrics()
    metrics.set_gauge(MetricName.BUILD_INFO, 1, {"version": __version__, "transport": settings.transport})
    metrics.set_gauge(MetricName.HINT_HOOKS_MISSING, len(hook_points.missing_at_load()))
    restorer = container.restorer() if node is not None else container.local_restorer()
    if node is not None and settings.connect_ahead:
        offset = layout.source_offset(replicated(KV, config))  # this rank's port above a peer's rank 0
        peers = [str(Endpoint.parse(e).offset(offset)) for e in settings.connect_ahead]
        node.client.connect_ahead([peer for peer in peers if peer != node.endpoint])
    log.info(
        "kvcr started: namespace %s, pools %s, endpoint %s, kv events %s",
        runner.namespace,
        {n: d.spec.page_bytes for n, d in described.items()},
        node.endpoint if node is not None else "none (local only)",
        _shown_events(kv_events),
    )
    return Started(runner, node, restorer, metrics, described, layout, sink[0] if sink else None)


def _shown_events(kv_events: KvEventsSettings | KvEventPublisher | None) -> str:
    if kv_events is None:
        return "off"
    if isinstance(kv_events, KvEventsSettings):
        return kv_events.endpoint
    return "on SGLang's own KV-event stream"


def _node(container: Any, settings: KvcrSettings, layout: RankLayout) -> RunnerNode:
    """The rank's node; a control port someone else holds is a ConfigError that says which and what to do."""
    try:
        node: RunnerNode = container.node()
    except AddressInUse as exc:
        base = settings.control_port
        port = layout.control_port(base)
        raise ConfigError(
            f"control_port {base} + this rank's offset {port - base} = port {port} on "
            f"{settings.control_host} is in use by another process (another kvcr or SGLang server on this "
            f"host?): give each server its own control_port range ({exc})"
        ) from None
    return node


def _with_shard(described: DescribedPool, layout: RankLayout, config: Any) -> DescribedPool:
    spec = dataclasses.replace(described.spec, shard=layout.shard(replicated(described.spec.name, config)))
    return dataclasses.replace(described, spec=spec)


def _kv_events(
    settings: KvcrSettings, layout: RankLayout, page_size: int, sink: list[DynamoInventorySink]
) -> tuple[KvEventsSettings | KvEventPublisher | None, InventoryFactory | None]:
    """The KV-event publisher of this DP replica, if this rank publishes, and the sink around it.

    One publisher per DP replica, on its attention rank 0 (the rank that holds the replica's
    pages in every layout, and the rank a hint's endpoint names). With ``kv_events_endpoint``
    kvcr binds its own PUB there (DP replica ``d`` binds the configured port + ``d``, as SGLang's
    own KV-event publishers do); without it, and when SGLang publishes KV events on this rank,
    kvcr's events join SGLang's own stream (``engine_kv_events``), which is the one stream
    Dynamo's ``dynamo.sglang`` worker relays to its router.
    """
    endpoint = settings.kv_events_endpoint
    if layout.rank_offset != 0:
        return None, None
    if endpoint is None:
        if not (settings.engine_kv_events and engine_publishes_events()):
            return None, None
        return EngineEventStream(), _sink_factory(page_size, sink, shared_stream=True)
    if layout.dp_rank:
        split = split_host_port(endpoint.removeprefix("tcp://"))  # checked when the settings were parsed
        assert split is not None
        port = int(split.port) + layout.dp_rank
        if port > 65535:
            raise ConfigError(f"kv_events_endpoint port {split.port} + dp rank {layout.dp_rank} runs past 65535")
        endpoint = f"tcp://{bracketed(split.host) if split.bracketed else split.host}:{port}"
    return KvEventsSettings(endpoint, settings.kv_events_topic, layout.dp_rank), _sink_factory(page_size, sink)


def _sink_factory(page_size: int, sink: list[DynamoInventorySink], *, shared_stream: bool = False) -> InventoryFactory:
    registry = default_registry()
    registry.enable()  # the plugin's backup hook records page tokens from now on

    def factory(publisher: KvEventPublisher) -> DynamoInventorySink:
        sink.append(DynamoInventorySink(publisher, block_size=page_size, tokens=registry, shared_stream=shared_stream))
        return sink[-1]

    return factory
