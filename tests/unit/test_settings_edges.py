"""Settings edges the plain cases miss: short and failing reads of pseudo-files, networks written with host
bits, and IPv6 events endpoints."""

import os
import subprocess
import sys

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.integrations.shared.settings import parse_settings, read_token_file


def refusal(call, *args):
    with pytest.raises(ConfigError) as err:
        call(*args)
    return str(err.value)


def test_an_allowlist_network_written_with_host_bits_is_accepted_and_matches_its_network():
    settings = parse_settings({"peer_allowlist": ["10.1.2.3/8", "[fd00::1]/16"]})
    assert settings.allows("10.200.0.1") and settings.allows("fd00::9")
    assert not settings.allows("11.0.0.1") and not settings.allows("fe80::1")


def test_a_bracketed_ipv6_events_endpoint_is_accepted():
    assert parse_settings({"kv_events_endpoint": "tcp://[::1]:5557"}).kv_events_endpoint == "tcp://[::1]:5557"
    assert parse_settings({"kv_events_endpoint": "tcp://[fd00::5]:5557"}).kv_events_endpoint == "tcp://[fd00::5]:5557"


def test_an_unbracketed_ipv6_wildcard_events_endpoint_is_refused():
    """``:::5557`` is not ``[::]:5557``: only the bracketed wildcard is let through to the port check."""
    message = refusal(parse_settings, {"kv_events_endpoint": "tcp://:::5557"})
    assert message == "kv_events_endpoint: endpoint 'tcp://:::5557' is not host:port"


def test_a_token_file_that_fails_to_read_is_refused_naming_the_path_and_the_error():
    """/proc/self/mem is a regular file of mode 0600 whose read at offset 0 fails (nothing is mapped there)."""
    message = refusal(read_token_file, "/proc/self/mem")
    assert message.startswith("auth_token_file '/proc/self/mem': cannot read it: ")
    assert message != "auth_token_file '/proc/self/mem': cannot read it: "


def test_a_token_file_longer_than_its_reported_size_is_refused_in_process():
    """A child's /proc/PID/environ has mode 0400 and stat size 0; only reading shows its 6000 bytes."""
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"KVCR_TEST_PADDING": "x" * 6000},
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        try:
            assert child.stdout.readline() == b"ready\n"  # its environ is set up by now
            path = f"/proc/{child.pid}/environ"
            assert refusal(read_token_file, path) == f"auth_token_file {path!r} is larger than 4096 bytes"
        finally:
            child.stdin.close()


@pytest.mark.skipif(not os.access("/proc/slabinfo", os.R_OK), reason="/proc/slabinfo is readable by root only")
def test_a_token_file_that_reads_in_short_pieces_is_refused_once_their_sum_passes_the_limit():
    """/proc/slabinfo (mode 0400, stat size 0) comes back a page or less per read: the size is the sum."""
    assert refusal(read_token_file, "/proc/slabinfo") == "auth_token_file '/proc/slabinfo' is larger than 4096 bytes"
