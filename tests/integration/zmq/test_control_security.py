"""Attacks on the control port, with the server in another process and real sockets on loopback.

Each attack is also run against a plaintext server where that shows the attack itself works
(the replay is faithful, the relay really rewrites bytes): the CURVE server must be what stops it.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from kvcr.adapters.zmq import ZmqControlChannel
from kvcr.adapters.zmq.curve import Keyring
from kvcr.ports.errors import ControlTimeout, PeerUnavailable, TransportError
from kvcr.testing.processes import stop_process
from tests.contract.zmq_kind import free_port
from tests.integration.zmq.relay import Relay, flip_at, splice_at

pytestmark = [pytest.mark.zmq, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[3]
TOKEN = b"a-cluster-token-of-32-bytes-long"
FAST_S = 0.5  # "within milliseconds", with room for a loaded CI machine


class Server:
    """``tests.integration.zmq.control_server`` in a child process."""

    def __init__(self, tmp_path: Path, token: bytes | None) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "tests.integration.zmq.control_server", "--port", str(self.port)]
        if token is not None:
            token_file = tmp_path / f"token-{self.port}"
            token_file.write_bytes(token)
            token_file.chmod(0o600)
            cmd += ["--token-file", str(token_file)]
        self.stderr_path = tmp_path / f"server-{self.port}.log"
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True
        )
        line = self._readline(60)
        if not line.startswith("READY "):
            self.kill()
            raise AssertionError(f"server did not start: {self.stderr_path.read_text()[-3000:]}")
        self.endpoint = line.split()[1]

    def _readline(self, timeout_s: float) -> str:
        out: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None  # a pipe
        reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return out[0] if out else ""

    def stats(self) -> dict:
        assert self.proc.stdin is not None  # a pipe
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self._readline(10))

    def wait_for(self, condition, timeout_s: float = 10.0) -> dict:
        """Poll stats until ``condition(stats)`` holds (the server counts on its own thread)."""
        give_up = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if condition(stats) or time.monotonic() > give_up:
                return stats
            time.sleep(0.05)

    def warnings(self, text: str) -> int:
        return sum(1 for line in self.stderr_path.read_text().splitlines() if "WARNING" in line and text in line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        stop_process(self.proc, grace_s=10)
        self._stderr.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None  # a pipe
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        self.kill()


@pytest.fixture
def server(tmp_path):
    made = []

    def start(token: bytes | None = TOKEN) -> Server:
        made.append(Server(tmp_path, token))
        return made[-1]

    yield start
    for s in made:
        s.stop()


@pytest.fixture
def client():
    made = []

    def make(**kwargs) -> ZmqControlChannel:
        made.append(ZmqControlChannel("127.0.0.1", free_port(), **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def relay():
    made = []

    def start(endpoint: str) -> Relay:
        made.append(Relay(int(endpoint.rsplit(":", 1)[1])))
        return made[-1]

    yield start
    for r in made:
        r.close()


def raw_curve_dealer(ctx, endpoint: str, server_public: bytes):
    """A CURVE client that knows the server's public key but has its own keypair, not the token's."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.immediate = 1
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    return sock


# ---------------------------------------------------------------------------------------- credentials


@pytest.mark.parametrize(
    ("credentials", "reason"), [({}, "protocol"), ({"token": b"another-token-of-the-same-length"}, "protocol")]
)
def test_a_client_without_the_token_fails_fast_and_never_reaches_the_handler(server, client, credentials, reason):
    target = server()
    outsider = client(**credentials)
    for _ in range(3):
        began = time.monotonic()
        with pytest.raises(PeerUnavailable, match="handshake failed"):
            outsider.request(target.endpoint, b"HELLO", timeout_s=5.0)
        assert time.monotonic() - began < FAST_S
    # Our client hangs up at once, so the server may see a reset before the failed handshake:
    # at least one of the three is counted.
    stats = target.wait_for(lambda s: s["refusals"][reason] >= 3, timeout_s=2.0)
    assert stats["handled"] == 0
    assert stats["refusals"][reason] >= 1
    member = client(token=TOKEN)
    assert member.request(target.endpoint, b"HELLO", timeout_s=5.0) == b"echo:HELLO"
    assert target.stats()["handled"] == 1


def test_a_client_that_learned_the_server_key_but_holds_no_token_is_refused_by_zap(server):
    target = server()
    ctx = zmq.Context()
    try:
        sock = raw_curve_dealer(ctx, target.endpoint, Keyring(TOKEN).keys[0].server_public)
        give_up = time.monotonic() + 2.0
        while time.monotonic() < give_up:  # with IMMEDIATE nothing is ever queued: the handshake never completes
            with pytest.raises(zmq.Again):
                sock.send_multipart([b"\x00" * 7 + b"\x01", b"HELLO"], zmq.NOBLOCK)
            time.sleep(0.05)
        stats = target.wait_for(lambda s: s["refusals"]["credentials"] >= 1)
        assert stats["refusals"]["credentials"] >= 1
        assert stats["handled"] == 0
    finally:
        ctx.destroy(linger=0)


