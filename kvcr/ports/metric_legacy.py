"""The counter names the runner emitted before the catalogue, and what each one means in it.

Transitional: the runner still calls ``increment("kvcr_restore_pages_total", ...)`` and the like.
The Prometheus adapter translates those calls into catalogue series so operators see them under
their catalogue names today; the in-memory adapter records them as given (tests read them). Once
every call site emits :class:`~kvcr.ports.metric_catalogue.MetricName` directly, delete this
module and its two uses. ``docs/observability.md`` has the same table for the call sites.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvcr.ports.metric_catalogue import FailureReason, MetricName, Path, RefusalReason, Result

Emission = tuple[MetricName, float, dict[str, str]]


def _pages(path: Path, result: Result) -> Callable[[float, Mapping[str, str]], list[Emission]]:
    return lambda value, _labels: [(MetricName.PAGES, value, {"path": path.value, "outcome": result.value})]


def _failure(path: Path, reason: FailureReason) -> Callable[[float, Mapping[str, str]], list[Emission]]:
    return lambda value, _labels: [(MetricName.FAILURES, value, {"path": path.value, "reason": reason.value})]


def _restored(value: float, labels: Mapping[str, str]) -> list[Emission]:
    path = Path.REMOTE_RESTORE if labels.get("source") == "remote" else Path.LOCAL_RESTORE
    return [(MetricName.PAGES, value, {"path": path.value, "outcome": Result.OK.value})]


def _backup_failed(value: float, _labels: Mapping[str, str]) -> list[Emission]:
    return [
        (MetricName.PAGES, value, {"path": Path.BACKUP.value, "outcome": Result.FAILED.value}),
        (MetricName.FAILURES, 1.0, {"path": Path.BACKUP.value, "reason": FailureReason.COPY_ERROR.value}),
    ]


def _refused(value: float, labels: Mapping[str, str]) -> list[Emission]:
    known = {r.value for r in RefusalReason}
    reason = labels.get("reason", "")
    return [(MetricName.PEER_REQUESTS_REFUSED, value, {"reason": reason if reason in known else "malformed"})]


def _none(_value: float, _labels: Mapping[str, str]) -> list[Emission]:
    return []  # superseded: the catalogue counts the same thing under another series


LEGACY: Mapping[str, Callable[[float, Mapping[str, str]], list[Emission]]] = {
    "kvcr_restore_pages_total": _restored,
    "kvcr_restore_misses_total": _pages(Path.LOCAL_RESTORE, Result.MISS),
    "kvcr_backup_pages_total": _pages(Path.BACKUP, Result.OK),
    "kvcr_backup_failed_pages_total": _backup_failed,
    "kvcr_lease_pages_total": _pages(Path.SERVED, Result.OK),
    "kvcr_remote_stale_pages_total": _pages(Path.REMOTE_RESTORE, Result.MISS),
    "kvcr_peer_restarts_seen_total": lambda value, _l: [(MetricName.PEER_RESTARTS, value, {})],
    "kvcr_peer_refused_total": _refused,
    "kvcr_transfers_uncertain_total": _failure(Path.REMOTE_RESTORE, FailureReason.UNCERTAIN),
    "kvcr_transfers_timed_out_total": _failure(Path.REMOTE_RESTORE, FailureReason.TIMEOUT),
    "kvcr_peer_refusals_total": _failure(Path.REMOTE_RESTORE, FailureReason.PEER_REFUSED),
    "kvcr_peer_failures_total": _failure(Path.REMOTE_RESTORE, FailureReason.PEER_UNAVAILABLE),
    "kvcr_leases_granted_total": _none,
    "kvcr_remote_leased_pages_total": _none,
    "kvcr_clear_total": _none,
}


def translate(name: str, value: float, labels: Mapping[str, str] | None) -> list[Emission] | None:
    """The catalogue emissions a pre-catalogue counter call stands for; None if ``name`` is not one."""
    rule = LEGACY.get(name)
    return None if rule is None else rule(value, labels or {})
