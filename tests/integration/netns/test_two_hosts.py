"""Two hosts on one machine: replicas in two network namespaces joined by a veth pair, UCX over tcp.

The test creates the namespaces and the pair (addresses of its own, inside them) and always
removes them. Control traffic is CURVE-authenticated (the addresses are not loopback). A link cut
mid-read (``ip link set ... down``) gives misses within the operation deadline and a live worker:
the given-up READ stays in flight (tcp retransmits), lands in the target's quarantined staging
memory once the link is back, and never in SGLang's host pages; then reads work again, without a
restart of either side.
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from kvcr.soak.pattern import prompt_keys
from kvcr.testing.netns import TwoHosts
from tests.fault.support import Fault

pytestmark = [
    pytest.mark.netns,
    pytest.mark.fault,
    pytest.mark.nixl,
    pytest.mark.sglang,
    pytest.mark.multiprocess,
    pytest.mark.zmq,
]

LAYERS, PAGES = 8, 32  # 2 MiB pages, 64 MiB per read
OP_MS, CONTROL_MS, RETRY_MS = 2000, 250, 500
SETTINGS = {
    "operation_timeout_ms": OP_MS,
    "abandon_timeout_ms": 2 * OP_MS,
    "control_timeout_ms": CONTROL_MS,
    "peer_retry_ms": RETRY_MS,
    "read_batch_pages": 8,
}
BOUND_S = OP_MS / 1000 + 1.0


@pytest.fixture
def hosts():
    with TwoHosts(f"kt{secrets.randbelow(100000)}") as made:
        yield made


@pytest.fixture
def token(tmp_path):
    path = tmp_path / "token"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


def _replica(cluster, hosts, token, side, **options):
    ns, dev, addr = (hosts.a, hosts.dev_a, hosts.addr_a) if side == "a" else (hosts.b, hosts.dev_b, hosts.addr_b)
    settings = {"auth_token_file": token, **options.pop("settings", {})}
    return cluster.start(
        f"host-{side}",
        layers=LAYERS,
        host=addr,
        netns=ns,
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev},
        settings=settings,
        **options,
    )


def test_a_link_cut_mid_read_costs_misses_within_the_deadline_and_reads_resume_without_a_restart(
    cluster, figures, hosts, token
):
    fault = Fault("link cut mid-read (two namespaces, veth down)", "tcp")
    source = _replica(cluster, hosts, token, "a", host_pages=3 * PAGES, dram_pages=6 * PAGES)
    target = _replica(cluster, hosts, token, "b", host_pages=PAGES, dram_pages=4, settings=SETTINGS)
    assert source.endpoint.startswith(f"tcp://{hosts.addr_a}:")
    before, cut, after = (prompt_keys(p, PAGES) for p in (70, 71, 72))
    for i, keys in enumerate((before, cut, after)):
        assert all(source.ask("backup", keys=keys, first_slot=i * PAGES)["stored"])
    first = fault.call(target.ask("restore", keys=before, first_slot=0, hint=source.endpoint), BOUND_S)
    assert first["results"] == [True] * PAGES  # across the link, over tcp, byte-checked
    fault.notes.append(f"restore of 64 MiB over the link {first['get_s'] * 1e3:.0f} ms")

    assert fault.call(target.ask("exists", keys=cut, hint=source.endpoint), BOUND_S)["hits"] == PAGES
    cutter = threading.Timer(min(0.02, first["get_s"] / 4), hosts.link, args=(False,))
    cutter.start()
    read = fault.call(target.ask("get", keys=cut, first_slot=0, hint=source.endpoint), BOUND_S)
    cutter.join()
    assert not all(read["results"]), "the read finished before the cut; the test did not cut it"
    fault.notes.append(f"read cut: {sum(read['results'])}/{PAGES} restored in {read['seconds']:.2f}s")
    # While the link is down: a hit query is a miss within the control deadline (or the peer is skipped).
    down = fault.call(target.ask("restore", keys=after, first_slot=0, hint=source.endpoint), BOUND_S)
    assert down["hits"] == 0 and down["exists_s"] <= CONTROL_MS / 1000 + 0.25
    fault.alive(target)
    fault.poison(target, 0, PAGES)

    hosts.link(up=True)
    time.sleep(2.0)  # tcp retransmits; the given-up READ lands in quarantined staging memory
    fault.poison(target, 0, PAGES)
    deadline = time.monotonic() + 30
    while True:  # no restart: the same processes, the same link
        again = fault.call(target.ask("restore", keys=after, first_slot=0, hint=source.endpoint), BOUND_S)
        if again["results"] == [True] * PAGES or time.monotonic() > deadline:
            break
        time.sleep(RETRY_MS / 1000)
    assert again["results"] == [True] * PAGES, "reads did not work again after the link came back"
    stats = target.ask("stats")
    assert stats["quarantined"] == 0 and stats["staging_quarantined"] == 0 and stats["live_transfers"] == 0
    fault.trials += 1
    fault.alive(target)
    assert source.alive
    figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(source)
