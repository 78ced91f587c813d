"""Dynamo's own SGLang worker (``python -m dynamo.sglang``) with kvcr as L3, behind Dynamo's real frontend.

No kvcr code is named on the worker's command line: kvcr is only the HiCache storage backend of its
extra-config, and kvcr's SGLang plugin (loaded by ``sgl.Engine`` in the worker process) publishes
the hint capability and forwards the router's hints. The frontend is ``python -m dynamo.frontend
--router-mode kv --discovery-backend file``; both run on loopback, on the CPU with kvcr's engine
shims (``docs/engine-on-cpu.md``), with the Qwen3.5 op placeholders Dynamo's imports need.

How a prefix reaches B honestly: its first request is pinned to A (``nvext.backend_instance_id``,
no router selection, so no hint); then requests that share it and add long suffixes of their own
are routed by the router's cost model alone. Once A carries their load, one is booked on B, which
never saw the prefix, with the router's hint naming A; B's prefill then reports the prefix as
cached (SGLang's ``#cached-token``), which only a restore from A's kvcr DRAM can give it. The
workers run with ``--enable-metrics``, so kvcr's counters are on each worker's own ``/metrics``
(``DYN_SYSTEM_PORT``): B's ``remote_restore`` pages and A's ``served`` pages say where the prefix
came from, and every hinted answer must equal the answer A computes for the same request. The
workers start through ``kvcr.demo.dynamo.sglang_workers``, as in ``kvcr demo --engine sglang``.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcr.demo.dynamo.deployment import Deployment
from kvcr.demo.dynamo.sglang_workers import (
    SERVED_MODEL,
    SglangWorker,
    SglangWorkerSpec,
    sglang_workers,
)
from kvcr.testing.engine import PAGE_SIZE, prompt_ids, token_id, word, write_model

pytestmark = [pytest.mark.timeout(240)]

PROMPT_TOKENS = 512
LEADING_TOKENS = 10  # of each 40-token answer, compared with A's (see the end of the hinted test)


def http(url: str, body: Any = None, timeout_s: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def registrations(discovery: Path) -> dict[int, dict[str, Any]]:
    """instance id -> the runtime data of each worker's model card (what the router reads)."""
    found = {}
    for path in discovery.rglob("*"):
        name = urllib.parse.unquote(path.name)
        if not path.is_file() or "/mdc/" not in f"{path.parent}/" or "generate/" not in name:
            continue
        try:
            card = json.loads(path.read_text())
        except ValueError:
            continue
        model = card.get("card_json") or {}
        found[int(card["instance_id"])] = ((model.get("runtime_config") or {}).get("runtime_data")) or {}
    return found


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("dynamo-sglang")
    model = write_model(workdir / "model")
    with Deployment(workdir / "deployment", served_model=SERVED_MODEL) as d:
        d.start_frontend()
        with sglang_workers(d, model, [SglangWorkerSpec("a"), SglangWorkerSpec("b")], timeout_s=200) as workers:
            assert len(registrations(d.discovery)) == 2
            yield {"url": d.url, "discovery": d.discovery, "workers": workers}


def test_each_workers_registration_carries_kvcrs_hint_capability(deployment):
    published = registrations(deployment["discovery"])
    endpoints = sorted(d["router_hint_source_control_endpoints"]["0"] for d in published.values())
    assert endpoints == sorted(w.control_endpoint for w in deployment["workers"].values())
    for data in published.values():
        assert data["router_hint"] is True
        assert data["router_hint_worker_type"] == "aggregated"
    for name in ("a", "b"):
        log = deployment["workers"][name].text()
        assert "hint capability, kv_hints forwarding and metrics hooked" in log
        assert "setup_prometheus_registry" in log


def test_requests_through_the_frontend_are_served_with_the_hooks_installed(deployment):
    prompt = " ".join(word(t - token_id(0)) for t in prompt_ids(PROMPT_TOKENS, seed=7))
    for _ in range(2):
        answer = http(f"{deployment['url']}/v1/completions", {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 2})
        assert answer["choices"][0]["finish_reason"] == "length"


