"""DynamoInventorySink: kvcr DRAM residency as the KV events Dynamo's router indexes.

The runner reports what its DRAM holds (``InventoryEvent``); this sink turns the KV anchor
pool's events into SGLang's own event maps and hands them to a ``KvEventPublisher`` (the ZMQ
PUB a Dynamo router subscribes to)::

    STORED  -> {"type": "BlockStored", "block_hashes": [i64, ...], "parent_block_hash": i64 | None,
                "token_ids": [...], "block_size": page_size, "lora_id": None, "medium": MEDIUM}
    REMOVED -> {"type": "BlockRemoved", "block_hashes": [i64, ...], "medium": MEDIUM}
    CLEARED -> {"type": "AllBlocksCleared"}   (on an engine's own stream: a BlockRemoved of every page announced)

A block hash is the page's router identity as SGLang's signed int64 (the first 16 hex chars of
the page hash); the router hints the same value as u64, which kvcr maps back to its page keys.
Dynamo places a stored block by its token ids and its parent, which SGLang's storage calls do
not carry (the parent only with ``hicache_storage_pass_prefix_keys``): they come from a
page-token registry that kvcr's SGLang plugin fills at backup time. A stored page whose tokens,
or (for the first page of an event) whose parent, are unknown is left out, and so is every page
after it in that event (their parent would be unknown to the router). A removal names only
pages this sink announced, so stores and removals balance, as Dynamo's per-tier counts need.
Side pools (indexer, Mamba, SWA) are not published: the router indexes prefixes, and the KV
anchor is what decides whether a prefix is held.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from kvcr.domain.keys import router_id_signed
from kvcr.integrations.shared.page_tokens import CapturedPage
from kvcr.ports.inventory import InventoryEvent, InventoryKind, KvEventPublisher

log = logging.getLogger(__name__)

MEDIUM = "CPU_TIER1"
"""The storage medium every event names.

Dynamo 1.6.1 and 1.7 map ``CPU``, ``CPU_PINNED`` and ``CPU_TIER1`` to their host tier (``DISK``,
``NVME`` and ``CPU_TIER2`` to disk, ``EXTERNAL``/``REMOTE``/``SHARED`` to external, anything
GPU-like or absent to device). kvcr's pages sit in host DRAM that kvcr owns, which is what the
host tier means, and it is the right tier for three reasons:

- the router builds hints only from device and host residency, never from disk or external;
- its cost model credits host hits at the host weight (0.75 by default), disk at 0.25;
- Dynamo's relay counts stores per (DP rank, tier, block): when kvcr's events share SGLang's own
  stream (``engine_kv_events``), SGLang's ``BlockRemoved`` for an L2 eviction only lowers the
  count of a page kvcr also stored, and the page stays routable and hintable until kvcr's own
  ``BlockRemoved``. (SGLang labels its L2 ``CPU``; ``CPU_TIER1`` keeps kvcr's events
  distinguishable in captures and logs.)

Not ``EXTERNAL``: the bytes belong to this worker, not to a shared pool.
"""


class PageTokens(Protocol):
    def page(self, page_hash_hex: str) -> CapturedPage | None:
        """A page's token ids and parent, or None when they are unknown."""


