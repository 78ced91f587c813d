"""Faults during a replica's first seconds, while its data plane's zero-copy probe still runs.

Every NIXL data plane measures once, in the background, whether UCX has a zero-copy path
(``kvcr.adapters.nixl.probe``): two throwaway agents of the process READ from each other. Over
tcp that takes a few seconds (each READ waits ``solo_s`` for a completion that cannot come
without the source's help). Two faults meet it there: a hit query arriving before it ends, and
the process being stopped in the middle of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_a_probe_stopped_mid_read_past_its_bound_finishes_and_abandons_nothing(monkeypatch):
    """The process stops (SIGSTOP, a freezer cgroup, swapping) while a probe READ is in flight."""
    from kvcr.adapters.nixl import probe

    monkeypatch.setenv("UCX_TLS", "tcp")  # a READ stays in flight until the source agent progresses
    stopped = [0.0]
    posts: list[int] = []

    def posted(attempt: int) -> None:
        posts.append(attempt)
        if attempt == 1:  # the first timed READ is in flight: the process is stopped for 10 s
            stopped[0] += 10.0

    class StoppedClock:
        """Real time, plus the 10 s the process spent stopped."""

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + stopped[0]

        @staticmethod
        def perf_counter() -> float:
            return time.perf_counter() + stopped[0]

    abandoned = len(probe._abandoned)
    report = probe.check_zero_copy(
        backend_params={"ucx_devices": "lo"}, timeout_s=5.0, clock=StoppedClock, on_post=posted
    )
    assert len(probe._abandoned) == abandoned, "a probe READ was abandoned with its agents"
    assert posts == [0, 1, 2, 3, 4, 5]  # the wire-up READ and five timed ones
    assert not report.zero_copy and "did not complete" not in " ".join(report.causes), report.causes


def test_a_process_exiting_while_its_probe_runs_exits_cleanly():
    """A short-lived process (a CLI, a benchmark's child) closes its data plane during the probe, and exits."""
    script = (
        "import time\n"
        "from kvcr.adapters.nixl import NixlDataPlane\n"
        "plane = NixlDataPlane('short-lived', backend_params={'ucx_devices': 'lo'})\n"
        "time.sleep(0.5)  # the probe (seconds over tcp) is mid-READ now\n"
        "plane.close()\n"
    )
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-500:])
