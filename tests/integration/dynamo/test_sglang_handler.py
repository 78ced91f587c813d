"""kvcr's hint forwarding on Dynamo 1.6.1's own SGLang worker handler (``python -m dynamo.sglang``).

The handler is Dynamo's real ``DecodeWorkerHandler`` (aggregated, token input) with Dynamo's real
``Context``; the engine is SGLang's real ``Engine`` class, whose real ``async_generate`` builds the
real ``GenerateReqInput``; only its tokenizer manager (which would hand the request to SGLang's
scheduler) is replaced by one that normalizes the request as SGLang's does and records it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from dynamo._core import Context
from dynamo.sglang.args import Config, DynamoConfig
from dynamo.sglang.request_handlers import DecodeWorkerHandler
from sglang.srt.entrypoints.engine import Engine

from kvcr.integrations.dynamo.sglang_handler import forward_kv_hints

pytestmark = [pytest.mark.sglang]

ROUTER_HINT = {
    "protocol_version": "0.1",
    "message_id": "sel-1",
    "actions": [
        {
            "action_id": "a1",
            "action_type": "kv.fetch",
            "action_version": "1.0",
            "payload": {"source_control_endpoint": "tcp://10.0.0.1:32100", "block_hashes": [7, 2**64 - 3]},
        }
    ],
}


class RecordingTokenizerManager:
    """Stands where SGLang's tokenizer manager would queue the request for the scheduler."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def generate_request(self, obj: Any, request: Any = None):
        obj.normalize_batch_and_arguments()  # what SGLang does first: kv_hints decoded (or refused) here
        self.requests.append(obj)
        yield {
            "output_ids": [11, 12],
            "meta_info": {
                "id": obj.rid,
                "finish_reason": {"type": "length"},
                "prompt_tokens": len(obj.input_ids),
                "completion_tokens": 2,
                "cached_tokens": 0,
            },
        }


class EngineWithoutScheduler(Engine):
    def __init__(self) -> None:  # no model, no scheduler processes
        self.tokenizer_manager = RecordingTokenizerManager()


def handler() -> tuple[Any, RecordingTokenizerManager]:
    server_args = SimpleNamespace(
        disaggregation_mode="null", enable_trace=False, skip_tokenizer_init=True, enable_return_routed_experts=False
    )
    engine = EngineWithoutScheduler()
    dynamo_args = cast(DynamoConfig, SimpleNamespace(use_sglang_tokenizer=False, enable_rl=False))  # a stand-in
    made = DecodeWorkerHandler(engine, Config(server_args, dynamo_args))
    return made, engine.tokenizer_manager


def serve(made: Any, request: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [out async for out in made.generate(request, Context(request_id))]

    return asyncio.run(run())


def request(**extra: Any) -> dict[str, Any]:
    return {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 2}, "sampling_options": {}, **extra}


def test_stock_dynamo_drops_the_routers_hint():
    made, manager = handler()
    outputs = serve(made, request(kv_hint=ROUTER_HINT), "req-1")
    assert outputs[-1]["token_ids"] == [11, 12]
    assert manager.requests[0].kv_hints is None


def test_with_kvcr_forwarding_sglang_gets_the_hint_as_kv_hints():
    made, manager = handler()
    forward_kv_hints(forward_kv_hints(made))  # idempotent
    outputs = serve(made, request(kv_hint=ROUTER_HINT), "req-2")
    assert outputs[-1]["finish_reason"] == "length"
    hints = manager.requests[0].kv_hints  # SGLang's own decoded envelope
    assert hints.message_id == "sel-1"
    [action] = hints.actions
    assert (action.action_id, action.action_type, action.action_version) == ("a1", "kv.fetch", "1.0")
    assert action.payload == ROUTER_HINT["actions"][0]["payload"]


def test_forwarding_passes_nothing_without_a_usable_hint():
    made, manager = handler()
    forward_kv_hints(made)
    serve(made, request(), "req-3")
    bad = {**ROUTER_HINT, "actions": [{**ROUTER_HINT["actions"][0], "payload": {"block_hashes": [-1]}}]}
    serve(made, request(kv_hint=bad), "req-4")  # SGLang would refuse the whole request for it
    assert [r.kv_hints for r in manager.requests] == [None, None]
