"""A source restarted at the same address, holding other bytes under the same keys.

The target holds a lease of the old incarnation (taken at hit-query time, not read yet) when the
source goes away (killed, or closed cleanly) and a new process binds the same port with the same
page keys but different bytes (another seed). The old lease must be refused: reading under it
gives misses, never the new process's bytes under the old lease's slots, nor the old bytes. New
leases, after a fresh HELLO (the old session is unknown to the new process), are served with
the new bytes.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.support import Fault, flavour
from tests.support import free_port

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess]

LAYERS, PAGES = 4, 16  # 1 MiB pages
OP_MS, RETRY_MS = 1500, 300
BOUND_S = OP_MS / 1000 + 1.0


@pytest.mark.parametrize(
    ("how", "verify", "tls"), [("kill", False, "cma"), ("close", True, "cma"), ("kill", False, "shm")]
)
def test_a_restarted_source_refuses_old_leases_and_serves_new_ones(cluster, figures, how, verify, tls):
    # Over shm the target still maps the dead source's arena: its closed socket is what refuses the old lease.
    _, plane = flavour(tls)
    fault = Fault(f"source restarted ({how}), other bytes, same keys" + (", verify_bytes" if verify else ""), tls)
    settings = {"operation_timeout_ms": OP_MS, "peer_retry_ms": RETRY_MS, "verify_bytes": verify, **plane}
    target = cluster.start("target", layers=LAYERS, host_pages=2 * PAGES, dram_pages=4, settings=settings)
    port = free_port()
    source = {
        "layers": LAYERS,
        "host_pages": 2 * PAGES,
        "dram_pages": 4 * PAGES,
        "settings": {"verify_bytes": verify, **plane},
    }
    old = cluster.start("old", port=port, **source)
    read, held = prompt_keys(10, PAGES), prompt_keys(11, PAGES)
    assert all(old.ask("backup", keys=read, first_slot=0, seed=1)["stored"])
    assert all(old.ask("backup", keys=held, first_slot=PAGES, seed=1)["stored"])
    first = fault.call(target.ask("restore", keys=read, first_slot=0, hint=old.endpoint, seed=1), BOUND_S)
    assert first["results"] == [True] * PAGES
    assert fault.call(target.ask("exists", keys=held, hint=old.endpoint), BOUND_S)["hits"] == PAGES  # booked

    if how == "kill":
        old.signal(signal.SIGKILL)
        old.process.join(10)
    else:
        old.close()  # it waits (close_lease_wait_s) for our booked lease, then goes
    new = cluster.start("new", port=port, **source)
    assert new.endpoint == old.endpoint
    assert all(new.ask("backup", keys=read, first_slot=0, seed=2)["stored"])
    assert all(new.ask("backup", keys=held, first_slot=PAGES, seed=2)["stored"])

    # The booked lease is the old incarnation's: refused. Checked against the new bytes (seed 2)
    # and, by being all misses, against the old ones too.
    stale = fault.call(target.ask("get", keys=held, first_slot=PAGES, hint=new.endpoint, seed=2), BOUND_S)
    assert not any(stale["results"]), "a read under the old incarnation's lease was accepted"
    time.sleep(RETRY_MS / 1000 + 0.1)
    for keys, slot in ((held, PAGES), (read, 0)):
        fresh = fault.call(target.ask("restore", keys=keys, first_slot=slot, hint=new.endpoint, seed=2), BOUND_S)
        assert fresh["results"] == [True] * PAGES, "the new incarnation's leases are served (its bytes, seed 2)"
        fault.trials += 1
    fault.poison(target, 0, 2 * PAGES)
    fault.alive(target)
    figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(new)


def test_a_restarted_source_that_answered_hello_is_not_skipped_for_its_predecessors_failed_read(cluster, figures):
    fault = Fault("source restarted, the new one answered HELLO first; the old lease read after")
    settings = {"operation_timeout_ms": OP_MS, "peer_retry_ms": 5000}  # a skip would outlast the test
    target = cluster.start("target", layers=LAYERS, host_pages=2 * PAGES, dram_pages=4, settings=settings)
    port = free_port()
    source = {"layers": LAYERS, "host_pages": 2 * PAGES, "dram_pages": 4 * PAGES}
    old = cluster.start("old", port=port, **source)
    read, held = prompt_keys(20, PAGES), prompt_keys(21, PAGES)
    assert all(old.ask("backup", keys=held, first_slot=PAGES, seed=1)["stored"])
    assert fault.call(target.ask("exists", keys=held, hint=old.endpoint), BOUND_S)["hits"] == PAGES  # booked
    old.signal(signal.SIGKILL)
    old.process.join(10)
    new = cluster.start("new", port=port, **source)
    assert all(new.ask("backup", keys=read, first_slot=0, seed=2)["stored"])
    assert all(new.ask("backup", keys=held, first_slot=PAGES, seed=2)["stored"])
    # Another request's hit query meets the new process first (its session is unknown there: HELLO) ...
    assert fault.call(target.ask("exists", keys=read, hint=new.endpoint), BOUND_S)["hits"] == PAGES
    # ... then the prefetch booked against the old process reads: a miss, and the old one's failure only.
    stale = fault.call(target.ask("get", keys=held, first_slot=PAGES, hint=new.endpoint, seed=2), BOUND_S)
    assert not any(stale["results"]), "a read under the old incarnation's lease was accepted"
    for keys, slot in ((read, 0), (held, PAGES)):  # at once: the new process is not skipped
        fresh = fault.call(target.ask("restore", keys=keys, first_slot=slot, hint=new.endpoint, seed=2), BOUND_S)
        assert fresh["results"] == [True] * PAGES, "the new incarnation was skipped for the old one's failure"
        fault.trials += 1
    fault.poison(target, 0, 2 * PAGES)
    fault.alive(target)
    figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(new)
