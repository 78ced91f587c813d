"""HELLO between a source with slot boards and a node from before them, both ways.

``PoolWire.board`` was added as a trailing, defaulted field of an array-like struct, under the same
protocol version: an older node must still read a newer source's HELLO reply (it drops the extra
element) and a newer node must read an older source's (no board: every page is leased). The older
node's struct is written out here as it was shipped.
"""

import msgspec

from kvcr.runner import protocol
from kvcr.runner.protocol import HelloReply, PoolWire


class OldPoolWire(msgspec.Struct, array_like=True, frozen=True):
    pool_id: int
    name: str
    namespace: str
    regions: list[int]
    pieces: list[int]
    slots: int


class OldHelloReply(msgspec.Struct, tag="hello_reply", array_like=True, frozen=True):
    nonce: bytes
    session: int
    incarnation: str
    data_plane: bytes
    pools: list[OldPoolWire]
    max_lease_ms: int


def body(frame: bytes) -> bytes:
    magic, version, inner = msgspec.msgpack.decode(frame, type=tuple[str, int, bytes])
    assert (magic, version) == (protocol.MAGIC, protocol.PROTOCOL_VERSION)
    return inner


def test_an_older_node_reads_a_hello_reply_that_names_slot_boards():
    wire = PoolWire(3, "kv", "ns", [7, 8], [4096, 4096], 64, board=9)
    frame = protocol.encode(HelloReply(bytes(16), 5, "inc", b"plane", [wire], 30_000))
    old = msgspec.msgpack.decode(body(frame), type=OldHelloReply)
    assert old.pools == [OldPoolWire(3, "kv", "ns", [7, 8], [4096, 4096], 64)]
    assert (old.session, old.max_lease_ms) == (5, 30_000)


def test_a_hello_reply_from_an_older_source_offers_no_board():
    old = OldHelloReply(bytes(16), 5, "inc", b"plane", [OldPoolWire(3, "kv", "ns", [7, 8], [4096, 4096], 64)], 30_000)
    frame = msgspec.msgpack.encode((protocol.MAGIC, protocol.PROTOCOL_VERSION, msgspec.msgpack.encode(old)))
    reply = protocol.decode(frame)
    assert isinstance(reply, HelloReply)
    assert reply.pools == [PoolWire(3, "kv", "ns", [7, 8], [4096, 4096], 64)]
    assert reply.pools[0].board == -1
