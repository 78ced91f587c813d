"""A relay between a target and a real source rewrites the source's replies: no wrong byte may land.

The relay (a control endpoint on the mock fabric) forwards each request to source ``A``'s real
server and then tampers with the reply: another request's reply (with or without the nonce
rewritten to fit), slots shuffled or pointed elsewhere, digests swapped, lease ids and TTLs at
extremes, pool descriptions lying about regions, sizes and namespaces, another node's data
plane, refusals with unknown codes, garbage. Two targets restore through it: one landing reads
directly in its host pages, one staging them. For every case:

- a page reported RESTORED holds exactly the source's bytes for that key;
- a page not restored is untouched by the staging target; the target landing directly may have
  had a read land there that verification then refused (a miss, never reported otherwise: the
  engine does not use a page reported missing);
- nothing raises out of ``restore``, and afterwards both targets restore from ``A`` directly.
"""

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcr.adapters.mock import MockControlChannel
from kvcr.domain.outcomes import Outcome
from kvcr.runner import protocol
from kvcr.runner.peer_client import PeerSettings, PoolRead
from kvcr.runner.protocol import HelloReply, LeaseReply, Refused
from tests.fuzz.budget import budget, count
from tests.fuzz.strategies import edge_ints
from tests.support import Cluster, content, seed, sequence

SENTINEL = b"\xa5"
PAGES = 8
DEST = list(range(30, 30 + PAGES))


class Relay:
    """Forwards to A's server, then applies the case's tampering to each reply."""

    def __init__(self, cluster, source) -> None:
        self.cluster, self.source = cluster, source
        self.ports = itertools.cycle(range(1, 65536))
        self.history: dict[type, list] = {HelloReply: [], LeaseReply: []}
        self.plan: dict[str, tuple] = {}
        self.channel: MockControlChannel | None = None

    def endpoint(self) -> str:
        """A fresh relay endpoint per case (on an address no node uses), so every case starts with a HELLO."""
        if self.channel is not None:
            self.channel.close()
        self.channel = MockControlChannel(
            self.cluster.fabric, f"tcp://127.0.0.99:{next(self.ports)}", self.cluster.clock
        )
        self.channel.serve(self.answer)
        return self.channel.endpoint

    def answer(self, frame: bytes) -> bytes | None:
        reply = self.source.server.handle(frame)
        if reply is None:
            return None
        message = protocol.decode(reply)
        kind = "hello" if isinstance(message, HelloReply) else "lease" if isinstance(message, LeaseReply) else None
        if kind is None:
            return reply
        history = self.history[type(message)]
        history.append(message)
        return tamper(message, self.plan.get(kind, ("pass",)), history, self.cluster)


def _replace(message, **changes):
    fields = {f: getattr(message, f) for f in message.__struct_fields__}
    fields.update(changes)
    return type(message)(**fields)


def tamper(message, op, history, cluster) -> bytes | None:
    name = op[0]
    if name == "pass":
        return protocol.encode(message)
    if name == "garbage":
        return op[1]
    if name == "none":
        return None
    if name == "refused":
        return protocol.encode(Refused(message.nonce, op[1]))
    if name in ("old", "old_renonced"):
        old = history[op[1] % len(history)]
        return protocol.encode(old if name == "old" else _replace(old, nonce=message.nonce))
    if name == "field":
        return protocol.encode(_replace(message, **{op[1]: op[2]}))
    if name == "pool":  # HELLO_REPLY: one field of one pool description
        pools = [_replace(p, **{op[1]: op[2]}) for p in message.pools]
        return protocol.encode(_replace(message, pools=pools))
    if name == "data_plane":  # another node's data plane, or junk
        other = {"B": cluster.nodes[1], "C": cluster.nodes[2]}.get(op[1])
        return protocol.encode(_replace(message, data_plane=other.data_plane.describe() if other else op[1]))
    if name == "shuffle":  # LEASE_REPLY: slots (and maybe digests) moved between pages
        rng = random.Random(op[1])
        slots = [list(s) for s in message.slots]
        digests = [list(d) for d in message.digests]
        for s, d in zip(slots, digests, strict=True):
            order = list(range(len(s)))
            rng.shuffle(order)
            s[:] = [s[i] for i in order]
            if op[2]:
                d[:] = [d[i] for i in order]
        return protocol.encode(_replace(message, slots=slots, digests=digests))
    if name == "slot":  # one slot set to an arbitrary value
        slots = [list(s) for s in message.slots]
        if slots and slots[0]:
            slots[0][op[1] % len(slots[0])] = op[2]
        return protocol.encode(_replace(message, slots=slots))
    if name == "digest":
        digests = [list(d) for d in message.digests]
        if digests and digests[0]:
            digests[0][op[1] % len(digests[0])] = op[2]
        return protocol.encode(_replace(message, digests=digests))
    if name == "shape":  # a pool or a page too many or too few
        slots, digests = [list(s) for s in message.slots], [list(d) for d in message.digests]
        if op[1] == "pool+":
            slots.append([0])
            digests.append([b""])
        elif op[1] == "pool-":
            slots, digests = slots[:-1], digests[:-1]
        elif slots:
            slots[0] = [*slots[0], 0] if op[1] == "page+" else slots[0][:-1]
        return protocol.encode(_replace(message, slots=slots, digests=digests))
    raise AssertionError(op)


