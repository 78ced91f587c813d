"""Four SGLang servers on the real model (:mod:`kvcr.testing.real_model`), kvcr as L3, one run per path.

Two pairs, one per data plane, because every replica of a kvcr cluster uses the same transport:

* ``nixl``: A (the source; its own restores are the *local* path) and B (follows hints: the *peer
  over NIXL* path, UCX on loopback);
* ``auto`` (kvcr's default): A2 (a second source) and C (follows hints: the *same-host peer* path,
  which ``auto`` serves over the shm plane).

For one prompt :meth:`RealFleet.paths` asks, in this order: A cold (**scratch**: nothing cached
anywhere), A2 cold (**scratch_again**: a second from-scratch computation in another process, the
recompute-against-recompute noise), A again (**device**: SGLang's own device radix hit, the seed's
"local HBM"), A after ``/flush_cache`` (**local**: from A's kvcr DRAM), B with a hint naming A
(**peer_nixl**), C with a hint naming A2 (**peer_same_host**). Each restored reply must show the
restore in SGLang's ``cached_tokens``, or :class:`~kvcr.testing.engine.EngineError` says which did not.

A carries the harness's corruption control (``KVCR_ENGINE_CORRUPT_FLAG``, ``engine_shims``):
:meth:`RealFleet.corrupted_local` restores a fresh prompt on A with one page overwritten after
kvcr's read, so a check can show that it catches a wrong page.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcr.testing.engine import (
    PAGE_SIZE,
    EngineError,
    EngineServer,
    fetch_hint,
    start_all,
    stop_all,
    wait_for,
)
from kvcr.testing.real_model import SERVE_ARGS

PATHS = ("scratch", "scratch_again", "device", "local", "peer_nixl", "peer_same_host")
RESTORED = ("local", "peer_nixl", "peer_same_host")
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head_dim x float32
# SGLang sizes an unset host pool from free memory less a 10 GiB reserve and refuses to start when
# four servers' kvcr arenas leave less; the ratio set explicitly (its default, 2x the device pool)
# skips that sizing.
HOST_POOL_ARGS = ("--hicache-ratio", "2")
SGLANG_PREFETCH_THRESHOLD = 256  # tokens: SGLang asks L3 for nothing shorter (its default, kept here)


@dataclass
class Reply:
    """One greedy answer: its token ids, their logprobs, the text, SGLang's cached tokens, the wall time."""

    output_ids: list[int]
    logprobs: list[float]
    text: str
    cached_tokens: int
    storage_tokens: int  # of cached_tokens, those SGLang read from L3 (kvcr)
    seconds: float

    @classmethod
    def of(cls, answer: dict[str, Any], seconds: float) -> Reply:
        meta = answer["meta_info"]
        return cls(
            output_ids=list(answer["output_ids"]),
            logprobs=[float(lp[0]) for lp in meta["output_token_logprobs"]],
            text=str(answer.get("text", "")),
            cached_tokens=int(meta["cached_tokens"]),
            storage_tokens=int((meta.get("cached_tokens_details") or {}).get("storage") or 0),
            seconds=seconds,
        )


def logprob_gap(a: Reply, b: Reply) -> float:
    """The largest absolute logprob difference over the tokens both answers share."""
    return max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=False)), default=0.0)


