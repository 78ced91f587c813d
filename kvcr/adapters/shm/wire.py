"""What a shm data plane tells its peers, and what it hands them over its socket.

The *description* (sent only to authenticated peers, inside the control channel's HELLO reply)
names the sender, its host identity, the abstract socket it hands memory out on, a *ticket* that
socket asks for, the digest of its beacon, and its exposed region table by id. The *grant* is the
socket's answer to a request carrying that ticket: where each exposed region lives in the
descriptors sent with it (SCM_RIGHTS). Both are versioned msgpack; every field is checked here.

A ticket names the node the description was made for (its *owner*; empty where the control
channel cannot tell nodes apart) and carries a MAC of that name under the source's random secret:
the source checks it without keeping any state, and binds the link it grants to that node. A
node's ticket is useless to any other node (the link would count as the ticket's owner's), and a
revoked owner's ticket is refused.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import msgspec

from kvcr.adapters.shm.host import HostIdentity
from kvcr.ports.errors import PeerUnavailable

VERSION = 2  # 2: a per-node ticket instead of one secret for every peer
SECRET_BYTES = 32
MAC_BYTES = 32
MAX_OWNER_BYTES = 64
MAX_TICKET_BYTES = 1 + MAX_OWNER_BYTES + MAC_BYTES
REQUEST_MAGIC = b"kvcr-shm-request/2\n"
_TICKET_CONTEXT = b"kvcr-shm-ticket/2\0"
MAX_REGIONS = 4096
MAX_FILES = 250  # SCM_RIGHTS carries at most 253 descriptors per message


class RegionWire(msgspec.Struct, array_like=True, frozen=True):
    id: int
    count: int
    piece_bytes: int
    stride: int

    @property
    def span(self) -> int:
        return self.stride * (self.count - 1) + self.piece_bytes


class Description(msgspec.Struct, frozen=True):
    version: int
    name: str
    incarnation: bytes
    boot_id: str
    net_namespace: int
    uid: int
    socket: str
    ticket: bytes
    beacon_digest: bytes
    regions: list[RegionWire]

    @property
    def host(self) -> HostIdentity:
        return HostIdentity(self.boot_id, self.net_namespace, self.uid)


class Placement(msgspec.Struct, array_like=True, frozen=True):
    """An exposed region inside the grant's descriptors: which one, and at what offset."""

    id: int
    file: int
    offset: int


class Grant(msgspec.Struct, frozen=True):
    version: int
    incarnation: bytes
    beacon: int  # index of the beacon's descriptor
    regions: list[Placement]


@dataclass(frozen=True, slots=True)
class Request:
    ticket: bytes

    def encode(self) -> bytes:
        return REQUEST_MAGIC + self.ticket


def make_ticket(secret: bytes, owner: bytes) -> bytes:
    """A ticket for ``owner`` (at most ``MAX_OWNER_BYTES``), checked by :func:`ticket_owner` with ``secret``."""
    if len(owner) > MAX_OWNER_BYTES:
        raise ValueError(f"a ticket owner is at most {MAX_OWNER_BYTES} bytes, got {len(owner)}")
    return bytes([len(owner)]) + owner + hmac.new(secret, _TICKET_CONTEXT + owner, hashlib.sha256).digest()


def ticket_owner(secret: bytes, ticket: bytes) -> bytes | None:
    """The owner a ticket was made for with ``secret``; None for a ticket ``secret`` did not make."""
    size = ticket[0] if ticket else 0
    if len(ticket) != 1 + size + MAC_BYTES or size > MAX_OWNER_BYTES:
        return None
    owner = ticket[1 : 1 + size]
    expected = hmac.new(secret, _TICKET_CONTEXT + owner, hashlib.sha256).digest()
    return owner if hmac.compare_digest(ticket[1 + size :], expected) else None


def encode(message: Description | Grant) -> bytes:
    return msgspec.msgpack.encode(message)


def decode_description(blob: bytes) -> Description:
    """A peer's description, checked field by field.

    Raises:
        PeerUnavailable: unreadable, another version, or a field out of range.
    """
    try:
        desc = msgspec.msgpack.decode(blob, type=Description)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise PeerUnavailable(f"unreadable shm peer description: {exc}") from exc
    if desc.version != VERSION:
        raise PeerUnavailable(f"shm peer description version {desc.version}, expected {VERSION}")
    problem = _description_problem(desc)
    if problem:
        raise PeerUnavailable(f"shm peer description refused: {problem}")
    return desc


def _description_problem(desc: Description) -> str | None:
    if not desc.name:
        return "no name"
    ticket = desc.ticket
    if not ticket or len(ticket) != 1 + ticket[0] + MAC_BYTES or ticket[0] > MAX_OWNER_BYTES:
        return "no usable ticket"
    if not desc.socket.startswith("\0"):
        return "no usable socket"
    if len(desc.regions) > MAX_REGIONS:
        return f"{len(desc.regions)} regions (at most {MAX_REGIONS})"
    ids = set()
    for region in desc.regions:
        if region.count <= 0 or region.piece_bytes <= 0 or (region.count > 1 and region.stride < region.piece_bytes):
            return f"region {region.id} has an unusable shape"
        ids.add(region.id)
    if len(ids) != len(desc.regions):
        return "a region id repeats"
    return None


def decode_grant(blob: bytes, files: int, incarnation: bytes) -> Grant:
    """The socket's grant, checked against the descriptors that came with it.

    Raises:
        PeerUnavailable: unreadable, another version or incarnation, or naming a missing descriptor.
    """
    try:
        grant = msgspec.msgpack.decode(blob, type=Grant)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise PeerUnavailable(f"unreadable shm grant: {exc}") from exc
    if grant.version != VERSION:
        raise PeerUnavailable(f"shm grant version {grant.version}, expected {VERSION}")
    if grant.incarnation != incarnation:
        raise PeerUnavailable("the shm grant comes from another incarnation than the description")
    if not 0 <= grant.beacon < files or any(not 0 <= p.file < files or p.offset < 0 for p in grant.regions):
        raise PeerUnavailable("the shm grant names a descriptor it did not send")
    return grant


__all__ = [
    "MAX_FILES",
    "MAX_TICKET_BYTES",
    "REQUEST_MAGIC",
    "SECRET_BYTES",
    "VERSION",
    "Description",
    "Grant",
    "Placement",
    "RegionWire",
    "Request",
    "decode_description",
    "decode_grant",
    "encode",
    "make_ticket",
    "ticket_owner",
]
