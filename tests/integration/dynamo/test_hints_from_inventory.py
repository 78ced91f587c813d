"""A kvcr runner's DRAM residency -> KV events over ZMQ -> Dynamo's real SelectionService -> hints.

Replica A's runner publishes; replica B is registered with an empty publisher, and hints are asked
for B as the target. Events are applied asynchronously, so every check polls overlap_scores
(bounded) before asking for a hint.
"""

import pytest

from kvcr.adapters.local import InMemoryMetrics, MmapHostMemory, MonotonicClock
from kvcr.adapters.zmq import ZmqEventPublisher
from kvcr.domain.hints import parse_hint
from kvcr.domain.keys import page_hashes, router_id
from kvcr.integrations.dynamo import DynamoInventorySink, PageTokenRegistry
from kvcr.runner import KvcrRunner
from tests.integration.dynamo.conftest import free_port, loopback, poll
from tests.support import HostPool, content, kv_pool, runner_config

P = 4
MODEL = "test-model"
A, B = 1, 2


class Replica:
    """A kvcr runner whose inventory goes to a real ZMQ publisher through the Dynamo sink."""

    def __init__(self, name, slots, registry, endpoint=None):
        self.pool = kv_pool()
        self.events_endpoint = endpoint or loopback()
        self.control_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.publisher = ZmqEventPublisher(self.events_endpoint)
        self.sink = DynamoInventorySink(self.publisher, block_size=P, tokens=registry)
        self.runner = KvcrRunner(
            runner_config((self.pool,), slots, name=name),
            memory=MmapHostMemory(),
            clock=MonotonicClock(),
            metrics=InMemoryMetrics(strict=True),
            inventory=self.sink,
        )
        self.host = HostPool(self.pool, 32)
        self.runner.register_host_pool("kv", self.host.regions)

    def hold_in_host(self, pages, first_slot=0):
        """Pages in the engine's host pool only (what SGLang's own tiers hold), not in kvcr DRAM."""
        for i, page in enumerate(pages):
            self.host.write_page(first_slot + i, content(page, self.pool.page_bytes))
        return list(range(first_slot, first_slot + len(pages)))

    def back_up(self, pages, first_slot=0, parent=None):
        slots = self.hold_in_host(pages, first_slot)
        assert self.runner.backup("kv", pages, slots, parent=parent) == [True] * len(pages)

    def held(self, pages):
        return self.runner.exists("kv", pages)

    def close(self):
        self.runner.close()
        self.sink.close()


@pytest.fixture
def registry():
    made = PageTokenRegistry()
    made.enable()
    return made


@pytest.fixture
def cluster(producer, registry, closing):
    """Replicas A (source) and B (target), both registered and subscribed to."""

    def make(slots_a=16):
        a = closing(Replica("A", slots_a, registry))
        b = closing(Replica("B", 16, registry))
        for worker, replica in ((A, a), (B, b)):
            record = producer.register_worker(
                worker, MODEL, P, replica.events_endpoint, {0: replica.control_endpoint}, "aggregated"
            )
            assert record["lifecycle"] == "schedulable"
            assert replica.publisher.wait_for_subscriber(5.0)  # no slow-joiner loss from here on
        return a, b

    return make


def prompt(n_pages, start=1000):
    return list(range(start, start + n_pages * P))


def held_by(producer, tokens, worker, expected, timeout_s=5.0):
    """Poll until the service sees ``expected`` blocks of ``tokens`` on ``worker``; returns what it saw."""

    def check():
        scores = producer.overlap_scores(MODEL, tokens)
        return scores.get((worker, 0), 0) == expected

    poll(check, timeout_s)
    return producer.overlap_scores(MODEL, tokens).get((worker, 0), 0)


def hinted(producer, tokens, request_id):
    hint = producer.hint_for(MODEL, tokens, B, request_id)
    if hint is None:
        return None
    parsed = parse_hint(hint)
    assert parsed.usable, parsed.reason
    return hint


def payload(hint):
    (action,) = hint["actions"]
    assert (action["action_type"], action["action_version"]) == ("kv.fetch", "1.0")
    return action["payload"]


