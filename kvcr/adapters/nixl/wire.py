"""What a NIXL data plane tells its peers: the description format, versioned, and its checks.

A description carries NIXL *partial* metadata (only the exposed regions and the beacon, with
the connection info), the exposed region table by id, the beacon's address and digest, and who
the sender is: name, a random incarnation, and the host identity CMA depends on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import RegionDescriptor
from kvcr.ports.errors import PeerUnavailable

DESCRIPTION_VERSION = 2

# A region as the hot path needs it: (index of piece 0 in its prepared list, count, piece bytes).
Extent = tuple[int, int, int]


class RegionWire(msgspec.Struct, array_like=True, frozen=True):
    id: int
    base: int
    stride: int
    count: int
    piece_bytes: int


class Description(msgspec.Struct, frozen=True):
    version: int
    name: str
    incarnation: bytes
    host: str
    metadata: bytes  # NIXL partial metadata: the exposed regions and the beacon, with connection info
    regions: list[RegionWire]
    beacon: int
    beacon_digest: bytes


def encode(description: Description) -> bytes:
    return msgspec.msgpack.encode(description)


def decode(blob: bytes) -> tuple[Description, dict[int, Extent], list[list[int]]]:
    """The description, its regions indexed one after the other, and their prepared-list rows.

    Raises:
        PeerUnavailable: unreadable, another version, no name, or an unusable region table.
    """
    try:
        desc = msgspec.msgpack.decode(blob, type=Description)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise PeerUnavailable(f"unreadable peer description: {exc}") from exc
    if desc.version != DESCRIPTION_VERSION:
        raise PeerUnavailable(f"peer description version {desc.version}, expected {DESCRIPTION_VERSION}")
    if not desc.name:
        raise PeerUnavailable("peer description has no name")
    extents: dict[int, Extent] = {}
    rows: list[list[int]] = []
    first = 0
    for wire in desc.regions:
        try:
            region = RegionDescriptor(str(wire.id), wire.base, wire.stride, wire.count, wire.piece_bytes)
        except KvcrError as exc:
            raise PeerUnavailable(f"peer {desc.name!r} describes an unusable region: {exc}") from exc
        if wire.id in extents:
            raise PeerUnavailable(f"peer {desc.name!r} describes region {wire.id} twice")
        extents[wire.id] = (first, region.count, region.piece_bytes)
        rows.append(row(region))
        first += region.count
    return desc, extents, rows


@dataclass(frozen=True, slots=True)
class DescribedPeer:
    """What a bare NIXL agent needs to read a described peer: its NIXL metadata and exposed regions."""

    name: str
    metadata: bytes
    regions: dict[int, RegionDescriptor]  # by region id; each label is its id


def described_peer(blob: bytes) -> DescribedPeer:
    """A peer's description, checked as ``connect`` checks it, as a bare NIXL agent uses it.

    Raises:
        PeerUnavailable: as ``decode``.
    """
    desc, _, _ = decode(blob)
    regions = {r.id: RegionDescriptor(str(r.id), r.base, r.stride, r.count, r.piece_bytes) for r in desc.regions}
    return DescribedPeer(desc.name, desc.metadata, regions)


def row(region: RegionDescriptor) -> list[int]:
    """A region as one strided row of a prepared list: piece ``i`` is the row's element ``i``."""
    stride = region.stride if region.count > 1 else region.piece_bytes
    return [region.base, region.piece_bytes, 0, stride, region.count]


def host_identity() -> str:
    """This host and process context as CMA sees them: boot id, pid namespace, uid ("" if unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        return f"{boot_id}/{os.stat('/proc/self/ns/pid').st_ino}/{os.getuid()}"
    except OSError:
        return ""
