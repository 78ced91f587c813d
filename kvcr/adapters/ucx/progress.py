"""The progress thread of a UCX data plane: it drives the worker and runs the source's serving loop.

A two-sided source must progress for every read a peer makes of it, so something has to run
while no caller is inside the data plane. Two modes:

- ``blocking`` (default): progress until idle, arm the worker, and sleep in ``epoll`` on its
  event descriptor until UCX has something (a message, a completion) or ``interval_s`` passes.
  Idle costs nothing; a message wakes the thread at once.
- ``polling``: progress, then sleep ``interval_s`` (0 spins). Lowest latency, a core's worth of
  CPU at ``interval_s=0``.

``wake()`` interrupts the sleep (close, or work posted from another thread that the loop must see).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MODES = ("blocking", "polling")


class Pump:
    """Runs ``work()`` (progress + serve; returns whether anything happened) on its own thread."""

    def __init__(self, name: str, worker: Any, mode: str, interval_s: float, work: Callable[[], bool]) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
        self._worker = worker
        self._mode = mode
        self._interval_s = max(0.0, interval_s)
        self._stop = threading.Event()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        if mode == "blocking":
            self._epoll.register(worker.epoll_file_descriptor, select.EPOLLIN)
        self._thread = threading.Thread(
            target=_run, args=(weakref.WeakMethod(work), self), name=f"kvcr-ucx-progress-{name}", daemon=True
        )
        self.rounds = 0  # loop turns, for idle-cost checks
        self._thread.start()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # closed: the thread is gone already
            os.eventfd_write(self._wake_fd, 1)

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop the thread; False if it is still inside a round (then it ends after that round)."""
        self._stop.set()
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self._epoll.close()
        os.close(self._wake_fd)
        return True

    def _wait(self) -> None:
        if self._mode == "blocking":
            if not self._worker.arm():
                return  # events already pending: progress again
            timeout = self._interval_s if self._interval_s > 0 else None
        else:
            if self._interval_s == 0:
                return
            timeout = self._interval_s
        for fd, _ in self._epoll.poll(timeout):
            if fd == self._wake_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)


def _run(work_ref: weakref.WeakMethod[Callable[[], bool]], pump: Pump) -> None:
    """Loop until stopped or until the data plane that owns ``work`` is collected."""
    while not pump._stop.is_set():
        work = work_ref()
        if work is None:
            return
        try:
            busy = work()
        except Exception:  # a bug here must not kill progress for good: log it and go on
            log.exception("UCX progress round failed")
            busy = False
        del work
        pump.rounds += 1
        if not busy:
            pump._wait()
