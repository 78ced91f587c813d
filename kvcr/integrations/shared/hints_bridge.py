"""Carry a request's ``kv_hints`` from SGLang's scheduler to the storage backend.

SGLang 0.5.23 keeps ``Req.kv_hints`` but never hands it to storage. The plugin (``plugin.py``)
records each request's hint when the scheduler starts its storage prefetch, keyed by request id,
and makes it the *current hint* of the prefetch thread while the cache controller runs that
request's hit query and prefetch reads. The backend reads ``extra_info.extra_info["kv_hints"]``
first (what newer SGLang passes) and falls back to the current hint.

The bridge also tells backends when an engine will not read what a hit query leased: the plugin
reports the hit cut by SGLang's MIN all-reduce across ranks (``prefetch_trimmed``) and the end of
a request's prefetch, done or revoked (``prefetch_finished``); every backend of the process that
registered as a listener releases those leases at once instead of when they expire.

This module imports nothing from SGLang, so the backend can use it without the plugin loaded.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol

MAX_TRACKED_REQUESTS = 8192

_by_request: OrderedDict[str, Any] = OrderedDict()
_lock = threading.Lock()
_current = threading.local()


def remember(request_id: str, hints: Any) -> None:
    """Record the hint of a request (the oldest are forgotten past MAX_TRACKED_REQUESTS)."""
    with _lock:
        _by_request[request_id] = hints
        _by_request.move_to_end(request_id)
        while len(_by_request) > MAX_TRACKED_REQUESTS:
            _by_request.popitem(last=False)


def lookup(request_id: str | None) -> Any:
    if request_id is None:
        return None
    with _lock:
        return _by_request.get(request_id)


@contextlib.contextmanager
def active(request_id: str | None) -> Iterator[None]:
    """Make ``request_id`` (and its hint) the current one on this thread for the duration."""
    previous = getattr(_current, "hints", None), getattr(_current, "request", None)
    _current.hints = lookup(request_id)
    _current.request = request_id
    try:
        yield
    finally:
        _current.hints, _current.request = previous


def current() -> Any:
    """The hint of the request this thread is serving, or None."""
    return getattr(_current, "hints", None)


def current_request() -> str | None:
    """The id of the request this thread is serving, or None."""
    request: str | None = getattr(_current, "request", None)
    return request


class PrefetchListener(Protocol):
    def on_prefetch_trimmed(self, request_id: str, keep: list[str]) -> None: ...

    def on_prefetch_finished(self, request_id: str) -> None: ...


_listeners: list[PrefetchListener] = []


def add_listener(listener: PrefetchListener) -> None:
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def listeners() -> tuple[PrefetchListener, ...]:
    """Who hears about prefetches now (a closed backend is not among them)."""
    with _lock:
        return tuple(_listeners)


def remove_listener(listener: PrefetchListener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def prefetch_trimmed(request_id: str, keep: list[str]) -> None:
    """The engine will read at most the pages ``keep`` of this request's hit."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener.on_prefetch_trimmed(request_id, keep)


def prefetch_finished(request_id: str) -> None:
    """The engine's prefetch of this request ended (read, revoked or terminated)."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener.on_prefetch_finished(request_id)
