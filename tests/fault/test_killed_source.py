"""A source SIGKILLed at random moments of a hinted hit query and prefetch read (seeded trials: CMA, tcp, shm).

The target is one replica (SGLang's real host pool and backend) for every trial; each trial gets a
fresh source holding pages no one else has, and kills it after a random delay drawn over the
calls it is cutting: both (hit query and read, half the trials) or the read alone. Pages are
2 MiB and the target reads 8 per NIXL READ, so a kill can land between READs, inside one, in the
HELLO, the data-plane connect or the LEASE. Over shm one read call cannot be cut (it is a memcpy from
the target's mapping), but the target checks before each read call that the source's broker socket
is still open: once the source is dead, its later read calls fail, so a kill between the target's
batches costs the rest of the prompt as misses, like a cut NIXL READ. Reads over shm take a few
milliseconds, too short to aim a kill into reliably: there, half the trials kill the source between
the hit query and the read, and the read must restore nothing.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.support import Fault, flavour

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess]

LAYERS, PAGES = 8, 48  # 2 MiB pages, 96 MiB per restore
OP_MS = 2000
TARGET = {"operation_timeout_ms": OP_MS, "abandon_timeout_ms": 2 * OP_MS, "read_batch_pages": 8, "peer_retry_ms": 200}
BOUND_S = OP_MS / 1000 + 1.0


def _source(cluster, name, keys, seed, env, plane):
    source = cluster.start(name, layers=LAYERS, host_pages=PAGES, dram_pages=2 * PAGES, settings=plane, env=env)
    assert all(source.ask("backup", keys=keys, first_slot=0, seed=seed)["stored"])
    return source


@pytest.mark.parametrize(("tls", "trials"), [("cma", 24), ("tcp", 8), ("shm", 12)])
def test_a_source_killed_at_random_moments_costs_misses_and_never_wrong_bytes(cluster, figures, tls, trials):
    rng = random.Random(1010)
    env, plane = flavour(tls)
    fault = Fault("source SIGKILLed during hit query / read", tls)
    target = cluster.start(
        "target", layers=LAYERS, host_pages=PAGES, dram_pages=8, settings={**TARGET, **plane}, env=env
    )
    # Calibrate on live sources: how long a first-contact hit query and the read take here (the
    # second one: the target's first connect also waits for its zero-copy probe).
    for calibration in (998, 999):
        keys = prompt_keys(calibration, PAGES)
        live = _source(cluster, f"live{calibration}", keys, 7, env, plane)
        whole = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=live.endpoint, seed=7), BOUND_S)
        assert whole["results"] == [True] * PAGES
        live.close()
    span_exists, span_get = whole["exists_s"], max(whole["get_s"], 0.002)
    cut = {"exists": 0, "get": 0, "neither": 0}
    for trial in range(trials):
        keys = prompt_keys(1000 + trial, PAGES)
        source = _source(cluster, f"source{trial}", keys, trial, env, plane)
        kill = threading.Timer(0, lambda s=source: s.signal(signal.SIGKILL))
        if trial % 2 == 0:  # anywhere in the hit query or the read
            kill.interval = rng.uniform(0, 1.2 * (span_exists + span_get))
            kill.start()
            reply = fault.call(
                target.ask("restore", keys=keys, first_slot=0, hint=source.endpoint, seed=trial), BOUND_S
            )
            hits = reply["hits"]
        else:  # the hit query leased everything; the kill lands in the read
            hits = fault.call(target.ask("exists", keys=keys, hint=source.endpoint), BOUND_S)["hits"]
            assert hits == PAGES
            # Over shm the read takes a few ms and one read call cannot be cut: the source dies between
            # the hit query and the read, so the read meets a dead source's mapping, every time.
            kill.interval = 0 if tls == "shm" else rng.uniform(0, 1.2 * span_get)
            kill.start()
            if tls == "shm":
                kill.join()
                source.process.join(10)
            reply = fault.call(target.ask("get", keys=keys, first_slot=0, hint=source.endpoint, seed=trial), BOUND_S)
        kill.join()
        source.process.join(10)
        assert not source.alive
        restored = sum(reply["results"])
        assert restored <= hits
        if tls == "shm" and trial % 2:
            assert restored == 0, "a dead source's arena, still mapped here, must never be read"
        cut["exists" if hits < PAGES else "get" if restored < hits else "neither"] += 1
        time.sleep(0.1)  # anything still in flight would land now
        fault.poison(target, 0, PAGES)
        fault.alive(target)
        fault.trials += 1
        # A dead source's endpoint is a prompt miss afterwards, never a wait.
        again = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=source.endpoint, seed=trial), BOUND_S)
        assert again["hits"] == 0 and again["exists_s"] < 0.5
    stats = target.ask("stats")
    assert stats["live_transfers"] == 0 and stats["quarantined"] == 0 and stats["staging_quarantined"] == 0
    fault.notes.append(f"cut in hit query {cut['exists']}, in read {cut['get']}, after both {cut['neither']}")
    fault.notes.append(f"live hit query {span_exists * 1e3:.0f} ms, read {span_get * 1e3:.0f} ms")
    figures.record(fault)
    # The kills really cut calls (over shm, half the trials by construction).
    assert cut["exists"] + cut["get"] >= trials // (2 if tls == "shm" else 3), cut
    cluster.close_checked(target)
