"""The lease book between an engine's hit query and its prefetch reads.

An engine asks "how many pages can you restore?" (hit query) before it allocates host pages and
reads them (prefetch). For pages a peer holds, kvcr leases them at hit-query time, so the count
it answers is exact, and reads under that lease at prefetch time with no control traffic. The
book holds those leases between the two calls, keyed by (pool, page):

- a page already held by a live lease is never leased again (repeated or concurrent queries);
- pages an engine will not read are released as soon as that is known: when the engine cuts the
  hit (``trim``: SGLang's MIN all-reduce across ranks), when the request's prefetch ends or is
  revoked (``finish``), and when a lease can no longer be read in time (``sweep``, run on every
  call);
- a lease is released (one-way) once every page it holds was read or dropped.

A page leased and never read is a source's work for nothing, and a prefix the target then
recomputed: each is counted in ``kvcr_unread_pages_total{reason}`` (``trimmed``: the engine cut
the hit; ``prefetch_ended``: the engine ended the request's prefetch before reading them, e.g.
its prefetch policy stopped waiting; ``expired``: the lease ran out before the read), and the
first ``trimmed`` or ``prefetch_ended`` in an interval is logged with what to do about it (an
expiry is found by the sweep, under the book's lock, and only counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvcr.ports.metric_catalogue import MetricName, UnreadReason
from kvcr.ports.metrics import Metrics
from kvcr.runner.peer_client import PeerClient, RemoteLease

log = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0
_ADVICE = {
    UnreadReason.TRIMMED: (
        "SGLang cut the hit: another rank of this engine held fewer pages (the MIN across ranks) or the host "
        "pool had room for fewer"
    ),
    UnreadReason.PREFETCH_ENDED: (
        "SGLang ended the request's prefetch before reading them; with hicache_storage_prefetch_policy "
        "best_effort a busy scheduler does not wait: run timeout (its default) and keep prefetch_timeout_base "
        "above a peer's first contact"
    ),
}

Page = tuple[str, str]  # (pool, page hash)


@dataclass
class _Held:
    lease: RemoteLease
    pending: set[Page] = field(default_factory=set)
    request: str | None = None


class PrefetchBook:
    """Remote leases taken at hit-query time, waiting for the reads. Thread-safe."""

    def __init__(self, client: PeerClient, metrics: Metrics | None = None) -> None:
        self._client = client
        self._metrics = metrics
        self._logged: dict[UnreadReason, float] = {}
        self._lock = threading.Lock()
        self._pages: dict[Page, _Held] = {}
        self._requests: dict[str, set[int]] = {}
        self._by_id: dict[int, _Held] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)

    def held(self, pool: str, page: str) -> RemoteLease | None:
        """The live lease holding ``(pool, page)``, if any."""
        with self._lock:
            self._sweep()
            held = self._pages.get((pool, page))
            return held.lease if held is not None else None

    def booked(self, pool: str, pages: Sequence[str]) -> list[bool]:
        """Per page: whether a live lease holds ``(pool, page)``; one sweep and one lock for the batch."""
        with self._lock:
            self._sweep()
            return [(pool, page) in self._pages for page in pages]

    def add(self, lease: RemoteLease, pages: Iterable[Page], request: str | None) -> None:
        """Book ``pages`` of ``lease`` for a later read; pages already booked elsewhere are not taken twice."""
        release = False
        with self._lock:
            self._sweep()
            held = _Held(lease, request=request)
            for item in pages:
                if item not in self._pages and lease.holds(*item):
                    held.pending.add(item)
                    self._pages[item] = held
            if held.pending:
                self._by_id[id(held)] = held
                if request is not None:
                    self._requests.setdefault(request, set()).add(id(held))
            else:
                release = True
        if release:
            self._client.release(lease)

    def take(self, pages: Sequence[Page]) -> list[tuple[RemoteLease, list[Page]]]:
        """Group booked ``pages`` by the lease holding them (the caller reads, then calls ``done``)."""
        groups: dict[int, tuple[RemoteLease, list[Page]]] = {}
        with self._lock:
            self._sweep()
            for item in pages:
                held = self._pages.get(item)
                if held is not None:
                    groups.setdefault(id(held), (held.lease, []))[1].append(item)
        return list(groups.values())

    def done(self, pages: Iterable[Page]) -> None:
        """These pages were read (or will not be): drop them, releasing leases left with nothing."""
        self._drop(pages)

    def trim(self, request: str, keep: Sequence[str]) -> None:
        """The engine will read at most ``keep`` of ``request``'s pages: drop the rest of its bookings."""
        keep_set = set(keep)
        with self._lock:
            items = [
                item
                for hid in self._requests.get(request, ())
                for item in self._by_id[hid].pending
                if item[1] not in keep_set
            ]
        self._unread(self._drop(items), UnreadReason.TRIMMED)

    def finish(self, request: str) -> None:
        """``request``'s prefetch ended (done, revoked or terminated): release everything it still books."""
        with self._lock:
            items = [item for hid in self._requests.pop(request, ()) for item in self._by_id[hid].pending]
        self._unread(self._drop(items), UnreadReason.PREFETCH_ENDED)

    def close(self) -> None:
        """Release every lease."""
        with self._lock:
            leases = [h.lease for h in self._by_id.values()]
            self._pages.clear()
            self._by_id.clear()
            self._requests.clear()
        for lease in leases:
            self._client.release(lease)

    # ------------------------------------------------------------------ internals

    def _unread(self, pages: int, reason: UnreadReason) -> None:
        """Count ``pages`` leased and never read; log the first of ``reason`` in an interval."""
        if not pages:
            return
        if self._metrics is not None:
            self._metrics.increment(MetricName.UNREAD_PAGES, pages, {"reason": reason})
        now = time.monotonic()
        with self._lock:
            quiet = now - self._logged.get(reason, -_LOG_EVERY_S) < _LOG_EVERY_S
            if not quiet:
                self._logged[reason] = now
        if not quiet:
            log.info("kvcr: %d pages leased from a peer were never read (%s): %s", pages, reason.value, _ADVICE[reason])

    def _drop(self, pages: Iterable[Page]) -> int:
        """Drop booked pages; how many were still booked."""
        finished: list[RemoteLease] = []
        dropped = 0
        with self._lock:
            for item in pages:
                held = self._pages.get(item)
                if held is None:
                    continue
                dropped += 1
                del self._pages[item]
                held.pending.discard(item)
                if not held.pending:
                    finished.append(held.lease)
                    self._forget(held)
        for lease in finished:
            self._client.release(lease)
        return dropped

    def _sweep(self) -> None:
        """Forget leases that can no longer be read in time (caller holds the lock)."""
        dead = [h for h in self._by_id.values() if not self._client.alive(h.lease)]
        expired = 0
        for held in dead:
            for item in held.pending:
                if self._pages.get(item) is held:
                    del self._pages[item]
                    expired += 1
            held.pending.clear()
            self._forget(held)
            held.lease.released = True  # expired at the source too: nothing to send
        if expired and self._metrics is not None:  # the lock is held: count now, log nothing here
            self._metrics.increment(MetricName.UNREAD_PAGES, expired, {"reason": UnreadReason.EXPIRED})

    def _forget(self, held: _Held) -> None:
        self._by_id.pop(id(held), None)
        if held.request is not None:
            ids = self._requests.get(held.request)
            if ids is not None:
                ids.discard(id(held))
                if not ids:
                    del self._requests[held.request]
