"""Dynamo's own SGLang worker, ``python -m dynamo.sglang``, with kvcr as its HiCache L3, on the CPU.

What an operator runs (docs/dynamo.md), with the flags a CPU-only machine needs
(``kvcr.testing.engine.CPU_FLAGS``, docs/engine-on-cpu.md) and the test shims on the child's
``PYTHONPATH`` only. No kvcr code is named on the command line: kvcr is the storage backend of the
extra-config, and kvcr's SGLang plugin publishes the hint capability, forwards the router's hints
and puts kvcr's series on the worker's ``/metrics`` (``--enable-metrics``, ``DYN_SYSTEM_PORT``).
The demo on real engines and ``tests/engine`` start workers through :func:`start_sglang_worker`.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcr.demo.dynamo.deployment import Deployment, DeploymentError, free_port, free_system_port, log_tail
from kvcr.testing.engine import (
    CPU_FLAGS,
    PAGE_SIZE,
    cpu_engine_environment,
    kvcr_extra_config,
    kvcr_l3_args,
    metric_sum,
    parse_metrics,
    stop_process_group,
)

SERVED_MODEL = "tiny"


@dataclass(frozen=True, slots=True)
class SglangWorkerSpec:
    name: str
    max_total_tokens: int = 4096
    kvcr_settings: Mapping[str, Any] = field(default_factory=dict)  # over the loopback defaults
    extra_args: tuple[str, ...] = ()
    served_model: str = SERVED_MODEL


@dataclass
class SglangWorker:
    spec: SglangWorkerSpec
    process: subprocess.Popen[bytes]
    control_port: int
    system_port: int
    log: Path

    @property
    def control_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.control_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}/metrics"

    def alive(self) -> bool:
        return bool(self.process.poll() is None)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the worker's process group (its scheduler too), SIGKILL after ``grace_s``."""
        stop_process_group(self.process, grace_s)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return str(response.read().decode())

    def kvcr_pages(self, path: str, outcome: str = "ok") -> int:
        """``kvcr_pages_total{path, outcome}`` on the worker's own /metrics, summed over its ranks."""
        return int(metric_sum(parse_metrics(self.metrics_text()), "kvcr_pages_total", path=path, outcome=outcome))


def worker_args(model: Path, control_port: int, events_port: int, spec: SglangWorkerSpec) -> list[str]:
    """``-m dynamo.sglang ...``: kvcr as L3 with hints on, SGLang's KV events, metrics, CPU flags."""
    settings = {"enable_remote_hint": True, "operation_timeout_ms": 2000, **spec.kvcr_settings}
    extra = kvcr_extra_config(control_port, **settings)
    return [
        "-m", "dynamo.sglang",
        "--model-path", str(model), "--served-model-name", spec.served_model,
        *CPU_FLAGS,
        "--page-size", str(PAGE_SIZE), "--max-total-tokens", str(spec.max_total_tokens),
        *kvcr_l3_args(extra),
        "--enable-metrics",
        # SGLang's KV events feed the router's event-driven indexer, without which it attaches no hints
        "--kv-events-config", json.dumps({"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://*:{events_port}"}),
        *spec.extra_args,
    ]  # fmt: skip


def cpu_environment(base: Mapping[str, str], system_port: int) -> dict[str, str]:
    """The worker's environment: a CPU engine's (shims, stubs, caches in the repo), Dynamo's op placeholders."""
    return cpu_engine_environment(base) | {
        "KVCR_ENGINE_CPU_OP_PLACEHOLDERS": "1",
        "DYN_SYSTEM_PORT": str(system_port),
    }


def start_sglang_worker(deployment: Deployment, model: Path, spec: SglangWorkerSpec) -> SglangWorker:
    """Start one ``python -m dynamo.sglang`` worker in ``deployment`` (not waiting for it)."""
    control, events, system = free_port(), free_port(), free_system_port()
    env = cpu_environment(deployment.environment(), system)
    args = [*worker_args(model, control, events, spec), "--discovery-backend", deployment.discovery_backend]
    process, log = deployment.spawn(spec.name, args, env)
    return SglangWorker(spec, process, control, system, log)


@contextmanager
def sglang_workers(
    deployment: Deployment, model: Path, specs: Iterable[SglangWorkerSpec], timeout_s: float = 240.0
) -> Iterator[dict[str, SglangWorker]]:
    """Start a worker per spec, wait until the frontend routes to them all; stop them all on the way out."""
    workers: dict[str, SglangWorker] = {}
    try:
        for spec in specs:
            workers[spec.name] = start_sglang_worker(deployment, model, spec)
        wait_sglang_ready(deployment, workers.values(), timeout_s)
        yield workers
    finally:
        for worker in workers.values():
            worker.stop()


def wait_sglang_ready(deployment: Deployment, workers: Iterable[SglangWorker], timeout_s: float = 240.0) -> None:
    """Wait until the frontend routes to every worker and lists the model; a dead worker ends the wait."""
    pending = list(workers)
    deadline = time.monotonic() + timeout_s
    while len(deployment.routable_ids()) < len(pending) or not deployment.model_listed():
        for worker in pending:
            if not worker.alive():
                raise DeploymentError(f"worker {worker.spec.name} exited; see {worker.log}{log_tail(worker.log, 25)}")
        if time.monotonic() > deadline:
            raise DeploymentError(
                f"the SGLang workers were not routable after {timeout_s:.0f} s; logs in {deployment.workdir}"
            )
        time.sleep(0.5)
