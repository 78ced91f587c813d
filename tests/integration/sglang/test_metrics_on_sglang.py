"""kvcr's series reach SGLang's own /metrics: SGLang's multiprocess collection, scraped and parsed.

The child stands in for a scheduler process (where the HiCache backend lives, built by SGLang's
storage factory with ``enable_storage_metrics``); the /metrics app is built by SGLang's own
``add_prometheus_middleware``, exactly as its HTTP server mounts it.
"""

import os
import subprocess
import sys
from pathlib import Path

import prometheus_client  # imported before PROMETHEUS_MULTIPROC_DIR is set: this process stays single-process
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvcr
from kvcr.testing.processes import stop_process
from tests.integration.sglang import sg

pytestmark = pytest.mark.multiprocess
REPO = Path(__file__).resolve().parents[3]


def samples(text):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def scrape_sglang_metrics(tmp_path, monkeypatch):
    """Run the scheduler stand-in, then scrape SGLang's own /metrics app over its multiprocess directory."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    stubs = REPO / "kvcr" / "testing" / "stubs"  # SGLang imports torchvision; CPU hosts have none
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), PYTHONPATH=f"{REPO}:{stubs}")
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
        return reply.text
    finally:
        stop_process(child)


def test_kvcr_series_from_the_backend_sglang_built_show_on_sglangs_metrics_page(tmp_path, monkeypatch):
    text = scrape_sglang_metrics(tmp_path, monkeypatch)
    assert prometheus_client.values.ValueClass is prometheus_client.values.MutexValue
    got = samples(text)
    assert got[("kvcr_pages_total", (("outcome", "ok"), ("path", "backup")))] == 4
    assert got[("kvcr_pages_total", (("outcome", "ok"), ("path", "local_restore")))] == 4
    assert got[("kvcr_pages_total", (("outcome", "miss"), ("path", "local_restore")))] == 1
    assert got[("kvcr_pages_total", (("outcome", "miss"), ("path", "remote_restore")))] == 0  # prefilled
    # the pair a dashboard divides: pages SGLang asked about, hit or missed
    assert got[("kvcr_lookup_pages_total", (("result", "hit"),))] == 3
    assert got[("kvcr_lookup_pages_total", (("result", "miss"),))] == 1
    capacity = got[("kvcr_dram_capacity_bytes", (("pool", "kv"),))]
    used = got[("kvcr_dram_used_bytes", (("pool", "kv"),))]
    assert capacity > 0 and used == 4 * sg.mha_host("page_first").get_size_per_token() * sg.P
    assert used + got[("kvcr_dram_free_bytes", (("pool", "kv"),))] == capacity
    assert got[("kvcr_build_info", (("transport", "mock"), ("version", kvcr.__version__)))] == 1


def test_sglangs_metrics_page_shows_no_created_series_and_no_impossible_label_pairs(tmp_path, monkeypatch):
    got = samples(scrape_sglang_metrics(tmp_path, monkeypatch))
    kvcr_names = {name for name, _ in got if name.startswith("kvcr_")}
    assert kvcr_names and not {n for n in kvcr_names if n.endswith("_created")}
    pairs = {dict(labels)["path"] + "/" + dict(labels)["outcome"] for name, labels in got if name == "kvcr_pages_total"}
    assert "backup/uncertain" not in pairs and "served/failed" not in pairs
    assert {"backup/ok", "remote_restore/uncertain", "served/ok"} <= pairs


def test_the_pool_label_allows_exactly_sglangs_pool_names():
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvcr.ports.metric_catalogue import POOLS

    names = {p.value for p in PoolName}
    if sg.HAS_DECODE_CP:  # SGLang 0.5.23
        assert names == POOLS
    else:  # the older releases name every pool kvcr knows except the one 0.5.23 added
        assert POOLS - names == {"auxiliary_swa"}
