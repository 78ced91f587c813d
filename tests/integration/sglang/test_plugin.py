"""The hint-forwarding plugin end to end, each case in a fresh process (hooks patch SGLang globally)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_flow(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.sglang.plugin_flow", mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_sglang_finds_the_plugin_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("kvcr") == "kvcr.integrations.sglang.plugin:load"


@pytest.mark.multiprocess
def test_a_hint_set_on_a_request_reaches_the_backend():
    result = run_flow("with-plugin")
    assert result["hit_tokens"] == 4 * 16
    assert result["prefetched_tokens"] == 4 * 16
    assert result["bytes_equal"] is True
    assert result["leases"] == 0  # the source lets go as soon as the prefetch ends


@pytest.mark.multiprocess
def test_a_revoked_prefetch_releases_its_leases_at_once():
    result = run_flow("revoked")
    assert result["hit_tokens"] == 4 * 16
    assert result["leases_after_query"] == 1
    assert result["leases"] == 0  # released when SGLang revoked it, not after lease_ms


@pytest.mark.multiprocess
def test_without_the_plugin_stock_sglang_drops_the_hint():
    assert run_flow("without-plugin")["hit_tokens"] == 0
