"""The backend's settings at their limits: the exact line an operator reads, and the values just inside."""

import os
import re
import subprocess
import sys

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.integrations.shared.settings import KvcrSettings, parse_settings, read_token_file

KNOWN = (
    "abandon_timeout_ms, allow_unauthenticated, auth_token_file, connect_ahead, connect_timeout_ms, "
    "control_advertise_host, "
    "control_handshake_ms, control_host, control_port, control_timeout_ms, dram_bytes, enable_remote_hint, "
    "engine_kv_events, kv_events_endpoint, kv_events_topic, landing, lease_ms, max_peer_links, node_key_file, "
    "operation_timeout_ms, page_digest, peer_allowlist, peer_directory_file, peer_lease_share, peer_retry_ms, policy, "
    "read_batch_pages, recompute_tokens_per_s, rotation_token_files, same_host_shm, transport, verify_bytes"
)


def refusal(extra):
    with pytest.raises(ConfigError) as err:
        parse_settings(extra)
    return str(err.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"typo": 1}, f"unknown kvcr setting 'typo'; known settings: {KNOWN}"),
        ({"control_port": "80"}, "kvcr setting 'control_port' must be int, got '80'"),
        ({"control_port": True}, "kvcr setting 'control_port' must be int, got True"),
        ({"verify_bytes": 1}, "kvcr setting 'verify_bytes' must be bool, got 1"),
        ({"auth_token_file": 3}, "kvcr setting 'auth_token_file' must be str or null, got 3"),
        ({"recompute_tokens_per_s": "x"}, "kvcr setting 'recompute_tokens_per_s' must be int or float, got 'x'"),
        ({"peer_allowlist": ["ok", ""]}, "peer_allowlist entries must be non-empty strings, got ''"),
        (
            {"connect_ahead": ["10.0.0.2:32100"]},
            "connect_ahead entry '10.0.0.2:32100': endpoint '10.0.0.2:32100' must start with tcp://",
        ),
        (
            {"connect_ahead": ["tcp://0.0.0.0:32100"]},
            "connect_ahead entry 'tcp://0.0.0.0:32100': endpoint host '0.0.0.0' is not dialable",
        ),
        (
            {"connect_ahead": ["tcp://10.9.0.2:32100"], "peer_allowlist": ["10.0.0.0/16"]},
            "connect_ahead entry 'tcp://10.9.0.2:32100' is outside peer_allowlist",
        ),
        (
            {"connect_ahead": ["tcp://h:1"], "control_port": 0},
            "connect_ahead needs a control_port (this node reads from peers)",
        ),
        ({"transport": "rdma"}, "transport must be one of nixl, ucx, shm, auto, mock, got 'rdma'"),
        (
            {"transport": "shm", "same_host_shm": False},
            "transport shm shares arenas with same-host peers: it cannot run with same_host_shm false",
        ),
        ({"same_host_shm": "no"}, "kvcr setting 'same_host_shm' must be bool, got 'no'"),
        ({"dram_bytes": 0}, "dram_bytes must be positive"),
        ({"control_port": -1}, "control_port must be in 0..65535 (0 disables the peer service), got -1"),
        ({"control_port": 65536}, "control_port must be in 0..65535 (0 disables the peer service), got 65536"),
        ({"operation_timeout_ms": 0}, "operation_timeout_ms must be in 1..3600000, got 0"),
        ({"lease_ms": 3600001}, "lease_ms must be in 1..3600000, got 3600001"),
        ({"peer_retry_ms": 0}, "peer_retry_ms must be in 1..3600000, got 0"),
        ({"peer_retry_ms": 3600001}, "peer_retry_ms must be in 1..3600000, got 3600001"),
        ({"read_batch_pages": 0}, "read_batch_pages must be in 1..65536, got 0"),
        ({"max_peer_links": 65537}, "max_peer_links must be in 1..65536, got 65537"),
        ({"control_handshake_ms": 99}, "control_handshake_ms must be in 100..60000, got 99"),
        ({"control_handshake_ms": 60001}, "control_handshake_ms must be in 100..60000, got 60001"),
        ({"control_handshake_ms": -1}, "control_handshake_ms must be in 100..60000, got -1"),
        ({"peer_lease_share": 0}, "peer_lease_share must be a number in (0, 1], got 0"),
        ({"peer_lease_share": 1.5}, "peer_lease_share must be a number in (0, 1], got 1.5"),
        ({"peer_lease_share": float("nan")}, "peer_lease_share must be a number in (0, 1], got nan"),
        ({"recompute_tokens_per_s": -0.5}, "recompute_tokens_per_s must be a finite number >= 0, got -0.5"),
        ({"landing": "sideways"}, "landing must be one of auto, direct, staged, got 'sideways'"),
        ({"policy": "random"}, "policy must be one of fifo, lru, got 'random'"),
        (
            {"rotation_token_files": ["/t"]},
            "rotation_token_files needs auth_token_file (the token this node binds with)",
        ),
        (
            {"node_key_file": "/k"},
            "node_key_file and peer_directory_file go together (per-node identities)",
        ),
        (
            {"peer_directory_file": "/d"},
            "node_key_file and peer_directory_file go together (per-node identities)",
        ),
        (
            {"node_key_file": "/k", "peer_directory_file": "/d", "auth_token_file": "/t"},
            "set auth_token_file (one cluster token) or node_key_file (per-node identities), not both",
        ),
        ({"node_key_file": 7, "peer_directory_file": "/d"}, "kvcr setting 'node_key_file' must be str or null, got 7"),
        (
            {"enable_remote_hint": True, "control_port": 0},
            "enable_remote_hint needs a control_port (peers and hints name control endpoints)",
        ),
    ],
)
def test_each_bad_setting_gets_its_own_line(extra, message):
    assert refusal(extra) == message