def test_a_curve_client_cannot_talk_to_a_plaintext_server(server, client):
    target = server(token=None)
    began = time.monotonic()
    with pytest.raises(PeerUnavailable):
        client(token=TOKEN).request(target.endpoint, b"x", timeout_s=5.0)
    assert time.monotonic() - began < FAST_S
    assert target.stats()["handled"] == 0


# ---------------------------------------------------------------------------------------- replay


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "plaintext"])
def test_recorded_bytes_replayed_on_a_new_connection_get_nothing(server, client, relay, secure):
    target = server(TOKEN if secure else None)
    wire = relay(target.endpoint)
    member = client(token=TOKEN) if secure else client()
    assert member.request(wire.endpoint, b"LEASE pages 0-3", timeout_s=5.0) == b"echo:LEASE pages 0-3"
    up, _ = wire.recorded()
    assert b"LEASE" not in up if secure else b"LEASE" in up  # CURVE also hides the request
    before = target.stats()
    answers = [wire.replay(target.port) for _ in range(5)]
    if secure:
        stats = target.wait_for(lambda s: s["refusals"]["protocol"] >= before["refusals"]["protocol"] + 5)
        assert stats["handled"] == before["handled"] == 1
        assert stats["refusals"]["protocol"] >= before["refusals"]["protocol"] + 5
        assert not any(b"echo:" in answer for answer in answers)
    else:  # the same bytes are a working request when nothing authenticates the connection
        stats = target.wait_for(lambda s: s["handled"] >= 6)
        assert stats["handled"] == 6
        assert all(b"echo:LEASE pages 0-3" in answer for answer in answers)


# ---------------------------------------------------------------------------------------- tampering


def test_a_bit_flipped_in_a_reply_breaks_the_connection_never_the_reply(server, client, relay):
    target = server()
    wire = relay(target.endpoint)
    member = client(token=TOKEN)
    assert member.request(wire.endpoint, b"warm-up", timeout_s=5.0) == b"echo:warm-up"
    wire.tamper_down = flip_at(len(wire.recorded()[1]) + 40)  # inside the next reply
    began = time.monotonic()
    with pytest.raises(PeerUnavailable):
        member.request(wire.endpoint, b"LEASE 0-3 " * 8, timeout_s=5.0)
    assert time.monotonic() - began < FAST_S
    wire.tamper_down = None
    assert member.request(wire.endpoint, b"after", timeout_s=5.0) == b"echo:after"  # a fresh connection works


def test_a_bit_flipped_in_a_request_never_reaches_the_handler(server, client, relay):
    target = server()
    wire = relay(target.endpoint)
    member = client(token=TOKEN)
    assert member.request(wire.endpoint, b"warm-up", timeout_s=5.0) == b"echo:warm-up"
    wire.tamper_up = flip_at(len(wire.recorded()[0]) + 40)
    # The server stops reading the connection at once and closes it at its next missed heartbeat
    # (about 3 s; see kvcr.adapters.zmq.server): an error either way, never a reply.
    began = time.monotonic()
    with pytest.raises((PeerUnavailable, ControlTimeout)):
        member.request(wire.endpoint, b"LEASE 0-3 " * 8, timeout_s=5.0)
    assert time.monotonic() - began < 6.0  # bounded by the deadline at worst
    wire.tamper_up = None
    assert member.request(wire.endpoint, b"after", timeout_s=5.0) == b"echo:after"
    stats = target.wait_for(lambda s: s["refusals"]["protocol"] >= 1)
    assert stats["payloads"] == [b"warm-up".hex(), b"after".hex()]
    assert stats["refusals"]["protocol"] >= 1


def test_the_plaintext_relay_really_rewrites_replies(server, client, relay):
    """The control case for the flip test: without CURVE the same relay makes a wrong reply land."""
    target = server(token=None)
    wire = relay(target.endpoint)
    member = client()
    assert member.request(wire.endpoint, b"warm-up", timeout_s=5.0) == b"echo:warm-up"
    payload = b"LEASE 0-3 " * 8
    reply_bytes = 10 + 3 + 2 + len(b"echo:" + payload)  # ZMTP short frames: id, status, body
    wire.tamper_down = flip_at(len(wire.recorded()[1]) + reply_bytes - 1)
    reply = member.request(wire.endpoint, payload, timeout_s=5.0)
    assert reply != b"echo:" + payload and len(reply) == len(b"echo:" + payload)


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "plaintext"])
def test_a_reply_spliced_in_for_another_request_is_never_accepted(server, client, relay, secure):
    target = server(TOKEN if secure else None)
    wire = relay(target.endpoint)
    member = client(token=TOKEN) if secure else client()
    assert member.request(wire.endpoint, b"warm-up", timeout_s=5.0) == b"echo:warm-up"
    start = len(wire.recorded()[1])
    assert member.request(wire.endpoint, b"LEASE pages 0-3", timeout_s=5.0) == b"echo:LEASE pages 0-3"
    end = len(wire.recorded()[1])
    wire.tamper_down = splice_at(end, wire.recorded()[1][start:end])  # same length: pages 4-7
    # CURVE: the old message's counter and MAC fail, the connection breaks. Plaintext: the old
    # reply carries the old request id and is discarded, so the request runs into its deadline.
    with pytest.raises(PeerUnavailable if secure else ControlTimeout):
        member.request(wire.endpoint, b"LEASE pages 4-7", timeout_s=1.0)


