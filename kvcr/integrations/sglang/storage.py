"""KvcrHiCacheStorage: kvcr as SGLang 0.5.23's HiCache L3 storage backend.

SGLang loads it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvcr", "module_path": "kvcr.integrations.sglang",
"class_name": "KvcrHiCacheStorage", "interface_v1": 1, ...}``. It then calls
``register_mem_pool_host`` (the anchor KV pool), ``register_mem_host_pool_v2`` per pool and
``on_host_pools_registered``; the runner is built there, when the pool geometry is known.

Data calls (``batch_*``) never raise into SGLang: bad input or a transport failure is logged and
answered with misses. The one exception to "degrade, don't die" is a read into SGLang's host
pages that cannot be confirmed stopped (UNCERTAIN): the worker then terminates with a log line
saying why, because HiCache would hand those pages to the GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvcr.adapters.zmq.events import bind_address
from kvcr.container import InventoryFactory, KvEventsSettings, build_container
from kvcr.domain.boundaries import all_pages_boundaries, intersect, leading_run, trailing_boundaries
from kvcr.domain.deadlines import DeadlineBudget
from kvcr.domain.errors import ConfigError, KvcrError, LayoutError
from kvcr.domain.hints import Endpoint, FetchHint, parse_hint
from kvcr.domain.keys import ShardIdentity, router_id
from kvcr.domain.outcomes import Outcome, PageOutcome
from kvcr.domain.pools import HitPolicy
from kvcr.integrations.dynamo.events import DynamoInventorySink
from kvcr.integrations.dynamo.page_tokens import default_registry
from kvcr.integrations.sglang import hints_bridge
from kvcr.integrations.sglang.pools import DescribedPool, describe_host_pool, host_slots
from kvcr.integrations.sglang.settings import KvcrSettings, parse_settings
from kvcr.ports.inventory import KvEventPublisher
from kvcr.runner.config import RunnerConfig, namespace_for
from kvcr.runner.node import NodeSettings, RunnerNode
from kvcr.runner.peer_client import PeerSettings, PoolRead, RemoteLease
from kvcr.runner.runner import KvcrRunner

log = logging.getLogger(__name__)

KV = "kv"
FAIL_STOP_EXIT_CODE = 75
HINT_KEYS = ("kv_hints", "kvcr_router_hint")


def terminate_worker(reason: str) -> None:
    """Fail-stop: log why, flush, and end the process without unwinding into SGLang."""
    log.critical("kvcr: terminating this worker: %s", reason)
    logging.shutdown()
    os._exit(FAIL_STOP_EXIT_CODE)


@dataclass
class _Held:
    """A remote lease taken at hit-query time, waiting for the prefetch reads."""

    lease: RemoteLease
    pending: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class _Stats:
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _pool_name(name: Any) -> str:
    return str(getattr(name, "value", name))


class KvcrHiCacheStorage(HiCacheStorage):
    """The HiCache storage surface over one kvcr runner per TP rank."""

    # Tests replace this to observe fail-stop without ending the test process.
    terminate: Callable[[str], None] = staticmethod(terminate_worker)

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        del kwargs  # the factory passes its own kwargs dict (empty); nothing in it is for us
        self.storage_config = storage_config
        self.settings: KvcrSettings = parse_settings(storage_config.extra_config)
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            raise ConfigError(
                'kvcr needs the zero-copy interface: add "interface_v1": 1 to --hicache-storage-backend-extra-config'
            )
        self._check_topology(storage_config)
        if self.settings.transport == "ucx":
            raise ConfigError("transport 'ucx' is not built in this kvcr release; use 'nixl' (or 'mock' for tests)")
        self._token = self.settings.token()
        cp = max(1, storage_config.attn_cp_size)
        self.rank_offset = storage_config.tp_rank + storage_config.tp_size * storage_config.attn_cp_rank
        self.replicated = bool(storage_config.is_mla_model)
        # The rank whose kvcr holds this replica's pages: every rank for sharded KV, rank 0 of our
        # CP group for replicated (MLA) KV, where only the storage writer backs up.
        self.writer_offset = (
            storage_config.tp_size * storage_config.attn_cp_rank if self.replicated else self.rank_offset
        )
        replica_base = storage_config.dp_rank * storage_config.tp_size * cp
        self.control_port = (
            self.settings.control_port + replica_base + self.rank_offset if self.settings.control_port else 0
        )
        self._writer_port = self.settings.control_port + replica_base + self.writer_offset
        self._host_pools: dict[str, Any] = {}
        self._described: dict[str, DescribedPool] = {}
        self.runner: KvcrRunner | None = None
        self.node: RunnerNode | None = None
        self.kv_events: DynamoInventorySink | None = None
        self._held: dict[tuple[str, str], _Held] = {}
        self._hint_rejections: dict[str, int] = {}
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------ registration

    @staticmethod
    def _check_topology(config: HiCacheStorageConfig) -> None:
        if config.pp_size > 1:
            raise ConfigError(
                "kvcr refuses pipeline parallelism (pp_size > 1): storage keys carry no stage identity, so a "
                "peer could serve another stage's KV"
            )
        if config.should_split_heads:
            raise ConfigError(
                "kvcr refuses heterogeneous TP head splitting: a peer's shard would not match this rank's heads"
            )
        if config.dcp_size > 1:
            raise ConfigError("kvcr does not support decode context parallelism (dcp_size > 1) yet")

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._host_pools[KV] = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if self.runner is not None and name not in self._described:
            raise LayoutError(f"pool {name!r} arrived after start-up; kvcr sizes its arenas once")
        self._host_pools[name] = host_pool

    def on_host_pools_registered(self) -> None:
        self._start()

    def _start(self) -> None:
        with self._start_lock:
            if self.runner is not None:
                return
            if KV not in self._host_pools:
                raise LayoutError("no KV host pool was registered")
            described = {
                name: describe_host_pool(name, pool, anchor=name == KV, hit_policy=HitPolicy.ALL_PAGES)
                for name, pool in self._host_pools.items()
            }
            anchor = described[KV]
            pools = tuple(d.spec for d in described.values())
            config = self.storage_config
            shard = ShardIdentity(replicated=True) if self.replicated else ShardIdentity(config.tp_rank, config.tp_size)
            s = self.settings
            runner_config = RunnerConfig(
                # NIXL agent names must be unique across the cluster (and across backends in one process).
                name=f"kvcr-{socket.gethostname()}-{os.getpid()}-dp{config.dp_rank}-r{self.rank_offset}-"
                f"{uuid.uuid4().hex[:8]}",
                namespace=namespace_for(
                    config.model_name or "unknown", anchor.page_size, anchor.dtype, anchor.layout, pools, shard=shard
                ),
                pools=pools,
                dram_bytes=s.dram_bytes,
                policy=s.policy,
                budget=DeadlineBudget(s.operation_timeout_ms / 1000, s.abandon_timeout_ms / 1000),
                lease_s=s.lease_ms / 1000,
                lease_margin_s=min(0.5, s.lease_ms / 4000),
            )
            choices = {
                "memory": "mmap",
                "transport": s.transport,
                "control": "mock" if s.transport == "mock" else "zmq",
            }
            node_settings = None
            if self.control_port:
                node_settings = NodeSettings(
                    s.control_host,
                    self.control_port,
                    advertise_host=s.control_advertise_host,
                    token=self._token,
                    peer=PeerSettings(
                        operation_s=s.operation_timeout_ms / 1000,
                        abandon_s=s.abandon_timeout_ms / 1000,
                        lease_s=s.lease_ms / 1000,
                        lease_margin_s=runner_config.lease_margin_s,
                        verify_bytes=s.verify_bytes,
                        max_pages_per_read=s.read_batch_pages,
                    ),
                )
            kv_events, inventory = self._kv_events(anchor.page_size)
            container = build_container(
                runner_config, node=node_settings, kv_events=kv_events, inventory=inventory, **choices
            )
            if s.transport == "mock":
                container.fabric.override(_process_fabric())
            try:
                if node_settings is not None:
                    node = container.node()
                    for name, d in described.items():
                        if d.spec.physical:
                            node.register_host_pool(name, d.regions)
                    self.node = node
                    runner = node.runner
                else:
                    runner = container.runner()
                    for name, d in described.items():
                        if d.spec.physical:
                            runner.register_host_pool(name, d.regions)
            except BaseException:
                if self.kv_events is not None:  # the publisher was bound: free its port for a retry
                    self.kv_events.close()
                    self.kv_events = None
                raise
            self._described = described
            self.runner = runner
            log.info(
                "kvcr started: namespace %s, pools %s, endpoint %s, kv events %s",
                runner.namespace,
                {n: d.spec.page_bytes for n, d in described.items()},
                self.node.endpoint if self.node else "none (local only)",
                kv_events.endpoint if kv_events else "off",
            )

    def _kv_events(self, page_size: int) -> tuple[KvEventsSettings | None, InventoryFactory | None]:
        """The KV-event publisher of this DP replica, if configured and this rank publishes.

        One publisher per DP replica, on its attention rank 0 (the rank that holds the replica's
        pages in every layout, and the rank a hint's endpoint names); DP replica ``d`` binds the
        configured port + ``d``, as SGLang's own KV-event publishers do.
        """
        endpoint = self.settings.kv_events_endpoint
        if endpoint is None or self.rank_offset != 0:
            return None, None
        dp_rank = self.storage_config.dp_rank
        if dp_rank:
            host, port = bind_address(endpoint)
            if port + dp_rank > 65535:
                raise ConfigError(f"kv_events_endpoint port {port} + dp rank {dp_rank} runs past 65535")
            endpoint = f"tcp://{f'[{host}]' if ':' in host else host}:{port + dp_rank}"
        registry = default_registry()
        registry.enable()  # the plugin's backup hook records page tokens from now on

        def sink(publisher: KvEventPublisher) -> DynamoInventorySink:
            self.kv_events = DynamoInventorySink(publisher, block_size=page_size, tokens=registry)
            return self.kv_events

        return KvEventsSettings(endpoint, self.settings.kv_events_topic, dp_rank), sink

    def _ready(self) -> KvcrRunner:
        if self.runner is None:
            self._start()
        assert self.runner is not None
        return self.runner

    # ------------------------------------------------------------------ hints

    def _hint(self, extra_info: HiCacheStorageExtraInfo | None) -> FetchHint | None:
        raw = None
        if extra_info is not None and isinstance(extra_info.extra_info, Mapping):
            for key in HINT_KEYS:
                if key in extra_info.extra_info:
                    raw = extra_info.extra_info[key]
                    if key == "kvcr_router_hint":
                        raw = {key: raw}
                    break
        if raw is None:
            raw = hints_bridge.current()  # forwarded by kvcr's SGLang plugin
        if raw is None:
            return None
        if not isinstance(raw, (Mapping, str, bytes, bytearray)):
            raw = _to_builtins(raw)
        parsed = parse_hint(raw)
        if parsed.hint is None:
            reason = parsed.reason or "unusable"
            with self._lock:
                self._hint_rejections[reason] = self._hint_rejections.get(reason, 0) + 1
            log.info("kvcr: ignoring hint (%s); serving from local DRAM only", reason)
        return parsed.hint

    def _source(self, extra_info: HiCacheStorageExtraInfo | None) -> tuple[str, frozenset[int] | None] | None:
        """The peer to lease missing pages from, and the router ids it is said to hold (None: any)."""
        if self.node is None:
            return None
        if self.settings.enable_remote_hint:
            hint = self._hint(extra_info)
            if hint is not None:
                offset = self.writer_offset if self.replicated else self.rank_offset
                endpoint = str(hint.source.offset(offset))
                if endpoint != self.node.endpoint:
                    return endpoint, hint.block_hashes
        if self.replicated and self.writer_offset != self.rank_offset:
            # Replicated KV is backed up by our replica's writer rank only: read it from there.
            host = self.settings.control_advertise_host or self.settings.control_host
            return str(Endpoint(host, self._writer_port)), None
        return None

    # ------------------------------------------------------------------ queries

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            runner = self._ready()
            local = runner.query(KV, keys).prefix
            if local == len(keys):
                return local
            return local + self._lease_missing(keys[local:], [KV], extra_info)[0]
        except Exception:
            log.exception("kvcr batch_exists failed; answering with local hits only")
            return self._local_prefix(keys)

    def _local_prefix(self, keys: list[str]) -> int:
        try:
            return self.runner.query(KV, keys).prefix if self.runner else 0
        except Exception:
            return 0

    def _lease_missing(
        self,
        keys: Sequence[str],
        required: Sequence[str],
        extra_info: HiCacheStorageExtraInfo | None,
        optional: Sequence[str] = (),
    ) -> tuple[int, RemoteLease | None]:
        """Lease the leading pages of ``keys`` from the hinted (or writer) peer.

        A page counts only if the peer holds it in every ``required`` pool; ``optional`` pools
        (trailing windows) are leased where held. Returns the granted leading run and the lease,
        which stays held until the prefetch reads those pages (or it expires).
        """
        source = self._source(extra_info)
        if source is None or not keys:
            return 0, None
        endpoint, covered = source
        wanted = []
        for page in keys:
            if covered is not None and router_id(page) not in covered:
                break  # the hint names a prefix: past its end there is nothing to lease
            wanted.append(page)
        pools = [*required, *optional]
        assert self.node is not None
        lease = self.node.client.lease(endpoint, [(pool, page) for page in wanted for pool in pools])
        if lease is None:
            return 0, None
        granted = 0
        for page in wanted:
            if not all(lease.holds(pool, page) for pool in required):
                break
            granted += 1
        if granted == 0:
            self.node.client.release(lease)
            return 0, None
        held = _Held(lease, {(pool, page) for page in wanted[:granted] for pool in pools if lease.holds(pool, page)})
        with self._lock:
            self._sweep()
            for item in held.pending:
                self._held[item] = held
        return granted, lease

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        try:
            return self._exists_v2(keys, pool_transfers or [], extra_info)
        except Exception:
            log.exception("kvcr batch_exists_v2 failed; answering with no hits")
            return PoolTransferResult(0, {}, [])

    def _exists_v2(
        self, keys: list[str], transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None
    ) -> PoolTransferResult:
        runner = self._ready()
        kv_physical = self._described[KV].spec.physical
        policies: dict[str, tuple[PoolHitPolicy, int]] = {}
        for transfer in transfers:
            name = _pool_name(transfer.name)
            if name == KV:
                continue
            if name not in self._described or not self._described[name].spec.physical:
                log.warning("kvcr: query names pool %r that holds no bytes here", name)
                return PoolTransferResult(0, {}, [])
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                log.warning("kvcr: hit policy %s of pool %r is not supported", transfer.hit_policy, name)
                return PoolTransferResult(0, {}, [])
            policies[name] = (transfer.hit_policy, max(1, len(transfer.keys or ())))
        all_pages = ([KV] if kv_physical else []) + [
            n for n, (p, _) in policies.items() if p is PoolHitPolicy.ALL_PAGES
        ]
        if not all_pages:
            # A bare logical anchor (with only trailing pools) carries no evidence of any page.
            log.warning("kvcr: refusing a query with no physical all-pages pool (logical anchor alone)")
            return PoolTransferResult(0, {}, [])
        trailing = [n for n, (p, _) in policies.items() if p is PoolHitPolicy.TRAILING_PAGES]
        present = {name: runner.exists(name, keys) for name in [*all_pages, *trailing]}
        local_prefix = min(leading_run(present[name]) for name in all_pages)
        if local_prefix < len(keys):
            # Pages the local tier misses in any all-pages pool may be leased from a peer.
            granted, lease = self._lease_missing(keys[local_prefix:], all_pages, extra_info, trailing)
            for i in range(local_prefix, local_prefix + granted):
                for name in all_pages:
                    present[name][i] = True
                for name in trailing:
                    present[name][i] = present[name][i] or (lease is not None and lease.holds(name, keys[i]))
        anchor_prefix = min(leading_run(present[name]) for name in all_pages)
        sets = []
        hits: dict[str, int] = {}
        for name in all_pages:
            boundaries = all_pages_boundaries(present[name][:anchor_prefix])
            sets.append(boundaries)
            hits[name] = leading_run(present[name])
        for name, (policy, window) in policies.items():
            if policy is PoolHitPolicy.TRAILING_PAGES:
                boundaries = trailing_boundaries(present[name][:anchor_prefix], window)
                sets.append(boundaries)
                hits[name] = max(boundaries)
        restorable = sorted(intersect(sets) - {0})
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, {k: v for k, v in hits.items() if v}, restorable)

    # ------------------------------------------------------------------ reads

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            self._ready()
            slots = host_slots(host_indices, self._described[KV].page_size)
            if len(slots) != len(keys):
                log.error("kvcr batch_get_v1: %d keys but %d host pages", len(keys), len(slots))
                return [False] * len(keys)
            started = time.perf_counter()
            results = self._read({KV: (keys, slots)}, extra_info)[KV]
            self._record(self._stats.prefetch_pgs, self._stats.prefetch_bandwidth, results, KV, started)
            return results
        except _FailStop:
            raise
        except Exception:
            log.exception("kvcr batch_get_v1 failed; reporting misses")
            return [False] * len(keys)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        requests: dict[str, tuple[list[str], list[int]]] = {}
        try:
            self._ready()
            for transfer in transfers:
                name = _pool_name(transfer.name)
                keys = list(transfer.keys or ())
                described = self._described.get(name)
                if described is None:
                    log.error("kvcr batch_get_v2: unknown pool %r", name)
                    results[name] = [False] * len(keys)
                elif not described.spec.physical:
                    results[name] = [True] * len(keys)  # logical: no bytes; evidence comes from physical pools
                else:
                    slots = host_slots(transfer.host_indices, described.page_size)
                    if len(slots) != len(keys):
                        results[name] = [False] * len(keys)
                    else:
                        requests[name] = (keys, slots)
            if requests:
                results.update(self._read(requests, extra_info))
            return results
        except _FailStop:
            raise
        except Exception:
            log.exception("kvcr batch_get_v2 failed; reporting misses")
            return {_pool_name(t.name): [False] * len(t.keys or ()) for t in transfers}

    def _read(
        self, requests: Mapping[str, tuple[list[str], list[int]]], extra_info: HiCacheStorageExtraInfo | None
    ) -> dict[str, list[bool]]:
        """Local restore of each pool's leading held pages, then the rest from a peer."""
        runner = self._ready()
        results: dict[str, list[bool]] = {}
        remote: dict[str, tuple[list[str], list[int], int]] = {}
        for name, (keys, slots) in requests.items():
            outcomes = runner.restore(name, keys, slots, prefix_only=True)
            done = [o.restored for o in outcomes]
            results[name] = done
            first = leading_run(done)
            if first < len(keys) and self.node is not None:
                remote[name] = (keys, slots, first)
        if remote:
            self._read_remote(remote, results, extra_info)
        return results

    def _read_remote(
        self,
        remote: Mapping[str, tuple[list[str], list[int], int]],
        results: dict[str, list[bool]],
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> None:
        assert self.node is not None
        client = self.node.client
        groups: dict[int, tuple[_Held, dict[str, tuple[list[str], list[int], list[int]]]]] = {}
        unleased: dict[str, tuple[list[str], list[int], list[int]]] = {}
        with self._lock:
            self._sweep()
            for name, (keys, slots, first) in remote.items():
                for i in range(first, len(keys)):
                    held = self._held.get((name, keys[i]))
                    if held is not None:
                        entry = groups.setdefault(id(held), (held, {}))[1].setdefault(name, ([], [], []))
                    else:
                        entry = unleased.setdefault(name, ([], [], []))
                    entry[0].append(keys[i])
                    entry[1].append(slots[i])
                    entry[2].append(i)
        batches: list[tuple[RemoteLease, dict[str, tuple[list[str], list[int], list[int]]], _Held | None]] = [
            (held.lease, pools, held) for held, pools in groups.values()
        ]
        if unleased:
            source = self._source(extra_info)
            if source is not None:
                endpoint, covered = source
                pairs = [
                    (name, page)
                    for name, (pages, _, _) in unleased.items()
                    for page in pages
                    if covered is None or router_id(page) in covered
                ]
                lease = client.lease(endpoint, pairs) if pairs else None
                if lease is not None:
                    batches.append((lease, unleased, None))
        for lease, pools, held in batches:
            reads = [PoolRead(name, pages, slots) for name, (pages, slots, _) in pools.items()]
            try:
                outcomes = client.read(lease, reads)
            finally:
                self._consume(lease, pools, held)
            self._apply(outcomes, pools, results)

    def _apply(
        self,
        outcomes: Mapping[str, list[PageOutcome]],
        pools: Mapping[str, tuple[list[str], list[int], list[int]]],
        results: dict[str, list[bool]],
    ) -> None:
        for name, (_, _, positions) in pools.items():
            for position, outcome in zip(positions, outcomes.get(name, ()), strict=False):
                if outcome.outcome is Outcome.UNCERTAIN:
                    self._fail_stop(
                        f"a read into SGLang host pages of pool {name!r} could not be confirmed stopped "
                        f"({outcome.reason}); those pages may still be written"
                    )
                results[name][position] = outcome.restored

    def _consume(
        self, lease: RemoteLease, pools: Mapping[str, tuple[list[str], list[int], list[int]]], held: _Held | None
    ) -> None:
        assert self.node is not None
        if held is None:
            self.node.client.release(lease)
            return
        with self._lock:
            for name, (pages, _, _) in pools.items():
                for page in pages:
                    held.pending.discard((name, page))
                    if self._held.get((name, page)) is held:
                        del self._held[(name, page)]
            finished = not held.pending
        if finished:
            self.node.client.release(lease)

    def _sweep(self) -> None:
        """Forget leases whose time is up (caller holds the lock)."""
        if self.node is None:
            return
        client = self.node.client
        stale = [item for item, held in self._held.items() if not client.alive(held.lease)]
        for item in stale:
            held = self._held.pop(item)
            held.pending.discard(item)
            if not held.pending and self.node is not None:
                self.node.client.release(held.lease)

    def _fail_stop(self, reason: str) -> None:
        type(self).terminate(reason)
        raise _FailStop(reason)  # only reached when a test replaced `terminate`

    # ------------------------------------------------------------------ writes

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            runner = self._ready()
            slots = host_slots(host_indices, self._described[KV].page_size)
            if len(slots) != len(keys):
                log.error("kvcr batch_set_v1: %d keys but %d host pages", len(keys), len(slots))
                return [False] * len(keys)
            started = time.perf_counter()
            results = runner.backup(KV, keys, slots, parent=_parent(extra_info))
            self._record(self._stats.backup_pgs, self._stats.backup_bandwidth, results, KV, started)
            return results
        except Exception:
            log.exception("kvcr batch_set_v1 failed; nothing stored")
            return [False] * len(keys)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = _pool_name(transfer.name)
            keys = list(transfer.keys or ())
            try:
                runner = self._ready()
                described = self._described.get(name)
                if described is None:
                    log.error("kvcr batch_set_v2: unknown pool %r", name)
                    results[name] = [False] * len(keys)
                elif not described.spec.physical:
                    results[name] = [True] * len(keys)
                else:
                    slots = host_slots(transfer.host_indices, described.page_size)
                    if len(slots) != len(keys):
                        results[name] = [False] * len(keys)
                    else:
                        results[name] = runner.backup(name, keys, slots, parent=_parent(extra_info))
            except Exception:
                log.exception("kvcr batch_set_v2 of pool %r failed; nothing stored", name)
                results[name] = [False] * len(keys)
        return results

    # ------------------------------------------------------------------ copy path (interface_v1 off)

    def _flat_extents(self, target: Any) -> list[int]:
        spec = self._described[KV].spec
        base = int(target.data_ptr())
        if int(target.numel()) * int(target.element_size()) != spec.page_bytes or not target.is_contiguous():
            raise LayoutError(f"a flat page must be {spec.page_bytes} contiguous bytes")
        addresses, offset = [], 0
        for component in spec.components:
            addresses.append(base + offset)
            offset += component.piece_bytes
        return addresses

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        try:
            runner = self._ready()
            if target_location is None:
                target_location = self._host_pools[KV].get_dummy_flat_data_page()
            ok = runner.load_page(KV, key, self._flat_extents(target_location))
            return target_location if ok else None
        except Exception:
            log.exception("kvcr get failed")
            return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        try:
            runner = self._ready()
            if value is None:
                return False
            return runner.store_page(KV, key, self._flat_extents(value.contiguous()))
        except Exception:
            log.exception("kvcr set failed")
            return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            return False
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key: str) -> bool:
        try:
            return self._ready().query(KV, [key]).prefix == 1
        except Exception:
            return False

    # ------------------------------------------------------------------ lifecycle

    def clear(self) -> None:
        try:
            self._ready().clear()
        except Exception:
            log.exception("kvcr clear failed")

    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            stats, self._stats = self._stats, _Stats()
        return StorageMetrics(stats.prefetch_pgs, stats.backup_pgs, stats.prefetch_bandwidth, stats.backup_bandwidth)

    def kvcr_stats(self) -> dict[str, Any]:
        """kvcr's own counters and occupancy (for operators; SGLang does not call this)."""
        runner = self._ready()
        stats = runner.stats()
        with self._lock:
            rejected = dict(self._hint_rejections)
            held = len(self._held)
        return {
            "namespace": stats.namespace,
            "endpoint": self.node.endpoint if self.node else None,
            "pools": [dataclasses.asdict(p) for p in stats.pools],
            "counters": stats.counters,
            "hints_rejected": rejected,
            "held_remote_pages": held,
            "kv_events": self.kv_events.stats() if self.kv_events else None,
        }

    def close(self) -> None:
        try:
            with self._lock:
                leases = {id(h): h for h in self._held.values()}
                self._held.clear()
            if self.node is not None:
                for held in leases.values():
                    self.node.client.release(held.lease)
                self.node.close()
            elif self.runner is not None:
                self.runner.close()
        except KvcrError:
            log.exception("kvcr close left memory registered (a transfer never settled)")
        finally:
            if self.kv_events is not None:
                self.kv_events.close()  # the router forgets this replica's pages

    def _record(
        self, pages: list[int], bandwidth: list[float], results: Sequence[bool], pool: str, started: float
    ) -> None:
        done = leading_run(list(results))
        seconds = time.perf_counter() - started
        nbytes = done * self._described[pool].spec.page_bytes
        with self._lock:
            pages.append(done)
            bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)


class _FailStop(BaseException):
    """Raised after fail-stop when the process was not actually terminated (tests)."""


def _parent(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    if extra_info is not None and extra_info.prefix_keys:
        return str(extra_info.prefix_keys[-1])
    return None


def _to_builtins(value: Any) -> Any:
    try:
        import msgspec

        return msgspec.to_builtins(value)
    except (ImportError, TypeError):
        return None


_FABRIC_LOCK = threading.Lock()
_FABRIC: Any = None


def _process_fabric() -> Any:
    """One mock fabric per process, shared by every backend using transport 'mock' (tests, demos)."""
    global _FABRIC
    with _FABRIC_LOCK:
        if _FABRIC is None:
            from kvcr.adapters.mock import MockFabric

            _FABRIC = MockFabric()
        return _FABRIC
