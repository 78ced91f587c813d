"""Worker capability on Dynamo's real ModelRuntimeConfig, endpoint maps, and hint forwarding to SGLang."""

import json
from typing import Any

import pytest
from dynamo.llm import ModelRuntimeConfig

from kvcr.domain.errors import ConfigError
from kvcr.domain.hints import parse_hint
from kvcr.integrations.dynamo import control_endpoints_for, kv_hints_from_request, publish_hint_capability
from kvcr.integrations.dynamo.capability import (
    ROUTER_HINT,
    ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS,
    ROUTER_HINT_WORKER_TYPE,
    EngineSpecificConfig,
)


class RecordingConfig:
    """Records set_engine_specific calls in order (ModelRuntimeConfig keeps an unordered map)."""

    def __init__(self):
        self.calls = []

    def set_engine_specific(self, key, value):
        self.calls.append((key, value))


def test_capability_lands_on_a_real_model_runtime_config():
    config = ModelRuntimeConfig()
    publish_hint_capability(config, {0: "tcp://10.0.0.7:32100", 1: "tcp://10.0.0.7:32104"}, "aggregated")
    data = {key: json.loads(text) for key, text in config.runtime_data.items()}
    assert data == {
        ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS: {"0": "tcp://10.0.0.7:32100", "1": "tcp://10.0.0.7:32104"},
        ROUTER_HINT_WORKER_TYPE: "aggregated",
        ROUTER_HINT: True,
    }
    # 1.6.1's get_engine_specific reads back only string values.
    assert config.get_engine_specific(ROUTER_HINT_WORKER_TYPE) == "aggregated"


def test_router_hint_is_published_last():
    config = RecordingConfig()
    publish_hint_capability(config, {0: "tcp://host-a:32100"}, "prefill")
    assert [key for key, _ in config.calls] == [
        ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS,
        ROUTER_HINT_WORKER_TYPE,
        ROUTER_HINT,
    ]
    assert [json.loads(value) for _, value in config.calls] == [{"0": "tcp://host-a:32100"}, "prefill", True]


@pytest.mark.parametrize(
    ("endpoints", "named"),
    [
        ({0: "tcp://0.0.0.0:32100"}, "[0]"),
        ({0: "tcp://10.0.0.1:32100", 1: "tcp://*:32101"}, "[1]"),
        ({0: "tcp://[::]:32100"}, "[0]"),
        ({0: "tcp://10.0.0.1:0"}, "[0]"),
        ({2: "10.0.0.1:32100"}, "[2]"),
        ({0: "ipc:///tmp/kvcr"}, "[0]"),
        ({-1: "tcp://10.0.0.1:32100"}, "-1"),
        ({}, "at least one"),
    ],
)
def test_undialable_endpoints_are_refused_before_anything_is_published(endpoints, named):
    config = RecordingConfig()
    with pytest.raises(ConfigError, match=ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS) as caught:
        publish_hint_capability(config, endpoints, "aggregated")
    assert named in str(caught.value)
    assert config.calls == []


def test_unknown_worker_types_are_refused():
    config = RecordingConfig()
    with pytest.raises(ConfigError, match=r"router_hint_worker_type.*'encode'"):
        publish_hint_capability(config, {0: "tcp://10.0.0.1:32100"}, "encode")
    assert config.calls == []


def test_the_recording_fake_and_the_real_config_satisfy_the_same_protocol():
    def takes(config: EngineSpecificConfig) -> None:
        publish_hint_capability(config, {0: "tcp://h:1"}, "decode")

    takes(RecordingConfig())
    takes(ModelRuntimeConfig())


def test_control_endpoints_follow_the_backends_port_layout():
    extra = {"control_host": "0.0.0.0", "control_advertise_host": "10.0.0.7", "control_port": 32100}
    assert control_endpoints_for(extra) == {0: "tcp://10.0.0.7:32100"}
    # DP attention: 4 replicas of attention-TP 2, rank r of replica d binds 32100 + 2d + r.
    assert control_endpoints_for(extra, dp_size=4, tp_size=2) == {
        0: "tcp://10.0.0.7:32100",
        1: "tcp://10.0.0.7:32102",
        2: "tcp://10.0.0.7:32104",
        3: "tcp://10.0.0.7:32106",
    }
    assert control_endpoints_for(extra, dp_size=2, tp_size=2, attn_cp_size=2, dp_start_rank=4) == {
        4: "tcp://10.0.0.7:32100",
        5: "tcp://10.0.0.7:32104",
    }


