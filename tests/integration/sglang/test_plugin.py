"""The hint-forwarding plugin end to end, each case in a fresh process (hooks patch SGLang globally)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_flow(mode: str, stderr: list[str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.sglang.plugin_flow", mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if stderr is not None:
        stderr.append(done.stderr)
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
    assert result["doctor"][0] == "ok", result["doctor"]  # the same check is green where every point fits


@pytest.mark.multiprocess
def test_a_revoked_prefetch_releases_its_leases_at_once():
    result = run_flow("revoked")
    assert result["hit_tokens"] == 4 * 16
    assert result["leases_after_query"] == 1
    assert result["leases"] == 0  # released when SGLang revoked it, not after lease_ms


@pytest.mark.multiprocess
def test_without_the_plugin_stock_sglang_drops_the_hint():
    assert run_flow("without-plugin")["hit_tokens"] == 0


@pytest.mark.multiprocess
def test_a_hook_point_this_sglang_changed_turns_hints_off_loudly_and_the_rest_keeps_working():
    logs: list[str] = []
    result = run_flow("moved-hook", logs)
    target = "sglang.srt.managers.cache_controller.HiCacheController._page_transfer"
    assert result["missing"] == [f"{target}: takes (self, prefetch_op, ...), kvcr's hook passes (self, operation, ...)"]
    assert result["hit_tokens"] == 0  # no hint hook was registered: the hinted pages are not found
    assert result["gauge"] == 1.0
    errors = [line for line in logs[0].splitlines() if "request hints are OFF" in line]
    assert len(errors) == 1 and target in errors[0], logs[0][-3000:]
    assert "get no KV events" not in logs[0]  # the backup hook point is unchanged: still captured
    status, detail = result["doctor"]  # and kvcr doctor is red, naming the point
    assert status == "FAIL" and "request hints (or KV events) off" in detail and target in detail, detail


@pytest.mark.multiprocess
def test_pd_decode_keeps_the_requests_hint_through_sglangs_anonymous_hit_query():
    """SGLang's decode side asks storage for its hit under a handle that names no request; the hint
    must still be current there, or a PD decode worker never reads a peer's pages."""
    result = run_flow("decode")
    assert result["hit_tokens"] == 4 * 16
    assert result["leases_after_query"] > 0  # the query leased the peer's pages for this request ...
    assert result["prefetched_tokens"] == 4 * 16
    assert result["bytes_equal"] is True
    assert result["leases"] == 0  # ... and the prefetch's end let them go


@pytest.mark.multiprocess
def test_a_pd_decode_prefetch_sglang_declines_releases_what_its_query_leased():
    result = run_flow("decode-declined")
    assert result["hit_tokens"] == 4 * 16 and result["leases_after_query"] > 0
    assert result["hit_after_start"] == 0  # SGLang's tree issued no prefetch: nothing will read them
    assert result["leases"] == 0  # released at once, not held for lease_ms
