"""Key derivation from the cluster token and the ZAP admission check."""

import pytest
import zmq
from zmq.utils import z85

from kvcr.adapters.zmq.curve import ZAP_DOMAIN, CurveKeys, Keyring, hkdf_sha256, zap_reply
from kvcr.domain.errors import ConfigError

pytestmark = pytest.mark.zmq


def test_hkdf_matches_rfc_5869_test_case_1():
    okm = hkdf_sha256(bytes([0x0B] * 22), bytes(range(0xF0, 0xFA)), 42, salt=bytes(range(13)))
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")


def test_keys_are_a_function_of_the_token_and_differ_by_role_and_token():
    a, again, b = (
        CurveKeys.from_token(b"token-a" * 4),
        CurveKeys.from_token(b"token-a" * 4),
        CurveKeys.from_token(b"token-b" * 4),
    )
    assert a == again
    assert len({a.server_secret, a.client_secret, b.server_secret, b.client_secret}) == 4
    assert a.server_public == zmq.curve_public(a.server_secret)
    assert a.client_public == zmq.curve_public(a.client_secret)
    assert all(len(k) == 40 for k in (a.server_public, a.server_secret, a.client_public, a.client_secret))


def _zap(key: bytes, *, mechanism=b"CURVE", domain=ZAP_DOMAIN, version=b"1.0"):
    return [version, b"7", domain, b"127.0.0.1", b"", mechanism, key]


def test_zap_admits_the_client_key_of_every_token_on_the_ring_and_nothing_else():
    current, rotating, outsider = b"current-token-" * 2, b"rotating-token" * 2, b"outsider-token" * 2
    ring = Keyring(current, [rotating])
    for token in (current, rotating):
        reply, admitted = zap_reply(_zap(z85.decode(CurveKeys.from_token(token).client_public)), ring)
        assert admitted and reply[:3] == [b"1.0", b"7", b"200"]
    refused = [
        _zap(z85.decode(CurveKeys.from_token(outsider).client_public)),
        _zap(z85.decode(CurveKeys.from_token(current).server_public)),  # the server's key is not a client's
        _zap(z85.decode(CurveKeys.from_token(current).client_public), mechanism=b"PLAIN"),
        _zap(z85.decode(CurveKeys.from_token(current).client_public), domain=b"other"),
        _zap(z85.decode(CurveKeys.from_token(current).client_public), version=b"2.0"),
        [b"1.0", b"7"],
    ]
    for frames in refused:
        reply, admitted = zap_reply(frames, ring)
        assert not admitted and reply[2] in (b"400", b"500")


@pytest.mark.parametrize(("token", "rotation"), [(b"", ()), ("text", ()), (b"ok-token-ok-token", [b""])])
def test_a_bad_token_is_a_config_error_naming_it(token, rotation):
    with pytest.raises(ConfigError, match="token"):
        Keyring(token, rotation)
