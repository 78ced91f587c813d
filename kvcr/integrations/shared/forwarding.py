"""Forwarding: the hint Dynamo's router put on a request, as SGLang's ``kv_hints``.

A Dynamo worker gets a ``PreprocessedRequest`` (a dict in Python) and calls SGLang with
``async_generate(..., kv_hints=kv_hints_from_request(request))``. SGLang keeps it on ``Req.kv_hints``
and kvcr's SGLang plugin carries it to the storage backend. Where the router puts the hint:

- ``request["kv_hint"]``: the typed ``kv.fetch@1.0`` envelope (current Dynamo);
- ``request["extra_args"]["kv_transfer_params"]["kv_hint"]``: the same envelope through the
  older engine bridge;
- ``request["extra_args"]["kv_transfer_params"]["router_hint"]``: the legacy compact hint
  ``{"source_control_endpoint", "block_hashes"}``, wrapped here into an envelope.

SGLang rejects a whole request whose ``kv_hints`` it cannot decode, so this fails closed: a hint
kvcr cannot use (see ``kvcr.domain.hints.parse_hint``) gives None (the request runs without it),
and the envelope handed on holds only well-formed actions with every field SGLang requires.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from kvcr.domain.hints import parse_hint

log = logging.getLogger(__name__)

_U64 = 1 << 64
PROTOCOL_VERSION = "0.1"


def kv_hints_from_request(request: Mapping[str, Any], *, request_id: str | None = None) -> dict[str, Any] | None:
    """The ``kv_hints`` envelope to pass to SGLang for ``request``, or None when it has no usable hint.

    Args:
        request: a Dynamo PreprocessedRequest-shaped mapping.
        request_id: used as the envelope's ``message_id`` when the hint carries none.
    """
    if not isinstance(request, Mapping):
        return None
    fallback_id = request_id or _text(request.get("request_id")) or _text(request.get("id")) or "kvcr"
    params = _kv_transfer_params(request)
    for raw in (request.get("kv_hint"), params.get("kv_hint"), params.get("router_hint")):
        hint = _decoded(raw)
        if hint is not None:
            if "actions" in hint or "protocol_version" in hint:
                return _from_envelope(hint, fallback_id)
            return _from_legacy(hint, fallback_id)
    return None


def _kv_transfer_params(request: Mapping[str, Any]) -> Mapping[str, Any]:
    extra = request.get("extra_args")
    params = extra.get("kv_transfer_params") if isinstance(extra, Mapping) else None
    return params if isinstance(params, Mapping) else {}


def _decoded(raw: object) -> Mapping[str, Any] | None:
    if isinstance(raw, bytes | bytearray):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    return raw if isinstance(raw, Mapping) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _from_envelope(envelope: Mapping[str, Any], fallback_id: str) -> dict[str, Any] | None:
    parsed = parse_hint(envelope)
    if parsed.hint is None:
        log.info("kvcr: not forwarding the request's kv_hint (%s)", parsed.reason)
        return None
    actions = []
    for index, action in enumerate(envelope.get("actions") or ()):
        if not isinstance(action, Mapping):
            continue
        kind, version, payload = action.get("action_type"), action.get("action_version"), action.get("payload", {})
        if not isinstance(kind, str) or not isinstance(version, str) or not isinstance(payload, Mapping):
            continue  # SGLang would refuse the whole envelope for it
        actions.append(
            {
                "action_id": _text(action.get("action_id")) or f"a{index + 1}",
                "action_type": kind,
                "action_version": version,
                "payload": dict(payload),
            }
        )
    return {
        "protocol_version": str(envelope.get("protocol_version")),
        "message_id": _text(envelope.get("message_id")) or fallback_id,
        "actions": actions,
    }


def _from_legacy(legacy: Mapping[str, Any], message_id: str) -> dict[str, Any] | None:
    parsed = parse_hint(legacy)
    hint = parsed.hint
    if hint is None:
        log.info("kvcr: not forwarding the request's legacy router_hint (%s)", parsed.reason)
        return None
    raw = legacy.get("block_hashes")
    ordered: dict[int, None] = {}
    for value in raw if isinstance(raw, list) else sorted(hint.block_hashes):
        ordered[value % _U64] = None  # signed (event form) and u64 name the same page; keep the router's order
    payload: dict[str, Any] = {"source_control_endpoint": str(hint.source), "block_hashes": list(ordered)}
    if hint.no_retain:
        payload["no_retain"] = True
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id,
        "actions": [{"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0", "payload": payload}],
    }
