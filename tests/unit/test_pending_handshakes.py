"""PendingHandshakes: which accepted connections wait for their handshake, and which are cut past the cap."""

import socket

import pytest

from kvcr.adapters.zmq.pending import PendingHandshakes, shut_down


def test_past_the_cap_the_oldest_waiting_connections_are_cut_in_order():
    cut: list[int] = []
    pending = PendingHandshakes(2, cut.append)
    for fd in (10, 11, 12, 13):
        pending.accepted(fd)
    assert pending.enforce() == 2
    assert cut == [10, 11] and len(pending) == 2
    assert pending.enforce() == 0 and cut == [10, 11]  # at the cap: nothing more


def test_a_connection_whose_handshake_ended_no_longer_counts():
    cut: list[int] = []
    pending = PendingHandshakes(1, cut.append)
    pending.accepted(10)
    pending.ended(10)  # succeeded, failed or closed
    pending.accepted(11)
    pending.ended(99)  # never seen: nothing happens
    assert pending.enforce() == 0 and cut == [] and len(pending) == 1


def test_a_descriptor_number_reused_after_its_close_counts_as_the_newest():
    cut: list[int] = []
    pending = PendingHandshakes(2, cut.append)
    pending.accepted(10)
    pending.accepted(11)
    pending.accepted(10)  # 10 closed without an event we saw, and its number came back
    pending.accepted(12)
    assert pending.enforce() == 1 and cut == [11]


def test_the_cap_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        PendingHandshakes(0)


def test_shutting_down_a_descriptor_ends_the_peers_connection_and_leaves_the_descriptor_open():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname(), timeout=5)
    accepted, _ = server.accept()
    try:
        shut_down(accepted.fileno())
        assert client.recv(1) == b""  # the peer sees the connection end
        assert accepted.fileno() >= 0  # the owner still holds (and will close) its descriptor
        shut_down(10_000)  # not a descriptor: nothing to cut, no error
    finally:
        for s in (client, accepted, server):
            s.close()
