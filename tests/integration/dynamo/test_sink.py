"""DynamoInventorySink (runner events -> Dynamo event maps) and the page-token registry, with a fake publisher."""

from array import array

import pytest

from kvcr.adapters.local import InMemoryMetrics, MmapHostMemory, MonotonicClock
from kvcr.container import KvEventsSettings, build_container
from kvcr.domain.keys import namespace_seed, page_hash, page_hashes, router_id_signed
from kvcr.integrations.dynamo import MEDIUM, DynamoInventorySink, PageTokenRegistry
from kvcr.ports.inventory import InventoryEvent, InventoryKind
from kvcr.runner import KvcrRunner
from tests.integration.dynamo.conftest import loopback
from tests.support import HostPool, content, indexer_pool, kv_pool, runner_config

P = 4


class FakePublisher:
    """The KvEventPublisher port, recording each batch."""

    def __init__(self):
        self.batches = []
        self.closed = False

    def publish(self, events):
        self.batches.append(events)

    def close(self):
        self.closed = True

    @property
    def events(self):
        return [event for batch in self.batches for event in batch]


def registry_with(tokens, page_size=P):
    registry = PageTokenRegistry()
    registry.enable()
    assert registry.record(page_hashes(tokens, page_size), tokens, page_size) == len(tokens) // page_size
    return registry


def test_stored_removed_and_cleared_become_sglang_event_maps():
    tokens = list(range(100, 100 + 3 * P))
    pages = page_hashes(tokens, P)
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry_with(tokens))
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages[1:]), pages[0]))
    sink.publish(InventoryEvent(InventoryKind.REMOVED, "kv", (pages[2],)))
    sink.publish(InventoryEvent(InventoryKind.CLEARED))
    assert publisher.batches == [
        [
            {
                "type": "BlockStored",
                "block_hashes": [router_id_signed(pages[1]), router_id_signed(pages[2])],
                "parent_block_hash": router_id_signed(pages[0]),
                "token_ids": tokens[P:],
                "block_size": P,
                "lora_id": None,
                "medium": MEDIUM,
            }
        ],
        [{"type": "BlockRemoved", "block_hashes": [router_id_signed(pages[2])], "medium": MEDIUM}],
        [{"type": "AllBlocksCleared"}],
    ]
    assert MEDIUM == "CPU_TIER1"
    assert sink.stats() == {
        "stored_pages": 2,
        "removed_pages": 1,
        "cleared": 1,
        "skipped_pages": 0,
        "side_pool_events": 0,
    }


def test_a_root_store_has_no_parent_and_hashes_are_signed_int64():
    tokens = list(range(7 * P))
    pages = page_hashes(tokens, P)
    publisher = FakePublisher()
    DynamoInventorySink(publisher, block_size=P, tokens=registry_with(tokens)).publish(
        InventoryEvent(InventoryKind.STORED, "kv", tuple(pages))
    )
    (stored,) = publisher.events
    assert stored["parent_block_hash"] is None
    assert all(-(1 << 63) <= h < (1 << 63) for h in stored["block_hashes"])
    assert [h % (1 << 64) for h in stored["block_hashes"]] == [int(p[:16], 16) for p in pages]


def test_pages_with_unknown_tokens_and_everything_after_them_are_left_out():
    tokens = list(range(5 * P))
    pages = page_hashes(tokens, P)
    registry = PageTokenRegistry()
    registry.enable()
    registry.record(pages[:2], tokens[: 2 * P], P)  # pages 2.. were never captured
    registry.record(pages[3:], tokens[3 * P :], P, prior_hash=pages[2])
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry)
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages)))
    (stored,) = publisher.events
    assert stored["block_hashes"] == [router_id_signed(p) for p in pages[:2]]
    assert stored["token_ids"] == tokens[: 2 * P]
    assert sink.stats()["skipped_pages"] == 3
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", (pages[2],), pages[1]))
    assert len(publisher.batches) == 1  # nothing at all to say
    assert sink.stats()["skipped_pages"] == 4


