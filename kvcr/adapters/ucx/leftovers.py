"""What a target gave up waiting for but must keep alive until UCX is done with it.

UCX may still read a send's buffer (a zero-copy HELLO or BYE), finish an endpoint's close, or
write a stale message into a scratch receive after we stopped caring; each such request is kept
here, with the buffer it uses, until it completes (or the data plane closes and cancels it).

:class:`Leftovers` is a table with no lock: the data plane holds its lock around every call,
from callers' threads (``send``, ``close_endpoint``) and from the progress thread (``keep_all``),
except ``cancel_all``, which ``close`` calls once it stopped the progress thread.
:func:`take_stale` touches no table and runs without the lock.
"""

from __future__ import annotations

import contextlib
from typing import Any

from kvcr.adapters.ucx import wire
from kvcr.adapters.ucx.binding import Binding

_DRAIN_BUDGET = 64

Kept = tuple[Any, bytearray]
"""A UCX request and the buffer it reads or writes (empty for an endpoint's close)."""


class Leftovers:
    """Requests nobody waits for any more. Not thread-safe: the caller's lock guards it."""

    __slots__ = ("_b", "_kept")

    def __init__(self, binding: Binding) -> None:
        self._b = binding
        self._kept: list[Kept] = []

    def keep(self, request: Any, buffer: bytearray) -> None:
        self._kept.append((request, buffer))

    def keep_all(self, found: list[Kept]) -> None:
        """Keep ``found`` and forget every request kept that has completed."""
        self._kept.extend(found)
        if self._kept:
            self._kept = [(r, keep) for r, keep in self._kept if not r.completed]

    def send(self, endpoint: Any, tag: int, payload: bytes) -> None:
        """Send ``payload`` without waiting; best effort: a send UCX refuses is dropped."""
        buffer = bytearray(payload)
        with contextlib.suppress(Exception):  # best effort: the source also notices a dead endpoint
            sent = endpoint.tag_send(self._b.array(buffer), self._b.tag(tag))
            if not sent.completed:
                self._kept.append((sent, buffer))

    def close_endpoint(self, endpoint: Any) -> None:
        """Start closing ``endpoint`` (:meth:`.Binding.close`) and keep the close."""
        with contextlib.suppress(Exception):  # failed already: nothing left to stop
            closing = self._b.close(endpoint)
            if closing is not None:
                self._kept.append((closing, bytearray()))

    def cancel_all(self) -> None:
        """Cancel every request kept (the data plane closes: nothing progresses them any more)."""
        for request, _ in self._kept:
            self._b.cancel(request)
        self._kept.clear()


def take_stale(binding: Binding, worker: Any) -> list[Kept]:
    """Receive into scratch memory the to-target messages that found no receive (they belong to
    given-up reads), a bounded number per call; the receives to keep."""
    found: list[Kept] = []
    probe_tag, kind_mask = binding.tag(wire.DATA), binding.mask(wire.TO_TARGET)
    for _ in range(_DRAIN_BUDGET):
        probe = worker.tag_probe(probe_tag, kind_mask, remove=True)
        if not probe.matched:
            break
        scratch = bytearray(max(probe.length, 1))
        found.append((worker.tag_recv_with_handle(binding.array(scratch), probe), scratch))
    return found
