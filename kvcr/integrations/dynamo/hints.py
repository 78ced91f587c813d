"""HintProducer: Dynamo's own selection core, fed by kvcr's KV events, asked for hints.

kvcr does not index anything itself. ``dynamo.llm.SelectionService`` (ai-dynamo-runtime) is the
router's selection core in process: it subscribes to each worker's KV-event PUB, keeps Dynamo's
radix index, and composes the ``kv.fetch@1.0`` envelope when a booking lands on a worker that a
better source can feed. This module only registers workers and asks for one target::

    producer = HintProducer()                                   # inside a running event loop
    await producer.register_worker(1, "m", 16, "tcp://a:5557", {0: "tcp://a:32100"})
    await producer.register_worker(2, "m", 16, "tcp://b:5557", {0: "tcp://b:32100"})
    hint = await producer.hint_for("m", token_ids, target_worker_id=2, request_id="req-1")

``BlockingHintProducer`` offers the same calls to code without an event loop: it runs the
coroutines on a private loop thread, each call bounded by a timeout.

Behaviour worth knowing (ai-dynamo-runtime 1.6.1):

- Events are applied asynchronously, tens of milliseconds after they are sent; nothing signals
  arrival, so callers that must see an event poll ``overlap_scores``.
- A hint is emitted only on a booking, only when another worker of the same worker type holds a
  longer prefix than the target, and never for a worker's own pages. Its hashes are the source's
  published block hashes as u64, root-aligned.
- The listener drops messages whose ``seq`` is not above the last one it saw, so a restarted
  publisher (seq 0 again) is ignored until the worker is deleted and registered anew:
  ``register_worker`` therefore always starts the worker afresh.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from kvcr.domain.errors import ConfigError, DeadlineExceeded
from kvcr.integrations.dynamo.capability import check_control_endpoints, check_worker_type

log = logging.getLogger(__name__)

T = TypeVar("T")


def _service_error() -> type[Exception]:
    from dynamo.llm.exceptions import SelectionServiceError

    error: type[Exception] = SelectionServiceError
    return error


class HintProducer:
    """Registers workers with an in-process SelectionService and asks it for hints.

    Construct it inside a running event loop (the service binds to it). Not thread-safe: use it
    from that loop only (``BlockingHintProducer`` does).

    Args:
        service: a ``dynamo.llm.SelectionService`` to use; by default one is created.
        indexer_threads: size of the KV indexer pool of a created service.
    """

    def __init__(self, service: Any = None, *, indexer_threads: int = 1) -> None:
        self._owns_service = service is None
        if service is None:
            from kvcr import compat

            compat.ensure_supported("dynamo-runtime")
            from dynamo.llm import SelectionService

            service = SelectionService(indexer_threads=indexer_threads)
        self._service = service
        self._errors: type[Exception] = _service_error()

    @property
    def service(self) -> Any:
        return self._service

    async def register_worker(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        kv_events_endpoint: str | Mapping[int, str],
        control_endpoints: Mapping[int, str],
        worker_type: str = "aggregated",
        *,
        endpoint: str | None = None,
    ) -> dict[str, Any]:
        """Register (or re-register) a worker and subscribe to its KV events.

        An existing registration of ``worker_id`` is deleted first: its index entries and the
        sequence watermark go with it, as they must after the worker's publisher restarted.

        Args:
            kv_events_endpoint: the worker's KV-event PUB address, or one per DP rank.
            control_endpoints: ``{dp_rank: "tcp://host:port"}``, each DP replica's rank-0 kvcr
                control endpoint (what hints name).
            worker_type: "aggregated", "prefill" or "decode"; hints flow only between equal types.
            endpoint: the worker's serving endpoint as the service records it (opaque to kvcr;
                defaults to its first control endpoint).

        Returns:
            The service's catalog record.

        Raises:
            ConfigError: a bad endpoint, worker type or block size.
        """
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        controls = check_control_endpoints(control_endpoints)
        request: dict[str, Any] = {
            "worker_id": worker_id,
            "model_name": model_name,
            "block_size": block_size,
            "endpoint": endpoint or controls[min(controls)],
            "router_hint_worker_type": check_worker_type(worker_type),
            "router_hint_source_control_endpoints": controls,
        }
        if isinstance(kv_events_endpoint, Mapping):
            if not kv_events_endpoint:
                raise ConfigError("kv_events_endpoint needs at least one dp rank -> endpoint entry")
            request["kv_events_endpoints"] = dict(kv_events_endpoint)
            request["data_parallel_start_rank"] = min(kv_events_endpoint)
            request["data_parallel_size"] = len(kv_events_endpoint)
        else:
            request["kv_events_endpoint"] = kv_events_endpoint
        await self.remove_worker(worker_id)
        record: dict[str, Any] = await self._service.upsert_worker(request)
        if record.get("lifecycle") != "schedulable":
            log.warning("dynamo worker %s registered but not schedulable: %s", worker_id, record)
        return record

    async def remove_worker(self, worker_id: int) -> bool:
        """Forget a worker and its index entries; False when it was not registered."""
        try:
            await self._service.delete_worker(worker_id)
        except self._errors as exc:
            if getattr(exc, "kind", None) == "not_found":
                return False
            raise
        return True

    async def overlap_scores(self, model_name: str, token_ids: Sequence[int]) -> dict[tuple[int, int], int]:
        """Blocks of the prompt's prefix each ``(worker_id, dp_rank)`` holds, in any tier."""
        result = await self._service.overlap_scores({"model_name": model_name, "token_ids": list(token_ids)})
        scores: dict[tuple[int, int], int] = {}
        for worker in result.get("workers", ()):
            held = max(int(worker.get(tier) or 0) for tier in ("device_blocks", "host_pinned_blocks", "disk_blocks"))
            scores[(int(worker["worker_id"]), int(worker.get("dp_rank") or 0))] = held
        return scores

    async def hint_for(
        self, model_name: str, token_ids: Sequence[int], target_worker_id: int, request_id: str
    ) -> dict[str, Any] | None:
        """The ``kv.fetch@1.0`` envelope for serving ``token_ids`` on ``target_worker_id``, or None.

        Books the request on the target only (the hint is composed at booking time) and always
        frees that booking again: the producer advises, it does not schedule. Selection failures
        (unknown model, no schedulable worker, a selection id in use) are logged and give None.
        """
        request = {
            "model_name": model_name,
            "selection_id": request_id,
            "token_ids": list(token_ids),
            "allowed_worker_ids": [target_worker_id],
        }
        try:
            selected = await self._service.select_and_reserve(request)
        except self._errors as exc:
            log.info("no kv hint for %s: %s", request_id, exc)
            return None
        try:
            hint = selected.get("kv_hint")
            if selected.get("worker_id") != target_worker_id:
                return None
            return dict(hint) if isinstance(hint, Mapping) else None
        finally:
            try:
                await self._service.free_reservation(request_id)
            except self._errors as exc:
                log.debug("reservation %s already gone: %s", request_id, exc)

    def close(self) -> None:
        """Stop the service: its KV-event listeners end, pending selections fail fast."""
        if self._owns_service:
            self._service.shutdown()


