"""Every metric kvcr emits: name, kind, help, label names and the closed set of values of each label.

This module is the single source. Adapters build their series from it and refuse anything it
does not list; code that emits names its metric with :class:`MetricName` and its label values
with the enums below (they are ``str`` enums, so they pass where the ``Metrics`` port wants
strings). Conventions are Prometheus's: base units (seconds, bytes), ``_total`` on counters,
``_seconds`` / ``_bytes`` suffixes, and labels whose values come from closed sets, never from a
key, an endpoint or any other text a peer or a request controls.

What a call looks like (``metrics`` is the ``Metrics`` port)::

    metrics.increment(MetricName.PAGES, n, {"path": Path.REMOTE_RESTORE, "outcome": Result.OK})
    metrics.increment(MetricName.BYTES, n * page_bytes, {"path": Path.REMOTE_RESTORE, "outcome": Result.OK})
    metrics.increment(MetricName.FAILURES, 1, {"path": Path.REMOTE_RESTORE, "reason": FailureReason.TIMEOUT})
    metrics.observe(MetricName.RESTORE_SECONDS, elapsed_s, {"path": Path.LOCAL_RESTORE})
    metrics.set_gauge(MetricName.DRAM_USED_BYTES, used, {"pool": "kv"})

``docs/observability.md`` lists the catalogue for operators and says which call site emits what.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvcr import __version__
from kvcr.domain.errors import KvcrError
from kvcr.domain.hints import Rejection
from kvcr.domain.transports import Transport


class Kind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class MetricName(str, enum.Enum):
    """The name of every kvcr metric, as Prometheus shows it."""

    PAGES = "kvcr_pages_total"
    BYTES = "kvcr_bytes_total"
    FAILURES = "kvcr_failures_total"
    VERIFICATION_FAILURES = "kvcr_verification_failures_total"
    HINTS_REJECTED = "kvcr_hints_rejected_total"
    PEER_REQUESTS_REFUSED = "kvcr_peer_requests_refused_total"
    EVICTED_PAGES = "kvcr_evicted_pages_total"
    LEASES_EXPIRED = "kvcr_leases_expired_total"
    PEER_RESTARTS = "kvcr_peer_restarts_total"
    METRICS_DROPPED = "kvcr_metrics_dropped_total"
    DRAM_USED_BYTES = "kvcr_dram_used_bytes"
    DRAM_FREE_BYTES = "kvcr_dram_free_bytes"
    LEASES_HELD = "kvcr_leases_held"
    PEERS_QUARANTINED = "kvcr_peers_quarantined"
    LEASE_SECONDS = "kvcr_lease_seconds"
    RESTORE_SECONDS = "kvcr_restore_seconds"
    LOOKUP_PAGES = "kvcr_lookup_pages_total"
    DRAM_CAPACITY_BYTES = "kvcr_dram_capacity_bytes"
    BUILD_INFO = "kvcr_build_info"
    HINT_HOOKS_MISSING = "kvcr_hint_hooks_missing"
    HINTED_PAGES = "kvcr_hinted_pages_total"
    UNREAD_PAGES = "kvcr_unread_pages_total"


class Path(str, enum.Enum):
    """Which way pages moved."""

    BACKUP = "backup"  # engine host pages -> kvcr DRAM
    LOCAL_RESTORE = "local_restore"  # kvcr DRAM -> engine host pages
    REMOTE_RESTORE = "remote_restore"  # a peer's kvcr DRAM -> engine host pages (data-plane READ)
    SERVED = "served"  # this replica's kvcr DRAM, leased to a peer for its READ


class Result(str, enum.Enum):
    """How a page ended on its path (``miss``: not there; nothing moved)."""

    OK = "ok"
    MISS = "miss"
    FAILED = "failed"
    UNCERTAIN = "uncertain"  # a transfer that could not be confirmed stopped
    # (served only) pages a same-host peer reports it took off the slot board: never leased, so the
    # source cannot check them; kept apart from ``ok``, which counts only what it granted
    REPORTED = "reported"


class FailureReason(str, enum.Enum):
    """Why an operation failed (one count per failed batch or peer call, not per page)."""

    PEER_UNAVAILABLE = "peer_unavailable"  # not reachable, or skipped during its retry window
    PEER_REFUSED = "peer_refused"  # HELLO or LEASE refused: credentials, version, namespace
    INCOMPATIBLE = "incompatible"  # the source's pool or geometry differs from ours
    LEASE_EXPIRED = "lease_expired"  # the lease ran out (or was released) before the read ended
    TIMEOUT = "timeout"  # the operation deadline passed
    TRANSFER_ERROR = "transfer_error"  # the data plane reported an error
    UNCERTAIN = "uncertain"  # a transfer could not be confirmed stopped
    VERIFICATION = "verification"  # bytes differ from the digest taken at backup
    COPY_ERROR = "copy_error"  # a local copy failed
    NO_SPACE = "no_space"  # no DRAM slot could be freed for a backup
    UNBOUND_REPLY = "unbound_reply"  # a reply that does not answer our request (replayed, substituted)
    NAME_IN_USE = "name_in_use"  # a source's data-plane name is held by another source's link
    MALFORMED_REPLY = "malformed_reply"  # a reply of the wrong shape
    SLOWER_THAN_RECOMPUTE = "slower_than_recompute"  # the estimated transfer exceeds recomputing the prefix
    NO_STAGING = "no_staging"  # every staging buffer is busy or quarantined
    INTERNAL = "internal"  # a bug in kvcr, caught at a boundary


class HintedOutcome(str, enum.Enum):
    """What became of a page a hint said a source holds, when it was asked of that source."""

    LEASED = "leased"
    MISSING = "missing"  # the source answered without it: the hint was stale
    UNREACHABLE = "unreachable"  # no lease at all: the source is down, refused us, or is skipped


class UnreadReason(str, enum.Enum):
    """Why pages leased from a peer at hit-query time were never read (their lease was given back)."""

    TRIMMED = "trimmed"  # the engine cut the hit (SGLang's MIN across ranks)
    PREFETCH_ENDED = "prefetch_ended"  # the engine ended the request's prefetch first
    EXPIRED = "expired"  # the lease ran out before the read


HintRejection = Rejection
"""Why a request's hint was not used (the domain's closed set; the request is served locally)."""


class RefusalReason(str, enum.Enum):
    """Why this replica's peer server refused a request (the peer protocol's codes)."""

    MALFORMED = "malformed"
    VERSION = "version"
    NAMESPACE = "namespace"
    UNKNOWN_SESSION = "unknown_session"
    TOO_LARGE = "too_large"
    CLOSING = "closing"
    INTERNAL = "internal"
    REPLAYED = "replayed"
    OUT_OF_RANGE = "out_of_range"
    # A LEASE or RELEASE named a session another connection opened (refused as unknown_session):
    FOREIGN_SESSION = "foreign_session"
    # A LEASE granted in part or not at all because its peer (connection) pins its share already:
    PEER_QUOTA = "peer_quota"
    # Refused by the control channel before any frame reached the server (CURVE, ZMTP):
    CREDENTIALS = "credentials"
    PROTOCOL = "protocol"
    HANDSHAKE = "handshake"
    FRAME = "frame"
    # (per-node identities) a request over a connection whose node the peer directory no longer lists:
    REVOKED = "revoked"
    # A connection shut down as it was accepted: its host already held its share of connections:
    CROWDED = "crowded"


class Lookup(str, enum.Enum):
    """How a page asked about in a hit query (SGLang's ``batch_exists``) ended: hit / (hit + miss) is the hit rate."""

    HIT = "hit"
    MISS = "miss"


class LeaseRole(str, enum.Enum):
    SOURCE = "source"  # leases this replica granted and still honours
    TARGET = "target"  # leases this replica took on peers and has not read or released yet


class DropReason(str, enum.Enum):
    """Why an adapter refused an emission (counted, never raised, in production)."""

    UNKNOWN_METRIC = "unknown_metric"
    WRONG_KIND = "wrong_kind"
    UNKNOWN_LABEL = "unknown_label"
    BAD_VALUE = "bad_value"


# SGLang 0.5.23's well-known host pool names (``PoolName``), the only pools kvcr registers.
POOLS = frozenset(
    {
        "kv",
        "mamba",
        "swa",
        "auxiliary_swa",
        "indexer",
        "draft",
        "draft_indexer",
        "draft_swa",
        *(
            f"deepseek_v4_{name}"
            for name in (
                "c1",
                "c1_indexer",
                "c1_indexer_scale",
                "c2",
                "c2_indexer",
                "c2_indexer_scale",
                "c4",
                "c4_indexer",
                "c4_indexer_scale",
                "c128",
                "c4_rope",
                "c128_rope",
                "c4_state",
                "c4_indexer_state",
                "c128_state",
            )
        ),
    }
)

# Restores on this box take 50 µs (a cached 64 KiB page) to seconds (a stalled peer, a deadline).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def _values(kind: type[enum.Enum], *only: enum.Enum) -> frozenset[str]:
    return frozenset(str(m.value) for m in (only or tuple(kind)))


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: what Prometheus shows (name, kind, help) and the labels it may carry."""

    name: MetricName
    kind: Kind
    help: str
    labels: tuple[tuple[str, frozenset[str]], ...] = ()
    buckets: tuple[float, ...] = ()
    # The label combinations that can happen, where fewer than every product of the closed sets
    # can (a backup is never ``uncertain``): others are refused and never shown as a 0.
    combos: frozenset[tuple[str, ...]] | None = None
    # How SGLang's multiprocess collection merges a gauge across scheduler processes (TP ranks).
    aggregate: Literal["livesum", "max"] = "livesum"

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.labels)

    def allowed(self, label: str) -> frozenset[str]:
        return dict(self.labels)[label]


_PATHS = ("path", _values(Path))
_POOL = ("pool", POOLS)


def _by_path(outcomes: Mapping[Path, tuple[Result, ...]]) -> frozenset[tuple[str, ...]]:
    return frozenset((path.value, outcome.value) for path, results in outcomes.items() for outcome in results)


_OK, _MISS, _FAILED, _UNCERTAIN, _REPORTED = Result.OK, Result.MISS, Result.FAILED, Result.UNCERTAIN, Result.REPORTED
# What each path can report: a backup or local copy either happens, is not needed/possible, or
# fails; only a peer's transfer can end unconfirmed; a source counts pages it granted, and apart
# from them the board reads its same-host peers report.
_PAGE_OUTCOMES = _by_path(
    {
        Path.BACKUP: (_OK, _MISS, _FAILED),
        Path.LOCAL_RESTORE: (_OK, _MISS, _FAILED),
        Path.REMOTE_RESTORE: (_OK, _MISS, _FAILED, _UNCERTAIN),
        Path.SERVED: (_OK, _REPORTED),
    }
)
_BYTE_OUTCOMES = frozenset(combo for combo in _PAGE_OUTCOMES if combo[1] != Result.MISS.value)

SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(
        MetricName.PAGES,
        Kind.COUNTER,
        "KV pages by data path and how they ended (a page of several pools counts once per pool).",
        (_PATHS, ("outcome", _values(Result))),
        combos=_PAGE_OUTCOMES,
    ),
    MetricSpec(
        MetricName.BYTES,
        Kind.COUNTER,
        "Bytes of the pages counted in kvcr_pages_total (a miss moves nothing).",
        (_PATHS, ("outcome", _values(Result, Result.OK, Result.FAILED, Result.UNCERTAIN, Result.REPORTED))),
        combos=_BYTE_OUTCOMES,
    ),
    MetricSpec(
        MetricName.FAILURES,
        Kind.COUNTER,
        "Failed operations by data path and reason; one per failed batch or peer call.",
        (_PATHS, ("reason", _values(FailureReason))),
    ),
    MetricSpec(
        MetricName.VERIFICATION_FAILURES,
        Kind.COUNTER,
        "Pages whose bytes differed from the digest taken at backup; they were reported as misses.",
        (("path", _values(Path, Path.LOCAL_RESTORE, Path.REMOTE_RESTORE)),),
    ),
    MetricSpec(
        MetricName.HINTS_REJECTED,
        Kind.COUNTER,
        "Request hints not used, by reason; the request was served from local DRAM only.",
        (("reason", _values(HintRejection)),),
    ),
    MetricSpec(
        MetricName.HINTED_PAGES,
        Kind.COUNTER,
        "Pages a hint said a source holds, once per time they were asked of it, by what the source answered.",
        (("outcome", _values(HintedOutcome)),),
    ),
    MetricSpec(
        MetricName.UNREAD_PAGES,
        Kind.COUNTER,
        "Pages leased from a peer at hit-query time and never read, by why; the engine recomputed them.",
        (("reason", _values(UnreadReason)),),
    ),
    MetricSpec(
        MetricName.PEER_REQUESTS_REFUSED,
        Kind.COUNTER,
        "Peer requests this replica's peer server refused, by reason.",
        (("reason", _values(RefusalReason)),),
    ),
    MetricSpec(MetricName.EVICTED_PAGES, Kind.COUNTER, "Pages evicted from kvcr DRAM to make room.", (_POOL,)),
    MetricSpec(MetricName.LEASES_EXPIRED, Kind.COUNTER, "Leases this replica granted that expired unreleased."),
    MetricSpec(MetricName.PEER_RESTARTS, Kind.COUNTER, "Times a peer answered with a new incarnation (it restarted)."),
    MetricSpec(
        MetricName.METRICS_DROPPED,
        Kind.COUNTER,
        "Metric emissions kvcr dropped because the catalogue does not allow them (a kvcr bug).",
        (("reason", _values(DropReason)),),
    ),
    MetricSpec(MetricName.DRAM_USED_BYTES, Kind.GAUGE, "kvcr DRAM holding pages (ready or filling).", (_POOL,)),
    MetricSpec(MetricName.DRAM_FREE_BYTES, Kind.GAUGE, "kvcr DRAM free for new pages.", (_POOL,)),
    MetricSpec(MetricName.LEASES_HELD, Kind.GAUGE, "Leases held now, by role.", (("role", _values(LeaseRole)),)),
    MetricSpec(MetricName.PEERS_QUARANTINED, Kind.GAUGE, "Peers this replica will not read from right now."),
    MetricSpec(
        MetricName.LEASE_SECONDS,
        Kind.HISTOGRAM,
        "LEASE round trip as the target sees it, by outcome (ok: some pages leased; miss: none).",
        (("outcome", _values(Result, Result.OK, Result.MISS, Result.FAILED)),),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        MetricName.RESTORE_SECONDS,
        Kind.HISTOGRAM,
        "One restore batch, from the call to its terminal state.",
        (("path", _values(Path, Path.LOCAL_RESTORE, Path.REMOTE_RESTORE)),),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        MetricName.LOOKUP_PAGES,
        Kind.COUNTER,
        "Pages the engine asked about in hit queries: hit (kvcr will restore it) or miss (recomputed).",
        (("result", _values(Lookup)),),
    ),
    MetricSpec(
        MetricName.DRAM_CAPACITY_BYTES,
        Kind.GAUGE,
        "kvcr DRAM allotted to a pool (used + free).",
        (_POOL,),
    ),
    MetricSpec(
        MetricName.BUILD_INFO,
        Kind.GAUGE,
        "Always 1: the kvcr version and the data plane this process runs.",
        (("version", frozenset({__version__})), ("transport", _values(Transport))),
        aggregate="max",
    ),
    MetricSpec(
        MetricName.HINT_HOOKS_MISSING,
        Kind.GAUGE,
        "SGLang methods kvcr's plugin wraps that were missing or changed at load; over 0, hints or KV events are off.",
        aggregate="max",
    ),
)

CATALOGUE: Mapping[str, MetricSpec] = {str(spec.name.value): spec for spec in SPECS}


class MetricError(KvcrError, ValueError):
    """An emission the catalogue does not allow; raised only by adapters in strict (test) mode."""

    def __init__(self, reason: DropReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check(name: str, kind: Kind, labels: Mapping[str, str] | None) -> tuple[MetricSpec, dict[str, str]]:
    """The spec of ``name`` and its labels as plain strings, or MetricError saying what is wrong.

    Label values are never echoed in the message: they may be the very text that should not
    have reached a label.
    """
    spec = CATALOGUE.get(str(name.value) if isinstance(name, MetricName) else str(name))
    if spec is None:
        raise MetricError(DropReason.UNKNOWN_METRIC, f"metric {name!s} is not in kvcr's catalogue")
    if spec.kind is not kind:
        raise MetricError(DropReason.WRONG_KIND, f"metric {spec.name.value} is a {spec.kind.value}, not a {kind.value}")
    given = {str(k): (v.value if isinstance(v, enum.Enum) else v) for k, v in (labels or {}).items()}
    if set(given) != set(spec.label_names):
        raise MetricError(
            DropReason.UNKNOWN_LABEL,
            f"metric {spec.name.value} takes labels {sorted(spec.label_names)}, got {sorted(given)}",
        )
    for label, allowed in spec.labels:
        if given[label] not in allowed:
            raise MetricError(
                DropReason.BAD_VALUE, f"metric {spec.name.value}: a value of label {label!r} is not in its closed set"
            )
    if spec.combos is not None and tuple(given[label] for label in spec.label_names) not in spec.combos:
        raise MetricError(DropReason.BAD_VALUE, f"metric {spec.name.value}: a label combination that cannot happen")
    return spec, given


def series(name: str, labels: Mapping[str, str] | None) -> str:
    """``name{k=v,...}`` with labels sorted: the key of one series in a snapshot."""
    if not labels:
        return name
    inner = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"
