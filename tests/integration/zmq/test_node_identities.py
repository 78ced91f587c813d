"""Per-node CURVE identities over real ZMQ: each node its own key, the peer directory decides who talks.

Every channel here is a real ``ZmqControlChannel`` with its own ZMQ context (so its own ZAP handler),
real CURVE handshakes on loopback; the directory is a file rewritten by rename, as operators should.
"""

import os
import time

import pytest

from kvcr.adapters.zmq.identity import generate_secret_key
from kvcr.ports.control import node_of
from kvcr.ports.errors import PeerRefused, PeerUnavailable
from tests.contract.zmq_kind import free_port

pytestmark = pytest.mark.zmq


class Node:
    def __init__(self, port=None):
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.secret, self.public = generate_secret_key()

    def line(self):
        return f"{self.endpoint} {self.public.decode()}"


def write_directory(path, *lines):
    """Write the file next to ``path`` and rename it over: a reader never sees half of it."""
    staged = path.with_suffix(".new")
    staged.write_text("# kvcr peer directory\n" + "".join(f"{line}\n" for line in lines))
    os.replace(staged, path)
    time.sleep(0.002)  # a distinct mtime even on coarse clocks (the inode differs anyway)


@pytest.fixture
def directory(tmp_path):
    return tmp_path / "peers"


def serving(channels, node, directory, seen=None):
    channel = channels(node.port, node_secret_key=node.secret, peer_directory_file=str(directory))

    def echo(payload, connection):
        if seen is not None:
            seen.append(node_of(connection))
        return b"echo:" + payload

    channel.serve_connections(echo)
    return channel


def dialling(channels, node, directory):
    return channels(node.port, node_secret_key=node.secret, peer_directory_file=str(directory))


def served_within(client, endpoint, seconds, failures):
    """Whether ``endpoint`` answers within ``seconds``; each failure of the kinds given redials."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return client.request(endpoint, b"back", 1.0) == b"echo:back"
        except failures:
            client.forget(endpoint)
    return False


def test_listed_nodes_talk_with_their_own_keys_and_the_server_knows_which_node_asked(channels, directory):
    a, b = Node(), Node()
    write_directory(directory, a.line(), b.line())
    seen = []
    server = serving(channels, a, directory, seen)
    client = dialling(channels, b, directory)
    assert server.authenticated and client.authenticated
    assert client.request(a.endpoint, b"hi", 2.0) == b"echo:hi"
    assert client.request(a.endpoint, b"again", 2.0) == b"echo:again"
    from zmq.utils import z85

    assert seen == [z85.decode(b.public)] * 2


def test_a_node_the_directory_does_not_list_is_refused_at_the_handshake(channels, tmp_path, directory):
    a, b, stranger = Node(), Node(), Node()
    write_directory(directory, a.line(), b.line())
    server = serving(channels, a, directory)
    # The stranger lists itself (and a) in its own copy: it knows where a is and what key a proves.
    its_own = tmp_path / "strangers-copy"
    write_directory(its_own, a.line(), stranger.line())
    intruder = dialling(channels, stranger, its_own)
    with pytest.raises(PeerUnavailable):
        intruder.request(a.endpoint, b"let me in", 1.0)
    deadline = time.monotonic() + 2
    while server.refusals["credentials"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.refusals["credentials"] >= 1


def test_a_listed_node_cannot_answer_in_another_nodes_name(channels, tmp_path, directory):
    """The relay of issue 23: with a shared token any holder could sit at (or in front of) a's address
    and complete the handshake as a. Here c, a listed node with its own key, serves at the address the
    directory gives a; b dials it expecting a's key, and the handshake fails: b gets nothing from c."""
    a, b, c = Node(), Node(), Node()
    write_directory(directory, a.line(), b.line(), c.line())
    # c stands at a's address, with its own key (its private copy of the directory says so).
    impostor = Node(a.port)
    impostor.secret, impostor.public = c.secret, c.public
    its_copy = tmp_path / "impostors-copy"
    write_directory(its_copy, impostor.line(), b.line())
    seen = []
    serving(channels, impostor, its_copy, seen)
    victim = dialling(channels, b, directory)
    with pytest.raises(PeerUnavailable):
        victim.request(a.endpoint, b"lease please", 1.0)
    assert seen == []  # nothing of b's ever reached the impostor's handler


def test_an_endpoint_the_directory_does_not_list_is_never_dialled(channels, directory):
    a, b = Node(), Node()
    write_directory(directory, a.line(), b.line())
    client = dialling(channels, b, directory)
    unlisted = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(PeerUnavailable, match="not in the peer directory"):
        client.request(unlisted, b"hint says so", 2.0)
    assert time.monotonic() - started < 0.5  # refused before any connection, not after a timeout
    assert client.open_peers() == 0


def test_removing_a_nodes_line_revokes_it_at_once_on_its_open_connection_and_at_any_new_one(channels, directory):
    a, b = Node(), Node()
    write_directory(directory, a.line(), b.line())
    server = serving(channels, a, directory)
    client = dialling(channels, b, directory)
    assert client.request(a.endpoint, b"before", 2.0) == b"echo:before"

    write_directory(directory, a.line())  # a's operator revokes b; nobody restarts
    revoked_at = time.monotonic()
    refused_after = None
    while time.monotonic() - revoked_at < 2.0:
        try:
            client.request(a.endpoint, b"still there?", 1.0)
        except PeerRefused as exc:
            assert "revoked" in str(exc)
            refused_after = time.monotonic() - revoked_at
            break
        time.sleep(0.005)
    assert refused_after is not None and refused_after < 0.5
    assert server.refusals["revoked"] >= 1

    # A new connection (b forgets the old one) fails the handshake: its key is no longer admitted.
    client.forget(a.endpoint)
    with pytest.raises(PeerUnavailable):
        client.request(a.endpoint, b"new connection", 1.0)

    write_directory(directory, a.line(), b.line())  # re-listed: served again
    assert served_within(client, a.endpoint, 2.0, (PeerRefused, PeerUnavailable))


def test_a_peer_re_keyed_in_the_directory_is_dialled_afresh_with_its_new_key(channels, directory):
    a, b = Node(), Node()
    write_directory(directory, a.line(), b.line())
    first = serving(channels, a, directory)
    client = dialling(channels, b, directory)
    assert client.request(a.endpoint, b"one", 2.0) == b"echo:one"
    first.close()
    renewed = Node(a.port)  # a's operator gave it a new key, and listed it
    write_directory(directory, renewed.line(), b.line())
    serving(channels, renewed, directory)
    assert served_within(client, a.endpoint, 3.0, (PeerUnavailable,))
