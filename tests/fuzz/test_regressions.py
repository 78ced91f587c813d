"""What the fuzz suite found, pinned as plain tests (each one failed before its fix)."""

import pytest

from kvcr.runner import protocol
from kvcr.runner.protocol import Hello, Lease, RefusalCode, Refused
from tests.support import Cluster


@pytest.fixture
def source():
    cluster = Cluster()
    yield cluster.node("A")
    cluster.close()


@pytest.mark.parametrize("nonce", [b"\x00" * (1 << 20), b"short", b"", b"n" * 17])
def test_a_refusal_never_echoes_a_malformed_nonce(source, nonce):
    """A 1 MiB "nonce" came back in full in the refusal (1 MiB in, 1 MiB out): only 16-byte nonces are echoed."""
    namespaces = dict(source.runner.namespaces)
    requests = [
        (Hello(nonce, "x", "i", namespaces), RefusalCode.MALFORMED),  # not a nonce at all (it was REPLAYED)
        (Hello(nonce, "x", "i", {"kv": "another"}), RefusalCode.NAMESPACE),
        (Hello(nonce, "x", "i", {f"p{i}": "" for i in range(100)}), RefusalCode.TOO_LARGE),
        (Lease(nonce, 12345, 1000, [(0, [])]), RefusalCode.MALFORMED),
    ]
    for request, code in requests:
        reply = source.server.handle(protocol.encode(request))
        assert len(reply) < 64
        assert protocol.decode(reply) == Refused(b"", int(code))


@pytest.mark.parametrize(
    "lie",
    [{"regions": [1]}, {"regions": [1, 2, 3]}, {"regions": []}],
)
@pytest.mark.parametrize("landing", ["direct", "staged"])
def test_a_pool_description_that_does_not_fit_our_pool_is_not_linked(lie, landing):
    """A HELLO_REPLY listing one region for a two-component pool raised ValueError out of restore
    (``zip(strict=True)`` while planning the read), and a staging target lost its staging buffers
    for good (taken before the exception): every later restore was a miss."""
    from kvcr.adapters.mock import MockControlChannel
    from kvcr.domain.outcomes import Outcome
    from kvcr.runner.peer_client import PeerSettings, PoolRead
    from kvcr.runner.protocol import HelloReply
    from tests.support import content, seed, sequence

    cluster = Cluster()
    try:
        source, target = cluster.node("A"), cluster.node("B", peer=PeerSettings(landing=landing))
        pages = sequence(2)
        seed(source, pages, [0, 1])

        def lying(frame):
            reply = source.server.handle(frame)
            if reply is not None and isinstance(message := protocol.decode(reply), HelloReply):
                pools = [type(p)(**{**{f: getattr(p, f) for f in p.__struct_fields__}, **lie}) for p in message.pools]
                fields = {f: getattr(message, f) for f in message.__struct_fields__}
                reply = protocol.encode(HelloReply(**{**fields, "pools": pools}))
            return reply

        relay = MockControlChannel(cluster.fabric, "tcp://127.0.0.1:20999", cluster.clock)
        relay.serve(lying)
        for _ in range(8):  # more than the staging pool's buffers
            result = target.client.restore(relay.endpoint, [PoolRead("kv", pages, [5, 6])])
            assert [o.outcome for o in result["kv"]] == [Outcome.MISS, Outcome.MISS]
            cluster.clock.advance(2)  # past the relay's retry pause
        result = target.client.restore(source.endpoint, [PoolRead("kv", pages, [5, 6])])
        assert [o.outcome for o in result["kv"]] == [Outcome.RESTORED] * 2
        assert target.hosts["kv"].read_page(6) == content(pages[1], 512)
    finally:
        cluster.close()


@pytest.mark.parametrize("path", ["/tmp/token\x00", "/tmp/token\ud800"])
def test_an_unusable_token_path_is_a_config_error_naming_the_setting(path):
    """A NUL byte (or an unencodable character) in auth_token_file raised ValueError from os.stat."""
    from kvcr.domain.errors import ConfigError
    from kvcr.integrations.shared.settings import parse_settings, read_token_file

    with pytest.raises(ConfigError, match=r"auth_token_file .* is not a usable path"):
        read_token_file(path)
    with pytest.raises(ConfigError, match="auth_token_file"):
        parse_settings({"auth_token_file": path}).token()


