"""``kvcr soak``: replicas under a mixed load for N minutes, then a count of everything that went wrong.

Each replica (``kvcr.soak.replica``) runs SGLang's two storage threads' worth of load on its own:
a backup thread writing prompts it owns (its kvcr DRAM is small, so backups evict), and a prefetch
thread doing local restores of its own prompts and hinted remote restores of the others'
(hints go stale as owners evict: those are misses). Every restored page is checked against its
key's bytes; every destination page is poisoned after its call and checked before its next use.
This process polls the replicas, serves the figures on ``--metrics-port`` and, at the end, stops
the load, closes every backend and counts what each left behind.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvcr.domain.errors import ConfigError
from kvcr.domain.transports import TRANSPORT_NAMES
from kvcr.soak.processes import Replica, ReplicaError
from kvcr.soak.replica import LAYER_PAGE_BYTES, ReplicaOptions
from kvcr.testing.ports import free_port_block

KINDS = ("backup", "local_restore", "remote_restore")
LEAKS = ("leaked_threads", "leaked_fds", "nixl_registrations", "live_transfers", "nixl_agents")
_POLL_TIMEOUT_S = 30.0  # a replica that does not answer a stats poll this long is hung


@dataclass(frozen=True)
class SoakOptions:
    """What a soak run does (``kvcr soak --help`` says the same per option)."""

    replicas: int = 4
    minutes: float = 10.0
    page_kib: int = 256
    dram_pages: int = 48
    host_pages: int = 128
    prompt_pages: int = 8
    prompts: int = 24
    pause_ms: float = 5.0
    remote_share: float = 0.5
    seed: int = 0
    operation_timeout_ms: int = 2000
    tls: str = "default"
    report_every_s: float = 10.0
    transport: str = "auto"  # kvcr's default: four replicas on one host read each other over shm

    def __post_init__(self) -> None:
        checks = [
            (self.replicas >= 2, f"--replicas must be at least 2, got {self.replicas}"),
            (self.minutes > 0, f"--minutes must be positive, got {self.minutes:g}"),
            (
                self.page_kib > 0 and self.page_kib % (LAYER_PAGE_BYTES >> 10) == 0,
                f"--page-kib must be a positive multiple of {LAYER_PAGE_BYTES >> 10}, got {self.page_kib}",
            ),
            (self.prompt_pages >= 1, f"--prompt-pages must be positive, got {self.prompt_pages}"),
            (
                2 * self.prompt_pages <= self.host_pages,
                f"--host-pages ({self.host_pages}) must hold two prompts of --prompt-pages ({self.prompt_pages})",
            ),
            (self.dram_pages >= 2, f"--dram-pages must be at least 2, got {self.dram_pages}"),
            (self.prompts >= 1, f"--prompts must be positive, got {self.prompts}"),
            (self.pause_ms >= 0, f"--pause-ms must not be negative, got {self.pause_ms:g}"),
            (0 <= self.remote_share <= 1, f"--remote-share must be in [0, 1], got {self.remote_share:g}"),
            (
                self.operation_timeout_ms > 0,
                f"--operation-timeout-ms must be positive, got {self.operation_timeout_ms}",
            ),
            (self.tls in ("default", "tcp"), f"--tls must be default or tcp, got {self.tls!r}"),
            (
                self.transport in TRANSPORT_NAMES,
                f"--transport must be one of {', '.join(TRANSPORT_NAMES)}, got {self.transport!r}",
            ),
            (self.report_every_s > 0, f"--report-every-s must be positive, got {self.report_every_s:g}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass
class ReplicaFigures:
    """One replica's figures: the last stats poll, RSS over the run, what it left after close."""

    name: str
    pid: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    rss_warm: int = 0  # RSS once warmed up (the baseline of the growth figure)
    rss_end: int = 0
    peak_rss: int = 0
    closed: dict[str, Any] | None = None
    alive_until_close: bool = True
    hung: bool = False

    def kind(self, kind: str) -> dict[str, Any]:
        kinds: dict[str, Any] = self.stats.get("kinds", {})
        return dict(kinds.get(kind, {}))


