"""A UCX source in another process: restore of known pages, a source killed or stopped mid-read."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvcr.adapters.ucx.paths import cma_allowed
from kvcr.domain.layout import PieceRun, slot_runs
from kvcr.ports.dataplane import TransferState
from tests.integration.buffers import wait
from tests.integration.ucx.support import LOOPBACK, PEER, REPO, SourceProcess, page, pool

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

MODES = [pytest.param(PEER, id="peer"), pytest.param(LOOPBACK, id="none")]


@pytest.fixture
def source_process():
    made = []

    def start(**kwargs):
        source = SourceProcess(**kwargs)
        made.append(source)
        return source

    yield start
    for source in made:
        source.close()


@pytest.mark.parametrize("params", MODES)
def test_a_target_restores_known_pages_from_a_source_process(planes, source_process, params):
    pages, piece, seed = 48, 64 << 10, 17
    source = source_process(pages=pages, piece=piece, seed=seed, params=params, components=2)
    target = planes("target", backend_params=params)
    k, v = pool(planes, "k", pages, piece), pool(planes, "v", pages, piece)
    dst = target.register([k.region, v.region], exposed=False)
    target.connect(source.description, 10.0)
    rng = np.random.default_rng(5)
    slots = [int(s) for s in rng.permutation(pages)[:32]]
    places = [int(p) for p in rng.permutation(pages)[:32]]
    runs = [
        PieceRun(src, first, dst_id, dst_first, count)
        for src, dst_id in zip(source.regions, dst, strict=True)
        for first, dst_first, count in slot_runs(zip(slots, places, strict=True))
    ]
    handle = target.read("source", runs, lease=7)
    assert wait(target, handle, timeout_s=30) is TransferState.DONE
    target.release(handle)
    for slot, place in zip(slots, places, strict=True):
        assert k.piece(place) == page(seed, slot, piece) and v.piece(place) == page(seed + 1, slot, piece)
    untouched = set(range(pages)) - set(places)
    assert all(k.piece(p) == bytes(piece) for p in untouched)
    # A guard at the source: the same read under another lease is refused, and sends nothing.
    assert source.command("guard", "allow") == {"ok": True}
    k.array[:] = 0
    handle = target.read("source", runs, lease=8)
    assert wait(target, handle) is TransferState.FAILED
    target.release(handle)
    assert k.untouched()
    handle = target.read("source", runs, lease=7)
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    stats = source.command("stats")
    assert stats["served"] == 2 and stats["refused"] == 1


def test_a_source_killed_mid_read_fails_the_read_promptly(planes, source_process):
    # peer mode streams over tcp: 128 messages of 2 MiB (reversed order) are in flight once the
    # first byte landed, unless all arrived before the kill (a descheduled test): then try again;
    # UCX sees the connection die. (In none mode the target pulls each piece by CMA in a few
    # hundred microseconds, so there is no "mid-read" to catch; a source that dies holding a
    # request is the next test, one that stops mid-read the one after.)
    params = PEER
    pages, piece = 128, 2 << 20
    target = planes("target", backend_params=params, reply_timeout_s=1.0)
    dst = pool(planes, "host", pages, piece)
    (did,) = target.register([dst.region], exposed=False)
    for _ in range(3):
        dst.array[:] = 0
        source = source_process(pages=pages, piece=piece, seed=3, params=params)
        target.connect(source.description, 10.0)
        runs = [PieceRun(source.regions[0], k, did, pages - 1 - k, 1) for k in range(pages)]
        handle = target.read("source", runs)
        _until_first_byte(target, handle, dst, pages - 1)
        os.kill(source.pid, signal.SIGKILL)
        killed = time.monotonic()
        state = wait(target, handle, timeout_s=10)
        target.release(handle)
        if state is not TransferState.DONE:
            break
    assert state is TransferState.FAILED
    assert time.monotonic() - killed < 4.0


@pytest.mark.parametrize("params", MODES)
def test_a_source_killed_before_it_answers_fails_the_read_within_the_reply_timeout(planes, source_process, params):
    source = source_process(pages=4, piece=1 << 20, seed=4, params=params)
    assert source.command("guard", "stall") == {"ok": True}  # it takes the request and sits on it
    target = planes("target", backend_params=params, reply_timeout_s=1.0)
    dst = pool(planes, "host", 4, 1 << 20)
    (did,) = target.register([dst.region], exposed=False)
    target.connect(source.description, 10.0)
    handle = target.read("source", [PieceRun(source.regions[0], 0, did, 0, 4)])
    time.sleep(0.2)
    os.kill(source.pid, signal.SIGKILL)
    started = time.monotonic()
    assert wait(target, handle, timeout_s=10) is TransferState.FAILED
    assert time.monotonic() - started < 3.0
    target.release(handle)
    assert dst.untouched()


@pytest.mark.parametrize("params", MODES)
def test_a_stopped_source_shows_which_transports_can_write_late(planes, source_process, params):
    # SIGSTOP the source once the first byte of one large message landed, then give the read up.
    # peer (tcp, the source pushes): cancel and disconnect leave it UNCERTAIN, and the bytes land
    # once the source resumes -- the late writes PeerInfo declares. none on one host (CMA, the
    # target pulls): the read ends by itself although the source is stopped.
    size = 256 << 20
    source = source_process(pages=1, piece=size, seed=6, params=params)
    target = planes("target", backend_params=params)
    dst = pool(planes, "host", 1, size)
    (did,) = target.register([dst.region], exposed=False)
    info = target.connect(source.description, 10.0)
    assert info.late_writes is (params is PEER or not cma_allowed({}))
    for _ in range(3):  # until the stop catches the read in flight (see the killed-source test)
        dst.array[:] = 0
        handle = target.read("source", [PieceRun(source.regions[0], 0, did, 0, 1)])
        _until_first_byte(target, handle, dst)
        os.kill(source.pid, signal.SIGSTOP)
        try:
            time.sleep(0.1)
            state = target.cancel(handle)
            if info.late_writes and state is TransferState.DONE:
                target.release(handle)
                continue
            if info.late_writes:
                assert state is TransferState.UNCERTAIN
                target.disconnect("source")
                time.sleep(0.2)
                assert target.poll(handle) is TransferState.UNCERTAIN
                landed = int(np.count_nonzero(dst.array[::4096]))
                os.kill(source.pid, signal.SIGCONT)
                assert wait(target, handle, timeout_s=20) is TransferState.FAILED
                assert int(np.count_nonzero(dst.array[::4096])) > landed  # it wrote after we gave up
            else:
                assert state is TransferState.DONE
                assert dst.piece(0) == page(6, 0, size)
        finally:
            os.kill(source.pid, signal.SIGCONT)
        target.release(handle)
        return
    pytest.fail("every read completed before the source could be stopped")


def _until_first_byte(target, handle, dst, index=0):
    first = index * dst.stride
    deadline = time.monotonic() + 20
    while not dst.array[first] and time.monotonic() < deadline:
        target.poll(handle)
    assert dst.array[first], "no byte landed within 20 s"


def test_an_idle_source_costs_almost_no_cpu(source_process):
    source = source_process(pages=4, piece=4096, seed=1, params=LOOPBACK)
    first = source.command("cpu")
    time.sleep(3.0)
    second = source.command("cpu")
    busy = (second["cpu_s"] - first["cpu_s"]) / (second["wall"] - first["wall"])
    assert busy < 0.05, f"an idle source used {busy:.1%} of a core"


@pytest.mark.nixl
def test_the_bench_runs_every_column_and_names_the_transports(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--pieces", "8K", "--batches", "4", "--reps", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "kvcr.bench.ucx_adapter", *args],
        cwd=REPO,
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert set(row["us"]) == {"memmove", "nixl", "ucx-peer", "ucx-none"}  # each checked its bytes
    transports = " ".join(result["notes"]["transports"])
    assert "tcp/lo" in transports and ("cma/memory" in transports or not cma_allowed({}))
