"""Scrape a standalone replica's /metrics during a run and find its restores counted.

Two runner nodes in this process over real NIXL READs and real ZMQ control, each with its own
Prometheus registry and exporter on a kernel-chosen loopback port. While B keeps restoring A's
pages on a thread, the test scrapes both over HTTP and parses the text with prometheus_client's
own parser.
"""

import threading
import urllib.request

import pytest
from dependency_injector import providers
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvcr.adapters.prometheus import PrometheusMetrics, start_exporter
from kvcr.container import build_container
from kvcr.domain.keys import NamespaceSpec
from kvcr.runner.config import RunnerConfig
from kvcr.runner.node import NodeSettings
from kvcr.runner.peer_client import PoolRead
from kvcr.testing.replica import HostPool, bench_keys, bench_pool, page_pattern
from tests.support import free_port

pytestmark = [pytest.mark.nixl, pytest.mark.zmq]

PAGE = 64 * 1024


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def pages(got, path, outcome="ok"):
    return got[("kvcr_pages_total", (("outcome", outcome), ("path", path)))]


class Replica:
    def __init__(self, name, memory):
        pool = bench_pool(PAGE)
        config = RunnerConfig(
            name,
            NamespaceSpec("scrape", 64, "bfloat16", "page_first"),
            (pool,),
            dram_bytes=16 * PAGE,
            max_peer_leased_fraction=1.0,  # one peer restores 8 of 16 pages: up to the pool's lease cap
        )
        self.metrics = PrometheusMetrics(CollectorRegistry(), strict=True)
        container = build_container(config, node=NodeSettings("127.0.0.1", free_port()))
        container.metrics.override(providers.Object(self.metrics))
        self.node = container.node()
        self.host = HostPool.allocate(memory, pool, 32)
        self.node.register_host_pool("kv", self.host.regions)
        self.server = start_exporter(self.metrics.registry, 0)

    def close(self):
        self.server.close()
        self.node.close()
        self.host.free()


def test_restores_show_up_on_a_scrape_during_the_run():
    from kvcr.adapters.local import MmapHostMemory

    memory = MmapHostMemory()
    a, b = Replica("scrape-a", memory), Replica("scrape-b", memory)
    stop, errors, rounds = threading.Event(), [], []
    try:
        keys = bench_keys(8)
        for slot, key in enumerate(keys):
            a.host.write(slot, page_pattern(key, PAGE))
        assert all(a.node.runner.backup("kv", keys, list(range(8))))
        assert all(o.restored for o in a.node.runner.restore("kv", keys[:2], [20, 21]))

        def restore_forever():
            try:
                while not stop.is_set():
                    result = b.node.client.restore(a.node.endpoint, [PoolRead("kv", keys, list(range(8, 16)))])
                    assert all(o.restored for o in result["kv"])
                    rounds.append(1)
            except Exception as exc:  # surfaced by the main thread
                errors.append(exc)

        worker = threading.Thread(target=restore_forever)
        worker.start()
        try:
            for _ in range(500):
                if len(rounds) >= 2 or errors:
                    break
                stop.wait(0.01)
            first = scrape(b.server.url)
            for _ in range(500):
                if len(rounds) >= 4 or errors:
                    break
                stop.wait(0.01)
            second, source = scrape(b.server.url), scrape(a.server.url)
        finally:
            stop.set()
            worker.join(30)
        assert not errors, errors
        assert 0 < pages(first, "remote_restore") <= pages(second, "remote_restore")
        assert pages(second, "remote_restore") % 8 == 0  # whole batches of 8 pages
        assert b.host.read(8) == page_pattern(keys[0], PAGE)
        assert pages(source, "served") >= pages(second, "remote_restore")
        assert pages(source, "local_restore") == 2 and pages(source, "backup") == 8
        assert source[("kvcr_metrics_dropped_total", (("reason", "unknown_metric"),))] == 0
    finally:
        b.close()
        a.close()
        memory.close()


def test_the_exporter_names_the_setting_when_its_port_is_taken():
    from kvcr.domain.errors import ConfigError

    first = start_exporter(CollectorRegistry(), 0)
    try:
        with pytest.raises(ConfigError, match="--metrics-port"):
            start_exporter(CollectorRegistry(), first.port)
    finally:
        first.close()
