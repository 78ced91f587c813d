"""kvcr's residency events on SGLang's own KV-event publisher (``engine_kv_events``), as a router reads them.

SGLang's real ``ZmqEventPublisher`` binds on loopback; a SUB reads what it sends. kvcr's batches
go out in the same sequence as SGLang's own, as SGLang's event structs, in kvcr's medium.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from kvcr.integrations.sglang import engine_events
from kvcr.integrations.sglang.engine_events import EngineEventStream, engine_batch, engine_publisher_ready
from kvcr.integrations.shared.kv_events import MEDIUM
from tests.integration.dynamo.conftest import free_port

STORED = {
    "type": "BlockStored",
    "block_hashes": [-5, 7],
    "parent_block_hash": None,
    "token_ids": list(range(32)),
    "block_size": 16,
    "lora_id": None,
    "medium": MEDIUM,
}
REMOVED = {"type": "BlockRemoved", "block_hashes": [7], "medium": MEDIUM}


@pytest.fixture
def wire() -> Iterator[tuple[ZmqEventPublisher, zmq.Socket[bytes]]]:
    engine_events._reset_for_tests()
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{port}", topic="kv-events", bind=True)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    yield publisher, sub
    sub.close(linger=0)
    context.term()
    publisher.shutdown()
    engine_events._reset_for_tests()


def sglang_batch() -> KVEventBatch:
    stored = BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16, lora_id=None
    )
    return KVEventBatch(ts=time.time(), events=[stored])


def attached(publisher: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Send SGLang batches until the SUB gets them (ZMQ drops what a PUB sends before); the last sequence number."""
    for _ in range(100):
        publisher.publish(sglang_batch())
        if sub.poll(100):
            break
    else:
        raise AssertionError("the SUB never attached")
    last = receive(sub)[0]
    while sub.poll(300):  # the warm-up batches sent while it attached
        last = receive(sub)[0]
    return last


def receive(sub: zmq.Socket[bytes]) -> tuple[int, list[dict[str, Any]], Any]:
    assert sub.poll(5000), "no batch within 5 s"
    _topic, seq, payload = sub.recv_multipart()
    _ts, events, dp_rank = msgpack.unpackb(payload)
    return int.from_bytes(seq, "big"), events, dp_rank


def test_kvcr_batches_join_sglangs_sequence_in_order_as_its_own_structs(wire):
    publisher, sub = wire
    stream = EngineEventStream()
    stream.publish([STORED])  # before SGLang's publisher exists: held
    assert not stream.bound
    engine_publisher_ready(publisher)
    assert stream.bound
    base = attached(publisher, sub)
    # the held batch went out before the SUB was attached; what follows shares SGLang's sequence
    stream.publish([STORED, REMOVED])
    publisher.publish(sglang_batch())
    stream.publish([{"type": "AllBlocksCleared"}])
    seen = [receive(sub) for _ in range(3)]
    assert [seq for seq, _, _ in seen] == [base + 1, base + 2, base + 3]
    kvcr, sglang, cleared = (events for _, events, _ in seen)
    assert kvcr[0]["type"] == "BlockStored" and kvcr[0]["medium"] == "CPU_TIER1"
    assert kvcr[0]["block_hashes"] == [-5, 7] and kvcr[0]["token_ids"] == list(range(32))
    assert kvcr[1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU_TIER1"}
    assert sglang[0]["type"] == "BlockStored" and "medium" not in sglang[0]
    assert cleared == [{"type": "AllBlocksCleared"}]
    assert {dp for _, _, dp in seen} == {0}  # the publisher's DP rank on kvcr's batches too


def test_a_stream_made_after_sglangs_publisher_binds_at_once_and_a_closed_one_sends_nothing(wire):
    publisher, sub = wire
    engine_publisher_ready(publisher)
    stream = EngineEventStream()
    assert stream.bound
    base = attached(publisher, sub)
    stream.close()
    stream.publish([STORED])
    publisher.publish(sglang_batch())
    seq, events, _ = receive(sub)
    assert seq == base + 1 and "medium" not in events[0]  # SGLang's batch, not kvcr's


def test_held_batches_are_bounded_and_counted():
    engine_events._reset_for_tests()
    stream = EngineEventStream(max_held=2)
    for _ in range(3):
        stream.publish([STORED])
    assert stream.dropped == 1
    stream.close()


def test_an_event_kvcr_does_not_publish_is_refused_by_name():
    with pytest.raises(ValueError, match="BlockUpdated"):
        engine_batch([{"type": "BlockUpdated"}])
