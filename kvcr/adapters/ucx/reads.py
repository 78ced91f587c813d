"""A target's reads: the receives each one posted, and how they settle into an outcome.

Bookkeeping over UCX requests: no lock, no progress. The data plane holds its lock around every
call and progresses its worker before ``poll`` and ``cancel``. The rules (the data plane's module
doc tells the outcomes):

- a read posts its receives, then its reply's, and only then sends the REQUEST, so the source
  cannot answer into nothing;
- a read that fails or is cancelled cancels every receive still posted first, and ends only
  once every receive has ended: a FAILED or CANCELLED read writes nothing more;
- a receive already matched runs to its end; until it does the read is UNCERTAIN.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcr.adapters.ucx import wire
from kvcr.adapters.ucx.binding import STATUS_CANCELED, STATUS_OK, Binding
from kvcr.adapters.ucx.links import Link
from kvcr.adapters.ucx.regions import Segment, WireRun
from kvcr.domain.errors import KvcrError
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Read:
    link: Link
    receives: list[Any]
    reply: Any
    reply_buffer: bytearray
    request: Any  # the REQUEST's send, with its payload kept alive
    payload: bytearray
    reply_by: float
    state: TransferState = TransferState.PENDING
    settled: int = 0  # receives [0, settled) are known to have ended
    stopping: bool = False  # every receive still posted was cancelled
    cancelled: bool = False  # cancel() asked
    failure: str = ""


class Reads:
    """The reads of the data plane ``name`` by handle. Not thread-safe: the caller's lock guards it.

    ``nonce``: the data plane's incarnation, which its requests carry; ``reply_timeout_s``: a read
    whose source sent no reply by then fails.
    """

    __slots__ = ("_b", "_name", "_nonce", "_reply_timeout_s", "_table")

    def __init__(self, binding: Binding, name: str, nonce: int, reply_timeout_s: float) -> None:
        self._b = binding
        self._name = name
        self._nonce = nonce
        self._reply_timeout_s = reply_timeout_s
        self._table: dict[int, Read] = {}

    def __len__(self) -> int:
        return len(self._table)

    def post(self, link: Link, handle: int, segments: Sequence[Segment], wire_runs: list[WireRun], lease: int) -> None:
        """Post the receives of read ``handle`` (one per segment, then the reply's), then its REQUEST.

        A read of no segments sends nothing and is DONE at once (as a one-sided READ of nothing).

        Raises:
            PeerUnavailable: UCX refused a post and the link is dead.
            TransportError: UCX refused a post (every receive posted was cancelled first).
        """
        if not segments:
            self._table[handle] = Read(link, [], None, bytearray(), None, bytearray(), 0.0, state=TransferState.DONE)
            return
        endpoint, tag, view = link.endpoint, self._b.tag, self._b.view
        receives: list[Any] = []
        reply: Any = None
        reply_buffer = bytearray(wire.REPLY_BYTES)
        payload = bytearray(wire.ENCODER.encode(wire.Request(self._name, self._nonce, handle, lease, wire_runs)))
        try:
            for k, (address, nbytes) in enumerate(segments):
                receives.append(endpoint.tag_recv(view(address, nbytes), tag(wire.data_tag(handle, k))))
            reply = endpoint.tag_recv(self._b.array(reply_buffer), tag(wire.reply_tag(handle)))
            sent = endpoint.tag_send(self._b.array(payload), tag(wire.REQUEST))
        except Exception as exc:
            # The source has seen no request, so nothing matched: every cancel is confirmed.
            for receive in [*receives, reply]:
                if receive is not None:
                    self._b.cancel(receive)
            error = f"{self._name}: cannot post a read from {link.name!r}: {exc}"
            raise (PeerUnavailable(error) if link.dead[0] else TransportError(error)) from exc
        self._table[handle] = Read(
            link, receives, reply, reply_buffer, sent, payload, time.monotonic() + self._reply_timeout_s
        )

    def poll(self, handle: int) -> TransferState:
        read = self._get(handle)
        self._settle(read)
        return read.state

    def cancel(self, handle: int) -> TransferState:
        """Take every receive of read ``handle`` out; UNCERTAIN while a matched one still runs."""
        read = self._get(handle)
        self._settle(read)
        if read.state.terminal:
            return read.state
        read.cancelled = True
        self._stop(read)
        self._settle(read)
        if not read.state.terminal:
            read.state = TransferState.UNCERTAIN
        return read.state

    def release(self, handle: int) -> None:
        read = self._get(handle)
        if not read.state.terminal:
            raise KvcrError(f"transfer {handle} is {read.state.value}; releasing it could reuse live memory")
        del self._table[handle]

    def unfinished(self) -> int:
        """Settle every read; how many are not terminal yet (a data plane closes only at 0)."""
        for read in self._table.values():
            self._settle(read)
        return sum(not read.state.terminal for read in self._table.values())

    def stop_link(self, link: Link, why: str) -> None:
        """Fail the live reads over ``link`` (it is being dropped): UNCERTAIN while a receive still runs."""
        for read in self._table.values():
            if read.link is link and not read.state.terminal:
                self._fail(read, why)
                self._settle(read)
                if not read.state.terminal:
                    read.state = TransferState.UNCERTAIN

    def clear(self) -> None:
        self._table.clear()

    def _get(self, handle: int) -> Read:
        read = self._table.get(handle)
        if read is None:
            raise TransportError(f"unknown transfer handle {handle}")
        return read

    def _settle(self, read: Read) -> None:
        """Move ``read`` on from what its receives say."""
        if read.state.terminal:
            return
        receives = read.receives
        i = read.settled
        while i < len(receives) and receives[i].completed:
            status = receives[i].status
            if status != STATUS_OK and not read.stopping:
                gone = status == STATUS_CANCELED or read.link.dead[0]
                self._fail(read, "the peer went away" if gone else f"a piece failed (UCX status {status})")
            i += 1
        read.settled = i
        reply = read.reply
        if not read.stopping:
            if reply.completed:
                if reply.status != STATUS_OK:
                    self._fail(read, f"its reply failed (UCX status {reply.status})")
                else:
                    code, _ = wire.unpack_reply(bytes(read.reply_buffer))
                    if code != wire.SENT:
                        self._fail(read, f"the source refused: the read {wire.REASONS.get(code, f'code {code}')}")
            elif read.link.dead[0]:
                self._fail(read, "the peer went away")
            elif time.monotonic() > read.reply_by:
                self._fail(read, f"the source did not answer within {self._reply_timeout_s:.1f}s")
        if read.stopping:  # cancelled receives end at once: look again
            while i < len(receives) and receives[i].completed:
                i += 1
            read.settled = i
        if i < len(receives) or not reply.completed:
            return
        if read.failure:
            log.info("%s: read from %s failed: %s", self._name, read.link.name, read.failure)
            read.state = TransferState.FAILED
        elif read.cancelled and not all(r.status == STATUS_OK for r in receives):
            read.state = TransferState.CANCELLED
        else:
            read.state = TransferState.DONE
        read.receives = []  # every one ended: nothing refers to the destination any more

    def _fail(self, read: Read, why: str) -> None:
        read.failure = read.failure or why
        self._stop(read)

    def _stop(self, read: Read) -> None:
        """Cancel every receive of ``read`` still posted (a matched one runs on regardless)."""
        read.stopping = True
        cancel = self._b.cancel
        for receive in read.receives[read.settled :]:
            if not receive.completed:
                cancel(receive)
        if not read.reply.completed:
            cancel(read.reply)
