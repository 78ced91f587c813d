"""RunnerGuard: the runner's lock with a deadline, its closed flag, and its in-flight count."""

from __future__ import annotations

import threading

import pytest

from kvcr.adapters.mock.clock import FakeClock
from kvcr.domain.errors import ClosedError, DeadlineExceeded
from kvcr.runner.guard import RunnerGuard


def test_the_lock_is_given_up_on_at_the_operation_deadline():
    clock = FakeClock()
    guard = RunnerGuard("r0", clock)
    with guard.locked(clock.now() + 1.0):
        result: list[BaseException] = []

        def contend() -> None:
            try:
                with guard.locked(clock.now() + 0.05):
                    pass
            except DeadlineExceeded as exc:
                result.append(exc)

        other = threading.Thread(target=contend)
        other.start()
        other.join(5)
    assert len(result) == 1  # the other caller waited 50 ms at most, then gave up
    with guard.locked(clock.now()):  # free again: a deadline already due still takes a free lock
        pass


def test_a_closed_runner_refuses_and_a_finished_operation_wakes_the_waiter():
    guard = RunnerGuard("r0", FakeClock())
    with guard.lock:
        guard.check_open()
        guard.inflight = 1
    woke = threading.Event()

    def wait_quiet() -> None:
        with guard.lock:
            while guard.inflight:
                guard.quiet.wait(5)
            woke.set()

    waiter = threading.Thread(target=wait_quiet)
    waiter.start()
    with guard.lock:
        guard.finished()
    waiter.join(5)
    assert woke.is_set() and guard.inflight == 0
    guard.closed = True
    with pytest.raises(ClosedError, match="'r0' is closed"):
        guard.check_open()
