"""CURVE keys derived from the cluster token, and the ZAP admission check.

Why derived keys: the cluster token is the only secret an operator provisions, so every node
derives the same two Curve25519 keypairs from it with HKDF-SHA256 (RFC 5869; a fixed salt, one
info label per key): a *server* keypair every control server binds with, and a *client* keypair
every node dials with. A client that lacks the token cannot compute the server's public key (so
its CurveZMQ HELLO does not decrypt) nor the admitted client key (so the ZAP check refuses it).
The price of one shared secret: every token holder can act as any node; the token is the trust
domain (see docs/security.md).

Rotation: a :class:`Keyring` holds the current token's keys first, then those of the rotation
tokens. Servers bind with the current token's server key and admit the client key of every token
on the ring; clients dial with the current keys and, when the handshake fails, with the next
token's keys (a failed CURVE handshake is seen in milliseconds, so the fallback is cheap).

pyzmq is imported inside the functions: importing this module needs nothing beyond the stdlib.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvcr.domain.errors import ConfigError

_SALT = b"kvcr control channel curve v1"
_SERVER_INFO = b"kvcr/control/curve/server-secret"
_CLIENT_INFO = b"kvcr/control/curve/client-secret"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27): one handler per context
ZAP_DOMAIN = b"kvcr-control"
_ZAP_VERSION = b"1.0"


def hkdf_sha256(key_material: bytes, info: bytes, length: int = 32, salt: bytes = _SALT) -> bytes:
    """RFC 5869 extract-then-expand (the stdlib has HMAC but no HKDF)."""
    if not 0 < length <= 255 * hashlib.sha256().digest_size:
        raise ValueError(f"HKDF output length {length} is out of range")
    prk = hmac.new(salt, key_material, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """One token's keypairs, Z85-encoded as libzmq's socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_token(cls, token: bytes) -> CurveKeys:
        from zmq import curve_public
        from zmq.utils import z85

        server_secret = z85.encode(hkdf_sha256(token, _SERVER_INFO))
        client_secret = z85.encode(hkdf_sha256(token, _CLIENT_INFO))
        return cls(curve_public(server_secret), server_secret, curve_public(client_secret), client_secret)


class Credentials(Protocol):
    """What the control channel's server and client ask of its keys: a :class:`Keyring` (one cluster
    token, every node the same keys) or a :class:`~kvcr.adapters.zmq.identity.NodeIdentity` (a
    keypair per node and a directory of them)."""

    per_node: bool  # whether a client key names one node (then quotas and revocation follow it)

    def __len__(self) -> int:
        """How many key sets a dial may try, one after the other."""

    def admits(self, client_key: bytes) -> bool:
        """Whether a raw 32-byte client public key may connect (asked again for every request)."""

    def server_key(self, endpoint: str) -> bytes | None:
        """The Z85 public key the server at ``endpoint`` proves; None: we may not dial it."""

    def configure_server(self, sock: Any) -> None: ...

    def configure_client(self, sock: Any, index: int, endpoint: str) -> None: ...


class Keyring:
    """The current token's keys first, then each rotation token's; who may connect to our server.

    Raises:
        ConfigError: a token that is not bytes or is empty (the message names ``token``).
    """

    per_node = False  # every token holder dials with the same client key

    def __init__(self, token: bytes, rotation_tokens: Sequence[bytes] = ()) -> None:
        tokens = [token, *rotation_tokens]
        for i, t in enumerate(tokens):
            name = "token" if i == 0 else f"rotation_tokens[{i - 1}]"
            if not isinstance(t, bytes) or not t:
                raise ConfigError(f"control {name} must be non-empty bytes")
        unique = list(dict.fromkeys(tokens))  # a token listed twice would only cost a redial
        self.keys: tuple[CurveKeys, ...] = tuple(CurveKeys.from_token(t) for t in unique)
        from zmq.utils import z85

        # Public keys are not secret: a plain set lookup (not constant-time) leaks nothing.
        self._admitted = frozenset(z85.decode(k.client_public) for k in self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def admits(self, client_key: bytes) -> bool:
        """Whether a client's raw 32-byte long-term public key belongs to a token on the ring."""
        return client_key in self._admitted

    def server_key(self, endpoint: str) -> bytes | None:
        """Every server binds with the current token's key, whatever its endpoint."""
        return self.keys[0].server_public

    def configure_server(self, sock: Any) -> None:
        """Make ``sock`` a CURVE server with the current token's key (call before ``bind``)."""
        lib = _lib()
        sock.setsockopt(lib.CURVE_SERVER, 1)
        sock.setsockopt(lib.CURVE_SECRETKEY, self.keys[0].server_secret)
        sock.setsockopt(lib.ZAP_DOMAIN, ZAP_DOMAIN)

    def configure_client(self, sock: Any, index: int, endpoint: str = "") -> None:
        """Make ``sock`` a CURVE client with the keys of ring entry ``index`` (call before ``connect``)."""
        lib = _lib()
        keys = self.keys[index]
        sock.setsockopt(lib.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(lib.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(lib.CURVE_SECRETKEY, keys.client_secret)


def zap_reply(frames: list[bytes], keyring: Credentials, user_id: bytes = b"") -> tuple[list[bytes], bool]:
    """Answer one ZAP request (RFC 27); returns the reply frames and whether the client was admitted.

    Only CURVE requests in our domain carrying an admitted key pass; anything else (another
    mechanism, a malformed request) is refused, so a misconfigured socket fails closed. An admitted
    connection gets ``user_id`` followed by the client's public key (hex) as its ZAP user id: libzmq
    attaches it to every message of that connection (the ``User-Id`` property), and no peer can set it.
    """
    if len(frames) < 6:
        request_id = frames[1] if len(frames) > 1 else b""
        return [_ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""], False
    version, request_id, domain, _address, _identity, mechanism, *credentials = frames
    admitted = (
        version == _ZAP_VERSION
        and domain == ZAP_DOMAIN
        and mechanism == b"CURVE"
        and len(credentials) == 1
        and keyring.admits(credentials[0])
    )
    if not admitted:
        return [_ZAP_VERSION, request_id, b"400", b"not a cluster member", b"", b""], False
    return [_ZAP_VERSION, request_id, b"200", b"OK", user_id + b"/" + credentials[0].hex().encode(), b""], True


def _lib() -> Any:
    import zmq

    return zmq
