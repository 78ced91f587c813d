"""Start-up and storage edges: a taken control port, a logical anchor's reads, and fail-stop's exit code."""

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer
from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

from kvcr.domain.errors import ConfigError
from kvcr.integrations.sglang import KvcrHiCacheStorage
from kvcr.integrations.sglang.failstop import FAIL_STOP_EXIT_CODE
from kvcr.integrations.shared import hints_bridge
from tests.integration.sglang import sg
from tests.integration.sglang.test_remote import hint

REPO = Path(__file__).resolve().parents[3]


def anchor_indices(pages):
    return torch.arange(pages * sg.P, dtype=torch.int64)


def logical_store(*, indexer=True, **settings):
    """DeepSeek-V4's shape: a logical KV anchor (no bytes), with or without a KV-derived indexer pool."""
    anchor = LogicalHostPool(17 * sg.P, sg.P, layout="page_first")
    store = KvcrHiCacheStorage(sg.storage_config(**settings), {})
    store.register_mem_pool_host(anchor)
    store.register_mem_host_pool_v2(anchor, "kv")
    side = None
    if indexer:
        side = sg.mha_host("page_first")
        store.register_mem_host_pool_v2(side, "indexer")
    store.on_host_pools_registered()
    return store, side


def test_a_control_port_in_use_names_the_base_the_rank_offset_and_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            sg.backend(
                sg.mha_host("page_first"),
                sg.storage_config(transport="shm", control_port=port - 1, tp_rank=1, tp_size=2),
            )
    message = str(caught.value)
    assert message.startswith(f"control_port {port - 1} + this rank's offset 1 = port {port} on 127.0.0.1 is in use")
    assert "give each server its own control_port range" in message


def test_a_logical_anchor_without_evidence_reads_misses_without_an_error(caplog):
    store, _ = logical_store(indexer=False)
    try:
        keys = sg.hashes(3)
        assert store.batch_set_v1(keys, anchor_indices(3)) == [True] * 3
        with caplog.at_level(logging.ERROR, logger="kvcr"):
            assert store.batch_get_v1(keys, anchor_indices(3)) == [False] * 3
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []  # a bare anchor is simply no evidence, not a failed read (start-up logs INFO)
    finally:
        store.close()


def test_a_logical_anchors_read_books_its_evidence_leases_for_the_request():
    source, source_indexer = logical_store(control_port=sg.free_port())
    reader, indexer = logical_store(control_port=sg.free_port(), enable_remote_hint=True)
    try:
        keys = sg.hashes(2)
        held = PoolTransfer(name="indexer", keys=keys, host_indices=source_indexer.alloc(2 * sg.P))
        assert source.batch_set_v2([held])["indexer"] == [True, True]
        info = hint(source.control_port, keys)
        with hints_bridge.active("req-anchor"):
            assert reader.batch_get_v1(keys, anchor_indices(2), info) == [True, True]
            # booked under the request: the indexer read that follows takes these leases
            assert reader.kvcr_stats()["held_remote_pages"] == 2
            dst = indexer.alloc(2 * sg.P)
            got = reader.batch_get_v2([PoolTransfer(name="indexer", keys=keys, host_indices=dst)], info)
        assert got == {"indexer": [True, True]}
        assert sg.pages_equal(source_indexer, held.host_indices, indexer, dst)
        assert reader.kvcr_stats()["held_remote_pages"] == 0
        assert source.runner.active_leases == 0
    finally:
        reader.close()
        source.close()


def test_fail_stop_ends_the_worker_with_its_exit_code_and_says_why():
    # terminate_worker ends its process (os._exit), so it runs in a child of this one
    script = "from kvcr.integrations.sglang.failstop import terminate_worker\nterminate_worker('a read gave up')\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == FAIL_STOP_EXIT_CODE, done.stderr[-2000:]
    assert "kvcr: terminating this worker: a read gave up" in done.stderr
