"""``page_digest``: what each digest stops, on the mock fabric with bytes really moving.

The writer here stands for a peer that holds the owner's NIXL description and writes into its
arena while a target holds a lease (NIXL registrations cannot be made read-only). With XXH3 it
can choose bytes that keep the page's digest (a second preimage takes about a millisecond,
``tests/xxh3_forgery.py``), so the target is served bytes the owner never backed up; with BLAKE3
the same write is a miss. A target whose ``page_digest`` differs from the source's gets misses
with a message that names the setting.
"""

from __future__ import annotations

import ctypes
import logging

import pytest

from kvcr.adapters.digests import copy_and_digest, page_digest
from kvcr.adapters.local import InMemoryMetrics, MonotonicClock, RecordingInventory
from kvcr.adapters.mock.memory import MockHostMemory
from kvcr.domain.digests import DIGEST_BYTES
from kvcr.domain.errors import ConfigError
from kvcr.domain.outcomes import Outcome
from kvcr.ports.memory import Move
from kvcr.runner.peer_client import PoolRead
from tests.support import Cluster, content, kv_pool, make_runner, seed, sequence
from tests.support import runner_config as make_config
from tests.xxh3_forgery import xxh3_128_second_preimage

PIECE = 2048  # two components: a 4 KiB page, long enough for XXH3's block loop after the key prefix


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def _forge_in_arena(owner, page: str, slot: int) -> bytes:
    """Rewrite ``page`` at ``slot`` of ``owner``'s arena with other bytes of the same XXH3 digest; the new bytes."""
    arena = owner.runner.pool_arenas()["kv"]
    key = f"{owner.runner.namespaces['kv']}#kv#{page}".encode()  # what the owner's digest is seeded with
    original = b"".join(ctypes.string_at(component.address(slot), PIECE) for component in arena)
    forged = xxh3_128_second_preimage(key + original, start=len(key))[len(key) :]
    assert forged != original
    for i, component in enumerate(arena):
        ctypes.memmove(component.address(slot), forged[i * PIECE : (i + 1) * PIECE], PIECE)
    return forged


@pytest.mark.parametrize(("digest", "served"), [("xxh3", True), ("blake3", False)])
def test_a_writer_that_keeps_the_xxh3_digest_is_served_under_xxh3_and_refused_under_blake3(cluster, digest, served):
    owner = cluster.node("A", pools=[kv_pool(PIECE)], page_digest=digest)
    target = cluster.node("B", pools=[kv_pool(PIECE)], page_digest=digest)
    pages = sequence(2)
    seed(owner, pages, [0, 1])
    lease = target.client.lease(owner.endpoint, [("kv", pages)])
    forged = _forge_in_arena(owner, pages[1], lease.slots[("kv", pages[1])])

    result = target.client.read(lease, [PoolRead("kv", pages, [5, 6])])
    target.client.release(lease)

    outcomes = [o.outcome for o in result["kv"]]
    host = target.hosts["kv"]
    assert host.read_page(5) == content(pages[0], 2 * PIECE)
    if served:  # the gap XXH3 leaves: bytes the owner never backed up, accepted
        assert outcomes == [Outcome.RESTORED, Outcome.RESTORED]
        assert host.read_page(6) == forged
    else:
        assert outcomes == [Outcome.RESTORED, Outcome.FAILED]
        assert "digest" in result["kv"][1].reason
        # The owner refuses it too: a local restore checks the same digest and drops the page.
        assert [o.outcome for o in owner.runner.restore("kv", pages, [20, 21])] == [Outcome.RESTORED, Outcome.FAILED]


def test_blake3_pages_restore_byte_equal_between_replicas_that_both_use_it(cluster):
    owner = cluster.node("A", page_digest="blake3")
    target = cluster.node("B", page_digest="blake3")
    pages = sequence(3)
    seed(owner, pages, [0, 1, 2])
    result = target.client.restore(owner.endpoint, [PoolRead("kv", pages, [5, 6, 7])])
    assert [o.outcome for o in result["kv"]] == [Outcome.RESTORED] * 3
    for page, slot in zip(pages, [5, 6, 7], strict=True):
        assert target.hosts["kv"].read_page(slot) == content(page, target.hosts["kv"].pool.page_bytes)


@pytest.mark.parametrize(("source", "target_digest"), [("xxh3", "blake3"), ("blake3", "xxh3")])
def test_replicas_with_different_page_digests_get_misses_and_a_message_naming_the_setting(
    cluster, caplog, source, target_digest
):
    owner = cluster.node("A", page_digest=source)
    target = cluster.node("B", page_digest=target_digest)
    pages = sequence(2)
    seed(owner, pages, [0, 1])
    with caplog.at_level(logging.ERROR, logger="kvcr"):
        result = target.client.restore(owner.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert [o.outcome for o in result["kv"]] == [Outcome.FAILED] * 2
    assert all("page_digest" in o.reason for o in result["kv"])
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "set page_digest the same on every replica" in message
    assert f"{DIGEST_BYTES[source]}-byte digests" in message
    snapshot = target.metrics.snapshot()
    assert snapshot.get("kvcr_verification_failures_total{path=remote_restore}") == 2


def test_each_digest_has_its_documented_length_and_the_fused_copy_agrees():
    memory = {name: MockHostMemory(page_digest=name) for name in DIGEST_BYTES}
    src = ctypes.create_string_buffer(b"x" * 5000 + b"y" * 5000)
    dst = ctypes.create_string_buffer(10000)
    moves = [Move(ctypes.addressof(dst), ctypes.addressof(src), 10000)]
    extents = [(ctypes.addressof(dst), 10000)]
    digests = {}
    for name, size in DIGEST_BYTES.items():
        fused = copy_and_digest(moves, b"ns#kv#page", name)
        assert len(fused) == size
        assert fused == page_digest(extents, b"ns#kv#page", name) == memory[name].digest(extents, b"ns#kv#page")
        assert fused != page_digest(extents, b"ns#kv#other", name)  # the seed binds the key
        digests[name] = fused
    assert digests["xxh3"] != digests["blake3"][:16]


@pytest.mark.parametrize("bad", ["sha1", "", "XXH3", None, 3])
def test_an_unknown_page_digest_is_refused_naming_the_setting(bad):
    with pytest.raises(ConfigError, match="page_digest"):
        MockHostMemory(page_digest=bad)
    with pytest.raises(ConfigError, match="page_digest"):
        make_config((kv_pool(),), 4, page_digest=bad)


def test_a_runner_whose_memory_adapter_digests_otherwise_is_refused_naming_page_digest():
    parts = (MonotonicClock(), InMemoryMetrics(strict=True), RecordingInventory())
    with pytest.raises(
        ConfigError, match="page_digest is 'blake3' but the runner's memory adapter digests with 'xxh3'"
    ):
        make_runner((kv_pool(),), 4, MockHostMemory(), *parts, page_digest="blake3")
    # Without verify_bytes nothing is digested, so the adapter's choice does not matter.
    make_runner((kv_pool(),), 4, MockHostMemory(), *parts, page_digest="blake3", verify_bytes=False).close()
