"""``kvcr demo``: Dynamo's frontend and KV router in front of kvcr workers, a multi-turn workload.

One command starts ``python -m dynamo.frontend --router-mode kv`` and ``--workers`` kvcr workers
(SGLang's host pool and controller over kvcr, NIXL between workers; see
``kvcr.demo.dynamo.worker``) on loopback, then replays conversations through the OpenAI
chat API: every conversation starts with the same system prompt and each turn extends the
previous one, so each prompt's pages are somewhere in some worker's kvcr. The router sends a turn
where its cost model says (prefix overlap against load); when the worker it picks lacks the
prefix that another holds, the router attaches a ``kv.fetch`` hint and the worker leases and
reads those pages from the peer. The first conversation's first turn goes alone, so the system
prompt is computed once; the others then start a little apart. The table at the end comes from the workers' own
reports (and the prefill tokens saved from the HTTP responses' usage); every restored page is
checked against the bytes its prefix determines.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcr.demo.dynamo.control_plane import ControlPlaneError
from kvcr.demo.dynamo.deployment import Deployment, DeploymentError, WorkerSpec
from kvcr.demo.dynamo.tiny_model import word
from kvcr.domain.units import format_byte_size

PAGE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class DemoOptions:
    workers: int = 2
    turns: int = 4
    page_kib: int = 64
    conversations: int | None = None  # default: two per worker
    plot: str | None = None
    workdir: str | None = None
    quiet: bool = False
    system_pages: int = 8
    user_words: int = 96
    reply_tokens: int = 16
    token_delay_ms: float = 20.0
    stagger_s: float = 0.15
    transport: str = "auto"
    metrics_port: int | None = None  # worker i serves /metrics on this port + i
    discovery: str = "file"  # or "etcd": an etcd server the deployment starts
    event_plane: str = "zmq"  # or "nats": a NATS server the deployment starts

    @property
    def conversation_count(self) -> int:
        return self.conversations or 2 * self.workers


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    failed: int
    hinted: int
    backed_up_pages: int
    local_pages: int
    peer_pages: int
    computed_pages: int
    restored_bytes: int
    restore_s: float
    latencies_ms: tuple[float, ...]
    saved_tokens_http: int
    saved_tokens_reported: int
    mismatched_pages: int

    @property
    def restored_pages(self) -> int:
        return self.local_pages + self.peer_pages

    @property
    def gbps(self) -> float:
        return self.restored_bytes / self.restore_s / 1e9 if self.restore_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.mismatched_pages and self.peer_pages > 0


def summarize(records: Sequence[Mapping[str, Any]], replies: Sequence[Mapping[str, Any]], failed: int) -> Summary:
    restoring = [r for r in records if r["local_pages"] + r["peer_pages"]]
    return Summary(
        requests=len(records),
        failed=failed,
        hinted=sum(bool(r["hint"]) for r in records),
        backed_up_pages=sum(r["backed_up_pages"] for r in records),
        local_pages=sum(r["local_pages"] for r in records),
        peer_pages=sum(r["peer_pages"] for r in records),
        computed_pages=sum(r["computed_pages"] for r in records),
        restored_bytes=sum(r["restored_bytes"] for r in records),
        restore_s=sum(r["restore_s"] for r in restoring),
        latencies_ms=tuple(sorted(r["restore_s"] * 1000 for r in restoring)),
        saved_tokens_http=sum(
            int(((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            for reply in replies
        ),
        saved_tokens_reported=sum((r["local_pages"] + r["peer_pages"]) * PAGE_TOKENS for r in records),
        mismatched_pages=sum(r["mismatched_pages"] for r in records),
    )


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


def _ms(sorted_values: Sequence[float], q: float) -> str:
    return f"{percentile(sorted_values, q):.1f}"


def _system_prompt(options: DemoOptions) -> str:
    return " ".join(word(i) for i in range(1000, 1000 + options.system_pages * PAGE_TOKENS))


def _user_turn(options: DemoOptions, conversation: int, turn: int) -> str:
    base = 100 + (conversation * 37 + turn * 11) % 800
    return " ".join(word(base + i) for i in range(options.user_words))


class _Workload:
    """Conversations in threads, each turn after the previous one's reply."""

    def __init__(self, deployment: Deployment, options: DemoOptions, on_reply: Any) -> None:
        self.deployment = deployment
        self.options = options
        self.on_reply = on_reply
        self.replies: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._first_turn_done = threading.Event()

    def run(self) -> None:
        """Conversation 0 first; the others start once its first turn is answered, a little apart.

        So the shared system prompt is in one worker's kvcr (and the router's index) before any
        other conversation asks for it.
        """
        threads = [
            threading.Thread(target=self._conversation, args=(c,), daemon=True)
            for c in range(self.options.conversation_count)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)

    def _conversation(self, conversation: int) -> None:
        o = self.options
        if conversation:
            self._first_turn_done.wait(120)
            time.sleep(conversation * o.stagger_s)
        messages = [{"role": "system", "content": _system_prompt(o)}]
        for turn in range(o.turns):
            messages.append({"role": "user", "content": _user_turn(o, conversation, turn)})
            try:
                reply = self.deployment.chat(messages, max_tokens=o.reply_tokens)
                text = str(reply["choices"][0]["message"]["content"])
            except (DeploymentError, KeyError, IndexError, TypeError) as exc:
                with self._lock:
                    self.errors.append(f"conversation {conversation} turn {turn}: {exc}")
                self.on_reply()
                self._first_turn_done.set()
                return
            messages.append({"role": "assistant", "content": text})
            with self._lock:
                self.replies.append(reply)
            self.on_reply()
            self._first_turn_done.set()


