"""Faults during a replica's first seconds, while its data plane's zero-copy probe still runs.

Every NIXL data plane measures once, in the background, whether UCX has a zero-copy path
(``kvcr.adapters.nixl.probe``): two throwaway agents of the process READ from each other. Over
tcp that takes a few seconds (each READ waits ``solo_s`` for a completion that cannot come
without the source's help). Two faults meet it there: a hit query arriving before it ends, and
the process being stopped in the middle of it.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.support import TCP, Fault

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess]

OP_MS = 1000


def test_a_hit_query_before_the_probe_ends_still_answers_within_the_operation_deadline(cluster, figures):
    fault = Fault("hinted hit query while the tcp probe runs", "tcp")
    source = cluster.start("source", host_pages=16, dram_pages=32, env=TCP)
    keys = prompt_keys(1, 8)
    assert all(source.ask("backup", keys=keys, first_slot=0)["stored"])
    target = cluster.start("target", host_pages=16, env=TCP, settings={"operation_timeout_ms": OP_MS})
    reply = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=source.endpoint), OP_MS / 1000 + 1.0)
    fault.notes.append(f"first hit query {reply['exists_s']:.3f}s, {reply['hits']} hits")
    fault.trials += 1
    time.sleep(4.0)  # the probe has ended: the next query connects and hits
    again = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=source.endpoint), OP_MS / 1000 + 1.0)
    assert again["results"] == [True] * len(keys)
    fault.alive(target)
    figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(source)


@pytest.mark.xfail(
    strict=True,
    reason="the probe's READ outlives its 5 s wall-clock bound while the process is stopped, so it abandons "
    "both loopback agents for the life of the process: their UCX workers, async thread and 15 fds leak",
)
def test_a_replica_stopped_during_its_probe_leaks_nothing(cluster, figures):
    fault = Fault("replica stopped during its transport probe", "tcp")
    replica = cluster.start("stopped", host_pages=16, env=TCP)
    replica.signal(signal.SIGSTOP)  # the probe (about 4 s over tcp) began at construction
    time.sleep(6.0)  # past the probe's own 5 s bound
    replica.signal(signal.SIGCONT)
    time.sleep(2.0)
    fault.alive(replica)
    fault.trials += 1
    report = cluster.close_checked(replica)
    assert report["nixl_agents"] == 0
    figures.record(fault)
