"""One machine's Dynamo deployment: ``python -m dynamo.frontend --router-mode kv`` and kvcr workers.

Everything is on loopback: discovery in a fresh directory (``discovery_backend="file"``, the
default) or through an etcd this deployment starts (``"etcd"``, Dynamo's production default), the
tcp request plane, KV events on the zmq event plane (or ``event_plane="nats"``, through a NATS
server it starts), every advertised host 127.0.0.1, ports from the kernel. Each
process logs to ``<workdir>/<name>.log``; each worker appends its report to
``<workdir>/<name>.jsonl``. The demo and the end-to-end tests drive it the same way::

    with Deployment(workdir) as d:
        d.start_frontend()
        a, b = d.start_worker(WorkerSpec("a")), d.start_worker(WorkerSpec("b"))
        d.wait_ready([a, b])
        reply = d.complete(token_ids)            # POST /v1/completions
        d.record_of(reply)                       # that request's line in its worker's report
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvcr.demo.dynamo.control_plane import DISCOVERY_BACKENDS, EVENT_PLANES, ControlPlane
from kvcr.demo.dynamo.tiny_model import write_tiny_model
from kvcr.testing.ports import free_port_block

LOOPBACK = "127.0.0.1"
_HOST_VARS = (
    "DYN_TCP_RPC_HOST",
    "DYN_TCP_RESPONSE_STREAM_HOST",
    "DYN_EVENT_PLANE_HOST",
    "DYN_HTTP_HOST",
    "DYN_HTTP_RPC_HOST",
    "DYN_SYSTEM_HOST",
)


class DeploymentError(RuntimeError):
    """A process did not start, died, or a request failed; the message says which."""


def log_tail(log: Path, lines: int = 15) -> str:
    """The last lines of a child's log, for an error message read where the log is gone (CI)."""
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    body = "".join(f"\n    {line}" for line in tail)
    return f"; its last lines:{body}" if body else ""


def free_port() -> int:
    """A free loopback port no outgoing connection will take first (see kvcr.testing.ports)."""
    return free_port_block()


def free_system_port() -> int:
    """A free port below 32768: Dynamo 1.6.1 reads ``DYN_SYSTEM_PORT`` as an i16."""
    try:
        return free_port_block(below=32768)
    except RuntimeError as exc:
        raise DeploymentError("no free port below 32768 for a worker's system server") from exc


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to start one kvcr worker (the options of ``kvcr worker``)."""

    name: str
    hint_capability: bool = True
    page_kib: int = 64
    host_pages: int = 256
    dram: str = "64MiB"
    max_tokens: int = 8
    token_delay_ms: float = 0.0
    queue_delay_ms: float = 0.0
    operation_timeout_ms: int = 2000
    transport: str = "auto"
    metrics_port: int | None = None
    extra_args: tuple[str, ...] = ()
    host: str = LOOPBACK  # the address it advertises (its namespace's, when ``prefix`` moves it to one)
    prefix: tuple[str, ...] = ()  # a command prefix, e.g. ``ip netns exec <ns>``
    env: tuple[tuple[str, str], ...] = ()  # extra environment (e.g. UCX_TLS, UCX_NET_DEVICES)


@dataclass
class Worker:
    spec: WorkerSpec
    process: subprocess.Popen[bytes]
    control_port: int
    system_port: int
    report: Path
    log: Path
    events_port: int = 0  # where its kvcr KV-event publisher binds
    worker_id: int | None = None

    @property
    def control_endpoint(self) -> str:
        return f"tcp://{self.spec.host}:{self.control_port}"

    @property
    def metrics_url(self) -> str | None:
        """Where the worker serves kvcr's /metrics (None without ``metrics_port``)."""
        if self.spec.metrics_port is None:
            return None
        return f"http://{self.spec.host}:{self.spec.metrics_port}/metrics"


