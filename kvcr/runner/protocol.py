"""The peer protocol: versioned request/reply messages, bound to a session and a request nonce.

A frame is a msgpack array ``["kvcr-peer", version, body]``; ``body`` is one msgpack-encoded
message below. The version is checked before the body is decoded. Authentication and secrecy
are the control channel's job (ZMQ CURVE keyed from the cluster token): a peer without the
token never gets a frame to us. On top of that every request carries a fresh random nonce that
its reply echoes, so a reply can never answer another request; the source refuses a nonce it has
seen before (a replayed frame gets nothing); and a lease request names the session its HELLO
opened, so namespaces are compared once per link, not per page.

A source on the target's host may also offer each pool's *slot board* (``PoolWire.board``,
``kvcr.domain.board``): the target then finds pages there and skips LEASE and RELEASE; it reports
what it took with SERVED so the source still counts it.

    target                                           source
      HELLO(nonce, sender, incarnation,
            {pool: namespace digest})         ->     HELLO_REPLY(nonce, session, incarnation,
                                                       data plane description, matching pools)
      LEASE(nonce, session, lease_ms,
            [(pool id, [page hash ...]) ...]) ->     LEASE_REPLY(nonce, lease id, ttl,
                                                       per pool: slot or -1, digest)
      (data-plane READ of the granted slots; the source takes no part on one-sided transports)
      RELEASE(session, [lease id ...])        ->     (one-way: nothing comes back)
      SERVED(session, [(pool id, pages) ...]) ->     (one-way: pages a same-host target found on
                                                       the pool's slot board instead of leasing)
    any request                               ->     REFUSED(nonce, code) on version, session,
                                                       namespace, size, range or shutdown
"""

from __future__ import annotations

import enum

import msgspec

MAGIC = "kvcr-peer"
PROTOCOL_VERSION = 2
MAX_LEASE_PAGES = 4096  # per LEASE: 32 read batches of 128 pages; more is refused, not served slowly
MAX_RELEASE_IDS = 1024
MAX_POOLS = 64
NONCE_BYTES = 16
# A LEASE's length must lie in 1..MAX_LEASE_MS (what any node's lease_ms setting can be); within it
# the source grants at most its own lease length. Outside it is nonsense (-1, 2**64 - 1) and refused.
MAX_LEASE_MS = 3_600_000


class RefusalCode(enum.IntEnum):
    """Why a request was refused: a closed set, so nothing a peer sends is ever echoed back."""

    MALFORMED = 1
    VERSION = 2
    NAMESPACE = 3
    UNKNOWN_SESSION = 4
    TOO_LARGE = 5
    CLOSING = 6
    INTERNAL = 7
    REPLAYED = 8
    OUT_OF_RANGE = 9  # a value no well-behaved peer sends (a lease length outside 1..MAX_LEASE_MS)


class PoolWire(msgspec.Struct, array_like=True, frozen=True):
    """One pool a link may lease from: its id on this link, namespace, region id per component, sizes."""

    pool_id: int
    name: str
    namespace: str
    regions: list[int]
    pieces: list[int]
    slots: int
    board: int = -1  # region id of its slot board for same-host peers (-1: none; older sources send none)


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    nonce: bytes
    sender: str
    incarnation: str
    namespaces: dict[str, str]  # pool name -> namespace digest


class HelloReply(msgspec.Struct, tag="hello_reply", array_like=True, frozen=True):
    nonce: bytes
    session: int
    incarnation: str
    data_plane: bytes
    pools: list[PoolWire]  # only pools whose namespace matched
    max_lease_ms: int


class Lease(msgspec.Struct, tag="lease", array_like=True, frozen=True):
    nonce: bytes
    session: int
    lease_ms: int
    pages: list[tuple[int, list[str]]]  # (pool id, page hashes)


class LeaseReply(msgspec.Struct, tag="lease_reply", array_like=True, frozen=True):
    nonce: bytes
    lease_id: int  # 0: nothing granted
    ttl_ms: int
    slots: list[list[int]]  # per requested pool, per page: slot in that pool's arena, or -1
    digests: list[list[bytes]]  # per requested pool, per page: the page's digest (empty if none)


class Release(msgspec.Struct, tag="release", array_like=True, frozen=True):
    session: int
    lease_ids: list[int]


class Served(msgspec.Struct, tag="served", array_like=True, frozen=True):
    """One-way, target to source: pages it took from the source's slot board without a LEASE (for the
    source's ``served`` count; sent only to sources whose HELLO offered a board)."""

    session: int
    pages: list[tuple[int, int]]  # (pool id, pages)


class Refused(msgspec.Struct, tag="refused", array_like=True, frozen=True):
    nonce: bytes
    code: int


Message = Hello | HelloReply | Lease | LeaseReply | Release | Served | Refused

_encoder = msgspec.msgpack.Encoder()
_body_decoder = msgspec.msgpack.Decoder(Message)
_frame_decoder = msgspec.msgpack.Decoder(tuple[str, int, bytes])


class FrameError(Exception):
    """A frame could not be accepted; ``code`` says why, from a closed set."""

    def __init__(self, code: RefusalCode) -> None:
        super().__init__(code.name.lower())
        self.code = code


def encode(message: Message) -> bytes:
    return _encoder.encode((MAGIC, PROTOCOL_VERSION, _encoder.encode(message)))


def decode(frame: bytes) -> Message:
    """Check magic and version, then decode the body.

    Raises:
        FrameError: the frame is malformed or of another version.
    """
    try:
        magic, version, body = _frame_decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise FrameError(RefusalCode.MALFORMED) from exc
    if magic != MAGIC:
        raise FrameError(RefusalCode.MALFORMED)
    if version != PROTOCOL_VERSION:
        raise FrameError(RefusalCode.VERSION)
    try:
        return _body_decoder.decode(body)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise FrameError(RefusalCode.MALFORMED) from exc
