"""Real-server benchmark: time to first token on a real trained model, recomputed vs restored by kvcr.

Four SGLang 0.5.23 servers on the CPU serve SmolLM2-135M-Instruct (``kvcr.testing.real_model``)
with kvcr as L3 (``kvcr.testing.real_fleet``: a NIXL pair and a pair on kvcr's default transport).
For each prompt length and repetition, a fresh prompt of real English (Python's reference
documentation) and a question, greedy, one new token:

* **recompute**: the source serves it cold (nothing cached anywhere);
* **local**: the source's device and host caches are flushed and it serves it again: the prefix
  comes back from its own kvcr DRAM;
* **peer over NIXL**: another server, with a hint naming the source, reads the prefix from the
  source's kvcr DRAM over NIXL (UCX on loopback);
* **same-host peer**: the same with kvcr's default transport (``auto``: the shm plane on one host).

TTFT is the client's wall time of ``/generate`` with ``max_new_tokens=1`` (HTTP included). Every
path's first token must equal the recomputed one and SGLang's ``cached_tokens_details.storage``
must show the restore. Ratios are path / recompute (below 1: faster), medians over the repetitions,
from the same run. Where a restored TTFT goes is read from the servers' own counters around each
prompt: ``kvcr_restore_seconds`` (kvcr's restore batches: the L3 read) and SGLang's
``sglang:queue_time_seconds`` (the request's wait in the scheduler's queue, which holds it while
the L3 prefetch runs); the rest is the forward pass over the prompt's last page, the host-to-device
copy and HTTP.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcr.bench.stats import markdown_table
from kvcr.testing.engine import PAGE_SIZE, EngineError, metric_sum
from kvcr.testing.real_fleet import SGLANG_PREFETCH_THRESHOLD, RealFleet
from kvcr.testing.real_model import MAX_POSITIONS, document_prompt, real_model

MIN_PROMPT_TOKENS = SGLANG_PREFETCH_THRESHOLD + 2 * PAGE_SIZE  # below SGLang's threshold kvcr is not asked
MAX_PROMPT_TOKENS = MAX_POSITIONS - 32  # the model's context, less the answer
RESTORED_PATHS = {"local": "a", "peer_nixl": "b", "peer_same_host": "c"}  # path -> the server that restores


@dataclass(frozen=True, slots=True)
class EngineResult:
    prompt_tokens: int
    reps: int
    recompute_ms: float
    local_ms: float
    peer_nixl_ms: float
    peer_same_host_ms: float
    local_ratio: float
    peer_nixl_ratio: float
    peer_same_host_ratio: float
    restore_ms: dict[str, float]  # path -> kvcr's restore batches (median per prompt)
    queue_ms: dict[str, float]  # path -> SGLang's queue time of the restored request (median)
    storage_tokens: int  # the fewest prompt tokens any restored path read from kvcr
    same_first_token: bool


def run_engine(lengths: Sequence[int], reps: int, *, workdir: Path | None = None) -> list[EngineResult]:
    """One result per prompt length (medians over ``reps`` fresh prompts), from one fleet."""
    model = real_model()
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-engine-") as scratch:
        root = workdir or Path(scratch)
        with RealFleet(model, root, max_prompt_tokens=max(lengths)) as fleet:
            return [_measure(fleet, model, length, reps) for length in lengths]


def _measure(fleet: RealFleet, model: Path, length: int, reps: int) -> EngineResult:
    seconds: dict[str, list[float]] = {path: [] for path in ("scratch", *RESTORED_PATHS)}
    restore: dict[str, list[float]] = {path: [] for path in RESTORED_PATHS}
    queue: dict[str, list[float]] = {path: [] for path in RESTORED_PATHS}
    stored, same = [], True
    for rep in range(reps):
        ids = document_prompt(model, length, seed=1000 + length + rep)
        before = {path: _counters(fleet, server, path) for path, server in RESTORED_PATHS.items()}
        replies = fleet.paths(ids, max_new_tokens=1)
        for path, server in RESTORED_PATHS.items():
            after = _counters(fleet, server, path)
            restore[path].append(after[0] - before[path][0])
            queue[path].append(after[1] - before[path][1])
            stored.append(replies[path].storage_tokens)
        for path in seconds:
            seconds[path].append(replies[path].seconds)
        same &= all(replies[p].output_ids == replies["scratch"].output_ids for p in RESTORED_PATHS)
    p50 = {path: statistics.median(values) for path, values in seconds.items()}
    return EngineResult(
        prompt_tokens=length,
        reps=reps,
        recompute_ms=p50["scratch"] * 1e3,
        local_ms=p50["local"] * 1e3,
        peer_nixl_ms=p50["peer_nixl"] * 1e3,
        peer_same_host_ms=p50["peer_same_host"] * 1e3,
        local_ratio=p50["local"] / p50["scratch"],
        peer_nixl_ratio=p50["peer_nixl"] / p50["scratch"],
        peer_same_host_ratio=p50["peer_same_host"] / p50["scratch"],
        restore_ms={path: statistics.median(v) * 1e3 for path, v in restore.items()},
        queue_ms={path: statistics.median(v) * 1e3 for path, v in queue.items()},
        storage_tokens=min(stored),
        same_first_token=same,
    )


def _counters(fleet: RealFleet, server: str, path: str) -> tuple[float, float]:
    """(kvcr's restore seconds for ``path``, SGLang's queue seconds) on ``server``, so far."""
    kvcr_path = "local_restore" if path == "local" else "remote_restore"
    engine = fleet.servers[server]
    samples = engine.metrics()
    return metric_sum(samples, "kvcr_restore_seconds_sum", path=kvcr_path), metric_sum(
        samples, "sglang:queue_time_seconds_sum"
    )


def check_lengths(lengths: Sequence[int]) -> None:
    if not lengths or min(lengths) < MIN_PROMPT_TOKENS or max(lengths) > MAX_PROMPT_TOKENS:
        raise EngineError(
            f"--lengths: each between {MIN_PROMPT_TOKENS} tokens (below it SGLang's prefetch threshold of "
            f"{SGLANG_PREFETCH_THRESHOLD} tokens leaves kvcr unasked) and {MAX_PROMPT_TOKENS} (the model's "
            f"context of {MAX_POSITIONS}, less the answer), got {list(lengths)}"
        )


def engine_table(results: Sequence[EngineResult]) -> str:
    header = [
        "prompt tokens",
        "recompute TTFT",
        "local kvcr DRAM",
        "x",
        "peer over NIXL",
        "x",
        "same-host peer (auto)",
        "x",
        "kvcr read (local / NIXL / auto)",
        "queued (local / NIXL / auto)",
        "same token",
    ]
    rows = [
        [
            str(r.prompt_tokens),
            f"{r.recompute_ms:.0f} ms",
            f"{r.local_ms:.0f} ms",
            f"{r.local_ratio:.2f}",
            f"{r.peer_nixl_ms:.0f} ms",
            f"{r.peer_nixl_ratio:.2f}",
            f"{r.peer_same_host_ms:.0f} ms",
            f"{r.peer_same_host_ratio:.2f}",
            " / ".join(f"{r.restore_ms[p]:.0f}" for p in RESTORED_PATHS) + " ms",
            " / ".join(f"{r.queue_ms[p]:.0f}" for p in RESTORED_PATHS) + " ms",
            "yes" if r.same_first_token else "NO",
        ]
        for r in results
    ]
    return markdown_table(header, rows)


def as_dict(result: EngineResult) -> dict[str, Any]:
    return asdict(result)
