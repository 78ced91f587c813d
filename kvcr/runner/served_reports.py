"""SERVED reports, batched off the restore path.

A page read from a source's slot board was never leased, so the source learns about it only from
the target's SERVED report (for its ``served`` count). Sending one frame per restore costs the
restore ~40 us on the 2-core VM (the send wakes the source's broker), a sixth of a 64 KiB x 32
restore. So restores only add their counts here; one thread sends what gathered at most once per
``interval_s`` per source, and nothing while nothing is pending (an idle client costs no CPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvcr.runner.peer_links import Link

INTERVAL_S = 0.05


class ServedReports:
    """Pending SERVED counts per link, sent by one lazily started thread. Thread-safe."""

    def __init__(self, send: Callable[[Link, list[tuple[int, int]]], None], interval_s: float = INTERVAL_S) -> None:
        self._send = send
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], tuple[Link, dict[int, int]]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, link: Link, counts: list[tuple[int, int]]) -> None:
        """``counts`` (pool id, pages) taken from ``link``'s boards: reported within ``interval_s``."""
        with self._lock:
            if self._closed:
                return
            key = (link.endpoint, link.side_session)
            entry = self._pending.get(key)
            if entry is None or entry[0] is not link:
                entry = self._pending[key] = (link, entry[1] if entry is not None else {})
            for pool_id, pages in counts:
                entry[1][pool_id] = entry[1].get(pool_id, 0) + pages
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvcr-served-reports", daemon=True)
                self._thread.start()
            wake = not self._wake.is_set()
        if wake:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._stop.wait(self._interval_s)  # gather what the next restores add
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Send everything pending now."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for link, counts in pending.values():
            self._send(link, sorted(counts.items()))

    def close(self) -> None:
        """Send what is pending and stop the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        self._wake.set()
        if thread is not None:
            thread.join(timeout=1.0)
        self.flush()
