"""The kvcr Dynamo worker's settings: parsed once from the command line, checked, frozen.

Every bad value is a ConfigError naming the option, so ``kvcr worker`` can print one line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvcr.domain.endpoints import WILDCARD_HOSTS
from kvcr.domain.errors import ConfigError
from kvcr.domain.transports import CROSS_PROCESS
from kvcr.domain.units import parse_byte_size
from kvcr.integrations.shared.host import available_memory_bytes

PAGE_LAYER_BYTES = 2 * 2 * 128 * 2  # K and V, 2 heads x 128 dims, bf16: bytes per token per layer


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What one kvcr Dynamo worker runs with (see ``build_parser`` for each option's meaning)."""

    model: str
    name: str
    namespace: str = "dynamo"
    component: str = "kvcr"
    endpoint: str = "generate"
    discovery_backend: str = "file"
    event_plane: str = "zmq"
    host: str = "127.0.0.1"
    control_port: int = 0
    kv_events_port: int = 0
    page_tokens: int = 16
    page_bytes: int = 64 << 10
    host_pages: int = 256
    dram_bytes: int = 64 << 20
    hint_capability: bool = True
    max_tokens: int = 8
    token_delay_s: float = 0.0
    queue_delay_s: float = 0.0
    operation_timeout_ms: int = 2000
    report: str | None = None
    transport: str = "auto"
    metrics_port: int | None = None
    auth_token_file: str | None = None

    @property
    def layers(self) -> int:
        return self.page_bytes // (self.page_tokens * PAGE_LAYER_BYTES)

    @property
    def control_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.control_port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.kv_events_port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcr worker",
        description="A Dynamo worker whose KV pages live in SGLang's host pool with kvcr as the L3 tier "
        "(a deterministic stand-in replaces the model).",
    )
    p.add_argument("--model", required=True, help="model directory (tokenizer); also the served model name")
    p.add_argument("--name", default=None, help="this worker's name in logs and reports (default: pid)")
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--component", default="kvcr")
    p.add_argument("--endpoint", default="generate")
    p.add_argument(
        "--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"), help="Dynamo discovery"
    )
    p.add_argument(
        "--event-plane",
        choices=("zmq", "nats"),
        default=os.environ.get("DYN_EVENT_PLANE", "zmq"),
        help="Dynamo's event plane for KV events (nats reads NATS_SERVER)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address kvcr's control service and events use")
    p.add_argument("--control-port", type=int, required=True, help="kvcr peer control port (hints name it)")
    p.add_argument("--kv-events-port", type=int, required=True, help="port of kvcr's KV-event publisher")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page (the router's block size)")
    p.add_argument("--page-kib", type=int, default=64, help="KV bytes per page, in KiB (a multiple of 16)")
    p.add_argument("--host-pages", type=int, default=256, help="pages in SGLang's host pool")
    p.add_argument("--dram", default="64MiB", help="kvcr DRAM tier size")
    p.add_argument(
        "--no-hint-capability",
        action="store_true",
        help="do not publish the router_hint capability keys (the router then sends this worker no hints)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated when the request names none")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="stand-in decode time per token")
    p.add_argument("--queue-delay-ms", type=float, default=0.0, help="time a request waits before its storage prefetch")
    p.add_argument("--operation-timeout-ms", type=int, default=2000, help="kvcr peer operation timeout")
    p.add_argument("--report", default=None, help="append one JSON line per request to this file")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve kvcr's Prometheus series on this loopback port's /metrics (0: a free one; default: none)",
    )
    p.add_argument(
        "--transport",
        choices=CROSS_PROCESS,
        default="auto",
        help="kvcr's data plane for peer reads (every worker alike)",
    )
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="the cluster's kvcr token (needed when --host is not loopback; every worker alike)",
    )
    return p


def parse_worker_args(argv: Sequence[str] | None = None) -> WorkerSettings:
    """Parse and check the command line; ConfigError names the first bad option."""
    args = build_parser().parse_args(argv)
    checks = (
        ("--control-port", args.control_port, 1, 65535),
        ("--kv-events-port", args.kv_events_port, 1, 65535),
        ("--page-tokens", args.page_tokens, 1, 4096),
        ("--page-kib", args.page_kib, 16, 1 << 20),
        ("--host-pages", args.host_pages, 2, 1 << 24),
        ("--max-tokens", args.max_tokens, 1, 1 << 16),
        ("--operation-timeout-ms", args.operation_timeout_ms, 1, 600_000),
    )
    for option, value, low, high in checks:
        if not low <= value <= high:
            raise ConfigError(f"{option} must be in {low}..{high}, got {value}")
    page_bytes = args.page_kib << 10
    if page_bytes % (args.page_tokens * PAGE_LAYER_BYTES):
        raise ConfigError(
            f"--page-kib {args.page_kib} is not a whole number of layers "
            f"({args.page_tokens * PAGE_LAYER_BYTES} bytes per layer at {args.page_tokens} tokens per page)"
        )
    for option, delay in (("--token-delay-ms", args.token_delay_ms), ("--queue-delay-ms", args.queue_delay_ms)):
        if not 0 <= delay <= 60_000:
            raise ConfigError(f"{option} must be in 0..60000, got {delay}")
    if not args.host or args.host in WILDCARD_HOSTS:
        raise ConfigError(f"--host must be an address peers can dial, got {args.host!r}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if not os.path.isdir(args.model):
        raise ConfigError(
            f"--model {args.model!r} is not a directory: kvcr worker serves a local model directory "
            "(its tokenizer and config), and fetches nothing from a hub"
        )
    dram_bytes = parse_byte_size(args.dram, name="--dram")
    available = available_memory_bytes()
    if available is not None and dram_bytes > available:
        raise ConfigError(
            f"--dram {args.dram} ({dram_bytes} bytes) is more than this host has available "
            f"({available >> 20} MiB); lower --dram"
        )
    return WorkerSettings(
        model=args.model,
        name=args.name or f"worker-{os.getpid()}",
        namespace=args.namespace,
        component=args.component,
        endpoint=args.endpoint,
        discovery_backend=args.discovery_backend,
        event_plane=args.event_plane,
        auth_token_file=args.auth_token_file,
        host=args.host,
        control_port=args.control_port,
        kv_events_port=args.kv_events_port,
        page_tokens=args.page_tokens,
        page_bytes=page_bytes,
        host_pages=args.host_pages,
        dram_bytes=dram_bytes,
        hint_capability=not args.no_hint_capability,
        max_tokens=args.max_tokens,
        token_delay_s=args.token_delay_ms / 1000,
        queue_delay_s=args.queue_delay_ms / 1000,
        operation_timeout_ms=args.operation_timeout_ms,
        report=args.report,
        transport=args.transport,
        metrics_port=args.metrics_port,
    )
