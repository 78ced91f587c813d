"""A hinted peer that cannot be reached at connect: nothing listens, a black hole, a dead data plane.

A hint may name a replica that is gone (its port closed), an address that swallows connections
(a black hole: TCP accepts, nothing ever answers), or a replica whose control port answers HELLO
but whose data plane never answers the connect READ (here: frozen right after its HELLO reply).
Each is a miss within its deadline (``control_timeout_ms``; ``connect_timeout_ms`` for the data
plane), then the peer is skipped for ``peer_retry_ms``.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvcr.soak.pattern import prompt_keys
from tests.fault.relay import PASS, Relay
from tests.fault.support import TCP, Fault
from tests.support import free_port

pytestmark = [pytest.mark.fault, pytest.mark.nixl, pytest.mark.sglang, pytest.mark.multiprocess, pytest.mark.zmq]

LAYERS, PAGES = 2, 8
OP_MS, CONTROL_MS, CONNECT_MS, RETRY_MS = 1500, 250, 500, 300
SETTINGS = {
    "operation_timeout_ms": OP_MS,
    "control_timeout_ms": CONTROL_MS,
    "connect_timeout_ms": CONNECT_MS,
    "peer_retry_ms": RETRY_MS,
}
BOUND_S = OP_MS / 1000 + 1.0


def _misses(fault, target, endpoint, keys, within_s, times=3):
    for _ in range(times):  # the first costs the deadline, the rest find the peer skipped
        reply = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=endpoint), BOUND_S)
        assert reply["hits"] == 0 and reply["exists_s"] <= within_s, reply["exists_s"]
        fault.trials += 1
    fault.notes.append(f"slowest miss {fault.worst_s * 1e3:.0f} ms")


def test_nothing_listening_and_a_black_hole_are_misses_within_the_control_deadline(cluster, figures):
    target = cluster.start("target", layers=LAYERS, host_pages=PAGES, dram_pages=4, settings=SETTINGS)
    keys = prompt_keys(40, PAGES)
    closed = Fault("peer unreachable: nothing listens")
    _misses(closed, target, f"tcp://127.0.0.1:{free_port()}", keys, CONTROL_MS / 1000 + 0.2)
    closed.alive(target)
    figures.record(closed)
    hole = Fault("peer unreachable: black hole (accepts, never answers)")
    relay = Relay(free_port())
    relay.forward = False
    try:
        _misses(hole, target, relay.endpoint, keys, CONTROL_MS / 1000 + 0.2)
    finally:
        relay.close()
    hole.poison(target, 0, PAGES)
    hole.alive(target)
    figures.record(hole)
    cluster.close_checked(target)


@pytest.mark.parametrize("tls", ["cma", "tcp"])
def test_a_data_plane_that_never_answers_the_connect_is_a_miss_within_the_connect_deadline(cluster, figures, tls):
    env = TCP if tls == "tcp" else {}
    fault = Fault("peer unreachable: data plane dead after HELLO", tls)
    target = cluster.start("target", layers=LAYERS, host_pages=PAGES, dram_pages=4, settings=SETTINGS, env=env)
    source = cluster.start("source", layers=LAYERS, host_pages=PAGES, dram_pages=2 * PAGES, env=env)
    keys = prompt_keys(41, PAGES)
    assert all(source.ask("backup", keys=keys, first_slot=0)["stored"])

    def freeze_after_hello(direction, kind, frames):
        if direction == "down" and kind == "HelloReply":
            source.signal(signal.SIGSTOP)  # its reply is on the wire; its data plane will not answer
        return PASS

    relay = Relay(int(source.endpoint.rsplit(":", 1)[1]), freeze_after_hello)
    try:
        _misses(fault, target, relay.endpoint, keys, CONNECT_MS / 1000 + CONTROL_MS / 1000 + 0.2)
        relay.policy = lambda d, k, f: PASS
        source.signal(signal.SIGCONT)
        # Served again without a restart. Over tcp the first connect after the thaw may still miss
        # (UCX re-establishes its endpoint; under load that can outlast connect_timeout_ms): a few
        # spaced retries, each bounded, are what an engine's next requests would be.
        attempts = 0
        while attempts < 5:
            attempts += 1
            time.sleep(RETRY_MS / 1000 + 0.1)
            again = fault.call(target.ask("restore", keys=keys, first_slot=0, hint=relay.endpoint), BOUND_S)
            if again["results"] == [True] * PAGES:
                break
        assert again["results"] == [True] * PAGES, again
        fault.notes.append(f"served again on attempt {attempts}")
    finally:
        relay.close()
        source.signal(signal.SIGCONT)
    fault.poison(target, 0, PAGES)
    fault.alive(target)
    figures.record(fault)
    cluster.close_checked(target)
    cluster.close_checked(source)