def test_long_values_are_cut_to_60_characters():
    shown = refusal({"landing": "z" * 70})
    assert shown == f"landing must be one of auto, direct, staged, got {repr('z' * 70)[:57]}..."
    exact = "w" * 58  # its repr is 60 characters: shown whole
    assert refusal({"landing": exact}) == f"landing must be one of auto, direct, staged, got {exact!r}"


def test_settings_at_their_limits_are_accepted():
    edge = parse_settings(
        {
            "control_port": 65535,
            "operation_timeout_ms": 3600000,
            "abandon_timeout_ms": 3600000,
            "control_timeout_ms": 1,
            "connect_timeout_ms": 1,
            "lease_ms": 3600000,
            "peer_retry_ms": 3600000,
            "read_batch_pages": 65536,
            "max_peer_links": 1,
            "recompute_tokens_per_s": 0,
            "dram_bytes": 1,
        }
    )
    assert (edge.control_port, edge.read_batch_pages, edge.max_peer_links, edge.dram_bytes) == (65535, 65536, 1, 1)
    assert parse_settings({"control_port": 0}).control_port == 0
    assert parse_settings({"peer_retry_ms": 1}).peer_retry_ms == 1
    assert parse_settings({}).control_handshake_ms == 2000
    assert parse_settings({}).peer_lease_share == 0.5 and parse_settings({"peer_lease_share": 1}).peer_lease_share == 1
    assert [parse_settings({"control_handshake_ms": ms}).control_handshake_ms for ms in (100, 60000)] == [100, 60000]
    assert parse_settings({"recompute_tokens_per_s": 2.5}).recompute_tokens_per_s == 2.5
    assert parse_settings({"peer_allowlist": ["a", "b"]}).peer_allowlist == ("a", "b")


def test_timings_are_converted_once_and_the_lease_margin_is_at_most_half_a_second():
    timing = KvcrSettings(
        operation_timeout_ms=2000, abandon_timeout_ms=3000, control_timeout_ms=100, connect_timeout_ms=700
    ).timing()
    assert (timing.operation_s, timing.abandon_s, timing.control_s, timing.connect_s) == (2.0, 3.0, 0.1, 0.7)
    assert (timing.lease_s, timing.lease_margin_s, timing.retry_after_s) == (10.0, 0.5, 1.0)
    short = KvcrSettings(lease_ms=1000, peer_retry_ms=250).timing()
    assert (short.lease_s, short.lease_margin_s, short.retry_after_s) == (1.0, 0.25, 0.25)


# ---------------------------------------------------------------------------------------------- events endpoint


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("ipc:///tmp/x", "kv_events_endpoint must be tcp://host:port, got 'ipc:///tmp/x'"),
        ("tcp://h:0", "kv_events_endpoint: endpoint port 0 is outside 1..65535"),
        ("tcp://h", "kv_events_endpoint: endpoint 'tcp://h' is not host:port"),  # what was written, not a rebuilt ':h'
        ("tcp://h:x", "kv_events_endpoint: endpoint 'tcp://h:x' has no numeric port"),
        ("tcp://h:1:2", "kv_events_endpoint: endpoint 'tcp://h:1:2' is not host:port"),
    ],
)
def test_a_bad_events_endpoint_is_refused_saying_why(endpoint, message):
    assert refusal({"kv_events_endpoint": endpoint}) == message


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://10.0.0.1:5557"])
def test_an_events_endpoint_may_bind_a_wildcard(endpoint):
    assert parse_settings({"kv_events_endpoint": endpoint}).kv_events_endpoint == endpoint


