"""Every contract test runs against each adapter kind listed here.

A kind is a factory module with ``make_data_plane(name)`` / ``make_control(port)`` and a
``close_all()``; the mock kinds live here, the real ones in ``nixl_kind.py`` and ``zmq_kind.py``
and carry their marker so a developer can deselect them (CI runs them all).
"""

import contextlib
import importlib

import pytest

from kvcr.adapters.mock import FakeClock, MockControlChannel, MockDataPlane, MockFabric

DATA_PLANE_KINDS = [
    "mock",
    pytest.param("nixl", marks=pytest.mark.nixl),
    pytest.param("ucx", marks=pytest.mark.ucx),
    "shm",
    pytest.param("auto", marks=pytest.mark.nixl),
]
CONTROL_KINDS = ["mock", pytest.param("zmq", marks=pytest.mark.zmq), pytest.param("zmq_curve", marks=pytest.mark.zmq)]


class _MockKind:
    def __init__(self):
        self.fabric, self.clock = MockFabric(), FakeClock()

    def make_data_plane(self, name):
        return MockDataPlane(self.fabric, name, self.clock)

    def make_control(self, port):
        return MockControlChannel(self.fabric, f"tcp://127.0.0.1:{port}", self.clock)


def _kind(name):
    if name == "mock":
        return _MockKind()
    return importlib.import_module(f"tests.contract.{name}_kind").Kind()


@pytest.fixture(params=DATA_PLANE_KINDS)
def data_planes(request):
    kind = _kind(request.param)
    made = []

    def make(name):
        plane = kind.make_data_plane(name)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        with contextlib.suppress(Exception):  # a test may have closed it already
            plane.close()


@pytest.fixture(params=CONTROL_KINDS)
def control_channels(request):
    kind = _kind(request.param)
    made = []

    def make(port):
        channel = kind.make_control(port)
        made.append(channel)
        return channel

    yield make
    for channel in made:
        channel.close()
