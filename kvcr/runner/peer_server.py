"""The source side of the peer protocol: answers HELLO and LEASE, takes RELEASE.

It runs on the control channel's own thread, so an idle engine keeps serving, and never touches
bytes: a peer reads leased slots through the data plane. HELLO opens a *session*: the pools whose
namespaces match, numbered for the link, and the data-plane description (exposed regions only).
LEASE names that session, so a peer of another namespace can never lease under ours. A session
belongs to the connection whose HELLO opened it: a LEASE or RELEASE naming it from any other
connection (another token holder that learnt the session and lease ids) is refused as an unknown
session and counted as ``foreign_session``, so nobody can end, renew or spend another peer's lease.
Every
failure becomes a REFUSED reply with a code from a closed set (never an exception on the server
thread, never the peer's own text echoed back); refusals are counted by code.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvcr.domain.layout import PieceRun
from kvcr.ports.control import node_of
from kvcr.ports.dataplane import (
    BoundSideLinks,
    DataPlane,
    GuardedReads,
    PeerActivity,
    SharedBoards,
    SideChannel,
)
from kvcr.ports.metric_catalogue import MetricName as M
from kvcr.ports.metric_catalogue import RefusalReason
from kvcr.ports.metrics import Metrics
from kvcr.runner import protocol
from kvcr.runner.board import shares_boards
from kvcr.runner.protocol import (
    MAX_LEASE_MS,
    MAX_LEASE_PAGES,
    MAX_POOLS,
    MAX_RELEASE_IDS,
    NONCE_BYTES,
    FrameError,
    Hello,
    HelloReply,
    Lease,
    LeaseReply,
    PoolWire,
    RefusalCode,
    Refused,
    Release,
    Served,
)
from kvcr.runner.runner import KvcrRunner

log = logging.getLogger(__name__)

MAX_SESSIONS = 4096
MAX_NONCES = 1 << 16  # per session, and for HELLOs: past this a session is dropped (the peer says HELLO again)
# Nonces remembered across all sessions (~100 B each): past this the least recently used sessions
# are dropped, so many busy sessions cannot make the server hold MAX_SESSIONS x MAX_NONCES of them.
MAX_TRACKED_NONCES = 1 << 20
_LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What a source remembers at most, so no peer can make it hold more (tests shrink them).

    max_sessions: open sessions, least recently used dropped first.
    max_nonces: nonces per session, and HELLO nonces: past this a session is dropped (its peer
        says HELLO again) and the oldest HELLO nonces are forgotten.
    max_tracked_nonces: nonces across all sessions.
    max_release_ids: lease ids one RELEASE may name; the rest are ignored.
    """

    max_sessions: int = MAX_SESSIONS
    max_nonces: int = MAX_NONCES
    max_tracked_nonces: int = MAX_TRACKED_NONCES
    max_release_ids: int = MAX_RELEASE_IDS


@dataclass
class _Session:
    sender: str
    connection: bytes  # the connection whose HELLO opened it: the only one that may use it
    holder: int  # the node (or connection) as the runner's lease holder: its quota is shared by its sessions
    pools: dict[int, str]  # pool id on this link -> pool name
    leases: set[int] = field(default_factory=set)
    nonces: set[bytes] = field(default_factory=set)


