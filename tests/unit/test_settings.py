"""kvcr's backend settings: every bad value is refused with one line naming the setting."""

import os
import re
import threading

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.integrations.shared.settings import parse_settings, read_token_file


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"dram_bytes": "9" * 400}, "dram_bytes"),
        ({"dram_bytes": 10**400}, "dram_bytes"),
        ({"dram_bytes": "8 parsecs"}, "dram_bytes"),
        ({"operation_timeout_ms": 10**18}, "operation_timeout_ms"),
        ({"lease_ms": 0}, "lease_ms"),
        ({"control_timeout_ms": 9000}, "control_timeout_ms"),
        ({"abandon_timeout_ms": 10, "operation_timeout_ms": 20}, "abandon_timeout_ms"),
        ({"read_batch_pages": True}, "read_batch_pages"),
        ({"verify_bytes": 1}, "verify_bytes"),
        ({"landing": "sideways"}, "landing"),
        ({"peer_allowlist": [3]}, "peer_allowlist"),
        ({"rotation_token_files": ["/x"]}, "rotation_token_files"),
        ({"peer_allowlist": "10.0.0.0/8"}, "peer_allowlist"),
        ({"max_peer_links": 0}, "max_peer_links"),
        ({"recompute_tokens_per_s": -1}, "recompute_tokens_per_s"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"policy": "random"}, "policy"),
        ({"enable_remote_hint": True, "control_port": 0}, "control_port"),
        ({"kv_events_endpoint": "ipc:///tmp/x"}, "kv_events_endpoint"),
        ({"typo_setting": 1}, "typo_setting"),
    ],
)
def test_bad_settings_name_the_setting(extra, match):
    with pytest.raises(ConfigError, match=match) as info:
        parse_settings(extra)
    assert "\n" not in str(info.value) and len(str(info.value)) < 600  # one line


def test_sglang_keys_pass_through_and_defaults_hold():
    settings = parse_settings({"backend_name": "kvcr", "interface_v1": 1, "prefetch_timeout_base": 15.0})
    assert settings.verify_bytes and settings.landing == "auto" and settings.control_timeout_ms == 250


def write_token(tmp_path, data, mode=0o600):
    path = tmp_path / "token"
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_a_good_token_file_is_read(tmp_path):
    assert read_token_file(write_token(tmp_path, b"0123456789abcdef\n")) == b"0123456789abcdef"


@pytest.mark.parametrize(
    ("data", "mode", "match"),
    [
        (b"0123456789abcdef", 0o644, "readable or writable by group or others"),
        (b"0123456789abcdef", 0o606, "readable or writable by group or others"),
        (b"short", 0o600, "at least 16 bytes"),
        (b"0123456789\x00abcdef", 0o600, "NUL byte; write a text token: head -c 32 /dev/urandom"),
        (b"x" * 5000, 0o600, "larger than"),
    ],
)
def test_bad_token_files_are_refused_naming_the_path(tmp_path, data, mode, match):
    path = write_token(tmp_path, data, mode)
    with pytest.raises(ConfigError, match=match) as info:
        read_token_file(path)
    assert path in str(info.value)


def test_a_fifo_token_file_is_refused_without_hanging(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path, 0o600)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_error_of(read_token_file, str(path))), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading a FIFO token file hung"
    assert "not a regular file" in outcome[0]


def test_a_missing_token_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="auth_token_file"):
        read_token_file(str(tmp_path / "nope"))


def test_the_allowlist_takes_hosts_and_networks():
    settings = parse_settings({"peer_allowlist": ["10.0.0.0/8", "replica-b.example", "::1"]})
    assert settings.allows("10.2.3.4") and settings.allows("replica-b.example") and settings.allows("::1")
    assert not settings.allows("192.168.0.1") and not settings.allows("replica-c.example")
    assert parse_settings({}).allows("anything")


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "10.0.0.300", "1.2.3", "fd00::/129", "bad host", "-dash.example"])
def test_an_allowlist_entry_that_can_match_nothing_is_refused_naming_it(entry):
    """A /33 was accepted, and every hint was then source_not_allowed."""
    with pytest.raises(ConfigError, match=rf"peer_allowlist entry '{re.escape(entry)}' is not an address"):
        parse_settings({"peer_allowlist": [entry]})


def test_a_bracketed_ipv6_network_matches_like_an_unbracketed_one():
    settings = parse_settings({"peer_allowlist": ["[fd00::]/8"]})
    assert settings.allows("fd00::5") and settings.allows("[fd00::5]") and not settings.allows("fe80::1")


def _error_of(call, *args):
    try:
        call(*args)
    except ConfigError as exc:
        return str(exc)
    return ""


def test_a_bad_rotation_token_file_is_named_as_such(tmp_path):
    """The rotation files were checked by the auth_token_file code and named as auth_token_file."""
    good = write_token(tmp_path, b"0123456789abcdef")
    shared = tmp_path / "shared"
    shared.mkdir()
    readable = write_token(shared, b"fedcba9876543210", 0o644)
    settings = parse_settings({"auth_token_file": good, "rotation_token_files": [readable]})
    with pytest.raises(ConfigError, match=r"^rotation_token_files .*readable or writable by group"):
        settings.rotation_tokens()


def test_the_default_page_digest_is_one_a_compromised_node_cannot_keep_where_nodes_have_their_own_keys(tmp_path):
    """Issue 43: with per-node identities the default is blake3 (an xxh3 second preimage written over NIXL
    was served as the owner's page); with a cluster token, or none, it stays xxh3; a setting wins."""
    keyed = {"node_key_file": str(tmp_path / "node.key"), "peer_directory_file": str(tmp_path / "peers")}
    assert parse_settings({}).page_digest == "auto"
    assert parse_settings({}).digest() == "xxh3"
    assert parse_settings(keyed).digest() == "blake3"
    assert parse_settings({**keyed, "page_digest": "xxh3"}).digest() == "xxh3"
    assert parse_settings({"page_digest": "blake3"}).digest() == "blake3"
    with pytest.raises(ConfigError, match="page_digest must be one of auto, xxh3, blake3, got 'md5'"):
        parse_settings({"page_digest": "md5"})
