"""The composition root: the only module that knows which adapter implements which port.

Build a runner with::

    container = Container()
    container.config.from_dict({"runner": RunnerConfig(...), "memory": "mmap", "inventory": "none"})
    runner = container.runner()

Tests swap an adapter with ``container.memory.override(...)``. Adapter modules are imported by
the build functions below, only when their provider is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dependency_injector import containers, providers

from kvcr.runner.config import RunnerConfig
from kvcr.runner.runner import KvcrRunner

if TYPE_CHECKING:
    from kvcr.ports.clock import Clock
    from kvcr.ports.inventory import InventorySink
    from kvcr.ports.memory import HostMemory
    from kvcr.ports.metrics import Metrics


def _mmap_memory() -> HostMemory:
    from kvcr.adapters.local import MmapHostMemory

    return MmapHostMemory()


def _mock_memory() -> HostMemory:
    from kvcr.adapters.mock import MockHostMemory

    return MockHostMemory()


def _monotonic_clock() -> Clock:
    from kvcr.adapters.local import MonotonicClock

    return MonotonicClock()


def _fake_clock() -> Clock:
    from kvcr.adapters.mock import FakeClock

    return FakeClock()


def _metrics() -> Metrics:
    from kvcr.adapters.local import InMemoryMetrics

    return InMemoryMetrics()


def _null_inventory() -> InventorySink:
    from kvcr.adapters.local import NullInventory

    return NullInventory()


def _recording_inventory() -> InventorySink:
    from kvcr.adapters.local import RecordingInventory

    return RecordingInventory()


def _runner(
    config: RunnerConfig, memory: HostMemory, clock: Clock, metrics: Metrics, inventory: InventorySink
) -> KvcrRunner:
    if not isinstance(config, RunnerConfig):
        raise TypeError(f"config.runner must be a RunnerConfig, got {type(config).__name__}")
    return KvcrRunner(config, memory=memory, clock=clock, metrics=metrics, inventory=inventory)


class Container(containers.DeclarativeContainer):
    """Providers for one runner; ``config`` is strict: a missing key is an error, not None."""

    config = providers.Configuration(strict=True)

    memory = providers.Selector(
        config.memory,
        mmap=providers.Singleton(_mmap_memory),
        mock=providers.Singleton(_mock_memory),
    )
    clock = providers.Selector(
        config.clock,
        monotonic=providers.Singleton(_monotonic_clock),
        fake=providers.Singleton(_fake_clock),
    )
    metrics = providers.Singleton(_metrics)
    inventory = providers.Selector(
        config.inventory,
        none=providers.Singleton(_null_inventory),
        recording=providers.Singleton(_recording_inventory),
    )
    runner = providers.Singleton(
        _runner,
        config=config.runner,
        memory=memory,
        clock=clock,
        metrics=metrics,
        inventory=inventory,
    )


DEFAULTS = {"memory": "mmap", "clock": "monotonic", "inventory": "none"}


def build_container(runner_config: RunnerConfig, **choices: str) -> Container:
    """A container for ``runner_config`` with adapter choices (memory, clock, inventory) applied."""
    container = Container()
    container.config.from_dict({**DEFAULTS, **choices, "runner": runner_config})
    return container
