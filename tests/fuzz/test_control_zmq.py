"""Hostile frames over real ZMQ sockets on loopback, to a node whose control channel uses CURVE.

The attacker holds the cluster token (it gets past CURVE: the worst case for the peer server)
and sends raw multipart messages: right and wrong shapes, one-way and request ids, payloads
from every frame strategy. After each batch a probe request proves the server still answers,
and every reply that came back before the probe is judged like an in-process reply. A second
target opens raw TCP connections that speak junk, half a ZMTP greeting, or plaintext ZMTP.
"""

import itertools
import socket
import time

import pytest
import zmq
from hypothesis import strategies as st

from kvcr.adapters.local import MonotonicClock
from kvcr.adapters.zmq.curve import Keyring
from kvcr.adapters.zmq.server import ONEWAY_ID, REFUSAL_REASONS
from kvcr.domain.deadlines import Timing
from kvcr.runner import protocol
from kvcr.runner.protocol import RefusalCode, Refused, Release
from tests.fuzz.budget import count
from tests.fuzz.peer import PeerUnderFire
from tests.fuzz.strategies import (
    envelope,
    hostile_messages,
    msgpack_frames,
    mutate,
    mutations,
    pack,
    raw_frames,
    resolve,
)
from tests.support import Cluster, sequence

pytestmark = pytest.mark.zmq

TOKEN = b"fuzz-cluster-token-0123456789abcdef"
TIMING = Timing(operation_s=2.0, abandon_s=4.0, control_s=1.0, lease_s=5.0, lease_margin_s=0.5, retry_after_s=0.2)
ANSWER_S = 10.0  # a loaded CI machine still answers a probe well within this


class Attacker:
    """A raw DEALER with the cluster's CURVE keys: sends any multipart message, collects what comes back."""

    def __init__(self, endpoint: str, token: bytes) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        Keyring(token).configure_client(self.sock, 0)
        self.sock.connect(endpoint)
        self._probes = itertools.count()

    def exchange(self, messages: list[list[bytes]]) -> list[list[bytes]]:
        """Send ``messages``, then a probe; returns the replies that arrived before the probe's."""
        for message in messages:
            self.sock.send_multipart(message)
        probe = b"PROBE" + next(self._probes).to_bytes(3, "big")
        self.sock.send_multipart([probe, b"not a frame"])
        replies: list[list[bytes]] = []
        give_up = time.monotonic() + ANSWER_S
        while True:
            left_ms = max(0, round((give_up - time.monotonic()) * 1000))
            assert self.sock.poll(left_ms), "the server stopped answering"
            frames = self.sock.recv_multipart()
            if frames[0] == probe:
                assert frames[1:] == [b"\x00", protocol.encode(Refused(b"", RefusalCode.MALFORMED))]
                return replies
            replies.append(frames)

    def oneway(self, payload: bytes) -> None:
        self.sock.send_multipart([ONEWAY_ID, payload])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


@pytest.fixture
def peer():
    cluster = Cluster(MonotonicClock(), control="zmq")
    harness = PeerUnderFire(cluster, token=TOKEN, timing=TIMING)
    attacker = None
    try:
        harness.start()
        attacker = Attacker(harness.a.endpoint, TOKEN)
        harness.attacker = attacker
        yield harness
    finally:
        if attacker is not None:
            attacker.close()
        harness.close()
        cluster.close()


def _oneway(attacker):
    def send(frame):
        attacker.oneway(frame)

    return send


request_ids = st.one_of(
    st.binary(min_size=8, max_size=8).filter(lambda b: b != ONEWAY_ID and not b.startswith(b"PROBE")),
    st.just(ONEWAY_ID),
    st.binary(max_size=12),
)
payloads = st.one_of(
    st.tuples(st.just("frame"), st.one_of(raw_frames, msgpack_frames)),
    st.tuples(st.just("message"), hostile_messages(sequence(8))),
    st.tuples(st.just("recorded"), st.integers(0, 1 << 16), st.one_of(st.just([]), mutations)),
)
messages = st.lists(
    st.one_of(
        st.tuples(request_ids, payloads).map(list),
        st.lists(st.one_of(st.binary(max_size=16), payloads), min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=4,
)


def _payload(peer, spec) -> bytes:
    if spec[0] == "frame":
        return spec[1]
    if spec[0] == "message":
        return envelope(body=pack(resolve(spec[1], peer.known())))
    return (
        mutate(peer.recorded[spec[1] % len(peer.recorded)], spec[2])
        if spec[2]
        else peer.recorded[spec[1] % len(peer.recorded)]
    )


def _decoded(frame: bytes) -> object:
    try:
        return protocol.decode(frame)
    except protocol.FrameError:
        return None


def _frames(peer, message) -> list[bytes]:
    return [part if isinstance(part, bytes) else _payload(peer, part) for part in message]


def test_multipart_messages_from_a_token_holder(peer):
    def case(batch):
        count("frames.zmq")
        sent = [_frames(peer, m) for m in batch]
        replies = peer.attacker.exchange(sent)
        # Only [8-byte id != 0, payload] is a request; one-way and malformed messages get nothing back.
        answered = [m for m in sent if len(m) == 2 and len(m[0]) == 8 and m[0] != ONEWAY_ID]
        assert [r[0] for r in replies] == [m[0] for m in answered], "replies must answer exactly the requests"
        for message, reply in zip(answered, replies, strict=True):
            assert len(reply) == 3, reply
            if reply[1] == b"\x01":  # only a one-way message sent as a request gets no answer
                assert isinstance(_decoded(message[1]), Release), reply
                assert reply[2] == b"no reply: a one-way message"
                continue
            assert reply[1] == b"\x00", reply[:2]  # the handler never failed
            peer.judge(message[1], reply[2])
        assert set(peer.a.control.refusals) <= set(REFUSAL_REASONS)

    # Once: a frame past the channel's limit (64 MiB) costs the sender its connection, nothing more.
    peer.attacker.sock.send_multipart([b"BIGFRAME", bytes((64 << 20) + 1)])
    assert peer.attacker.exchange([]) == []

    peer.fuzz("frames.zmq", (messages,), case, _oneway(peer.attacker))


ZMTP_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
tcp_junk = st.one_of(
    st.binary(max_size=512),
    st.builds(lambda tail: ZMTP_SIGNATURE + tail, st.binary(max_size=128)),
    # A whole ZMTP 3.0 greeting asking for NULL (plaintext) or PLAIN, then junk: never admitted.
    st.builds(
        lambda mech, tail: ZMTP_SIGNATURE + b"\x03\x00" + mech.ljust(20, b"\x00") + b"\x00" + bytes(31) + tail,
        st.sampled_from([b"NULL", b"PLAIN", b"CURVE", b"GSSAPI", b"\xff" * 20]),
        st.binary(max_size=256),
    ),
)


def test_raw_tcp_connections_speaking_junk(peer):
    port = int(peer.a.endpoint.rsplit(":", 1)[1])

    def case(chunks):
        count("frames.tcp")
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            for chunk in chunks:
                try:
                    conn.sendall(chunk)
                except OSError:
                    break  # the server may already have closed it
        assert peer.attacker.exchange([]) == []
        assert set(peer.a.control.refusals) <= set(REFUSAL_REASONS)

    peer.fuzz("frames.tcp", (st.lists(tcp_junk, min_size=1, max_size=3),), case, _oneway(peer.attacker))
