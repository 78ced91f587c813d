"""The composition root wires real adapters by config and lets tests override them."""

import pytest
from dependency_injector import errors as di_errors

from kvcr.adapters.local import MmapHostMemory, NullInventory, RecordingInventory
from kvcr.adapters.mock import FakeClock, MockHostMemory
from kvcr.container import Container, build_container
from kvcr.runner import KvcrRunner
from tests.support import kv_pool, runner_config


def test_defaults_build_a_runner_on_real_memory():
    container = build_container(runner_config((kv_pool(),), 4))
    runner = container.runner()
    assert isinstance(runner, KvcrRunner)
    assert isinstance(container.memory(), MmapHostMemory)
    assert isinstance(container.inventory(), NullInventory)
    assert container.runner() is runner
    runner.close()


def test_selectors_pick_adapters_by_name():
    container = build_container(runner_config((kv_pool(),), 4), memory="mock", clock="fake", inventory="recording")
    assert isinstance(container.memory(), MockHostMemory)
    assert isinstance(container.clock(), FakeClock)
    assert isinstance(container.inventory(), RecordingInventory)
    container.runner().close()


def test_override_swaps_an_adapter():
    container = build_container(runner_config((kv_pool(),), 4))
    memory = MockHostMemory()
    with container.memory.override(memory):
        runner = container.runner()
    assert memory.live_allocations == 1
    runner.close()
    assert memory.live_allocations == 0


def test_strict_config_refuses_missing_keys_and_wrong_types():
    container = Container()
    container.config.from_dict({"memory": "mock", "clock": "fake", "inventory": "none"})
    with pytest.raises(di_errors.Error):
        container.runner()
    bad = build_container(runner_config((kv_pool(),), 4))
    bad.config.runner.from_value({"name": "not a RunnerConfig"})
    with pytest.raises(TypeError, match="RunnerConfig"):
        bad.runner()
