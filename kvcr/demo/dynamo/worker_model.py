"""The kvcr worker's engine: SGLang's real HiCache host pool and controller, a stand-in for the model.

What is real: SGLang 0.5.23's ``MHATokenToKVPoolHost`` (the host KV pool), its
``HybridCacheController`` (hit query, prefetch and backup threads), and kvcr as its L3 storage
backend, created by SGLang's own storage factory (the ``dynamic`` route) from the extra config.
What stands in for the model: no device and no forward pass. A page's KV bytes are a pure
function of its token prefix (seeded by the page's chained hash), so "prefill" writes those bytes
into the host pool and every page that comes back from storage, local or from a peer, is checked
bit for bit against them.

One request (``serve``), serialized per worker:

1. the prompt's full pages and their SGLang page keys;
2. a local-only hit query (how many leading pages this worker's kvcr holds);
3. the router's hint, if any, is made the current hint of the controller's threads while they run
   the request's hit query and prefetch reads (``hints_bridge``, as kvcr's SGLang plugin does in
   SGLang's scheduler); SGLang's controller then restores the leading pages: local ones first,
   the rest leased and read from the hinted peer over NIXL;
4. every restored page is verified, the missing pages are "computed";
5. what this worker's kvcr did not hold yet (peer-restored and computed pages) is backed up
   through SGLang's backup thread, which is what publishes the KV events the router indexes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from queue import Empty
from typing import Any

from kvcr.demo.dynamo.worker_settings import WorkerSettings
from kvcr.domain.errors import ConfigError
from kvcr.domain.keys import page_hashes
from kvcr.integrations.shared import hints_bridge
from kvcr.integrations.shared.page_tokens import default_registry

log = logging.getLogger(__name__)

HEADS, HEAD_DIM = 2, 128
_QUEUE_TIMEOUT_S = 60.0


def prepare_sglang() -> None:
    """SGLang on a CPU-only machine: caches under the checkout, an import-only torchvision, one rank.

    Must run before SGLang is imported. The torchvision stub comes from the repository's
    ``kvcr/testing/stubs`` (shipped in the wheel) when no torchvision is installed (SGLang imports it unconditionally).
    """
    from kvcr.testing.sglang import prepare_environment

    prepare_environment()
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


@dataclass(frozen=True, slots=True)
class Served:
    """What one request did to the KV pages of its prompt."""

    pages: int
    local_pages: int
    peer_pages: int
    computed_pages: int
    backed_up_pages: int
    restore_s: float
    restored_bytes: int
    verified: bool | None  # None: nothing was restored, so nothing to check
    mismatched_pages: int

    @property
    def restored_pages(self) -> int:
        return self.local_pages + self.peer_pages


class _DevicePool:
    """The device-side members SGLang's controller reads; the stand-in has no device KV."""

    def __init__(self, layers: int) -> None:
        import torch

        self.device = torch.device("cpu")
        self.layer_num = layers
        self.counter: Any = None

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class _Allocator:
    def __init__(self, layers: int) -> None:
        self.pool = _DevicePool(layers)

    def get_kvcache(self) -> _DevicePool:
        return self.pool

    def set_hicache_transfer_done_event(self, *args: Any) -> None:
        pass


def _host_pool(settings: WorkerSettings) -> Any:
    """SGLang's real MHA host pool (page_first, bf16), sized to ``host_pages`` pages."""
    from kvcr.testing.sglang import host_pool

    return host_pool(
        settings.layers, settings.host_pages, page_tokens=settings.page_tokens, heads=HEADS, head_dim=HEAD_DIM
    )


