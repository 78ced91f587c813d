"""``kvcr bench scale``: what a small local fleet sends Dynamo's KV router, the measured input of docs/scale.md.

``--workers`` stand-in kvcr workers behind Dynamo's frontend and KV router (file discovery, the
zmq event plane, loopback) serve ``--requests`` completions, ``--concurrency`` at a time: each
request is one of ``--prefixes`` shared prefixes of ``--prefix-pages`` pages plus a suffix of its
own, so the router sees both reuse and new pages. One SUB socket on every worker's KV-event
publisher (the stream the router reads, subscribed before the first request) counts what kvcr
publishes: messages, bytes on the wire (all frames), block-stored and block-removed updates.
Each worker's report gives the pages it computed (the prefill the events describe), the hints it
received and their size as they arrived.

Reported: KV-event bytes per prefill token and per stored block, block updates per second (the
router's index update rate), hints and hint bytes, requests answered. Throughput here is bounded
by two cores and the stand-in model; the per-token and per-block figures are what scale.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PAGE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ScaleOptions:
    workers: int = 8
    requests: int = 320
    concurrency: int = 8
    prefixes: int = 16
    prefix_pages: int = 8
    suffix_tokens: int = 64
    dram: str = "16MiB"  # per worker: 256 pages of 64 KiB, small enough that evictions (BlockRemoved) happen
    workdir: str | None = None


@dataclass
class EventTally:
    """What one worker's KV-event publisher sent, as a subscriber received it."""

    messages: int = 0
    wire_bytes: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    events: int = 0

    def add(self, frames: Sequence[bytes]) -> None:
        import msgpack

        self.messages += 1
        self.wire_bytes += sum(len(f) for f in frames)
        _ts, events, _dp_rank = msgpack.unpackb(frames[-1], raw=False)
        for event in events:
            self.events += 1
            hashes = len(event.get("block_hashes") or ())
            if event.get("type") == "BlockStored":
                self.stored_blocks += hashes
            elif event.get("type") == "BlockRemoved":
                self.removed_blocks += hashes


@dataclass
class ScaleResult:
    options: ScaleOptions
    answered: int
    failed: int
    seconds: float
    prompt_tokens: int
    computed_tokens: int
    hints: int
    hint_bytes: list[int] = field(default_factory=list)
    hint_pages: list[int] = field(default_factory=list)
    tally: dict[str, EventTally] = field(default_factory=dict)

    def total(self, name: str) -> int:
        return sum(int(getattr(t, name)) for t in self.tally.values())

    @property
    def bytes_per_prefill_token(self) -> float:
        return self.total("wire_bytes") / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def bytes_per_stored_block(self) -> float:
        stored = self.total("stored_blocks")
        return self.total("wire_bytes") / stored if stored else 0.0

    @property
    def block_updates_per_s(self) -> float:
        return (self.total("stored_blocks") + self.total("removed_blocks")) / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out |= {
            "bytes_per_prefill_token": self.bytes_per_prefill_token,
            "bytes_per_stored_block": self.bytes_per_stored_block,
            "block_updates_per_s": self.block_updates_per_s,
            "messages_per_s": self.total("messages") / self.seconds if self.seconds else 0.0,
        }
        return out


class Subscribers:
    """A SUB socket per KV-event endpoint, drained by one thread until ``close``."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        import zmq

        self._context = zmq.Context()
        self._poller = zmq.Poller()
        self._names: dict[Any, str] = {}
        self.tally = {name: EventTally() for name in endpoints}
        for name, endpoint in endpoints.items():
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            self._poller.register(socket, zmq.POLLIN)
            self._names[socket] = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            for socket, _ in self._poller.poll(50):
                self.tally[self._names[socket]].add(socket.recv_multipart())

    def close(self) -> None:
        time.sleep(0.5)  # the last batches in flight
        self._stop.set()
        self._thread.join(5)
        for socket in self._names:
            socket.close()
        self._context.term()


def _prompt(options: ScaleOptions, request: int) -> list[int]:
    prefix = request % options.prefixes
    shared = [3 + (prefix * 997 + i) % 1000 for i in range(options.prefix_pages * PAGE_TOKENS)]
    own = [3 + (request * 131 + i * 7) % 1000 for i in range(options.suffix_tokens)]
    return shared + own


def run_scale(options: ScaleOptions) -> ScaleResult:
    """Start the fleet, run the requests, return the tallies (raises DeploymentError if it cannot start)."""
    import tempfile

    from kvcr.demo.dynamo.deployment import Deployment, DeploymentError, WorkerSpec

    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(options.workdir or scratch)
        with Deployment(workdir / "deployment", page_tokens=PAGE_TOKENS) as deployment:
            deployment.start_frontend()
            workers = [
                deployment.start_worker(WorkerSpec(f"w{i}", host_pages=512, dram=options.dram, max_tokens=4))
                for i in range(options.workers)
            ]
            deployment.wait_ready(workers, timeout_s=60.0 + 20.0 * options.workers)
            subscribers = Subscribers({w.spec.name: f"tcp://127.0.0.1:{w.events_port}" for w in workers})
            time.sleep(1.0)  # ZMQ's slow joiner: the SUBs are attached before the first batch
            failed = [0]

            def one(request: int) -> None:
                try:
                    deployment.complete(_prompt(options, request), max_tokens=4)
                except DeploymentError:
                    failed[0] += 1

            started = time.monotonic()
            with ThreadPoolExecutor(options.concurrency) as pool:
                list(pool.map(one, range(options.requests)))
            seconds = time.monotonic() - started
            subscribers.close()
            records = deployment.records()
    hinted = [r for r in records if r.get("hint")]
    return ScaleResult(
        options=options,
        answered=options.requests - failed[0],
        failed=failed[0],
        seconds=seconds,
        prompt_tokens=sum(int(r["prompt_tokens"]) for r in records),
        computed_tokens=sum(int(r["computed_pages"]) for r in records) * PAGE_TOKENS,
        hints=len(hinted),
        hint_bytes=[int(r.get("hint_bytes") or 0) for r in hinted],
        hint_pages=[int(r.get("hint_pages") or 0) for r in hinted],
        tally=subscribers.tally,
    )


def scale_table(result: ScaleResult) -> str:
    o = result.options
    hint_bytes = result.hint_bytes or [0]
    hint_pages = result.hint_pages or [0]
    rows = [
        ("workers x requests (concurrency)", f"{o.workers} x {o.requests} ({o.concurrency})"),
        ("answered / failed", f"{result.answered} / {result.failed} in {result.seconds:.1f} s"),
        ("prompt tokens / computed (prefill) tokens", f"{result.prompt_tokens} / {result.computed_tokens}"),
        ("KV-event messages / events", f"{result.total('messages')} / {result.total('events')}"),
        ("blocks stored / removed", f"{result.total('stored_blocks')} / {result.total('removed_blocks')}"),
        ("KV-event bytes on the wire", str(result.total("wire_bytes"))),
        ("bytes per prefill token", f"{result.bytes_per_prefill_token:.1f}"),
        ("bytes per stored block", f"{result.bytes_per_stored_block:.1f}"),
        ("router index updates (blocks) per s", f"{result.block_updates_per_s:.0f}"),
        ("hinted requests", str(result.hints)),
        ("hint bytes median / max", f"{statistics.median(hint_bytes):.0f} / {max(hint_bytes)}"),
        ("pages per hint median / max", f"{statistics.median(hint_pages):.0f} / {max(hint_pages)}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def write_json(result: ScaleResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.as_dict(), indent=2, default=str))
