"""The source side of the peer protocol: answers HELLO, LEASE, RELEASE and PING.

It runs on the control channel's own thread, so an idle engine keeps serving. It never touches
bytes: a peer reads leased slots one-sidedly through the data plane. Every failure becomes a
REFUSED reply (never an exception on the server thread); a peer that fails version or auth
checks gets neither data-plane metadata nor leases.
"""

from __future__ import annotations

import logging
import uuid

from kvcr.ports.dataplane import DataPlane
from kvcr.ports.metrics import Metrics
from kvcr.runner.protocol import (
    MAX_LEASE_KEYS,
    Ack,
    Codec,
    FrameError,
    Hello,
    HelloReply,
    Lease,
    LeaseReply,
    Message,
    Ping,
    Pong,
    PoolGeometryWire,
    Refused,
    Release,
)
from kvcr.runner.runner import KvcrRunner

log = logging.getLogger(__name__)


class PeerServer:
    """Serves this runner's kvcr DRAM to peers under leases."""

    def __init__(self, runner: KvcrRunner, data_plane: DataPlane, codec: Codec, metrics: Metrics) -> None:
        self._runner = runner
        self._data_plane = data_plane
        self._codec = codec
        self._metrics = metrics
        self.incarnation = uuid.uuid4().hex
        self._pools = [
            PoolGeometryWire(
                pool=pool,
                labels=[r.label for r in regions],
                strides=[r.stride for r in regions],
                pieces=[r.piece_bytes for r in regions],
                slots=regions[0].count,
            )
            for pool, regions in runner.pool_arenas().items()
        ]

    def handle(self, frame: bytes) -> bytes:
        """Answer one request frame with one reply frame; never raises."""
        try:
            request = self._codec.decode(frame)
        except FrameError as exc:
            self._metrics.increment("kvcr_peer_refused_total", labels={"reason": _reason_label(exc.reason)})
            return self._codec.refusal(exc.reason)
        try:
            reply = self._dispatch(request)
        except Exception as exc:  # a bug must not kill the server thread; the peer sees a refusal
            log.exception("peer request %s failed", type(request).__name__)
            reply = Refused(f"internal error: {type(exc).__name__}")
        return self._codec.encode(reply)

    def _dispatch(self, request: Message) -> Message:
        runner = self._runner
        if isinstance(request, Hello):
            if request.namespace != runner.namespace:
                self._metrics.increment("kvcr_peer_refused_total", labels={"reason": "namespace"})
                return Refused(f"namespace {request.namespace} is not {runner.namespace}")
            return HelloReply(runner.namespace, self.incarnation, self._data_plane.describe(), self._pools)
        if isinstance(request, Lease):
            if len(request.keys) > MAX_LEASE_KEYS:
                return Refused(f"lease of {len(request.keys)} keys exceeds {MAX_LEASE_KEYS}")
            if request.renew_id:
                ttl = runner.renew_lease(request.renew_id, request.lease_ms / 1000)
                if not ttl:
                    return Refused("lease expired")
                return LeaseReply(request.renew_id, [], round(ttl * 1000), self.incarnation)
            grant = runner.lease(request.keys, request.lease_ms / 1000)
            checksums = runner.checksums(request.keys, grant.slots) if request.checksums else []
            return LeaseReply(grant.lease_id, list(grant.slots), round(grant.ttl_s * 1000), self.incarnation, checksums)
        if isinstance(request, Release):
            runner.release_lease(request.lease_id)
            return Ack()
        if isinstance(request, Ping):
            runner.expire_leases()
            return Pong(self.incarnation)
        return Refused(f"unexpected {type(request).__name__}")


def _reason_label(reason: str) -> str:
    if "authentication" in reason:
        return "auth"
    if "version" in reason:
        return "version"
    return "malformed"
