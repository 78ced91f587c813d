"""DRAM full during backup: a page is stored whole or not at all, and leased pages are never overwritten.

kvcr DRAM is deliberately small here (16 pages). A backup larger than all of it, backups while a
peer holds half of it under leases, and a mixed load of backups (evicting), local and remote
restores from both replicas' backup and prefetch threads at once: every page reported stored or
restored is checked byte for byte.
"""

from __future__ import annotations

import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.support import Fault

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess]

LAYERS, DRAM = 2, 16  # 512 KiB pages
BOUND_S = 5.0 + 1.0  # the backend's default operation_timeout_ms, + 1 s


def test_a_backup_larger_than_dram_stores_whole_pages_only(cluster, figures):
    fault = Fault("DRAM full: one backup of 2.5x DRAM")
    replica = cluster.start("replica", layers=LAYERS, host_pages=80, dram_pages=DRAM)
    keys = prompt_keys(50, 40)
    backup = replica.ask("backup", keys=keys, first_slot=0)
    fault.worst_s = backup["seconds"]
    stored = [k for k, ok in zip(keys, backup["stored"], strict=True) if ok]
    assert 0 < len(stored) <= DRAM
    got = fault.call(replica.ask("get", keys=stored, first_slot=40, hint=None), BOUND_S)
    assert got["results"] == [True] * len(stored)  # and byte-checked: whole pages
    for key, ok in zip(keys, backup["stored"], strict=True):
        if not ok:
            assert fault.call(replica.ask("exists", keys=[key], hint=None), BOUND_S)["hits"] == 0
    fault.trials += 1
    fault.notes.append(f"{len(stored)} of {len(keys)} stored")
    fault.alive(replica)
    figures.record(fault)
    cluster.close_checked(replica)


def test_backups_while_a_peer_holds_half_the_dram_never_touch_the_leased_pages(cluster, figures):
    fault = Fault("DRAM full: backups while a peer leases half")
    source = cluster.start("source", layers=LAYERS, host_pages=64, dram_pages=DRAM)
    peer = cluster.start("peer", layers=LAYERS, host_pages=16, dram_pages=4)
    leased = prompt_keys(51, DRAM // 2)
    assert all(source.ask("backup", keys=leased, first_slot=0, seed=3)["stored"])
    assert fault.call(peer.ask("exists", keys=leased, hint=source.endpoint), BOUND_S)["hits"] == DRAM // 2
    for round_ in range(3):  # each round wants all of DRAM: only the unleased half is there
        keys = prompt_keys(60 + round_, DRAM)
        stored = source.ask("backup", keys=keys, first_slot=16, seed=4)["stored"]
        assert sum(stored) == DRAM // 2
        kept = [k for k, ok in zip(keys, stored, strict=True) if ok]
        assert fault.call(source.ask("get", keys=kept, first_slot=40, hint=None, seed=4), BOUND_S)["results"] == [
            True
        ] * len(kept)
        fault.trials += 1
    read = fault.call(peer.ask("get", keys=leased, first_slot=0, hint=source.endpoint, seed=3), BOUND_S)
    assert read["results"] == [True] * len(leased)  # the leased slots still hold the leased pages
    fault.poison(peer, 0, len(leased))
    fault.alive(peer)
    figures.record(fault)
    cluster.close_checked(peer)
    cluster.close_checked(source)


def test_a_full_dram_under_concurrent_backups_and_local_and_remote_restores(cluster, figures):
    fault = Fault("DRAM full: concurrent backup/prefetch threads, 2 replicas")
    a = cluster.start("a", layers=LAYERS, host_pages=64, dram_pages=DRAM)
    b = cluster.start("b", layers=LAYERS, host_pages=64, dram_pages=DRAM)
    prompts = {"a": list(range(100, 112)), "b": list(range(200, 212))}
    for me, other in ((a, b), (b, a)):
        name, peer = me.options.name, other.options.name
        plan = {
            "own_prompts": prompts[name],
            "peers": [{"endpoint": other.endpoint, "prompts": prompts[peer]}],
            "prompt_pages": 4,
            "rng_seed": 5 if name == "a" else 6,
            "remote_share": 0.5,
            "pause_s": 0.002,
        }
        assert me.ask("workload", plan=plan)["started"] == 2
    time.sleep(6.0)
    for replica in (a, b):
        assert replica.ask("halt")["stuck_threads"] == []
        stats = replica.ask("stats")
        kinds = stats["kinds"]
        for kind in ("backup", "local_restore", "remote_restore"):
            k = kinds[kind]
            fault.trials += k["ops"]
            fault.worst_s = max(fault.worst_s, k["max_s"])
            fault.wrong_bytes += k.get("wrong_bytes", 0)
            fault.late_bytes += k.get("late_bytes", 0)
            assert k["ops"] > 0 and k["exceptions"] == 0 and k["hangs"] == 0, (kind, k)
            assert k.get("wrong_bytes", 0) == 0 and k.get("late_bytes", 0) == 0, (kind, k)
        fault.hits += kinds["remote_restore"]["restored"] + kinds["local_restore"]["restored"]
        assert kinds["remote_restore"]["restored"] > 0  # peers really served each other
        assert stats["counters"].get("kvcr_evicted_pages_total{pool=kv}", 0) > 0  # DRAM really was full
        fault.alive(replica)
    fault.notes.append("ops counted per kind over both replicas")
    figures.record(fault)
    cluster.close_checked(a)
    cluster.close_checked(b)
