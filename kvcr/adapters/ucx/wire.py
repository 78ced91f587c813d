"""What travels between two UCX data planes: the description, four control messages, tag layout.

Tags are 64 bits: a 4-bit kind on top, then a 40-bit read id and a 20-bit segment index::

    63..60 kind | 59..20 read id | 19..0 segment

Kinds with bit 63 set go to a *source* (HELLO, REQUEST, BYE: its serving loop probes for them);
kinds ``01xx`` go to a *target* (DATA, REPLY, WELCOME), each with a receive the target posted
before it sent what provokes them. So a to-target message that finds no posted receive belongs
to a read that was cancelled, and the target may drain it. GONE (``0010``), a source's last word
to its targets when it closes, is probed for like the source's kinds.
"""

from __future__ import annotations

import struct

import msgspec

VERSION = 1

HELLO = 0x8 << 60
REQUEST = 0x9 << 60
BYE = 0xA << 60
TO_SOURCE = 0x8 << 60  # mask: any of the above

DATA = 0x4 << 60
REPLY = 0x5 << 60
WELCOME = 0x6 << 60
TO_TARGET = 0xC << 60  # mask selecting bits 63..62; value 01 = any of the above
GONE = 0x2 << 60

KIND_MASK = 0xF << 60
MAX_READ_ID = (1 << 40) - 1
MAX_SEGMENTS = 1 << 20

# Reply codes (closed set; the target turns every non-zero one into FAILED).
SENT = 0
REFUSED_UNKNOWN_REGION = 1
REFUSED_OUT_OF_BOUNDS = 2
REFUSED_NOT_LEASED = 3
REFUSED_MALFORMED = 4
REFUSED_SEND_FAILED = 5
REASONS = {
    REFUSED_UNKNOWN_REGION: "names a region the source does not expose",
    REFUSED_OUT_OF_BOUNDS: "runs out of the source's region bounds or pairs pieces it cannot merge",
    REFUSED_NOT_LEASED: "is not covered by a live lease at the source",
    REFUSED_MALFORMED: "was malformed",
    REFUSED_SEND_FAILED: "could not be sent",
}

_CODE = struct.Struct("<II")  # reply: code, segments sent
_NONCE = struct.Struct("<Q")  # welcome: the source's incarnation
REPLY_BYTES = _CODE.size
WELCOME_BYTES = _NONCE.size


class RegionWire(msgspec.Struct, array_like=True, frozen=True):
    """An exposed region as a peer sees it: geometry for bounds checks, never an address."""

    id: int
    count: int
    piece_bytes: int
    dense: bool


class Description(msgspec.Struct, frozen=True):
    version: int
    name: str
    nonce: int  # this incarnation of the data plane
    address: bytes  # UCX worker address
    error_handling: bool  # both ends of an endpoint must agree
    host: str  # boot id / pid namespace / user (kvcr.adapters.ucx.paths.host_token)
    regions: list[RegionWire]


class Hello(msgspec.Struct, array_like=True, frozen=True):
    version: int
    name: str
    nonce: int
    address: bytes
    hello_id: int


class Request(msgspec.Struct, array_like=True, frozen=True):
    """A read: each run is (src region, src first, dst region, dst first, count, split).

    ``split`` runs travel as ``count`` messages (one per piece), the others as one message; the
    segment index of a message counts messages across the runs in order.
    """

    name: str
    nonce: int
    read_id: int
    lease: int
    runs: list[tuple[int, int, int, int, int, bool]]


class Bye(msgspec.Struct, array_like=True, frozen=True):
    """BYE (a target leaves a source) and GONE (a source leaves its targets): who, which incarnation."""

    name: str
    nonce: int


ENCODER = msgspec.msgpack.Encoder()
_HELLO = msgspec.msgpack.Decoder(Hello)
_REQUEST = msgspec.msgpack.Decoder(Request)
_BYE = msgspec.msgpack.Decoder(Bye)
_DESCRIPTION = msgspec.msgpack.Decoder(Description)


def decode_description(data: bytes) -> Description:
    """Raises ValueError naming what is wrong."""
    try:
        description = _DESCRIPTION.decode(data)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise ValueError(f"unreadable peer description: {exc}") from exc
    if description.version != VERSION:
        raise ValueError(f"peer description version {description.version}, expected {VERSION}")
    if not description.name:
        raise ValueError("peer description has no name")
    return description


def decode_hello(data: bytes) -> Hello:
    return _HELLO.decode(data)


def decode_request(data: bytes) -> Request:
    return _REQUEST.decode(data)


def decode_bye(data: bytes) -> Bye:
    return _BYE.decode(data)


def data_tag(read_id: int, segment: int) -> int:
    return DATA | (read_id << 20) | segment


def reply_tag(read_id: int) -> int:
    return REPLY | (read_id << 20)


def welcome_tag(hello_id: int) -> int:
    return WELCOME | (hello_id << 20)


def pack_reply(code: int, segments: int) -> bytes:
    return _CODE.pack(code, segments)


def unpack_reply(data: bytes) -> tuple[int, int]:
    code, segments = _CODE.unpack_from(data)
    return int(code), int(segments)


def pack_welcome(nonce: int) -> bytes:
    return _NONCE.pack(nonce)


def unpack_welcome(data: bytes) -> int:
    return int(_NONCE.unpack_from(data)[0])
