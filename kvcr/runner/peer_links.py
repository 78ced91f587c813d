"""A target's sessions with its sources: one link per source, its control calls, its down-time, its rate.

A link is what HELLO established with one source: the session id the source bound to our
connection, the source's incarnation, the pools we share (checked against our own pools), and the
data-plane peer we connected. Links are cached (bounded LRU, idle ones closed), and a source that
fails in any way (no answer, a refusal, a reply that does not answer our request, a failed read)
is skipped for ``retry_after_s`` with its link, control connection and data-plane peer dropped:
a sick source costs misses, never waits.

Every control round trip goes through ``call``, which binds a reply to the request's nonce and
turns every failure into None.

Names: a source chooses the name its data-plane description claims, and a data plane keys its
peers (and replaces one) by that name. So each name belongs to the description the endpoint whose
authenticated HELLO brought it first connected, until the last link using it is dropped: a source
at another endpoint claiming it with another description is refused before that description is
connected (``name_in_use``), so a link never reads from a peer that another endpoint's source put
in its place. The same description at another endpoint (one source reached at two addresses)
changes nothing in the plane, and both links share its peer.

Side links: when the data plane also carries control frames to a peer (``SideChannel``: the
same-host plane's UNIX socket), the link says HELLO a second time over it, and the session that
opens (bound to the side link) carries LEASE and RELEASE there: a UNIX-socket round trip instead of
a CURVE one. Anything that fails on the side link fails the way the control channel would.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvcr.domain.board import BoardLayout, board_layout
from kvcr.domain.deadlines import Timing
from kvcr.domain.pools import PoolSpec
from kvcr.ports.clock import Clock
from kvcr.ports.control import ControlChannel
from kvcr.ports.dataplane import DataPlane, PeerInfo, SideChannel
from kvcr.ports.errors import PeerRefused, PeerUnavailable, TransportError
from kvcr.ports.metric_catalogue import FailureReason, Path, Result
from kvcr.ports.metric_catalogue import MetricName as M
from kvcr.ports.metrics import Metrics
from kvcr.runner import protocol
from kvcr.runner.protocol import NONCE_BYTES, Hello, HelloReply, Lease, PoolWire, RefusalCode, Refused

log = logging.getLogger(__name__)

_RATE_WEIGHT = 0.3  # EWMA weight of the newest read in a link's throughput estimate
SIDE_LEASE_PAGES = 1024  # larger leases go over the control channel (their reply may not fit a side frame)


@dataclass
class Link:
    """One source as HELLO described it."""

    endpoint: str
    session: int
    incarnation: str
    peer: PeerInfo
    pools: dict[str, PoolWire]
    staged: bool
    last_used: float
    bytes_per_s: float = 0.0  # 0: no estimate yet
    side_session: int = 0  # the session HELLO opened over the data plane's side link (0: none)

    def lease_session(self, pages: int) -> int:
        """The session a LEASE of ``pages`` pages goes under: the side link's when it has one and they fit."""
        return self.side_session if self.side_session and pages <= SIDE_LEASE_PAGES else self.session

    def learn_rate(self, nbytes: int, elapsed: float) -> None:
        """Fold one completed read into the throughput estimate."""
        if elapsed <= 0 or nbytes <= 0:
            return
        rate = nbytes / elapsed
        self.bytes_per_s = rate if not self.bytes_per_s else (1 - _RATE_WEIGHT) * self.bytes_per_s + _RATE_WEIGHT * rate


Granted = tuple[list[str], Sequence[int], Sequence[bytes]]
"""One pool of a lease: the pages as asked and, in that order, their source slots (-1: not granted)
and digests (empty: none)."""


