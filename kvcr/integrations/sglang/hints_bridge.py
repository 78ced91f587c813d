"""Carry a request's ``kv_hints`` from SGLang's scheduler to the storage backend.

SGLang 0.5.23 keeps ``Req.kv_hints`` but never hands it to storage. The plugin (``plugin.py``)
records each request's hint when the scheduler starts its storage prefetch, keyed by request id,
and makes it the *current hint* of the prefetch thread while the cache controller runs that
request's hit query and prefetch reads. The backend reads ``extra_info.extra_info["kv_hints"]``
first (what newer SGLang passes) and falls back to the current hint.

This module imports nothing from SGLang, so the backend can use it without the plugin loaded.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

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
    """Make ``request_id``'s hint the current one on this thread for the duration."""
    previous = getattr(_current, "hints", None)
    _current.hints = lookup(request_id)
    try:
        yield
    finally:
        _current.hints = previous


def current() -> Any:
    """The hint of the request this thread is serving, or None."""
    return getattr(_current, "hints", None)
