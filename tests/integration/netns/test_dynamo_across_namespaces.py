"""Dynamo on etcd + NATS with kvcr workers on separate "hosts": network namespaces on one bridge.

The frontend, etcd and NATS run in one namespace; workers A, B and (late) C each in their own,
advertising their own addresses, UCX over tcp between them. The router's hint sends a request to
B, whose kvcr reads the prefix from A across the bridge, every page verified; C joins late, is
routed to, and its pages are read by a peer on the router's hint too. Every namespace (and so
every veth pair and the bridge) is this test's own and removed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kvcr.demo.dynamo.control_plane import missing
from kvcr.testing.netns import Hosts

pytestmark = [pytest.mark.netns, pytest.mark.nixl, pytest.mark.multiprocess, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[3]
PREFIX_PAGES = 4


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_the_router_hints_across_namespaces_and_a_late_worker_joins(tmp_path):
    assert missing("etcd", "nats") is None, "etcd and NATS are needed (CI installs them)"
    before = _namespaces()
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    with Hosts(4) as hosts:
        workers = {
            name: {"ns": hosts.names[i], "dev": hosts.devs[i], "addr": hosts.addrs[i]}
            for i, name in ((1, "a"), (2, "b"), (3, "c"))
        }
        job = {"workdir": str(tmp_path / "deployment"), "token_file": str(token), "frontend_addr": hosts.addrs[0]}
        job["workers"] = workers
        done = subprocess.run(
            [*hosts.exec_prefix(0), sys.executable, "-m", "tests.integration.dynamo.netns_flow", json.dumps(job)],
            cwd=REPO,
            env=dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=hosts.devs[0]),
            capture_output=True,
            text=True,
            timeout=400,
        )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"ready {out['ready_s']:.1f} s; C routable {out['join_s']:.1f} s after it started, "
        f"first request on C {out['first_request_to_c_s']:.1f} s after"
    )
    assert out["endpoints"]["a"] == f"tcp://{workers['a']['addr']}:{out['endpoints']['a'].rsplit(':', 1)[1]}"
    record = out["hinted"]
    assert record["worker"] == "b" and record["hint"] is True and record["hint_source"] == out["endpoints"]["a"]
    assert (record["peer_pages"], record["computed_pages"]) == (PREFIX_PAGES, 0)
    assert record["verified"] is True and record["mismatched_pages"] == 0
    assert out["served_by_c"] is not None, "the router never booked the late worker"
    late = out["hinted_from_c"]
    assert late["worker"] != "c" and late["hint"] is True and late["hint_source"] == out["endpoints"]["c"]
    assert late["peer_pages"] == PREFIX_PAGES and late["verified"] is True
    # Across namespaces kvcr's auto transport read each peer over NIXL (UCX tcp), never shared memory.
    logs = {name: (tmp_path / "deployment" / f"{name}.log").read_text(errors="replace") for name in ("b", "a")}
    assert "is read over NixlDataPlane, not shared memory" in logs["b"]
    assert not any("is read over shared memory" in text for text in logs.values())
    assert _namespaces() <= before
