"""Dynamo integration tests: ai-dynamo-runtime's real SelectionService and pyzmq sockets, loopback only."""

import contextlib
import time

import pytest

# SGLang's cache directories and the torchvision stub must be in place before anything here imports SGLang.
import tests.integration.sglang.conftest  # noqa: F401
from tests.support import free_port as free_port  # re-exported for these tests


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration/dynamo" in str(item.fspath):
            item.add_marker(pytest.mark.dynamo)
            item.add_marker(pytest.mark.zmq)


def loopback() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def poll(check, timeout_s: float = 5.0, interval_s: float = 0.02):
    """Call ``check`` until it returns something truthy (returned) or the time is up (the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


@pytest.fixture
def producer():
    from kvcr.integrations.dynamo import BlockingHintProducer

    made = BlockingHintProducer(timeout_s=10.0)
    yield made
    made.close()


@pytest.fixture
def closing():
    """closing(obj) -> obj, closed (in reverse order) when the test ends."""
    made = []

    def keep(obj):
        made.append(obj)
        return obj

    yield keep
    for obj in reversed(made):
        with contextlib.suppress(Exception):
            obj.close()
