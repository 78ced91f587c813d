"""``python -m dynamo.sglang`` with kvcr as L3 needs no custom code: kvcr's SGLang plugin wires it.

Each flow runs in a fresh process (``dynamo_sglang_host_flow``), as Dynamo's worker process: Dynamo
1.6.1's real ``register`` module and request handlers, then SGLang's real ``load_plugins()`` (what
``sgl.Engine.__init__`` calls there) running kvcr's plugin from its installed entry point. Dynamo's
code is not patched by the test; only the SGLang engine (no scheduler) and the server arguments are
stand-ins. The hook's refusals are checked in-process on stand-in modules and classes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.integrations.shared import dynamo_sglang
from kvcr.integrations.shared.sglang_handler import _request_hints

REPO = Path(__file__).resolve().parents[3]
KVCR = {
    "module_path": "kvcr.integrations.sglang",
    "class_name": "KvcrHiCacheStorage",
    "control_host": "10.0.0.7",
    "control_port": 32100,
    "enable_remote_hint": True,
}


def run_flow(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.dynamo.dynamo_sglang_host_flow", *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def with_plugin() -> dict:
    return run_flow()


@pytest.mark.sglang
@pytest.mark.multiprocess
def test_the_plugin_hooks_dynamos_registration_and_handlers(with_plugin):
    assert with_plugin["hooked"] is True
    assert with_plugin["prefill_hooked"] is True


@pytest.mark.sglang
@pytest.mark.multiprocess
def test_dynamos_get_runtime_config_carries_kvcrs_capability(with_plugin):
    assert with_plugin["capability"] == {
        "router_hint_source_control_endpoints": {"0": "tcp://10.0.0.7:32100"},
        "router_hint_worker_type": "aggregated",
        "router_hint": True,
    }
    # --tp-size 4 --dp-size 2 --enable-dp-attention: attention TP 2, so DP rank d binds 32100 + 2d
    assert with_plugin["capability_dp_attention"] == {
        "router_hint_source_control_endpoints": {"0": "tcp://10.0.0.7:32100", "1": "tcp://10.0.0.7:32102"},
        "router_hint_worker_type": "prefill",
        "router_hint": True,
    }


@pytest.mark.sglang
@pytest.mark.multiprocess
def test_no_capability_unless_kvcr_is_the_l3_with_hints_on(with_plugin):
    assert with_plugin["capability_hints_off"] == {}
    assert with_plugin["capability_other_backend"] == {}
    assert with_plugin["capability_no_hicache"] == {}


@pytest.mark.sglang
@pytest.mark.multiprocess
def test_a_routers_kv_hint_reaches_sglang_as_kv_hints(with_plugin):
    assert with_plugin["served"] == [{"message_id": "sel-1", "n": 1}]  # SGLang's decoded envelope
    assert with_plugin["served_hints_off"] == [None]


@pytest.mark.sglang
@pytest.mark.multiprocess
def test_stock_dynamo_without_the_plugin_publishes_and_forwards_nothing():
    stock = run_flow("--no-plugin")
    assert stock["hooked"] is False
    assert stock["capability"] == {}
    assert stock["served"] == [None]
    assert stock["metrics_hooked"] is False
    assert not any("kvcr_" in text for text in stock["metrics"])  # Dynamo passes only sglang: series


@pytest.mark.sglang
@pytest.mark.multiprocess
def test_kvcrs_series_reach_the_workers_metrics_with_dynamos_labels(with_plugin):
    assert with_plugin["metrics_hooked"] is True
    texts = with_plugin["metrics"]
    assert any("sglang:prompt_tokens" in text for text in texts)  # Dynamo's own callback, as before
    kvcr = [line for text in texts for line in text.splitlines() if line.startswith("kvcr_pages_total{")]
    assert len(kvcr) == 1, texts  # once (not also through SGLang's callback), hints off or not
    for label in ('path="backup"', 'outcome="ok"', 'dynamo_component="backend"', 'worker_id="abc"', 'model="tiny"'):
        assert label in kvcr[0]
    assert kvcr[0].endswith(" 5.0")


# ---------------------------------------------------------------------- in-process: the hook's own rules


def args(**overrides):
    fields = {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(KVCR),
        "disaggregation_mode": "null",
        "tp_size": 1,
    }
    return SimpleNamespace(**{**fields, **overrides})


class Config:
    def __init__(self, data_parallel_size=1, runtime_data=None):
        self.data_parallel_size = data_parallel_size
        self.data_parallel_start_rank = 0
        self.runtime_data = dict(runtime_data or {})

    def set_engine_specific(self, key, value):
        self.runtime_data[key] = value


def test_kvcr_is_recognised_by_module_or_name_and_read_from_a_file(tmp_path):
    assert dynamo_sglang.hint_settings(args()).control_port == 32100
    named = {**KVCR, "module_path": "elsewhere", "backend_name": "kvcr"}
    assert dynamo_sglang.hint_settings(args(hicache_storage_backend_extra_config=named)) is not None
    other = {**KVCR, "module_path": "mooncake_store", "backend_name": "mooncake"}
    assert dynamo_sglang.hint_settings(args(hicache_storage_backend_extra_config=other)) is None
    path = tmp_path / "kvcr.json"
    path.write_text(json.dumps(KVCR))
    assert dynamo_sglang.hint_settings(args(hicache_storage_backend_extra_config=f"@{path}")) is not None
    plain = {k: v for k, v in KVCR.items() if k != "module_path"}
    assert dynamo_sglang.hint_settings(args(hicache_storage_backend="kvcr", hicache_storage_backend_extra_config=plain))


def test_a_hint_config_that_cannot_be_advertised_fails_registration():
    wildcard = {**KVCR, "control_host": "0.0.0.0"}
    with pytest.raises(ConfigError, match="not dialable"):
        dynamo_sglang.publish_for_engine(Config(), args(hicache_storage_backend_extra_config=wildcard))


def test_a_worker_that_already_publishes_router_hint_is_left_alone():
    config = Config(runtime_data={"router_hint": "true"})
    assert dynamo_sglang.publish_for_engine(config, args()) is False
    assert config.runtime_data == {"router_hint": "true"}


def test_decode_role_and_pure_dp_ports():
    config = Config(data_parallel_size=2)
    assert dynamo_sglang.publish_for_engine(config, args(disaggregation_mode="decode", tp_size=2, dp_size=2))
    assert json.loads(config.runtime_data["router_hint_source_control_endpoints"]) == {
        "0": "tcp://10.0.0.7:32100",
        "1": "tcp://10.0.0.7:32102",  # each replica is TP 2
    }
    assert json.loads(config.runtime_data["router_hint_worker_type"]) == "decode"


def test_what_does_not_look_like_dynamo_is_left_untouched(caplog):
    def get_runtime_config(engine, server_args, dynamo_args):  # sync: not Dynamo's
        return None

    module = SimpleNamespace(get_runtime_config=get_runtime_config)

    class NotAHandler:
        def __init__(self, config):
            self.config = config

    init = NotAHandler.__init__
    with caplog.at_level(logging.WARNING, logger=dynamo_sglang.__name__):
        assert dynamo_sglang._hook_runtime_config(module) is False
        assert dynamo_sglang._hook_handler(NotAHandler, "NotAHandler") is False
    assert module.get_runtime_config is get_runtime_config
    assert NotAHandler.__init__ is init
    assert len(caplog.records) == 2


def test_install_does_nothing_outside_a_dynamo_sglang_process(monkeypatch):
    monkeypatch.delitem(sys.modules, "dynamo.sglang", raising=False)
    assert dynamo_sglang.install() == []


def test_the_prefill_legs_inner_request_carries_the_hint():
    hint = {
        "protocol_version": "0.1",
        "message_id": "m",
        "actions": [
            {
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {"source_control_endpoint": "tcp://10.0.0.1:32100", "block_hashes": [3]},
            }
        ],
    }
    assert _request_hints({"request": {"token_ids": [1], "kv_hint": hint}, "sampling_params": {}}, "r")["message_id"]
    assert _request_hints({"request": {"token_ids": [1]}}, "r") is None
