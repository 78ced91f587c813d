"""The ControlChannel contract."""

import time

import pytest

from kvcr.ports.errors import PeerRefused, PeerUnavailable, TransportError


def test_request_reaches_the_handler_and_returns_its_reply(control_channels):
    server, client = control_channels(41001), control_channels(41002)
    server.serve(lambda payload: b"echo:" + payload)
    assert client.request(server.endpoint, b"hello", timeout_s=2.0) == b"echo:hello"
    assert client.request(server.endpoint, b"", timeout_s=2.0) == b"echo:"


def test_nobody_listening_is_peer_unavailable(control_channels):
    client = control_channels(41003)
    with pytest.raises(PeerUnavailable):
        client.request("tcp://127.0.0.1:41999", b"x", timeout_s=0.5)


def test_a_closed_server_stops_answering(control_channels):
    server, client = control_channels(41004), control_channels(41005)
    server.serve(lambda payload: payload)
    server.close()
    with pytest.raises(TransportError):
        client.request(server.endpoint, b"x", timeout_s=0.5)


def test_large_payloads_round_trip(control_channels):
    server, client = control_channels(41006), control_channels(41007)
    server.serve(lambda payload: payload[::-1])
    blob = bytes(range(256)) * 4096
    assert client.request(server.endpoint, blob, timeout_s=5.0) == blob[::-1]


def _until(condition, timeout_s=5.0):
    """Wait (bounded) for something a channel delivers on its own thread; True if it came."""
    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.005)
    return True


def test_a_one_way_message_reaches_the_handler_and_nothing_answers_it(control_channels):
    server, client = control_channels(41011), control_channels(41012)
    seen = []

    def handler(payload):
        seen.append(payload)
        return None if payload.startswith(b"RELEASE") else b"echo:" + payload

    server.serve(handler)
    client.send(server.endpoint, b"RELEASE 1")
    assert _until(lambda: b"RELEASE 1" in seen)
    # No reply was sent for it, so none can be mistaken for the next request's.
    assert client.request(server.endpoint, b"LEASE", timeout_s=2.0) == b"echo:LEASE"
    client.send(server.endpoint, b"RELEASE 2")
    assert _until(lambda: b"RELEASE 2" in seen)
    assert client.request(server.endpoint, b"LEASE again", timeout_s=2.0) == b"echo:LEASE again"
    assert seen == [b"RELEASE 1", b"LEASE", b"RELEASE 2", b"LEASE again"]


def test_one_way_messages_never_raise_and_never_block(control_channels):
    client = control_channels(41013)
    began = time.monotonic()
    client.send("tcp://127.0.0.1:41999", b"nobody listens")
    client.send("not-an-endpoint", b"x")
    client.close()
    client.send("tcp://127.0.0.1:41999", b"after close")
    assert time.monotonic() - began < 0.5


def test_a_request_the_handler_does_not_answer_is_refused(control_channels):
    server, client = control_channels(41014), control_channels(41015)
    server.serve(lambda payload: None)
    with pytest.raises(PeerRefused):
        client.request(server.endpoint, b"LEASE", timeout_s=2.0)


def test_forget_closes_a_peer_and_the_next_request_dials_again(control_channels):
    server, client = control_channels(41016), control_channels(41017)
    server.serve(lambda payload: b"echo:" + payload)
    assert client.request(server.endpoint, b"1", timeout_s=2.0) == b"echo:1"
    client.forget(server.endpoint)
    client.forget(server.endpoint)  # twice is fine
    client.forget("tcp://127.0.0.1:41999")  # never dialled
    client.forget("not-an-endpoint")
    assert client.request(server.endpoint, b"2", timeout_s=2.0) == b"echo:2"
