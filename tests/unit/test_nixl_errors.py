"""NIXL's plain exceptions become kvcr's transport errors in one place; kvcr's own errors pass through."""

import pytest

from kvcr.adapters.nixl.agent import nixl_errors
from kvcr.domain.errors import ConfigError
from kvcr.ports.errors import PeerUnavailable, TransportError


def test_a_nixl_exception_becomes_a_transport_error_naming_what_failed():
    bad_address = pytest.raises(TransportError, match=r"^registering 'kv': nixlBackendError: bad address$")
    with bad_address as caught, nixl_errors("registering 'kv'"):
        raise RuntimeError("nixlBackendError: bad address")
    assert type(caught.value) is TransportError and isinstance(caught.value.__cause__, RuntimeError)


def test_the_error_type_is_the_callers_choice():
    with (
        pytest.raises(PeerUnavailable, match="cannot connect to 'B': gone"),
        nixl_errors("cannot connect to 'B'", PeerUnavailable),
    ):
        raise ValueError("gone")


def test_kvcr_errors_pass_unchanged_and_success_is_silent():
    refused = ConfigError("no UCX plugin")
    with pytest.raises(ConfigError) as caught, nixl_errors("building", PeerUnavailable):
        raise refused
    assert caught.value is refused
    with nixl_errors("nothing"):
        pass
