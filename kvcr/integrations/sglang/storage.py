"""KvcrHiCacheStorage: kvcr as SGLang 0.5.23's HiCache L3 storage backend (a facade).

SGLang loads it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvcr", "module_path": "kvcr.integrations.sglang",
"class_name": "KvcrHiCacheStorage", "interface_v1": 1, ...}``, then calls
``register_mem_pool_host`` (the anchor KV pool), ``register_mem_host_pool_v2`` per pool and
``on_host_pools_registered``; kvcr starts there, once the pool geometry is known (``startup``).

This class only translates SGLang's calls: hints are read by ``hints``, hit rules live in
``kvcr.domain.hits``, local-then-remote reads and the hit-query lease book in the runner
(``Restorer``, ``PrefetchBook``). Data calls never raise into SGLang: bad input or a transport
failure is a miss. The one exception is fail-stop (``failstop``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolTransferResult

from kvcr.domain.boundaries import leading_run
from kvcr.domain.errors import ConfigError, EvidenceError, KvcrError, LayoutError
from kvcr.domain.hints import Endpoint
from kvcr.domain.hits import PoolPresence, evidence_pools, hit_verdict
from kvcr.domain.pools import HitPolicy
from kvcr.integrations.sglang.failstop import FailStop, terminate_worker
from kvcr.integrations.sglang.hints import HintReader
from kvcr.integrations.sglang.pools import host_slots
from kvcr.integrations.sglang.startup import KV, Started, check_topology, rank_layout, replicated, start
from kvcr.integrations.sglang.stats import StorageStats, storage_metrics
from kvcr.integrations.shared import hints_bridge
from kvcr.integrations.shared.settings import KvcrSettings, parse_settings
from kvcr.ports.metric_catalogue import Lookup, MetricName
from kvcr.runner.restore import Source

log = logging.getLogger(__name__)

_POLICIES = {"all_pages": HitPolicy.ALL_PAGES, "trailing_pages": HitPolicy.TRAILING_PAGES}


def _name(pool: Any) -> str:
    return str(getattr(pool, "value", pool))


class KvcrHiCacheStorage(HiCacheStorage):
    """The HiCache storage surface over one kvcr runner per TP rank."""

    # Tests replace this to observe fail-stop without ending the test process.
    terminate = staticmethod(terminate_worker)

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        del kwargs  # the factory passes its own kwargs dict (empty); nothing in it is for us
        self.storage_config = storage_config
        self.settings: KvcrSettings = parse_settings(storage_config.extra_config)
        if not (storage_config.extra_config or {}).get("interface_v1"):
            raise ConfigError(
                'kvcr needs the zero-copy interface: add "interface_v1": 1 to --hicache-storage-backend-extra-config'
            )
        check_topology(storage_config, self.settings)
        self.layout = rank_layout(storage_config)
        self.control_port = self.layout.control_port(self.settings.control_port) if self.settings.control_port else 0
        self._token = self.settings.token()
        self._rotation = self.settings.rotation_tokens()
        self._node_key = self.settings.node_key()
        self._host_pools: dict[str, Any] = {}
        self._started: Started | None = None
        self._hints: HintReader | None = None
        self._min_pages: int | None = None
        self._start_lock = threading.Lock()
        self._refused_pools: set[str] = set()
        self._stats = StorageStats(bool(storage_config.enable_storage_metrics))

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._host_pools[KV] = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = _name(host_pool_name)
        if self._started is not None and name not in self._started.described:
            if name not in self._refused_pools:  # kvcr sized its arenas at start-up
                self._refused_pools.add(name)
                log.error("kvcr: pool %r registered after start-up is not served (its pages are misses)", name)
            return
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._host_pools[name] = host_pool

    def on_host_pools_registered(self) -> None:
        self._ready()

    def _ready(self) -> Started:
        with self._start_lock:
            if self._started is None:
                self._started = start(
                    self.storage_config, self.settings, self._token, self._rotation, self._host_pools, self._node_key
                )
                self._hints = HintReader(self.settings, self._started.metrics)
                hints_bridge.add_listener(self)
            return self._started

    @property
    def runner(self) -> Any:
        return self._ready().runner

    @property
    def node(self) -> Any:
        return self._ready().node

    @property
    def kv_events(self) -> Any:
        """The KV-event sink publishing kvcr DRAM residency (None when this rank publishes none)."""
        return self._started.kv_events if self._started is not None else None

    # ------------------------------------------------------------------ sources

    def _sources(self, extra_info: Any, pools: list[str]) -> dict[str, Source | None]:
        """Per pool, the peer its missing pages come from: the hinted replica, or our own writer (MLA)."""
        started = self._ready()
        node, layout = started.node, self.layout
        if node is None:
            return {}
        hint = self._hints.read(extra_info) if self.settings.enable_remote_hint and self._hints else None
        sources: dict[str, Source | None] = {}
        for pool in pools:
            shared = replicated(pool, self.storage_config)
            if hint is not None:
                chain: Source | None = None
                for held in reversed(hint.holders):  # the router's order: its best source first
                    endpoint = str(held.source.offset(layout.source_offset(shared)))
                    if endpoint != node.endpoint:
                        chain = Source(endpoint, held.block_hashes, chain)
                if chain is not None:
                    sources[pool] = chain
                    continue
            if shared and not layout.is_writer:
                # Replicated KV is backed up by our replica's writer rank only: read it from there.
                host = self.settings.control_advertise_host or self.settings.control_host
                sources[pool] = Source(str(Endpoint(host, layout.writer_port(self.settings.control_port))))
            else:
                sources[pool] = None
        return sources

    # ------------------------------------------------------------------ queries

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        try:
            pages: int = self._exists(keys, [], extra_info).pages
            return pages
        except EvidenceError:
            return 0  # a bare logical anchor: no bytes, no evidence, no hit
        except Exception:
            log.exception("kvcr batch_exists failed; answering with no hits")
            return 0

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        try:
            verdict = self._exists(keys, list(pool_transfers or ()), extra_info)
            return PoolTransferResult(
                verdict.pages, {k: v for k, v in verdict.pool_hits.items() if v}, list(verdict.restorable)
            )
        except (EvidenceError, LayoutError) as exc:
            log.warning("kvcr: refusing a hit query: %s", exc)
        except Exception:
            log.exception("kvcr batch_exists_v2 failed; answering with no hits")
        return PoolTransferResult(0, {}, [])

    def _exists(self, keys: list[str], transfers: list[Any], extra_info: Any) -> Any:
        started = self._ready()
        presences = [self._shape(KV, HitPolicy.ALL_PAGES, len(keys))]
        named = {KV}
        for transfer in transfers:
            name = _name(transfer.name)
            if name == KV:
                continue
            policy = _POLICIES.get(_name(transfer.hit_policy))
            if policy is None or name not in started.described:
                raise LayoutError(f"pool {name!r} or its hit policy {_name(transfer.hit_policy)!r} is not served")
            presences.append(self._shape(name, policy, max(1, len(transfer.keys or ()))))
            named.add(name)
        if not started.described[KV].spec.physical:
            # A logical anchor's pages stand on the physical ALL_PAGES pools (its reads answer from
            # them, ``_evidence``), whether or not the query names them: hits and reads agree.
            presences.extend(
                self._shape(n, HitPolicy.ALL_PAGES, 1) for n in _anchor_evidence(started) if n not in named
            )
        physical = [p.pool for p in presences if p.physical]
        evidence = [p.pool for p in evidence_pools(presences)]
        found = self._presence(started, keys, physical, evidence, extra_info)
        verdict = hit_verdict(
            [PoolPresence(p.pool, p.policy, found.get(p.pool, ()), p.window, p.physical) for p in presences]
        )
        metrics = started.metrics
        metrics.increment(MetricName.LOOKUP_PAGES, verdict.pages, {"result": Lookup.HIT})
        metrics.increment(MetricName.LOOKUP_PAGES, max(0, len(keys) - verdict.pages), {"result": Lookup.MISS})
        return verdict

    def _shape(self, pool: str, policy: HitPolicy, window: int) -> PoolPresence:
        return PoolPresence(pool, policy, (), window, self._ready().described[pool].spec.physical)

    # ------------------------------------------------------------------ reads

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self.batch_get_v2([_Transfer(KV, host_indices, keys)], extra_info).get(KV, [False] * len(keys))

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {_name(t.name): [False] * len(t.keys or ()) for t in transfers}
        try:
            started = self._ready()
            started_at = time.perf_counter()
            requests, logical = self._requests(transfers, started)
            restored = started.restorer.read(requests, self._sources(extra_info, list(requests)))
            if restored.uncertain is not None:
                self._fail_stop(restored.uncertain)
            results.update(restored.restored)
            for name, keys in logical.items():
                results[name] = self._evidence(keys, started, extra_info)
            if KV in requests:
                self._record(self._stats.prefetch, results[KV], started, started_at)
        except FailStop:
            raise
        except Exception:
            log.exception("kvcr batch_get failed; reporting misses")
        return results

    def _requests(
        self, transfers: list[Any], started: Started
    ) -> tuple[dict[str, tuple[list[str], list[int]]], dict[str, list[str]]]:
        """Physical pools' (keys, host slots) to read, and logical pools' keys (answered from evidence)."""
        requests: dict[str, tuple[list[str], list[int]]] = {}
        logical: dict[str, list[str]] = {}
        for transfer in transfers:
            name, keys = _name(transfer.name), list(transfer.keys or ())
            described = started.described.get(name)
            if described is None:
                continue  # a pool kvcr does not serve: misses
            if not described.spec.physical:
                logical[name] = keys
                continue
            slots = host_slots(transfer.host_indices, described.page_size)
            if len(slots) != len(keys):
                log.error("kvcr: %d keys but %d host pages for pool %r; misses", len(keys), len(slots), name)
                continue
            requests[name] = (keys, slots)
        return requests, logical

    def _evidence(self, keys: list[str], started: Started, extra_info: Any) -> list[bool]:
        """A logical anchor's pages are as available as every physical ALL_PAGES pool makes them.

        Counted as the hit query counted them, local or from the pools' sources: the sidecar reads
        that follow take what this books (under a request id), or lease it anew.
        """
        pools = _anchor_evidence(started)
        if not pools:
            return [False] * len(keys)
        found = self._presence(started, keys, pools, pools, extra_info)
        return [all(found[p][i] for p in pools) for i in range(len(keys))]

    def _presence(
        self, started: Started, keys: list[str], pools: list[str], evidence: list[str], extra_info: Any
    ) -> dict[str, list[bool]]:
        """The restorer's presence for this call's request, its hint's sources and SGLang's threshold."""
        return started.restorer.presence(
            keys,
            pools,
            self._sources(extra_info, pools),
            request=hints_bridge.current_request(),
            evidence=evidence,
            min_pages=self._prefetch_min_pages(started),
        )

    def _prefetch_min_pages(self, started: Started) -> int:
        """Pages below which SGLang prefetches nothing (its ``prefetch_threshold``); found once."""
        if self._min_pages is None:
            page_tokens = started.described[KV].page_size
            threshold = engine_prefetch_threshold(self.storage_config.extra_config)
            self._min_pages = -(-max(threshold, page_tokens) // page_tokens) if threshold > 0 else 0
        return self._min_pages

    def _fail_stop(self, reason: str) -> None:
        type(self).terminate(reason)
        raise FailStop(reason)  # only reached when a test replaced `terminate`

    # ------------------------------------------------------------------ writes

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self.batch_set_v2([_Transfer(KV, host_indices, keys)], extra_info).get(KV, [False] * len(keys))

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        parent = _parent(extra_info)
        for transfer in transfers:
            name, keys = _name(transfer.name), list(transfer.keys or ())
            results[name] = [False] * len(keys)
            try:
                started = self._ready()
                described = started.described.get(name)
                if described is None:
                    continue
                if not described.spec.physical:
                    results[name] = [True] * len(keys)  # no bytes to keep: the physical pools hold them
                    continue
                slots = host_slots(transfer.host_indices, described.page_size)
                if len(slots) != len(keys):
                    log.error(
                        "kvcr: %d keys but %d host pages for pool %r; nothing stored", len(keys), len(slots), name
                    )
                    continue
                started_at = time.perf_counter()
                results[name] = started.runner.backup(name, keys, slots, parent=parent)
                if name == KV:
                    self._record(self._stats.backup, results[name], started, started_at)
            except Exception:
                log.exception("kvcr backup of pool %r failed; nothing stored", name)
        return results

    # ------------------------------------------------------------------ copy path (interface_v1 off)

    def _flat_extents(self, target: Any) -> list[int]:
        spec = self._ready().described[KV].spec
        base = int(target.data_ptr())
        if int(target.numel()) * int(target.element_size()) != spec.page_bytes or not target.is_contiguous():
            raise LayoutError(f"a flat page must be {spec.page_bytes} contiguous bytes")
        offsets = [0]
        for component in spec.components[:-1]:
            offsets.append(offsets[-1] + component.piece_bytes)
        return [base + offset for offset in offsets]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        try:
            target = target_location if target_location is not None else self._host_pools[KV].get_dummy_flat_data_page()
            return target if self._ready().runner.load_page(KV, key, self._flat_extents(target)) else None
        except Exception:
            log.exception("kvcr get failed")
            return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            log.error("kvcr: %d keys but %d target pages; misses", len(keys), len(targets))
            return [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        try:
            return value is not None and self._ready().runner.store_page(
                KV, key, self._flat_extents(value.contiguous())
            )
        except Exception:
            log.exception("kvcr set failed")
            return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            return False
        if len(values) != len(keys):
            log.error("kvcr: %d keys but %d pages; nothing stored", len(keys), len(values))
            return False
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key: str) -> bool:
        try:
            return self._ready().runner.query(KV, [key]).prefix == 1
        except Exception:
            return False

    # ------------------------------------------------------------------ lifecycle

    def on_prefetch_trimmed(self, request_id: str, keep: list[str]) -> None:
        if self._started is not None:
            self._started.restorer.trim(request_id, keep)

    def on_prefetch_finished(self, request_id: str) -> None:
        if self._started is not None:
            self._started.restorer.finish(request_id)

    def clear(self) -> None:
        try:
            self._ready().runner.clear()
        except Exception:
            log.exception("kvcr clear failed")

    def get_stats(self) -> Any:
        return storage_metrics(self._stats)

    def kvcr_stats(self) -> dict[str, Any]:
        """kvcr's own counters and occupancy (for operators; SGLang does not call this)."""
        started = self._ready()
        stats = started.runner.stats()
        return {
            "namespace": stats.namespace,
            "endpoint": started.node.endpoint if started.node else None,
            "pools": [p.as_dict() for p in stats.pools],
            "counters": stats.counters,
            "hints_rejected": self._hints.rejected if self._hints else {},
            "held_remote_pages": started.restorer.booked,
            "hinted_by_source": started.restorer.hinted_by_source(),
            "kv_events": started.kv_events.stats() if started.kv_events else None,
        }

    def close(self) -> None:
        hints_bridge.remove_listener(self)
        started = self._started
        if started is None:
            return
        try:
            started.restorer.close()
            started.close()
        except KvcrError:
            log.exception("kvcr close left memory registered (a transfer never settled)")

    def _record(self, record: Any, results: list[bool], started: Started, started_at: float) -> None:
        pages = leading_run(results)
        record(pages, pages * started.described[KV].spec.page_bytes, time.perf_counter() - started_at)


