"""``active_leases`` counts live leases only: one past its deadline is ended when asked, not counted.

Before, a lease nobody released (its LEASE reply lost with a target that gave up) was counted, and
kept pinning its slots, until some later lease or close swept it: an operator saw a held lease
that had expired seconds ago.
"""

import time

from tests.runner.test_lease_scope import fill
from tests.support import sequence


def test_an_expired_lease_is_not_counted_and_pins_nothing(build):
    runner, hosts = build()
    pages = sequence(2)
    fill(hosts["kv"], pages, [0, 1])
    runner.backup("kv", pages, [0, 1])
    grant = runner.lease([("kv", pages)], 0.05)
    assert grant.lease_id and runner.active_leases == 1
    time.sleep(0.1)
    assert runner.active_leases == 0
    assert runner.leased_slots(grant.lease_id) is None
