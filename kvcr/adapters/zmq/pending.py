"""A cap on connections accepted but not yet through their handshake.

libzmq accepts every TCP connection and keeps it, with its descriptor, until the handshake
succeeds, fails or outlives ``ZMQ_HANDSHAKE_IVL``; it has no cap of its own. Anyone who reaches
the port can hold that many descriptors without a token. The server's monitor reports each
connection's descriptor as it is accepted and as its handshake ends or it closes; this table
keeps the ones in between, oldest first, and past ``cap`` the oldest are cut (shut down, so
libzmq sees the peer gone and closes the connection itself). An honest handshake ends in
milliseconds, so the ones still waiting when the cap is reached are the oldest half-open ones.

Not thread-safe: the server thread alone calls it, in the order the monitor reports events.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import OrderedDict
from collections.abc import Callable


def shut_down(fd: int) -> None:
    """End the TCP connection behind ``fd`` without closing ``fd`` (libzmq owns it and closes it)."""
    with contextlib.suppress(OSError):  # already gone: nothing to cut
        dup = socket.socket(fileno=os.dup(fd))
        try:
            dup.shutdown(socket.SHUT_RDWR)
        finally:
            dup.close()


class PendingHandshakes:
    """Descriptors of accepted connections whose handshake has not ended, oldest first.

    Args:
        cap: most connections waiting at once; a positive integer.
        cut: ends one connection by descriptor (:func:`shut_down`; tests pass their own).
    """

    def __init__(self, cap: int, cut: Callable[[int], None] = shut_down) -> None:
        if cap < 1:
            raise ValueError(f"the cap on pending handshakes must be positive, got {cap}")
        self.cap = cap
        self._cut = cut
        self._waiting: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._waiting)

    def accepted(self, fd: int) -> None:
        self._waiting.pop(fd, None)  # a number seen again was reused after its close
        self._waiting[fd] = None

    def ended(self, fd: int) -> None:
        """Its handshake succeeded or failed, or the connection closed."""
        self._waiting.pop(fd, None)

    def enforce(self) -> int:
        """Cut the oldest waiting connections past the cap; returns how many were cut."""
        cut = 0
        while len(self._waiting) > self.cap:
            fd, _ = self._waiting.popitem(last=False)
            self._cut(fd)
            cut += 1
        return cut
