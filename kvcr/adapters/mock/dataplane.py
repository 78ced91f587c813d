"""A DataPlane over the in-process fabric that really copies bytes between registered regions.

It enforces what NIXL enforces (regions registered on both sides, pieces in bounds, endpoints
open) and completes transfers through the injected clock: a read posted at ``t`` completes on
the first poll at or after ``t + latency_s``, and only then are bytes copied — from the source's
memory as it is at that moment. Faults model the source side and are constructor arguments.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcr.adapters.mock.fabric import Faults, MockFabric
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import CopyRun, RegionDescriptor
from kvcr.ports.clock import Clock
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, RegistrationError, TransportError


@dataclass
class _Transfer:
    source: str
    runs: tuple[tuple[int, int, int], ...]  # (dst address, src address, nbytes)
    complete_at: float
    state: TransferState = TransferState.PENDING
    cancel_requested: bool = False


def _bounds(region: RegionDescriptor, offset: int, nbytes: int) -> bool:
    return offset >= 0 and nbytes > 0 and offset + nbytes <= region.span


class MockDataPlane:
    def __init__(self, fabric: MockFabric, name: str, clock: Clock, faults: Faults | None = None) -> None:
        self._fabric = fabric
        self._name = name
        self._clock = clock
        self._handles = itertools.count(1)
        self._transfers: dict[int, _Transfer] = {}
        self._peers: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        node = fabric.node(name)
        with fabric.lock:
            node.data_up = True
            node.incarnation += 1
            node.faults = faults or Faults()

    @property
    def name(self) -> str:
        return self._name

    @property
    def faults(self) -> Faults:
        """Faults of reads served by this endpoint."""
        return self._fabric.node(self._name).faults

    def set_faults(self, faults: Faults) -> None:
        """Change this endpoint's faults (they apply to reads already posted, too)."""
        with self._fabric.lock:
            self._fabric.node(self._name).faults = faults

    def register(self, regions: Sequence[RegionDescriptor]) -> None:
        self._check_open()
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            for region in regions:
                if region.label in node.regions:
                    raise RegistrationError(f"{self._name}: region {region.label!r} is already registered")
            for region in regions:
                node.regions[region.label] = region

    def deregister(self, labels: Sequence[str]) -> None:
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            for label in labels:
                node.regions.pop(label, None)

    def describe(self) -> bytes:
        self._check_open()
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            labels = sorted(node.regions)
            incarnation = node.incarnation
        return json.dumps(
            {"fabric": "mock", "name": self._name, "incarnation": incarnation, "regions": labels}
        ).encode()

    def connect(self, description: bytes) -> str:
        self._check_open()
        try:
            info = json.loads(description)
            peer = info["name"]
        except (ValueError, KeyError, TypeError) as exc:
            raise PeerUnavailable(f"unreadable peer description: {exc}") from exc
        node = self._fabric.find(peer)
        if node is None or not node.data_up:
            raise PeerUnavailable(f"peer {peer!r} is not on the fabric")
        with self._lock:
            self._peers.add(peer)
        return str(peer)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._peers.discard(peer)

    def read(self, peer: str, runs: Sequence[CopyRun]) -> int:
        self._check_open()
        with self._lock:
            if peer not in self._peers:
                raise PeerUnavailable(f"{self._name}: peer {peer!r} is not connected")
        source = self._fabric.find(peer)
        if source is None or not source.data_up or source.faults.peer_down:
            raise PeerUnavailable(f"peer {peer!r} is down")
        mine = self._fabric.node(self._name)
        resolved = []
        with self._fabric.lock:
            for run in runs:
                src = source.regions.get(run.src_label)
                dst = mine.regions.get(run.dst_label)
                if src is None:
                    raise TransportError(f"peer {peer!r} has no registered region {run.src_label!r}")
                if dst is None:
                    raise TransportError(f"{self._name} has no registered region {run.dst_label!r}")
                if not _bounds(src, run.src_offset, run.nbytes) or not _bounds(dst, run.dst_offset, run.nbytes):
                    raise TransportError(f"run {run} is out of the registered bounds")
                resolved.append((dst.base + run.dst_offset, src.base + run.src_offset, run.nbytes))
        latency = source.faults.latency_s
        handle = next(self._handles)
        with self._lock:
            self._transfers[handle] = _Transfer(peer, tuple(resolved), self._clock.now() + latency)
        return handle

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfer(handle)
            if transfer.state is TransferState.PENDING or transfer.state is TransferState.UNCERTAIN:
                self._progress(transfer)
            return transfer.state

    def cancel(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfer(handle)
            self._progress(transfer)
            if transfer.state is not TransferState.PENDING:
                return transfer.state
            source = self._fabric.find(transfer.source)
            if source is not None and source.faults.uncertain_cancel:
                transfer.state = TransferState.UNCERTAIN  # still live: a later poll may land it
                return transfer.state
            transfer.state = TransferState.CANCELLED
            return transfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            transfer = self._transfer(handle)
            if not transfer.state.terminal:
                raise KvcrError(f"transfer {handle} is {transfer.state.value}; releasing it could reuse live memory")
            del self._transfers[handle]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            live = [h for h, t in self._transfers.items() if not t.state.terminal]
            if live:
                raise KvcrError(f"{self._name}: {len(live)} transfers are not terminal; cannot close")
            self._closed = True
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            node.regions.clear()
            node.data_up = False

    # -------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"data plane {self._name!r} is closed")

    def _transfer(self, handle: int) -> _Transfer:
        transfer = self._transfers.get(handle)
        if transfer is None:
            raise TransportError(f"unknown transfer handle {handle}")
        return transfer

    def _progress(self, transfer: _Transfer) -> None:
        source = self._fabric.find(transfer.source)
        faults = source.faults if source is not None else Faults(peer_down=True)
        if faults.stall or self._clock.now() < transfer.complete_at:
            return
        if source is None or not source.data_up or faults.peer_down or faults.error:
            transfer.state = TransferState.FAILED
            return
        runs = transfer.runs
        if faults.partial_runs is not None:
            runs = runs[: faults.partial_runs]
        for dst, src, nbytes in runs:
            ctypes.memmove(dst, src, nbytes)
            if faults.corrupt:
                flipped = ctypes.string_at(dst, 1)[0] ^ 0xFF
                ctypes.memset(dst, flipped, 1)
        partial = faults.partial_runs is not None and faults.partial_runs < len(transfer.runs)
        transfer.state = TransferState.FAILED if partial else TransferState.DONE


if TYPE_CHECKING:
    from kvcr.adapters.mock.clock import FakeClock
    from kvcr.ports.dataplane import DataPlane

    _: DataPlane = MockDataPlane(MockFabric(), "a", FakeClock())
