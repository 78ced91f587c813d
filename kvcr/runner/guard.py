"""The runner's one lock, and the two facts about its life that the lock guards: closed, and in flight.

Every part of the runner (its copies, its lease desk, its registration) takes this lock around
index and lease-table calls, counts an operation in flight while it copies outside the lock, and
waits on ``quiet`` for in-flight operations or leases to end.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from kvcr.domain.errors import ClosedError, DeadlineExceeded
from kvcr.ports.clock import Clock


class RunnerGuard:
    def __init__(self, name: str, clock: Clock) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.quiet = threading.Condition(self.lock)  # notified when an operation or a lease ends
        self.inflight = 0
        self.closed = False
        self._clock = clock

    @contextlib.contextmanager
    def locked(self, deadline: float) -> Iterator[None]:
        """Hold the lock, or raise DeadlineExceeded if it is not free before ``deadline`` (our clock)."""
        if not self.lock.acquire(timeout=max(0.0, deadline - self._clock.now())):
            raise DeadlineExceeded("runner lock not acquired before the operation deadline")
        try:
            yield
        finally:
            self.lock.release()

    def check_open(self) -> None:
        """Raise ClosedError once the runner is closed (call with the lock held)."""
        if self.closed:
            raise ClosedError(f"runner {self.name!r} is closed")

    def finished(self) -> None:
        """One in-flight operation ended (call with the lock held)."""
        self.inflight -= 1
        self.quiet.notify_all()
