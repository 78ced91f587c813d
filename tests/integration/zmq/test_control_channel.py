"""ZmqControlChannel behaviour beyond the contract: concurrency, stalls, restarts, failures, close."""

import contextlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kvcr.adapters.zmq import ZmqControlChannel
from kvcr.adapters.zmq.curve import Keyring
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


# ------------------------------------------------------------------ security settings

TOKEN = b"a-cluster-token-of-32-bytes-long"


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"bind_host": "10.0.0.7"}, "allow_unauthenticated"),
        ({"bind_host": "0.0.0.0", "advertise_host": "10.0.0.7"}, "allow_unauthenticated"),
        ({"bind_host": "my-host"}, "allow_unauthenticated"),
        ({"rotation_tokens": [b"next-token-next-token"]}, "rotation_tokens"),
        ({"token": b""}, "token"),
        ({"max_peers": 0}, "max_peers"),
        ({"idle_close_s": 0}, "idle_close_s"),
        ({"idle_close_s": float("nan")}, "idle_close_s"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s"),
        ({"handshake_timeout_s": float("inf")}, "handshake_timeout_s"),
        ({"handshake_timeout_s": "2"}, "handshake_timeout_s"),
    ],
)
def test_unsafe_or_bad_security_settings_are_config_errors_naming_the_setting(kwargs, setting):
    kwargs = {"bind_host": "127.0.0.1", **kwargs}
    with pytest.raises(ConfigError, match=setting):
        ZmqControlChannel(kwargs.pop("bind_host"), 41000, **kwargs)


def test_a_routable_bind_needs_a_token_or_an_explicit_opt_in_which_is_logged(caplog):
    with_token = ZmqControlChannel("0.0.0.0", free_port(), advertise_host="127.0.0.1", token=TOKEN)
    loopback = ZmqControlChannel("::1", free_port())  # loopback needs nothing
    assert with_token.authenticated and not loopback.authenticated
    with_token.close()
    loopback.close()
    opened = ZmqControlChannel("0.0.0.0", free_port(), advertise_host="127.0.0.1", allow_unauthenticated=True)
    try:
        with caplog.at_level("WARNING"):
            opened.serve(echo)
        assert any("WITHOUT authentication" in r.getMessage() for r in caplog.records)
    finally:
        opened.close()


def test_curve_channels_round_trip_and_a_plaintext_server_refuses_a_curve_client(channels):
    server, client = channels(token=TOKEN), channels(token=TOKEN)
    server.serve(echo)
    assert server.authenticated
    assert client.request(server.endpoint, b"secret", timeout_s=2.0) == b"echo:secret"
    plain = channels()
    plain.serve(echo)
    began = time.monotonic()
    with pytest.raises(PeerUnavailable, match="handshake failed"):
        client.request(plain.endpoint, b"x", timeout_s=5.0)
    assert time.monotonic() - began < 0.5


def test_two_authenticated_servers_cannot_share_one_context():
    ctx = zmq.Context()
    first = ZmqControlChannel("127.0.0.1", free_port(), token=TOKEN, context=ctx)
    second = ZmqControlChannel("127.0.0.1", free_port(), token=TOKEN, context=ctx)
    try:
        first.serve(echo)
        with pytest.raises(TransportError, match="context"):
            second.serve(echo)
    finally:
        first.close()
        second.close()
        ctx.term()


def test_refusals_are_counted_by_reason_and_reported_to_the_callback(channels):
    reported = []

    def callback(reason):
        reported.append(reason)
        raise RuntimeError("a broken metrics sink must not stop the server")

    server = channels(token=TOKEN, on_refusal=callback)
    server.serve(echo)
    outsider = channels(token=b"another-token-of-the-same-length")
    with pytest.raises(PeerUnavailable):
        outsider.request(server.endpoint, b"x", timeout_s=2.0)
    ctx = zmq.Context()
    try:
        member = ctx.socket(zmq.DEALER)
        member.linger = 0
        Keyring(TOKEN).configure_client(member, 0)
        member.connect(server.endpoint)
        member.send(b"one frame is not a request")
        give_up = time.monotonic() + 5
        while server.refusals["frame"] < 1 and time.monotonic() < give_up:
            time.sleep(0.01)
    finally:
        ctx.destroy(linger=0)
    assert set(server.refusals) == set(ZmqControlChannel.REFUSAL_REASONS)
    assert server.refusals["frame"] == 1
    assert "frame" in reported
    assert channels(token=TOKEN).request(server.endpoint, b"ok", timeout_s=2.0) == b"echo:ok"


# ------------------------------------------------------------------ one-way messages and bounded links