# ---------------------------------------------------------------------------------------------- allowlist


def test_the_allowlist_matches_addresses_networks_and_names_exactly():
    settings = KvcrSettings(peer_allowlist=("10.0.0.0/8", "fd00::/8", "replica-b", "not/a/network"))
    assert settings.allows("10.9.9.9") and settings.allows("[fd00::5]") and settings.allows("fd00::5")
    assert settings.allows("replica-b") and not settings.allows("replica-c")
    assert not settings.allows("11.0.0.1") and not settings.allows("[fe80::1]")
    assert settings.allows("not/a/network")  # an entry that is no network still matches its own text
    assert not KvcrSettings(peer_allowlist=("replica-b",)).allows("10.0.0.1")
    assert KvcrSettings(peer_allowlist=("10.0.0.7",)).allows("10.0.0.7")


def test_an_ipv6_address_written_in_brackets_is_allowed_as_written():
    bracketed = KvcrSettings(peer_allowlist=("[fd00::7]",))  # as it appears in a tcp:// endpoint
    assert bracketed.allows("[fd00::7]") and bracketed.allows("fd00::7")
    assert not bracketed.allows("[fd00::8]")
    assert KvcrSettings(peer_allowlist=("[fd00::/16]",)).allows("fd00::1")


# ---------------------------------------------------------------------------------------------- token files


def token_file(tmp_path, data, mode=0o600, name="token"):
    path = tmp_path / name
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_token_file_refusals_say_what_to_do(tmp_path):
    loose = token_file(tmp_path, b"0123456789abcdef", 0o640)
    with pytest.raises(ConfigError) as err:
        read_token_file(loose)
    assert str(err.value) == (
        f"auth_token_file {loose!r} is readable or writable by group or others (mode 640); chmod 600 it"
    )
    big = token_file(tmp_path, b"x" * 4097, name="big")
    with pytest.raises(ConfigError) as err:
        read_token_file(big)
    assert str(err.value) == f"auth_token_file {big!r} is larger than 4096 bytes"
    short = token_file(tmp_path, b"x" * 15, name="short")
    with pytest.raises(ConfigError) as err:
        read_token_file(short)
    assert str(err.value) == f"auth_token_file {short!r}: the token must be at least 16 bytes"
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError) as err:
        read_token_file(missing)
    assert str(err.value) == f"auth_token_file {missing!r}: cannot read it: No such file or directory"
    with pytest.raises(ConfigError) as err:
        read_token_file(str(tmp_path))
    assert str(err.value) == f"auth_token_file {str(tmp_path)!r} is not a regular file"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root (CI runs as root)")
@pytest.mark.parametrize("setting", ["auth_token_file", "node_key_file"])
def test_a_token_or_key_file_another_uid_owns_is_refused(tmp_path, setting):
    """Issue 43: whoever owns the file can change it (and chmod it back): it must be ours (or root's)."""
    theirs = token_file(tmp_path, b"0123456789abcdef-0123456789", 0o600)
    os.chown(theirs, 65534, -1)
    with pytest.raises(ConfigError) as err:
        read_token_file(theirs, setting)
    assert str(err.value) == (
        f"{setting} {theirs!r} belongs to uid 65534, who could change it; chown it to uid {os.geteuid()} (or root)"
    )


def test_token_files_of_exactly_the_limits_are_read(tmp_path):
    largest = (bytes(range(33, 127)) * 44)[:4096]  # printable, no NUL, nothing to strip
    assert read_token_file(token_file(tmp_path, largest)) == largest
    assert read_token_file(token_file(tmp_path, b"0123456789abcdef\n", name="min")) == b"0123456789abcdef"


