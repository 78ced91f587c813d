"""End to end on loopback: router hint -> replica B's SGLang backend -> restore from replica A, bytes equal.

Each flow runs in a fresh process (``e2e_flow.py``): kvcr's SGLang plugin patches SGLang's classes
for the whole process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# The data plane between the two replicas (both live in one process, each with its own NIXL agent).
E2E_TRANSPORT = "nixl"

pytestmark = [pytest.mark.sglang, pytest.mark.multiprocess]


def run_flow(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.dynamo.e2e_flow", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.nixl
def test_a_router_hint_restores_the_sources_pages_into_the_targets_host_pool():
    result = run_flow(E2E_TRANSPORT)
    pages, tokens = 6, 6 * 16
    assert result["backed_up_tokens"] == tokens
    assert result["captured_pages"] == pages  # the plugin captured the tokens on SGLang's backup path
    assert result["a_holds"] == [True] * pages
    assert result["a_kv_events"]["stored_pages"] == pages
    assert result["router_blocks_on_a"] == pages
    assert result["hint_source"].startswith("tcp://127.0.0.1:")
    assert result["hint_names_a_pages"] is True
    assert result["hit_tokens"] == tokens
    assert result["prefetched_tokens"] == tokens
    assert result["bytes_equal"] is True
    assert result["a_leases_left"] == 0
    assert result["b_kv_events"]["stored_pages"] == 0  # restored into B's host pool, not B's kvcr DRAM


def test_without_the_plugin_no_tokens_are_captured_and_nothing_is_hinted():
    result = run_flow("mock", "without-plugin")  # no hint, no bytes move: the data plane does not matter
    assert result["backed_up_tokens"] == 6 * 16 and result["a_holds"] == [True] * 6
    assert result["captured_pages"] == 0
    assert result["a_kv_events"] == {**result["a_kv_events"], "stored_pages": 0, "skipped_pages": 6}
    assert result["router_blocks_on_a"] == 0
    assert result["hint_source"] is None
    assert result["hit_tokens"] == 0
