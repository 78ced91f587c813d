"""``kvcr demo`` (``--engine sglang``, the default): Dynamo's frontend and KV router in front of real SGLang engines.

The workers are Dynamo's own ``python -m dynamo.sglang`` (a real SGLang 0.5.23 engine each: its
scheduler, radix tree and HiCache controller) with kvcr as HiCache's L3, started as an operator
would (``kvcr.demo.dynamo.sglang_workers``), on the CPU with a real trained model, SmolLM2-135M-Instruct
(``kvcr.testing.real_model``). Conversations go through ``/v1/completions`` as token ids in the
model's chat format (a shared system prompt quoting Python's reference documentation, each turn
extending the last with the reply and a new user message that quotes more and asks a question),
greedy. Whatever the router
decides, routing a turn to the worker that lacks its prefix attaches a hint, and that worker's
kvcr reads the prefix from the peer's kvcr DRAM.

Conversation 0's first turn goes alone; once its worker's kvcr holds the system prompt's pages, every
conversation's next turn is sent at once. The router's cost model weighs a worker's prefix overlap
against the blocks of the requests it is already running: with several turns in flight on the
worker holding the system prompt, a cold worker wins some of them, and those get the hint. (Sent one
after another, on a machine fast enough to answer each turn before the next arrives, every turn
would go to the holder and no peer would serve anything.)

The story is the tier: each engine's GPU pool holds 1,024 tokens and its host pool (L2) twice that,
far less than the conversations. Before each later round, other users' one-off prompts (16 of 600
tokens, routed like any request) push every conversation's history out of both pools; kvcr's DRAM
keeps it, and says so on SGLang's own KV-event stream, so the router still knows who holds what.
A conversation that comes back is then restored from kvcr DRAM by the worker that holds it, or
read from that worker's kvcr by the other one on the router's hint, whichever the router picks:
the table shows both.

What the table reports comes from the engines and kvcr themselves: prefill tokens saved from the
responses' ``usage.prompt_tokens_details.cached_tokens`` (SGLang's count), pages from each
worker's ``kvcr_pages_total`` on its own ``/metrics``. Then the workers stop and one more SGLang
server with no cache at all (no HiCache, no kvcr, no radix tree) answers every request again:
every answer must equal the one computed without reuse.

The stand-in-model demo (``kvcr demo --engine stand-in``) stays the better tool for many workers, for checking
every restored page against the bytes its prefix determines, for latency plots and for the
etcd/NATS control plane: it starts in seconds and its pages are checkable byte for byte.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kvcr.demo.dynamo.control_plane import ControlPlaneError
from kvcr.demo.dynamo.deployment import Deployment, DeploymentError
from kvcr.demo.dynamo.sglang_workers import (
    SglangWorker,
    SglangWorkerSpec,
    start_sglang_worker,
    wait_sglang_ready,
)
from kvcr.testing.engine import PAGE_SIZE, EngineError, EngineServer, wait_for
from kvcr.testing.real_model import MODEL_NAME, SERVE_ARGS, RealModelError, encode, real_model, reference_ids

KVCR_PATHS = ("backup", "local_restore", "remote_restore", "served")
DRAM = "1GiB"  # per worker: ~1,450 of the real model's 720 KiB pages, every conversation and other prompt
ANSWERS_SHOWN = 3  # the answers table quotes the first words of this many of conversation 0's answers


@dataclass(frozen=True, slots=True)
class EngineDemoOptions:
    workers: int = 2
    conversations: int = 4
    turns: int = 3
    system_tokens: int = 256
    user_tokens: int = 96  # documentation quoted in each user message, before its question
    reply_tokens: int = 24
    gpu_tokens: int = 1024  # each engine's GPU pool; SGLang's host pool is twice this
    other_prompts: int = 16  # before each round after the second: other users' one-off prompts
    other_tokens: int = 600
    stagger_s: float = 0.05  # between the conversations that start together after the first turn
    settle_s: float = 0.5  # after the first turn's pages are in kvcr: the KV events reach the router
    workdir: str | None = None
    quiet: bool = False
    discovery: str = "file"  # or "etcd": an etcd server the deployment starts
    event_plane: str = "zmq"  # or "nats": a NATS server the deployment starts


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt: list[int]
    question: str = ""
    text: str = ""
    cached_tokens: int = 0
    error: str = ""


@dataclass
class EngineSummary:
    turns: list[Turn]
    pages: dict[str, dict[str, int]] = field(default_factory=dict)  # worker -> kvcr path -> pages
    reference: list[str] = field(default_factory=list)  # the answers computed without reuse
    reference_error: str = ""
    other_prompts: int = 0

    @property
    def answered(self) -> int:
        return sum(not t.error for t in self.turns)

    @property
    def saved_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.turns)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t.prompt) for t in self.turns)

    def total(self, path: str) -> int:
        return sum(by_path.get(path, 0) for by_path in self.pages.values())

    @property
    def mismatched(self) -> list[Turn]:
        if len(self.reference) != len(self.turns):
            return []
        return [t for t, ref in zip(self.turns, self.reference, strict=True) if not t.error and t.text != ref]

    @property
    def ok(self) -> bool:
        checked = len(self.reference) == len(self.turns) and not self.reference_error
        reused = self.total("remote_restore") > 0 and self.total("local_restore") > 0
        return checked and self.answered == len(self.turns) and not self.mismatched and reused


QUESTIONS = (
    "What does the assert statement do?",
    "When is the else clause of a for loop executed?",
    "What is the difference between a list and a tuple?",
    "How does the with statement close a file?",
    "What does the global statement declare?",
    "What is a generator expression?",
    "How are keyword arguments passed to a function?",
    "What happens when an exception is not handled?",
    "What does the pass statement do?",
    "How does a class inherit from another class?",
    "What is the purpose of __init__?",
    "What does the lambda keyword create?",
)
SYSTEM = "You are a helpful assistant who answers questions about Python from its reference documentation:\n"


class Dialogue:
    """Token ids of the conversations on the real model (SmolLM2's chat format, ChatML).

    The system prompt quotes Python's reference documentation; each user message quotes a further
    excerpt and asks one of :data:`QUESTIONS`; a reply comes back as text and is tokenized again
    (the next prompt holds those ids; the answer without reuse is asked the same ids).
    """

    def __init__(self, model: Path, options: EngineDemoOptions) -> None:
        self.model, self.options = model, options
        self._doc = reference_ids(model)
        head, tail = self.ids(f"<|im_start|>system\n{SYSTEM}"), self.ids("<|im_end|>\n")
        self.system = [*head, *self._doc[: max(16, options.system_tokens - len(head) - len(tail))], *tail]

    def ids(self, text: str) -> list[int]:
        return encode(self.model, text)

    def question(self, c: int, k: int) -> str:
        return QUESTIONS[(c * self.options.turns + k) % len(QUESTIONS)]

    def user(self, c: int, k: int) -> list[int]:
        o = self.options
        question = self.question(c, k)
        quote = self._excerpt(5000 + (c * o.turns + k) * o.user_tokens, o.user_tokens)
        return [
            *self.ids("<|im_start|>user\nMore of the documentation:\n"),
            *quote,
            *self.ids(f"\n\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"),
        ]

    def reply(self, text: str) -> list[int]:
        return self.ids(f"{text}<|im_end|>\n")

    def other(self, k: int, i: int) -> list[int]:
        """Another user's one-off prompt of ``other_tokens``: an excerpt nobody else asks about."""
        o = self.options
        body = self._excerpt(40_000 + (k * o.other_prompts + i) * o.other_tokens, o.other_tokens - 12)
        return [*self.ids("<|im_start|>user\n"), *body, *self.ids("<|im_end|>\n<|im_start|>assistant\n")]

    def _excerpt(self, start: int, tokens: int) -> list[int]:
        """``tokens`` ids of the documentation from ``start``, wrapping round (any number of turns fits)."""
        start %= max(1, len(self._doc) - tokens)
        return list(self._doc[start : start + tokens])


class Conversations:
    """The conversations in rounds, one turn of each per round, each turn in its own thread.

    Conversation 0's first turn goes alone; then ``settled()`` (which waits until a worker's kvcr
    holds that turn's pages) and the others' first turns go together, ``stagger_s`` apart. Every
    later round sends all conversations' next turns together; from the third round on, other
    users' prompts go first (``other_prompts``), pushing the conversations out of the engines' pools.
    """

    def __init__(
        self,
        deployment: Deployment,
        dialogue: Dialogue,
        options: EngineDemoOptions,
        on_turn: Any,
        settled: Callable[[], None],
    ) -> None:
        self.deployment, self.dialogue, self.options = deployment, dialogue, options
        self.on_turn, self.settled = on_turn, settled
        self.turns: list[Turn] = []
        self.other_errors: list[str] = []
        self._lock = threading.Lock()
        self._prompts = {c: list(dialogue.system) for c in range(options.conversations)}
        self._failed: set[int] = set()

    def run(self) -> list[Turn]:
        o = self.options
        for k in range(o.turns):
            if k == 0:
                self._turn(0, 0)
                self.settled()
                self._together([partial(self._turn, c, 0) for c in range(1, o.conversations)])
                continue
            if k >= 2:
                self._together([partial(self._other, k, i) for i in range(o.other_prompts)], stagger_s=0.0)
            self._together([partial(self._turn, c, k) for c in range(o.conversations)])
        return sorted(self.turns, key=lambda t: (t.conversation, t.turn))

    def _together(self, calls: Sequence[Callable[[], None]], stagger_s: float | None = None) -> None:
        gap = self.options.stagger_s if stagger_s is None else stagger_s
        threads = [threading.Thread(target=call, daemon=True) for call in calls]
        for thread in threads:
            thread.start()
            time.sleep(gap)
        for thread in threads:
            thread.join(600)

    def _turn(self, c: int, k: int) -> None:
        if c in self._failed:
            return
        o = self.options
        prompt = self._prompts[c]
        prompt += self.dialogue.user(c, k)
        turn = Turn(c, k, list(prompt), question=self.dialogue.question(c, k))
        try:
            reply = self.deployment.complete(prompt, max_tokens=o.reply_tokens, sampling={"temperature": 0})
            turn.text = str(reply["choices"][0]["text"])
            details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
            turn.cached_tokens = int(details.get("cached_tokens") or 0)
            prompt += self.dialogue.reply(turn.text)
        except (DeploymentError, KeyError, IndexError, TypeError, ValueError) as exc:
            turn.error = str(exc)
            self._failed.add(c)
        with self._lock:
            self.turns.append(turn)
        self.on_turn()

    def _other(self, k: int, i: int) -> None:
        """One other user's one-off prompt (its answer is not checked)."""
        prompt = self.dialogue.other(k, i)
        try:
            self.deployment.complete(prompt, max_tokens=1, sampling={"temperature": 0})
        except (DeploymentError, KeyError, IndexError, TypeError, ValueError) as exc:
            with self._lock:
                self.other_errors.append(str(exc))


def answers_without_reuse(model: Path, workdir: Path, turns: Sequence[Turn], reply_tokens: int) -> list[str]:
    """Every turn's answer from a SGLang server with no cache at all (greedy, the same token limit)."""
    server = EngineServer(model, workdir / "reference.log", reuse=False, extra_args=SERVE_ARGS)
    with server:
        return [
            str(server.generate(t.prompt, max_new_tokens=reply_tokens, ignore_eos=False, logprobs=False)["text"])
            for t in turns
        ]


def run_engine_demo(options: EngineDemoOptions) -> int:
    """Run the demo; 0 when every turn was answered, equals its answer without reuse, and a peer served pages."""
    from rich.console import Console

    console = Console(quiet=options.quiet)
    results = Console()
    started = time.monotonic()
    with ExitStack() as stack:
        workdir = Path(options.workdir) if options.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            model = real_model()
        except RealModelError as exc:
            results.print(f"[red]kvcr demo: {exc}[/red]")
            return 1
        dialogue = Dialogue(model, options)
        deployment = stack.enter_context(
            Deployment(
                workdir / "deployment",
                served_model=MODEL_NAME,
                discovery_backend=options.discovery,
                event_plane=options.event_plane,
            )
        )
        workers: list[SglangWorker] = []
        stack.callback(_stop_all, workers)
        with console.status(f"starting Dynamo's frontend (KV router) and {options.workers} dynamo.sglang workers"):
            try:
                deployment.start_frontend()
                workers = [
                    start_sglang_worker(deployment, model, worker_spec(i, options)) for i in range(options.workers)
                ]
                wait_sglang_ready(deployment, workers)
            except (DeploymentError, ControlPlaneError) as exc:
                results.print(f"[red]kvcr demo: {exc}[/red]")
                return 1
        console.print(
            f"frontend {deployment.url} (router-mode kv, {options.discovery} discovery, {options.event_plane} "
            f"event plane) in front of {options.workers} `python -m dynamo.sglang` "
            f"workers with kvcr as L3; ready after {time.monotonic() - started:.0f} s"
        )
        total = options.conversations * options.turns
        done = [0]

        def advanced() -> None:
            done[0] += 1
            console.print(f"  {done[0]}/{total} turns answered", highlight=False)

        def settled() -> None:
            pages = options.system_tokens // PAGE_SIZE
            with suppress(EngineError):  # the demo goes on; the table says what kvcr held
                wait_for(lambda: _backed_up(workers) >= pages, 60, "the first turn's pages in kvcr")
            time.sleep(options.settle_s)

        conversations = Conversations(deployment, dialogue, options, advanced, settled)
        turns = conversations.run()
        summary = EngineSummary(turns)
        summary.other_prompts = options.other_prompts * max(0, options.turns - 2) - len(conversations.other_errors)
        for worker in workers:
            try:
                summary.pages[worker.spec.name] = {path: worker.kvcr_pages(path) for path in KVCR_PATHS}
            except OSError as exc:
                results.print(f"[red]kvcr demo: {worker.spec.name}'s /metrics did not answer: {exc}[/red]")
        for worker in workers:
            worker.stop()
        with console.status("the same requests on one SGLang server with no cache (the answers without reuse)"):
            try:
                summary.reference = answers_without_reuse(model, workdir, turns, options.reply_tokens)
            except EngineError as exc:
                summary.reference_error = str(exc).splitlines()[0]
    results.print(_table(summary))
    results.print(_answers(summary))
    results.print(_verdict(summary))
    return 0 if summary.ok else 1


def worker_spec(i: int, options: EngineDemoOptions) -> SglangWorkerSpec:
    """Worker ``i``: the real model computed in float32 (kvcr.testing.real_model), a small GPU pool, kvcr
    DRAM that keeps the whole workload."""
    return SglangWorkerSpec(
        f"sglang-{i}",
        options.gpu_tokens,
        kvcr_settings={"dram_bytes": DRAM},
        extra_args=SERVE_ARGS,
        served_model=MODEL_NAME,
    )


def _backed_up(workers: Sequence[SglangWorker]) -> int:
    """Pages the workers' kvcr backed up so far (0 while a /metrics does not answer yet)."""
    try:
        return sum(worker.kvcr_pages("backup") for worker in workers)
    except OSError:
        return 0


def _stop_all(workers: Sequence[SglangWorker]) -> None:
    for worker in workers:
        worker.stop()


def _table(s: EngineSummary) -> Any:
    from rich.table import Table

    table = Table(title="kvcr under real SGLang engines behind Dynamo's KV router", header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    answered_same = (
        f"{len(s.turns) - len(s.mismatched)} / {len(s.turns)}" if len(s.reference) == len(s.turns) else "not checked"
    )
    rows = [
        ("turns (answered / sent)", f"{s.answered} / {len(s.turns)}"),
        ("prompt tokens", str(s.prompt_tokens)),
        ("prefill tokens saved (SGLang's cached_tokens)", str(s.saved_tokens)),
        ("pages backed up to kvcr", str(s.total("backup"))),
        ("other users' prompts (GPU and host pools flushed)", str(s.other_prompts)),
        ("pages restored from local kvcr DRAM", str(s.total("local_restore"))),
        ("pages restored from a peer (router's hint)", str(s.total("remote_restore"))),
        ("answers equal to the answer without reuse", answered_same),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for worker, by_path in sorted(s.pages.items()):
        pages = " / ".join(str(by_path[p]) for p in KVCR_PATHS)
        table.add_row(f"  {worker}: backup / local / from peer / served", pages)
    return table


def _answers(s: EngineSummary) -> Any:
    """Conversation 0's questions and the first words of the model's answers (a table of its own)."""
    from rich.table import Table

    table = Table(title="what the model answered (conversation 0)", header_style="bold")
    table.add_column("question")
    table.add_column("answer (first words)")
    for turn in [t for t in s.turns if t.conversation == 0][:ANSWERS_SHOWN]:
        table.add_row(turn.question, first_words(turn.text) or turn.error[:60])
    return table


def first_words(text: str, words: int = 9) -> str:
    """The first ``words`` words of an answer, on one line."""
    parts = text.split()
    return " ".join(parts[:words]) + (" ..." if len(parts) > words else "")


def _verdict(s: EngineSummary) -> str:
    failed = [t for t in s.turns if t.error]
    if failed:
        return f"[red]FAILED: {len(failed)} turns got no answer (first: {failed[0].error})[/red]"
    if s.reference_error:
        return f"[red]FAILED: the server without reuse did not answer: {s.reference_error}[/red]"
    if s.mismatched:
        t = s.mismatched[0]
        return (
            f"[red]FAILED: {len(s.mismatched)} answers differ from the answer without reuse "
            f"(first: conversation {t.conversation} turn {t.turn})[/red]"
        )
    if not s.total("remote_restore"):
        return "[yellow]no page was restored from a peer: every turn was routed to its prefix's holder[/yellow]"
    if not s.total("local_restore"):
        return "[yellow]no page was restored from local kvcr DRAM: no conversation came back to its holder[/yellow]"
    return (
        f"[green]OK: every answer equals the answer without reuse; {s.saved_tokens} prefill tokens saved, "
        f"{s.total('local_restore')} pages restored from local kvcr DRAM, "
        f"{s.total('remote_restore')} read from a peer on the router's hint[/green]"
    )
