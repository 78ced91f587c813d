"""The metric catalogue: Prometheus naming, closed label sets, and adapters that refuse the rest."""

import re
from pathlib import Path

import pytest

from kvcr.adapters.local import InMemoryMetrics
from kvcr.ports.metric_catalogue import (
    CATALOGUE,
    SPECS,
    DropReason,
    FailureReason,
    Kind,
    MetricError,
    MetricName,
    Result,
    check,
)
from kvcr.ports.metric_catalogue import Path as PagePath

RUNNER = Path(__file__).resolve().parents[2] / "kvcr" / "runner"


def test_every_name_follows_prometheus_conventions():
    assert len(CATALOGUE) == len(SPECS) == len(MetricName)
    for spec in SPECS:
        name = spec.name.value
        assert re.fullmatch(r"kvcr_[a-z][a-z0-9_]*[a-z]", name), name
        assert name.endswith("_total") == (spec.kind is Kind.COUNTER), name
        if "bytes" in name:
            assert name.endswith(("_bytes", "_bytes_total")), name
        if spec.kind is Kind.HISTOGRAM:
            assert name.endswith("_seconds") and list(spec.buckets) == sorted(spec.buckets), name
        assert spec.help.endswith(".") and len(spec.help) < 160, name
        for label, allowed in spec.labels:
            assert re.fullmatch(r"[a-z][a-z_]*", label) and label not in {"le", "quantile"}, (name, label)
            assert allowed and len(allowed) <= 32, (name, label)
            version = (spec.name, label) == (MetricName.BUILD_INFO, "version")
            value = r"[0-9][0-9a-z.+]*" if version else r"[a-z][a-z0-9_]*"
            assert all(re.fullmatch(value, v) for v in allowed), (name, label)


def test_check_names_what_is_wrong_and_never_echoes_a_value():
    labels = {"path": PagePath.BACKUP, "outcome": Result.OK}
    spec, given = check(MetricName.PAGES, Kind.COUNTER, labels)
    assert spec.name is MetricName.PAGES and given == {"path": "backup", "outcome": "ok"}
    cases = [
        ("kvcr_pagez_total", Kind.COUNTER, labels, DropReason.UNKNOWN_METRIC),
        (MetricName.PAGES, Kind.GAUGE, labels, DropReason.WRONG_KIND),
        (MetricName.PAGES, Kind.COUNTER, {"path": "backup"}, DropReason.UNKNOWN_LABEL),
        (MetricName.PAGES, Kind.COUNTER, {**labels, "peer": "x"}, DropReason.UNKNOWN_LABEL),
        (MetricName.PAGES, Kind.COUNTER, {"path": "tcp://10.0.0.1:5555", "outcome": "ok"}, DropReason.BAD_VALUE),
        (MetricName.BYTES, Kind.COUNTER, {"path": "backup", "outcome": "miss"}, DropReason.BAD_VALUE),
        # each value is in its closed set, but a backup never ends unconfirmed, nor a served page failed
        (MetricName.PAGES, Kind.COUNTER, {"path": "backup", "outcome": "uncertain"}, DropReason.BAD_VALUE),
        (MetricName.BYTES, Kind.COUNTER, {"path": "served", "outcome": "failed"}, DropReason.BAD_VALUE),
    ]
    for name, kind, given_labels, reason in cases:
        with pytest.raises(MetricError) as caught:
            check(name, kind, given_labels)
        assert caught.value.reason is reason
        assert "10.0.0.1" not in str(caught.value)


def test_in_memory_metrics_raise_in_strict_mode_and_count_drops_otherwise():
    strict = InMemoryMetrics(strict=True)
    strict.increment(MetricName.FAILURES, 1, {"path": PagePath.REMOTE_RESTORE, "reason": FailureReason.TIMEOUT})
    strict.observe(MetricName.RESTORE_SECONDS, 0.5, {"path": PagePath.LOCAL_RESTORE})
    strict.set_gauge(MetricName.DRAM_FREE_BYTES, 4096, {"pool": "kv"})
    assert strict.snapshot() == {
        "kvcr_failures_total{path=remote_restore,reason=timeout}": 1,
        "kvcr_restore_seconds_count{path=local_restore}": 1,
        "kvcr_restore_seconds_sum{path=local_restore}": 0.5,
        "kvcr_dram_free_bytes{pool=kv}": 4096,
    }
    with pytest.raises(MetricError):
        strict.set_gauge(MetricName.DRAM_FREE_BYTES, 1, {"pool": "a-key-9f2c"})
    lenient = InMemoryMetrics(strict=False)
    lenient.increment("kvcr_made_up_total")
    lenient.observe(MetricName.PAGES, 1.0, {"path": "backup", "outcome": "ok"})
    assert lenient.snapshot() == {
        "kvcr_metrics_dropped_total{reason=unknown_metric}": 1,
        "kvcr_metrics_dropped_total{reason=wrong_kind}": 1,
    }


def test_the_prometheus_adapter_refuses_the_same_emissions():
    from prometheus_client import CollectorRegistry

    from kvcr.adapters.prometheus import PrometheusMetrics

    strict = PrometheusMetrics(CollectorRegistry(), strict=True)
    with pytest.raises(MetricError):
        strict.increment(MetricName.HINTS_REJECTED, 1, {"reason": "bad json at byte 3"})
    with pytest.raises(MetricError):
        strict.increment(MetricName.PEER_RESTARTS, -1)
    lenient = PrometheusMetrics(CollectorRegistry())
    lenient.increment(MetricName.HINTS_REJECTED, 1, {"reason": "bad json at byte 3"})
    lenient.increment(MetricName.HINTS_REJECTED, 2, {"reason": "not_json"})
    snap = lenient.snapshot()
    assert snap["kvcr_metrics_dropped_total{reason=bad_value}"] == 1
    assert snap["kvcr_hints_rejected_total{reason=not_json}"] == 2
    assert not any("byte 3" in key for key in snap)


def test_the_runner_names_metrics_only_through_the_catalogue():
    literal = []
    for source in [*RUNNER.glob("*.py"), *RUNNER.parent.joinpath("integrations").rglob("*.py")]:
        literal += re.findall(r'(?:increment|set_gauge|observe)\(\s*"([a-z_]+)"', source.read_text())
    assert not literal, f"metric names written as text instead of MetricName: {literal}"


def test_the_operator_docs_list_every_metric_and_label_value():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in docs.splitlines() if line.startswith("| `kvcr_")}
    assert set(rows) == set(CATALOGUE)
    for spec in SPECS:
        row = rows[spec.name.value]
        assert f"| {spec.kind.value} |" in row
        for label, allowed in spec.labels:
            assert f"`{label}`" in row, (spec.name, label)
            if label != "pool" and "as above" not in row:
                assert all(value in row for value in allowed), (spec.name, label)
