"""Sources killed mid-read over and over, against several UCX data planes in one target process."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integration.ucx.support import REPO

pytestmark = [pytest.mark.ucx, pytest.mark.nixl, pytest.mark.multiprocess, pytest.mark.fault]


def test_a_target_with_several_planes_outlives_its_sources_being_killed_mid_read():
    # The target runs in a child so that a crash is this test's failure, not pytest's, and so that
    # its process holds exactly the state the crash needed (issue 27): ucxx's UCX hooked memory
    # events first, then NIXL's UCX did, and a peer-mode plane made after that had no registration
    # cache, which UCX 1.21 dereferences when a rendezvous aborts (SIGSEGV in ucp_memh_invalidate).
    spec = {"rounds": 7, "pages": 32, "piece": 1 << 20, "before": ["peer"] * 3, "other_ucx": True, "after": ["peer"]}
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.ucx.kill_storm", json.dumps(spec)],
        cwd=REPO,
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode >= 0, f"the target died of {signal.Signals(-done.returncode).name}: {done.stderr[-3000:]}"
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kills"] >= 20 and len(report["planes"]) >= 3
    outcomes = report["outcomes"]["peer"]
    assert sum(outcomes.values()) == report["kills"]  # every read ended...
    assert set(outcomes) <= {"done", "failed"}  # ...in DONE or FAILED
    assert outcomes.get("failed", 0) >= 1  # and some kills did land mid-read
    # Peer mode runs only with a registration cache: the plane made after NIXL's UCX either has one
    # or was refused, with the reason.
    assert all(plane["registration_cache"] for plane in report["planes"])
    assert len(report["planes"]) + len(report["refused"]) == 4
    assert all("registration cache" in refusal["error"] for refusal in report["refused"])
