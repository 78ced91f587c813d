"""The NIXL data plane's transfer table: our handle numbers, the NIXL handles behind them, their states.

No lock and no agent: the data plane holds its one lock around every call and hands in how to
ask NIXL for a handle's state (so the table never keeps the agent alive past the plane's close).
The rules it keeps: a NIXL handle is released only once its transfer is terminal, and a prepared
list that was replaced is released only once no handle made from it is left.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvcr.adapters.nixl.agent import nixl_errors
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import TransportError

log = logging.getLogger(__name__)

STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING, "ERR": TransferState.FAILED}


@dataclass(slots=True)
class Transfer:
    xfer: Any  # NIXL xfer handle; None once released (or for an empty read)
    peer: str
    late_writes: bool
    state: TransferState
    slot: int | None = None  # scratch slot of an internal (connect) READ


class TransferTable:
    """Transfers by handle: reads the engine posted and our own connect READs (``slot`` set).

    Args:
        owner: the plane's name, for messages.
        check_state: NIXL's state of an xfer handle (``"DONE"``, ``"PROC"``, ``"ERR"``); may raise.
        on_end: told the peer of a transfer that ended or was released (after replaced lists
            were reaped), so a disconnected peer can be forgotten once its last read is over.
    """

    def __init__(self, owner: str, check_state: Callable[[Any], str], on_end: Callable[[str], None]) -> None:
        self._owner = owner
        self._check_state = check_state
        self._on_end = on_end
        self._transfers: dict[int, Transfer] = {}
        self._retired: list[Any] = []  # prepared lists replaced while transfers may use them
        self._handles = itertools.count(1)

    def __len__(self) -> int:
        return len(self._transfers)

    def add(self, xfer: Any, peer: str, late_writes: bool, status: str | TransferState, slot: int | None = None) -> int:
        """A new handle for ``xfer`` (``status``: NIXL's answer to its post, or a state)."""
        state = status if isinstance(status, TransferState) else STATES.get(status, TransferState.FAILED)
        handle = next(self._handles)
        self._transfers[handle] = Transfer(xfer, peer, late_writes, state, slot)
        return handle

    def posted(self, handle: int) -> Transfer:
        """A transfer the engine posted (TransportError for an unknown handle or an internal one)."""
        transfer = self._transfers.get(handle)
        if transfer is None or transfer.slot is not None:
            raise TransportError(f"unknown transfer handle {handle}")
        return transfer

    def internal(self, handle: int) -> Transfer:
        return self._transfers[handle]

    def pop(self, handle: int) -> Transfer:
        return self._transfers.pop(handle)

    def items(self) -> list[tuple[int, Transfer]]:
        return list(self._transfers.items())

    def __iter__(self) -> Iterator[Transfer]:
        return iter(list(self._transfers.values()))

    def clear(self) -> None:
        self._transfers.clear()

    def live_from(self, peer: str) -> bool:
        return any(t.peer == peer and not t.state.terminal for t in self._transfers.values())

    def refresh(self, transfer: Transfer) -> None:
        """Ask NIXL for a live transfer's state; one that ended frees what waited on it."""
        if transfer.xfer is None or transfer.state.terminal:
            return
        try:
            status = self._check_state(transfer.xfer)
        except Exception as exc:  # NIXL raises (rather than answering ERR) on a failed endpoint
            log.info("%s: transfer from %s failed: %s", self._owner, transfer.peer, exc)
            status = "ERR"
        state = STATES.get(status, TransferState.FAILED)
        if state is not TransferState.PENDING:
            transfer.state = state
            self.ended(transfer)

    def detach(self, transfer: Transfer) -> None:
        """Release the NIXL handle (on a live one this only stops us from watching it)."""
        xfer, transfer.xfer = transfer.xfer, None
        if xfer is not None:
            with nixl_errors(f"{self._owner}: NIXL refused to release a transfer"):
                xfer.release()

    def ended(self, transfer: Transfer) -> None:
        """A transfer ended (or was released): free what waited on it."""
        self.reap()
        self._on_end(transfer.peer)

    def retire(self, dlist: Any) -> None:
        """Release ``dlist`` (a replaced prepared list) once no handle can still use it."""
        if dlist is not None:
            self._retired.append(dlist)
        self.reap()

    def reap(self) -> None:
        """Release replaced prepared lists once no transfer handle is left that was made from them."""
        if not self._retired or any(t.xfer is not None for t in self._transfers.values()):
            return
        retired, self._retired = self._retired, []
        for dlist in retired:
            with contextlib.suppress(Exception):  # a list NIXL will not release is only memory
                dlist.release()