@dataclass
class SoakReport:
    """Everything a soak run counted; ``ok`` only if nothing went wrong."""

    options: SoakOptions
    seconds: float
    replicas: list[ReplicaFigures]

    def total(self, kind: str, what: str) -> float:
        return sum(float(r.kind(kind).get(what, 0)) for r in self.replicas)

    @property
    def wrong_bytes(self) -> int:
        return int(sum(self.total(kind, "wrong_bytes") + self.total(kind, "late_bytes") for kind in KINDS))

    @property
    def hangs(self) -> int:
        return int(sum(self.total(kind, "hangs") for kind in KINDS)) + sum(r.hung for r in self.replicas)

    @property
    def exceptions(self) -> int:
        return int(sum(self.total(kind, "exceptions") for kind in (*KINDS, "workload")))

    @property
    def leaks(self) -> dict[str, int]:
        out = dict.fromkeys(LEAKS, 0)
        for r in self.replicas:
            for name in LEAKS:
                out[name] += int((r.closed or {}).get(name, 0))
        return out

    @property
    def ok(self) -> bool:
        closed = all(r.closed is not None and r.closed.get("error") is None for r in self.replicas)
        alive = all(r.alive_until_close for r in self.replicas)
        remote = self.total("remote_restore", "restored") > 0
        return (
            closed
            and alive
            and remote
            and not self.wrong_bytes
            and not self.hangs
            and not self.exceptions
            and not any(self.leaks.values())
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "options": vars(self.options),
            "seconds": self.seconds,
            "ok": self.ok,
            "operations": {kind: int(self.total(kind, "ops")) for kind in KINDS},
            "pages_restored": {kind: int(self.total(kind, "restored")) for kind in KINDS},
            "wrong_bytes": self.wrong_bytes,
            "hangs": self.hangs,
            "exceptions": self.exceptions,
            "leaks": self.leaks,
            "replicas": [
                {
                    "name": r.name,
                    "pid": r.pid,
                    "kinds": {kind: r.kind(kind) for kind in KINDS},
                    "rss_warm": r.rss_warm,
                    "rss_end": r.rss_end,
                    "rss_growth": r.rss_end - r.rss_warm,
                    "peak_rss": r.peak_rss,
                    "logs": r.stats.get("logs", {}),
                    "first_logs": r.stats.get("first_logs", []),
                    "closed": r.closed,
                    "alive_until_close": r.alive_until_close,
                    "hung": r.hung,
                }
                for r in self.replicas
            ],
        }

    def table(self) -> str:
        mib = 1 << 20
        lines = [
            f"soak: {len(self.replicas)} replicas, {self.seconds / 60:.1f} min, "
            f"{self.options.page_kib} KiB pages, DRAM {self.options.dram_pages} pages each",
            f"{'replica':8} {'kind':15} {'ops':>7} {'pages':>8} {'restored':>8} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'max ms':>7} {'wrong':>5} {'hangs':>5} {'exc':>4}",
        ]
        for r in self.replicas:
            for kind in KINDS:
                k = r.kind(kind)
                wrong = int(k.get("wrong_bytes", 0) + k.get("late_bytes", 0))
                lines.append(
                    f"{r.name:8} {kind:15} {k.get('ops', 0):>7} {k.get('pages', 0):>8} {k.get('restored', 0):>8} "
                    f"{k.get('p50_s', 0) * 1e3:>7.2f} {k.get('p99_s', 0) * 1e3:>7.2f} {k.get('max_s', 0) * 1e3:>7.1f} "
                    f"{wrong:>5} {k.get('hangs', 0):>5} {k.get('exceptions', 0):>4}"
                )
        lines.append(f"{'replica':8} {'RSS warm MiB':>12} {'end':>7} {'growth':>7} {'peak':>7}  left after close")
        for r in self.replicas:
            left = ", ".join(f"{name} {int((r.closed or {}).get(name, 0))}" for name in LEAKS)
            lines.append(
                f"{r.name:8} {r.rss_warm / mib:>12.1f} {r.rss_end / mib:>7.1f} {(r.rss_end - r.rss_warm) / mib:>7.1f} "
                f"{r.peak_rss / mib:>7.1f}  {left if r.closed is not None else 'did not close'}"
            )
        ops = ", ".join(f"{kind} {int(self.total(kind, 'ops'))}" for kind in KINDS)
        lines.append(f"operations: {ops}")
        lines.append(
            f"wrong bytes {self.wrong_bytes}, hangs {self.hangs}, exceptions {self.exceptions}, "
            f"leaks {sum(self.leaks.values())}: {'OK' if self.ok else 'FAILED'}"
        )
        return "\n".join(lines)


