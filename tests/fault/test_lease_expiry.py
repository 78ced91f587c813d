"""A lease that expires before the read, while the source evicts the pages and reuses their slots.

The target leases a prompt at hit-query time (the lease is 800 ms, on both sides); after a delay
drawn around the expiry, the source backs up twice its DRAM of other pages (evicting everything
it may, so expired pages' slots get other bytes) before or while the target reads. With ``verify_bytes`` off,
only the lease rule keeps wrong bytes out: the target accepts a read only if it ended before
``sent + lease - margin`` on its own clock, which is before the source's expiry on the source's.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.support import Fault

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess]

# 1 MiB pages. A peer may lease half the source's DRAM: room for this trial's lease and the last one's
# (which the source may still hold when the target has already given it up).
LAYERS, PAGES, DRAM = 4, 8, 32
LEASE_MS, MARGIN_S = 800, 0.2  # the margin the backend derives: min(0.5 s, lease / 4)
OP_MS = 1500
BOUND_S = OP_MS / 1000 + 1.0
TRIALS = 12


def test_a_lease_expiring_while_the_source_reuses_its_slots_never_gives_wrong_bytes(cluster, figures):
    rng = random.Random(77)
    fault = Fault("lease expired before the read, slots reused")
    settings = {"lease_ms": LEASE_MS, "operation_timeout_ms": OP_MS}
    target = cluster.start("target", layers=LAYERS, host_pages=PAGES, dram_pages=4, settings=settings)
    source = cluster.start("source", layers=LAYERS, host_pages=2 * DRAM, dram_pages=DRAM, settings=settings)
    outcomes = {"read in time": 0, "missed": 0}
    for trial in range(TRIALS):
        keys = prompt_keys(200 + trial, PAGES)
        assert all(source.ask("backup", keys=keys, first_slot=0, seed=trial)["stored"])
        assert fault.call(target.ask("exists", keys=keys, hint=source.endpoint), BOUND_S)["hits"] == PAGES
        # Stratified over [lease - 2 margins, lease + 2 margins], one seeded draw per stratum.
        low, width = LEASE_MS / 1000 - 2 * MARGIN_S, 4 * MARGIN_S / TRIALS
        time.sleep(low + width * (trial + rng.random()))
        storm = [prompt_keys(10_000 + 10 * trial + i, DRAM) for i in range(2)]

        def evict(storm=storm):
            for batch in storm:
                source.ask("backup", keys=batch, first_slot=DRAM, seed=-1)

        evictor = threading.Thread(target=evict)
        evictor.start()
        if trial % 2 == 0:
            evictor.join()  # the slots are reused before the read, or the lease kept them
        read = fault.call(target.ask("get", keys=keys, first_slot=0, hint=source.endpoint, seed=trial), BOUND_S)
        evictor.join()
        outcomes["read in time" if any(read["results"]) else "missed"] += 1
        fault.poison(target, 0, PAGES)
        fault.trials += 1
    # After expiry the pages were really evicted and their slots reused: a fresh query finds nothing.
    assert fault.call(target.ask("exists", keys=keys, hint=source.endpoint), BOUND_S)["hits"] == 0
    fault.alive(target)
    fault.notes.append(", ".join(f"{k}: {v}" for k, v in outcomes.items()))
    figures.record(fault)
    assert outcomes["missed"] >= 1  # the delays really reach past the expiry
    evicted = source.ask("stats")["counters"].get("kvcr_evicted_pages_total{pool=kv}", 0)
    assert evicted >= TRIALS * PAGES  # every trial's pages were evicted and their slots reused
    cluster.close_checked(target)
    cluster.close_checked(source)
