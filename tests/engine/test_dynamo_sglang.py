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
came from, and every hinted answer must equal the answer A computes for the same request.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcr.demo.dynamo.deployment import _HOST_VARS, LOOPBACK, free_port, free_system_port
from kvcr.testing.engine import (
    PAGE_SIZE,
    REPO,
    SHIMS,
    STUBS,
    kvcr_extra_config,
    prompt_ids,
    token_id,
    word,
    write_model,
)

pytestmark = [pytest.mark.timeout(240)]

PROMPT_TOKENS = 512


class Node:
    def __init__(self, name: str, args: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name, self.log = name, workdir / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def environment(discovery: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({var: LOOPBACK for var in _HOST_VARS})
    for var, sub in (("SGLANG_CACHE_DIR", "sglang"), ("TORCH_EXTENSIONS_DIR", "torch_extensions")):
        env.setdefault(var, str(REPO / ".cache" / sub))
    env.update(
        DYN_DISCOVERY_BACKEND="file",
        DYN_FILE_KV=str(discovery),
        DYN_LOG="info",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        UCX_NET_DEVICES=env.get("UCX_NET_DEVICES", "lo"),
        **extra,
    )
    return env


def worker_args(model: Path, control_port: int) -> list[str]:
    extra = kvcr_extra_config(control_port, enable_remote_hint=True, operation_timeout_ms=2000)
    return [
        "-m", "dynamo.sglang",
        "--model-path", str(model), "--served-model-name", "tiny",
        "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "page_first_direct", "--skip-server-warmup",
        "--page-size", str(PAGE_SIZE), "--max-total-tokens", "4096",
        "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
        "--discovery-backend", "file", "--enable-metrics",
        # SGLang's KV events: the router's event-driven indexer, without which it attaches no hints
        "--kv-events-config", json.dumps({"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://*:{free_port()}"}),
    ]  # fmt: skip


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
    discovery = workdir / "discovery"
    discovery.mkdir()
    http_port = free_port()
    nodes: list[Node] = []
    controls = {"a": free_port(), "b": free_port()}
    systems = {"a": free_system_port(), "b": free_system_port()}
    try:
        path = os.pathsep.join([str(SHIMS), str(REPO), str(STUBS)])
        for name, control in controls.items():
            env = environment(
                discovery,
                PYTHONPATH=path,
                SGLANG_USE_CPU_ENGINE="1",
                KVCR_ENGINE_CPU_OP_PLACEHOLDERS="1",
                DYN_SYSTEM_PORT=str(systems[name]),
            )
            nodes.append(Node(name, worker_args(model, control), env, workdir))
        frontend_args = ["-m", "dynamo.frontend", "--http-host", LOOPBACK, "--http-port", str(http_port)]
        frontend_args += ["--router-mode", "kv", "--discovery-backend", "file"]
        nodes.append(Node("frontend", frontend_args, environment(discovery, PYTHONPATH=str(REPO)), workdir))
        deadline = time.monotonic() + 200
        while len(registrations(discovery)) < 2:
            dead = [n for n in nodes if not n.alive()]
            if dead or time.monotonic() > deadline:
                culprit = dead[0] if dead else nodes[0]
                pytest.fail(f"{culprit.name} did not come up:\n{culprit.text()[-4000:]}")
            time.sleep(1)
        url = f"http://{LOOPBACK}:{http_port}"
        while True:
            try:
                if any(m.get("id") == "tiny" for m in http(f"{url}/v1/models", timeout_s=5)["data"]):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the frontend never listed the model:\n{nodes[-1].text()[-3000:]}")
            time.sleep(0.5)
        yield {
            "url": url,
            "discovery": discovery,
            "controls": controls,
            "metrics": {name: f"http://{LOOPBACK}:{port}/metrics" for name, port in systems.items()},
            "nodes": {n.name: n for n in nodes},
        }
    finally:
        for node in nodes:
            node.stop()


def test_each_workers_registration_carries_kvcrs_hint_capability(deployment):
    published = registrations(deployment["discovery"])
    endpoints = sorted(d["router_hint_source_control_endpoints"]["0"] for d in published.values())
    assert endpoints == sorted(f"tcp://127.0.0.1:{port}" for port in deployment["controls"].values())
    for data in published.values():
        assert data["router_hint"] is True
        assert data["router_hint_worker_type"] == "aggregated"
    for name in ("a", "b"):
        log = deployment["nodes"][name].text()
        assert "hint capability, kv_hints forwarding and metrics hooked" in log
        assert "setup_prometheus_registry" in log


def test_requests_through_the_frontend_are_served_with_the_hooks_installed(deployment):
    prompt = " ".join(word(t - token_id(0)) for t in prompt_ids(PROMPT_TOKENS, seed=7))
    for _ in range(2):
        answer = http(f"{deployment['url']}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert answer["choices"][0]["finish_reason"] == "length"


def cached_tokens(node: Node) -> list[int]:
    """SGLang's ``#cached-token`` of each prefill batch in a worker's log."""
    return [int(n) for n in re.findall(r"#cached-token: (\d+)", node.text())]


def kvcr_pages(metrics_url: str, path: str) -> int:
    """``kvcr_pages_total{path=..., outcome="ok"}`` on a worker's own /metrics (Dynamo's system port)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kvcr_pages_total{") and f'path="{path}"' in line and 'outcome="ok"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def test_kvcrs_counters_are_on_each_workers_metrics(deployment):
    for url in deployment["metrics"].values():
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert "sglang:" in text and "kvcr_build_info{" in text and "kvcr_pages_total" in text, text[-2000:]
    assert kvcr_pages(deployment["metrics"]["a"], "backup") + kvcr_pages(deployment["metrics"]["b"], "backup") > 0


def test_a_hinted_request_restores_the_prefix_from_the_peer(deployment):
    url, published = deployment["url"], registrations(deployment["discovery"])
    by_port = {d["router_hint_source_control_endpoints"]["0"]: i for i, d in published.items()}
    a_id = by_port[f"tcp://127.0.0.1:{deployment['controls']['a']}"]
    a, b = deployment["nodes"]["a"], deployment["nodes"]["b"]
    prompt = " ".join(word(t - token_id(0)) for t in prompt_ids(PROMPT_TOKENS, seed=9))
    http(
        f"{url}/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 2, "nvext": {"backend_instance_id": a_id}},
    )
    seen_by_b = len(cached_tokens(b))
    metrics = deployment["metrics"]
    remote_before, served_before = kvcr_pages(metrics["b"], "remote_restore"), kvcr_pages(metrics["a"], "served")
    time.sleep(1)  # A's KV events reach the router
    # The router sends a request to B (with a hint to A) once A looks busy enough; how many requests
    # that takes depends on the machine's load, so keep A busy until B has taken one (at most 10).
    threads, bodies, answers = [], [], {}

    def ask(k: int) -> None:
        answers[k] = http(f"{url}/v1/completions", bodies[k])["choices"][0]["text"]

    for k in range(10):
        suffix = " ".join(word(t - token_id(0)) for t in prompt_ids(300, seed=100 + k))
        bodies.append({"model": "tiny", "prompt": f"{prompt} {suffix}", "max_tokens": 40, "temperature": 0})
        thread = threading.Thread(target=ask, args=(k,), daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(0.4)
        if k >= 2 and cached_tokens(b)[seen_by_b:]:
            break
    for thread in threads:
        thread.join(120)
    on_b = cached_tokens(b)[seen_by_b:]
    assert on_b, f"the router never booked B:\n{a.text()[-1500:]}"
    assert max(on_b) >= PROMPT_TOKENS - PAGE_SIZE, b.text()[-3000:]  # B never computed the prefix
    remote = kvcr_pages(metrics["b"], "remote_restore") - remote_before
    assert remote >= (PROMPT_TOKENS - PAGE_SIZE) // PAGE_SIZE  # the prefix's pages, read from A's kvcr DRAM
    assert kvcr_pages(metrics["a"], "served") - served_before >= remote
    # Every answer, B's from restored pages among them, equals A's for the same request
    assert len(answers) == len(bodies)
    for k, body in enumerate(bodies):
        pinned = {**body, "nvext": {"backend_instance_id": a_id}}
        again = http(f"{url}/v1/completions", pinned)["choices"][0]["text"]
        assert answers[k] == again, f"request {k}: {answers[k]!r} != A's {again!r}"
    print(f"B cached {max(on_b)} tokens; {remote} pages from A's kvcr DRAM; {len(bodies)} answers equal A's")