def run_cluster_demo(options: DemoOptions) -> int:
    """Run the demo; 0 when every request was answered, every restored page verified, >= 1 from a peer."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(quiet=options.quiet)  # progress and start-up lines
    results = Console()  # failures, the tables and the verdict: printed even with --quiet
    total = options.conversation_count * options.turns
    started = time.monotonic()
    with ExitStack() as stack:
        workdir = Path(options.workdir) if options.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        deployment = stack.enter_context(
            Deployment(
                workdir / "deployment",
                page_tokens=PAGE_TOKENS,
                discovery_backend=options.discovery,
                event_plane=options.event_plane,
            )
        )
        servers = [
            name for name, on in (("etcd", options.discovery == "etcd"), ("NATS", options.event_plane == "nats")) if on
        ]
        starting = ", ".join([*servers, "Dynamo's frontend (KV router)"])
        with console.status(f"starting {starting} and {options.workers} kvcr workers"):
            try:
                deployment.start_frontend()
            except ControlPlaneError as exc:
                results.print(f"[red]kvcr demo: {exc}[/red]")
                return 1
            workers = [
                deployment.start_worker(
                    WorkerSpec(
                        f"worker-{i}",
                        page_kib=options.page_kib,
                        host_pages=512,
                        dram="256MiB",
                        max_tokens=options.reply_tokens,
                        token_delay_ms=options.token_delay_ms,
                        transport=options.transport,
                        metrics_port=None if options.metrics_port is None else options.metrics_port + i,
                    )
                )
                for i in range(options.workers)
            ]
            try:
                deployment.wait_ready(workers)
            except DeploymentError as exc:
                results.print(f"[red]kvcr demo: {exc}[/red]")
                return 1
        console.print(
            f"frontend {deployment.url} (router-mode kv, {options.discovery} discovery, "
            f"{options.event_plane} event plane), {options.workers} workers over {options.transport}, "
            f"{options.page_kib} KiB pages of {PAGE_TOKENS} tokens; ready after {time.monotonic() - started:.0f} s"
        )
        if options.metrics_port is not None:
            console.print("kvcr metrics: " + ", ".join(f"{w.spec.name} {w.metrics_url}" for w in workers))
        progress = Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        with progress:
            task = progress.add_task(
                f"{options.conversation_count} conversations x {options.turns} turns through /v1/chat/completions",
                total=total,
            )
            workload = _Workload(deployment, options, lambda: progress.advance(task))
            workload.run()
        records = sorted(deployment.records(), key=lambda r: float(r.get("time", 0.0)))
        summary = summarize(records, workload.replies, failed=total - len(workload.replies))
        for error in workload.errors[:5]:
            results.print(f"[red]{error}[/red]")
        results.print(_table(summary, options))
        results.print(_per_worker(records))
        if options.plot:
            _plot(records, Path(options.plot))
            console.print(f"plot written to {options.plot}")
    verdict = _verdict(summary)
    results.print(verdict)
    return 0 if summary.ok else 1


def _verdict(s: Summary) -> str:
    if s.failed:
        return f"[red]FAILED: {s.failed} requests got no answer[/red]"
    if s.mismatched_pages:
        return f"[red]FAILED: {s.mismatched_pages} restored pages differ from the bytes their prefix determines[/red]"
    if not s.peer_pages:
        return "[yellow]no page was restored from a peer: every turn was routed to its prefix's holder[/yellow]"
    return (
        f"[green]OK: {s.restored_pages} restored pages verified, {s.peer_pages} of them read from a peer "
        f"on the router's hint[/green]"
    )


def _table(s: Summary, options: DemoOptions) -> Any:
    from rich.table import Table

    table = Table(title="kvcr behind Dynamo's KV router", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    verified = (
        "n/a (nothing restored)" if not s.restored_pages else "all match" if not s.mismatched_pages else "MISMATCH"
    )
    rows = [
        ("requests (answered / sent)", f"{s.requests} / {s.requests + s.failed}"),
        ("requests with a router hint", str(s.hinted)),
        ("pages backed up to kvcr", str(s.backed_up_pages)),
        ("pages restored locally", str(s.local_pages)),
        ("pages restored from a peer", str(s.peer_pages)),
        ("pages computed", str(s.computed_pages)),
        ("bytes restored", format_byte_size(s.restored_bytes)),
        ("restore GB/s (bytes / prefetch time)", f"{s.gbps:.2f}"),
        (
            "restore latency p50 / p99",
            f"{percentile(s.latencies_ms, 50):.1f} / {percentile(s.latencies_ms, 99):.1f} ms",
        ),
        ("prefill tokens saved (HTTP usage)", f"{s.saved_tokens_http} (workers report {s.saved_tokens_reported})"),
        ("verification of restored pages", f"{verified} ({s.restored_pages} pages)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _per_worker(records: Sequence[Mapping[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="per worker", header_style="bold")
    for column in ("worker", "requests", "hinted", "local", "from peer", "computed", "backed up"):
        table.add_column(column, justify="right" if column != "worker" else "left")
    for name in sorted({str(r["worker"]) for r in records}):
        mine = [r for r in records if r["worker"] == name]
        table.add_row(
            name,
            str(len(mine)),
            str(sum(bool(r["hint"]) for r in mine)),
            *(str(sum(r[k] for r in mine)) for k in ("local_pages", "peer_pages", "computed_pages", "backed_up_pages")),
        )
    return table


def _plot(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(1, len(records) + 1))
    local = [r["local_pages"] for r in records]
    peer = [r["peer_pages"] for r in records]
    computed = [r["computed_pages"] for r in records]
    fig, (pages, latency) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    pages.bar(x, local, label="restored locally", color="tab:green")
    pages.bar(x, peer, bottom=local, label="restored from a peer (router hint)", color="tab:blue")
    pages.bar(x, computed, bottom=[a + b for a, b in zip(local, peer, strict=True)], label="computed", color="0.7")
    pages.set_ylabel("prompt pages")
    pages.legend(loc="upper left")
    pages.set_title("Each request's prompt pages, in the order the workers served them")
    restoring = [(i, r) for i, r in zip(x, records, strict=True) if r["local_pages"] + r["peer_pages"]]
    latency.scatter(
        [i for i, _ in restoring],
        [r["restore_s"] * 1000 for _, r in restoring],
        c=["tab:blue" if r["peer_pages"] else "tab:green" for _, r in restoring],
    )
    latency.set_ylabel("restore latency (ms)")
    latency.set_title("Restore latency of the requests that restored pages (blue: some from a peer)")
    latency.set_xlabel("request")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