@pytest.mark.parametrize("rate", [float("nan"), float("inf")])
def test_a_recompute_rate_that_is_not_a_finite_number_is_refused(rate):
    """json.loads (how SGLang reads the extra config) accepts NaN and Infinity, and both were taken:
    NaN silently turned the slower-than-recompute check off, Infinity made every remote read after
    the first a miss."""
    from kvcr.domain.errors import ConfigError
    from kvcr.integrations.shared.settings import parse_settings

    with pytest.raises(ConfigError, match="recompute_tokens_per_s"):
        parse_settings({"recompute_tokens_per_s": rate})


@pytest.mark.parametrize(
    "key", ["control_port", "lease_ms", "read_batch_pages", "recompute_tokens_per_s", "dram_bytes"]
)
def test_an_integer_too_long_to_print_is_a_config_error_naming_the_setting(key):
    """An int of over 4300 digits made building the error message raise ValueError (str() refuses it)."""
    from kvcr.domain.errors import ConfigError
    from kvcr.integrations.shared.settings import parse_settings

    with pytest.raises(ConfigError, match=key):
        parse_settings({key: -(10**5000)})
    with pytest.raises(ConfigError, match="transport"):
        parse_settings({"transport": [10**5000]})  # the wrong type, shown in the message
    with pytest.raises(ConfigError, match="unknown kvcr setting"):
        parse_settings({10**5000: 1})


@pytest.mark.zmq
def test_a_one_way_message_sent_as_a_request_is_answered_without_a_traceback(caplog):
    """RELEASE sent with a request id made the ZMQ server raise TypeError inside its own loop and log
    'control handler ... failed' with a traceback: a peer's mistake looked like a handler bug."""
    import logging
    import time

    import zmq

    from kvcr.adapters.local import MonotonicClock
    from kvcr.runner.protocol import Release

    cluster = Cluster(MonotonicClock(), control="zmq")
    context = zmq.Context()
    try:
        source = cluster.node("A")
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(source.endpoint)
        with caplog.at_level(logging.WARNING, logger="kvcr"):
            sock.send_multipart([b"\x00" * 7 + b"\x01", protocol.encode(Release(1, [2]))])
            assert sock.poll(10_000)
            assert sock.recv_multipart() == [b"\x00" * 7 + b"\x01", b"\x01", b"no reply: a one-way message"]
            time.sleep(0.05)
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
        sock.close(linger=0)
    finally:
        context.term()
        cluster.close()


def test_the_nonces_a_server_remembers_are_bounded_across_sessions():
    """Each session kept up to 65,536 nonces and 4,096 sessions were kept: a token holder could make
    the server remember about 268 M nonces (~20 GB). A budget across sessions drops the least
    recently used sessions first; a dropped session's peer is told so and is served after a new HELLO."""
    import secrets

    from kvcr.adapters.local import InMemoryMetrics
    from kvcr.adapters.mock import MockDataPlane
    from kvcr.runner.peer_server import PeerServer, ServerLimits
    from kvcr.runner.protocol import HelloReply, LeaseReply

    cluster = Cluster()
    try:
        runner = cluster.node("A").runner
        plane = MockDataPlane(cluster.fabric, "budget", cluster.clock)
        arena_ids = {pool: plane.register(regions, exposed=True) for pool, regions in runner.pool_arenas().items()}
        server = PeerServer(runner, plane, arena_ids, InMemoryMetrics(), limits=ServerLimits(max_tracked_nonces=50))
        namespaces = dict(runner.namespaces)

        def ask(message):
            return protocol.decode(server.handle(protocol.encode(message)))

        def hello():
            reply = ask(Hello(secrets.token_bytes(16), "p", "i", namespaces))
            assert isinstance(reply, HelloReply)
            return reply.session

        def lease(session):
            return ask(Lease(secrets.token_bytes(16), session, 1000, [(0, [])]))

        sessions = [hello() for _ in range(10)]
        answers = {}
        for _ in range(20):
            for session in sessions:
                answers[session] = lease(session)
            assert server.tracked_nonces <= 50
        kept = [s for s in sessions if isinstance(answers[s], LeaseReply)]
        forgotten = [s for s in sessions if not isinstance(answers[s], LeaseReply)]
        assert kept and forgotten  # the budget dropped some sessions and kept serving others
        assert all(answers[s] == Refused(answers[s].nonce, int(RefusalCode.UNKNOWN_SESSION)) for s in forgotten)
        assert isinstance(lease(kept[-1]), LeaseReply)
        assert isinstance(lease(hello()), LeaseReply)  # a forgotten peer says HELLO again and is served
        plane.close()
    finally:
        cluster.close()
