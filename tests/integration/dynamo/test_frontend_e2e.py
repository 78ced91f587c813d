"""Dynamo for real: ``python -m dynamo.frontend --router-mode kv`` and kvcr workers, requests over HTTP.

The cases run in file order on one deployment (starting it costs ~15 s): worker A (hint capable),
worker B (hint capable, requests wait 1.5 s before their storage prefetch, as in a scheduler
queue), later worker C (no capability keys). How a prefix ends up on B honestly: the prefix's
first request is pinned to A (``nvext.backend_instance_id``, which bypasses the router's selection
and so carries no hint); then A is kept busy by a long request sharing the prefix, and the router's
own cost model sends the next request for that prefix to the idle B. Whether a hint is attached,
naming whom and which pages, is the router's decision alone.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import kvcr
from kvcr.demo.dynamo.deployment import Deployment, DeploymentError, Worker, WorkerSpec
from kvcr.demo.dynamo.tiny_model import token_id
from tests.support import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.nixl, pytest.mark.timeout(240)]

PAGE = 16
PREFIX_PAGES = 4
TOKEN_DELAY_MS = 25
QUEUE_DELAY_MS = 1500
BUSY_TOKENS = 120  # 3 s of decode on A while the next request is routed


def prefix(n: int) -> list[int]:
    """A prompt prefix of PREFIX_PAGES full pages, distinct for every ``n``."""
    return [token_id(100 * n + i) for i in range(PREFIX_PAGES * PAGE)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, dict[str, Worker]]]:
    deployment = Deployment(tmp_path_factory.mktemp("dynamo-e2e"))
    try:
        deployment.start_frontend()
        workers = {
            "a": deployment.start_worker(WorkerSpec("a", token_delay_ms=TOKEN_DELAY_MS, metrics_port=free_port())),
            "b": deployment.start_worker(
                WorkerSpec("b", token_delay_ms=TOKEN_DELAY_MS, queue_delay_ms=QUEUE_DELAY_MS, metrics_port=free_port())
            ),
        }
        deployment.wait_ready(workers.values())
        yield deployment, workers
    finally:
        deployment.close()


class Background:
    """A request in a thread; its reply, or the error it ended with."""

    def __init__(self, call: Any) -> None:
        self.reply: dict[str, Any] | None = None
        self.error: Exception | None = None

        def run() -> None:
            try:
                self.reply = call()
            except DeploymentError as exc:
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self, timeout_s: float = 60.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the request did not finish"


def seed_on(d: Deployment, worker: Worker, tokens: list[int]) -> dict[str, Any]:
    """Serve ``tokens`` on ``worker`` (pinned) so its kvcr holds them; returns its report line."""
    record = d.record_of(d.complete([*tokens, token_id(1)], nvext={"backend_instance_id": worker.worker_id}))
    assert record["worker"] == worker.spec.name and record["computed_pages"] == PREFIX_PAGES
    assert record["backed_up_pages"] == PREFIX_PAGES
    time.sleep(0.3)  # the KV events reach the router's index in milliseconds
    return record


def keep_busy(d: Deployment, tokens: list[int]) -> Background:
    """A long request sharing ``tokens``: the router books it on their holder, which is then loaded."""
    busy = Background(lambda: d.complete(tokens + [token_id(1500 + i) for i in range(300)], max_tokens=BUSY_TOKENS))
    time.sleep(0.7)
    return busy


def test_the_router_hints_a_to_b_and_b_reads_as_pages(cluster):
    d, w = cluster
    tokens = prefix(1)
    seed_on(d, w["a"], tokens)
    busy = keep_busy(d, tokens)
    reply = d.complete([*tokens, token_id(2), token_id(3)])
    busy.join()
    record = d.record_of(reply)
    assert record["worker"] == "b"
    assert record["hint"] is True
    assert record["hint_source"] == w["a"].control_endpoint
    assert record["hint_pages"] == PREFIX_PAGES
    assert (record["peer_pages"], record["local_pages"], record["computed_pages"]) == (PREFIX_PAGES, 0, 0)
    assert record["verified"] is True and record["mismatched_pages"] == 0
    assert reply["choices"][0]["text"].strip()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_PAGES * PAGE
    # The busy request found its prefix in A's own kvcr.
    assert d.record_of(busy.reply)["worker"] == "a" and d.record_of(busy.reply)["local_pages"] == PREFIX_PAGES
    # Each worker's --metrics-port shows it: B restored the pages from a peer, A served them.
    pages_b, pages_a = scrape(w["b"]), scrape(w["a"])
    assert pages_b[("kvcr_pages_total", (("outcome", "ok"), ("path", "remote_restore")))] >= PREFIX_PAGES
    # Leased (ok), or taken off A's slot board by B on this host (reported by B: A cannot check it).
    served = sum(pages_a.get(("kvcr_pages_total", (("outcome", o), ("path", "served"))), 0) for o in ("ok", "reported"))
    assert served >= PREFIX_PAGES
    # The deployment's default transport: auto (one host, so B read A's arena over shm).
    assert pages_a[("kvcr_build_info", (("transport", "auto"), ("version", kvcr.__version__)))] == 1
    assert not [name for name, _ in pages_a if name.endswith("_created")]


def scrape(worker: Worker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A worker's /metrics (``--metrics-port``), parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    assert worker.metrics_url is not None
    with urllib.request.urlopen(worker.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_stale_hint_after_a_evicted_is_a_miss_and_no_error(cluster):
    d, w = cluster
    tokens = prefix(2)
    seed_on(d, w["a"], tokens)
    busy = keep_busy(d, tokens)
    pending = Background(lambda: d.complete([*tokens, token_id(4)]))
    time.sleep(0.4)  # routed (with its hint) and waiting in B's queue
    assert d.control(w["a"], "clear_kvcr") == {"status": "ok", "cleared": True}
    pending.join()
    busy.join()
    assert pending.error is None and pending.reply is not None
    record = d.record_of(pending.reply)
    assert record["worker"] == "b" and record["hint"] is True and record["hint_source"] == w["a"].control_endpoint
    assert (record["peer_pages"], record["computed_pages"]) == (0, PREFIX_PAGES)
    assert record["verified"] is None
    assert pending.reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_killed_b_recomputes_and_answers(cluster):
    d, w = cluster
    tokens = prefix(3)
    seed_on(d, w["a"], tokens)
    busy = keep_busy(d, tokens)
    pending = Background(lambda: d.complete([*tokens, token_id(5)]))
    time.sleep(0.4)
    d.kill(w["a"])
    started = time.monotonic()
    pending.join()
    busy.join()
    assert busy.error is not None  # A's own request died with it
    assert pending.error is None and pending.reply is not None
    record = d.record_of(pending.reply)
    assert record["worker"] == "b" and record["hint"] is True and record["hint_source"] == w["a"].control_endpoint
    assert (record["peer_pages"], record["computed_pages"]) == (0, PREFIX_PAGES)
    assert time.monotonic() - started < 15  # bounded by kvcr's operation timeout, not hung


def test_a_worker_without_the_capability_keys_gets_no_hint(cluster):
    d, w = cluster
    if w["a"].process.poll() is None:
        d.stop(w["a"])
    started = time.monotonic()
    d.wait_gone(w["a"])
    print(f"A left the frontend's view {time.monotonic() - started:.1f} s after it ended")
    w["c"] = d.start_worker(WorkerSpec("c", hint_capability=False, token_delay_ms=TOKEN_DELAY_MS))
    d.wait_ready([w["b"], w["c"]])
    tokens = prefix(4)
    seed_on(d, w["b"], tokens)
    busy = keep_busy(d, tokens)
    reply = d.complete([*tokens, token_id(6)])
    busy.join()
    record = d.record_of(reply)
    assert record["worker"] == "c"  # B held the prefix and was busy: the same arrangement that hinted B
    assert record["hint"] is False and record["hint_source"] is None
    assert (record["peer_pages"], record["computed_pages"]) == (0, PREFIX_PAGES)
    assert reply["choices"][0]["text"].strip()
