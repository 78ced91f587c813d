"""Control messages dropped, delayed and duplicated between target and source (a ZMTP-aware relay).

The relay (``tests/fault/relay.py``) forwards the source's control port and acts on single peer-
protocol messages, keeping the ZMQ stream valid. Each case gets a fresh relay (a new endpoint, so
the target says HELLO again) in front of the same source. Expected: a lost or late message costs
at most ``control_timeout_ms`` and a miss, then the peer is skipped for ``peer_retry_ms`` and works
again; a duplicate is harmless (the source refuses a replayed nonce, the target ignores a reply to
a request it no longer waits for); a lost RELEASE only keeps pages until the lease expires.
"""

from __future__ import annotations

import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.relay import PASS, Action, Relay, once
from tests.fault.support import Fault

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess, pytest.mark.zmq]

LAYERS, PAGES = 2, 8  # 512 KiB pages
OP_MS, CONTROL_MS, RETRY_MS, LEASE_MS = 1500, 250, 300, 1000
SETTINGS = {
    "operation_timeout_ms": OP_MS,
    "control_timeout_ms": CONTROL_MS,
    "peer_retry_ms": RETRY_MS,
    "lease_ms": LEASE_MS,
}
BOUND_S = OP_MS / 1000 + 1.0
MISS_S = CONTROL_MS / 1000 + 0.2  # a lost message costs one control deadline, plus scheduling

DROP, TWICE = Action(copies=0), Action(copies=2)
# (name, policy, first restore hits?, slowest first hit query allowed)
CASES = [
    ("HELLO dropped", once("up", "Hello", DROP), False, MISS_S),
    ("HELLO reply dropped", once("down", "HelloReply", DROP), False, MISS_S),
    ("LEASE dropped", once("up", "Lease", DROP), False, MISS_S),
    ("LEASE reply dropped", once("down", "LeaseReply", DROP), False, MISS_S),
    ("LEASE reply delayed 100 ms", once("down", "LeaseReply", Action(delay_s=0.1)), True, 0.1 + MISS_S),
    ("LEASE reply delayed past the deadline", once("down", "LeaseReply", Action(delay_s=0.6)), False, MISS_S),
    ("HELLO duplicated", once("up", "Hello", TWICE), True, MISS_S),
    ("LEASE duplicated", once("up", "Lease", TWICE), True, MISS_S),
    ("LEASE reply duplicated", once("down", "LeaseReply", TWICE), True, MISS_S),
    ("every message delayed 50 ms", lambda d, k, f: Action(delay_s=0.05), True, 0.2 + MISS_S),
]


def test_lost_late_and_duplicated_control_messages_cost_at_most_a_miss(cluster, figures):
    target = cluster.start("target", layers=LAYERS, host_pages=PAGES, dram_pages=4, settings=SETTINGS)
    source = cluster.start("source", layers=LAYERS, host_pages=PAGES, dram_pages=4 * PAGES, settings=SETTINGS)
    port = int(source.endpoint.rsplit(":", 1)[1])
    keys = prompt_keys(30, PAGES)
    assert all(source.ask("backup", keys=keys, first_slot=0)["stored"])
    for name, policy, hits, slowest in CASES:
        fault = Fault(f"control: {name}")
        relay = Relay(port, policy)
        try:
            first = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=relay.endpoint), BOUND_S)
            assert first["exists_s"] <= slowest, (name, first["exists_s"])
            assert (first["results"] == [True] * PAGES) if hits else first["hits"] == 0, (name, first["hits"])
            fault.notes.append(f"first hit query {first['exists_s'] * 1e3:.0f} ms, {first['hits']} hits")
            relay.policy = lambda d, k, f: PASS
            time.sleep(RETRY_MS / 1000 + 0.05)  # a failed peer is skipped this long
            again = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=relay.endpoint), BOUND_S)
            assert again["results"] == [True] * PAGES, f"{name}: the peer did not come back"
            fault.trials += 1
            fault.poison(target, 0, PAGES)
            fault.alive(target)
            assert source.alive
        finally:
            relay.close()
        figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(source)


