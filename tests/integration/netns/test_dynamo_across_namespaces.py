"""Dynamo on etcd + NATS with kvcr workers on separate "hosts": network namespaces on one bridge.

The frontend, etcd and NATS run in one namespace; workers A, B and (late) C each in their own,
advertising their own addresses, UCX over tcp between them. The router's hint sends a request to
B, whose kvcr reads the prefix from A across the bridge, every page verified; C joins late, is
routed to, and its pages are read by a peer on the router's hint too. Then the churn: NATS and
etcd each stopped while requests come in, the frontend restarted (a hinted read across namespaces
after each), and C SIGKILLed while it holds a prefix no one else has (the frontend runs with
Dynamo's ``--migration-limit 3``, so a request booked on C before the router drops it goes to a
live worker). Every namespace (and so every veth pair and the bridge) is this test's own and removed.
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
        # Dynamo's request migration: without it the frontend answers 503 to a request it books on a
        # killed worker before the worker's etcd lease expires (6 of 22 here, in one run)
        job["router_args"] = ["--migration-limit", "3"]
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
    churn = out["churn"]
    for server in ("nats", "etcd"):
        outage = churn[server]
        # every request during the outage answered from the prefix's holder (nothing recomputed)
        assert len(outage["during"]) == 3 and all(r["computed_pages"] == 0 for r in outage["during"]), outage
        assert_hinted_read(outage["after"], out["endpoints"]["a"])
        again = outage["routable_again_s"]
        print(f"{server} down {outage['down_s']:.1f} s: 3/3 answered; all routable again {again:.1f} s after")
    assert_hinted_read(churn["after_frontend"], out["endpoints"]["a"])
    listed = churn["while_listed"]
    answered = [r for r in listed if "error" not in r]
    assert len(answered) == len(listed), listed  # each one booked on dead C migrated to a live worker
    missed = [r for r in answered if r["hint_source"] == out["endpoints"]["c"]]
    assert all(r["peer_pages"] == 0 and r["mismatched_pages"] == 0 for r in missed)  # a miss, never bytes
    after = churn["after_dropped"]
    # the router forgot C with it: no hint names C (the prefix is served by whoever recomputed it meanwhile)
    assert after["hint_source"] != out["endpoints"]["c"] and after["mismatched_pages"] == 0, after
    print(
        f"frontend restarted: routable {churn['frontend_routable_s']:.1f} s later; C SIGKILLed: dropped "
        f"{churn['dead_dropped_s']:.1f} s later, {len(answered)}/{len(listed)} requests answered meanwhile, "
        f"{len(missed)} of them hinted to dead C (each a miss, recomputed)"
    )


def assert_hinted_read(record: dict, source: str) -> None:
    """A read across namespaces on the router's hint: another worker than A (B or C) read A's pages."""
    assert record["worker"] != "a" and record["hint"] is True and record["hint_source"] == source, record
    assert (record["peer_pages"], record["computed_pages"]) == (PREFIX_PAGES, 0)
    assert record["verified"] is True and record["mismatched_pages"] == 0