@dataclass
class RemoteLease:
    """Pages a source holds for us until ``sent_at + ttl - margin`` on our clock."""

    endpoint: str
    lease_id: int
    sent_at: float
    ttl_s: float
    # Per pool, what was asked and granted, in the order asked: a read of the pages in that order
    # looks nothing up page by page, and no per-page map is built unless something asks by key.
    order: dict[str, Granted]
    link: Link | None = None
    released: bool = False
    session: int = 0  # the session it was granted under (its RELEASE goes under the same one)
    # Found on the source's slot board instead of leased (nothing pinned, nothing to RELEASE): per
    # pool, the slots as found (``order``'s) and their generations; a page whose slot moved on
    # during the read is a miss.
    board: dict[str, tuple[Sequence[int], Sequence[int]]] | None = None

    @functools.cached_property
    def slots(self) -> dict[tuple[str, str], int]:
        """(pool, page hash) -> source slot, for the pages granted."""
        return {
            (pool, page): slot
            for pool, (pages, slots, _) in self.order.items()
            for page, slot in zip(pages, slots, strict=True)
            if slot >= 0
        }

    @functools.cached_property
    def digests(self) -> dict[tuple[str, str], bytes]:
        """(pool, page hash) -> the digest the source vouched for, for the pages granted."""
        return {
            (pool, page): digest
            for pool, (pages, slots, digests) in self.order.items()
            for page, slot, digest in zip(pages, slots, digests, strict=True)
            if slot >= 0
        }

    @property
    def held_pages(self) -> int:
        """How many pages the source granted."""
        return sum(len(slots) - slots.count(-1) for _, slots, _ in self.order.values())

    def holds(self, pool: str, page_hash: str) -> bool:
        return (pool, page_hash) in self.slots

    def granted(self, pool: str, pages: Sequence[str]) -> tuple[Sequence[int], Sequence[bytes]]:
        """Per page of ``pool``, its source slot (-1 where not leased) and digest (empty where none)."""
        asked = self.order.get(pool)
        if asked is not None and (asked[0] == pages or (not isinstance(pages, list) and asked[0] == list(pages))):
            return asked[1], asked[2]
        slots, digests = self.slots, self.digests
        keys = [(pool, page) for page in pages]
        return [slots.get(key, -1) for key in keys], [digests.get(key, b"") for key in keys]

    def usable_until(self, margin_s: float) -> float:
        """The last moment (our clock) a read under this lease may finish."""
        return self.sent_at + self.ttl_s - margin_s


@functools.lru_cache(maxsize=64)
def board_layout_of(slots: int) -> BoardLayout:
    """The layout of a source's board of ``slots`` slots, computed once per size (every board read needs it)."""
    return board_layout(slots)


def count_failure(metrics: Metrics, reason: FailureReason) -> None:
    """One failure of the remote-restore path."""
    metrics.increment(M.FAILURES, 1, {"path": Path.REMOTE_RESTORE, "reason": reason})


def count_miss(metrics: Metrics, reason: FailureReason, pages: int) -> None:
    """A failure that made ``pages`` pages misses."""
    count_failure(metrics, reason)
    metrics.increment(M.PAGES, pages, {"path": Path.REMOTE_RESTORE, "outcome": Result.MISS})


