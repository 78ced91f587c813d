"""Router hints: Dynamo's ``kv.fetch@1.0`` envelope and the legacy compact shape.

Parsing fails closed: anything malformed yields no hint plus a short reason (counted by the
caller), never an exception. ``block_hashes`` are router identities of pages a source replica
holds; they are a set, not positions. The source endpoint is the replica's rank-0 control
endpoint; rank ``r`` of a target dials ``port + r``.

Accepted shapes::

    {"protocol_version": "0.1", "message_id": "...",
     "actions": [{"action_type": "kv.fetch", "action_version": "1.0",
                  "payload": {"source_control_endpoint": "tcp://host:port",
                              "block_hashes": [u64, ...], "mode": "copy", "no_retain": false}}]}
    {"source_control_endpoint": "tcp://host:port", "block_hashes": [u64, ...]}      # legacy
    {"kvcr_router_hint": {"source_control_endpoint": "host:port", "block_hashes": [...]}}

Either may arrive as a dict, a JSON string or JSON bytes. An envelope may carry several
``kv.fetch`` actions, one per holder, best first: the first decides whether the hint is usable;
each further one that reads cleanly (and names another endpoint) is a fallback holder.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvcr.domain.endpoints import WILDCARD_HOSTS, bracketed, split_host_port

MAX_BLOCK_HASHES = 1 << 20
MAX_HOLDERS = 8  # kv.fetch actions read from one envelope; further ones are ignored
_U64_MOD = 1 << 64
_I64_MIN = -(1 << 63)
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")
SUPPORTED_PROTOCOL_MAJOR = "0"
SUPPORTED_ACTION_MAJOR = "1"
LEGACY_WRAPPER_KEY = "kvcr_router_hint"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A dialable ``tcp://host:port`` control endpoint (no wildcard host, no port 0)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if self.host in WILDCARD_HOSTS or not self.host:
            raise ValueError(f"endpoint host {self.host!r} is not dialable")
        if not 0 < self.port < 65536:
            raise ValueError(f"endpoint port {self.port} is outside 1..65535")

    def __str__(self) -> str:
        return f"tcp://{bracketed(self.host)}:{self.port}"

    def offset(self, rank_offset: int) -> Endpoint:
        """The endpoint of the rank ``rank_offset`` ports above this one."""
        return Endpoint(self.host, self.port + rank_offset)

    @classmethod
    def parse(cls, text: str, *, require_scheme: bool = True) -> Endpoint:
        """Read ``tcp://host:port`` (or ``host:port`` when ``require_scheme`` is False)."""
        if not isinstance(text, str):
            raise ValueError("endpoint must be a string")
        rest = text
        if text.startswith("tcp://"):
            rest = text[len("tcp://") :]
        elif require_scheme:
            raise ValueError(f"endpoint {text!r} must start with tcp://")
        split = split_host_port(rest)
        if split is None:
            raise ValueError(
                f"endpoint {text!r} has no port" if rest.startswith("[") else f"endpoint {text!r} is not host:port"
            )
        host, port_text, in_brackets = split
        if in_brackets:
            ipaddress.IPv6Address(host)
        elif _HOST.match(host) is None:
            raise ValueError(f"endpoint {text!r} is not host:port")
        if not port_text.isdigit() or len(port_text) > 5:
            raise ValueError(f"endpoint {text!r} has no numeric port")
        return cls(host, int(port_text))


@dataclass(frozen=True, slots=True)
class Holder:
    """One replica a hint names, and the pages it is said to hold."""

    source: Endpoint
    block_hashes: frozenset[int]


@dataclass(frozen=True, slots=True)
class FetchHint:
    """A usable hint: which replica to lease from, and which pages it is said to hold.

    ``more`` are further holders (one per further ``kv.fetch`` action, in the envelope's order),
    asked for what the first one does not lease.
    """

    source: Endpoint
    block_hashes: frozenset[int]
    message_id: str | None = None
    no_retain: bool = False
    more: tuple[Holder, ...] = ()

    def covers(self, router_id: int) -> bool:
        """Whether the source is said to hold the page with this router identity."""
        return router_id in self.block_hashes

    @property
    def holders(self) -> tuple[Holder, ...]:
        """Every holder, the first source first."""
        return (Holder(self.source, self.block_hashes), *self.more)

    def keeping(self, holders: tuple[Holder, ...]) -> FetchHint | None:
        """This hint with only ``holders`` (in their order), or None when there are none."""
        if not holders:
            return None
        first, *rest = holders
        return FetchHint(first.source, first.block_hashes, self.message_id, self.no_retain, tuple(rest))


class Rejection(str, enum.Enum):
    """Why a hint was not used: a closed set, safe as a metric label (the reason text is not)."""

    NO_HINT = "no_hint"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    UNREADABLE = "unreadable"
    NOT_ENVELOPE = "not_envelope"
    PROTOCOL_VERSION = "protocol_version"
    ACTION_VERSION = "action_version"
    NO_FETCH_ACTION = "no_fetch_action"
    BAD_PAYLOAD = "bad_payload"
    BAD_ENDPOINT = "bad_endpoint"
    BAD_HASHES = "bad_hashes"
    UNSUPPORTED_MODE = "unsupported_mode"
    NOT_ALLOWED = "source_not_allowed"


@dataclass(frozen=True, slots=True)
class HintParse:
    """A parsed hint, or why there is none (``reason`` for logs, ``code`` for counters)."""

    hint: FetchHint | None
    reason: str | None = None
    code: Rejection | None = None

    @property
    def usable(self) -> bool:
        return self.hint is not None


