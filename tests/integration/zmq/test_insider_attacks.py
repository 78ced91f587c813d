"""Attacks by a token holder on other peers' sessions and leases, over real ZMQ with real CURVE.

The source and its honest target are runner nodes in this process (the data plane is the mock, so
bytes really move); the insider is another process holding the cluster token and speaking the peer
protocol from its own connection (``tests/integration/zmq/insider.py``). Integrity checks are off
(the default), so only the lease protects what the honest target reads.
"""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcr.adapters.local import MonotonicClock
from kvcr.domain.deadlines import Timing
from kvcr.domain.outcomes import Outcome
from kvcr.runner.peer_client import PoolRead
from kvcr.testing.processes import stop_process
from tests.support import Cluster, content, sequence

pytestmark = [pytest.mark.zmq, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[3]
TOKEN = b"insider-cluster-token-0123456789"
TIMING = Timing(operation_s=2.0, abandon_s=4.0, control_s=1.0, lease_s=5.0, lease_margin_s=0.5, retry_after_s=1.0)
PAGE_BYTES = 512


class Insider:
    """The hostile token holder's process; one JSON command in, one JSON answer out."""

    def __init__(self, tmp_path, endpoint, identity=None):
        cmd = [sys.executable, "-m", "tests.integration.zmq.insider", "--endpoint", endpoint]
        if identity is None:
            token_file = tmp_path / "insider-token"
            token_file.write_bytes(TOKEN)
            token_file.chmod(0o600)
            cmd += ["--token-file", str(token_file)]
        else:  # (key file, directory, the endpoint the directory lists the insider at)
            key_file, directory, own = identity
            cmd += ["--node-key-file", str(key_file), "--directory", str(directory), "--own-endpoint", own]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def do(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        assert out and out[0], f"the insider did not answer {command['do']}: {self.proc.stderr.read()[-2000:]}"
        return json.loads(out[0])

    def close(self):
        stop_process(self.proc)


@pytest.fixture
def cluster():
    c = Cluster(MonotonicClock(), control="zmq")
    yield c
    c.close()


@pytest.fixture
def insider(tmp_path):
    made = []

    def make(endpoint, identity=None):
        made.append(Insider(tmp_path, endpoint, identity))
        return made[-1]

    yield make
    for one in made:
        one.close()


def refused(node, reason):
    return node.metrics.snapshot().get(f"kvcr_peer_requests_refused_total{{reason={reason}}}", 0)


def until(condition, timeout_s=5.0):
    give_up = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < give_up:
        time.sleep(0.01)
    return condition()


def test_another_connection_cannot_release_or_spend_a_peers_lease(cluster, insider):
    """The attack of issue 23 (B): release the victim's lease, let the owner reuse its slots, and the
    victim's read under the lease it still trusts returns the new pages' bytes (4/4 wrong before)."""
    a = cluster.node("A", token=TOKEN, slots=16, timing=TIMING, verify_bytes=False)
    b = cluster.node("B", token=TOKEN, slots=16, timing=TIMING, verify_bytes=False)
    pages = sequence(4)
    host = a.hosts["kv"]
    for slot, page in enumerate(pages):
        host.write_page(slot, content(page, PAGE_BYTES))
    assert all(a.runner.backup("kv", pages, list(range(4))))
    lease = b.client.lease(a.endpoint, [("kv", pages)])
    assert lease is not None and a.runner.active_leases == 1
    session, pool_id = lease.link.session, lease.link.pools["kv"].pool_id

    hostile = insider(a.endpoint)
    assert hostile.do(do="release", session=session, lease_ids=[lease.lease_id]) == {"sent": True}
    until(lambda: refused(a, "foreign_session") >= 1 or not a.runner.active_leases)
    held = a.runner.active_leases

    # The owner fills its arena with 16 new pages: unleased slots are reused, leased ones are not.
    fresh = sequence(16, start=1000)
    for slot, page in enumerate(fresh):
        host.write_page(slot, content(page, PAGE_BYTES))
    a.runner.backup("kv", fresh, list(range(16)))

    result = b.client.read(lease, [PoolRead("kv", pages, [20, 21, 22, 23])])
    restored = sum(o.outcome is Outcome.RESTORED for o in result["kv"])
    wrong = sum(b.hosts["kv"].read_page(20 + i) != content(page, PAGE_BYTES) for i, page in enumerate(pages))
    # Nor can it take leases under the victim's session (spending its nonces, pinning under its name).
    spent = hostile.do(do="lease", session=session, pages=[[pool_id, pages]])
    figures = {"leases_held": held, "restored": restored, "wrong_pages": wrong, "insider_lease": spent}
    # UNKNOWN_SESSION (4): the same answer as for no session at all; both attempts counted.
    assert figures == {"leases_held": 1, "restored": 4, "wrong_pages": 0, "insider_lease": {"refused": 4}}
    assert refused(a, "foreign_session") == 2
    b.client.release(lease)
    assert until(lambda: a.runner.active_leases == 0)  # the owner's own connection still releases it


def test_a_peer_that_keeps_re_leasing_pages_cannot_starve_another_peers_restore(cluster, insider):
    """The attack of issue 23 (D): an insider leases (and keeps re-leasing) as many pages as the pool's
    lease cap allows, from two sessions; a second target restoring the owner's 16 newest pages, which
    nobody leases, got 0/16 until the pins expired. Each connection now pins at most its share."""
    a = cluster.node("A", token=TOKEN, slots=64, timing=TIMING, verify_bytes=False, peer_share=0.5)
    b = cluster.node("B", token=TOKEN, slots=16, timing=TIMING, verify_bytes=False)
    pages = sequence(48)
    host = a.hosts["kv"]
    for slot, page in enumerate(pages):
        host.write_page(slot, content(page, PAGE_BYTES))
    assert all(a.runner.backup("kv", pages, list(range(48))))

    hostile = insider(a.endpoint)
    sessions = [hostile.do(do="hello", namespaces=dict(a.runner.namespaces)) for _ in range(2)]
    pinned = set()
    for _ in range(3):  # re-leasing: fresh leases over the same pages, before the old ones expire
        for n, opened in enumerate(sessions):
            wanted = pages[16 * n : 16 * n + 16]
            granted = hostile.do(do="lease", session=opened["session"], pages=[[opened["pools"]["kv"], wanted]])
            pinned |= {page for page, slot in zip(wanted, granted["slots"][0], strict=True) if slot >= 0}
    held = a.runner.active_leases

    newest = pages[32:]
    result = b.client.restore(a.endpoint, [PoolRead("kv", newest, list(range(16)))])
    restored = sum(o.outcome is Outcome.RESTORED for o in result["kv"])
    equal = sum(b.hosts["kv"].read_page(i) == content(page, PAGE_BYTES) for i, page in enumerate(newest))
    figures = {"insider_pinned": len(pinned), "restored": restored, "byte_equal": equal}
    assert figures == {"insider_pinned": 16, "restored": 16, "byte_equal": 16}
    assert held >= 3 and refused(a, "peer_quota") >= 3  # its LEASEs past its share were cut, and counted


def _identities(tmp_path, *names):
    """A key per name and one directory listing them all: {name: (secret, endpoint)}, the directory."""
    from kvcr.adapters.zmq.identity import generate_secret_key
    from tests.contract.zmq_kind import free_port

    made, lines = {}, []
    for name in names:
        secret, public = generate_secret_key()
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        made[name] = (secret, endpoint)
        lines.append(f"{endpoint} {public.decode()}")
    directory = tmp_path / "peers"
    directory.write_text("\n".join(lines) + "\n")
    return made, directory


@pytest.mark.parametrize("credentials", ["token", "per-node keys"])
def test_a_node_pins_at_most_its_share_however_many_connections_it_opens(cluster, insider, tmp_path, credentials):
    """The attack of issue 23 (D) from several connections: each connection gets a share of the pool's
    lease cap, so with one cluster token (every node the same key) an insider with two connections
    pins the whole cap and a second target's restore of 16 unleased pages gets 0/16. With per-node
    keys the quota belongs to the node: two connections share one share, and the restore gets 16/16."""
    keys, directory = _identities(tmp_path, "A", "B", "insider")
    if credentials == "token":
        creds = {"A": {"token": TOKEN}, "B": {"token": TOKEN}}
        hostile_identity = None
    else:
        creds = {n: {"identity": (keys[n][0], directory)} for n in ("A", "B")}
        key_file = tmp_path / "insider.key"
        key_file.write_bytes(keys["insider"][0])
        key_file.chmod(0o600)
        hostile_identity = (key_file, directory, keys["insider"][1])
    port = {n: int(keys[n][1].rsplit(":", 1)[1]) for n in ("A", "B")}
    a = cluster.node("A", port["A"], slots=64, timing=TIMING, verify_bytes=False, peer_share=0.5, **creds["A"])
    b = cluster.node("B", port["B"], slots=16, timing=TIMING, verify_bytes=False, **creds["B"])
    pages = sequence(48)
    host = a.hosts["kv"]
    for slot, page in enumerate(pages):
        host.write_page(slot, content(page, PAGE_BYTES))
    assert all(a.runner.backup("kv", pages, list(range(48))))

    hostile = insider(a.endpoint, hostile_identity)
    pinned = set()
    for n in range(2):  # one session on each of two connections
        opened = hostile.do(do="hello", connection=n, namespaces=dict(a.runner.namespaces))
        wanted = pages[16 * n : 16 * n + 16]
        granted = hostile.do(
            do="lease", connection=n, session=opened["session"], pages=[[opened["pools"]["kv"], wanted]]
        )
        pinned |= {page for page, slot in zip(wanted, granted["slots"][0], strict=True) if slot >= 0}

    newest = pages[32:]
    result = b.client.restore(a.endpoint, [PoolRead("kv", newest, list(range(16)))])
    restored = sum(o.outcome is Outcome.RESTORED for o in result["kv"])
    equal = sum(b.hosts["kv"].read_page(i) == content(page, PAGE_BYTES) for i, page in enumerate(newest))
    figures = {"insider_pinned": len(pinned), "restored": restored, "byte_equal": equal}
    if credentials == "token":  # what a shared token cannot tell apart (docs/security.md)
        assert figures == {"insider_pinned": 32, "restored": 0, "byte_equal": 0}
    else:
        assert figures == {"insider_pinned": 16, "restored": 16, "byte_equal": 16}
        assert refused(a, "peer_quota") >= 1


def test_a_revoked_node_gets_nothing_more_over_the_connection_it_already_holds(cluster, insider, tmp_path):
    """Per-node identities: the insider (its own key, listed) opens a session and leases; its line is
    removed from the source's directory (renamed over, nobody restarts); its very next LEASE over the
    same connection is refused as revoked, and the honest target's restore still works."""
    keys, directory = _identities(tmp_path, "A", "B", "insider")
    port = {n: int(keys[n][1].rsplit(":", 1)[1]) for n in ("A", "B")}
    a = cluster.node("A", port["A"], slots=32, timing=TIMING, identity=(keys["A"][0], directory))
    b = cluster.node("B", port["B"], slots=16, timing=TIMING, identity=(keys["B"][0], directory))
    pages = sequence(8)
    for slot, page in enumerate(pages):
        a.hosts["kv"].write_page(slot, content(page, PAGE_BYTES))
    assert all(a.runner.backup("kv", pages, list(range(8))))
    key_file = tmp_path / "insider.key"
    key_file.write_bytes(keys["insider"][0])
    key_file.chmod(0o600)
    hostile = insider(a.endpoint, (key_file, directory, keys["insider"][1]))
    opened = hostile.do(do="hello", namespaces=dict(a.runner.namespaces))
    lease = [[opened["pools"]["kv"], pages[:4]]]
    assert "lease_id" in hostile.do(do="lease", session=opened["session"], pages=lease)

    kept = [line for line in directory.read_text().splitlines() if not line.startswith(keys["insider"][1])]
    staged = tmp_path / "peers.new"
    staged.write_text("\n".join(kept) + "\n")
    staged.replace(directory)
    revoked_at = time.monotonic()
    answer = hostile.do(do="lease", session=opened["session"], pages=lease)
    while "failed" not in answer and time.monotonic() - revoked_at < 2:
        answer = hostile.do(do="lease", session=opened["session"], pages=lease)
    refused_after_s = time.monotonic() - revoked_at
    assert "revoked" in answer.get("failed", ""), answer
    assert refused_after_s < 0.5 and refused(a, "revoked") >= 1

    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, list(range(8)))])
    assert sum(o.outcome is Outcome.RESTORED for o in result["kv"]) == 8
    assert all(b.hosts["kv"].read_page(i) == content(page, PAGE_BYTES) for i, page in enumerate(pages))
