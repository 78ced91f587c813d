"""ZmqControlChannel behaviour beyond the contract: concurrency, stalls, restarts, failures, close."""

import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kvcr.adapters.zmq import ZmqControlChannel
from kvcr.domain.errors import ConfigError
from kvcr.ports.errors import ControlTimeout, PeerRefused, PeerUnavailable, TransportError
from tests.contract.zmq_kind import free_port

pytestmark = pytest.mark.zmq


def echo(payload):
    return b"echo:" + payload


def test_concurrent_requests_from_four_threads_each_get_their_own_reply(channels):
    server, client = channels(), channels()
    server.serve(echo)
    errors, start = [], threading.Barrier(4)

    def worker(t):
        try:
            start.wait(5)
            for i in range(200):
                payload = f"{t}:{i}".encode() * (1 + i % 7)
                assert client.request(server.endpoint, payload, timeout_s=5.0) == b"echo:" + payload
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)


def test_a_stalled_server_times_out_in_time_and_later_replies_are_not_mixed_up(channels):
    server, client = channels(), channels()
    stalled = threading.Event()

    def handler(payload):
        if payload == b"stall":
            stalled.set()
            time.sleep(1.0)
        return echo(payload)

    server.serve(handler)
    began = time.monotonic()
    with pytest.raises(ControlTimeout):
        client.request(server.endpoint, b"stall", timeout_s=0.3)
    assert time.monotonic() - began < 0.3 + 0.5
    assert stalled.is_set()
    # Sent while the server still sleeps: answered after the stall, with its own reply, not "stall"'s.
    assert client.request(server.endpoint, b"next", timeout_s=3.0) == b"echo:next"
    assert client.request(server.endpoint, b"again", timeout_s=1.0) == b"echo:again"


def test_stale_replies_with_another_request_id_are_discarded(channels):
    """A raw ROUTER answers each request first with a foreign id, then with the right one."""
    port = free_port()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(f"tcp://127.0.0.1:{port}")

    def serve_once():
        if router.poll(5000):
            identity, request_id, payload = router.recv_multipart()
            (number,) = struct.unpack(">Q", request_id)
            router.send_multipart([identity, struct.pack(">Q", number + 1000), b"\x00", b"stale"])
            router.send_multipart([identity, request_id, b"\x00", b"fresh:" + payload])

    try:
        thread = threading.Thread(target=serve_once)
        thread.start()
        assert channels().request(f"tcp://127.0.0.1:{port}", b"x", timeout_s=3.0) == b"fresh:x"
        thread.join(5)
    finally:
        router.close()
        ctx.term()


def test_nobody_listening_fails_fast_not_at_the_deadline(channels):
    client = channels()
    began = time.monotonic()
    with pytest.raises(PeerUnavailable):
        client.request(f"tcp://127.0.0.1:{free_port()}", b"x", timeout_s=5.0)
    assert time.monotonic() - began < 0.5


def test_a_server_restarted_on_the_same_port_is_reachable_again(channels):
    port = free_port()
    client = channels()
    first = channels(port)
    first.serve(lambda payload: b"first")
    assert client.request(first.endpoint, b"x", timeout_s=2.0) == b"first"
    first.close()
    with pytest.raises(PeerUnavailable):  # the pooled connection saw the peer go
        client.request(first.endpoint, b"x", timeout_s=1.0)
    second = channels(port)
    second.serve(lambda payload: b"second")
    assert client.request(second.endpoint, b"x", timeout_s=2.0) == b"second"


def test_a_handler_that_raises_does_not_kill_the_server(channels):
    server, client = channels(), channels()

    def handler(payload):
        if payload == b"boom":
            raise RuntimeError("handler bug")
        return echo(payload)

    server.serve(handler)
    with pytest.raises(PeerRefused, match="RuntimeError"):
        client.request(server.endpoint, b"boom", timeout_s=2.0)
    assert client.request(server.endpoint, b"ok", timeout_s=2.0) == b"echo:ok"


def test_close_while_a_request_is_in_flight_returns_promptly(channels):
    server, client = channels(), channels()
    release = threading.Event()
    server.serve(lambda payload: release.wait(5) and b"late")
    outcome = []

    def ask():
        began = time.monotonic()
        try:
            client.request(server.endpoint, b"x", timeout_s=5.0)
            outcome.append(("reply", time.monotonic() - began))
        except TransportError as exc:
            outcome.append((type(exc).__name__, time.monotonic() - began))

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(0.2)  # the request is now waiting on the stalled server
    began = time.monotonic()
    client.close()
    assert time.monotonic() - began < 0.5
    thread.join(2)
    assert not thread.is_alive()
    assert outcome[0][0] == "TransportError" and outcome[0][1] < 1.0
    with pytest.raises(TransportError):
        client.request(server.endpoint, b"x", timeout_s=1.0)
    release.set()


