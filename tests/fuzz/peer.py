"""A live peer server under fire: the source node, its legitimate clients, and the judge of every reply.

``PeerUnderFire`` builds a source ``A`` (8 known pages backed up) and two legitimate clients on
one fabric through the composition root, records the frames the clients really exchange with
``A`` (material for replays and mutations), and judges each reply ``A`` gives a hostile frame
against a model of what the protocol allows:

- a frame that does not decode gets ``REFUSED(MALFORMED or VERSION)`` with an empty nonce;
- every reply decodes, is a refusal with a code from the closed set (never ``INTERNAL``: that is
  an exception inside the server), or a HELLO_REPLY / LEASE_REPLY that answers exactly this
  request (same nonce, same shape) and grants only pages ``A`` really holds at their real slots;
- a refusal is small (nothing the peer sent is echoed back);
- a LEASE whose (session, nonce) the server has seen before is never granted, nor a HELLO whose
  nonce it has seen (within its replay window);
- RELEASE (one-way) gets no reply, and nothing ever logs an ERROR.

Afterwards ``still_serves`` releases whatever the fuzz was granted, has each legitimate client
restore the pages (bytes compared) and checks that the Python heap kvcr holds is back near its
baseline (tracemalloc, counting only allocations made by kvcr's own modules).
"""

from __future__ import annotations

import gc
import logging
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import given

