"""UCX data plane behaviour beyond the contract suite: leases, refusals, cancellation, late writes."""

import os
import subprocess
import sys
import threading
import time

import pytest

from kvcr.adapters.ucx import UcxDataPlane, parse_backend_params, wire
from kvcr.domain.errors import ConfigError
from kvcr.domain.layout import PieceRun
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError
from tests.integration.buffers import wait
from tests.integration.ucx.support import LOOPBACK, PEER, REPO, pool

pytestmark = pytest.mark.ucx

PIECE = 64 << 10
COUNT = 8


def _pair(planes, **target_kwargs):
    source, target = planes("source"), planes("target", **target_kwargs)
    src = pool(planes, "arena", COUNT, PIECE, seed=1)
    dst = pool(planes, "host", COUNT, PIECE)
    (sid,) = source.register([src.region], exposed=True)
    (did,) = target.register([dst.region], exposed=False)
    target.connect(source.describe(), 5.0)
    return source, target, src, dst, sid, did


class Gate:
    """A read guard that blocks the source's serving loop until opened, then answers ``allow``."""

    def __init__(self, allow=True):
        self.opened = threading.Event()
        self.allow = allow
        self.seen = []

    def __call__(self, lease, runs):
        self.seen.append((lease, list(runs)))
        self.opened.wait(30)
        return self.allow


def test_the_guard_sees_the_lease_and_the_runs_in_source_ids(planes):
    source, target, src, dst, sid, did = _pair(planes)
    gate = Gate()
    gate.opened.set()
    source.guard_reads(gate)
    handle = target.read("source", [PieceRun(sid, 2, did, 0, 3)], lease=41)
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert gate.seen == [(41, [PieceRun(sid, 2, did, 0, 3)])]
    assert [dst.piece(k) for k in range(3)] == [src.piece(2 + k) for k in range(3)]


def test_a_read_the_guard_refuses_fails_and_sends_nothing(planes):
    source, target, _, dst, sid, did = _pair(planes)
    source.guard_reads(lambda lease, runs: False)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, COUNT)], lease=3)
    assert wait(target, handle) is TransferState.FAILED
    target.release(handle)
    assert dst.untouched()
    assert (source.server.served, source.server.refused) == (0, 1)


def test_a_guard_that_raises_refuses(planes):
    source, target, _, dst, sid, did = _pair(planes)

    def broken(lease, runs):
        raise RuntimeError("lease table is gone")

    source.guard_reads(broken)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, 1)])
    assert wait(target, handle) is TransferState.FAILED
    target.release(handle)
    assert dst.untouched()


def test_a_hostile_request_for_a_private_region_is_refused_at_the_source(planes):
    # The attacker skips its own side's checks (it claims the source exposes the private id) and
    # sends the raw request a hostile peer would; the source must refuse it.
    source, attacker = planes("source"), planes("attacker")
    secret = pool(planes, "engine", COUNT, PIECE, seed=9)
    (private_id,) = source.register([secret.region], exposed=False)
    loot = pool(planes, "loot", COUNT, PIECE)
    (did,) = attacker.register([loot.region], exposed=False)
    attacker.connect(source.describe(), 5.0)
    attacker._peers["source"].regions[private_id] = wire.RegionWire(private_id, COUNT, PIECE, True)
    handle = attacker.read("source", [PieceRun(private_id, 0, did, 0, COUNT)])
    assert wait(attacker, handle) is TransferState.FAILED
    attacker.release(handle)
    assert loot.untouched()
    assert (source.server.served, source.server.refused) == (0, 1)


def test_cancel_of_an_unanswered_read_is_confirmed_and_later_bytes_are_drained(planes):
    source, target, _, dst, sid, did = _pair(planes)
    gate = Gate()
    source.guard_reads(gate)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, COUNT)])
    deadline = time.monotonic() + 5
    while not gate.seen and time.monotonic() < deadline:
        target.poll(handle)
        time.sleep(0.001)
    assert gate.seen, "the source never got the request"
    assert target.cancel(handle) is TransferState.CANCELLED
    target.release(handle)
    gate.opened.set()  # now the source sends every piece, to receives that are gone
    deadline = time.monotonic() + 5
    while target.drained < 2 and time.monotonic() < deadline:  # one data message + the reply
        time.sleep(0.005)
    assert target.drained >= 2 and source.server.served == 1
    assert dst.untouched()


