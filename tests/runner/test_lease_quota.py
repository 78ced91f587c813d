"""Per-peer lease quotas: one holder pins at most its share of a pool, and at most so many leases."""

import time

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.runner.quota import PeerQuota
from tests.support import content, runner_config, sequence

MINE, THEIRS = 11, 22


def stored(build, pages, **changes):
    runner, hosts = build(slots=32, **changes)  # lease cap 16; a holder's share 8 by default
    for slot, page in enumerate(pages):
        hosts["kv"].write_page(slot, content(page, hosts["kv"].pool.page_bytes))
    assert all(runner.backup("kv", pages, list(range(len(pages)))))
    return runner


def granted(grant):
    return sum(slot >= 0 for slot in grant.slots[0])


def test_a_holder_pins_at_most_its_share_and_another_holder_still_gets_unleased_pages(build):
    pages = sequence(24)
    runner = stored(build, pages)
    first = runner.lease([("kv", pages[:12])], 5.0, holder=MINE)
    assert granted(first) == 8 and first.over_quota == 4 and first.slots[0][8:] == (-1,) * 4
    again = runner.lease([("kv", pages[:8])], 5.0, holder=MINE)  # re-leasing what it pins costs nothing
    assert granted(again) == 8 and again.over_quota == 0
    more = runner.lease([("kv", pages[8:12])], 5.0, holder=MINE)
    assert granted(more) == 0 and more.lease_id == 0 and more.over_quota == 4
    other = runner.lease([("kv", pages[16:24])], 5.0, holder=THEIRS)
    assert granted(other) == 8 and other.over_quota == 0
    local = runner.lease([("kv", pages[8:16])], 5.0)  # no holder: only the pool's cap applies
    assert granted(local) == 0 and local.over_quota == 0  # the pool is at its cap (16) now


def test_ending_a_holders_leases_gives_its_share_back(build):
    pages = sequence(16)
    runner = stored(build, pages)
    first = runner.lease([("kv", pages[:8])], 5.0, holder=MINE)
    second = runner.lease([("kv", pages[:8])], 5.0, holder=MINE)
    assert runner.release_lease(first.lease_id)
    assert granted(runner.lease([("kv", pages[8:9])], 5.0, holder=MINE)) == 0  # the second still pins 8
    assert runner.release_lease(second.lease_id)
    assert granted(runner.lease([("kv", pages[8:16])], 0.001, holder=MINE)) == 8
    assert granted(runner.lease([("kv", pages[:1])], 5.0, holder=MINE)) == 0  # at its share again
    time.sleep(0.01)
    assert runner.expire_leases() == 1  # expiry gives the share back too
    assert granted(runner.lease([("kv", pages[:8])], 5.0, holder=MINE)) == 8


def test_a_holder_holds_at_most_max_peer_leases(build):
    pages = sequence(2)
    runner = stored(build, pages, max_peer_leases=2)
    assert all(runner.lease([("kv", pages)], 5.0, holder=MINE).lease_id for _ in range(2))
    third = runner.lease([("kv", pages)], 5.0, holder=MINE)
    assert third.lease_id == 0 and third.over_quota == 2
    assert runner.lease([("kv", pages)], 5.0, holder=THEIRS).lease_id


def test_the_quota_model_forgets_a_holder_once_its_leases_end():
    quota = PeerQuota(max_leases=4)
    quota.pin(MINE, "kv", "p")
    quota.pin(MINE, "kv", "p")  # one page claimed twice by one lease: pinned once
    quota.add_lease(MINE)
    assert not quota.may_pin(MINE, "kv", "q", cap=1) and quota.may_pin(MINE, "kv", "p", cap=1)
    quota.end(MINE, [("kv", "p"), ("kv", "p")])
    assert quota.holders() == 0 and quota.may_pin(MINE, "kv", "q", cap=1)
    assert quota.may_lease(0) and quota.may_pin(0, "kv", "q", cap=0)  # holder 0 is never counted


def test_try_pin_pins_only_what_may_pin_allows_and_counts_each_pool_apart():
    quota = PeerQuota(max_leases=4)
    assert not quota.try_pin(MINE, "kv", "p", cap=0) and quota.holders() == 0  # nothing recorded
    assert quota.try_pin(MINE, "kv", "p", cap=2) and quota.try_pin(MINE, "kv", "q", cap=2)
    assert not quota.try_pin(MINE, "kv", "r", cap=2)  # a third distinct page is over the share
    assert quota.try_pin(MINE, "kv", "p", cap=2)  # a page it pins already costs nothing more
    assert quota.try_pin(MINE, "state", "s", cap=1)  # another pool's share is its own
    assert quota.try_pin(THEIRS, "kv", "r", cap=2)  # and another holder's
    quota.add_lease(MINE)
    quota.end(MINE, [("kv", "p"), ("kv", "q"), ("kv", "p"), ("state", "s")])
    assert quota.may_pin(MINE, "kv", "r", cap=1) and quota.may_pin(MINE, "state", "t", cap=1)
    assert quota.try_pin(0, "kv", "r", cap=0)  # holder 0 is never counted


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_peer_leased_fraction": 0.0}, "max_peer_leased_fraction must be in (0, 1], got 0.0"),
        ({"max_peer_leased_fraction": 1.5}, "max_peer_leased_fraction must be in (0, 1], got 1.5"),
        ({"max_peer_leases": 0}, "max_peer_leases must be in 1..1048576, got 0"),
    ],
)
def test_quota_settings_out_of_range_are_refused_by_name(kv, changes, message):
    with pytest.raises(ConfigError) as err:
        runner_config((kv,), 16, **changes)
    assert str(err.value) == message


@pytest.fixture
def kv():
    from tests.support import kv_pool

    return kv_pool()
