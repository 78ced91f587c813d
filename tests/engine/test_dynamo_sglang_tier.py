"""The router routes and hints on kvcr's tier: a prefix only A's kvcr DRAM holds is still A's to give.

Two ``python -m dynamo.sglang`` workers behind Dynamo's real frontend and KV router, each with a
GPU pool of 1,024 tokens and SGLang's default host pool (twice that), kvcr as L3 with a few MiB
of DRAM. A prefix P is computed on A (pinned), then other prompts pinned to A push P out of A's
GPU and host pools; SGLang tells the router so (``BlockRemoved``), while A's kvcr keeps P and
says so on the same stream (``engine_kv_events``, medium ``CPU_TIER1``: Dynamo's relay
counts stores per tier and block, so SGLang's removal leaves kvcr's). With A kept busy, a
request for P is booked on B with the router's hint naming A, and B restores P from A's kvcr
DRAM; A's own pools never held P again in between (A restored nothing from its kvcr until the
end, when a request for P pinned to A must come from its kvcr: P had really left A's pools).
Without kvcr's events the router would know no holder of P and B would compute it.

Then a prefix Q goes through A the same way and on past A's kvcr (more traffic than its DRAM
holds): kvcr's ``BlockRemoved`` reaches the router, so a request for Q booked on B carries no
hint (B's ``kvcr_hinted_pages_total`` does not move) and is computed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcr.demo.dynamo.deployment import Deployment
from kvcr.demo.dynamo.sglang_workers import (
    SERVED_MODEL,
    SglangWorker,
    SglangWorkerSpec,
    sglang_workers,
)
from kvcr.testing.engine import PAGE_SIZE, metric_sum, parse_metrics, prompt_ids, token_id, word, write_model
from tests.engine.test_dynamo_sglang import cached_tokens, http, registrations

pytestmark = [pytest.mark.timeout(420)]

GPU_TOKENS = 1024  # SGLang's host pool is twice this (hicache_ratio 2)
PREFIX_TOKENS = 320
FILLER_TOKENS = 600
FILLERS_OUT_OF_POOLS = 7  # 4,200 tokens: more than A's GPU and host pools together (3,072)
DRAM = "2MiB"  # 512 pages of this model (4 KiB each): 8,192 tokens, more than the pools
FILLERS_OUT_OF_KVCR = 16  # 9,600 tokens more: past A's kvcr DRAM too


def text(length: int, seed: int) -> str:
    return " ".join(word(t - token_id(0)) for t in prompt_ids(length, seed=seed))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("dynamo-sglang-tier")
    model = write_model(workdir / "model")
    specs = [SglangWorkerSpec(name, GPU_TOKENS, {"dram_bytes": DRAM}) for name in ("a", "b")]
    with Deployment(workdir / "deployment", served_model=SERVED_MODEL) as d:
        d.start_frontend()
        with sglang_workers(d, model, specs, timeout_s=200) as workers:
            published = registrations(d.discovery)
            ids = {d_["router_hint_source_control_endpoints"]["0"]: i for i, d_ in published.items()}
            yield {"url": d.url, "workers": workers, "ids": {n: ids[w.control_endpoint] for n, w in workers.items()}}


def complete(url: str, prompt: str, *, max_tokens: int = 1, pin: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if pin is not None:
        body["nvext"] = {"backend_instance_id": pin}
    answer: dict[str, Any] = http(f"{url}/v1/completions", body, timeout_s=120)
    return answer


def hinted_pages(worker: SglangWorker, outcome: str | None = None) -> int:
    """``kvcr_hinted_pages_total{outcome}`` on a worker (all outcomes: None): pages a hint said a peer holds."""
    labels = {} if outcome is None else {"outcome": outcome}
    return int(metric_sum(parse_metrics(worker.metrics_text()), "kvcr_hinted_pages_total", **labels))


def wait_backed_up(worker: SglangWorker, pages: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker.kvcr_pages("backup") < pages:
        assert time.monotonic() < deadline, f"A backed up {worker.kvcr_pages('backup')} pages, not {pages}"
        time.sleep(0.2)


def push_out(url: str, a_id: int, count: int, seed: int) -> None:
    for k in range(count):
        complete(url, text(FILLER_TOKENS, seed=seed + k), pin=a_id)


def book_on_b_while_a_is_busy(url: str, a_id: int, b: SglangWorker, prefix: str, seed: int) -> tuple[int, str, str]:
    """Keep A busy with long pinned decodes; send requests for ``prefix`` until the router books one on B.

    Returns the tokens B's prefill found cached, B's answer and the request's prompt.
    """
    seen = len(cached_tokens(b))
    stop = threading.Event()

    def keep_busy(k: int) -> None:
        while not stop.is_set():
            complete(url, text(120, seed=seed + 500 + k), max_tokens=200, pin=a_id)

    busy = [threading.Thread(target=keep_busy, args=(k,), daemon=True) for k in range(3)]
    for thread in busy:
        thread.start()
    try:
        time.sleep(1.5)  # the router counts A's decodes
        for k in range(12):
            prompt = f"{prefix} {text(60, seed=seed + k)}"
            answer = complete(url, prompt, max_tokens=8)
            on_b = cached_tokens(b)[seen:]
            if on_b:
                return max(on_b), answer["choices"][0]["text"], prompt
        raise AssertionError(f"the router never booked B:\n{b.text()[-1500:]}")
    finally:
        stop.set()
        for thread in busy:
            thread.join(120)


def test_a_prefix_only_kvcr_holds_is_hinted_and_restored_from_its_dram(deployment):
    url, (a, b), ids = deployment["url"], (deployment["workers"]["a"], deployment["workers"]["b"]), deployment["ids"]
    prefix = text(PREFIX_TOKENS, seed=31)
    complete(url, prefix, pin=ids["a"])
    wait_backed_up(a, (PREFIX_TOKENS // PAGE_SIZE))
    push_out(url, ids["a"], FILLERS_OUT_OF_POOLS, seed=1000)
    time.sleep(1)  # the events reach the router
    local_before, served_before = a.kvcr_pages("local_restore"), a.kvcr_pages("served")
    remote_before, leased_before = b.kvcr_pages("remote_restore"), hinted_pages(b, "leased")
    cached_on_b, answer, prompt = book_on_b_while_a_is_busy(url, ids["a"], b, prefix, seed=2000)
    assert cached_on_b >= PREFIX_TOKENS - PAGE_SIZE, b.text()[-3000:]  # B never computed P
    remote = b.kvcr_pages("remote_restore") - remote_before
    assert remote >= PREFIX_TOKENS // PAGE_SIZE - 1  # P's pages, read from A's kvcr DRAM
    assert a.kvcr_pages("served") - served_before >= remote
    assert hinted_pages(b, "leased") - leased_before >= remote  # on a hint: with two workers, naming A
    assert a.kvcr_pages("local_restore") == local_before  # A's pools did not hold P again meanwhile
    # P had left A's GPU and host pools: A now has to take it from its kvcr DRAM.
    again = complete(url, prompt, max_tokens=8, pin=ids["a"])
    assert a.kvcr_pages("local_restore") - local_before >= PREFIX_TOKENS // PAGE_SIZE - 1, a.text()[-3000:]
    assert answer.split()[:4] == again["choices"][0]["text"].split()[:4]


def test_a_prefix_kvcr_evicted_is_no_longer_hinted(deployment):
    url, (a, b), ids = deployment["url"], (deployment["workers"]["a"], deployment["workers"]["b"]), deployment["ids"]
    prefix = text(PREFIX_TOKENS, seed=41)
    complete(url, prefix, pin=ids["a"])
    push_out(url, ids["a"], FILLERS_OUT_OF_POOLS + FILLERS_OUT_OF_KVCR, seed=3000)
    time.sleep(1)
    hinted_before = hinted_pages(b)
    remote_before, served_before = b.kvcr_pages("remote_restore"), a.kvcr_pages("served")
    cached_on_b, _, _ = book_on_b_while_a_is_busy(url, ids["a"], b, prefix, seed=4000)
    assert cached_on_b < PREFIX_TOKENS - PAGE_SIZE  # B computed Q: no one held it
    assert hinted_pages(b) == hinted_before  # no hint (with two workers, any would name A)
    assert b.kvcr_pages("remote_restore") == remote_before and a.kvcr_pages("served") == served_before
