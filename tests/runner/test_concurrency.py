"""Four threads back up and restore at once under eviction pressure: no page is lost or torn."""

import random
import threading

from kvcr.domain.outcomes import Outcome
from tests.support import content, kv_pool, sequence

THREADS = 4
ROUNDS = 150


def test_concurrent_backup_and_restore_never_tear_a_page(build):
    runner, hosts = build(pools=(kv_pool(32 * 1024),), slots=24, host_pages=THREADS * 32)
    host = hosts["kv"]
    page_bytes = host.pool.page_bytes
    shared = [sequence(6, start=100_000 + 1000 * i) for i in range(4)]
    errors: list[BaseException] = []
    restored_pages = [0] * THREADS
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        rng = random.Random(t)
        own = [sequence(6, start=t * 10_000 + 100 * i) for i in range(4)]
        write_slots = list(range(t * 32, t * 32 + 8))
        read_slots = list(range(t * 32 + 16, t * 32 + 24))
        try:
            start.wait(5)
            for _ in range(ROUNDS):
                pages = rng.choice(own + shared)
                n = rng.randint(1, len(pages))
                pages = pages[:n]
                for page, slot in zip(pages, write_slots, strict=False):
                    host.write_page(slot, content(page, page_bytes))
                results = runner.backup("kv", pages, write_slots[:n])
                assert len(results) == n
                outcomes = runner.restore("kv", pages, read_slots[:n])
                for page, slot, outcome in zip(pages, read_slots, outcomes, strict=False):
                    assert outcome.outcome in (Outcome.RESTORED, Outcome.MISS), outcome
                    if outcome.restored:
                        assert host.read_page(slot) == content(page, page_bytes), "torn or foreign page"
                        restored_pages[t] += 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[0]
    assert all(n > 0 for n in restored_pages)
    stats = runner.stats().pools[0]
    assert stats.filling == 0 and stats.claimed == 0 and stats.discarding == 0
    assert stats.ready + stats.free == stats.slots
    assert stats.ready == sum(runner.exists("kv", p).count(True) for p in _all_sequences())
    assert runner.stats().counters.get("kvcr_evicted_pages_total{pool=kv}", 0) > 0


def _all_sequences():
    seqs = [sequence(6, start=100_000 + 1000 * i) for i in range(4)]
    for t in range(THREADS):
        seqs += [sequence(6, start=t * 10_000 + 100 * i) for i in range(4)]
    return seqs
