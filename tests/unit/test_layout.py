import pytest

from kvcr.domain.errors import LayoutError
from kvcr.domain.layout import (
    ComponentSpec,
    CopyRun,
    MemoryRef,
    RegionDescriptor,
    check_disjoint,
    coalesce,
    merge_runs,
    page_slots,
    project,
)


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


def test_project_gives_one_ref_per_component():
    regions = [region("k", 0), region("v", 10_000)]
    assert project(regions, 4) == (MemoryRef("k", 4), MemoryRef("v", 4))
    with pytest.raises(LayoutError):
        project(regions, 99)


def test_merge_runs_joins_pieces_adjacent_on_both_sides():
    pairs = [(200, 1200), (0, 1000), (100, 1100), (400, 5000), (500, 9000)]
    assert merge_runs(pairs, 100) == [(0, 1000, 300), (400, 5000, 100), (500, 9000, 100)]
    assert merge_runs([], 100) == []


def test_coalesce_merges_consecutive_slots_per_region_pair():
    src = region("src", 0)
    dst = region("dst", 50_000)
    runs = coalesce([(src, 4, dst, 2), (src, 1, dst, 0), (src, 3, dst, 1), (src, 5, dst, 3)])
    assert runs == [CopyRun("src", 100, "dst", 0, 100), CopyRun("src", 300, "dst", 100, 300)]


def test_coalesce_refuses_mismatched_piece_sizes():
    with pytest.raises(LayoutError, match="mismatch"):
        coalesce([(region("a", 0), 0, region("b", 9000, piece=50, stride=50), 0)])


def test_page_slots_requires_whole_aligned_contiguous_pages():
    assert page_slots([8, 9, 10, 11, 0, 1, 2, 3], 4) == [2, 0]
    with pytest.raises(LayoutError, match="whole number"):
        page_slots([0, 1, 2], 4)
    with pytest.raises(LayoutError, match="aligned"):
        page_slots([1, 2, 3, 4], 4)
    with pytest.raises(LayoutError, match="contiguous"):
        page_slots([0, 2, 1, 3], 4)
