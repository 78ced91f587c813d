"""Connect-time READs of a peer's beacon: is the peer reachable, and do its READs end inside the post?

The first READ finishes UCX's wire-up within the connect deadline and proves the peer answers
(its bytes must match the digest its description vouches for). Further READs look at the slot
right after ``transfer()`` returns: on CMA the bytes are already there; over tcp or RDMA they
arrive later. Each READ lands in one of the beacon's scratch slots, which is reused only once
that READ has ended (a READ that never ends keeps its slot; :meth:`BeaconReads.sweep` frees it
when it does).

Threading: ``read`` and ``settle`` take the data plane's lock themselves (a connect waits outside
it); ``finish`` and ``sweep`` run under it too, ``sweep`` with the lock already held by the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcr.adapters.nixl.beacon import BEACON_BYTES, SCRATCH_SLOTS, Beacon, digest
from kvcr.adapters.nixl.transfers import TransferTable
from kvcr.adapters.nixl.wire import Description
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError

SYNC_WINDOW_S = 50e-6  # a look at the slot later than this after the post proves nothing


class BeaconReads:
    """Our READs of peers' beacons, kept in the plane's transfer table as internal transfers.

    Args:
        owner: the plane's name, for messages.
        lock: the plane's one lock (every agent call is made under it).
        beacon: our beacon and scratch slots.
        table: the plane's transfer table.
        agent: the plane's NIXL agent and numpy module, asked for at each post (None once closed).
        check_open: raises once the plane is closed.
        translate: turns what NIXL raised into kvcr's transport errors.
    """

    def __init__(
        self,
        owner: str,
        lock: threading.Lock,
        beacon: Beacon,
        table: TransferTable,
        agent: Callable[[], tuple[Any, Any]],
        check_open: Callable[[], None],
        translate: Callable[[Exception, str], TransportError],
    ) -> None:
        self._owner = owner
        self._lock = lock
        self._beacon = beacon
        self._table = table
        self._agent = agent
        self._check_open = check_open
        self._translate = translate

    def read(self, peer: str, beacon: int) -> tuple[int, bytes, float]:
        """Post a READ of ``peer``'s beacon (at ``beacon``) into a free scratch slot.

        Returns its internal handle, a copy of the slot taken right after the post returned, and
        how long after the post that copy was finished.
        """
        with self._lock:
            self._check_open()
            slot = self._beacon.take_slot()
            if slot is None:
                raise PeerUnavailable(f"{self._owner}: {SCRATCH_SLOTS} connects are still waiting for their peers")
            address = self._beacon.slot_address(slot)
            agent, np = self._agent()
            xfer = None
            try:
                local = agent.get_xfer_descs(np.array([[address, BEACON_BYTES, 0]], dtype=np.uint64), "DRAM")
                remote = agent.get_xfer_descs(np.array([[beacon, BEACON_BYTES, 0]], dtype=np.uint64), "DRAM")
                xfer = agent.initialize_xfer("READ", local, remote, peer)
                status = agent.transfer(xfer)
                posted = time.perf_counter()
                seen = ctypes.string_at(address, BEACON_BYTES)
                after = time.perf_counter() - posted
            except Exception as exc:
                self._beacon.give_back(slot)
                if xfer is not None:
                    with contextlib.suppress(Exception):  # its post failed: nothing is in flight
                        xfer.release()
                raise self._translate(exc, f"first read from {peer!r}") from exc
            return self._table.add(xfer, peer, True, status, slot), seen, after

    def settle(self, handle: int, deadline: float) -> TransferState:
        """Poll an internal READ until it ends or ``deadline`` (a burst of polls, then short sleeps)."""
        spins = 0
        while True:
            with self._lock:
                transfer = self._table.internal(handle)
                self._table.refresh(transfer)
                state = transfer.state
            if state.terminal or time.monotonic() >= deadline:
                return state
            spins += 1
            if spins > 64:
                time.sleep(200e-6)

    def finish(self, handle: int, expected: bytes) -> bool:
        """End an internal READ: if it is over, free its slot and say whether the slot's digest is ``expected``.

        One that is still live keeps its handle and slot (swept once it ends) and answers False.
        """
        with self._lock:
            transfer = self._table.internal(handle)
            if not transfer.state.terminal:
                return False
            self._table.pop(handle)
            assert transfer.slot is not None
            held = transfer.state is TransferState.DONE and digest(self._beacon.slot_bytes(transfer.slot)) == expected
            self._free(transfer)
            return held

    def sweep(self) -> None:
        """Free the slots of internal READs that have ended since they were given up (lock held)."""
        for handle, transfer in self._table.items():
            if transfer.slot is not None:
                self._table.refresh(transfer)
                if transfer.state.terminal:
                    self._table.pop(handle)
                    self._free(transfer)

    def complete_in_post(self, peer: str, desc: Description, deadline: float) -> bool:
        """Whether READs from this peer land their bytes before ``transfer()`` returns (CMA).

        The slot is looked at right after the post; a look finished later than ``SYNC_WINDOW_S``
        proves nothing and is repeated. Two complete looks, and no incomplete one, are needed.
        """
        complete = 0
        for _ in range(6):
            handle, seen, after = self.read(peer, desc.beacon)
            state = self.settle(handle, deadline)
            if not self.finish(handle, desc.beacon_digest) or state is not TransferState.DONE:
                return False
            if after > SYNC_WINDOW_S:
                continue
            if digest(seen) != desc.beacon_digest:
                return False
            complete += 1
            if complete == 2:
                return True
        return False

    def _free(self, transfer: Any) -> None:
        self._beacon.give_back(transfer.slot)
        with contextlib.suppress(TransportError):  # an ended READ: releasing it frees NIXL's request
            self._table.detach(transfer)
        self._table.ended(transfer)