@dataclass
class RealFleet:
    """The four servers; a context manager that starts them together and stops them together."""

    model: Path
    workdir: Path
    max_prompt_tokens: int
    servers: dict[str, EngineServer] = field(default_factory=dict)
    corrupt_flag: Path = field(init=False)

    def __post_init__(self) -> None:
        self.corrupt_flag = self.workdir / "corrupt-a"
        tokens = self.max_prompt_tokens + 1024
        prompt_bytes = (self.max_prompt_tokens + 4 * PAGE_SIZE) * KV_BYTES_PER_TOKEN
        # A source holds the prompt being read (older ones are evicted, least recently used first),
        # and one peer may pin at most peer_lease_share of the half of a pool that leases may pin:
        # with 1.0, a prompt needs a pool of twice its size.
        source = {"dram_bytes": int(2.5 * prompt_bytes), "peer_lease_share": 1.0}
        target = {"dram_bytes": int(1.25 * prompt_bytes), "enable_remote_hint": True}

        def server(name: str, settings: dict[str, Any], env: dict[str, str] | None = None) -> EngineServer:
            log = self.workdir / f"{name}.log"
            return EngineServer(
                self.model, log, max_total_tokens=tokens, kvcr_settings=settings, env=env or {},
                extra_args=(*SERVE_ARGS, *HOST_POOL_ARGS),
            )  # fmt: skip

        reserve = {"KVCR_ENGINE_HOST_RESERVE_GIB": "2"}  # four servers fit a 24 GiB machine (engine_shims)
        corrupt = reserve | {"KVCR_ENGINE_CORRUPT_FLAG": str(self.corrupt_flag)}
        self.servers = {
            "a": server("a", source | {"transport": "nixl"}, corrupt),
            "b": server("b", target | {"transport": "nixl"}, reserve),
            "a2": server("a2", source | {"transport": "auto"}, reserve),
            "c": server("c", target | {"transport": "auto"}, reserve),
        }

    def __enter__(self) -> RealFleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        start_all(list(self.servers.values()), timeout_s=480.0)
        try:
            warm = [1, 2, 3, 4] * 16  # every server's first request pays one-time costs
            for server in self.servers.values():
                server.generate(warm, max_new_tokens=1, timeout_s=300.0)
        except BaseException:
            stop_all(list(self.servers.values()))
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(list(self.servers.values()))

    def paths(self, ids: Sequence[int], max_new_tokens: int) -> dict[str, Reply]:
        """Every path of :data:`PATHS` for ``ids`` (a prompt no server has seen), in that order."""
        a, b, a2, c = (self.servers[n] for n in ("a", "b", "a2", "c"))
        pages = (len(ids) - 1) // PAGE_SIZE
        replies: dict[str, Reply] = {}

        def ask(path: str, server: EngineServer, hint: Any = None) -> None:
            replies[path] = _timed(server, ids, max_new_tokens, hint)

        backed_a, backed_a2 = a.kvcr_pages("backup"), a2.kvcr_pages("backup")
        ask("scratch", a)
        ask("scratch_again", a2)
        ask("device", a)
        _backed_up(a, backed_a + pages)
        _backed_up(a2, backed_a2 + pages)
        a.flush_cache()
        ask("local", a)
        ask("peer_nixl", b, fetch_hint(a, ids))
        ask("peer_same_host", c, fetch_hint(a2, ids))
        for path in ("scratch", "scratch_again"):
            if replies[path].cached_tokens:
                raise EngineError(f"{path} was not computed from scratch: {replies[path].cached_tokens} tokens cached")
        for path in ("device", *RESTORED):
            reused = replies[path].storage_tokens if path in RESTORED else replies[path].cached_tokens
            if reused < pages * PAGE_SIZE:
                raise EngineError(
                    f"{path}: SGLang reused {reused} of the prompt's {pages * PAGE_SIZE} reusable tokens "
                    f"{'from kvcr' if path in RESTORED else 'from its device cache'}"
                )
        return replies

    def corrupted_local(self, ids: Sequence[int], max_new_tokens: int, pages: int = 1) -> tuple[Reply, Reply]:
        """``ids`` from scratch on A, then restored from A's kvcr DRAM with ``pages`` pages overwritten."""
        a = self.servers["a"]
        backed = a.kvcr_pages("backup")
        scratch = _timed(a, ids, max_new_tokens)
        _backed_up(a, backed + (len(ids) - 1) // PAGE_SIZE)
        a.flush_cache()
        self.corrupt_flag.write_text(str(pages))
        try:
            corrupted = _timed(a, ids, max_new_tokens)
        finally:
            self.corrupt_flag.unlink(missing_ok=True)
        a.flush_cache()  # the corrupted pages leave A's device cache (its host pool keeps them: fresh prompts only)
        if not corrupted.cached_tokens:
            raise EngineError("the corruption control's restore did not happen (no cached tokens)")
        return scratch, corrupted


def _timed(server: EngineServer, ids: Sequence[int], max_new_tokens: int, hint: Any = None) -> Reply:
    """One greedy ``/generate`` of ``ids`` on ``server`` (with ``hint`` if given), timed by the client."""
    started = time.perf_counter()
    answer = server.generate(ids, max_new_tokens=max_new_tokens, kv_hints=hint, timeout_s=900.0)
    return Reply.of(answer, time.perf_counter() - started)


def _backed_up(server: EngineServer, pages: int) -> None:
    wait_for(lambda: server.kvcr_pages("backup") >= pages, 300.0, "the prompt's pages in kvcr DRAM")
