"""The soak's CI variant: ``kvcr soak`` with four replica processes for 90 s, scraped once while it runs.

The long run (10 minutes or more) is the same command with a larger ``--minutes``; its figures are
in docs/faults.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import free_port

pytestmark = [pytest.mark.soak, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[2]
MINUTES = 1.5


def _scrape(url: str, deadline: float) -> str:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as page:
                text = page.read().decode()
            if 'kvcr_soak_operations_total{kind="remote_restore"' in text:
                return text
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no soak series on {url}")
        time.sleep(2)


@pytest.mark.timeout(600)
def test_a_short_soak_of_four_replicas_counts_no_wrong_bytes_hangs_exceptions_or_leaks(tmp_path):
    port = free_port()
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable, "-m", "kvcr.cli", "soak", "--replicas", "4", "--minutes", str(MINUTES),
        "--report-every-s", "15", "--metrics-port", str(port), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=dict(os.environ, UCX_NET_DEVICES="lo"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        metrics = _scrape(f"http://127.0.0.1:{port}/metrics", time.monotonic() + 240)
        stdout, stderr = proc.communicate(timeout=MINUTES * 60 + 240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (stdout.decode()[-3000:], stderr.decode()[-3000:])
    assert "kvcr_soak_wrong_bytes_total" in metrics and "kvcr_soak_rss_bytes" in metrics
    report = json.loads(out.read_text())
    assert report["options"]["transport"] == "auto"  # kvcr's default: these same-host replicas read over shm
    assert report["ok"] and report["wrong_bytes"] == 0 and report["hangs"] == 0 and report["exceptions"] == 0
    assert report["leaks"] == dict.fromkeys(report["leaks"], 0)
    assert all(count > 100 for count in report["operations"].values()), report["operations"]
    assert all(pages > 0 for pages in report["pages_restored"].values()), report["pages_restored"]
    for replica in report["replicas"]:
        assert replica["closed"]["error"] is None and replica["alive_until_close"]
        assert replica["rss_growth"] < 64 << 20, (replica["name"], replica["rss_growth"])
        assert not replica["logs"].get("ERROR"), replica["first_logs"]
    assert "OK" in stdout.decode().splitlines()[-1]
