import contextlib

import pytest

from kvcr.adapters.zmq import ZmqControlChannel
from tests.contract.zmq_kind import free_port


@pytest.fixture
def channels():
    """channels(port=None, **kwargs) -> a ZmqControlChannel on 127.0.0.1 (a free port by default)."""
    made = []

    def make(port=None, **kwargs):
        channel = ZmqControlChannel("127.0.0.1", port or free_port(), **kwargs)
        made.append(channel)
        return channel

    yield make
    for channel in made:
        with contextlib.suppress(Exception):
            channel.close()