def test_a_source_that_does_not_answer_fails_the_read_after_the_reply_timeout(planes):
    source, target, _, dst, sid, did = _pair(planes, reply_timeout_s=0.3)
    gate = Gate()
    source.guard_reads(gate)
    started = time.monotonic()
    handle = target.read("source", [PieceRun(sid, 0, did, 0, COUNT)])
    assert wait(target, handle) is TransferState.FAILED
    assert 0.3 <= time.monotonic() - started < 3.0
    target.release(handle)
    gate.opened.set()
    assert dst.untouched()


def test_disconnect_ends_an_unanswered_read_failed(planes):
    source, target, _, dst, sid, did = _pair(planes)
    gate = Gate()
    source.guard_reads(gate)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, COUNT)])
    target.disconnect("source")
    assert target.poll(handle) is TransferState.FAILED
    target.release(handle)
    gate.opened.set()
    with pytest.raises(PeerUnavailable):
        target.read("source", [PieceRun(sid, 0, did, 0, 1)])
    assert dst.untouched()


def test_close_refuses_while_a_read_is_uncertain_and_release_too(planes):
    source, target, _, _, sid, did = _pair(planes)
    gate = Gate()
    source.guard_reads(gate)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, COUNT)])
    state = target.poll(handle)
    assert state is TransferState.PENDING
    with pytest.raises(Exception, match=r"not terminal|could reuse live memory"):
        target.release(handle)
    with pytest.raises(Exception, match="not terminal"):
        target.close()
    gate.opened.set()
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    target.close()


def test_strided_regions_move_piece_by_piece_and_dense_runs_in_one_message(planes):
    source, target = planes("source"), planes("target")
    src = pool(planes, "arena", COUNT, PIECE, stride=PIECE + 4096, seed=5)
    dst = pool(planes, "host", COUNT, PIECE)
    (sid,) = source.register([src.region], exposed=True)
    (did,) = target.register([dst.region], exposed=False)
    target.connect(source.describe(), 5.0)
    handle = target.read("source", [PieceRun(sid, 1, did, 2, 5), PieceRun(sid, 7, did, 0, 1)])
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert [dst.piece(2 + k) for k in range(5)] == [src.piece(1 + k) for k in range(5)]
    assert dst.piece(0) == src.piece(7) and dst.piece(1) == bytes(PIECE)


def test_a_large_dense_read_is_byte_exact(planes):
    source, target = planes("source"), planes("target")
    src = pool(planes, "arena", 4, 8 << 20, seed=11)
    dst = pool(planes, "host", 4, 8 << 20)
    (sid,) = source.register([src.region], exposed=True)
    (did,) = target.register([dst.region], exposed=False)
    target.connect(source.describe(), 5.0)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, 4)])
    assert wait(target, handle, timeout_s=30) is TransferState.DONE
    target.release(handle)
    assert (dst.array == src.array).all()


def test_late_writes_are_declared_by_the_path_ucx_takes(planes):
    # peer mode streams over tcp (a stalled source resumes writing after disconnect); none mode on
    # one host pulls by CMA inside the target's own progress. tests/integration/ucx/test_ucx_processes.py
    # shows both by stopping a source mid-read.
    from kvcr.adapters.ucx.paths import cma_allowed

    for params, expected in ((PEER, True), (LOOPBACK, not cma_allowed({}))):
        source = planes(f"source-{expected}", backend_params=params)
        target = planes(f"target-{expected}", backend_params=params)
        assert target.connect(source.describe(), 5.0).late_writes is expected


def test_both_ends_must_agree_on_error_handling(planes):
    source = planes("source", backend_params=PEER)
    target = planes("target")
    with pytest.raises(PeerUnavailable, match="ucx_error_handling_mode"):
        target.connect(source.describe(), 1.0)


def test_a_closed_source_fails_connect_within_the_timeout(planes):
    source, target = planes("source"), planes("target")
    description = source.describe()
    source.close()
    started = time.monotonic()
    with pytest.raises(PeerUnavailable):
        target.connect(description, 0.5)
    assert time.monotonic() - started < 3.0


