"""The one wildcard-host set, the one host:port split and the one bracket rule (kvcr/domain/endpoints.py)."""

import pytest

from kvcr.domain.endpoints import WILDCARD_HOSTS, HostPort, bracketed, split_host_port


@pytest.mark.parametrize(
    ("text", "split"),
    [
        ("10.0.0.7:32100", HostPort("10.0.0.7", "32100", False)),
        ("host-a:1", HostPort("host-a", "1", False)),
        ("[fd00::1]:32100", HostPort("fd00::1", "32100", True)),
        ("[::]:5557", HostPort("::", "5557", True)),
        (":::5557", HostPort("::", "5557", False)),  # left for the caller to refuse
        ("host:", HostPort("host", "", False)),
        (":80", HostPort("", "80", False)),
        ("host", None),
        ("[fd00::1]", None),
        ("[fd00::1]32100", None),
        ("", None),
    ],
)
def test_split_host_port(text, split):
    assert split_host_port(text) == split


@pytest.mark.parametrize(
    ("host", "written"),
    [("10.0.0.7", "10.0.0.7"), ("host-a", "host-a"), ("fd00::1", "[fd00::1]"), ("[fd00::1]", "[fd00::1]")],
)
def test_bracketed(host, written):
    assert bracketed(host) == written


def test_the_wildcards_are_every_any_address_spelling_and_nothing_dialable():
    assert {"*", "0.0.0.0", "::", "[::]"} == WILDCARD_HOSTS
    assert not {"127.0.0.1", "::1", "[::1]", "localhost", ""} & WILDCARD_HOSTS