class PeerServer:
    """Serves this runner's kvcr DRAM to peers under leases.

    Args:
        arena_ids: per physical pool, the data-plane region id of each component's arena region.
    """

    def __init__(
        self,
        runner: KvcrRunner,
        data_plane: DataPlane,
        arena_ids: Mapping[str, Sequence[int]],
        metrics: Metrics,
        *,
        limits: ServerLimits | None = None,
    ) -> None:
        self._runner = runner
        self._limits = limits or ServerLimits()
        self._tracked = 0  # nonces held by the sessions in self._sessions
        self._data_plane = data_plane
        self._metrics = metrics
        self.incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._sessions: OrderedDict[int, _Session] = OrderedDict()
        self._closing = False
        self._last_log = 0.0
        self._hello_nonces: OrderedDict[bytes, None] = OrderedDict()
        arenas = runner.pool_arenas()
        boards = _share_boards(runner, data_plane)
        self._pools: list[PoolWire] = []
        self._region_pool: dict[int, str] = {}
        for pool_id, (name, regions) in enumerate(sorted(arenas.items())):
            ids = list(arena_ids[name])
            namespace = runner.namespaces[name]
            pieces = [r.piece_bytes for r in regions]
            board = boards.get(name, -1)
            self._pools.append(PoolWire(pool_id, name, namespace, ids, pieces, regions[0].count, board))
            self._region_pool.update(dict.fromkeys(ids, name))
        self._activity = data_plane if isinstance(data_plane, PeerActivity) else None
        self._bound = data_plane if isinstance(data_plane, BoundSideLinks) else None
        if isinstance(data_plane, GuardedReads):
            data_plane.guard_reads(self._covered)
        if isinstance(data_plane, SideChannel):
            data_plane.serve_side(self.handle)  # frames over side links, their connection being the link

    def close_to_new_work(self) -> None:
        """Refuse HELLO and LEASE from now on (shutdown); RELEASE keeps working."""
        with self._lock:
            self._closing = True

    def handle(self, frame: bytes, connection: bytes = b"") -> bytes | None:
        """Answer one request frame with one reply frame (None for one-way messages); never raises.

        ``connection`` names the control connection the frame came over (see ``serve_connections``).
        """
        try:
            request = protocol.decode(frame)
        except FrameError as exc:
            return self._refuse(b"", exc.code)
        try:
            if isinstance(request, Release):
                self._release(request, connection)
                return None
            if isinstance(request, Served):
                self._served(request, connection)
                return None
            if isinstance(request, Hello):
                return protocol.encode(self._hello(request, connection))
            if isinstance(request, Lease):
                return protocol.encode(self._lease(request, connection))
            return self._refuse(b"", RefusalCode.MALFORMED)
        except Exception:  # a bug must not kill the server thread; the peer sees a refusal
            log.exception("kvcr peer server: %s failed", type(request).__name__)
            return self._refuse(getattr(request, "nonce", b""), RefusalCode.INTERNAL)

    # ------------------------------------------------------------------ messages

    def _hello(self, request: Hello, connection: bytes) -> HelloReply | Refused:
        if self._closing:
            return self._refusal(request.nonce, RefusalCode.CLOSING)
        if len(request.namespaces) > MAX_POOLS:
            return self._refusal(request.nonce, RefusalCode.TOO_LARGE)
        pools = [p for p in self._pools if request.namespaces.get(p.name) == p.namespace]
        if not pools:
            # Neither side's namespace text goes back: the peer learns only that nothing matched.
            return self._refusal(request.nonce, RefusalCode.NAMESPACE)
        if len(request.nonce) != NONCE_BYTES:
            return self._refusal(request.nonce, RefusalCode.MALFORMED)
        session_id = secrets.randbits(63) | 1
        with self._lock:
            if request.nonce in self._hello_nonces:
                replayed = True
            else:
                replayed = False
                self._hello_nonces[request.nonce] = None
                while len(self._hello_nonces) > self._limits.max_nonces:
                    self._hello_nonces.popitem(last=False)
                pool_ids = {p.pool_id: p.name for p in pools}
                holder = _holder(connection)
                self._sessions[session_id] = _Session(request.sender[:128], connection, holder, pool_ids)
            while len(self._sessions) > self._limits.max_sessions:
                self._drop_oldest_session()
        if replayed:
            return self._refusal(request.nonce, RefusalCode.REPLAYED)
        self._expect_reads()
        lease_ms = round(self._runner.config.timing.lease_s * 1000)
        return HelloReply(request.nonce, session_id, self.incarnation, self._describe_to(connection), pools, lease_ms)

    def _lease(self, request: Lease, connection: bytes) -> LeaseReply | Refused:
        if self._closing:
            return self._refusal(request.nonce, RefusalCode.CLOSING)
        if len(request.nonce) != NONCE_BYTES:
            return self._refusal(request.nonce, RefusalCode.MALFORMED)
        replayed = foreign = False
        with self._lock:
            session = self._sessions.get(request.session)
            if session is not None and session.connection != connection:
                session, foreign = None, True  # its nonces and recency are the owner's: left alone
            if session is not None:
                self._sessions.move_to_end(request.session)
                replayed = request.nonce in session.nonces
                if not replayed:
                    session.nonces.add(request.nonce)
                    self._tracked += 1
                    if len(session.nonces) > self._limits.max_nonces:
                        self._drop_session(request.session)  # the peer opens a fresh session
                    while self._tracked > self._limits.max_tracked_nonces and len(self._sessions) > 1:
                        self._drop_oldest_session()
        if session is None:
            # The same answer as for a session that does not exist: the peer learns nothing from it.
            reason = RefusalReason.FOREIGN_SESSION if foreign else None
            return self._refusal(request.nonce, RefusalCode.UNKNOWN_SESSION, reason)
        if replayed:
            return self._refusal(request.nonce, RefusalCode.REPLAYED)
        if len(request.pages) > MAX_POOLS or sum(len(pages) for _, pages in request.pages) > MAX_LEASE_PAGES:
            return self._refusal(request.nonce, RefusalCode.TOO_LARGE)
        if not 0 < request.lease_ms <= MAX_LEASE_MS:
            return self._refusal(request.nonce, RefusalCode.OUT_OF_RANGE)
        wanted: list[tuple[str, list[str]]] = []
        for pool_id, pages in request.pages:
            name = session.pools.get(pool_id)
            wanted.append((name if name is not None else "", pages))  # "" is no pool: all -1
        grant = self._runner.lease(wanted, request.lease_ms / 1000, holder=session.holder)
        if grant.over_quota:  # granted in part (or not at all): this peer already pins its share
            self._count_refusal(RefusalReason.PEER_QUOTA)
        if grant.lease_id:
            with self._lock:
                session.leases.add(grant.lease_id)
            self._expect_reads()
        return LeaseReply(
            request.nonce,
            grant.lease_id,
            round(grant.ttl_s * 1000),
            [list(s) for s in grant.slots],
            [list(d) for d in grant.digests],
        )

    def _release(self, request: Release, connection: bytes) -> None:
        with self._lock:
            session = self._sessions.get(request.session)
            if session is None:
                return
            if session.connection != connection:
                foreign = True
            else:
                foreign = False
                ids = [i for i in request.lease_ids[: self._limits.max_release_ids] if i in session.leases]
                session.leases.difference_update(ids)
        if foreign:
            self._count_refusal(RefusalReason.FOREIGN_SESSION)  # one-way: nothing goes back
            return
        for lease_id in ids:
            self._runner.release_lease(lease_id)

    def _served(self, request: Served, connection: bytes) -> None:
        """Count pages a same-host peer took from a slot board (only its own session's, only our pools)."""
        with self._lock:
            session = self._sessions.get(request.session)
            if session is None or session.connection != connection:
                return
            pools = [(session.pools.get(pool_id), pages) for pool_id, pages in request.pages[:MAX_POOLS]]
        for name, pages in pools:
            if name is not None:
                self._runner.count_board_reads(name, pages)

    # ------------------------------------------------------------------ helpers

    def _covered(self, lease_id: int, runs: Sequence[PieceRun]) -> bool:
        """Guard for two-sided transports: every piece a peer asks for is under its live lease."""
        held = self._runner.leased_slots(lease_id)
        if held is None:
            return False
        for run in runs:
            pool = self._region_pool.get(run.src)
            slots = held.get(pool) if pool is not None else None
            if slots is None or any(s not in slots for s in range(run.src_first, run.src_first + run.count)):
                return False
        return True

    def _describe_to(self, connection: bytes) -> bytes:
        """Our data-plane description; where the plane binds side links, made for the connection's node."""
        if self._bound is None:
            return self._data_plane.describe()
        return self._bound.describe_to(node_of(connection) or b"")

    def _expect_reads(self) -> None:
        if self._activity is not None:
            self._activity.expect_reads(self._runner.config.timing.lease_s)

    def _drop_session(self, session_id: int) -> None:
        """Forget a session (under the lock); its peer's next LEASE is UNKNOWN_SESSION and it says HELLO again."""
        self._tracked -= len(self._sessions.pop(session_id).nonces)

    def _drop_oldest_session(self) -> None:
        self._drop_session(next(iter(self._sessions)))

    @property
    def tracked_nonces(self) -> int:
        """Nonces remembered across all sessions (bounded by ``limits.max_tracked_nonces``)."""
        with self._lock:
            return self._tracked

    def _refusal(self, nonce: bytes, code: RefusalCode, reason: RefusalReason | None = None) -> Refused:
        self._count_refusal(reason or RefusalReason(code.name.lower()))
        # Only a well-formed nonce is echoed: a peer's 1 MiB "nonce" must not come back to it.
        return Refused(nonce if len(nonce) == NONCE_BYTES else b"", int(code))

    def _count_refusal(self, reason: RefusalReason) -> None:
        self._metrics.increment(M.PEER_REQUESTS_REFUSED, labels={"reason": reason})
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:  # refusals are peer-driven: never one line each
            self._last_log = now
            log.info("kvcr peer server refused a request: %s", reason.value)

    def _refuse(self, nonce: bytes, code: RefusalCode) -> bytes:
        return protocol.encode(self._refusal(nonce, code))


def _share_boards(runner: KvcrRunner, data_plane: DataPlane) -> dict[str, int]:
    """Per pool, the data-plane id of its slot board, when the plane lets same-host peers map one."""
    if not isinstance(data_plane, SharedBoards) or not shares_boards():
        return {}
    return {pool: data_plane.share_board(region) for pool, region in runner.share_boards().items()}


def _holder(connection: bytes) -> int:
    """A non-zero lease holder id: the connection's node where the channel knows it (every connection
    of that node then shares one quota), else the connection (every session it opens shares one)."""
    node = node_of(connection)
    named = b"node:" + node if node is not None else b"connection:" + connection
    return int.from_bytes(hashlib.blake2b(named, digest_size=8).digest(), "big") >> 1 | 1
