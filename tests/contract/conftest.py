"""Fixtures that give every contract test a pair of endpoints of one adapter kind.

Each kind returns a factory: ``make(name) -> DataPlane`` plus a teardown. The NIXL kind joins
this list when its adapter exists; the suite itself does not change.
"""

import contextlib

import pytest

from kvcr.adapters.mock import FakeClock, MockControlChannel, MockDataPlane, MockFabric

DATA_PLANE_KINDS = ["mock"]
CONTROL_KINDS = ["mock"]


@pytest.fixture(params=DATA_PLANE_KINDS)
def data_planes(request):
    made = []
    if request.param == "mock":
        fabric, clock = MockFabric(), FakeClock()

        def make(name):
            plane = MockDataPlane(fabric, name, clock)
            made.append(plane)
            return plane

    yield make
    for plane in made:
        with contextlib.suppress(Exception):  # a test may have closed or killed it already
            plane.close()


@pytest.fixture(params=CONTROL_KINDS)
def control_channels(request):
    made = []
    if request.param == "mock":
        fabric, clock = MockFabric(), FakeClock()

        def make(port):
            channel = MockControlChannel(fabric, f"tcp://127.0.0.1:{port}", clock)
            made.append(channel)
            return channel

    yield make
    for channel in made:
        channel.close()