class SourceLinks:
    """Links to sources, by control endpoint. Thread-safe.

    Args:
        namespaces: our pools' namespaces (what HELLO offers, and what a source's pools must match).
        specs: our pools, by name (a source's pool description must fit ours to be read from).
        landing: ``auto``, ``direct`` or ``staged`` (see PeerSettings).
    """

    def __init__(
        self,
        control: ControlChannel,
        data_plane: DataPlane,
        clock: Clock,
        metrics: Metrics,
        *,
        timing: Timing,
        namespaces: dict[str, str],
        specs: dict[str, PoolSpec],
        landing: str,
        max_links: int,
        link_idle_s: float,
    ) -> None:
        self._control = control
        self._data_plane = data_plane
        self._side = data_plane if isinstance(data_plane, SideChannel) else None
        self._clock = clock
        self._metrics = metrics
        self._timing = timing
        self._namespaces = namespaces
        self._specs = specs
        self._landing = landing
        self._max_links = max_links
        self._link_idle_s = link_idle_s
        self.incarnation = secrets.token_hex(16)
        self._links: OrderedDict[str, Link] = OrderedDict()
        self._down_until: dict[str, float] = {}
        self._connecting: dict[str, threading.Event] = {}  # one HELLO and connect per endpoint at a time
        self._kept: set[str] = set()  # endpoints connected ahead of need: never closed for idling
        # data-plane peer name -> the description connected under it, and the endpoints whose links use it
        self._names: dict[str, tuple[bytes, set[str]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._links)

    def get(self, endpoint: str, deadline: float) -> Link | None:
        """The link to ``endpoint``: cached, or made now (HELLO, then the data plane); None on any failure.

        One caller at a time makes a link to an endpoint; another that asks meanwhile (a hit query
        while the link is connected ahead of need) waits for it, within its own deadline.
        """
        while True:
            now = self._clock.now()
            with self._lock:
                link = self._links.get(endpoint)
                if link is not None:
                    link.last_used = now
                    self._links.move_to_end(endpoint)
                    return link
                if now < self._down_until.get(endpoint, 0.0):
                    return None
                pending = self._connecting.get(endpoint)
                if pending is None:
                    mine = self._connecting[endpoint] = threading.Event()
            if pending is None:
                break
            if not pending.wait(max(0.0, deadline - now)):
                return None
        try:
            return self._connect(endpoint, deadline, now)
        finally:
            with self._lock:
                del self._connecting[endpoint]
            mine.set()

    def keep(self, endpoint: str) -> None:
        """Never close the link to ``endpoint`` for idling (it was connected ahead of need)."""
        with self._lock:
            self._kept.add(endpoint)

    def _connect(self, endpoint: str, deadline: float, now: float) -> Link | None:
        self._close_idle(now)
        nonce = secrets.token_bytes(NONCE_BYTES)
        hello = Hello(nonce, self._data_plane.name, self.incarnation, dict(self._namespaces))
        reply = self.call(endpoint, hello, nonce, deadline)
        if not isinstance(reply, HelloReply):
            if isinstance(reply, Refused) and reply.code == RefusalCode.NAMESPACE:
                self.mark_down(endpoint, "no pool namespace in common")
            return None
        mine = self._namespaces
        # Checked here too: a peer that shares no namespace with us must never get a link; nor may a
        # pool description that does not fit our pool (reads are planned from its regions and sizes).
        pools = {p.name: p for p in reply.pools if mine.get(p.name) == p.namespace and self._fits(p)}
        if not pools:
            self.mark_down(endpoint, "no pool namespace in common")
            return None
        try:
            name = self._data_plane.peer_name(reply.data_plane)
        except TransportError as exc:
            self.mark_down(endpoint, f"cannot connect its data plane: {exc}")
            return None
        if not self._claim(name, endpoint, reply.data_plane):
            count_failure(self._metrics, FailureReason.NAME_IN_USE)
            self.mark_down(endpoint, f"its data-plane name {name[:80]!r} is held by another source's link")
            return None
        try:
            timeout = min(self._timing.connect_s, max(0.0, deadline - self._clock.now()))
            peer = self._data_plane.connect(reply.data_plane, timeout)
        except TransportError as exc:
            self._unclaim(name, endpoint)
            self.mark_down(endpoint, f"cannot connect its data plane: {exc}")
            return None
        if peer.name != name:  # the plane keys the peer by what it connected: never a name we did not bind
            self._unclaim(name, endpoint)
            self.mark_down(endpoint, "its data plane connected under another name than it described")
            return None
        landing = self._landing
        staged = landing == "staged" or (landing == "auto" and peer.late_writes)
        link = Link(endpoint, reply.session, reply.incarnation, peer, pools, staged, self._clock.now())
        self._open_side(link, deadline)
        evicted: list[tuple[str, Link]] = []
        with self._lock:
            self._links[endpoint] = link
            while len(self._links) > self._max_links:
                oldest = next(iter(self._links))
                evicted.append((oldest, self._links.pop(oldest)))
        for old, old_link in evicted:
            self._drop(old, old_link)  # both halves: the control connection and the data-plane peer
        return link

    def _claim(self, name: str, endpoint: str, description: bytes) -> bool:
        """Bind ``name`` to ``endpoint``'s link; False if another endpoint's link uses it with another description."""
        with self._lock:
            held = self._names.get(name)
            if held is None or held[1] <= {endpoint}:
                self._names[name] = (description, {endpoint})
                return True
            if held[0] != description:
                return False
            held[1].add(endpoint)
            return True

    def _unclaim(self, name: str, endpoint: str) -> bool:
        """Unbind ``name`` from ``endpoint``; True when no link uses it any more (its data-plane peer may go)."""
        with self._lock:
            held = self._names.get(name)
            if held is None:
                return True
            held[1].discard(endpoint)
            if held[1]:
                return False
            del self._names[name]
            return True

    def _open_side(self, link: Link, deadline: float) -> None:
        """HELLO over the data plane's side link, if it has one to this peer; the link keeps the session."""
        timeout = min(self._timing.control_s, deadline - self._clock.now())
        if self._side is None or timeout <= 0:
            return
        nonce = secrets.token_bytes(NONCE_BYTES)
        hello = Hello(nonce, self._data_plane.name, self.incarnation, dict(self._namespaces))
        try:
            frame = self._side.side_request(link.peer.name, protocol.encode(hello), timeout)
            reply = protocol.decode(frame) if frame is not None else None
        except (TransportError, protocol.FrameError) as exc:
            log.info("kvcr: no side link to %s (%s); leases go over the control channel", link.endpoint, exc)
            return
        if isinstance(reply, HelloReply) and reply.nonce == nonce and reply.incarnation == link.incarnation:
            link.side_session = reply.session

    def call(
        self, endpoint: str, request: Hello | Lease, nonce: bytes, deadline: float, link: Link | None = None
    ) -> object:
        """One round trip, bounded by the control deadline; None (peer marked down) on failure.

        A LEASE under ``link``'s side session goes over its side link. A side link found closed
        (its source closed or died) sends the LEASE over the control channel instead: a source
        restarted at the endpoint answers that it does not know the session (the caller says HELLO
        again, at once), and a dead one fails as over the control channel."""
        timeout = min(self._timing.control_s, deadline - self._clock.now())
        if timeout <= 0:
            return None
        try:
            payload = protocol.encode(request)
            frame = None
            side = link is not None and isinstance(request, Lease) and request.session == link.side_session
            if side and link is not None and link.side_session and self._side is not None:
                try:
                    frame = self._side.side_request(link.peer.name, payload, timeout)
                except PeerUnavailable as exc:
                    log.info("kvcr: the side link to %s is closed (%s); asking over the control channel", endpoint, exc)
                    timeout = min(self._timing.control_s, deadline - self._clock.now())
                    if timeout <= 0:
                        return None
            if frame is None:
                frame = self._control.request(endpoint, payload, timeout)
            reply = protocol.decode(frame)
        except protocol.FrameError:
            self.mark_down(endpoint, "unreadable reply")
            return None
        except PeerRefused as exc:
            self.mark_down(endpoint, f"refused: {exc}")
            return None
        except TransportError as exc:
            self.mark_down(endpoint, str(exc))
            return None
        if isinstance(reply, Refused):
            count_failure(self._metrics, FailureReason.PEER_REFUSED)
            if reply.code != RefusalCode.UNKNOWN_SESSION:
                self.mark_down(endpoint, f"refused ({_refusal_name(reply.code)})")
            return reply
        if getattr(reply, "nonce", None) != nonce:
            # A reply to another request (or a replayed one): never act on it.
            count_failure(self._metrics, FailureReason.UNBOUND_REPLY)
            self.mark_down(endpoint, "reply does not answer our request")
            return None
        return reply

    def send_release(self, link: Link, lease_id: int, session: int = 0) -> None:
        """RELEASE one lease granted under ``session`` (default: the link's), one-way (best effort: it also expires)."""
        if not lease_id:
            return
        session = session or link.session
        payload = protocol.encode(protocol.Release(session, [lease_id]))
        if session == link.side_session and self._side is not None and self._side.side_send(link.peer.name, payload):
            return
        self._control.send(link.endpoint, payload)

    def send_served(self, link: Link, pages: list[tuple[int, int]]) -> None:
        """SERVED over the side link, one-way: (pool id, pages) taken from the source's boards.

        A source believes at most a pool's slots per entry and reads at most ``MAX_POOLS`` entries
        of a frame, but a report gathers every restore of its interval: larger counts go as several
        entries, and as several frames when they do not fit one.
        """
        if not link.side_session or self._side is None:
            return
        slots = {wire.pool_id: wire.slots for wire in link.pools.values()}
        entries: list[tuple[int, int]] = []
        for pool_id, count in pages:
            most = max(slots.get(pool_id, count), 1)
            entries += [(pool_id, min(most, count - at)) for at in range(0, count, most)]
        for at in range(0, len(entries), protocol.MAX_POOLS):
            frame = protocol.Served(link.side_session, entries[at : at + protocol.MAX_POOLS])
            self._side.side_send(link.peer.name, protocol.encode(frame))

    def newer(self, link: Link) -> Link | None:
        """The link of a newer incarnation that answered HELLO at ``link``'s endpoint since, if any."""
        with self._lock:
            current = self._links.get(link.endpoint)
        if current is None or current is link or current.incarnation == link.incarnation:
            return None
        return current

    def mark_down(self, endpoint: str, why: str, failed: Link | None = None) -> None:
        """Skip ``endpoint`` for ``retry_after_s`` and drop its link, control connection and data-plane peer.

        ``failed``: the link a failed read used. When a newer incarnation of the source answered HELLO
        since, the failure is its predecessor's: only the old data-plane peer is disconnected (when the
        transport names the two apart), and the new process is neither skipped nor dropped.
        """
        newer = self.newer(failed) if failed is not None else None
        if failed is not None and newer is not None:
            log.info(
                "kvcr: a read from %s's previous incarnation failed (%s); its new one is not skipped", endpoint, why
            )
            if failed.peer.name != newer.peer.name and self._unclaim(failed.peer.name, endpoint):
                with contextlib.suppress(TransportError):
                    self._data_plane.disconnect(failed.peer.name)
            return
        retry_after_s = self._timing.retry_after_s
        log.info("kvcr: peer %s skipped for %.1fs: %s", endpoint, retry_after_s, why)
        count_failure(self._metrics, FailureReason.PEER_UNAVAILABLE)
        with self._lock:
            link = self._links.pop(endpoint, None)
            now = self._clock.now()
            self._down_until[endpoint] = now + retry_after_s
            self._down_until = {e: t for e, t in self._down_until.items() if t > now}
            down = len(self._down_until)
        self._metrics.set_gauge(M.PEERS_QUARANTINED, down)
        if link is not None:
            self._drop(endpoint, link)

    def forget(self, endpoint: str) -> None:
        """Drop the link to ``endpoint`` (if any) without skipping it: the next call says HELLO again."""
        with self._lock:
            link = self._links.pop(endpoint, None)
        if link is not None:
            self._drop(endpoint, link)

    def close(self) -> None:
        """Forget every link (their data-plane peers and control connections)."""
        with self._lock:
            endpoints = list(self._links)
        for endpoint in endpoints:
            self.forget(endpoint)

    def _fits(self, wire: PoolWire) -> bool:
        spec = self._specs.get(wire.name)
        return (
            spec is not None
            and wire.slots > 0
            and len(wire.regions) == len(spec.components)
            and list(wire.pieces) == [c.piece_bytes for c in spec.components]
        )

    def _close_idle(self, now: float) -> None:
        idle: list[tuple[str, Link]] = []
        with self._lock:
            for endpoint, link in list(self._links.items()):
                if now - link.last_used < self._link_idle_s:
                    break  # ordered by use: the rest are fresher
                if endpoint not in self._kept:
                    idle.append((endpoint, self._links.pop(endpoint)))
        for endpoint, link in idle:
            self._drop(endpoint, link)

    def _drop(self, endpoint: str, link: Link | None = None) -> None:
        if link is not None and self._unclaim(link.peer.name, endpoint):  # else another endpoint's link reads it
            with contextlib.suppress(TransportError):
                self._data_plane.disconnect(link.peer.name)
        self._control.forget(endpoint)


def _refusal_name(code: int) -> str:
    try:
        return RefusalCode(code).name.lower()
    except ValueError:
        return "unknown"
