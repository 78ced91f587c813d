"""Dynamo's production control plane: etcd discovery and the NATS event plane, for real, with kvcr workers.

The same deployment as ``test_frontend_e2e`` (Dynamo's real frontend with its KV router, two kvcr
workers), but discovery goes through an etcd server and the KV events through a NATS server the
deployment starts as children (Debian's etcd-server 3.4 and nats-server 2.9; ``scripts/install.sh``
installs them). The cases run in file order: registration, a hinted restore, an etcd outage, a
worker killed. Each prints the figure its closing note quotes.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kvcr.demo.dynamo.control_plane import missing
from kvcr.demo.dynamo.deployment import Deployment, Worker, WorkerSpec
from kvcr.demo.dynamo.tiny_model import token_id
from tests.integration.dynamo.test_frontend_e2e import (
    PREFIX_PAGES,
    QUEUE_DELAY_MS,
    TOKEN_DELAY_MS,
    keep_busy,
    prefix,
    seed_on,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.nixl, pytest.mark.timeout(300)]


def etcd_keys(url: str) -> list[str]:
    """Every key in etcd (its v3 HTTP gateway, keys only)."""
    everything = base64.b64encode(b"\0").decode()
    body = json.dumps({"key": everything, "range_end": everything, "keys_only": True}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v3/kv/range", data=body), timeout=5) as reply:
        found = json.loads(reply.read()).get("kvs", [])
    return [base64.b64decode(k["key"]).decode(errors="replace") for k in found]


def instance_keys(url: str) -> set[int]:
    """Worker instance ids of the ``generate`` endpoints registered in etcd."""
    prefix_ = "v1/instances/dynamo/kvcr/generate/"
    return {int(k[len(prefix_) :], 16) for k in etcd_keys(url) if k.startswith(prefix_)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, dict[str, Worker]]]:
    absent = missing("etcd", "nats")
    assert absent is None, f"{absent}: this test needs both (CI installs them)"
    deployment = Deployment(tmp_path_factory.mktemp("dynamo-etcd"), discovery_backend="etcd", event_plane="nats")
    try:
        deployment.start_frontend()
        workers = {
            "a": deployment.start_worker(WorkerSpec("a", token_delay_ms=TOKEN_DELAY_MS)),
            "b": deployment.start_worker(WorkerSpec("b", token_delay_ms=TOKEN_DELAY_MS, queue_delay_ms=QUEUE_DELAY_MS)),
        }
        deployment.wait_ready(workers.values())
        yield deployment, workers
    finally:
        deployment.close()


def etcd_url(d: Deployment) -> str:
    assert d.control_plane is not None
    return d.control_plane.etcd_url


def test_workers_register_in_etcd_and_nowhere_else(cluster):
    d, w = cluster
    assert instance_keys(etcd_url(d)) == {w["a"].worker_id, w["b"].worker_id}
    assert any("/topic/kv-events/" in k for k in etcd_keys(etcd_url(d)))  # the KV event sources
    assert not list(d.discovery.rglob("*"))  # no file discovery behind its back


def hinted_restore(d: Deployment, w: dict[str, Worker], n: int) -> dict[str, object]:
    """Seed prefix ``n`` on A, load A, and let the router book the next request on B (with its hint)."""
    tokens = prefix(n)
    seed_on(d, w["a"], tokens)
    busy = keep_busy(d, tokens)
    reply = d.complete([*tokens, token_id(2), token_id(3)])
    busy.join()
    record = d.record_of(reply)
    assert reply["choices"][0]["text"].strip()
    return record


def test_kv_events_over_nats_reach_the_router_and_b_reads_as_pages_on_its_hint(cluster):
    d, w = cluster
    record = hinted_restore(d, w, 11)
    assert record["worker"] == "b" and record["hint"] is True
    assert record["hint_source"] == w["a"].control_endpoint and record["hint_pages"] == PREFIX_PAGES
    assert (record["peer_pages"], record["local_pages"], record["computed_pages"]) == (PREFIX_PAGES, 0, 0)
    assert record["verified"] is True and record["mismatched_pages"] == 0


def test_an_etcd_outage_keeps_requests_served_and_hints_resume_after_it(cluster):
    d, w = cluster
    assert d.control_plane is not None
    tokens = prefix(12)
    seed_on(d, w["a"], tokens)
    d.control_plane.stop("etcd")
    stopped = time.monotonic()
    served = []
    try:
        for k in range(5):
            served.append(d.record_of(d.complete([*tokens, token_id(20 + k)])))
            time.sleep(1.0)
    finally:
        outage = time.monotonic() - stopped
        d.control_plane.restart("etcd")
    # Every request was answered while etcd was down, from the prefix's holder's kvcr or its GPU tier.
    assert len(served) == 5 and all(r["computed_pages"] == 0 for r in served), served
    assert all(w_.process.poll() is None for w_ in w.values())
    back = time.monotonic()
    d.wait_ready(w.values(), timeout_s=60)
    again = time.monotonic() - back
    print(f"etcd down {outage:.1f} s: {len(served)}/5 requests answered; routable again {again:.1f} s after")
    record = hinted_restore(d, w, 13)
    assert record["worker"] == "b" and record["hint"] is True and record["peer_pages"] == PREFIX_PAGES
    assert record["verified"] is True


def test_a_nats_outage_keeps_requests_served_and_hints_resume_after_it(cluster):
    d, w = cluster
    assert d.control_plane is not None
    tokens = prefix(8)
    seed_on(d, w["a"], tokens)
    d.control_plane.stop("nats")
    try:
        served = [d.record_of(d.complete([*tokens, token_id(40 + k)])) for k in range(3)]
    finally:
        d.control_plane.restart("nats")
    assert all(r["computed_pages"] == 0 for r in served), served  # the router's index kept what it had
    time.sleep(3)  # the publishers reconnect to NATS
    record = hinted_restore(d, w, 9)
    assert record["worker"] == "b" and record["hint"] is True and record["peer_pages"] == PREFIX_PAGES


def test_a_restarted_frontend_finds_the_workers_in_etcd_and_hints_again(cluster):
    d, w = cluster
    restarted = time.monotonic()
    d.restart_frontend()
    d.wait_ready(w.values(), timeout_s=90)
    print(f"frontend restarted: both workers routable {time.monotonic() - restarted:.1f} s later")
    record = hinted_restore(d, w, 10)
    assert record["worker"] == "b" and record["hint"] is True and record["peer_pages"] == PREFIX_PAGES
    assert record["verified"] is True


def test_a_killed_worker_leaves_etcd_and_the_router_and_is_never_hinted_again(cluster):
    d, w = cluster
    tokens = prefix(14)
    seed_on(d, w["a"], tokens)
    d.kill(w["a"])
    killed = time.monotonic()
    d.wait_gone(w["a"], timeout_s=90)
    gone = time.monotonic() - killed
    assert w["a"].worker_id not in instance_keys(etcd_url(d))  # its etcd lease expired with it
    print(f"A left the router's view {gone:.1f} s after SIGKILL (its etcd lease expiring)")
    record = d.record_of(d.complete([*tokens, token_id(30)]))
    assert record["worker"] == "b"
    assert record["hint_source"] != w["a"].control_endpoint  # the router forgot A's pages with it
    assert record["peer_pages"] == 0 and record["computed_pages"] == PREFIX_PAGES
