"""A source frozen (SIGSTOP) past the operation and abandonment deadlines, then resumed: CMA and tcp.

Measured (docs/nixl-behaviour.md): on CMA a READ is complete when it is posted, so a frozen source
still serves a READ of pages leased before the freeze; over tcp the READ stays in progress with no
error until the source resumes, then lands. Through the backend: the tcp read is given up at the
operation deadline (misses), its staging buffer is quarantined, and the late bytes land there, never
in SGLang's host pages; once the source is back the buffer is reaped and reads work again.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.support import TCP, Fault, flavour

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess]

LAYERS, PAGES = 8, 32  # 2 MiB pages
OP_MS, ABANDON_MS, CONTROL_MS, RETRY_MS = 1500, 3000, 250, 500
SETTINGS = {
    "operation_timeout_ms": OP_MS,
    "abandon_timeout_ms": ABANDON_MS,
    "control_timeout_ms": CONTROL_MS,
    "peer_retry_ms": RETRY_MS,
    "read_batch_pages": 8,
}
BOUND_S = OP_MS / 1000 + 1.0


@pytest.mark.parametrize("tls", ["cma", "tcp", "shm"])
def test_a_frozen_source_costs_misses_within_the_deadline_and_serves_again_once_resumed(cluster, figures, tls):
    env, plane = flavour(tls)
    fault = Fault("source frozen past both deadlines, resumed", tls)
    target = cluster.start(
        "target", layers=LAYERS, host_pages=2 * PAGES, dram_pages=8, settings={**SETTINGS, **plane}, env=env
    )
    # The hit query given up while the source is frozen leaves a lease granted on resume that nobody
    # releases; it must expire (lease_ms) before the source closes, or its memory is kept (and, over
    # shm, its memfds stay open): the source leases for 3 s to keep that wait short.
    lease_ms = 3000
    source = cluster.start(
        "source",
        layers=LAYERS,
        host_pages=4 * PAGES,
        dram_pages=8 * PAGES,
        settings={**plane, "lease_ms": lease_ms},
        env=env,
    )
    warm, leased, later = (prompt_keys(p, PAGES) for p in (1, 2, 3))
    for i, keys in enumerate((warm, leased, later)):
        assert all(source.ask("backup", keys=keys, first_slot=i * PAGES)["stored"])
    first = fault.call(target.ask("restore", keys=warm, first_slot=0, hint=source.endpoint), BOUND_S)
    assert first["results"] == [True] * PAGES
    assert fault.call(target.ask("exists", keys=leased, hint=source.endpoint), BOUND_S)["hits"] == PAGES

    source.signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    read = fault.call(target.ask("get", keys=leased, first_slot=0, hint=source.endpoint), BOUND_S)
    if tls == "tcp":
        assert not any(read["results"])  # nothing can come back from a frozen tcp source
        assert read["seconds"] >= OP_MS / 1000 - 0.05  # it was given up at the operation deadline
        stats = target.ask("stats")
        assert stats["quarantined"] == 1 and stats["staging_quarantined"] >= 1
    if tls == "shm":
        assert all(read["results"])  # a copy from a mapping needs nothing from the frozen process
    fault.notes.append(f"read of leased pages while frozen: {sum(read['results'])}/{PAGES} in {read['seconds']:.3f}s")
    stalled = fault.call(target.ask("restore", keys=later, first_slot=PAGES, hint=source.endpoint), BOUND_S)
    if tls == "shm":
        # Over shm the hit query reads the source's slot board: a frozen source cannot move a slot, so
        # its pages are found and read from the mapping, asking the frozen process nothing.
        assert stalled["hits"] == PAGES and all(stalled["results"]) and stalled["exists_s"] <= CONTROL_MS / 1000
    else:
        # While frozen, a new hit query is a prompt miss: the LEASE costs control_timeout_ms at most.
        assert stalled["hits"] == 0 and stalled["exists_s"] <= CONTROL_MS / 1000 + 0.25
    fault.notes.append(f"hit query while frozen {stalled['exists_s'] * 1e3:.0f} ms")
    time.sleep(max(0.0, ABANDON_MS / 1000 + 0.5 - (time.monotonic() - frozen_at)))
    fault.poison(target, 0, 2 * PAGES)
    source.signal(signal.SIGCONT)
    time.sleep(1.0)  # over tcp the given-up READ lands now: in quarantined staging memory
    fault.poison(target, 0, 2 * PAGES)
    fault.alive(target)
    assert source.alive  # the source survives being read while frozen

    time.sleep(RETRY_MS / 1000)
    again = fault.call(target.ask("restore", keys=later, first_slot=PAGES, hint=source.endpoint), BOUND_S)
    assert again["results"] == [True] * PAGES, "reads from the resumed source work again without a restart"
    stats = target.ask("stats")
    assert stats["quarantined"] == 0 and stats["staging_quarantined"] == 0 and stats["live_transfers"] == 0
    fault.trials += 1
    figures.record(fault)
    cluster.close_checked(target)
    deadline = time.monotonic() + lease_ms / 1000 + 2.0
    while source.ask("stats")["leases_held"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert source.ask("stats")["leases_held"] == 0, "an orphaned lease outlived lease_ms"
    cluster.close_checked(source)


@pytest.mark.parametrize("tls", ["cma", "tcp"])
def test_a_source_frozen_before_first_contact_is_a_miss_within_the_control_deadline(cluster, figures, tls):
    env = TCP if tls == "tcp" else {}
    fault = Fault("source frozen before first contact", tls)
    target = cluster.start("target", layers=LAYERS, host_pages=PAGES, dram_pages=8, settings=SETTINGS, env=env)
    source = cluster.start("source", layers=LAYERS, host_pages=PAGES, dram_pages=2 * PAGES, env=env)
    keys = prompt_keys(4, PAGES)
    assert all(source.ask("backup", keys=keys, first_slot=0)["stored"])
    source.signal(signal.SIGSTOP)
    for _ in range(3):  # the first costs the HELLO's deadline, then the peer is skipped
        reply = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=source.endpoint), BOUND_S)
        assert reply["hits"] == 0 and reply["exists_s"] <= CONTROL_MS / 1000 + 0.25
        fault.trials += 1
    fault.poison(target, 0, PAGES)
    source.signal(signal.SIGCONT)
    time.sleep(RETRY_MS / 1000 + 0.1)
    reply = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=source.endpoint), BOUND_S)
    assert reply["results"] == [True] * PAGES
    fault.alive(target)
    figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(source)