def test_a_removal_names_only_pages_the_sink_announced_once():
    # On SGLang's own stream Dynamo counts stores per block and tier: a removal of a page kvcr never
    # announced would take away the count of SGLang's own L2 copy.
    tokens = list(range(300, 300 + 2 * P))
    pages = page_hashes(tokens, P)
    unknown = page_hash(list(range(900, 900 + P)), None)
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry_with(tokens))
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", (pages[0],), None))
    sink.publish(InventoryEvent(InventoryKind.REMOVED, "kv", (unknown,)))  # never announced: nothing sent
    sink.publish(InventoryEvent(InventoryKind.REMOVED, "kv", (pages[0], pages[1])))
    sink.publish(InventoryEvent(InventoryKind.REMOVED, "kv", (pages[0],)))  # already removed: nothing sent
    removals = [e for e in publisher.events if e["type"] == "BlockRemoved"]
    assert removals == [{"type": "BlockRemoved", "block_hashes": [router_id_signed(pages[0])], "medium": MEDIUM}]
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", (pages[0],), None))
    sink.publish(InventoryEvent(InventoryKind.CLEARED))
    sink.publish(InventoryEvent(InventoryKind.REMOVED, "kv", (pages[0],)))  # the clear took it already
    assert [e["type"] for e in publisher.events][-2:] == ["BlockStored", "AllBlocksCleared"]
    assert sink.stats()["removed_pages"] == 1


def test_on_an_engines_stream_a_clear_or_close_removes_only_what_the_sink_announced():
    # AllBlocksCleared would wipe the engine's own blocks (every tier) from the router too.
    tokens = list(range(400, 400 + 3 * P))
    pages = page_hashes(tokens, P)
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry_with(tokens), shared_stream=True)
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages), None))
    sink.publish(InventoryEvent(InventoryKind.REMOVED, "kv", (pages[0],)))
    sink.publish(InventoryEvent(InventoryKind.CLEARED))
    held = sorted(router_id_signed(p) for p in pages[1:])
    assert publisher.events[-1] == {"type": "BlockRemoved", "block_hashes": held, "medium": MEDIUM}
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", (pages[0],), None))
    sink.close()
    last = {"type": "BlockRemoved", "block_hashes": [router_id_signed(pages[0])], "medium": MEDIUM}
    assert publisher.events[-1] == last
    assert publisher.closed and all(e["type"] != "AllBlocksCleared" for e in publisher.events)
    assert sink.stats()["removed_pages"] == 4 and sink.stats()["cleared"] == 2


def test_side_pools_are_not_published_and_close_clears_then_closes():
    tokens = list(range(P))
    pages = page_hashes(tokens, P)
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry_with(tokens))
    sink.publish(InventoryEvent(InventoryKind.STORED, "indexer", tuple(pages)))
    sink.publish(InventoryEvent(InventoryKind.REMOVED, "mamba", tuple(pages)))
    assert publisher.batches == []
    assert sink.stats()["side_pool_events"] == 2
    sink.close()
    sink.close()
    assert publisher.batches == [[{"type": "AllBlocksCleared"}]] and publisher.closed
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages)))
    assert len(publisher.batches) == 1


def test_a_runner_publishes_only_the_kv_anchor_pool_through_the_sink():
    tokens = list(range(300, 300 + 4 * P))
    pages = page_hashes(tokens, P)
    pools = (kv_pool(), indexer_pool())
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry_with(tokens))
    runner = KvcrRunner(
        runner_config(pools, 8),
        memory=MmapHostMemory(),
        clock=MonotonicClock(),
        metrics=InMemoryMetrics(strict=True),
        inventory=sink,
    )
    hosts = {p.name: HostPool(p, 8) for p in pools}
    for pool in pools:
        runner.register_host_pool(pool.name, hosts[pool.name].regions)
        for i, page in enumerate(pages):
            hosts[pool.name].write_page(i, content(page, pool.page_bytes))
        assert runner.backup(pool.name, pages, range(4)) == [True] * 4
    assert [e["type"] for e in publisher.events] == ["BlockStored"]
    assert publisher.events[0]["block_hashes"] == [router_id_signed(p) for p in pages]
    runner.close()


def test_the_container_builds_the_sink_around_its_zmq_publisher():
    made = []

    def factory(publisher):
        made.append(DynamoInventorySink(publisher, block_size=P, tokens=PageTokenRegistry()))
        return made[-1]

    container = build_container(
        runner_config((kv_pool(),), 4), kv_events=KvEventsSettings(loopback(), dp_rank=None), inventory=factory
    )
    runner = container.runner()
    try:
        from kvcr.adapters.zmq import ZmqEventPublisher

        assert container.inventory() is made[0]
        assert isinstance(made[0].publisher, ZmqEventPublisher)
        assert container.kv_event_publisher() is made[0].publisher
    finally:
        runner.close()
        made[0].close()
    with pytest.raises(TypeError, match="kv_events"):
        build_container(runner_config((kv_pool(),), 4), inventory=factory)


