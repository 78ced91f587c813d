"""The peer directory file and a node's own key: parsing, re-reading on change, failing closed."""

import os

import pytest
from zmq.utils import z85

from kvcr.adapters.zmq.identity import (
    RELOAD_S,
    Directory,
    NodeIdentity,
    PeerDirectory,
    generate_secret_key,
    write_node_key,
)
from kvcr.domain.errors import ConfigError

pytestmark = pytest.mark.zmq

A_SECRET, A_PUBLIC = generate_secret_key()
B_SECRET, B_PUBLIC = generate_secret_key()
A_LINE = f"tcp://10.0.0.1:32100 {A_PUBLIC.decode()}"
B_LINE = f"tcp://10.0.0.2:32100 {B_PUBLIC.decode()}"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_give_each_endpoint_its_key_comments_and_blank_lines_aside():
    text = f"# two nodes\n\n  {A_LINE}  \n{B_LINE}\ntcp://10.0.0.1:32101 {A_PUBLIC.decode()}\n"
    directory = Directory.parse(text, "peers")
    assert directory.by_endpoint == {
        "tcp://10.0.0.1:32100": A_PUBLIC,
        "tcp://10.0.0.2:32100": B_PUBLIC,
        "tcp://10.0.0.1:32101": A_PUBLIC,  # one node's second rank: the same key at its own port
    }
    assert directory.keys == {z85.decode(A_PUBLIC), z85.decode(B_PUBLIC)}


def test_a_host_port_without_the_scheme_is_read_as_tcp():
    assert Directory.parse(f"10.0.0.9:7 {A_PUBLIC.decode()}", "p").by_endpoint == {"tcp://10.0.0.9:7": A_PUBLIC}


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (A_PUBLIC.decode(), "expected '<tcp://host:port> <public key>', got 1 fields"),
        (f"{A_LINE} extra", "got 3 fields"),
        (f"tcp://10.0.0.1:1 {A_PUBLIC.decode()[:-1]}", "40 characters of Z85, got 39"),
        ("tcp://10.0.0.1:1 " + "~" * 40, "is not Z85"),
        (f"tcp://*:32100 {A_PUBLIC.decode()}", "endpoint 'tcp://\\*:32100'"),
        (f"tcp://10.0.0.1:0 {A_PUBLIC.decode()}", "endpoint 'tcp://10.0.0.1:0'"),
        (f"{A_PUBLIC.decode()} tcp://10.0.0.1:1", "endpoint"),  # the old order: key first
    ],
)
def test_a_bad_line_is_a_config_error_naming_the_file_and_the_line(line, says):
    with pytest.raises(ConfigError, match=rf"peer directory 'peers' line 2: .*{says}"):
        Directory.parse(f"# header\n{line}\n", "peers")


def test_an_endpoint_listed_twice_is_refused():
    with pytest.raises(ConfigError, match=r"line 2: endpoint tcp://10.0.0.1:32100 is listed twice"):
        Directory.parse(f"{A_LINE}\ntcp://10.0.0.1:32100 {B_PUBLIC.decode()}\n", "peers")


def test_the_file_is_read_again_when_it_changes_and_not_more_often_than_the_reload_interval(tmp_path):
    path = tmp_path / "peers"
    path.write_text(A_LINE + "\n")
    clock = Clock()
    directory = PeerDirectory(str(path), clock)
    assert set(directory.current().by_endpoint) == {"tcp://10.0.0.1:32100"}
    staged = tmp_path / "peers.new"
    staged.write_text(f"{A_LINE}\n{B_LINE}\n")
    os.replace(staged, path)
    assert len(directory.current().keys) == 1  # looked at less than RELOAD_S ago
    clock.now += RELOAD_S
    assert len(directory.current().keys) == 2


def test_a_directory_that_stops_parsing_or_disappears_admits_nobody_until_it_is_fixed(tmp_path, caplog):
    path = tmp_path / "peers"
    path.write_text(A_LINE + "\n")
    clock = Clock()
    directory = PeerDirectory(str(path), clock)
    path.write_text(A_LINE + "\nnot a line\n")
    clock.now += RELOAD_S
    assert directory.current().keys == frozenset()
    assert "admitting and dialling no peer until it is fixed" in caplog.text and "line 2" in caplog.text
    path.unlink()
    clock.now += RELOAD_S
    assert directory.current().by_endpoint == {}
    path.write_text(f"{A_LINE}\n{B_LINE}\n")
    clock.now += RELOAD_S
    assert len(directory.current().keys) == 2