class DynamoInventorySink:
    """An InventorySink that publishes the KV anchor pool's residency as Dynamo KV events.

    Args:
        publisher: where the event batches go (one batch per runner event).
        block_size: tokens per page; must equal the block size the worker registered with the router.
        tokens: the page-token registry the SGLang plugin fills.
        pool: the pool whose residency is published (the KV anchor).
        medium: the storage medium named in the events (see ``MEDIUM``).
    """

    def __init__(
        self,
        publisher: KvEventPublisher,
        *,
        block_size: int,
        tokens: PageTokens,
        pool: str = "kv",
        medium: str = MEDIUM,
        shared_stream: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.publisher = publisher
        self._block_size = block_size
        self._tokens = tokens
        self._pool = pool
        self._medium = medium
        self._shared_stream = shared_stream
        self._lock = threading.Lock()
        self._closed = False
        self._warned_unplaced = False
        # The router ids this sink announced and has not removed: a removal names only these. On
        # SGLang's own stream Dynamo counts stores per block and tier, so removing a page kvcr never
        # announced (its tokens were unknown) would take away a count of SGLang's own L2 copy.
        self._announced: set[int] = set()
        self._counts = {
            "stored_pages": 0,
            "removed_pages": 0,
            "cleared": 0,
            "skipped_pages": 0,
            "side_pool_events": 0,
        }

    def publish(self, event: InventoryEvent) -> None:
        if event.kind is InventoryKind.CLEARED:
            self._clear()
        elif event.pool != self._pool:
            self._count("side_pool_events", 1)
        elif event.kind is InventoryKind.STORED:
            self._stored(event)
        elif event.kind is InventoryKind.REMOVED and event.page_hashes:
            with self._lock:
                hashes = [h for page in event.page_hashes if (h := router_id_signed(page)) in self._announced]
                self._announced.difference_update(hashes)
            if hashes:
                self._send(
                    {"type": "BlockRemoved", "block_hashes": hashes, "medium": self._medium},
                    "removed_pages",
                    len(hashes),
                )

    def _stored(self, event: InventoryEvent) -> None:
        hashes: list[int] = []
        token_ids: list[int] = []
        parent = event.parent
        for page in event.page_hashes:
            captured = self._tokens.page(page)
            why = None
            if captured is None or len(captured.tokens) != self._block_size:
                why = "their token ids are unknown"
            elif not hashes and parent is None:
                # The runner knows a parent only when SGLang passed prefix keys; the capture may
                # know it anyway (a later batch of one backup), or know that the page is a root.
                if captured.placed:
                    parent = captured.parent
                else:
                    why = "where they hang in the prefix tree is unknown"
                    self._warn_unplaced()
            if why is not None:
                skipped = len(event.page_hashes) - len(hashes)
                self._count("skipped_pages", skipped)
                log.debug("kvcr: %d stored pages left out of the KV events from %s on: %s", skipped, page[:16], why)
                break
            assert captured is not None
            hashes.append(router_id_signed(page))
            token_ids.extend(captured.tokens)
        if not hashes:
            return
        with self._lock:
            self._announced.update(hashes)
        stored: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": router_id_signed(parent) if parent is not None else None,
            "token_ids": token_ids,
            "block_size": self._block_size,
            "lora_id": None,
            "medium": self._medium,
        }
        self._send(stored, "stored_pages", len(hashes))

    def _warn_unplaced(self) -> None:
        if not self._warned_unplaced:
            self._warned_unplaced = True
            log.warning(
                "kvcr: backed-up pages whose parent page is unknown are left out of the KV events (the router "
                'could not place them); add "hicache_storage_pass_prefix_keys": true to the storage extra config'
            )

    def _send(self, event: dict[str, Any], counter: str, amount: int) -> None:
        if self._closed:
            return
        self.publisher.publish([event])
        self._count(counter, amount)

    def _count(self, counter: str, amount: int) -> None:
        with self._lock:
            self._counts[counter] += amount

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _clear(self) -> None:
        """Everything this sink announced is gone: ``AllBlocksCleared`` on a stream of kvcr's own.

        On an engine's stream (``shared_stream``) that event would also clear the engine's own
        blocks, in every tier: there the announced pages are removed by name instead.
        """
        with self._lock:
            announced, self._announced = sorted(self._announced), set()
        if not self._shared_stream:
            self._send({"type": "AllBlocksCleared"}, "cleared", 1)
        elif announced:
            removed = {"type": "BlockRemoved", "block_hashes": announced, "medium": self._medium}
            self._send(removed, "removed_pages", len(announced))
            self._count("cleared", 1)

    def close(self) -> None:
        """Tell the router this DRAM is gone (see ``_clear``), then close the publisher."""
        if self._closed:
            return
        self._clear()
        self._closed = True
        self.publisher.close()


if TYPE_CHECKING:
    from kvcr.ports.inventory import InventorySink

    def _conforms(publisher: KvEventPublisher, tokens: PageTokens) -> InventorySink:
        return DynamoInventorySink(publisher, block_size=16, tokens=tokens)
