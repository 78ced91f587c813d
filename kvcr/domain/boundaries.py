"""Resume boundaries: the prefix lengths (in pages) at which a restore may stop.

Each (pool, rank) yields a set of legal prefix lengths. ALL_PAGES pools give ``{0..k}`` up to
the first missing page; TRAILING_PAGES pools give every end whose trailing window is complete,
holes allowed. The restorable prefix is the largest length in the *intersection* of every set:
``{0, 4, 8} ∩ {0, 6}`` is ``{0}``, so the answer is 0, never min(8, 6).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcr.domain.errors import LayoutError


def leading_run(present: Sequence[bool]) -> int:
    """Number of leading True values."""
    for i, hit in enumerate(present):
        if not hit:
            return i
    return len(present)


def all_pages_boundaries(present: Sequence[bool]) -> frozenset[int]:
    """``{0, 1, ..., k}`` where ``k`` is the leading run of present pages."""
    return frozenset(range(leading_run(present) + 1))


def trailing_boundaries(present: Sequence[bool], window: int) -> frozenset[int]:
    """0 plus every end ``e`` whose last ``min(window, e)`` pages are all present."""
    if window <= 0:
        raise LayoutError(f"trailing window must be positive, got {window}")
    ends = {0}
    run = 0  # length of the present run ending at the current page
    for i, hit in enumerate(present):
        run = run + 1 if hit else 0
        end = i + 1
        if run >= min(window, end):
            ends.add(end)
    return frozenset(ends)


def intersect(boundary_sets: Iterable[frozenset[int]]) -> frozenset[int]:
    """Intersection of every set (0 is always legal: restoring nothing is always safe)."""
    result: frozenset[int] | None = None
    for boundaries in boundary_sets:
        result = boundaries if result is None else result & boundaries
    return (result if result is not None else frozenset()) | {0}