def _refuse(code: Rejection, reason: str) -> HintParse:
    return HintParse(None, reason, code)


def _major(version: object) -> str | None:
    if not isinstance(version, str) or not version:
        return None
    major, _, _ = version.partition(".")
    return major if major.isdigit() else None


def _read_hashes(raw: object) -> frozenset[int] | str:
    if not isinstance(raw, list) or not raw:
        return "block_hashes must be a non-empty list"
    if len(raw) > MAX_BLOCK_HASHES:
        return f"block_hashes has more than {MAX_BLOCK_HASHES} entries"
    hashes = set()
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int):
            return "block_hashes must hold integers"
        if not _I64_MIN <= value < _U64_MOD:
            return "block hash outside the 64-bit range"
        hashes.add(value % _U64_MOD)  # signed int64 (KV-event form) and u64 name the same page
    return frozenset(hashes)


def _read_payload(payload: object, *, require_scheme: bool, message_id: str | None) -> HintParse:
    if not isinstance(payload, Mapping):
        return _refuse(Rejection.BAD_PAYLOAD, "payload must be an object")
    endpoint_text = payload.get("source_control_endpoint")
    if endpoint_text is None:
        return _refuse(Rejection.BAD_ENDPOINT, "no source_control_endpoint")
    try:
        source = Endpoint.parse(endpoint_text, require_scheme=require_scheme)
    except ValueError:
        return _refuse(Rejection.BAD_ENDPOINT, "bad source_control_endpoint")
    hashes = _read_hashes(payload.get("block_hashes"))
    if isinstance(hashes, str):
        return _refuse(Rejection.BAD_HASHES, hashes)
    mode = payload.get("mode", "copy")
    if mode != "copy":
        return _refuse(Rejection.UNSUPPORTED_MODE, "unsupported mode")
    no_retain = payload.get("no_retain", False)
    if not isinstance(no_retain, bool):
        return _refuse(Rejection.BAD_PAYLOAD, "no_retain must be a boolean")
    return HintParse(FetchHint(source, hashes, message_id, no_retain))


def _decode(raw: object) -> object:
    if isinstance(raw, bytes | bytearray | memoryview):
        raw = bytes(raw).decode("utf-8")
    if isinstance(raw, str):
        return json.loads(raw)
    return raw


def parse_hint(raw: object) -> HintParse:
    """Read a hint in any accepted shape; never raises."""
    if raw is None:
        return _refuse(Rejection.NO_HINT, "no hint")
    try:
        data = _decode(raw)
    except (ValueError, RecursionError):
        return _refuse(Rejection.NOT_JSON, "hint is not valid JSON")
    if not isinstance(data, Mapping):
        return _refuse(Rejection.NOT_OBJECT, "hint must be an object")
    try:
        return _parse_mapping(data)
    except (TypeError, ValueError, RecursionError) as exc:  # defensive: odd key types in user dicts
        return _refuse(Rejection.UNREADABLE, f"hint unreadable: {type(exc).__name__}")


def _parse_mapping(data: Mapping[object, object]) -> HintParse:
    if "actions" in data or "protocol_version" in data:
        return _parse_envelope(data)
    if LEGACY_WRAPPER_KEY in data:
        return _read_payload(data[LEGACY_WRAPPER_KEY], require_scheme=False, message_id=None)
    if "source_control_endpoint" in data or "block_hashes" in data:
        return _read_payload(data, require_scheme=False, message_id=None)
    return _refuse(Rejection.NOT_ENVELOPE, "not a hint envelope")


def _parse_envelope(data: Mapping[object, object]) -> HintParse:
    if _major(data.get("protocol_version")) != SUPPORTED_PROTOCOL_MAJOR:
        return _refuse(Rejection.PROTOCOL_VERSION, "unsupported protocol_version")
    message_id = data.get("message_id")
    if message_id is not None and not isinstance(message_id, str):
        return _refuse(Rejection.NOT_ENVELOPE, "message_id must be a string")
    actions = data.get("actions")
    if not isinstance(actions, list):
        return _refuse(Rejection.NOT_ENVELOPE, "actions must be a list")
    first: HintParse | None = None
    more: list[Holder] = []
    for action in actions:
        if not isinstance(action, Mapping) or action.get("action_type") != "kv.fetch":
            continue  # other actions belong to other consumers
        if first is None:
            if _major(action.get("action_version")) != SUPPORTED_ACTION_MAJOR:
                return _refuse(Rejection.ACTION_VERSION, "unsupported kv.fetch action_version")
            first = _read_payload(action.get("payload"), require_scheme=True, message_id=message_id)
            if first.hint is None:
                return first
            continue
        # A further holder: one that cannot be read is left out, the hint stands on the others.
        if len(more) >= MAX_HOLDERS - 1 or _major(action.get("action_version")) != SUPPORTED_ACTION_MAJOR:
            continue
        lead = first.hint
        extra = _read_payload(action.get("payload"), require_scheme=True, message_id=None).hint
        if lead is None or extra is None or extra.no_retain != lead.no_retain:
            continue
        if extra.source not in {lead.source, *(h.source for h in more)}:
            more.append(Holder(extra.source, extra.block_hashes))
    if first is None or first.hint is None:
        return _refuse(Rejection.NO_FETCH_ACTION, "no kv.fetch action")
    return HintParse(first.hint.keeping(first.hint.holders + tuple(more)))