small_ints = st.one_of(st.integers(-3, 40), edge_ints)
common_ops = st.one_of(
    st.just(("pass",)),
    st.tuples(st.just("garbage"), st.binary(max_size=64)),
    st.just(("none",)),
    st.tuples(st.just("refused"), st.one_of(st.integers(0, 10), edge_ints)),
    st.tuples(st.just("old"), st.integers(0, 1 << 16)),
    st.tuples(st.just("old_renonced"), st.integers(0, 1 << 16)),
)
hello_ops = st.one_of(
    common_ops,
    st.tuples(st.just("field"), st.just("session"), edge_ints),
    st.tuples(st.just("field"), st.just("incarnation"), st.text(max_size=8)),
    st.tuples(st.just("field"), st.just("max_lease_ms"), edge_ints),
    st.tuples(st.just("field"), st.just("pools"), st.just([])),
    st.tuples(st.just("pool"), st.sampled_from(["pool_id", "slots"]), small_ints),
    st.tuples(st.just("pool"), st.sampled_from(["regions", "pieces"]), st.lists(small_ints, max_size=3)),
    st.tuples(st.just("pool"), st.sampled_from(["name", "namespace"]), st.sampled_from(["", "kv", "indexer", "zz"])),
    st.tuples(st.just("data_plane"), st.one_of(st.sampled_from(["B", "C"]), st.binary(max_size=64))),
)
lease_ops = st.one_of(
    common_ops,
    st.tuples(st.just("field"), st.sampled_from(["lease_id", "ttl_ms"]), edge_ints),
    st.tuples(st.just("shuffle"), st.integers(0, 1 << 16), st.booleans()),
    st.tuples(st.just("slot"), st.integers(0, 64), small_ints),
    st.tuples(st.just("digest"), st.integers(0, 64), st.one_of(st.binary(max_size=20), st.just(b""))),
    st.tuples(st.just("shape"), st.sampled_from(["pool+", "pool-", "page+", "page-"])),
)
# What the target asks for: A's pages in any order (some repeated), and pages A never had.
requests = st.lists(
    st.one_of(st.integers(0, PAGES - 1), st.integers(100, 104)), min_size=1, max_size=PAGES, unique=True
)


@pytest.fixture
def setup():
    cluster = Cluster()
    source = cluster.node("A")
    direct = cluster.node("B", peer=PeerSettings(landing="direct"))
    staged = cluster.node("C", peer=PeerSettings(landing="staged"))
    pages = sequence(PAGES)
    seed(source, pages, range(PAGES))
    yield cluster, source, (direct, staged), pages
    cluster.close()


def test_tampered_replies_never_land_wrong_bytes(setup):
    cluster, source, targets, pages = setup
    relay = Relay(cluster, source)
    size = source.hosts["kv"].pool.page_bytes
    truth = {page: content(page, size) for page in pages}
    foreign = sequence(5, start=10_000)  # pages A never held

    @budget("replies.hostile")
    @given(st.sampled_from([0, 1]), hello_ops, lease_ops, requests)
    def case(which, hello_op, lease_op, picks):
        count("replies.hostile")
        target = targets[which]
        host = target.hosts["kv"]
        asked = [pages[i] if i < PAGES else foreign[i - 100] for i in picks]
        dest = DEST[: len(asked)]
        for slot in dest:
            host.write_page(slot, SENTINEL * size)
        relay.plan = {"hello": hello_op, "lease": lease_op}
        result = target.client.restore(relay.endpoint(), [PoolRead("kv", asked, dest)])
        outcomes = result["kv"]
        assert len(outcomes) == len(asked)
        for page, slot, outcome in zip(asked, dest, outcomes, strict=True):
            landed = host.read_page(slot)
            if outcome.outcome is Outcome.RESTORED:
                assert landed == truth.get(page), f"RESTORED with wrong bytes ({hello_op}, {lease_op})"
            elif target is targets[1]:
                assert landed == SENTINEL * size, f"a staged miss touched a host page ({hello_op}, {lease_op})"
        cluster.clock.advance(11)  # let any lease the relay kept live expire on the source
        source.runner.expire_leases()

    case()
    for target in targets:  # both still restore from A directly, byte-exact
        host = target.hosts["kv"]
        result = target.client.restore(source.endpoint, [PoolRead("kv", pages, DEST)])
        assert [o.outcome for o in result["kv"]] == [Outcome.RESTORED] * PAGES
        assert all(host.read_page(s) == truth[p] for p, s in zip(pages, DEST, strict=True))
