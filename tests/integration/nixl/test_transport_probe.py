"""The two-process transport probe and kvcr doctor's transport line: quiet on CMA, speaking on tcp."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcr.adapters.nixl.transport_probe import probe_transport

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]
REPO = Path(__file__).resolve().parents[3]
SKIP = "--skip=sglang,page-keys,config,ports,token"


def doctor(**env):
    done = subprocess.run(
        [sys.executable, "-m", "kvcr.cli", "doctor", SKIP, "--read-bytes", "8MiB"],
        cwd=REPO,
        env={**os.environ, "UCX_NET_DEVICES": "lo", **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = done.stdout.splitlines()
    [transport] = [line for line in lines if line.split()[1:2] == ["transport"]]
    return done.returncode, transport, done.stdout + done.stderr


def test_a_read_between_two_processes_uses_cma_zero_copy_here():
    report = probe_transport(nbytes=8 << 20, repeats=3)
    assert report.zero_copy and not report.causes, report.summary()
    assert report.transport == "cma/memory" and report.verified
    assert report.solo_reads == 3 and report.read_gbps > 0.2
    assert "zero-copy" in report.summary()


def test_the_doctor_stays_quiet_on_this_host():
    rc, transport, output = doctor()
    assert rc == 0, output
    assert transport.startswith("ok ") and "cma/memory (zero-copy)" in transport
    assert "slow" not in output and "WARN" not in output and "NIXL INFO" not in output


def test_the_doctor_speaks_when_ucx_is_forced_to_tcp():
    rc, transport, output = doctor(UCX_TLS="tcp")
    assert rc == 2, output
    assert transport.startswith("WARN") and "peer reads will be slow" in transport
    assert "tcp/lo (software emulation)" in transport and "UCX_TLS=tcp" in transport
    # Whether a tcp READ completed with the source idle is what the probe saw this time: usually not
    # (tcp emulates a READ with the source's worker), but UCX's async events sometimes complete one
    # (a loaded CI run did). The line says which, in either case.
    assert "needs the source to progress" in transport or "finishes without the source's help" in transport
    assert output.rstrip().endswith("kvcr will work, degraded")
