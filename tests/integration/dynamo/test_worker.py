"""The kvcr Dynamo worker's settings, capability record and command line (no processes but one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcr.demo.dynamo.worker_settings import parse_worker_args
from kvcr.domain.errors import ConfigError
from kvcr.integrations.dynamo.capability import hint_capability

MODEL = str(Path(__file__).parent)  # any directory stands for a model directory here
BASE = ["--model", MODEL, "--control-port", "30001", "--kv-events-port", "30002"]


def test_the_settings_carry_the_page_geometry_and_endpoints():
    s = parse_worker_args([*BASE, "--page-kib", "256", "--page-tokens", "16", "--dram", "1GiB", "--name", "a"])
    assert (s.layers, s.page_bytes, s.dram_bytes) == (16, 256 << 10, 1 << 30)
    assert s.control_endpoint == "tcp://127.0.0.1:30001" and s.kv_events_endpoint == "tcp://127.0.0.1:30002"
    assert s.hint_capability and parse_worker_args([*BASE, "--no-hint-capability"]).hint_capability is False


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--control-port", "0"], "--control-port"),
        (["--page-kib", "24"], "--page-kib"),
        (["--queue-delay-ms", "-1"], "--queue-delay-ms"),
        (["--host", "0.0.0.0"], "--host"),
        (["--dram", "lots"], "--dram"),
        (["--dram", "1TiB"], "--dram 1TiB .* more than this host has available"),
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--model", "/nonexistent/model"], "--model '/nonexistent/model' is not a directory"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(extra, option):
    with pytest.raises(ConfigError, match=option):
        parse_worker_args([*BASE, *extra])


def test_the_capability_is_the_three_keys_with_router_hint_last():
    record = hint_capability("tcp://127.0.0.1:30001")
    assert list(record) == ["router_hint_source_control_endpoints", "router_hint_worker_type", "router_hint"]
    assert record == {
        "router_hint_source_control_endpoints": {"0": "tcp://127.0.0.1:30001"},
        "router_hint_worker_type": "aggregated",
        "router_hint": True,
    }
    with pytest.raises(ConfigError, match="router_hint_source_control_endpoints"):
        hint_capability("tcp://0.0.0.0:30001")


def test_the_worker_command_refuses_bad_options_in_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "kvcr.cli", "worker", *BASE[:2], "--control-port", "0", "--kv-events-port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "kvcr worker: --control-port must be in 1..65535, got 0"


def test_a_missing_model_directory_is_one_line_before_dynamo_starts():
    done = subprocess.run(
        [sys.executable, "-m", "kvcr.cli", "worker", "--model", "/nonexistent", *BASE[2:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("kvcr worker: --model '/nonexistent' is not a directory")