# ---------------------------------------------------------------------------------------- garbage


def _dealer(ctx, endpoint: str, secure: bool):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 10_000
    if secure:
        Keyring(TOKEN).configure_client(sock, 0)
    sock.connect(endpoint)
    return sock


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "plaintext"])
def test_the_server_survives_garbage_and_then_serves_a_member(server, client, secure):
    target = server(TOKEN if secure else None)
    baseline = target.stats()["rss_bytes"]
    for size in [1] * 10 + [1 << 16] * 10 + [1 << 20]:  # bytes that are not ZMTP at all
        with (
            socket.create_connection(("127.0.0.1", target.port), timeout=2.0) as junk,
            contextlib.suppress(BrokenPipeError, ConnectionResetError),  # the server hung up first
        ):
            junk.sendall(os.urandom(size))
    # A plaintext server may read random bytes as old-style ZMTP frames: count from here on.
    time.sleep(0.3)
    before = target.stats()
    ctx = zmq.Context()
    try:
        # 10,000 malformed frames at full speed from a connected peer: dropped, counted, rarely logged.
        flood = _dealer(ctx, target.endpoint, secure)
        for _ in range(10_000):
            flood.send(b"not [id, payload]")
        frames = before["refusals"]["frame"] + 10_000
        stats = target.wait_for(lambda s: s["refusals"]["frame"] >= frames, timeout_s=30)
        assert stats["refusals"]["frame"] == frames
        # 64 MiB: one over the limit (the connection is dropped), one under it but malformed.
        big = _dealer(ctx, target.endpoint, secure)
        big.send_multipart([b"\x00" * 7 + b"\x01", bytes((64 << 20) + (1 << 10))])
        under = _dealer(ctx, target.endpoint, secure)
        under.send(bytes((64 << 20) - (1 << 16)))
        stats = target.wait_for(lambda s: s["refusals"]["frame"] >= frames + 1, timeout_s=30)
        assert stats["refusals"]["frame"] == frames + 1
    finally:
        ctx.destroy(linger=0)
    member = client(token=TOKEN) if secure else client()
    assert member.request(target.endpoint, b"still here?", timeout_s=5.0) == b"echo:still here?"
    stats = target.stats()
    assert stats["handled"] == before["handled"] + 1
    assert stats["payloads"][-1] == b"still here?".hex()
    assert target.warnings("malformed request") <= 3  # one per 10 s at most, not one per frame
    assert stats["rss_bytes"] < baseline + (256 << 20)
    if secure:
        assert stats["handled"] == 1  # nothing unauthenticated ever reached the handler


# ---------------------------------------------------------------------------------------- rotation


def test_a_token_rotation_in_two_rolls_keeps_every_pair_of_nodes_talking(client):
    old, new = b"the-old-cluster-token-0123456789", b"the-new-cluster-token-0123456789"
    stages = {
        "before": {"token": old},
        "roll 1": {"token": old, "rotation_tokens": [new]},  # admit and try the new token
        "roll 2": {"token": new, "rotation_tokens": [old]},  # bind with the new, still admit the old
        "after": {"token": new},
    }
    servers = {}
    for name, credentials in stages.items():
        servers[name] = client(**credentials)
        servers[name].serve(lambda payload, name=name: name.encode())
    # During the first roll "before" and "roll 1" nodes coexist; during the second, "roll 1" and
    # "roll 2"; during the clean-up, "roll 2" and "after". Every such pair talks both ways.
    for a, b in [("before", "roll 1"), ("roll 1", "roll 2"), ("roll 2", "after")]:
        for src, dst in [(a, b), (b, a)]:
            asker = client(**stages[src])
            assert asker.request(servers[dst].endpoint, b"?", timeout_s=5.0) == dst.encode(), (src, dst)
    # Skipping a stage does break: an "after" node cannot reach a "roll 1" node.
    with pytest.raises(PeerUnavailable):
        client(**stages["after"]).request(servers["roll 1"].endpoint, b"?", timeout_s=5.0)
    with pytest.raises(TransportError):
        client(**stages["before"]).request(servers["after"].endpoint, b"?", timeout_s=5.0)
