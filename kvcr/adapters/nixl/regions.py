"""Our side of a NIXL agent's memory: the registered regions, their piece indices, one prepared list.

Each region is registered as one DRAM extent (``base``, ``span``), read-write: NIXL 1.5.1 has no
access flags, and a read-only mapping lets a peer's WRITE crash the source on tcp. All regions,
exposed and private, form one *prepared* list with one strided row per region, so piece ``i`` of
a region is index ``first + i`` of the list (``extents`` maps a region id to ``(first, count,
piece_bytes)``). Not thread-safe: the data plane calls it under its lock.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcr.adapters.nixl import wire
from kvcr.adapters.nixl.wire import Extent
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.errors import RegistrationError, TransportError

INIT_AGENT = "NIXL_INIT_AGENT"  # NIXL's name for "our own side" of a prepared list


@dataclass(slots=True)
class _Local:
    region: RegionDescriptor
    exposed: bool
    registration: Any


class LocalRegions:
    """The regions registered with one agent and the prepared list every read lands through.

    ``retire`` takes a prepared list that was replaced: transfers made from it may still be live,
    so only the data plane knows when it can be released.
    """

    def __init__(self, name: str, agent: Any, np: Any, retire: Callable[[Any], None]) -> None:
        self._name = name
        self._agent = agent
        self._np = np
        self._retire = retire
        self._locals: dict[int, _Local] = {}
        self._ids = itertools.count(1)
        self.extents: dict[int, Extent] = {}
        self.dlist: Any = None
        self.registrations = 0  # NIXL memory registrations held, extents of our own included

    def register_extent(self, base: int, nbytes: int) -> Any:
        registration = self._agent.register_memory([(base, nbytes, 0, "")], "DRAM")
        self.registrations += 1
        return registration

    def deregister_extent(self, registration: Any) -> None:
        self._agent.deregister_memory(registration)
        self.registrations -= 1

    def exposed(self) -> list[tuple[int, RegionDescriptor]]:
        """(id, region) of every region peers may read, in registration order."""
        return [(i, e.region) for i, e in self._locals.items() if e.exposed]

    def add(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        """Register ``regions``; all or none (RegistrationError names them)."""
        known = [entry.region for entry in self._locals.values()]
        for i, region in enumerate(regions):
            for other in [*known, *regions[:i]]:
                if region.overlaps(other):
                    raise RegistrationError(f"{self._name}: region {region.label!r} overlaps {other.label!r}")
        added: list[int] = []
        try:
            for region in regions:
                registration = self.register_extent(region.base, region.span)
                region_id = next(self._ids)
                self._locals[region_id] = _Local(region, exposed, registration)
                added.append(region_id)
            self._rebuild()
        except Exception as exc:
            for region_id in added:
                entry = self._locals.pop(region_id)
                with contextlib.suppress(Exception):  # undoing our own half-done registration
                    self.deregister_extent(entry.registration)
            with contextlib.suppress(Exception):
                self._rebuild()
            labels = [r.label for r in regions]
            raise RegistrationError(f"{self._name}: cannot register {labels}: {exc}") from exc
        return tuple(added)

    def remove(self, ids: Sequence[int]) -> bool:
        """Deregister ``ids`` (unknown ones are skipped); returns whether an exposed region went.

        Raises:
            RegistrationError: NIXL refused some deregistration (the rest were done).
        """
        failures = []
        exposed_changed = changed = False
        for region_id in ids:
            entry = self._locals.pop(region_id, None)
            if entry is None:
                continue
            changed = True
            exposed_changed |= entry.exposed
            try:
                self.deregister_extent(entry.registration)
            except Exception as exc:
                failures.append(f"{entry.region.label!r}: {exc}")
        if changed:
            self._rebuild()
        if failures:
            raise RegistrationError(f"{self._name}: deregistration failed for {', '.join(failures)}")
        return exposed_changed

    def retire_list(self) -> None:
        """At close, first: hand the prepared list to ``retire`` (its memory stays registered)."""
        self._retire(self.dlist)
        self.dlist = None

    def close(self, own: Sequence[Any] = ()) -> list[str]:
        """At close, once the prepared lists are released: deregister every region and the data
        plane's ``own`` registrations, then drop the agent (the data plane's reference must be the
        last, or NIXL never destroys the agent, its thread and its sockets); returns what failed."""
        failures: list[str] = []
        for registration in [*(e.registration for e in self._locals.values()), *own]:
            try:
                self.deregister_extent(registration)
            except Exception as exc:
                failures.append(f"deregister memory: {exc}")
        self._locals.clear()
        self.extents.clear()
        self._agent = None
        return failures

    def _rebuild(self) -> None:
        extents: dict[int, Extent] = {}
        rows: list[list[int]] = []
        first = 0
        for region_id, entry in self._locals.items():
            region = entry.region
            extents[region_id] = (first, region.count, region.piece_bytes)
            rows.append(wire.row(region))
            first += region.count
        dlist = (
            self._agent.prep_xfer_dlist(INIT_AGENT, self._np.array(rows, dtype=self._np.uint64), "DRAM")
            if rows
            else None
        )
        self._retire(self.dlist)
        self.extents, self.dlist = extents, dlist


def piece_indices(
    owner: str, peer: str, remote: Mapping[int, Extent], local: Mapping[int, Extent], runs: Sequence[PieceRun]
) -> tuple[list[int], list[int]]:
    """Indices into the peer's and our prepared lists for ``runs``, after every check.

    TransportError (nothing is posted) for a region either side lacks, piece sizes that differ, or
    a run out of its regions' bounds. The hot path of a read: region lookups only when a run's
    region differs from the last.
    """
    src_index: list[int] = []
    dst_index: list[int] = []
    add_src, add_dst = src_index.append, dst_index.append
    src_id = dst_id = -1
    s_first = s_count = d_first = d_count = 0
    for run in runs:
        if run.src != src_id or run.dst != dst_id:
            src, dst = remote.get(run.src), local.get(run.dst)
            if src is None:
                raise TransportError(f"run {run}: peer {peer!r} exposes no region {run.src}")
            if dst is None:
                raise TransportError(f"run {run}: {owner} has no registered region {run.dst}")
            if src[2] != dst[2]:
                raise TransportError(f"run {run}: piece sizes differ ({src[2]} vs {dst[2]})")
            src_id, dst_id = run.src, run.dst
            s_first, s_count, _ = src
            d_first, d_count, _ = dst
        count, src_first, dst_first = run.count, run.src_first, run.dst_first
        if count <= 0 or src_first < 0 or dst_first < 0 or src_first + count > s_count:
            raise TransportError(f"run {run} is out of the registered bounds")
        if dst_first + count > d_count:
            raise TransportError(f"run {run} is out of the registered bounds")
        if count == 1:
            add_src(s_first + src_first)
            add_dst(d_first + dst_first)
        else:
            src_index.extend(range(s_first + src_first, s_first + src_first + count))
            dst_index.extend(range(d_first + dst_first, d_first + dst_first + count))
    return src_index, dst_index