def test_a_lost_release_keeps_pages_only_until_the_lease_expires(cluster, figures):
    """The source's pages stay claimed (unevictable) under a lease whose RELEASE was lost, then go."""
    fault = Fault("control: RELEASE dropped")
    dram = 2 * PAGES  # a peer may lease half: exactly our prompt
    target = cluster.start("target", layers=LAYERS, host_pages=PAGES, dram_pages=4, settings=SETTINGS)
    source = cluster.start("source", layers=LAYERS, host_pages=3 * dram, dram_pages=dram, settings=SETTINGS)
    relay = Relay(int(source.endpoint.rsplit(":", 1)[1]), once("up", "Release", DROP))
    try:
        keys = prompt_keys(31, PAGES)
        assert all(source.ask("backup", keys=keys, first_slot=0)["stored"])
        read = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=relay.endpoint), BOUND_S)
        assert read["results"] == [True] * PAGES
        deadline = time.monotonic() + 2
        while "Release" not in relay.kinds("up") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "Release" in relay.kinds("up")  # sent, and dropped
        filler = prompt_keys(32, dram)
        stored = source.ask("backup", keys=filler, first_slot=dram, seed=5)["stored"]
        assert sum(stored) == dram - PAGES, "pages under a live lease must not be evicted"
        time.sleep(LEASE_MS / 1000 + 0.1)
        stored = source.ask("backup", keys=prompt_keys(33, dram), first_slot=dram, seed=5)["stored"]
        assert all(stored), "once the lease expired, its pages are evictable"
        fault.trials += 1
        fault.call(read, BOUND_S)
        fault.poison(target, 0, PAGES)
        fault.alive(target)
    finally:
        relay.close()
    figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(source)


def test_lease_replies_a_relay_drops_pin_only_that_peers_share_for_one_lease(cluster, figures):
    """A relay that drops every LEASE reply: the source granted the leases (the pages stay pinned,
    as under a lost RELEASE) but the target never learned of them. That costs the source at most
    the relayed connection's own share, for one lease time: a target dialling the source directly
    restores its unleased pages meanwhile, and the pins are gone once the leases expire."""
    fault = Fault("control: every LEASE reply dropped")
    dram = 4 * PAGES
    share = {**SETTINGS, "peer_lease_share": 0.5}  # one connection may pin half the pool: 2 prompts
    source = cluster.start("source", layers=LAYERS, host_pages=dram, dram_pages=dram, settings=share)
    relayed = cluster.start("relayed", layers=LAYERS, host_pages=2 * PAGES, dram_pages=4, settings=SETTINGS)
    direct = cluster.start("direct", layers=LAYERS, host_pages=PAGES, dram_pages=4, settings=SETTINGS)
    drop_replies = lambda d, k, f: DROP if (d, k) == ("down", "LeaseReply") else PASS  # noqa: E731
    relay = Relay(int(source.endpoint.rsplit(":", 1)[1]), drop_replies)
    try:
        stranded, wanted = prompt_keys(34, 2 * PAGES), prompt_keys(35, PAGES)
        assert all(source.ask("backup", keys=stranded, first_slot=0)["stored"])
        assert all(source.ask("backup", keys=wanted, first_slot=2 * PAGES)["stored"])
        lost = fault.call(relayed.ask("restore", keys=stranded, first_slot=0, hint=relay.endpoint), BOUND_S)
        assert lost["hits"] == 0  # its LEASE reply never came: a miss
        assert "LeaseReply" in relay.kinds("down")  # the source answered, and the relay dropped it
        pinned = source.ask("stats")["leases_held"]
        assert pinned >= 1  # granted, and held for nobody
        read = fault.call(direct.ask("restore", keys=wanted, first_slot=0, hint=source.endpoint), BOUND_S)
        assert read["results"] == [True] * PAGES, "the stranded leases starved another peer's restore"
        deadline = time.monotonic() + LEASE_MS / 1000 + 2.0
        while source.ask("stats")["leases_held"] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = source.ask("stats")["leases_held"]
        assert left == 0, "stranded leases outlived their lease time"
        fault.trials += 1
        fault.notes.append(f"{pinned} stranded lease(s); direct restore {PAGES}/{PAGES}; released within one lease")
        fault.poison(direct, 0, PAGES)
        fault.alive(direct)
    finally:
        relay.close()
    figures.record(fault)
    for replica in (direct, relayed, source):
        cluster.close_checked(replica)