def engine_prefetch_threshold(extra_config: Mapping[str, Any] | None) -> int:
    """The storage hit, in tokens, below which SGLang prefetches nothing from storage.

    SGLang takes ``prefetch_threshold`` out of the extra-config before the backend sees it, so it
    is read again the way SGLang's controller reads it (its default: 256), from the scheduler's own
    copy of the raw setting. Outside a scheduler (a backend driven directly: tools, tests) there is
    no controller to apply one: ``extra_config``'s value if it has one, else none (0).
    """
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.runtime_context import get_memory

        raw = get_memory().hicache_storage_backend_extra_config
        return int(HybridCacheController.parse_storage_backend_extra_config(raw)[1])
    except Exception:  # not in a scheduler, or a SGLang that parses elsewhere
        value = (extra_config or {}).get("prefetch_threshold", 0)
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


class _Transfer:
    """The v2 shape of a v1 call (one pool, its host indices and keys)."""

    __slots__ = ("host_indices", "keys", "name")

    def __init__(self, name: str, host_indices: Any, keys: list[str]) -> None:
        self.name, self.host_indices, self.keys = name, host_indices, keys


def _anchor_evidence(started: Started) -> list[str]:
    """The pools a logical anchor's pages stand on: every physical ALL_PAGES pool (none: no evidence)."""
    return [n for n, d in started.described.items() if d.spec.physical and d.spec.hit_policy is HitPolicy.ALL_PAGES]


def _parent(extra_info: Any) -> str | None:
    prefix = getattr(extra_info, "prefix_keys", None)
    return str(prefix[-1]) if prefix else None
