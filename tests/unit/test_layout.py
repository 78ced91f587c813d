import pytest

from kvcr.domain.errors import LayoutError
from kvcr.domain.layout import ComponentSpec, PieceRun, RegionDescriptor, check_disjoint, slot_runs


def region(label, base, stride=100, count=10, piece=100):
    return RegionDescriptor(label, base, stride, count, piece)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(label="", base=0, stride=1, count=1, piece_bytes=1),
        dict(label="a", base=-1, stride=1, count=1, piece_bytes=1),
        dict(label="a", base=0, stride=1, count=1, piece_bytes=0),
        dict(label="a", base=0, stride=1, count=0, piece_bytes=1),
        dict(label="a", base=0, stride=4, count=2, piece_bytes=8),
    ],
)
def test_invalid_regions_are_rejected(kwargs):
    with pytest.raises(LayoutError):
        RegionDescriptor(**kwargs)


def test_zero_sized_component_is_rejected():
    with pytest.raises(LayoutError, match="piece_bytes"):
        ComponentSpec("k", 0)


def test_overlap_detection():
    a = region("a", 0)
    assert not a.overlaps(region("b", 1000))
    assert a.overlaps(region("b", 950))
    # Interleaved pieces with one period: K at 0, V at 50 of every 100 bytes.
    k = RegionDescriptor("k", 0, 100, 10, 50)
    v = RegionDescriptor("v", 50, 100, 10, 50)
    assert not k.overlaps(v) and not v.overlaps(k)
    assert k.overlaps(RegionDescriptor("w", 40, 100, 10, 50))
    assert RegionDescriptor("w", 60, 100, 10, 50).overlaps(k)


def test_check_disjoint_names_the_overlapping_pair_and_duplicate_labels():
    with pytest.raises(LayoutError, match="'a' and 'b' overlap"):
        check_disjoint([region("a", 0), region("b", 500)])
    with pytest.raises(LayoutError, match="registered twice"):
        check_disjoint([region("a", 0), region("a", 5000)])
    check_disjoint([region("a", 0), region("b", 1000), region("c", 2000)])


def test_offsets_are_bounds_checked():
    r = region("a", 4096)
    assert r.address(3) == 4096 + 300
    with pytest.raises(LayoutError, match="outside"):
        r.offset(10)


def test_slot_runs_join_pairs_adjacent_on_both_sides_in_destination_order():
    pairs = [(12, 2), (10, 0), (11, 1), (40, 4), (90, 5), (91, 6)]
    assert slot_runs(pairs) == [(10, 0, 3), (40, 4, 1), (90, 5, 2)]
    assert slot_runs([]) == []


def test_slot_runs_do_not_join_pairs_adjacent_on_one_side_only():
    assert slot_runs([(1, 0), (5, 1), (6, 3)]) == [(1, 0, 1), (5, 1, 1), (6, 3, 1)]


def test_slot_runs_never_merge_a_repeated_slot():
    assert slot_runs([(0, 0), (0, 0), (2, 2)]) == [(0, 0, 1), (0, 0, 1), (2, 2, 1)]
    assert slot_runs([(5, 0), (6, 1), (7, 2)]) == [(5, 0, 3)]


def test_slot_runs_never_join_a_source_that_runs_backwards():
    assert slot_runs([(5, 0), (4, 1)]) == [(5, 0, 1), (4, 1, 1)]
    assert slot_runs([(9, 2), (8, 3), (7, 4)]) == [(9, 2, 1), (8, 3, 1), (7, 4, 1)]


def test_a_piece_run_says_why_it_does_not_fit_its_regions():
    src = RegionDescriptor("src", 0x1000, 64, 4, 64)
    dst = RegionDescriptor("dst", 0x9000, 64, 8, 64)
    assert PieceRun(0, 0, 1, 4, 4).misfit(src, dst) is None  # exactly up to both ends
    assert PieceRun(0, 0, 1, 0, 4).misfit(src, dst) is None  # from both starts
    assert PieceRun(0, 1, 1, 0, 4).misfit(src, dst) == f"run {PieceRun(0, 1, 1, 0, 4)} is out of the registered bounds"
    assert PieceRun(0, 0, 1, 5, 4).misfit(src, dst) is not None  # past the destination's end
    for bad in (PieceRun(0, 0, 1, 0, 0), PieceRun(0, -1, 1, 0, 1), PieceRun(0, 0, 1, -1, 1)):
        assert bad.misfit(src, dst) == f"run {bad} is out of the registered bounds"
    wide = RegionDescriptor("wide", 0x20000, 128, 8, 128)
    assert PieceRun(0, 0, 1, 0, 1).misfit(src, wide) == f"run {PieceRun(0, 0, 1, 0, 1)}: piece sizes differ (64 vs 128)"


def test_an_overlap_after_a_disjoint_first_region_is_still_found():
    first = RegionDescriptor("a", 0, 10, 1, 10)
    second = RegionDescriptor("b", 20, 10, 1, 10)
    third = RegionDescriptor("c", 25, 10, 1, 10)
    with pytest.raises(LayoutError, match="'b' and 'c' overlap"):
        check_disjoint([first, second, third])