import kvcr
from kvcr.runner import protocol
from kvcr.runner.peer_client import PoolRead
from kvcr.runner.peer_server import MAX_NONCES
from kvcr.runner.protocol import (
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
from tests.fuzz import budget
from tests.support import content, seed, sequence

KVCR_DIR = str(Path(kvcr.__file__).resolve().parent)
MAX_REFUSAL_BYTES = 64  # magic, version, tag, a 16-byte nonce, a code: about 40 bytes
HEAP_SLACK_BYTES = 16 << 20  # sessions and nonce windows are bounded; this is far above what they hold in a run
PAGES = 8
DEST = list(range(20, 20 + PAGES))


class ErrorLog(logging.Handler):
    """Collects ERROR records of kvcr's loggers (a caught exception in a server logs one)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def kvcr_heap_bytes() -> int:
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, f"{KVCR_DIR}/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@dataclass
class Model:
    """What the server has seen, as far as a client on the wire can know it."""

    sessions: list[int] = field(default_factory=list)
    session_ids: set[int] = field(default_factory=set)
    nonces: list[bytes] = field(default_factory=list)
    lease_nonces: set[tuple[int, bytes]] = field(default_factory=set)  # (session, nonce) the server holds
    hello_nonces: set[bytes] = field(default_factory=set)
    hellos_accepted: int = 0
    lease_ids: set[int] = field(default_factory=set)
    granted: list[tuple[int, int]] = field(default_factory=list)  # (session, lease id) the fuzz holds


class PeerUnderFire:
    def __init__(self, cluster, *, token: bytes | None = None, timing=None) -> None:
        self.cluster = cluster
        kwargs = {"token": token, "timing": timing} if timing is not None else {"token": token}
        self.a = cluster.node("A", **kwargs)
        self.clients = [cluster.node("B", **kwargs), cluster.node("C", **kwargs)]
        self.pages = sequence(PAGES)
        seed(self.a, self.pages, range(PAGES))
        self.model = Model()
        self.recorded: list[bytes] = []  # requests legitimate clients sent
        self.recorded_by_kind: dict[type, list[bytes]] = {Hello: [], Lease: [], Release: []}
        self.replies: list[bytes] = []  # replies they got
        self.arena_slot: dict[str, int] = {}
        self.namespaces = dict(self.a.runner.namespaces)
        self.description = self.a.data_plane.describe()
        self.pools: dict[str, PoolWire] = {}  # A's pools as its HELLO_REPLY describes them
        for node in self.clients:
            self._record(node)
        self.errors = ErrorLog()
        logging.getLogger("kvcr").addHandler(self.errors)
        self.heap_before = 0

    # ------------------------------------------------------------------ setup

    def _record(self, node) -> None:
        control = node.control
        request, send = control.request, control.send

        def recording_request(endpoint, payload, timeout_s):
            reply = request(endpoint, payload, timeout_s)
            if endpoint == self.a.endpoint:
                self._keep(bytes(payload))
                self.replies.append(bytes(reply))
                self._learn(bytes(payload), bytes(reply))
            return reply

        def recording_send(endpoint, payload):
            if endpoint == self.a.endpoint:
                self._keep(bytes(payload))
            send(endpoint, payload)

        control.request, control.send = recording_request, recording_send

    def _keep(self, frame: bytes) -> None:
        self.recorded.append(frame)
        self.recorded_by_kind[type(protocol.decode(frame))].append(frame)

    def _learn(self, frame: bytes, reply: bytes) -> None:
        """Feed a legitimate exchange into the model (its sessions, nonces and slots become known)."""
        request, answer = protocol.decode(frame), protocol.decode(reply)
        if isinstance(request, Hello):
            self.model.nonces.append(request.nonce)
            self.model.hello_nonces.add(request.nonce)
            if isinstance(answer, HelloReply):
                self.pools = {p.name: p for p in answer.pools}
                self.model.hellos_accepted += 1
                self.model.sessions.append(answer.session)
                self.model.session_ids.add(answer.session)
        elif isinstance(request, Lease):
            self.model.nonces.append(request.nonce)
            self.model.lease_nonces.add((request.session, request.nonce))
            if isinstance(answer, LeaseReply):
                self.model.lease_ids.add(answer.lease_id)
                for (_, pages), slots in zip(request.pages, answer.slots, strict=True):
                    for page, slot in zip(pages, slots, strict=True):
                        if slot >= 0:
                            self.arena_slot[page] = slot

    def start(self) -> None:
        """Warm up: every legitimate path once (twice: the second restore reuses the links)."""
        self.restore_everywhere()
        self.restore_everywhere()
        assert len(self.arena_slot) == PAGES, self.arena_slot

    def fuzz(self, target: str, strategies: tuple, body, send=None) -> int:
        """Run ``body`` on the target's cases (``budget.phases``), then ``still_serves``; returns the heap growth."""
        traced_here = False
        try:
            for cases, traced in budget.phases(target):
                if traced:
                    if not tracemalloc.is_tracing():
                        tracemalloc.start()
                        traced_here = True
                    self.heap_before = self.measure()
                budget.budget(target, cases)(given(*strategies)(body))()
            growth = self.still_serves(send)
            budget.note(target, "kvcr_heap_growth_kib", growth // 1024)
            return growth
        finally:
            if traced_here:
                tracemalloc.stop()

    def known(self) -> dict[str, object]:
        """What ``strategies.resolve`` substitutes: sessions and nonces seen so far, A's namespaces."""
        return {"session": self.model.sessions, "nonce": self.model.nonces, "namespaces": self.namespaces}

    @staticmethod
    def measure() -> int:
        gc.collect()
        return kvcr_heap_bytes() if tracemalloc.is_tracing() else 0

    # ------------------------------------------------------------------ the judge

    def fire(self, frame: bytes) -> object:
        """Hand one frame to A's server (in process) and judge the reply."""
        return self.judge(frame, self.a.server.handle(frame))

    def judge(self, frame: bytes, reply: bytes | None) -> object:
        try:
            request = protocol.decode(frame)
        except FrameError as exc:
            request, undecodable = None, exc.code
        assert not self.errors.records, self.errors.records[0].getMessage()
        if isinstance(request, Release):
            assert reply is None, "RELEASE is one-way"
            return None
        assert isinstance(reply, bytes), f"no reply to {type(request).__name__}"
        answer = protocol.decode(reply)  # a server reply always decodes
        if isinstance(answer, Refused):
            assert len(reply) <= MAX_REFUSAL_BYTES, f"a refusal of {len(reply)} bytes echoes what the peer sent"
            assert answer.code in set(RefusalCode) and answer.code != RefusalCode.INTERNAL, answer
        if request is None or not isinstance(request, Hello | Lease):
            expected = undecodable if request is None else RefusalCode.MALFORMED
            assert answer == Refused(b"", int(expected)), (answer, expected)
            return answer
        if len(request.nonce) == NONCE_BYTES:
            assert not isinstance(answer, Release | Served), answer  # one-way messages have no nonce
            assert answer.nonce == request.nonce, "a reply must answer this request"
        if isinstance(request, Hello):
            self._judge_hello(request, answer)
        else:
            self._judge_lease(request, answer)
        return answer

    def _judge_hello(self, request: Hello, answer: object) -> None:
        model = self.model
        matching = [p for p in self.pools.values() if request.namespaces.get(p.name) == p.namespace]
        if isinstance(answer, Refused):
            if answer.code == RefusalCode.REPLAYED and model.hellos_accepted < MAX_NONCES:
                assert len(request.nonce) != NONCE_BYTES or request.nonce in model.hello_nonces
            return
        assert isinstance(answer, HelloReply), answer
        assert len(request.nonce) == NONCE_BYTES, "a HELLO with a malformed nonce opened a session"
        if model.hellos_accepted < MAX_NONCES:  # past the window the server may forget old nonces
            assert request.nonce not in model.hello_nonces, "a replayed HELLO opened a session"
        assert matching and answer.pools == matching, "HELLO_REPLY must list exactly the matching pools"
        assert answer.data_plane == self.description
        assert answer.session not in model.session_ids, "session ids are never reused"
        model.hello_nonces.add(request.nonce)
        model.hellos_accepted += 1
        model.sessions.append(answer.session)
        model.session_ids.add(answer.session)

    def _judge_lease(self, request: Lease, answer: object) -> None:
        model = self.model
        key = (request.session, request.nonce)
        if isinstance(answer, Refused):
            if answer.code not in (RefusalCode.UNKNOWN_SESSION, RefusalCode.CLOSING):
                model.lease_nonces.add(key)  # the session was live: the server now knows this nonce
            return
        assert isinstance(answer, LeaseReply), answer
        assert key not in model.lease_nonces, "a replayed LEASE was granted"
        assert len(request.nonce) == NONCE_BYTES, "a LEASE with a malformed nonce was granted"
        model.lease_nonces.add(key)
        assert len(answer.slots) == len(request.pages) == len(answer.digests)
        granted = 0
        for (pool_id, pages), slots, digests in zip(request.pages, answer.slots, answer.digests, strict=True):
            assert len(slots) == len(pages) == len(digests)
            for page, slot, digest in zip(pages, slots, digests, strict=True):
                if slot == -1:
                    assert digest == b""
                    continue
                granted += 1
                assert pool_id == self.pools["kv"].pool_id, f"granted a page of pool id {pool_id}"
                assert self.arena_slot.get(page) == slot, "granted a slot that does not hold that page"
                assert digest, "a granted page carries its digest"
        assert (answer.lease_id != 0) == (granted > 0), answer.lease_id
        assert 0 <= answer.ttl_ms <= round(self.a.runner.config.timing.lease_s * 1000)
        if answer.lease_id:
            assert answer.lease_id not in model.lease_ids, "lease ids are never reused"
            model.lease_ids.add(answer.lease_id)
            model.granted.append((request.session, answer.lease_id))

    # ------------------------------------------------------------------ afterwards

    def release_granted(self, send=None) -> None:
        """Release every lease the fuzz was granted (as its holder would), then wait for none to be live."""
        send = send or self.a.server.handle
        for session, lease_id in self.model.granted:
            assert send(protocol.encode(Release(session, [lease_id]))) is None
        self.model.granted.clear()
        give_up = time.monotonic() + 5
        while self.a.runner.active_leases and time.monotonic() < give_up:
            time.sleep(0.01)

    def restore_everywhere(self) -> None:
        for node in self.clients:
            host = node.hosts["kv"]
            for slot in DEST:
                host.zero_page(slot)
            result = node.client.restore(self.a.endpoint, [PoolRead("kv", self.pages, DEST)])
            outcomes = [o.outcome.value for o in result["kv"]]
            assert outcomes == ["restored"] * PAGES, outcomes
            for page, slot in zip(self.pages, DEST, strict=True):
                assert host.read_page(slot) == content(page, host.pool.page_bytes), f"wrong bytes in slot {slot}"

    def still_serves(self, send=None) -> int:
        """A legitimate restore works (bytes checked) and kvcr's heap is near its baseline; returns the growth."""
        self.release_granted(send)
        assert self.a.runner.active_leases == 0, "a fuzz lease is still live after its release"
        self.restore_everywhere()
        give_up = time.monotonic() + 5
        while self.a.runner.active_leases and time.monotonic() < give_up:  # RELEASE may be one-way over a socket
            time.sleep(0.01)
        assert self.a.runner.active_leases == 0
        assert not self.errors.records, self.errors.records[0].getMessage()
        growth = self.measure() - self.heap_before
        assert growth <= HEAP_SLACK_BYTES, f"kvcr holds {growth / 2**20:.1f} MiB more than before the fuzz"
        return growth

    def close(self) -> None:
        logging.getLogger("kvcr").removeHandler(self.errors)
