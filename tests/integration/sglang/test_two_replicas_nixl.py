"""Two SGLang replicas in two processes over real NIXL: B restores A's pages into its own host pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from kvcr.domain.keys import router_id
from kvcr.testing.processes import stop_process
from kvcr.testing.sglang import PAGE_TOKENS, backend, host_pool, storage_config
from kvcr.testing.sglang_replica import expected_pages
from tests.support import free_port

pytestmark = [pytest.mark.nixl, pytest.mark.zmq, pytest.mark.multiprocess]
REPO = Path(__file__).resolve().parents[3]


def start_replica_a(pages: int, layers: int, seed: int) -> tuple[subprocess.Popen, dict]:
    cmd = [
        sys.executable,
        "-m",
        "kvcr.testing.sglang_replica",
        "--port",
        str(free_port()),
        "--pages",
        str(pages),
        "--layers",
        str(layers),
        "--seed",
        str(seed),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=dict(os.environ, UCX_NET_DEVICES="lo"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line: list[str] = []
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None  # both are pipes
    reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(180)
    if not line or not line[0].startswith("READY "):
        proc.kill()
        raise AssertionError(f"replica A did not start: {stderr.read()[-3000:]}")
    return proc, json.loads(line[0][len("READY ") :])


def stop(proc: subprocess.Popen) -> None:
    stop_process(proc)


def hint(info: dict) -> HiCacheStorageExtraInfo:
    envelope = {
        "protocol_version": "0.1",
        "message_id": "req-x",
        "actions": [
            {
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {
                    "source_control_endpoint": info["endpoint"],
                    "block_hashes": [router_id(k) for k in info["keys"]],
                },
            }
        ],
    }
    return HiCacheStorageExtraInfo(extra_info={"kv_hints": envelope})


def replica_b(layers: int, pages: int, **settings):
    host = host_pool(layers, pages)
    store = backend(host, storage_config(free_port(), enable_remote_hint=True, **settings))
    return host, store


def test_replica_b_restores_replica_as_pages_given_a_hint():
    pages, layers = 8, 2
    proc, info = start_replica_a(pages, layers, seed=5)
    host, store = replica_b(layers, 2 * pages)
    try:
        assert info["stored"] == pages
        keys = info["keys"]
        assert store.batch_exists(keys) == 0  # nothing local, no hint
        assert store.batch_exists(keys, hint(info)) == pages
        dst = torch.arange(pages * PAGE_TOKENS, 2 * pages * PAGE_TOKENS, dtype=torch.int64)
        assert store.batch_get_v1(keys, dst, hint(info)) == [True] * pages
        restored = host.kv_buffer.view(torch.int16)[:, pages * PAGE_TOKENS : 2 * pages * PAGE_TOKENS]
        assert torch.equal(restored, expected_pages(layers, pages, seed=5))
    finally:
        store.close()
        stop(proc)


def test_replica_a_killed_mid_read_gives_misses_and_raises_nothing():
    pages, layers = 64, 32  # 8 MiB pages: a 512 MiB read, long enough to be cut
    proc, info = start_replica_a(pages, layers, seed=6)
    host, store = replica_b(layers, pages, operation_timeout_ms=3000, abandon_timeout_ms=6000)
    try:
        keys = info["keys"]
        assert store.batch_exists(keys, hint(info)) == pages  # leased at hit-query time
        killer = threading.Timer(0.005, lambda: proc.send_signal(signal.SIGKILL))
        started = time.monotonic()
        killer.start()
        results = store.batch_get_v1(keys, torch.arange(pages * PAGE_TOKENS, dtype=torch.int64), hint(info))
        elapsed = time.monotonic() - started
        killer.join()
        assert len(results) == pages and elapsed <= 3.0 + 1.0
        assert not all(results), "the read finished before the kill; the test did not cut it"
        # Pages reported restored are really A's bytes; the rest are misses SGLang recomputes.
        first_miss = results.index(False)
        expected = expected_pages(layers, pages, seed=6)[:, : first_miss * PAGE_TOKENS]
        assert torch.equal(host.kv_buffer.view(torch.int16)[:, : first_miss * PAGE_TOKENS], expected)
        assert store.batch_exists(keys, hint(info)) == 0  # A is gone: nothing to lease, no exception
    finally:
        store.close()
        stop(proc)