# ---------------------------------------------------------------------- registry


def test_the_registry_records_nothing_until_enabled():
    tokens = list(range(2 * P))
    registry = PageTokenRegistry()
    assert registry.record(page_hashes(tokens, P), tokens, P) == 0
    assert registry.tokens(page_hashes(tokens, P)[0]) is None


def test_the_registry_keeps_only_tokens_that_hash_to_the_key():
    tokens = list(range(50, 50 + 4 * P))
    pages = page_hashes(tokens, P)
    registry = PageTokenRegistry()
    registry.enable()
    assert registry.record(pages, array("q", tokens), P) == 4  # SGLang hands an array('q')
    assert [registry.tokens(p) for p in pages] == [tokens[i * P : (i + 1) * P] for i in range(4)]
    shifted = [0, *tokens]  # one token too many in front: every page would be paired wrongly
    fresh = PageTokenRegistry()
    fresh.enable()
    assert fresh.record(pages, shifted, P) == 0
    assert fresh.stats()["refused_pages"] == 4
    assert fresh.record(pages, tokens[:-1], P) == 0  # too short to fill the pages


def test_the_registry_checks_a_child_page_against_the_prior_key_and_accepts_salted_chains():
    tokens = list(range(8 * P))
    seed = namespace_seed(None, "tenant-a")
    salted = page_hashes(tokens, P, prior_hash=seed)
    registry = PageTokenRegistry()
    registry.enable()
    # A node deeper in the tree, SGLang passing the prefix keys: checked against the prior key.
    assert registry.record(salted[4:], tokens[4 * P :], P, prior_hash=salted[3]) == 4
    # Without the prefix keys the first page cannot be checked, but the tokens are exactly the pages.
    assert registry.record(salted[:4], tokens[: 4 * P], P) == 4
    # A wrong prior key is caught.
    assert registry.record(salted[4:6], tokens[4 * P : 6 * P], P, prior_hash=salted[0]) == 1


def test_the_registry_is_bounded_by_tokens_oldest_first():
    registry = PageTokenRegistry(max_tokens=3 * P)
    registry.enable()
    tokens = list(range(5 * P))
    pages = page_hashes(tokens, P)
    assert registry.record(pages, tokens, P) == 5
    assert registry.stats()["pages"] == 3 and registry.stats()["tokens"] == 3 * P
    assert registry.tokens(pages[0]) is None and registry.tokens(pages[4]) == tokens[4 * P :]


def test_wide_tokens_hash_like_sglang():
    tokens = [1 << 40, 2, 3, 4]
    key = page_hash(tokens)
    registry = PageTokenRegistry()
    registry.enable()
    assert registry.record([key], tokens, P) == 1
    assert registry.tokens(key) == tokens


def test_a_store_without_a_parent_is_placed_by_what_the_capture_knows():
    tokens = list(range(6 * P))
    pages = page_hashes(tokens, P)
    registry = PageTokenRegistry()
    registry.enable()
    registry.record(pages, tokens, P)  # one backup of six pages: each page's parent is known
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry)
    # SGLang passed no prefix keys for the second storage batch: the runner reports no parent.
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages[4:])))
    assert publisher.events[0]["parent_block_hash"] == router_id_signed(pages[3])
    assert registry.page(pages[0]).parent is None and registry.page(pages[0]).placed


def test_pages_whose_parent_is_unknown_are_left_out_with_one_warning(caplog):
    tokens = list(range(6 * P))
    pages = page_hashes(tokens, P)
    registry = PageTokenRegistry()
    registry.enable()
    # A child node backed up without prefix keys: the tokens are exactly its pages, the parent is unknown.
    registry.record(pages[3:], tokens[3 * P :], P)
    assert registry.page(pages[3]).placed is False and registry.page(pages[4]).placed is True
    publisher = FakePublisher()
    sink = DynamoInventorySink(publisher, block_size=P, tokens=registry)
    with caplog.at_level("WARNING", logger="kvcr.integrations.shared.kv_events"):
        sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages[3:])))
        sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages[3:])))
    assert publisher.batches == []
    assert sink.stats()["skipped_pages"] == 6
    assert [r.message for r in caplog.records if "hicache_storage_pass_prefix_keys" in r.message] != []
    assert len(caplog.records) == 1
    # With the parent from SGLang's prefix keys the same pages are published.
    sink.publish(InventoryEvent(InventoryKind.STORED, "kv", tuple(pages[3:]), pages[2]))
    assert publisher.events[0]["parent_block_hash"] == router_id_signed(pages[2])
