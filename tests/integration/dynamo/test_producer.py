"""HintProducer edges on the real SelectionService: validation, DP replicas, failures that give no hint."""

import asyncio

import pytest

from kvcr.adapters.zmq import ZmqEventPublisher
from kvcr.domain.errors import ConfigError
from kvcr.domain.keys import page_hashes, router_id, router_id_signed
from kvcr.integrations.dynamo import BlockingHintProducer, HintProducer
from tests.integration.dynamo.conftest import loopback, poll

P = 4


def stored(tokens, parent=None):
    pages = page_hashes(tokens, P)
    return {
        "type": "BlockStored",
        "block_hashes": [router_id_signed(p) for p in pages],
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": P,
        "lora_id": None,
        "medium": "CPU_TIER1",
    }


def test_registration_is_validated_before_the_service_sees_it(producer):
    with pytest.raises(ConfigError, match="router_hint_worker_type"):
        producer.register_worker(1, "m", P, loopback(), {0: "tcp://127.0.0.1:30001"}, "bogus")
    with pytest.raises(ConfigError, match=r"router_hint_source_control_endpoints\[0\]"):
        producer.register_worker(1, "m", P, loopback(), {0: "tcp://0.0.0.0:30001"})
    with pytest.raises(ConfigError, match="block_size"):
        producer.register_worker(1, "m", 0, loopback(), {0: "tcp://127.0.0.1:30001"})
    assert producer.remove_worker(1) is False


def test_no_hint_for_an_unknown_model_a_lone_worker_or_a_short_prompt(producer, closing):
    assert producer.hint_for("nobody", list(range(16)), 1, "r1") is None
    endpoint = loopback()
    publisher = closing(ZmqEventPublisher(endpoint))
    producer.register_worker(1, "m", P, endpoint, {0: "tcp://127.0.0.1:30001"})
    assert publisher.wait_for_subscriber(5.0)
    publisher.publish([stored(list(range(8)))])
    assert poll(lambda: producer.overlap_scores("m", list(range(8))).get((1, 0)) == 2)
    assert producer.hint_for("m", list(range(8)), 1, "r2") is None  # the target's own pages are no hint
    assert producer.hint_for("m", [1, 2], 1, "r3") is None
    assert producer.hint_for("m", list(range(8)), 1, "r2") is None  # the reservation was freed


def test_a_dp_replica_is_hinted_with_its_own_control_endpoint(producer, closing):
    events = {0: loopback(), 1: loopback()}
    publishers = {rank: closing(ZmqEventPublisher(ep, dp_rank=rank)) for rank, ep in events.items()}
    controls = {0: "tcp://127.0.0.1:31000", 1: "tcp://127.0.0.1:31002"}
    record = producer.register_worker(1, "m", P, events, controls)
    assert record["lifecycle"] == "schedulable"
    target = closing(ZmqEventPublisher(loopback()))
    producer.register_worker(2, "m", P, target.endpoint, {0: "tcp://127.0.0.1:32000"})
    assert all(p.wait_for_subscriber(5.0) for p in (*publishers.values(), target))
    tokens = list(range(500, 500 + 3 * P))
    publishers[1].publish([stored(tokens)])
    assert poll(lambda: producer.overlap_scores("m", tokens).get((1, 1)) == 3)
    hint = producer.hint_for("m", tokens, 2, "r-dp")
    payload = hint["actions"][0]["payload"]
    assert payload["source_control_endpoint"] == controls[1]
    assert payload["block_hashes"] == [router_id(p) for p in page_hashes(tokens, P)]


def test_the_async_producer_works_in_the_callers_loop():
    async def flow():
        producer = HintProducer()
        try:
            record = await producer.register_worker(7, "m", P, loopback(), {0: "tcp://127.0.0.1:30007"}, "decode")
            assert record["router_hint_worker_type"] == "decode"
            assert await producer.remove_worker(7) is True
            assert await producer.hint_for("m", list(range(8)), 7, "r") is None
        finally:
            producer.close()

    asyncio.run(flow())


def test_the_blocking_producer_closes_once_and_refuses_calls_after():
    producer = BlockingHintProducer(timeout_s=5.0)
    producer.close()
    producer.close()
    with pytest.raises(RuntimeError, match="closed"):
        producer.hint_for("m", [1], 1, "r")
