"""``kvcr bench remote --netns``: the remote benchmark across two namespaces, against raw NIXL on the same link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.nixl, pytest.mark.multiprocess, pytest.mark.zmq]

REPO = Path(__file__).resolve().parents[3]


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_bench_remote_across_two_namespaces_reports_the_tcp_ratio_and_removes_them(tmp_path):
    before = _namespaces()
    out = tmp_path / "remote.json"
    cmd = [sys.executable, "-m", "kvcr.cli", "bench", "remote", "--netns", "--page-sizes", "256KiB", "--batches", "8",
           "--reps", "3", "--no-plot", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tcp over veth" in done.stdout and "read vs raw" in done.stdout
    (row,) = json.loads(out.read_text())
    assert row["link"] == "tcp over veth (2 namespaces)" and row["verified"]
    assert row["raw_p50_ms"] > 0 and row["read_vs_raw"] > 0 and row["restore_vs_raw"] > 0
    assert _namespaces() <= before  # its namespaces (and so the veth pair) are gone