def test_one_way_messages_to_a_dead_peer_are_dropped_without_blocking(channels):
    client = channels()
    dead = f"tcp://127.0.0.1:{free_port()}"
    began = time.monotonic()
    for _ in range(5000):
        client.send(dead, b"RELEASE")
    assert time.monotonic() - began < 2.0
    assert client.dropped_sends > 0  # beyond the small queue kept while (re)connecting
    assert client.open_peers() == 1


def test_a_one_way_message_whose_handler_fails_is_logged_rarely_and_the_server_keeps_serving(channels, caplog):
    server, client = channels(), channels()
    failures = []

    def handler(payload):
        if payload == b"RELEASE":
            failures.append(payload)
            raise RuntimeError("handler bug")
        return echo(payload)

    server.serve(handler)
    assert client.request(server.endpoint, b"up", timeout_s=2.0) == b"echo:up"
    with caplog.at_level("WARNING"):
        for _ in range(200):
            client.send(server.endpoint, b"RELEASE")
        give_up = time.monotonic() + 5
        while len(failures) < 200 and time.monotonic() < give_up:
            time.sleep(0.01)
    assert len(failures) == 200
    assert sum("handler on" in r.getMessage() for r in caplog.records) == 1
    assert client.request(server.endpoint, b"still", timeout_s=2.0) == b"echo:still"


def test_at_most_max_peers_keep_sockets_and_evicted_peers_are_dialled_again(channels):
    servers = [channels() for _ in range(6)]
    for i, server in enumerate(servers):
        server.serve(lambda payload, i=i: f"{i}".encode())
    client = channels(max_peers=3)
    for _ in range(2):
        for i, server in enumerate(servers):
            assert client.request(server.endpoint, b"?", timeout_s=2.0) == f"{i}".encode()
            assert client.open_peers() <= 3
    client.send(servers[0].endpoint, b"one-way counts as use")
    assert client.open_peers() <= 3


def test_idle_peers_are_closed_after_idle_close_s(channels):
    servers = [channels() for _ in range(3)]
    for server in servers:
        server.serve(echo)
    client = channels(idle_close_s=0.2)
    client.serve(echo)  # its server thread runs the idle sweep
    for server in servers:
        assert client.request(server.endpoint, b"x", timeout_s=2.0) == b"echo:x"
    assert client.open_peers() == 3
    give_up = time.monotonic() + 5
    while client.open_peers() and time.monotonic() < give_up:
        time.sleep(0.05)
    assert client.open_peers() == 0
    assert client.request(servers[0].endpoint, b"y", timeout_s=2.0) == b"echo:y"


def test_forget_closes_the_sockets_kept_for_a_peer(channels):
    server, other, client = channels(), channels(), channels()
    server.serve(echo)
    other.serve(echo)
    assert client.request(server.endpoint, b"x", timeout_s=2.0) == b"echo:x"
    assert client.request(other.endpoint, b"x", timeout_s=2.0) == b"echo:x"
    assert client.open_peers() == 2
    client.forget(server.endpoint)
    assert client.open_peers() == 1
    assert client.request(server.endpoint, b"y", timeout_s=2.0) == b"echo:y"


def test_forget_during_a_request_closes_its_socket_when_the_request_ends(channels):
    server, client = channels(), channels()
    release = threading.Event()
    server.serve(lambda payload: release.wait(5) and echo(payload))
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(client.request(server.endpoint, b"x", timeout_s=5.0)))
    thread.start()
    time.sleep(0.2)
    client.forget(server.endpoint)
    release.set()
    thread.join(5)
    assert outcome == [b"echo:x"]
    assert client.open_peers() == 0


@pytest.mark.multiprocess
def test_the_round_trip_benchmark_runs_and_reports_every_case(capsys):
    from kvcr.bench import zmq_adapter as bench

    bench.main(["--requests", "50", "--cold", "10", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report["results"]) == {"raw", "plaintext", "curve", "plaintext cold", "curve cold"}
    for result in report["results"].values():
        assert 0 < result["p50_us"] <= result["p99_us"]
    assert report["results"]["plaintext"]["p50_vs_plaintext"] == 1.0


def test_a_peer_that_drops_the_greeting_is_not_blamed_on_a_token_no_one_set(channels):
    # A peer killed or restarting mid-greeting, dialled by a node with no token: the failure must
    # not send its operator after a cluster token neither side has.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def drop_every_greeting():
        listener.settimeout(0.05)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                conn.recv(64)  # the start of the ZMTP greeting, then gone
                conn.close()

    thread = threading.Thread(target=drop_every_greeting, daemon=True)
    thread.start()
    try:
        client = channels()
        with pytest.raises(PeerUnavailable) as failed:
            client.request(f"tcp://127.0.0.1:{listener.getsockname()[1]}", b"x", timeout_s=2.0)
        assert "token" not in str(failed.value), str(failed.value)
    finally:
        stop.set()
        thread.join(2)
        listener.close()
