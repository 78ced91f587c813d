"""Router hints for ``python -m dynamo.sglang``: the router's ``kv_hint`` as SGLang's ``kv_hints``.

Dynamo 1.6.1's SGLang worker (``dynamo.sglang.request_handlers.DecodeWorkerHandler``) receives
the request the KV router booked, ``kv_hint`` included, and calls
``engine.async_generate(...)`` without passing it on, so SGLang (which accepts ``kv_hints`` on a
generate request since 0.5.23) never sees it. ``forward_kv_hints(handler)`` closes that gap on a
constructed handler:

- its ``generate`` makes the request's hint (``forwarding.kv_hints_from_request``: an envelope
  SGLang can decode, or None) current for the request's task;
- its engine's ``async_generate`` adds ``kv_hints=`` from there. It is replaced on the engine
  object itself (the handler and Dynamo's helpers keep seeing the real ``sgl.Engine``) and keeps
  the real method's signature, which Dynamo inspects to decide which optional arguments to pass.

Covers the ``async_generate`` paths of the aggregated worker and of both disaggregated legs (a
prefill worker's ``DisaggPreprocessedRequest`` carries the hint on its inner ``request``); the
native-payload path (``native_generate_stream``) is left as it is. kvcr's SGLang plugin installs
this on every handler ``python -m dynamo.sglang`` constructs (``dynamo_sglang``). The worker must also publish the
hint capability (``capability.publish_hint_capability`` on its ``ModelRuntimeConfig``) for the
router to send hints at all; SGLang's storage backend then needs ``enable_remote_hint``.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from kvcr.integrations.shared.forwarding import kv_hints_from_request

_REQUEST_HINTS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "kvcr_request_kv_hints", default=None
)
_INSTALLED = "_kvcr_forwards_kv_hints"


def forward_kv_hints(handler: Any) -> Any:
    """Make a Dynamo SGLang handler pass each request's router hint to SGLang (idempotent)."""
    if getattr(handler, _INSTALLED, False):
        return handler
    engine = handler.engine
    engine.async_generate = _with_request_hint(engine.async_generate)
    generate: Callable[[Mapping[str, Any], Any], AsyncIterator[Any]] = handler.generate

    @functools.wraps(generate)
    async def generate_with_hint(request: Mapping[str, Any], context: Any) -> AsyncIterator[Any]:
        previous = _REQUEST_HINTS.get()
        _REQUEST_HINTS.set(_request_hints(request, str(context.id())))
        try:
            async for output in generate(request, context):
                yield output
        finally:
            # set, not reset: a generator may be closed from another context than it ran in
            _REQUEST_HINTS.set(previous)

    handler.generate = generate_with_hint
    setattr(handler, _INSTALLED, True)
    return handler


def _request_hints(request: Mapping[str, Any], request_id: str) -> dict[str, Any] | None:
    hints = kv_hints_from_request(request, request_id=request_id)
    inner = request.get("request") if isinstance(request, Mapping) else None
    if hints is None and isinstance(inner, Mapping):  # the prefill leg's DisaggPreprocessedRequest
        hints = kv_hints_from_request(inner, request_id=request_id)
    return hints


def _with_request_hint(async_generate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(async_generate)
    async def async_generate_with_hint(*args: Any, **kwargs: Any) -> Any:
        hints = _REQUEST_HINTS.get()
        if hints is not None and kwargs.get("kv_hints") is None:
            kwargs["kv_hints"] = hints
        return await async_generate(*args, **kwargs)

    return async_generate_with_hint
