"""kvcr's DRAM residency on SGLang's own KV-event stream, so any router that reads SGLang's events sees the tier.

Under ``python -m dynamo.sglang`` the worker relays exactly one event stream per DP rank to the
router: the ZMQ PUB that SGLang's scheduler binds for ``--kv-events-config``. SGLang publishes its
GPU and host (L2) blocks there and removes a block when its host pool evicts it, so a prefix that
only kvcr's DRAM still holds would be forgotten by the router. kvcr therefore puts its own
``BlockStored`` / ``BlockRemoved`` events (the Dynamo inventory sink's, with kvcr's own medium)
into that same publisher: one sequence, one replay buffer, the worker's own identity and DP rank,
no second socket for Dynamo to learn about and nothing for the operator to configure.

The scheduler builds its publisher (``SchedulerKvEventsPublisher.init_kv_events``) after the
cache, and kvcr may start before or after it; kvcr's plugin hands the publisher over with
:func:`engine_publisher_ready` and every :class:`EngineEventStream` of the process binds to it.
Batches published before that are held (bounded) and sent in order once it is bound; kvcr's
DRAM is empty until the first backup, so in practice nothing waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

MAX_HELD_BATCHES = 65_536
"""Batches kept while SGLang's publisher is not there yet; past this the oldest go (counted, logged)."""

_lock = threading.Lock()
_publisher: Any = None
_streams: list[EngineEventStream] = []


def engine_publisher_ready(publisher: Any) -> None:
    """SGLang's scheduler built its KV-event publisher (None: this rank publishes none)."""
    global _publisher
    if publisher is None:
        return
    with _lock:
        _publisher = publisher
        streams = list(_streams)
    for stream in streams:
        stream.bind(publisher)


def engine_publishes_events() -> bool:
    """Whether this process's SGLang scheduler publishes KV events (``--kv-events-config``, its publisher rank)."""
    try:
        from sglang.srt.disaggregation.kv_events import is_kv_publisher_rank
        from sglang.srt.runtime_context import get_observability

        return bool(is_kv_publisher_rank(get_observability().kv_events_config))
    except Exception:  # not inside an SGLang scheduler (tests, tools), or a SGLang without these
        return False


class EngineEventStream:
    """A ``KvEventPublisher`` that hands kvcr's event maps to SGLang's scheduler publisher. Thread-safe.

    Each batch becomes one ``KVEventBatch`` of SGLang's own event structs; the publisher stamps
    its DP rank, numbers it in its sequence and sends it from its own thread, so ``publish`` only
    converts and enqueues.
    """

    def __init__(self, max_held: int = MAX_HELD_BATCHES) -> None:
        self._lock = threading.Lock()
        self._publisher: Any = None
        self._held: deque[list[dict[str, Any]]] = deque()
        self._max_held = max_held
        self._closed = False
        self.dropped = 0
        with _lock:
            _streams.append(self)
            publisher = _publisher
        if publisher is not None:
            self.bind(publisher)

    @property
    def bound(self) -> bool:
        return self._publisher is not None

    def bind(self, publisher: Any) -> None:
        """Send through ``publisher`` from now on; what was held goes first, in order."""
        with self._lock:
            if self._closed or self._publisher is publisher:
                return
            self._publisher = publisher
            held, self._held = list(self._held), deque()
            for events in held:
                self._send(publisher, events)
        log.info("kvcr: kvcr's residency events go out on SGLang's own KV-event stream")

    def publish(self, events: list[dict[str, Any]]) -> None:
        with self._lock:
            if self._closed:
                return
            if self._publisher is not None:
                self._send(self._publisher, events)
                return
            if len(self._held) >= self._max_held:
                self._held.popleft()
                self.dropped += 1
                if self.dropped == 1:
                    log.error(
                        "kvcr: SGLang's KV-event publisher is not there and %d batches are waiting: the oldest "
                        "are dropped (the router may not learn of some kvcr pages)",
                        self._max_held,
                    )
            self._held.append(events)

    def _send(self, publisher: Any, events: list[dict[str, Any]]) -> None:
        try:
            publisher.publish(engine_batch(events))
        except Exception:  # a closed or odd publisher: the router misses these, SGLang keeps serving
            self.dropped += 1
            log.warning("kvcr: SGLang's KV-event publisher refused a batch of kvcr's events", exc_info=True)

    def close(self) -> None:
        """Stop sending (SGLang's scheduler owns the socket and closes it itself). Idempotent."""
        with self._lock:
            self._closed = True
            self._held.clear()
        with _lock:
            if self in _streams:
                _streams.remove(self)


def engine_batch(events: list[dict[str, Any]]) -> Any:
    """kvcr's event maps as SGLang's ``KVEventBatch`` of its own structs (the DP rank is the publisher's)."""
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    structs: list[Any] = []
    for event in events:
        kind = event.get("type")
        if kind == "BlockStored":
            structs.append(
                BlockStored(
                    block_hashes=list(event["block_hashes"]),
                    parent_block_hash=event.get("parent_block_hash"),
                    token_ids=list(event["token_ids"]),
                    block_size=int(event["block_size"]),
                    lora_id=event.get("lora_id"),
                    medium=event.get("medium"),
                )
            )
        elif kind == "BlockRemoved":
            structs.append(BlockRemoved(block_hashes=list(event["block_hashes"]), medium=event.get("medium")))
        elif kind == "AllBlocksCleared":
            structs.append(AllBlocksCleared())
        else:
            raise ValueError(f"not a KV event kvcr publishes: {kind!r}")
    return KVEventBatch(ts=time.time(), events=structs)


def _reset_for_tests() -> None:
    global _publisher
    with _lock:
        _publisher = None
        _streams.clear()