def run_soak(
    options: SoakOptions, *, progress: Callable[[str], None] = print, metrics_port: int | None = None
) -> SoakReport:
    """Start the replicas, run the load for ``options.minutes``, stop, close, count."""
    figures = [ReplicaFigures(f"r{i}") for i in range(options.replicas)]
    with _exporter(figures, metrics_port, progress), _replicas(options, progress) as replicas:
        for fig, replica in zip(figures, replicas, strict=True):
            fig.pid = replica.pid
        per = options.prompts
        owned = {i: list(range(i * per, (i + 1) * per)) for i in range(options.replicas)}
        for i, replica in enumerate(replicas):
            plan = {
                "own_prompts": owned[i],
                "peers": [{"endpoint": r.endpoint, "prompts": owned[j]} for j, r in enumerate(replicas) if j != i],
                "prompt_pages": options.prompt_pages,
                "rng_seed": options.seed * 1000 + i,
                "remote_share": options.remote_share,
                "pause_s": options.pause_ms / 1000,
                "seed": options.seed,
            }
            replica.ask("workload", plan=plan)
        started = time.monotonic()
        duration = options.minutes * 60
        warm_at = started + min(max(10.0, duration / 6), duration / 2)
        warmed = False
        while True:
            now = time.monotonic()
            if now - started >= duration:
                break
            time.sleep(min(options.report_every_s, duration - (now - started)))
            _poll(replicas, figures)
            if not warmed and time.monotonic() >= warm_at:
                warmed = True
                for fig in figures:
                    fig.rss_warm = int(fig.stats.get("rss", 0))
            progress(_progress_line(figures, time.monotonic() - started))
        seconds = time.monotonic() - started
        for fig, replica in zip(figures, replicas, strict=True):
            fig.alive_until_close = replica.alive
            try:
                if replica.ask("halt", timeout_s=_POLL_TIMEOUT_S + 30)["stuck_threads"]:
                    fig.hung = True
            except ReplicaError:
                fig.hung = True
        _poll(replicas, figures)
        for fig in figures:
            fig.rss_end = int(fig.stats.get("rss", 0))
            fig.peak_rss = int(fig.stats.get("peak_rss", 0))
            if not warmed:
                fig.rss_warm = int(fig.stats.get("rss_start", 0))
        for fig, replica in zip(figures, replicas, strict=True):
            fig.closed = replica.close()
    return SoakReport(options, seconds, figures)


def _poll(replicas: list[Replica], figures: list[ReplicaFigures]) -> None:
    for fig, replica in zip(figures, replicas, strict=True):
        if fig.hung:
            continue
        try:
            fig.stats = replica.ask("stats", timeout_s=_POLL_TIMEOUT_S)
        except ReplicaError:
            fig.hung = True
            fig.alive_until_close = replica.alive


def _progress_line(figures: list[ReplicaFigures], elapsed_s: float) -> str:
    ops = {kind: sum(int(f.kind(kind).get("ops", 0)) for f in figures) for kind in KINDS}
    wrong = sum(int(f.kind(k).get("wrong_bytes", 0) + f.kind(k).get("late_bytes", 0)) for f in figures for k in KINDS)
    hangs = sum(int(f.kind(k).get("hangs", 0)) for f in figures for k in KINDS) + sum(f.hung for f in figures)
    rss = max((int(f.stats.get("rss", 0)) for f in figures), default=0) >> 20
    return (
        f"[{elapsed_s:6.0f}s] backups {ops['backup']}, local restores {ops['local_restore']}, "
        f"remote restores {ops['remote_restore']}; wrong bytes {wrong}, hangs {hangs}, max RSS {rss} MiB"
    )


