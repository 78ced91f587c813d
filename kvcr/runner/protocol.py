"""The peer protocol: versioned, optionally authenticated request/reply messages.

A frame is a msgpack array ``["kvcr-peer", version, body, mac]``; ``body`` is one msgpack-encoded
message below and ``mac`` is HMAC-SHA256(cluster token, body) when a token is configured (empty
otherwise). The version and the MAC are checked before the body is decoded, so a peer speaking
another version or holding another token learns nothing but a refusal.

    target                                source
      HELLO(namespace, sender)      ->      HELLO_REPLY(namespace, data plane, pool geometry)
      LEASE(block keys, lease_ms)   ->      LEASE_REPLY(lease id, slot per key or -1, ttl)
      (one-sided data-plane READ of the granted slots, no source involvement)
      RELEASE(lease id)             ->      ACK
      PING                          ->      PONG(incarnation)
    any request                     ->      REFUSED(reason) on version, auth or namespace failure
"""

from __future__ import annotations

import hmac
from hashlib import sha256

import msgspec

from kvcr.ports.errors import PeerRefused

MAGIC = "kvcr-peer"
PROTOCOL_VERSION = 1
MAX_LEASE_KEYS = 65536


class PoolGeometryWire(msgspec.Struct, array_like=True, frozen=True):
    """One pool's arena as a peer sees it: component region labels, strides and piece sizes."""

    pool: str
    labels: list[str]
    strides: list[int]
    pieces: list[int]
    slots: int


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    namespace: str
    sender: str


class HelloReply(msgspec.Struct, tag="hello_reply", array_like=True, frozen=True):
    namespace: str
    incarnation: str
    data_plane: bytes
    pools: list[PoolGeometryWire]


class Lease(msgspec.Struct, tag="lease", array_like=True, frozen=True):
    keys: list[str]
    lease_ms: int
    renew_id: int = 0
    checksums: bool = False


class LeaseReply(msgspec.Struct, tag="lease_reply", array_like=True, frozen=True):
    lease_id: int
    slots: list[int]  # per requested key: the slot index in that key's pool arena, or -1
    ttl_ms: int
    incarnation: str
    checksums: list[bytes] = []  # per requested key when asked for: digest of its pieces


class Release(msgspec.Struct, tag="release", array_like=True, frozen=True):
    lease_id: int


class Ack(msgspec.Struct, tag="ack", array_like=True, frozen=True):
    pass


class Ping(msgspec.Struct, tag="ping", array_like=True, frozen=True):
    pass


class Pong(msgspec.Struct, tag="pong", array_like=True, frozen=True):
    incarnation: str


class Refused(msgspec.Struct, tag="refused", array_like=True, frozen=True):
    reason: str


Message = Hello | HelloReply | Lease | LeaseReply | Release | Ack | Ping | Pong | Refused

_encoder = msgspec.msgpack.Encoder()
_body_decoder = msgspec.msgpack.Decoder(Message)
_frame_decoder = msgspec.msgpack.Decoder(tuple[str, int, bytes, bytes])


class FrameError(Exception):
    """A frame could not be accepted; ``reason`` is safe to send back to the peer."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Codec:
    """Encodes and checks frames for one cluster token (None: unauthenticated cluster)."""

    def __init__(self, token: bytes | None) -> None:
        self._token = token

    def _mac(self, body: bytes) -> bytes:
        if self._token is None:
            return b""
        return hmac.new(self._token, body, sha256).digest()

    def encode(self, message: Message) -> bytes:
        body = _encoder.encode(message)
        return _encoder.encode((MAGIC, PROTOCOL_VERSION, body, self._mac(body)))

    def decode(self, frame: bytes) -> Message:
        """Check magic, version and MAC, then decode the body.

        Raises:
            FrameError: the frame is malformed, of another version, or fails authentication.
        """
        try:
            magic, version, body, mac = _frame_decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise FrameError("malformed frame") from exc
        if magic != MAGIC:
            raise FrameError("not a kvcr peer frame")
        if version != PROTOCOL_VERSION:
            raise FrameError(f"protocol version {version} is not {PROTOCOL_VERSION}")
        if self._token is not None and not hmac.compare_digest(mac, self._mac(body)):
            raise FrameError("authentication failed")
        try:
            return _body_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise FrameError("malformed message") from exc

    def decode_reply(self, frame: bytes) -> Message:
        """Decode a reply; a REFUSED reply or an unreadable one raises PeerRefused."""
        try:
            message = self.decode(frame)
        except FrameError as exc:
            # A refusal from a peer with another token is unsigned: read it only to explain.
            raise PeerRefused(f"unusable reply: {exc.reason}{_peek_refusal(frame)}") from exc
        if isinstance(message, Refused):
            raise PeerRefused(f"peer refused: {message.reason}")
        return message

    def refusal(self, reason: str) -> bytes:
        """A REFUSED frame (signed when we have a token)."""
        return self.encode(Refused(reason))


def _peek_refusal(frame: bytes) -> str:
    try:
        _, _, body, _ = _frame_decoder.decode(frame)
        message = _body_decoder.decode(body)
    except (msgspec.DecodeError, ValueError):
        return ""
    return f" (peer said: {message.reason})" if isinstance(message, Refused) else ""