def cached_tokens(worker: SglangWorker) -> list[int]:
    """SGLang's ``#cached-token`` of each prefill batch in a worker's log."""
    return [int(n) for n in re.findall(r"#cached-token: (\d+)", worker.text())]


def test_kvcrs_counters_are_on_each_workers_metrics(deployment):
    workers = deployment["workers"]
    for worker in workers.values():
        text = worker.metrics_text()
        assert "sglang:" in text and "kvcr_build_info{" in text and "kvcr_pages_total" in text, text[-2000:]
    assert sum(worker.kvcr_pages("backup") for worker in workers.values()) > 0


def test_a_hinted_request_restores_the_prefix_from_the_peer(deployment):
    url, published = deployment["url"], registrations(deployment["discovery"])
    by_port = {d["router_hint_source_control_endpoints"]["0"]: i for i, d in published.items()}
    a, b = deployment["workers"]["a"], deployment["workers"]["b"]
    a_id = by_port[a.control_endpoint]
    prompt = " ".join(word(t - token_id(0)) for t in prompt_ids(PROMPT_TOKENS, seed=9))
    http(
        f"{url}/v1/completions",
        {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 2, "nvext": {"backend_instance_id": a_id}},
    )
    seen_by_b = len(cached_tokens(b))
    remote_before, served_before = b.kvcr_pages("remote_restore"), a.kvcr_pages("served")
    time.sleep(1)  # A's KV events reach the router
    # The router sends a request to B (with a hint to A) once A looks busy enough; how many requests
    # that takes depends on the machine's load, so keep A busy until B has taken one (at most 16).
    # Long answers keep each request running on A: an idle CPU engine no longer spins a core
    # (--sleep-on-idle) and answers 40 tokens faster than the next request arrives.
    threads, bodies, answers = [], [], {}

    def ask(k: int) -> None:
        answers[k] = http(f"{url}/v1/completions", bodies[k])["choices"][0]["text"]

    for k in range(16):
        suffix = " ".join(word(t - token_id(0)) for t in prompt_ids(300, seed=100 + k))
        bodies.append({"model": SERVED_MODEL, "prompt": f"{prompt} {suffix}", "max_tokens": 200, "temperature": 0})
        thread = threading.Thread(target=ask, args=(k,), daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(0.2)
        if k >= 2 and cached_tokens(b)[seen_by_b:]:
            break
    for thread in threads:
        thread.join(120)
    on_b = cached_tokens(b)[seen_by_b:]
    assert on_b, f"the router never booked B:\n{a.text()[-1500:]}"
    assert max(on_b) >= PROMPT_TOKENS - PAGE_SIZE, b.text()[-3000:]  # B never computed the prefix
    remote = b.kvcr_pages("remote_restore") - remote_before
    assert remote >= (PROMPT_TOKENS - PAGE_SIZE) // PAGE_SIZE  # the prefix's pages, read from A's kvcr DRAM
    assert a.kvcr_pages("served") - served_before >= remote
    # Every answer, B's from restored pages among them, starts as A's for the same request does.
    # Greedy decoding in bf16 on the CPU is not batch-invariant: one request decoded in a batch and
    # alone can flip a near-tied argmax after some dozens of tokens (a CI run saw request 3 agree for
    # 25 tokens, then part). A wrong restored prefix changes every generated token's attention from
    # the first on, so the leading tokens carry the check.
    assert len(answers) == len(bodies)
    for k, body in enumerate(bodies):
        pinned = {**body, "nvext": {"backend_instance_id": a_id}}
        again = http(f"{url}/v1/completions", pinned)["choices"][0]["text"]
        leading = answers[k].split()[:LEADING_TOKENS]
        assert leading == again.split()[:LEADING_TOKENS], f"request {k}: {answers[k]!r} != A's {again!r}"
    print(
        f"B cached {max(on_b)} tokens; {remote} pages from A's kvcr DRAM; "
        f"{len(bodies)} answers start as A's ({LEADING_TOKENS} tokens)"
    )