class BlockingHintProducer:
    """``HintProducer`` for callers without an event loop: a private loop thread runs every call.

    Thread-safe: calls from any thread are queued onto that loop.

    Args:
        timeout_s: the longest any one call may take (DeadlineExceeded after that).
        indexer_threads: size of the service's KV indexer pool.
    """

    def __init__(self, *, timeout_s: float = 10.0, indexer_threads: int = 1) -> None:
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcr-hint-producer", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._producer: HintProducer = self._run(self._make(indexer_threads))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _make(indexer_threads: int) -> HintProducer:
        return HintProducer(indexer_threads=indexer_threads)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coroutine.close()
            raise RuntimeError("the hint producer is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(self._timeout_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise DeadlineExceeded(f"hint producer call took longer than {self._timeout_s} s") from exc

    def register_worker(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        kv_events_endpoint: str | Mapping[int, str],
        control_endpoints: Mapping[int, str],
        worker_type: str = "aggregated",
        *,
        endpoint: str | None = None,
    ) -> dict[str, Any]:
        return self._run(
            self._producer.register_worker(
                worker_id,
                model_name,
                block_size,
                kv_events_endpoint,
                control_endpoints,
                worker_type,
                endpoint=endpoint,
            )
        )

    def remove_worker(self, worker_id: int) -> bool:
        return self._run(self._producer.remove_worker(worker_id))

    def overlap_scores(self, model_name: str, token_ids: Sequence[int]) -> dict[tuple[int, int], int]:
        return self._run(self._producer.overlap_scores(model_name, token_ids))

    def hint_for(
        self, model_name: str, token_ids: Sequence[int], target_worker_id: int, request_id: str
    ) -> dict[str, Any] | None:
        return self._run(self._producer.hint_for(model_name, token_ids, target_worker_id, request_id))

    def close(self) -> None:
        """Shut the service down and stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            self._run(self._close())
        finally:
            self._closed = True
            self._stop_loop()

    async def _close(self) -> None:
        self._producer.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self._timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
