import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcr.domain.boundaries import all_pages_boundaries, intersect, leading_run, trailing_boundaries
from kvcr.domain.errors import EvidenceError, LayoutError
from kvcr.domain.hits import PoolPresence, hit_verdict
from kvcr.domain.layout import ComponentSpec
from kvcr.domain.pools import HitPolicy, PoolSpec, check_pool_set


def restorable_prefix(sets):
    return max(intersect(sets))

KV = PoolSpec("kv", (ComponentSpec("k", 8), ComponentSpec("v", 8)), anchor=True)
INDEXER = PoolSpec("indexer", (ComponentSpec("i", 4),))
MAMBA = PoolSpec("mamba", (ComponentSpec("m", 4),), HitPolicy.TRAILING_PAGES)
LOGICAL = PoolSpec("kv", (), anchor=True, logical=True)


def test_the_worked_example_from_the_design():
    assert restorable_prefix([frozenset({0, 4, 8}), frozenset({0, 6})]) == 0


def test_intersection_not_min_of_maxima():
    sets = [frozenset({0, 2, 4, 6, 8}), frozenset({0, 3, 6, 9})]
    assert restorable_prefix(sets) == 6
    assert intersect([]) == frozenset({0})


def test_all_pages_boundaries_stop_at_first_miss():
    assert all_pages_boundaries([True, True, False, True]) == frozenset({0, 1, 2})
    assert all_pages_boundaries([]) == frozenset({0})
    assert leading_run([True, True, False, True]) == 2


def test_trailing_boundaries_allow_holes():
    present = [False, False, False, True, False, True, True, False]
    assert trailing_boundaries(present, 1) == frozenset({0, 4, 6, 7})
    assert trailing_boundaries(present, 2) == frozenset({0, 7})
    assert trailing_boundaries([True, True], 4) == frozenset({0, 1, 2})
    with pytest.raises(LayoutError):
        trailing_boundaries(present, 0)


@given(st.lists(st.lists(st.booleans(), min_size=8, max_size=8), min_size=1, max_size=4), st.integers(1, 3))
def test_restorable_prefix_is_legal_for_every_pool(columns, window):
    sets = [all_pages_boundaries(columns[0])] + [trailing_boundaries(c, window) for c in columns[1:]]
    best = restorable_prefix(sets)
    assert all(best in s for s in sets)
    assert best <= min(max(s) for s in sets)


def test_pool_spec_validation():
    with pytest.raises(LayoutError, match="zero components"):
        PoolSpec("kv", ())
    with pytest.raises(LayoutError, match="logical"):
        PoolSpec("kv", (ComponentSpec("k", 8),), anchor=True, logical=True)
    with pytest.raises(LayoutError, match="only the anchor"):
        PoolSpec("swa", (), logical=True)
    with pytest.raises(LayoutError, match="repeats"):
        PoolSpec("kv", (ComponentSpec("k", 8), ComponentSpec("k", 8)))
    with pytest.raises(LayoutError, match="all_pages"):
        PoolSpec("kv", (ComponentSpec("k", 8),), HitPolicy.TRAILING_PAGES, anchor=True)
    assert KV.page_bytes == 16 and LOGICAL.page_bytes == 0


def test_pool_set_validation():
    check_pool_set([KV, INDEXER, MAMBA])
    with pytest.raises(LayoutError, match="repeat"):
        check_pool_set([KV, KV])
    with pytest.raises(LayoutError, match="one pool may be the anchor"):
        check_pool_set([KV, PoolSpec("other", (ComponentSpec("x", 1),), anchor=True)])
    with pytest.raises(LayoutError):
        check_pool_set([])


ALL, TRAIL = HitPolicy.ALL_PAGES, HitPolicy.TRAILING_PAGES


def test_the_hit_is_the_shortest_evidence_run():
    verdict = hit_verdict(
        [
            PoolPresence("kv", ALL, [True, True, True, False]),
            PoolPresence("indexer", ALL, [True, True, False, True]),
        ]
    )
    assert verdict.pages == 2 and verdict.restorable == (1, 2)
    assert verdict.pool_hits == {"kv": 3, "indexer": 2}


def test_resume_boundaries_are_intersected_across_pools():
    # KV holds 4 pages, Mamba checkpoints sit at 1 and 3: the legal cuts are {1, 3}, the hit 3.
    verdict = hit_verdict(
        [PoolPresence("kv", ALL, [True] * 4), PoolPresence("mamba", TRAIL, [True, False, True, False], window=1)]
    )
    assert verdict.restorable == (1, 3) and verdict.pages == 3


def test_a_hole_in_a_trailing_window_is_never_a_contiguous_prefix():
    verdict = hit_verdict(
        [PoolPresence("kv", ALL, [True] * 4), PoolPresence("mamba", TRAIL, [True, False, True, True], window=2)]
    )
    assert verdict.restorable == (1, 4) and verdict.pages == 4
    gone = hit_verdict([PoolPresence("kv", ALL, [True] * 4), PoolPresence("mamba", TRAIL, [False] * 4, window=1)])
    assert gone.pages == 0 and gone.restorable == ()


def test_a_logical_anchor_counts_only_through_physical_pools():
    verdict = hit_verdict(
        [PoolPresence("kv", ALL, (), physical=False), PoolPresence("indexer", ALL, [True, True, False])]
    )
    assert verdict.pages == 2 and "kv" not in verdict.pool_hits


def test_bare_logical_anchor_is_no_evidence():
    with pytest.raises(EvidenceError):
        hit_verdict([PoolPresence("kv", ALL, (), physical=False)])
    with pytest.raises(EvidenceError):
        hit_verdict([PoolPresence("kv", ALL, (), physical=False), PoolPresence("mamba", TRAIL, [True])])


def test_pools_answering_different_page_counts_are_refused():
    with pytest.raises(LayoutError, match="different page counts"):
        hit_verdict([PoolPresence("kv", ALL, [True]), PoolPresence("indexer", ALL, [True, True])])
