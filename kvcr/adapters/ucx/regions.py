"""A UCX data plane's own regions, and how a read of a peer's lands in them.

Bookkeeping only: no lock, no UCX. The data plane holds its lock around every call (the source's
serving loop reads ``exposed`` under the same lock). Two tables, ``exposed`` (peers may read
them) and ``private`` (only our reads land there), never overlapping; the description a peer
connects with is cached until the exposed table changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvcr.adapters.ucx import wire
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.errors import RegistrationError, TransportError

Segment = tuple[int, int]
"""Where one tagged receive lands: (address, nbytes) in a destination region."""

WireRun = tuple[int, int, int, int, int, bool]
"""A run as the source sees it in a REQUEST: (src, src_first, dst, dst_first, count, split)."""


class Regions:
    """The regions of one data plane named ``name``. Not thread-safe: the caller's lock guards it."""

    __slots__ = ("_description", "_ids", "_name", "exposed", "private")

    def __init__(self, name: str) -> None:
        self._name = name
        self._ids = itertools.count(1)
        self.exposed: dict[int, RegionDescriptor] = {}
        self.private: dict[int, RegionDescriptor] = {}
        self._description: bytes | None = None

    def register(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        """Ids for ``regions``, all or none: one overlapping a known region or another is refused."""
        known = [*self.exposed.values(), *self.private.values()]
        for i, region in enumerate(regions):
            for other in [*known, *regions[:i]]:
                if region.overlaps(other):
                    raise RegistrationError(f"{self._name}: region {region.label!r} overlaps {other.label!r}")
        table = self.exposed if exposed else self.private
        ids = []
        for region in regions:
            region_id = next(self._ids)
            table[region_id] = region
            ids.append(region_id)
        if exposed:
            self._description = None
        return tuple(ids)

    def deregister(self, ids: Sequence[int]) -> None:
        for region_id in ids:
            if self.exposed.pop(region_id, None) is not None:
                self._description = None
            self.private.pop(region_id, None)

    def description(self, encode: Callable[[list[wire.RegionWire]], bytes]) -> bytes:
        """Our description, made by ``encode`` from the exposed regions' geometry when they changed."""
        if self._description is None:
            regions = [wire.RegionWire(i, r.count, r.piece_bytes, r.dense) for i, r in self.exposed.items()]
            self._description = encode(regions)
        return self._description

    def clear(self) -> None:
        self.exposed.clear()
        self.private.clear()

    def plan(
        self, peer: str, sources: dict[int, wire.RegionWire], runs: Sequence[PieceRun]
    ) -> tuple[list[Segment], list[WireRun]]:
        """Destination (address, nbytes) per segment, and the runs as the source will see them.

        ``sources``: the regions ``peer`` exposes. A run dense on both sides is one segment,
        otherwise one per piece (the source's serving loop segments the same way).
        """
        segments: list[Segment] = []
        wire_runs: list[WireRun] = []
        for run in runs:
            src = sources.get(run.src)
            if src is None:
                raise TransportError(f"run {run}: peer {peer!r} exposes no region {run.src}")
            dst = self.exposed.get(run.dst) or self.private.get(run.dst)
            if dst is None:
                raise TransportError(f"run {run}: {self._name} has no registered region {run.dst}")
            misfit = run.misfit(src, dst)
            if misfit is not None:
                raise TransportError(misfit)
            split = run.count > 1 and not (src.dense and dst.dense)
            if split:
                segments.extend((dst.address(run.dst_first + k), dst.piece_bytes) for k in range(run.count))
            else:
                segments.append((dst.address(run.dst_first), run.count * dst.piece_bytes))
            wire_runs.append((run.src, run.src_first, run.dst, run.dst_first, run.count, split))
        if len(segments) > wire.MAX_SEGMENTS:
            raise TransportError(f"a read of {len(segments)} segments is over the {wire.MAX_SEGMENTS} a read may have")
        return segments, wire_runs
