"""Hypothesis strategies for hostile input: msgpack junk, control frames, mutations of recorded frames.

Sizes are chosen so one case stays cheap (a few MiB at most) while still reaching every limit the
peer protocol has (``MAX_POOLS``, ``MAX_LEASE_PAGES``, ``MAX_RELEASE_IDS``, ``NONCE_BYTES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import msgpack
from hypothesis import strategies as st

from kvcr.runner.protocol import MAGIC, MAX_LEASE_PAGES, MAX_POOLS, MAX_RELEASE_IDS, NONCE_BYTES, PROTOCOL_VERSION

I64_MIN, U64_MAX = -(1 << 63), (1 << 64) - 1
TAGS = ("hello", "hello_reply", "lease", "lease_reply", "release", "refused")

# Integers at and around every boundary msgpack and the protocol have.
edge_ints = st.one_of(
    st.sampled_from(
        [
            *(0, 1, -1, 2, 7, 15, 16, 17, 63, 64, 65, 127, 128, 255, 256, 4095, 4096, 4097, 65535, 65536),
            *(1 << 31, (1 << 31) - 1, -(1 << 31), 1 << 32, (1 << 53) + 1, (1 << 63) - 1, I64_MIN, 1 << 63, U64_MAX),
        ]
    ),
    st.integers(I64_MIN, U64_MAX),
)
giant_sizes = st.sampled_from([1 << 10, 1 << 14, 1 << 17, 1 << 20])
giant_text = st.builds(  # n bytes of UTF-8, whatever the character
    lambda n, c: c * (n // len(c.encode())), giant_sizes, st.sampled_from(["a", "\u00e9", "\x00", "\U0001f600", "0"])
)
giant_bytes = st.builds(lambda n, b: b * n, giant_sizes, st.sampled_from([b"\x00", b"\xff", b"\xc1", b"k"]))
texts = st.one_of(st.text(max_size=24), giant_text)
blobs = st.one_of(st.binary(max_size=48), giant_bytes)

# Anything msgpack can carry, nested.
leaves = st.one_of(
    st.none(),
    st.booleans(),
    edge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=16),
    st.binary(max_size=16),
)
junk = st.recursive(
    leaves,  # giant strings come in as single fields (below), so one frame stays a few MiB
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=8), edge_ints, st.binary(max_size=8)), inner, max_size=6),
    ),
    max_leaves=24,
)
long_lists = st.builds(lambda n, v: [v] * n, st.sampled_from([MAX_POOLS + 1, 5_000, 70_000]), leaves)
# Arrays nested far past any recursion limit, written directly (a packer refuses to nest them).
deep_nesting = st.builds(
    lambda d, inner: b"\x91" * d + inner, st.integers(100, 200_000), st.sampled_from([b"\xc0", b"\x90"])
)


MAX_FRAME_BYTES = 16 << 20  # what one generated frame may weigh (a bigger one is a strategy bug)


def pack(value: object) -> bytes:
    frame = msgpack.packb(value, use_bin_type=True)
    assert len(frame) <= MAX_FRAME_BYTES, f"a generated frame of {len(frame)} bytes"
    return frame


# Raw bytes: random, and msgpack headers that claim enormous lengths with nothing behind them.
_LYING_HEADERS = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 billion items
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\x93\xa9kvcr-peer\x02\xc6\x7f\xff\xff\xff",  # a right envelope whose body claims 2 GiB
    b"\x93\xa9kvcr-peer\x02\xc4\x05\xdd\xff\xff\xff\xff",  # a body that is a lying array
    b"\xc1",  # never-used type byte
    b"\xd4\x01\x00",  # fixext (msgspec: unknown extension)
]
raw_frames = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda h, tail: h + tail, st.sampled_from(_LYING_HEADERS), st.binary(max_size=32)),
    st.builds(lambda n: bytes(n), st.sampled_from([0, 1 << 16, 1 << 22])),
)


def envelope(magic: object = MAGIC, version: object = PROTOCOL_VERSION, body: object = b"") -> bytes:
    return pack([magic, version, body])


# A tagged array with arbitrary fields: the shape of a message, with junk for values.
junk_messages = st.builds(
    lambda tag, fields: [tag, *fields],
    st.one_of(st.sampled_from(TAGS), texts, leaves),
    st.lists(st.one_of(junk, long_lists, texts, blobs), max_size=6),
)
msgpack_frames = st.one_of(
    # right envelope, junk body (packed or not)
    st.builds(envelope, body=st.one_of(junk_messages.map(pack), junk.map(pack), blobs, junk)),
    # wrong magic or version, otherwise right
    st.builds(
        envelope,
        st.one_of(st.just(MAGIC), texts, leaves, st.just(MAGIC.upper()), st.just(MAGIC + "\x00")),
        st.one_of(st.just(PROTOCOL_VERSION), edge_ints, leaves, st.just(str(PROTOCOL_VERSION))),
        junk_messages.map(pack),
    ),
    # not a three-element array
    st.one_of(junk, long_lists).map(pack),
    deep_nesting,
    st.builds(envelope, body=deep_nesting),
    st.lists(st.one_of(st.just(MAGIC), st.just(PROTOCOL_VERSION), junk), min_size=0, max_size=6).map(pack),
    st.dictionaries(texts, junk, max_size=4).map(pack),
)


# Well-typed messages with hostile values. Sessions and nonces may refer to real ones the harness
# has seen by then (``Known``, resolved when the case runs), so replays and cross-session mixes come
# up often, not by luck.
@dataclass(frozen=True)
class Known:
    kind: str  # "session" or "nonce"
    index: int


@dataclass(frozen=True)
class Namespaces:
    """The source's real namespace map, with extra entries, or with every value replaced."""

    extra: tuple[tuple[str, str], ...] = ()
    value: str | None = None


