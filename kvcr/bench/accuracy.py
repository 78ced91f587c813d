"""The accuracy probe: a real model's answers after a kvcr restore equal its answers from scratch.

For each prompt length, a fresh prompt of real English (an excerpt of Python's reference
documentation and a question) goes through every path of :class:`kvcr.testing.real_fleet.RealFleet`
with greedy decoding and logprobs: (a) from scratch, (b) restored from local kvcr DRAM, (c) from a
peer over NIXL, (d) from a same-host peer over kvcr's default transport; plus two correct
computations that involve no kvcr: a second from-scratch computation in another server process and
SGLang's own device-cache hit (the prompt's prefix reused from GPU memory, the seed's "local HBM").

**The bound.** A restored page holds exactly the bytes SGLang computed for it (kvcr copies bytes),
so a restored answer is computed by the same kernels on the same shapes as the device-cache hit.
Two correct computations may still differ where the engine is not batch-invariant (a one-pass
prefill against a prefix-then-tail one sums in another order), so the probe first measures that
noise for each prompt: the largest logprob difference of the second scratch computation and of the
device hit against scratch. A restored path passes when its greedy tokens equal scratch's and its
largest logprob difference is at most ``max(noise, FLOOR)``, FLOOR being ten float32 ulps at the
logprobs' scale (|logprob| < 16: ulp 1.9e-6), below which two summation orders cannot be told apart.
On this engine (float32 on the CPU, ``kvcr.testing.real_model``) the noise measures 0.0: every
correct computation agrees to the bit, and the restored paths do too.

**The control.** A fresh prompt is restored from local kvcr DRAM with one page overwritten in
SGLang's host pool after kvcr's read (the harness's ``KVCR_ENGINE_CORRUPT_FLAG``); the same check
must fail on it (measured: a logprob difference of about 2.9 and different text at 1,024 tokens).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcr.bench.stats import markdown_table
from kvcr.testing.real_fleet import RESTORED, RealFleet, Reply, logprob_gap
from kvcr.testing.real_model import document_prompt, real_model

FLOOR = 2e-5  # ten float32 ulps at |logprob| < 16
CHECKED = ("scratch_again", "device", *RESTORED)
NEW_TOKENS = 16


@dataclass(frozen=True, slots=True)
class AccuracyResult:
    prompt_tokens: int
    new_tokens: int
    answer: str  # the answer from scratch
    gaps: dict[str, float]  # path -> largest |logprob - scratch's|
    same_tokens: dict[str, bool]  # path -> greedy tokens equal scratch's
    storage_tokens: dict[str, int]  # restored path -> prompt tokens SGLang read from kvcr
    noise: float  # the two correct computations without kvcr against scratch
    bound: float

    @property
    def ok(self) -> bool:
        return all(self.same_tokens[p] and self.gaps[p] <= self.bound for p in RESTORED)


@dataclass(frozen=True, slots=True)
class ControlResult:
    prompt_tokens: int
    corrupted_pages: int
    gap: float
    same_tokens: bool
    bound: float
    answer: str  # what the corrupted restore answered

    @property
    def caught(self) -> bool:
        """The probe's check fails on the corrupted restore (it is able to fail)."""
        return not self.same_tokens or self.gap > self.bound


def judge(prompt_tokens: int, replies: dict[str, Reply]) -> AccuracyResult:
    """Every path of one prompt against scratch, with the bound that prompt's noise gives."""
    scratch = replies["scratch"]
    gaps = {path: logprob_gap(replies[path], scratch) for path in CHECKED}
    noise = max(gaps["scratch_again"], gaps["device"])
    return AccuracyResult(
        prompt_tokens=prompt_tokens,
        new_tokens=len(scratch.output_ids),
        answer=scratch.text,
        gaps=gaps,
        same_tokens={path: replies[path].output_ids == scratch.output_ids for path in CHECKED},
        storage_tokens={path: replies[path].storage_tokens for path in RESTORED},
        noise=noise,
        bound=max(noise, FLOOR),
    )


def control(fleet: RealFleet, model: Path, prompt_tokens: int, bound: float, new_tokens: int) -> ControlResult:
    """One page of a restore from local kvcr DRAM overwritten: the check must catch it."""
    ids = document_prompt(model, prompt_tokens, seed=424_242)
    scratch, corrupted = fleet.corrupted_local(ids, new_tokens, pages=1)
    return ControlResult(
        prompt_tokens=prompt_tokens,
        corrupted_pages=1,
        gap=logprob_gap(corrupted, scratch),
        same_tokens=corrupted.output_ids == scratch.output_ids,
        bound=bound,
        answer=corrupted.text,
    )


def run_accuracy(
    lengths: Sequence[int],
    *,
    new_tokens: int = NEW_TOKENS,
    workdir: Path | None = None,
) -> tuple[list[AccuracyResult], ControlResult]:
    """Every length's result, then the control at the shortest length, from one fleet."""
    model = real_model()
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-accuracy-") as scratch:
        root = workdir or Path(scratch)
        with RealFleet(model, root, max_prompt_tokens=max(lengths)) as fleet:
            results = []
            for i, length in enumerate(lengths):
                ids = document_prompt(model, length, seed=500 + i)
                results.append(judge(length, fleet.paths(ids, new_tokens)))
            bound = max(r.bound for r in results)
            return results, control(fleet, model, min(lengths), bound, new_tokens)


def accuracy_table(results: Sequence[AccuracyResult], check: ControlResult) -> str:
    header = [
        "prompt tokens",
        "answer from scratch (first words)",
        "noise (2nd scratch / device hit)",
        "local kvcr DRAM",
        "peer over NIXL",
        "same-host peer (auto)",
        "bound",
        "greedy tokens equal",
    ]

    def cell(r: AccuracyResult, path: str) -> str:
        return f"{r.gaps[path]:.1e}" if r.gaps[path] else "0"

    rows = [
        [
            str(r.prompt_tokens),
            _first_words(r.answer),
            f"{cell(r, 'scratch_again')} / {cell(r, 'device')}",
            cell(r, "local"),
            cell(r, "peer_nixl"),
            cell(r, "peer_same_host"),
            f"{r.bound:.0e}",
            "yes" if all(r.same_tokens[p] for p in RESTORED) else "NO",
        ]
        for r in results
    ]
    rows.append(
        [
            f"{check.prompt_tokens} (control)",
            _first_words(check.answer),
            "",
            f"{check.gap:.2f} ({check.corrupted_pages} page corrupted)",
            "",
            "",
            f"{check.bound:.0e}",
            _control_verdict(check),
        ]
    )
    return markdown_table(header, rows)


def _control_verdict(check: ControlResult) -> str:
    """Whether the corrupted restore's greedy tokens stayed equal, and whether the check caught it."""
    if not check.same_tokens:
        return "no: caught"  # different tokens always fail the check
    return "yes, logprobs caught" if check.caught else "yes: NOT CAUGHT"


def _first_words(text: str, words: int = 8) -> str:
    cut = " ".join(text.split()[:words])
    return cut.replace("|", "/") + (" ..." if len(text.split()) > words else "")


def as_dict(results: Sequence[AccuracyResult], check: ControlResult) -> dict[str, Any]:
    return {"results": [asdict(r) for r in results], "control": asdict(check) | {"caught": check.caught}}