def storage_extra_config(settings: WorkerSettings) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` that selects kvcr (SGLang's dynamic route)."""
    token = {} if settings.auth_token_file is None else {"auth_token_file": settings.auth_token_file}
    return {
        **token,
        "backend_name": "kvcr",
        "module_path": "kvcr.integrations.sglang",
        "class_name": "KvcrHiCacheStorage",
        "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": True,
        "transport": settings.transport,
        "dram_bytes": settings.dram_bytes,
        "control_host": settings.host,
        "control_port": settings.control_port,
        "enable_remote_hint": True,
        "operation_timeout_ms": settings.operation_timeout_ms,
        "abandon_timeout_ms": 2 * settings.operation_timeout_ms,
        "kv_events_endpoint": settings.kv_events_endpoint,
    }


def _controller_class() -> type:
    """SGLang's HybridCacheController with the request's hint current around its storage calls.

    The three overrides do what kvcr's SGLang plugin registers as hooks in SGLang's scheduler
    process: the hit query and the prefetch reads run with the request's hint current on the
    controller's thread, and a backup records its pages' token ids for the KV events.
    """
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    class HintedCacheController(HybridCacheController):
        def _storage_hit_query(self, operation: Any) -> Any:
            with hints_bridge.active(getattr(operation, "request_id", None)):
                return super()._storage_hit_query(operation)

        def _page_transfer(self, operation: Any) -> Any:
            with hints_bridge.active(getattr(operation, "request_id", None)):
                return super()._page_transfer(operation)

        def _page_backup(self, operation: Any) -> Any:
            registry = default_registry()
            if registry.enabled:
                prefix = operation.prefix_keys
                registry.record(
                    list(operation.hash_value or ()),
                    operation.token_ids,
                    int(self.page_size),
                    prior_hash=str(prefix[-1]) if prefix else None,
                )
            return super()._page_backup(operation)

    return HintedCacheController


class StandInModel:
    """One worker's KV path: SGLang's host pool and controller over kvcr, and the stand-in model.

    Thread-safe: ``serve`` calls are serialized (SGLang's controller answers hit queries in
    submission order on one queue).
    """

    def __init__(self, settings: WorkerSettings) -> None:
        import torch
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

        if settings.layers < 1:
            raise ConfigError(f"--page-kib {settings.page_bytes >> 10} gives no whole layer")
        self.settings = settings
        self.page_tokens = settings.page_tokens
        self.host = _host_pool(settings)
        allocator = _Allocator(settings.layers)
        self.group = HostPoolGroup(
            [
                PoolEntry(
                    name=PoolName.KV,
                    host_pool=self.host,
                    device_pool=allocator.pool,
                    layer_mapper=lambda i: i,
                    is_primary_index_anchor=True,
                )
            ]
        )
        self.controller = _controller_class()(
            token_to_kv_pool_allocator=allocator,
            mem_pool_host=self.group,
            page_size=self.page_tokens,
            tp_group=None,
            load_cache_event=threading.Event(),
            io_backend="direct",
            storage_backend="dynamic",
            prefetch_threshold=self.page_tokens,
            model_name=settings.model,
            storage_backend_extra_config=storage_extra_config(settings),
            # --metrics-port: kvcr's series go to this process's default registry, which it serves
            enable_storage_metrics=settings.metrics_port is not None,
        )
        self.store = self.controller.storage_backend
        self._page_shape = tuple(self.host.get_data_page(0, flat=True).shape)
        self.page_bytes = int(self.host.get_data_page(0, flat=True).numel()) * 2
        self._torch = torch
        self._lock = threading.Lock()
        self.max_pages = settings.host_pages // 2  # room for a prompt's restored and computed pages

    def expected_page(self, page_key: str) -> Any:
        """A page's KV bytes (as int16 bit patterns): a function of the page key, i.e. of its prefix."""
        torch = self._torch
        generator = torch.Generator().manual_seed(int(page_key[:15], 16))
        return torch.randint(-(1 << 15), 1 << 15, self._page_shape, generator=generator, dtype=torch.int16)

    def serve(self, request_id: str, token_ids: Sequence[int], kv_hints: Any) -> Served:
        """Restore what storage has of the prompt's pages, verify it, compute and back up the rest."""
        pages = min(len(token_ids) // self.page_tokens, self.max_pages)
        tokens = list(token_ids[: pages * self.page_tokens])
        keys = page_hashes(tokens, self.page_tokens)
        with self._lock:
            if not pages:
                return Served(0, 0, 0, 0, 0, 0.0, 0, None, 0)
            local = int(self.store.batch_exists(keys))  # no hint is current here: this rank's kvcr only
            if kv_hints is not None:
                hints_bridge.remember(request_id, kv_hints)
            restored_at = computed_at = None
            try:
                started = time.perf_counter()
                restored, restored_at = self._prefetch(request_id, tokens)
                restore_s = time.perf_counter() - started if restored else 0.0
                mismatched = sum(
                    not self._holds(int(restored_at[i * self.page_tokens]), keys[i]) for i in range(restored)
                )
                computed_at = self._compute(keys[restored:])
                backed_up = self._back_up(tokens, keys, local, restored, restored_at, computed_at)
            finally:
                for held in (restored_at, computed_at):
                    if held is not None:
                        self.group.free(held)
        return Served(
            pages=pages,
            local_pages=min(local, restored),
            peer_pages=restored - min(local, restored),
            computed_pages=pages - restored,
            backed_up_pages=backed_up,
            restore_s=restore_s,
            restored_bytes=restored * self.page_bytes,
            verified=(mismatched == 0) if restored else None,
            mismatched_pages=mismatched,
        )

    def _prefetch(self, request_id: str, tokens: list[int]) -> tuple[int, Any]:
        """SGLang's storage prefetch, driven the way its scheduler drives it; (pages, host indices)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        ctrl = self.controller
        op = ctrl.prefetch(CacheRequestHandle(rid=request_id, attempt_id=0), tokens, None, None)
        if ctrl.prefetch_hit_queue.get(timeout=_QUEUE_TIMEOUT_S) is not op:
            raise RuntimeError("SGLang's controller answered another request's hit query")
        if not op.storage_hit_count:
            return 0, None
        dst, hit_tokens = ctrl.allocate_storage_hit(
            op, op.storage_hit_count, allow_partial=False, min_tokens=self.page_tokens, evict_host=lambda n: 0
        )
        if dst is None:
            log.warning("kvcr worker: no host pages free for %d restored tokens; recomputing", hit_tokens)
            return 0, None
        op.host_indices = dst
        ctrl.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = ctrl.ack_prefetch_queue.get(timeout=_QUEUE_TIMEOUT_S)
            completed = max(completed, ack.completed_tokens or 0)
            if ack.completed_req:
                break
        return completed // self.page_tokens, dst

    def _holds(self, index: int, page_key: str) -> bool:
        actual = self.host.get_data_page(index, flat=True).view(self._torch.int16)
        return bool(self._torch.equal(actual, self.expected_page(page_key)))

    def _compute(self, keys: list[str]) -> Any:
        """The stand-in prefill: write each missing page's bytes into fresh host pages."""
        if not keys:
            return None
        indices = self.group.alloc(len(keys) * self.page_tokens)
        if indices is None:
            raise RuntimeError("SGLang's host pool has no room for this prompt")
        for i, key in enumerate(keys):
            page = self.expected_page(key).view(self._torch.bfloat16)
            self.host.set_from_flat_data_page(int(indices[i * self.page_tokens]), page)
        return indices

    def _back_up(
        self, tokens: list[int], keys: list[str], local: int, restored: int, restored_at: Any, computed_at: Any
    ) -> int:
        """Back up pages ``local..`` (peer-restored, then computed) through SGLang's backup thread."""
        torch = self._torch
        first = min(local, restored)
        parts = []
        if restored > first:
            parts.append(restored_at[first * self.page_tokens : restored * self.page_tokens])
        if computed_at is not None:
            parts.append(computed_at)
        if not parts:
            return 0
        indices = torch.cat(parts) if len(parts) > 1 else parts[0]
        ctrl = self.controller
        ctrl.write_storage(
            indices,
            tokens[first * self.page_tokens :],
            hash_value=keys[first:],
            prefix_keys=keys[:first] or None,
        )
        try:
            done = ctrl.ack_backup_queue.get(timeout=_QUEUE_TIMEOUT_S)
        except Empty:
            log.warning("kvcr worker: SGLang's backup thread did not answer; pages not backed up")
            return 0
        return int(done.completed_tokens) // self.page_tokens

    def clear(self) -> bool:
        """Empty this worker's kvcr DRAM through SGLang's own call (the router hears AllBlocksCleared)."""
        with self._lock:
            return bool(self.controller.clear_storage_backend())

    def close(self) -> None:
        """Stop SGLang's storage threads and close kvcr (its peers and the router forget it)."""
        self.controller.detach_storage_backend()
