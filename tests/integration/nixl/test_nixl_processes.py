"""NIXL behaviour that needs its own process: a forced tcp transport, and nixl missing."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run(script, timeout=120, **env):
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        env={**os.environ, "UCX_NET_DEVICES": "lo", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed


@pytest.mark.nixl
@pytest.mark.multiprocess
def test_a_forced_tcp_transport_is_reported_with_a_warning():
    done = run(
        """
        import json, logging
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
        from kvcr.adapters.nixl import NixlDataPlane
        plane = NixlDataPlane("tcp-only")
        report = plane.transport_report
        print(json.dumps({"zero_copy": report.zero_copy, "causes": report.causes, "tls": report.ucx_tls}))
        plane.close()
        """,
        UCX_TLS="tcp",
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["zero_copy"] is False and report["tls"] == "tcp"
    assert any("UCX_TLS=tcp" in cause for cause in report["causes"])
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING kvcr.adapters.nixl")]
    assert warnings and "UCX_TLS=tcp" in warnings[0] and "tcp-only" in warnings[0]


@pytest.mark.nixl
@pytest.mark.multiprocess
def test_cancel_of_a_live_read_is_uncertain_and_the_read_still_lands():
    # Over emulated tcp RMA the source must progress for a READ to move, and its pump only runs
    # every 50 ms, so a 32 MiB READ is surely in flight when we cancel it.
    done = run(
        """
        import json, time
        import numpy as np
        from kvcr.adapters.nixl import NixlDataPlane
        from kvcr.domain.errors import KvcrError
        from kvcr.domain.layout import CopyRun, RegionDescriptor
        from kvcr.ports.dataplane import TransferState

        n = 32 << 20
        src = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        source = NixlDataPlane("source", progress_interval_s=0.05, check_transport=False)
        target = NixlDataPlane("target", check_transport=False)
        source.register([RegionDescriptor("src", src.ctypes.data, n, 1, n)])
        target.register([RegionDescriptor("dst", dst.ctypes.data, n, 1, n)])
        peer = target.connect(source.describe())
        handle = target.read(peer, [CopyRun("src", 0, "dst", 0, n)])
        cancelled = target.cancel(handle)
        landed_then = int(np.count_nonzero(dst))
        refusals = []
        for attempt in (lambda: target.release(handle), target.close):
            try:
                attempt()
            except KvcrError:
                refusals.append(True)
        deadline = time.monotonic() + 60
        state = target.poll(handle)
        while not state.terminal and time.monotonic() < deadline:
            time.sleep(0.001)
            state = target.poll(handle)
        equal = bool(np.array_equal(src, dst))
        target.release(handle)
        target.close()
        source.close()
        print(json.dumps({"cancelled": cancelled.value, "landed_then": landed_then, "refusals": len(refusals),
                          "final": state.value, "equal": equal}))
        """,
        UCX_TLS="tcp",
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cancelled"] == "uncertain"
    assert result["refusals"] == 2  # neither release() nor close() while it may still write
    assert result["final"] == "done" and result["equal"]  # it was never stopped: every byte landed
    assert result["landed_then"] < 32 << 20


def test_the_package_imports_without_nixl_and_says_so_when_built():
    done = run(
        """
        import sys
        sys.modules["nixl"] = None  # as if it were not installed
        import kvcr.adapters.nixl as adapter
        from kvcr.ports.errors import TransportError
        assert "nixl._api" not in sys.modules
        try:
            adapter.NixlDataPlane("x", check_transport=False)
        except TransportError as exc:
            print("refused:", exc)
        """
    )
    assert "refused: NIXL is not installed" in done.stdout
