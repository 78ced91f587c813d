"""Honest in-memory fakes of the ports: bytes really move, faults are constructor arguments."""

from kvcr.adapters.mock.clock import FakeClock
from kvcr.adapters.mock.control import MockControlChannel
from kvcr.adapters.mock.dataplane import MockDataPlane
from kvcr.adapters.mock.fabric import ControlFaults, Faults, MockFabric
from kvcr.adapters.mock.memory import MockHostMemory

__all__ = [
    "ControlFaults",
    "FakeClock",
    "Faults",
    "MockControlChannel",
    "MockDataPlane",
    "MockFabric",
    "MockHostMemory",
]
