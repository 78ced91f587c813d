"""Domain rules at their edges: region overlap, run coalescing, key encodings, namespaces, outcomes, hits."""

import hashlib
import json
import struct

import pytest

from kvcr.domain.eviction import FifoPolicy, LruPolicy
from kvcr.domain.hits import PoolPresence, hit_verdict
from kvcr.domain.keys import NamespaceSpec, ShardIdentity, page_hash, page_hashes
from kvcr.domain.layout import RegionDescriptor, check_disjoint, slot_runs
from kvcr.domain.outcomes import Outcome, failed, miss, uncertain
from kvcr.domain.pools import HitPolicy
from kvcr.domain.residency import Lease

# ---------------------------------------------------------------------------------------------- overlaps

# K at bytes [0, 50) of every 100, ten times: the gaps [50, 100) are free for another region's pieces.
K = RegionDescriptor("k", 0, 100, 10, 50)


def test_a_single_piece_in_the_gap_of_a_strided_region_does_not_overlap_it():
    gap = RegionDescriptor("s", 160, 100, 1, 30)  # bytes [160, 190): inside K's second gap
    assert K.overlaps(gap) is False and gap.overlaps(K) is False
    two = RegionDescriptor("k2", 0, 100, 2, 50)
    inside = RegionDescriptor("s2", 60, 100, 1, 30)  # bytes [60, 90): between two's pieces, inside its extent
    assert two.overlaps(inside) is False and inside.overlaps(two) is False
    check_disjoint([K, gap])


def test_single_pieces_overlap_when_their_bytes_do():
    a, b = RegionDescriptor("a", 0, 0, 1, 64), RegionDescriptor("b", 32, 0, 1, 64)
    assert a.overlaps(b) is True and b.overlaps(a) is True
    assert RegionDescriptor("c", 64, 0, 1, 8).overlaps(a) is False  # touching is not overlapping


def test_a_piece_reaching_past_the_period_into_the_next_piece_overlaps():
    late = RegionDescriptor("w", 60, 100, 10, 50)  # [60, 110) runs into K's piece at [100, 150)
    assert K.overlaps(late) is True and late.overlaps(K) is True


def test_the_phase_is_measured_from_each_regions_own_base():
    k = RegionDescriptor("k", 1030, 100, 10, 50)
    v = RegionDescriptor("v", 1080, 100, 10, 50)  # 50 bytes after every K piece: interleaved, disjoint
    assert k.overlaps(v) is False and v.overlaps(k) is False
    assert k.overlaps(RegionDescriptor("x", 1070, 100, 10, 20)) is True  # [1070, 1090) hits [1030, 1080)


def test_regions_with_different_periods_over_one_extent_are_refused():
    other = RegionDescriptor("o", 60, 70, 5, 5)  # pieces at 60, 130, 200, ...: 130 is inside K's [100, 150)
    assert K.overlaps(other) is True
    sparse = RegionDescriptor("p", 55, 300, 3, 5)  # pieces in K's gaps only, yet the rule refuses unproven pairs
    assert K.overlaps(sparse) is True


def test_runs_come_out_in_destination_order_even_when_sources_run_backwards():
    assert slot_runs([(5, 0), (1, 1)]) == [(5, 0, 1), (1, 1, 1)]
    assert slot_runs([(9, 3), (7, 2), (8, 0), (9, 1)]) == [(8, 0, 2), (7, 2, 1), (9, 3, 1)]


# ---------------------------------------------------------------------------------------------- keys


def _u32(tokens, prior=None):
    data = (bytes.fromhex(prior) if prior else b"") + struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.sha256(data).hexdigest()


def _u64(tokens):
    return hashlib.sha256(b"\xff" + struct.pack(f"<{len(tokens)}Q", *tokens)).hexdigest()


def test_token_ids_0_and_2_pow_32_minus_1_use_the_narrow_encoding():
    assert page_hash([0, 5]) == _u32([0, 5])
    assert page_hash([0xFFFFFFFF, 1]) == _u32([0xFFFFFFFF, 1])


def test_a_page_with_a_wide_token_is_encoded_wide_with_every_token_including_0():
    assert page_hash([0, 1 << 32]) == _u64([0, 1 << 32])
    assert page_hash([(1 << 64) - 1]) == _u64([(1 << 64) - 1])


def test_only_full_pages_are_hashed_and_page_size_1_is_legal():
    assert len(page_hashes(list(range(7)), 4)) == 1  # 3 tokens left over: no second page
    assert len(page_hashes(list(range(8)), 4)) == 2
    assert page_hashes([3, 4], 1) == [_u32([3]), _u32([4], _u32([3]))]


def test_a_pool_namespace_is_the_documented_digest():
    spec = NamespaceSpec("llama", 64, "bfloat16", "page_first", salt="t")
    for shard, terms in ((ShardIdentity(1, 2), ["tp", 1, 2]), (ShardIdentity(replicated=True), ["replicated"])):
        canonical = json.dumps(
            ["kvcr-namespace-v2", "llama", 64, "bfloat16", "page_first", "kv", [512, 512], terms, "t"],
            separators=(",", ":"),
        )
        assert spec.pool_digest("kv", (512, 512), shard) == hashlib.sha256(canonical.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------- outcomes, leases, eviction


def test_outcomes_keep_their_reason_and_ties_keep_the_first():
    assert miss("not held").reason == "not held" and miss("x").outcome is Outcome.MISS
    assert uncertain("cancel unconfirmed").reason == "cancel unconfirmed"
    assert failed("copy").reason == "copy"
    first, second = miss("first"), miss("second")
    assert first.worsen(second) is first
    assert failed("a").worsen(failed("b")).reason == "a"


def test_a_renewed_lease_is_the_same_lease_with_a_new_end():
    lease = Lease(7, ("k1", "k2"), granted_at=5.0, expires_at=15.0)
    renewed = lease.renewed(12.0, 10.0)
    assert renewed == Lease(7, ("k1", "k2"), 5.0, 22.0)


@pytest.mark.parametrize("policy", [LruPolicy, FifoPolicy])
def test_removing_an_unknown_key_is_ignored(policy):
    order = policy()
    order.admit(["a", "b"])
    order.remove("missing")
    assert sorted(order.victims()) == ["a", "b"] and len(order) == 2


# ---------------------------------------------------------------------------------------------- hits


def test_the_hit_is_the_largest_legal_cut_and_each_pool_reports_its_own():
    kv = PoolPresence("kv", HitPolicy.ALL_PAGES, [True] * 4)
    mamba = PoolPresence("mamba", HitPolicy.TRAILING_PAGES, [False, True, False, True], window=1)
    verdict = hit_verdict([kv, mamba])
    assert verdict.restorable == (2, 4) and verdict.pages == 4
    assert verdict.pool_hits == {"kv": 4, "mamba": 4}
    assert hit_verdict([kv]).pages == 4 and hit_verdict([kv]).restorable == (1, 2, 3, 4)
    only_second = PoolPresence("mamba", HitPolicy.TRAILING_PAGES, [False, True, False, False], window=1)
    assert hit_verdict([kv, only_second]).pool_hits["mamba"] == 2