def test_the_hint_names_the_source_and_exactly_the_pages_in_its_kvcr_dram(producer, cluster, registry):
    a, _ = cluster()
    tokens = prompt(8)
    pages = page_hashes(tokens, P)
    registry.record(pages, tokens, P)
    a.hold_in_host(pages[6:], first_slot=10)  # pages 6 and 7 sit only in A's engine tiers
    a.back_up(pages[:6])
    assert held_by(producer, tokens, A, 6) == 6
    hint = hinted(producer, tokens, "req-1")
    assert hint is not None and hint["message_id"] == "req-1"
    body = payload(hint)
    assert body["source_control_endpoint"] == a.control_endpoint
    in_dram = [router_id(p) for p, held in zip(pages, a.held(pages), strict=True) if held]
    assert body["block_hashes"] == in_dram == [router_id(p) for p in pages[:6]]
    assert a.sink.stats()["stored_pages"] == 6


def test_eviction_on_the_source_shrinks_the_hint(producer, cluster, registry):
    a, _ = cluster(slots_a=6)
    tokens, other = prompt(6), prompt(3, start=5000)
    pages, other_pages = page_hashes(tokens, P), page_hashes(other, P)
    registry.record(pages, tokens, P)
    registry.record(other_pages, other, P)
    a.back_up(pages)
    assert held_by(producer, tokens, A, 6) == 6
    assert len(payload(hinted(producer, tokens, "req-before"))["block_hashes"]) == 6
    a.back_up(other_pages, first_slot=20)  # a full tier: the oldest prefix loses its deepest pages
    remaining = a.held(pages)
    kept = remaining.index(False)
    assert 0 < kept < 6 and not any(remaining[kept:])
    assert held_by(producer, tokens, A, kept) == kept
    body = payload(hinted(producer, tokens, "req-after"))
    assert body["block_hashes"] == [router_id(p) for p in pages[:kept]]
    assert a.sink.stats()["removed_pages"] == 6 - kept


def test_after_a_clear_there_is_no_hint(producer, cluster, registry):
    a, _ = cluster()
    tokens = prompt(5)
    registry.record(page_hashes(tokens, P), tokens, P)
    a.back_up(page_hashes(tokens, P))
    assert held_by(producer, tokens, A, 5) == 5
    a.runner.clear()
    assert held_by(producer, tokens, A, 0) == 0
    assert hinted(producer, tokens, "req-cleared") is None


def test_pages_whose_tokens_were_not_captured_are_never_hinted(producer, cluster, registry):
    a, _ = cluster()
    tokens = prompt(6)
    pages = page_hashes(tokens, P)
    registry.record(pages[:2], tokens[: 2 * P], P)  # the plugin saw only the first two pages
    a.back_up(pages)
    assert held_by(producer, tokens, A, 2) == 2
    assert payload(hinted(producer, tokens, "req-partial"))["block_hashes"] == [router_id(p) for p in pages[:2]]
    assert a.sink.stats()["skipped_pages"] == 4


def test_a_target_that_holds_the_prefix_itself_gets_no_hint(producer, cluster, registry):
    a, b = cluster()
    tokens = prompt(4)
    pages = page_hashes(tokens, P)
    registry.record(pages, tokens, P)
    a.back_up(pages)
    b.back_up(pages)
    assert held_by(producer, tokens, A, 4) == 4 and held_by(producer, tokens, B, 4) == 4
    assert hinted(producer, tokens, "req-own") is None


def test_a_restarted_publisher_starts_at_seq_zero_and_a_re_registered_worker_is_indexed_again(
    producer, cluster, registry, closing
):
    a, _ = cluster()
    tokens = prompt(4)
    pages = page_hashes(tokens, P)
    registry.record(pages, tokens, P)
    a.back_up(pages)
    assert held_by(producer, tokens, A, 4) == 4
    first_seq = a.publisher.next_seq
    assert first_seq >= 1
    a.close()  # the worker goes away: its publisher says AllBlocksCleared on the way out
    assert held_by(producer, tokens, A, 0) == 0

    restarted = closing(Replica("A2", 16, registry, endpoint=a.events_endpoint))
    assert restarted.publisher.next_seq == 0
    # Dynamo keeps the old seq watermark per worker: a restarted worker is registered afresh.
    producer.register_worker(A, MODEL, P, restarted.events_endpoint, {0: restarted.control_endpoint})
    assert restarted.publisher.wait_for_subscriber(5.0)
    restarted.back_up(pages[:3])
    assert held_by(producer, tokens, A, 3) == 3
    assert restarted.publisher.next_seq == 1  # one STORED batch, sent as seq 0
    body = payload(hinted(producer, tokens, "req-restarted"))
    assert body["source_control_endpoint"] == restarted.control_endpoint
    assert body["block_hashes"] == [router_id(p) for p in pages[:3]]
