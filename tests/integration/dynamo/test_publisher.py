"""ZmqEventPublisher on loopback, checked with our own SUB socket: wire format and sequence numbers."""

import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from kvcr.adapters.zmq import ZmqEventPublisher
from kvcr.domain.errors import ConfigError
from tests.integration.dynamo.conftest import loopback


@pytest.fixture
def subscriber():
    context = zmq.Context()
    made = []

    def connect(endpoint):
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 20)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 50)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        made.append(sock)
        return sock

    yield connect
    for sock in made:
        sock.close(linger=0)
    context.term()


def attached(publisher, sub, timeout_s=5.0):
    """Wait for ``sub`` to be attached to ``publisher``, keeping the SUB busy meanwhile.

    libzmq hands a socket its reconnected pipe (and re-sends its subscriptions) only when the
    application calls into that socket; a router's SUB is always receiving, ours must poll.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sub.poll(20)
        if publisher.wait_for_subscriber(0):
            return True
    return False


def receive(sock, count, timeout_s=5.0):
    """``count`` messages as (topic, seq, [ts, events, dp_rank]); fewer if they do not come in time."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        if sock.poll(50):
            topic, seq, payload = sock.recv_multipart()
            assert len(seq) == 8
            got.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return got


def test_batches_go_out_in_the_dynamo_wire_format_with_seq_from_zero(subscriber, closing):
    endpoint = loopback()
    publisher = closing(ZmqEventPublisher(endpoint, topic="kv-events", dp_rank=3))
    sub = subscriber(endpoint)
    assert publisher.wait_for_subscriber(5.0)
    stored = {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None, "token_ids": [1, 2, 3, 4]}
    publisher.publish([stored])
    publisher.publish([{"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU_TIER1"}, {"type": "x"}])
    publisher.publish([])  # an empty batch is not a message
    publisher.publish([{"type": "AllBlocksCleared"}])
    got = receive(sub, 3)
    assert [(topic, seq) for topic, seq, _ in got] == [(b"kv-events", 0), (b"kv-events", 1), (b"kv-events", 2)]
    ts, events, dp_rank = got[0][2]
    assert isinstance(ts, float) and abs(ts - time.time()) < 60
    assert events == [stored] and dp_rank == 3
    assert [len(body[1]) for _, _, body in got] == [1, 2, 1]
    assert receive(sub, 1, timeout_s=0.2) == []
    assert publisher.next_seq == 3 and publisher.dropped == 0


def test_seq_is_gap_free_under_a_burst_and_restarts_at_zero_with_a_new_publisher(subscriber):
    endpoint = loopback()
    first = ZmqEventPublisher(endpoint, max_queued_batches=4)
    sub = subscriber(endpoint)
    assert first.wait_for_subscriber(5.0)
    for i in range(2000):  # faster than the sender thread may drain: some batches can be dropped
        first.publish([{"type": "AllBlocksCleared", "i": i}])
    assert first.wait_for_subscriber(0)
    got = receive(sub, 2000, timeout_s=3.0)
    sent = first.next_seq
    assert sent + first.dropped == 2000
    assert [seq for _, seq, _ in got] == list(range(sent))  # a dropped batch never leaves a hole
    order = [body[1][0]["i"] for _, _, body in got]
    assert order == sorted(order)
    first.close()

    second = ZmqEventPublisher(endpoint)  # same address, as a restarted worker would bind it
    try:
        assert attached(second, sub)  # our SUB reconnects by itself
        for i in range(5):
            second.publish([{"type": "AllBlocksCleared", "i": i}])
        got = receive(sub, 5)
        assert [seq for _, seq, _ in got] == [0, 1, 2, 3, 4]
        assert [body[1][0]["i"] for _, _, body in got] == [0, 1, 2, 3, 4]
    finally:
        second.close()


def test_close_flushes_what_is_queued_and_later_batches_are_counted_as_dropped(subscriber):
    endpoint = loopback()
    publisher = ZmqEventPublisher(endpoint)
    sub = subscriber(endpoint)
    assert publisher.wait_for_subscriber(5.0)
    for i in range(50):
        publisher.publish([{"type": "AllBlocksCleared", "i": i}])
    publisher.close()
    assert [seq for _, seq, _ in receive(sub, 50)] == list(range(50))
    publisher.publish([{"type": "AllBlocksCleared"}])
    assert publisher.dropped == 1
    publisher.close()  # idempotent


def test_wait_for_subscriber_is_bounded_and_counts_subscribers(subscriber, closing):
    endpoint = loopback()
    publisher = closing(ZmqEventPublisher(endpoint))
    started = time.monotonic()
    assert publisher.wait_for_subscriber(0.2) is False
    assert time.monotonic() - started < 2
    sub = subscriber(endpoint)
    assert publisher.wait_for_subscriber(5.0)
    assert publisher.subscribers == 1
    sub.close(linger=0)
    deadline = time.monotonic() + 5
    while publisher.subscribers and time.monotonic() < deadline:
        time.sleep(0.02)
    assert publisher.subscribers == 0


@pytest.mark.parametrize(
    "endpoint",
    ["127.0.0.1:5557", "ipc:///tmp/x", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://:5"],
)
def test_bad_bind_addresses_are_config_errors(endpoint):
    with pytest.raises(ConfigError, match="kv events endpoint"):
        ZmqEventPublisher(endpoint)


def test_bad_dp_rank_and_bounds_are_config_errors():
    with pytest.raises(ConfigError, match="dp_rank"):
        ZmqEventPublisher(loopback(), dp_rank=-1)
    with pytest.raises(ConfigError, match="max_queued_batches"):
        ZmqEventPublisher(loopback(), max_queued_batches=0)


def test_a_taken_port_is_a_transport_error(closing):
    from kvcr.ports.errors import TransportError

    endpoint = loopback()
    closing(ZmqEventPublisher(endpoint))
    with pytest.raises(TransportError, match="cannot bind"):
        ZmqEventPublisher(endpoint)


def test_importing_the_adapters_opens_nothing_and_imports_no_zmq():
    code = (
        "import sys, threading, kvcr.adapters.zmq, kvcr.integrations.dynamo, kvcr.container\n"
        "assert 'zmq' not in sys.modules and 'msgpack' not in sys.modules and 'dynamo' not in sys.modules\n"
        "assert threading.active_count() == 1\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