def test_control_endpoints_refuse_what_peers_cannot_dial():
    with pytest.raises(ConfigError, match="control_port is 0"):
        control_endpoints_for({"control_port": 0})
    with pytest.raises(ConfigError, match="not dialable"):
        control_endpoints_for({"control_host": "0.0.0.0", "control_port": 32100})
    with pytest.raises(ConfigError, match="unknown kvcr setting"):
        control_endpoints_for({"control_prot": 32100})
    with pytest.raises(ConfigError, match="control_port"):
        control_endpoints_for({"control_port": 65530}, dp_size=8)


# ---------------------------------------------------------------------- forwarding

ENVELOPE: dict[str, Any] = {
    "protocol_version": "0.1",
    "message_id": "sel-9",
    "actions": [
        {
            "action_id": "a1",
            "action_type": "kv.fetch",
            "action_version": "1.0",
            "payload": {"source_control_endpoint": "tcp://10.0.0.1:32100", "block_hashes": [1, (1 << 64) - 1]},
        }
    ],
}


def test_the_typed_kv_hint_is_forwarded_as_sglang_kv_hints():
    forwarded = kv_hints_from_request({"token_ids": [1, 2, 3], "kv_hint": ENVELOPE})
    assert forwarded == ENVELOPE
    assert forwarded is not ENVELOPE
    assert parse_hint(forwarded).hint.block_hashes == frozenset({1, (1 << 64) - 1})
    assert kv_hints_from_request({"kv_hint": json.dumps(ENVELOPE)}) == ENVELOPE


def test_the_bridge_and_legacy_locations_are_read_too():
    bridged = {"extra_args": {"kv_transfer_params": {"kv_hint": ENVELOPE}}}
    assert kv_hints_from_request(bridged) == ENVELOPE
    legacy = {
        "extra_args": {
            "kv_transfer_params": {
                "router_hint": {"source_control_endpoint": "10.0.0.1:32100", "block_hashes": [5, -1, 5]}
            }
        }
    }
    forwarded = kv_hints_from_request(legacy, request_id="req-3")
    assert forwarded == {
        "protocol_version": "0.1",
        "message_id": "req-3",
        "actions": [
            {
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {"source_control_endpoint": "tcp://10.0.0.1:32100", "block_hashes": [5, (1 << 64) - 1]},
            }
        ],
    }
    assert parse_hint(forwarded).usable


def test_the_top_level_hint_wins_and_fields_sglang_requires_are_filled_in():
    partial = {
        "protocol_version": "0.1",
        "actions": [
            {"action_type": "kv.fetch", "action_version": "1.0", "payload": ENVELOPE["actions"][0]["payload"]},
            {"action_type": "other.thing", "action_version": "2.0", "payload": "not a map"},  # SGLang would refuse
            "junk",
        ],
    }
    request = {"request_id": "rid-1", "kv_hint": partial, "extra_args": {"kv_transfer_params": {"kv_hint": None}}}
    forwarded = kv_hints_from_request(request)
    assert forwarded["message_id"] == "rid-1"
    assert forwarded["actions"] == [{"action_id": "a1", **partial["actions"][0]}]


@pytest.mark.parametrize(
    "request_",
    [
        {},
        {"kv_hint": None},
        {"kv_hint": "{not json"},
        {"kv_hint": {"protocol_version": "1.0", "actions": ENVELOPE["actions"]}},
        {"kv_hint": {**ENVELOPE, "actions": [{**ENVELOPE["actions"][0], "payload": {"block_hashes": [1]}}]}},
        {"kv_hint": {**ENVELOPE, "actions": [{**ENVELOPE["actions"][0], "action_version": "2.0"}]}},
        {"kv_hint": {**ENVELOPE, "actions": []}},
        {
            "extra_args": {
                "kv_transfer_params": {"router_hint": {"source_control_endpoint": "0.0.0.0:1", "block_hashes": [1]}}
            }
        },
        {"extra_args": "nope"},
        "not a mapping",
    ],
)
def test_unusable_hints_are_not_forwarded(request_):
    assert kv_hints_from_request(request_) is None
