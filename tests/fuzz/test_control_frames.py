"""Hostile control frames into a live peer server (in process, the mock fabric's channel).

Every target shares one server for all its cases, so what one case leaves behind (sessions,
nonces, leases) is what the next case meets; at the end the legitimate clients restore real
pages (bytes compared) and kvcr's heap must be back near its baseline.
"""

import secrets

import pytest
from hypothesis import strategies as st

from kvcr.runner import protocol
from kvcr.runner.protocol import Hello, Lease, LeaseReply, RefusalCode, Refused
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


@pytest.fixture
def peer():
    cluster = Cluster()
    harness = PeerUnderFire(cluster)
    try:
        harness.start()
        yield harness
    finally:
        harness.close()
        cluster.close()


def test_random_bytes_get_malformed_refusals(peer):
    def case(frame):
        count("frames.bytes")
        answer = peer.fire(frame)
        assert isinstance(answer, Refused)

    peer.fuzz("frames.bytes", (raw_frames,), case)


def test_msgpack_junk_wrong_magic_version_and_shapes_get_typed_refusals(peer):
    def case(frame):
        count("frames.msgpack")
        peer.fire(frame)

    peer.fuzz("frames.msgpack", (msgpack_frames,), case)


HOSTILE = hostile_messages(sequence(8))


def test_well_typed_messages_with_hostile_values_are_refused_or_answered_exactly(peer):
    def case(message, version):
        count("frames.messages")
        peer.fire(envelope(version=version, body=pack(resolve(message, peer.known()))))

    peer.fuzz("frames.messages", (HOSTILE, st.sampled_from([2, 2, 2, 2, 1, 3])), case)


def test_mutated_recordings_of_legitimate_frames(peer):
    def case(pick, ops):
        count("frames.mutated")
        frame = peer.recorded[pick % len(peer.recorded)]
        peer.fire(mutate(frame, ops))

    peer.fuzz("frames.mutated", (st.integers(0, 1 << 16), mutations), case)


def _with(frame: bytes, **changes) -> bytes:
    message = protocol.decode(frame)
    fields = {f: getattr(message, f) for f in message.__struct_fields__}
    fields.update(changes)
    return protocol.encode(type(message)(**fields))


actions = st.lists(
    st.one_of(
        st.tuples(st.just("restore")),
        st.tuples(st.just("replay"), st.integers(0, 1 << 16)),
        st.tuples(st.just("replay_lease"), st.integers(0, 1 << 16)),
        st.tuples(st.just("rehello"), st.integers(0, 1 << 16)),
        st.tuples(st.just("move_lease"), st.integers(0, 1 << 16), st.integers(0, 1 << 16)),
        st.tuples(st.just("swap_nonce"), st.integers(0, 1 << 16), st.integers(0, 1 << 16)),
        st.tuples(st.just("expire"), st.floats(0, 30)),
    ),
    min_size=1,
    max_size=12,
)


def test_replayed_and_substituted_frames_never_win_a_lease(peer):
    """Recorded frames replayed verbatim, or moved to another session, or given another recorded nonce."""

    def recorded(kind):
        return peer.recorded_by_kind[kind]

    def case(steps):
        count("frames.replayed")
        for step in steps:
            if step[0] == "restore":
                peer.release_granted()  # the fuzz may hold every page up to the lease cap
                peer.restore_everywhere()
            elif step[0] == "replay":
                peer.fire(peer.recorded[step[1] % len(peer.recorded)])
            elif step[0] == "replay_lease":
                leases = recorded(Lease)
                answer = peer.fire(leases[step[1] % len(leases)])
                assert isinstance(answer, Refused), "a replayed LEASE was answered"
                assert answer.code in (RefusalCode.REPLAYED, RefusalCode.UNKNOWN_SESSION)
            elif step[0] == "rehello":
                hellos = recorded(Hello)
                peer.fire(_with(hellos[step[1] % len(hellos)], nonce=secrets.token_bytes(16)))
            elif step[0] == "move_lease":
                leases, sessions = recorded(Lease), peer.model.sessions
                peer.fire(_with(leases[step[1] % len(leases)], session=sessions[step[2] % len(sessions)]))
            elif step[0] == "swap_nonce":
                leases, nonces = recorded(Lease), peer.model.nonces
                peer.fire(_with(leases[step[1] % len(leases)], nonce=nonces[step[2] % len(nonces)]))
            else:
                peer.cluster.clock.advance(step[1])
                peer.a.runner.expire_leases()

    def case_then_replay_all(steps):
        case(steps)
        if steps[-1][0] == "restore":  # now and then: the oldest and newest LEASEs, replayed once more, get nothing
            leases = recorded(Lease)
            for frame in leases[:16] + leases[-16:]:
                assert not isinstance(peer.fire(frame), LeaseReply)

    peer.fuzz("frames.replayed", (actions,), case_then_replay_all)
