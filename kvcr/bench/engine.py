"""Real-server benchmark: time to first token for a long prefix, recomputed vs restored by kvcr.

Two SGLang 0.5.23 servers run on the CPU with kvcr as L3 (``kvcr.testing.engine``; NIXL on
loopback), A and B (B follows hints). For each prompt length and repetition, a fresh prompt:

* **recompute**: A serves it cold (nothing cached anywhere);
* **local**: A's device cache is flushed (``/flush_cache``) and A serves it again: the prefix comes
  back from A's kvcr DRAM;
* **peer**: B serves it with a ``kv_hints`` envelope naming A: the prefix is read from A's kvcr
  DRAM over NIXL.

TTFT is the client's wall time of a greedy ``/generate`` with ``max_new_tokens=1`` (what a user
waits for the first token, HTTP included). Each path's first token must equal the recomputed one,
and SGLang's ``cached_tokens`` must show the restore. Ratios are recompute / path (above 1: faster
than recomputing), measured in the same run. The model is tiny; on a CPU its prefill is cheap, so
these ratios understate what a real model on a GPU gains from skipping prefill.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcr.bench.stats import markdown_table
from kvcr.testing.engine import (
    PAGE_SIZE,
    EngineError,
    EngineServer,
    fetch_hint,
    prompt_ids,
    start_all,
    stop_all,
    wait_for,
    write_model,
)

# SGLang prefetches from L3 only when at least its prefetch threshold (256 tokens by default; the
# bench's servers keep it) is to be fetched; a prompt restores all but its last, partial page.
SGLANG_PREFETCH_THRESHOLD = 256
MIN_PROMPT_TOKENS = SGLANG_PREFETCH_THRESHOLD + 2 * PAGE_SIZE
MAX_PROMPT_TOKENS = 3072  # the tiny model's context is 4096


@dataclass(frozen=True, slots=True)
class EngineResult:
    prompt_tokens: int
    reps: int
    recompute_ms: float
    local_ms: float
    peer_ms: float
    local_cached_tokens: int
    peer_cached_tokens: int
    local_ratio: float
    peer_ratio: float
    same_first_token: bool


def _ttft(server: EngineServer, ids: Sequence[int], hint: Any = None) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    reply = server.generate(ids, max_new_tokens=1, kv_hints=hint, timeout_s=120.0)
    return time.perf_counter() - started, reply


def run_engine(
    lengths: Sequence[int], reps: int, *, layers: int = 8, hidden: int = 256, workdir: Path | None = None
) -> list[EngineResult]:
    """One result per prompt length (medians over ``reps``), from one pair of servers."""
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-engine-") as scratch:
        root = workdir or Path(scratch)
        model = write_model(root / "model", seed=11, layers=layers, hidden=hidden)
        tokens = 4 * max(lengths) + 4096
        settings = {"dram_bytes": "1GiB"}
        a = EngineServer(model, root / "a.log", max_total_tokens=tokens, kvcr_settings=settings)
        b = EngineServer(
            model, root / "b.log", max_total_tokens=tokens, kvcr_settings=settings | {"enable_remote_hint": True}
        )
        start_all([a, b])
        try:
            warm = prompt_ids(64, seed=999)  # the first request of a server pays one-time costs
            a.generate(warm, max_new_tokens=1)
            b.generate(warm, max_new_tokens=1)
            return [_measure(a, b, length, reps) for length in lengths]
        finally:
            stop_all([a, b])


def _wait_backups(server: EngineServer, at_least: int) -> None:
    wait_for(lambda: server.kvcr_pages("backup") >= at_least, 60.0, "the prompt's pages in kvcr DRAM")


def _measure(a: EngineServer, b: EngineServer, length: int, reps: int) -> EngineResult:
    pages = (length - 1) // PAGE_SIZE
    recompute, local, peer = [], [], []
    local_cached, peer_cached, same = [], [], True
    for rep in range(reps):
        ids = prompt_ids(length, seed=100_000 + length * 100 + rep)
        backups = a.kvcr_pages("backup")
        t_cold, cold = _ttft(a, ids)
        _wait_backups(a, backups + pages)
        a.flush_cache()
        t_local, warm = _ttft(a, ids)
        t_peer, remote = _ttft(b, ids, fetch_hint(a, ids))
        recompute.append(t_cold)
        local.append(t_local)
        peer.append(t_peer)
        local_cached.append(int(warm["meta_info"]["cached_tokens"]))
        peer_cached.append(int(remote["meta_info"]["cached_tokens"]))
        same &= warm["output_ids"] == cold["output_ids"] == remote["output_ids"]
    if min(local_cached) == 0 or min(peer_cached) == 0:
        raise EngineError(f"a restore did not happen (cached tokens: local {local_cached}, peer {peer_cached})")
    p50 = statistics.median
    return EngineResult(
        prompt_tokens=length,
        reps=reps,
        recompute_ms=p50(recompute) * 1e3,
        local_ms=p50(local) * 1e3,
        peer_ms=p50(peer) * 1e3,
        local_cached_tokens=min(local_cached),
        peer_cached_tokens=min(peer_cached),
        local_ratio=p50(recompute) / p50(local),
        peer_ratio=p50(recompute) / p50(peer),
        same_first_token=same,
    )


def engine_table(results: Sequence[EngineResult]) -> str:
    header = [
        "prompt tokens",
        "recompute TTFT",
        "local kvcr DRAM",
        "x",
        "peer over NIXL",
        "x",
        "cached (local/peer)",
        "same token",
    ]
    rows = [
        [
            str(r.prompt_tokens),
            f"{r.recompute_ms:.0f} ms",
            f"{r.local_ms:.0f} ms",
            f"{r.local_ratio:.2f}",
            f"{r.peer_ms:.0f} ms",
            f"{r.peer_ratio:.2f}",
            f"{r.local_cached_tokens}/{r.peer_cached_tokens}",
            "yes" if r.same_first_token else "NO",
        ]
        for r in results
    ]
    return markdown_table(header, rows)


def as_dict(result: EngineResult) -> dict[str, Any]:
    return asdict(result)