def test_a_directory_that_cannot_be_read_at_start_up_is_a_config_error_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"peer_directory_file .*missing.*cannot read it"):
        PeerDirectory(str(tmp_path / "missing"))


def test_a_node_must_be_listed_at_its_own_endpoint_with_its_own_key(tmp_path):
    path = tmp_path / "peers"
    path.write_text(f"{A_LINE}\n{B_LINE}\n")
    directory = PeerDirectory(str(path))
    assert NodeIdentity(A_SECRET, directory, "tcp://10.0.0.1:32100").public_key == A_PUBLIC
    with pytest.raises(ConfigError, match=r"lists another key there.*add the line 'tcp://10.0.0.2:32100 "):
        NodeIdentity(A_SECRET, directory, "tcp://10.0.0.2:32100")
    with pytest.raises(ConfigError, match=r"does not list it: this node serves tcp://10.0.0.3:1"):
        NodeIdentity(A_SECRET, directory, "tcp://10.0.0.3:1")


@pytest.mark.parametrize("secret", [b"short", b"\xff" * 40, b"~" * 40])
def test_a_secret_key_that_is_not_z85_of_32_bytes_is_a_config_error_naming_the_setting(tmp_path, secret):
    path = tmp_path / "peers"
    path.write_text(A_LINE + "\n")
    with pytest.raises(ConfigError, match="node_key_file"):
        NodeIdentity(secret, PeerDirectory(str(path)), "tcp://10.0.0.1:32100")


def test_keygen_writes_a_new_private_file_and_never_overwrites_one(tmp_path):
    path = tmp_path / "node.key"
    public = write_node_key(str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    directory = tmp_path / "peers"
    directory.write_text(f"tcp://10.0.0.1:32100 {public.decode()}\n")
    identity = NodeIdentity(path.read_bytes(), PeerDirectory(str(directory)), "tcp://10.0.0.1:32100")
    assert identity.public_key == public
    with pytest.raises(ConfigError, match="exists: remove it first"):
        write_node_key(str(path))
    assert NodeIdentity(path.read_bytes(), PeerDirectory(str(directory)), "tcp://10.0.0.1:32100").public_key == public


def _writable_by_others(path):
    path.chmod(0o666)


def _owned_by_another_uid(path):
    os.chown(path, 65534, -1)


def _a_fifo(path):
    path.unlink()
    os.mkfifo(path)


UNSAFE = {
    "writable by others": (_writable_by_others, "writable by group or others"),
    "another owner": (_owned_by_another_uid, "belongs to uid 65534"),
    "a fifo": (_a_fifo, "not a regular file"),
}


def unsafe(kind):
    """(how to make a file unsafe this way, what the refusal says); skipped where it needs root."""
    if kind == "another owner" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root (CI runs as root)")
    return UNSAFE[kind]


@pytest.mark.parametrize("kind", list(UNSAFE))
def test_a_directory_anyone_else_could_write_or_that_could_block_is_refused_at_start_up(tmp_path, kind):
    """Issue 43: a 0666 file let another uid append its key and be served; a FIFO hung start-up."""
    make, says = unsafe(kind)
    path = tmp_path / "peers"
    path.write_text(A_LINE + "\n")
    make(path)
    with pytest.raises(ConfigError, match=f"peer_directory_file .*{says}"):
        PeerDirectory(str(path))


@pytest.mark.parametrize("kind", list(UNSAFE))
def test_a_directory_that_becomes_unsafe_at_run_time_admits_nobody_without_blocking_its_reader(tmp_path, kind):
    """A FIFO renamed over the file stalled the server's reader (1 of 5 requests answered in 4 s)."""
    import threading

    make, _ = unsafe(kind)
    path = tmp_path / "peers"
    path.write_text(A_LINE + "\n")
    clock = Clock()
    directory = PeerDirectory(str(path), clock)
    staged = tmp_path / "peers.new"
    staged.write_text(f"{A_LINE}\n{B_LINE}\n")
    make(staged)
    os.replace(staged, path)
    clock.now += RELOAD_S
    seen = []
    reader = threading.Thread(target=lambda: seen.append(directory.current()), daemon=True)
    reader.start()
    reader.join(2.0)
    assert seen and seen[0].keys == frozenset()  # answered at once, and nobody is admitted