@pytest.mark.parametrize("data", [b"a" * 16, b"ab" * 16, b"0000000011111111" * 4, b"abcdefg" * 5])
def test_a_token_of_fewer_than_8_distinct_bytes_is_refused_naming_the_file(tmp_path, data):
    path = token_file(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        read_token_file(path)
    distinct = len(set(data))
    assert str(err.value) == (
        f"auth_token_file {path!r}: the token has only {distinct} distinct byte values (at least 8); "
        "use random bytes, e.g. head -c 32 /dev/urandom | base64"
    )
    rotation = parse_settings(
        {"auth_token_file": token_file(tmp_path, b"0123456789abcdef", name="ok"), "rotation_token_files": [path]}
    )
    with pytest.raises(ConfigError, match=rf"^rotation_token_files {re.escape(repr(path))}: the token has only"):
        rotation.rotation_tokens()


def test_a_token_of_exactly_8_distinct_bytes_is_read(tmp_path):
    assert read_token_file(token_file(tmp_path, b"abcdefgh" * 2)) == b"abcdefgh" * 2


def test_the_settings_read_the_token_and_every_rotation_token(tmp_path):
    main = token_file(tmp_path, b"main-0123456789abcdef", name="main")
    old = token_file(tmp_path, b"old-0123456789abcdef", name="old")
    settings = parse_settings({"auth_token_file": main, "rotation_token_files": [old]})
    assert settings.token() == b"main-0123456789abcdef" and settings.rotation_tokens() == (b"old-0123456789abcdef",)
    assert parse_settings({}).token() is None and parse_settings({}).rotation_tokens() == ()


def test_a_value_whose_repr_is_61_characters_is_cut():
    value = "v" * 59  # repr: 61 characters
    assert refusal({"landing": value}) == f"landing must be one of auto, direct, staged, got {repr(value)[:57]}..."


def test_a_bad_dram_size_names_dram_bytes():
    assert refusal({"dram_bytes": "lots"}) == "dram_bytes: cannot read 'lots' as a byte size (try '8GiB' or '512MiB')"


def test_allowlist_networks_may_have_host_bits_set():
    assert KvcrSettings(peer_allowlist=("10.0.0.1/8",)).allows("10.200.0.1")


def test_an_infinite_recompute_rate_is_refused():
    assert refusal({"recompute_tokens_per_s": float("inf")}) == (
        "recompute_tokens_per_s must be a finite number >= 0, got inf"
    )


def test_integers_past_64_bits_are_refused_as_out_of_range():
    assert refusal({"control_port": 1 << 64}) == "kvcr setting 'control_port' is out of range (an integer of 65 bits)"
    # 64 bits pass the range check: the setting's own bound answers
    assert refusal({"control_port": 1 << 63}) == (
        f"control_port must be in 0..65535 (0 disables the peer service), got {1 << 63}"
    )
    assert parse_settings({"recompute_tokens_per_s": (1 << 64) - 1}).recompute_tokens_per_s == (1 << 64) - 1


def test_an_integer_too_large_to_show_is_named_by_its_type():
    huge = 10**5000  # no repr: str() refuses integers of over 4300 digits
    assert refusal({"transport": huge}) == "kvcr setting 'transport' must be str, got a int too large to show"


def test_a_wildcard_events_endpoint_with_a_bad_port_is_refused_as_a_local_bind():
    assert refusal({"kv_events_endpoint": "tcp://*:x"}) == (
        "kv_events_endpoint: endpoint 'tcp://127.0.0.1:x' has no numeric port"
    )


def test_only_an_exact_address_is_one_an_allowlist_entry_matches():
    # text around an address makes it a name, compared as text
    assert not KvcrSettings(peer_allowlist=("10.0.0.1",)).allows("10.0.0.1X")
    assert not KvcrSettings(peer_allowlist=("10.0.0.1X",)).allows("10.0.0.1")
    assert KvcrSettings(peer_allowlist=("10.0.0.1X",)).allows("10.0.0.1X")


def test_a_token_path_the_file_system_cannot_hold_is_refused():
    with pytest.raises(ConfigError) as err:
        read_token_file("/tmp/a\x00b")
    assert str(err.value) == "auth_token_file '/tmp/a\\x00b' is not a usable path"


def test_a_file_whose_length_exceeds_its_reported_size_is_refused_once_read():
    """/proc/self/environ is a regular file of mode 0400 whose stat size is 0: only reading shows its
    length, as for a file that grew after it was checked. The read stops at 4097 bytes."""
    script = (
        "from kvcr.domain.errors import ConfigError\n"
        "from kvcr.integrations.shared.settings import read_token_file\n"
        "try:\n"
        "    read_token_file('/proc/self/environ')\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "KVCR_TEST_PADDING": "x" * 8192}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "auth_token_file '/proc/self/environ' is larger than 4096 bytes", done.stderr
