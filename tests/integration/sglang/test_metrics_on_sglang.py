"""kvcr's series reach SGLang's own /metrics: SGLang's multiprocess collection, scraped and parsed.

The child stands in for a scheduler process (where the HiCache backend lives); the /metrics app is
built by SGLang's own ``add_prometheus_middleware``, exactly as its HTTP server mounts it.
"""

import os
import subprocess
import sys
from pathlib import Path

import prometheus_client  # imported before PROMETHEUS_MULTIPROC_DIR is set: this process stays single-process
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcr.testing.processes import stop_process

pytestmark = pytest.mark.multiprocess
REPO = Path(__file__).resolve().parents[3]


def samples(text):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_kvcr_series_show_on_sglangs_metrics_page(tmp_path, monkeypatch):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.sglang.metrics_child"],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "READY"
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        from sglang.srt.utils.common import add_prometheus_middleware

        app = Starlette()
        add_prometheus_middleware(app)
        reply = TestClient(app).get("/metrics")
        assert reply.status_code == 200
        got = samples(reply.text)
    finally:
        stop_process(child)
    assert prometheus_client.values.ValueClass is prometheus_client.values.MutexValue
    restored = got[("kvcr_pages_total", (("outcome", "ok"), ("path", "local_restore")))]
    backed_up = got[("kvcr_pages_total", (("outcome", "ok"), ("path", "backup")))]
    assert (restored, backed_up) == (4, 4)
    assert got[("kvcr_leases_held", (("role", "source"),))] == 2
    assert got[("kvcr_pages_total", (("outcome", "miss"), ("path", "remote_restore")))] == 0  # prefilled


def test_the_pool_label_allows_exactly_sglangs_pool_names():
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvcr.ports.metric_catalogue import POOLS

    assert {p.value for p in PoolName} == POOLS