def test_a_source_that_closes_fails_its_targets_reads_at_once(planes):
    # A closing source says GONE: reads fail now (not at the 30 s reply timeout), new ones are refused.
    source, target, _, dst, sid, did = _pair(planes, reply_timeout_s=30.0)
    source.close()
    deadline = time.monotonic() + 2.0
    while True:
        try:
            handle = target.read("source", [PieceRun(sid, 0, did, 0, 1)])
        except PeerUnavailable:
            break
        assert wait(target, handle, timeout_s=2.0) is TransferState.FAILED
        target.release(handle)
        assert time.monotonic() < deadline, "the target never learnt that the source closed"
        time.sleep(0.01)
    assert dst.untouched()


def test_a_restarted_source_replaces_the_connection(planes):
    first, target = planes("source"), planes("target")
    src = pool(planes, "arena", COUNT, PIECE, seed=2)
    first.register([src.region], exposed=True)
    target.connect(first.describe(), 5.0)
    first.close()
    second = planes("source")
    (sid,) = second.register([src.region], exposed=True)
    dst = pool(planes, "host", COUNT, PIECE)
    (did,) = target.register([dst.region], exposed=False)
    target.connect(second.describe(), 5.0)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, 1)])
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert dst.piece(0) == src.piece(0)


def test_bad_backend_parameters_are_named():
    with pytest.raises(ConfigError, match="ucx_error_handling_mode"):
        parse_backend_params({"ucx_error_handling_mode": "sometimes"})
    with pytest.raises(ConfigError, match="'colour'"):
        parse_backend_params({"colour": "blue"})
    assert parse_backend_params({"ucx_devices": "lo", "TLS": "tcp"}) == (False, {"NET_DEVICES": "lo", "TLS": "tcp"})
    assert parse_backend_params({"ucx_error_handling_mode": "peer"}) == (True, {})
    for key in ("RCACHE_ENABLE", "UCX_RCACHE_ENABLE"):  # peer mode needs the cache: not the caller's to turn off
        with pytest.raises(ConfigError, match=key):
            parse_backend_params({key: "n"})
    with pytest.raises(ConfigError, match="progress_mode"):
        UcxDataPlane("x", progress_mode="spin")


def test_too_many_segments_are_refused_before_posting(planes):
    _, target, _, _, sid, did = _pair(planes)
    with pytest.raises(TransportError, match="segments"):
        target.read("source", [PieceRun(sid, 0, did, 0, 1)] * (wire.MAX_SEGMENTS + 1))


def test_importing_the_adapter_imports_no_ucxx_and_building_one_leaves_the_environment_alone():
    script = (
        "import os, sys\n"
        "import kvcr.adapters.ucx\n"
        "assert 'ucxx' not in sys.modules, 'ucxx imported at import time'\n"
        "before = dict(os.environ)\n"
        "plane = kvcr.adapters.ucx.UcxDataPlane('x', backend_params={'ucx_devices': 'lo'})\n"
        "changed = {k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)}\n"
        "plane.close()\n"
        "assert 'ucxx' in sys.modules and not changed, changed\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_new_region_table_of_the_same_incarnation_keeps_the_connection_and_its_reads(planes):
    source, target, src, dst, sid, did = _pair(planes)
    gate = Gate()
    source.guard_reads(gate)
    handle = target.read("source", [PieceRun(sid, 0, did, 0, 2)])
    more = pool(planes, "arena2", COUNT, PIECE, seed=3)
    (sid2,) = source.register([more.region], exposed=True)
    target.connect(source.describe(), 5.0)  # the peer protocol relays the new description
    gate.opened.set()
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    handle = target.read("source", [PieceRun(sid2, 5, did, 4, 1)])
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert dst.piece(0) == src.piece(0) and dst.piece(4) == more.piece(5)


def test_kvcrs_ucx_transport_runs_with_peer_error_handling():
    """With ``none`` UCX aborts a target whose source dies mid-rendezvous (docs/ucx.md, issue 27):
    the data plane the composition root builds for ``transport: ucx`` must survive a peer's death."""
    from kvcr.container import build_container
    from tests.support import kv_pool, runner_config

    plane = build_container(runner_config((kv_pool(),), 4, name="ucx-default"), transport="ucx").data_plane()
    try:
        assert plane.error_handling is True
    finally:
        plane.close()