@contextlib.contextmanager
def _replicas(options: SoakOptions, progress: Callable[[str], None]) -> Iterator[list[Replica]]:
    layers = options.page_kib * 1024 // LAYER_PAGE_BYTES
    env = {"UCX_TLS": "tcp"} if options.tls == "tcp" else {}
    settings = {
        "operation_timeout_ms": options.operation_timeout_ms,
        "abandon_timeout_ms": 2 * options.operation_timeout_ms,
        "transport": options.transport,
    }
    made: list[Replica] = []
    try:
        port = free_port_block(options.replicas)
        progress(f"starting {options.replicas} replicas (SGLang host pools, kvcr over {options.transport}) ...")
        for i in range(options.replicas):
            made.append(
                Replica(
                    ReplicaOptions(
                        f"r{i}",
                        layers=layers,
                        host_pages=options.host_pages,
                        dram_pages=options.dram_pages,
                        port=port + i,
                        settings=settings,
                        env=env,
                    )
                )
            )
        yield made
    finally:
        for replica in made:
            with contextlib.suppress(Exception):
                if replica.process.is_alive():
                    replica.kill()


@contextlib.contextmanager
def _exporter(figures: list[ReplicaFigures], port: int | None, progress: Callable[[str], None]) -> Iterator[None]:
    if port is None:
        yield
        return
    from prometheus_client import CollectorRegistry

    from kvcr.adapters.prometheus import start_exporter

    registry = CollectorRegistry()
    registry.register(_Collector(figures))
    server = start_exporter(registry, port)
    progress(f"soak metrics on {server.url}")
    try:
        yield
    finally:
        server.close()


class _Collector:
    """The soak's figures as Prometheus series, read from the replicas' last stats poll."""

    def __init__(self, figures: list[ReplicaFigures]) -> None:
        self._figures = figures
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ops = CounterMetricFamily("kvcr_soak_operations", "Backend calls the soak made", labels=["replica", "kind"])
        pages = CounterMetricFamily(
            "kvcr_soak_pages",
            "Pages asked for and restored (stored, for backups)",
            labels=["replica", "kind", "outcome"],
        )
        wrong = CounterMetricFamily(
            "kvcr_soak_wrong_bytes", "Bytes restored wrong, or landing after their call returned", labels=["replica"]
        )
        hangs = CounterMetricFamily(
            "kvcr_soak_hangs",
            "Calls slower than operation_timeout_ms + 1 s, or replicas not answering",
            labels=["replica"],
        )
        errors = CounterMetricFamily("kvcr_soak_exceptions", "Exceptions raised by backend calls", labels=["replica"])
        slowest = GaugeMetricFamily("kvcr_soak_call_seconds_max", "Slowest call so far", labels=["replica", "kind"])
        rss = GaugeMetricFamily("kvcr_soak_rss_bytes", "Resident memory of each replica", labels=["replica"])
        peak = GaugeMetricFamily("kvcr_soak_peak_rss_bytes", "Peak resident memory of each replica", labels=["replica"])
        with self._lock:
            figures = list(self._figures)
        for fig in figures:
            bad = hung = exceptions = 0.0
            for kind in KINDS:
                k = fig.kind(kind)
                ops.add_metric([fig.name, kind], k.get("ops", 0))
                pages.add_metric([fig.name, kind, "asked"], k.get("pages", 0))
                pages.add_metric([fig.name, kind, "restored"], k.get("restored", 0))
                slowest.add_metric([fig.name, kind], k.get("max_s", 0.0))
                bad += k.get("wrong_bytes", 0) + k.get("late_bytes", 0)
                hung += k.get("hangs", 0)
                exceptions += k.get("exceptions", 0)
            wrong.add_metric([fig.name], bad)
            hangs.add_metric([fig.name], hung + fig.hung)
            errors.add_metric([fig.name], exceptions)
            rss.add_metric([fig.name], fig.stats.get("rss", 0))
            peak.add_metric([fig.name], fig.stats.get("peak_rss", 0))
        yield from (ops, pages, wrong, hangs, errors, slowest, rss, peak)