def test_close_is_idempotent_and_a_closed_channel_refuses_work(channels):
    server = channels()
    server.serve(echo)
    server.close()
    server.close()
    with pytest.raises(TransportError):
        server.serve(echo)
    with pytest.raises(TransportError):
        server.request("tcp://127.0.0.1:1", b"x", timeout_s=0.1)


def test_serving_twice_is_refused(channels):
    server = channels()
    server.serve(echo)
    with pytest.raises(TransportError, match="already serving"):
        server.serve(echo)


def test_a_port_in_use_is_a_transport_error_naming_the_endpoint(channels):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(TransportError, match=f"tcp://127.0.0.1:{port}"):
            channels(port).serve(echo)


def test_a_malformed_endpoint_is_peer_unavailable(channels):
    with pytest.raises(PeerUnavailable):
        channels().request("not-an-endpoint", b"x", timeout_s=0.5)


def test_an_oversized_request_is_refused_locally(channels):
    client = channels(max_message_bytes=1024)
    with pytest.raises(TransportError, match="max_message_bytes"):
        client.request("tcp://127.0.0.1:1", bytes(2048), timeout_s=0.5)


def test_an_oversized_reply_drops_the_connection_instead_of_hanging(channels):
    server, client = channels(), channels(max_message_bytes=1 << 16)
    server.serve(lambda payload: bytes(1 << 20))
    began = time.monotonic()
    with pytest.raises(PeerUnavailable):
        client.request(server.endpoint, b"x", timeout_s=3.0)
    assert time.monotonic() - began < 1.0


@pytest.mark.parametrize(
    ("bind_host", "port", "advertise_host", "setting"),
    [
        ("127.0.0.1", 0, None, "port"),
        ("127.0.0.1", 70000, None, "port"),
        ("0.0.0.0", 41000, None, "advertise_host"),
        ("*", 41000, None, "advertise_host"),
        ("127.0.0.1", 41000, "0.0.0.0", "advertise_host"),
        ("127.0.0.1", 41000, "*", "advertise_host"),
        ("127.0.0.1", 41000, "::", "advertise_host"),
        ("", 41000, None, "bind_host"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_setting(bind_host, port, advertise_host, setting):
    with pytest.raises(ConfigError, match=setting):
        ZmqControlChannel(bind_host, port, advertise_host=advertise_host)


def test_the_advertised_endpoint(channels):
    assert channels(41000).endpoint == "tcp://127.0.0.1:41000"
    for bind_host, advertise_host, endpoint in [
        ("0.0.0.0", "10.0.0.7", "tcp://10.0.0.7:41000"),
        ("::1", None, "tcp://[::1]:41000"),
    ]:
        channel = ZmqControlChannel(bind_host, 41000, advertise_host=advertise_host, allow_unauthenticated=True)
        assert channel.endpoint == endpoint
        channel.close()


def test_a_wildcard_bind_is_reachable_through_the_advertised_host(channels):
    wildcard = ZmqControlChannel("0.0.0.0", free_port(), advertise_host="127.0.0.1", allow_unauthenticated=True)
    try:
        wildcard.serve(echo)
        assert channels().request(wildcard.endpoint, b"w", timeout_s=2.0) == b"echo:w"
    finally:
        wildcard.close()


def _ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            return probe.getsockname()[1]
    except OSError:
        return None


def test_an_ipv6_loopback_server_is_reachable(channels):
    port = _ipv6_loopback()
    if port is None:
        pytest.skip("this machine has no IPv6 loopback")
    server = ZmqControlChannel("::1", port)
    try:
        server.serve(echo)
        assert server.endpoint == f"tcp://[::1]:{port}"
        assert channels().request(server.endpoint, b"6", timeout_s=2.0) == b"echo:6"
    finally:
        server.close()


def test_a_shared_context_is_left_running(channels):
    ctx = zmq.Context()
    try:
        server = ZmqControlChannel("127.0.0.1", free_port(), context=ctx)
        server.serve(echo)
        assert channels().request(server.endpoint, b"s", timeout_s=2.0) == b"echo:s"
        server.close()
        assert not ctx.closed
    finally:
        ctx.term()


@pytest.mark.multiprocess
def test_importing_the_package_does_not_import_pyzmq():
    code = "import sys, kvcr.adapters.zmq; assert 'zmq' not in sys.modules, 'zmq imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
