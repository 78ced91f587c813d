"""The ControlChannel contract."""

import pytest

from kvcr.ports.errors import PeerUnavailable, TransportError


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
