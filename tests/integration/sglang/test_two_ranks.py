"""Two TP ranks, two processes, SGLang's real collectives: the ranks agree on what kvcr restores.

SGLang reduces each prefetch's hit count across TP ranks (MIN) and then syncs completions, so a
rank whose kvcr holds fewer pages shrinks the restore for both. These tests run that through
SGLang 0.5.23's own code over a gloo world of two (``two_ranks_flow.py``), not by reasoning about it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.multiprocess


def run_ranks(
    pages: tuple[int, int],
    *,
    rounds: int = 1,
    prompt_pages: int = 5,
    env: dict[str, str] | None = None,
    peer: bool = False,
    dead_peer_rank: int | None = None,
    dp_attention: bool = False,
    identities: list | None = None,
):
    init_port, control_port = free_port(), free_port(2)
    extra = {"peer": {"port": free_port(2)}, "dead_peer_rank": dead_peer_rank} if peer else {}
    children = []
    for rank in (0, 1):
        spec = {
            "rank": rank,
            "init_port": init_port,
            "control_port": control_port,
            "pages": list(pages),
            "rounds": rounds,
            "prompt_pages": prompt_pages,
            "dp_attention": dp_attention,
            **extra,
        }
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.integration.sglang.two_ranks_flow", json.dumps(spec)],
                cwd=REPO,
                env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for child in children:
            out, err = child.communicate(timeout=300)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert child.returncode == 0 and lines, err[-3000:]
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    ordered = sorted(results, key=lambda r: r["rank"])
    if identities is not None:
        identities.extend(r["storage"] for r in ordered)
    return [r["rounds"] for r in ordered]


def test_the_rank_holding_fewer_pages_shrinks_the_restore_for_both():
    rank0, rank1 = run_ranks((5, 3))
    assert [r["backed_up"] for r in (*rank0, *rank1)] == [5 * 16, 3 * 16]
    # Rank 0 alone holds 5 pages; SGLang's MIN all-reduce makes both ranks restore 3.
    assert [r["hit"] for r in (*rank0, *rank1)] == [3 * 16, 3 * 16]
    assert [r["completed"] for r in (*rank0, *rank1)] == [3 * 16, 3 * 16]
    assert all(r["bytes_ok"] for r in (*rank0, *rank1))


def test_under_sglangs_random_backend_failures_the_ranks_always_agree_and_no_byte_is_wrong():
    # Six storage calls per round over both ranks, each failing with p = 0.1: a round is whole with
    # p = 0.53, so 16 rounds hold both kinds except with p < 1e-4.
    rounds = 16
    rank0, rank1 = run_ranks(
        (4, 4), rounds=rounds, prompt_pages=4, env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.1"}
    )
    assert len(rank0) == len(rank1) == rounds
    for mine, theirs in zip(rank0, rank1, strict=True):
        assert mine["hit"] == theirs["hit"]  # SGLang's hit sync: one answer for both ranks
        assert mine["completed"] == theirs["completed"]  # and one completion
        assert mine["bytes_ok"] and theirs["bytes_ok"]  # what was restored is what was backed up
    completed = [r["completed"] for r in rank0]
    assert any(c == 4 * 16 for c in completed), completed  # some rounds restored the whole prompt
    assert any(c < 4 * 16 for c in completed), completed  # and injected failures cut others


def test_hinted_ranks_each_read_their_own_shard_from_the_peers_same_rank():
    rank0, rank1 = run_ranks((4, 4), prompt_pages=4, peer=True)
    assert [r["backed_up"] for r in (*rank0, *rank1)] == [4 * 16, 4 * 16]  # on the peer, not locally
    assert [r["hit"] for r in (*rank0, *rank1)] == [4 * 16, 4 * 16]
    assert [r["completed"] for r in (*rank0, *rank1)] == [4 * 16, 4 * 16]
    assert all(r["bytes_ok"] for r in (*rank0, *rank1))  # each rank got its own shard's bytes
    assert [r["peer_leases"] for r in (*rank0, *rank1)] == [0, 0]  # released once the reads ended


def test_a_peer_failing_on_one_rank_is_a_miss_on_both_and_no_byte_lands_wrong():
    # Rank 1's peer is gone (its control port closed); rank 0's peer holds every page. SGLang's
    # MIN across ranks must turn rank 0's 4 leased pages into no restore on either rank.
    rank0, rank1 = run_ranks((4, 4), prompt_pages=4, peer=True, dead_peer_rank=1)
    assert [r["backed_up"] for r in (*rank0, *rank1)] == [4 * 16, 0]
    assert [r["hit"] for r in (*rank0, *rank1)] == [0, 0]
    assert [r["completed"] for r in (*rank0, *rank1)] == [0, 0]
    assert all(r["bytes_ok"] for r in (*rank0, *rank1))
    assert rank0[0]["peer_leases"] == 0  # what rank 0's hit query leased was let go when the MIN trimmed it


def test_dp_attention_ranks_are_replicas_each_restoring_what_its_own_kvcr_holds():
    """DP attention 2 x 1: each attention-DP rank is its own replica (attention-TP group of one), so
    SGLang syncs nothing across them; kvcr sees tp 0 of 1 with dp_rank 0 and 1 and serves each alone
    (on its own control port: base + dp rank)."""
    identities: list = []
    rank0, rank1 = run_ranks((5, 3), dp_attention=True, identities=identities)
    assert identities == [{"tp_rank": 0, "tp_size": 1, "dp_rank": 0}, {"tp_rank": 0, "tp_size": 1, "dp_rank": 1}]
    assert [r["hit"] for r in (*rank0, *rank1)] == [5 * 16, 3 * 16]  # no MIN across DP ranks
    assert [r["completed"] for r in (*rank0, *rank1)] == [5 * 16, 3 * 16]
    assert all(r["bytes_ok"] for r in (*rank0, *rank1))
