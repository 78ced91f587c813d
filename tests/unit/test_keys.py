import hashlib
import re
import struct

import pytest

import kvcr.domain.keys as keys_module
from kvcr.domain.errors import InvalidKeyError
from kvcr.domain.keys import (
    NamespaceSpec,
    ShardIdentity,
    check_page_hash,
    check_page_hashes,
    i64_to_u64,
    page_hash,
    page_hashes,
    router_id,
    router_id_signed,
    u64_to_i64,
)


def _reference(tokens, prior=None):
    data = (bytes.fromhex(prior) if prior else b"") + struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.sha256(data).hexdigest()


def test_first_page_hash_is_sha256_of_little_endian_u32_tokens():
    assert page_hash([1, 2, 3, 4]) == _reference([1, 2, 3, 4])
    assert page_hash([1, 2, 3, 4]) != page_hash([4, 3, 2, 1])


def test_pages_chain_through_the_prior_raw_digest():
    tokens = list(range(100, 112))
    hashes = page_hashes(tokens, 4)
    assert len(hashes) == 3
    assert hashes[0] == _reference(tokens[0:4])
    assert hashes[1] == _reference(tokens[4:8], hashes[0])
    assert hashes[2] == _reference(tokens[8:12], hashes[1])


def test_partial_tail_page_is_dropped_and_prior_hash_continues_a_chain():
    tokens = list(range(10))
    full = page_hashes(tokens, 4)
    assert len(full) == 2
    assert page_hashes(tokens[4:8], 4, prior_hash=full[0]) == [full[1]]


def test_wide_tokens_never_collide_with_narrow_encoding():
    assert page_hash([1 << 32]) != page_hash([0, 1])
    with pytest.raises(InvalidKeyError):
        page_hash([-1])


def test_router_identity_is_first_16_hex_chars_unsigned_and_signed():
    h = "ff" * 8 + "00" * 24
    assert router_id(h) == (1 << 64) - 1
    assert router_id_signed(h) == -1
    h2 = "7f" + "ff" * 7 + "ab" * 24
    assert router_id(h2) == router_id_signed(h2) == (1 << 63) - 1


@pytest.mark.parametrize("value", [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1])
def test_u64_i64_round_trip(value):
    assert i64_to_u64(u64_to_i64(value)) == value


@pytest.mark.parametrize("bad", [1 << 64, -1])
def test_u64_out_of_range_is_rejected(bad):
    with pytest.raises(InvalidKeyError):
        u64_to_i64(bad)


@pytest.mark.parametrize("bad", ["", "abc", "A" * 64, "g" * 64, "0" * 63, "0" * 65, None, 123])
def test_malformed_page_hashes_are_rejected(bad):
    with pytest.raises(InvalidKeyError):
        check_page_hash(bad)


def _spec(**changes):
    base = dict(model="llama", page_size=64, dtype="bfloat16", layout="page_first", salt="")
    base.update(changes)
    return NamespaceSpec(**base)


RANK0_OF_2 = ShardIdentity(0, 2)


def _digest(spec=None, pool="kv", pieces=(1024, 1024), shard=RANK0_OF_2):
    return (spec or _spec()).pool_digest(pool, pieces, shard)


def test_pool_namespace_is_stable_and_sensitive_to_every_term():
    digest = _digest()
    assert len(digest) == 16 and digest == _digest()
    variants = [
        _digest(_spec(model="other")),
        _digest(_spec(page_size=32)),
        _digest(_spec(dtype="float16")),
        _digest(_spec(layout="page_first_direct")),
        _digest(_spec(salt="tenant-a")),
        _digest(pieces=(1024, 2048)),
        _digest(pool="indexer"),
        _digest(shard=ShardIdentity(1, 2)),
    ]
    assert len({*variants, digest}) == len(variants) + 1


def test_replicated_pools_share_one_namespace_across_ranks_and_sharded_ones_do_not():
    replicated = {_digest(shard=ShardIdentity(r, 4, replicated=True)) for r in range(4)}
    sharded = {_digest(shard=ShardIdentity(r, 4)) for r in range(4)}
    assert len(replicated) == 1 and len(sharded) == 4


def test_a_malformed_pool_name_cannot_enter_a_namespace():
    with pytest.raises(InvalidKeyError):
        _digest(pool="k v")


def test_bad_shard_identity_is_rejected():
    with pytest.raises(InvalidKeyError):
        ShardIdentity(2, 2)


def test_a_batch_of_page_hashes_is_refused_naming_its_first_bad_key():
    good = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    check_page_hashes(good)
    check_page_hashes([])
    for bad in ("z" * 64, "A" * 64, "a" * 63, "a" * 65, " " + "a" * 63):
        with pytest.raises(InvalidKeyError, match=re.escape(repr(bad))):
            check_page_hashes([good[0], bad, good[1]])
    with pytest.raises(InvalidKeyError, match="got 7"):
        check_page_hashes([good[0], 7])  # deliberately not a str: the refusal must name it


def test_a_valid_batch_is_checked_in_one_pass_not_key_by_key(mocker):
    # The per-key check runs only to name a bad key: the batch check is on every backup's hot path.
    per_key = mocker.patch("kvcr.domain.keys.check_page_hash", wraps=keys_module.check_page_hash)
    check_page_hashes([hashlib.sha256(bytes([i])).hexdigest() for i in range(4)])
    assert per_key.call_count == 0
    with pytest.raises(InvalidKeyError):
        check_page_hashes(["a" * 64, "q" * 64])
    assert per_key.call_count == 2