def resolve(value: object, known: dict[str, object]) -> object:
    """``value`` with every ``Known`` and ``Namespaces`` replaced by the real thing it stands for."""
    if isinstance(value, Namespaces):
        real = cast("dict[str, str]", known["namespaces"])
        mixed = dict.fromkeys(real, value.value) if value.value is not None else dict(real)
        mixed.update(value.extra)
        return mixed
    if isinstance(value, Known):
        pool = cast("list[int] | list[bytes]", known[value.kind])  # sessions or nonces
        if not pool:
            return 0 if value.kind == "session" else b""
        return pool[value.index % len(pool)]
    if isinstance(value, list | tuple):
        return [resolve(v, known) for v in value]
    return value


nonces = st.one_of(
    st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES),
    st.binary(max_size=64),
    giant_bytes,
    st.integers(0, 1 << 16).map(lambda i: Known("nonce", i)),
)
sessions = st.one_of(edge_ints, st.integers(0, 1 << 16).map(lambda i: Known("session", i)))


def page_lists(known_pages: list[str]) -> st.SearchStrategy[list[str]]:
    page = st.one_of(
        st.sampled_from(known_pages),
        st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
        st.text(max_size=70),
    )
    return st.one_of(
        st.lists(st.one_of(page, giant_text), max_size=12),
        st.builds(lambda n, p: [p] * n, st.sampled_from([MAX_LEASE_PAGES, MAX_LEASE_PAGES + 1, 20_000]), page),
        st.builds(lambda pages: pages * 600, st.just(known_pages)),  # the real pages, many times over
    )


def hostile_messages(known_pages: list[str]) -> st.SearchStrategy[list[object]]:
    """A message array ``[tag, field, ...]`` whose fields have the right types and hostile values."""
    ns_maps = st.one_of(
        st.just(Namespaces()),
        st.dictionaries(texts, texts, max_size=4),
        st.builds(lambda n: {f"p{i}": "x" for i in range(n)}, st.sampled_from([MAX_POOLS, MAX_POOLS + 1, 5_000])),
        st.builds(lambda extra: Namespaces(tuple(extra.items())), st.dictionaries(texts, texts, max_size=3)),
        st.builds(lambda v: Namespaces(value=v), texts),
    )
    nonce, session = nonces, sessions
    pool_ids = st.one_of(st.integers(-2, 4), edge_ints)
    hello = st.builds(lambda *f: ["hello", *f], nonce, texts, texts, ns_maps)
    lease = st.builds(
        lambda *f: ["lease", *f],
        nonce,
        session,
        edge_ints,
        st.one_of(
            st.lists(st.tuples(pool_ids, page_lists(known_pages)).map(list), max_size=4),
            st.builds(lambda n: [[0, []]] * n, st.sampled_from([MAX_POOLS, MAX_POOLS + 1, 3_000])),
        ),
    )
    release = st.builds(
        lambda *f: ["release", *f],
        session,
        st.one_of(
            st.lists(edge_ints, max_size=16),
            st.builds(lambda n, v: [v] * n, st.sampled_from([MAX_RELEASE_IDS + 1, 50_000]), edge_ints),
        ),
    )
    # Replies and refusals sent to a server: well formed, but never requests.
    others = st.one_of(
        st.builds(lambda *f: ["hello_reply", *f], nonce, edge_ints, texts, blobs, st.just([]), edge_ints),
        st.builds(lambda *f: ["lease_reply", *f], nonce, edge_ints, edge_ints, st.just([[0]]), st.just([[b""]])),
        st.builds(lambda *f: ["refused", *f], nonce, edge_ints),
    )
    return st.one_of(hello, lease, lease, release, others)


# Byte-level mutations of a recorded frame.
mutations = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(1, 255)),
        st.tuples(st.just("truncate"), st.integers(0, 1 << 16)),
        st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 16)),
        st.tuples(st.just("repeat"), st.integers(0, 1 << 16), st.integers(1, 64), st.integers(2, 50)),
    ),
    min_size=1,
    max_size=4,
)


def mutate(frame: bytes, ops: list[tuple]) -> bytes:
    data = bytearray(frame)
    for op in ops:
        at = op[1] % (len(data) + 1)
        if op[0] == "flip" and data:
            data[at % len(data)] ^= op[2]
        elif op[0] == "truncate":
            del data[at:]
        elif op[0] == "insert":
            data[at:at] = op[2]
        elif op[0] == "delete":
            del data[at : at + op[2]]
        elif op[0] == "repeat":
            data[at:at] = bytes(data[at : at + op[2]]) * op[3]
    return bytes(data)