@dataclass
class Deployment:
    """Starts and stops the processes of one deployment (a context manager; ``close`` kills all)."""

    workdir: Path
    page_tokens: int = 16
    python: str = sys.executable
    router_args: tuple[str, ...] = ()
    http_port: int = 0
    discovery_backend: str = "file"
    event_plane: str = "zmq"
    host: str = LOOPBACK  # where the frontend, etcd and NATS listen (and what this process dials)
    served_model: str = ""  # the model name requests carry (default: the stand-in model's path)
    workers: list[Worker] = field(default_factory=list, init=False)
    control_plane: ControlPlane | None = field(default=None, init=False)
    _frontend: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _logs: list[IO[bytes]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.discovery_backend not in DISCOVERY_BACKENDS:
            raise DeploymentError(
                f"discovery_backend must be one of {DISCOVERY_BACKENDS}, got {self.discovery_backend!r}"
            )
        if self.event_plane not in EVENT_PLANES:
            raise DeploymentError(f"event_plane must be one of {EVENT_PLANES}, got {self.event_plane!r}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = str(write_tiny_model(self.workdir / "model"))
        self.served_model = self.served_model or self.model
        self.discovery = self.workdir / "discovery"
        self.discovery.mkdir(exist_ok=True)

    # ------------------------------------------------------------------ processes

    def _servers(self) -> ControlPlane | None:
        """The etcd / NATS this deployment needs, started on first use (None with neither)."""
        wanted_etcd, wanted_nats = self.discovery_backend == "etcd", self.event_plane == "nats"
        if self.control_plane is None and (wanted_etcd or wanted_nats):
            self.control_plane = ControlPlane(
                self.workdir / "control-plane", etcd=wanted_etcd, nats=wanted_nats, host=self.host
            )
            self.control_plane.start()
        return self.control_plane

    def environment(self, host: str = "", **extra: str) -> dict[str, str]:
        """A child's environment: this deployment's discovery, event plane and advertised ``host``."""
        env = dict(os.environ)
        env.update({var: host or self.host for var in _HOST_VARS})
        servers = self._servers()
        if servers is not None:
            env.update(servers.env())
        env.update(
            DYN_DISCOVERY_BACKEND=self.discovery_backend,
            DYN_FILE_KV=str(self.discovery),
            DYN_EVENT_PLANE=self.event_plane,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            UCX_NET_DEVICES=env.get("UCX_NET_DEVICES", "lo"),
            DYN_LOG=env.get("DYN_LOG", "info"),
        )
        env.update(extra)
        return env

    def spawn(
        self, name: str, args: Sequence[str], env: Mapping[str, str], prefix: Sequence[str] = ()
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """Start ``python args`` in its own session, logging to ``<workdir>/<name>.log``; closed with the deployment."""
        log = self.workdir / f"{name}.log"
        handle = open(log, "ab")  # noqa: SIM115 (closed in close)
        self._logs.append(handle)
        process = subprocess.Popen(
            [*prefix, self.python, *args],
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
        return process, log

    def start_frontend(self) -> str:
        """Start the frontend with the KV router; returns its base URL."""
        self.http_port = self.http_port or free_port()
        args = [
            "-m",
            "dynamo.frontend",
            "--http-host",
            self.host,
            "--http-port",
            str(self.http_port),
            "--router-mode",
            "kv",
            "--discovery-backend",
            self.discovery_backend,
            *self.router_args,
        ]
        self._frontend, _ = self.spawn("frontend", args, self.environment())
        return self.url

    def restart_frontend(self) -> None:
        """Stop the frontend (SIGTERM) and start it again on the same port."""
        self._stop_frontend()
        self.start_frontend()

    def _stop_frontend(self) -> None:
        if self._frontend is not None and self._frontend.poll() is None:
            self._frontend.send_signal(signal.SIGTERM)
            try:
                self._frontend.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self._frontend.pid, signal.SIGKILL)
                self._frontend.wait(15)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def start_worker(self, spec: WorkerSpec) -> Worker:
        control, events, system = free_port(), free_port(), free_system_port()
        report = self.workdir / f"{spec.name}.jsonl"
        args = [
            "-m",
            "kvcr.demo.dynamo.worker",
            "--model",
            self.model,
            "--name",
            spec.name,
            "--control-port",
            str(control),
            "--kv-events-port",
            str(events),
            "--page-tokens",
            str(self.page_tokens),
            "--page-kib",
            str(spec.page_kib),
            "--host-pages",
            str(spec.host_pages),
            "--dram",
            spec.dram,
            "--max-tokens",
            str(spec.max_tokens),
            "--token-delay-ms",
            str(spec.token_delay_ms),
            "--queue-delay-ms",
            str(spec.queue_delay_ms),
            "--operation-timeout-ms",
            str(spec.operation_timeout_ms),
            "--report",
            str(report),
            "--transport",
            spec.transport,
            "--host",
            spec.host,
            *(() if spec.hint_capability else ("--no-hint-capability",)),
            *(() if spec.metrics_port is None else ("--metrics-port", str(spec.metrics_port))),
            *spec.extra_args,
        ]
        env = self.environment(spec.host, DYN_SYSTEM_PORT=str(system))
        env.update(spec.env)
        process, log = self.spawn(spec.name, args, env, spec.prefix)
        worker = Worker(spec, process, control, system, report, log, events_port=events)
        self.workers.append(worker)
        return worker

    def wait_ready(self, workers: Iterable[Worker], timeout_s: float = 120.0) -> None:
        """Wait until every worker reported ready and the frontend routes to all of them."""
        pending = list(workers)
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive(pending)
            for worker in pending:
                if worker.worker_id is None:
                    ready = [r for r in read_records(worker.report) if r.get("event") == "ready"]
                    if ready:
                        worker.worker_id = int(ready[-1]["worker_id"])
            ids = {w.worker_id for w in pending}
            if None not in ids and ids <= self.routable_ids() and self.model_listed():
                return
            if time.monotonic() > deadline:
                raise DeploymentError(f"deployment not ready after {timeout_s:.0f} s; logs in {self.workdir}")
            time.sleep(0.25)

    def _check_alive(self, workers: Iterable[Worker]) -> None:
        if self._frontend is not None and self._frontend.poll() is not None:
            log = self.workdir / "frontend.log"
            raise DeploymentError(f"the frontend exited ({self._frontend.returncode}); see {log}{log_tail(log)}")
        for worker in workers:
            if worker.process.poll() is not None:
                raise DeploymentError(
                    f"worker {worker.spec.name} exited ({worker.process.returncode}); "
                    f"see {worker.log}{log_tail(worker.log)}"
                )

    def wait_gone(self, worker: Worker, timeout_s: float = 60.0) -> None:
        """Wait until the frontend no longer lists a stopped or killed worker."""
        deadline = time.monotonic() + timeout_s
        while worker.worker_id in self.routable_ids():
            if time.monotonic() > deadline:
                raise DeploymentError(f"the frontend still lists worker {worker.spec.name} after {timeout_s:.0f} s")
            time.sleep(0.25)

    def routable_ids(self) -> set[int]:
        """Instance ids of the ``generate`` endpoints the frontend currently sees."""
        try:
            health = self._get("/health")
        except DeploymentError:
            return set()
        return {
            int(i["instance_id"])
            for i in health.get("instances", ())
            if isinstance(i, Mapping) and i.get("endpoint") == "generate"
        }

    def model_listed(self) -> bool:
        try:
            return any(m.get("id") == self.served_model for m in self._get("/v1/models").get("data", ()))
        except DeploymentError:
            return False

    def kill(self, worker: Worker) -> None:
        """SIGKILL: no cleanup, no goodbye to the router or the peers."""
        if worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait(30)

    def stop(self, worker: Worker, timeout_s: float = 30.0) -> None:
        """SIGTERM: Dynamo's graceful shutdown (deregister, drain, ``cleanup``)."""
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
            try:
                worker.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(worker)

    def close(self) -> None:
        for worker in self.workers:
            self.stop(worker, timeout_s=15.0)
        self._stop_frontend()
        for handle in self._logs:
            handle.close()
        self._logs.clear()
        if self.control_plane is not None:
            self.control_plane.close()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def complete(
        self,
        prompt: Sequence[int] | str,
        *,
        max_tokens: int = 8,
        nvext: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/completions`` with token ids or text (``sampling``: e.g. temperature); the parsed response."""
        body: dict[str, Any] = {"model": self.served_model}
        body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        body["max_tokens"] = max_tokens
        body.update(sampling or {})
        if nvext:
            body["nvext"] = dict(nvext)
        return self._post("/v1/completions", body)

    def chat(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int = 8) -> dict[str, Any]:
        """``POST /v1/chat/completions``; the parsed response."""
        return self._post(
            "/v1/chat/completions", {"model": self.served_model, "messages": list(messages), "max_tokens": max_tokens}
        )

    def control(self, worker: Worker, name: str) -> dict[str, Any]:
        """``POST /engine/control/<name>`` on a worker's system port."""
        return _request(f"http://{worker.spec.host}:{worker.system_port}/engine/control/{name}", {})

    def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return _request(self.url + path, body)

    def _get(self, path: str) -> dict[str, Any]:
        return _request(self.url + path, None)

    # ------------------------------------------------------------------ reports

    def records(self) -> list[dict[str, Any]]:
        """Every request line of every worker's report."""
        return [r for w in self.workers for r in read_records(w.report) if r.get("event") == "request"]

    def record_of(self, reply: Mapping[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
        """The report line of the request behind a completion response (matched by request id)."""
        request_id = str(reply.get("id", "")).split("-", 1)[-1]
        deadline = time.monotonic() + timeout_s
        while True:
            for record in self.records():
                if record.get("request_id") == request_id:
                    return record
            if time.monotonic() > deadline:
                raise DeploymentError(f"no worker reported request {request_id}")
            time.sleep(0.05)


def read_records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line still being written
    return records


def _request(url: str, body: Mapping[str, Any] | None, timeout_s: float = 60.0) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            parsed: dict[str, Any] = json.loads(response.read())
            return parsed
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise DeploymentError(f"{url}: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DeploymentError(f"{url}: {exc}") from exc
