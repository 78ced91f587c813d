import pytest

from kvcr.domain.deadlines import DeadlineBudget
from kvcr.domain.errors import ConfigError
from kvcr.domain.eviction import FifoPolicy, LruPolicy
from kvcr.domain.outcomes import RESTORED, Outcome, failed, miss, restored_prefix, uncertain
from kvcr.domain.residency import IllegalTransition, Lease, SlotState, check_transition, evictable, lease_accepts


def test_slot_state_machine():
    assert check_transition(SlotState.FREE, SlotState.FILLING) is SlotState.FILLING
    assert check_transition(SlotState.FILLING, SlotState.READY) is SlotState.READY
    assert check_transition(SlotState.READY, SlotState.DISCARDING) is SlotState.DISCARDING
    for bad in [
        (SlotState.FREE, SlotState.READY),
        (SlotState.READY, SlotState.FILLING),
        (SlotState.DISCARDING, SlotState.READY),
    ]:
        with pytest.raises(IllegalTransition):
            check_transition(*bad)


def test_only_unclaimed_ready_slots_are_evictable():
    assert evictable(SlotState.READY, 0)
    assert not evictable(SlotState.READY, 1)
    assert not evictable(SlotState.FILLING, 0)


def test_lease_rule_uses_the_targets_send_time_and_margin():
    assert lease_accepts(sent_at=100.0, lease_s=10.0, margin_s=1.0, completed_at=108.9)
    assert not lease_accepts(sent_at=100.0, lease_s=10.0, margin_s=1.0, completed_at=109.0)
    lease = Lease(1, ("k",), granted_at=5.0, expires_at=15.0)
    assert not lease.expired(14.9) and lease.expired(15.0)
    assert lease.renewed(14.0, 10.0).expires_at == 24.0


def test_lru_evicts_least_recent_prefix_deepest_first():
    policy = LruPolicy()
    policy.admit(["a0", "a1", "a2"])
    policy.admit(["b0", "b1"])
    assert list(policy.victims()) == ["a2", "a1", "a0", "b1", "b0"]
    policy.touch(["a0", "a1"])
    assert list(policy.victims()) == ["a2", "b1", "b0", "a1", "a0"]
    policy.remove("b1")
    policy.remove("missing")
    assert len(policy) == 4


def test_fifo_ignores_touches():
    policy = FifoPolicy()
    policy.admit(["a0", "a1"])
    policy.admit(["b0"])
    policy.touch(["a0"])
    assert list(policy.victims()) == ["a1", "a0", "b0"]


def test_deadline_budget():
    budget = DeadlineBudget(1.0, 3.0)
    d = budget.start(10.0)
    assert d.operation.at == 11.0 and d.abandon.at == 13.0
    assert d.operation.remaining(10.5) == 0.5 and d.operation.expired(11.0)
    with pytest.raises(ConfigError, match="abandon_timeout_ms"):
        DeadlineBudget(2.0, 1.0)
    with pytest.raises(ConfigError, match="operation_timeout_ms"):
        DeadlineBudget(0.0, 1.0)


def test_outcomes_only_get_worse():
    assert RESTORED.worsen(miss("x")).outcome is Outcome.MISS
    assert failed("x").worsen(RESTORED).outcome is Outcome.FAILED
    assert failed("x").worsen(uncertain("y")).outcome is Outcome.UNCERTAIN
    assert restored_prefix([RESTORED, RESTORED, miss("m"), RESTORED]) == 2
