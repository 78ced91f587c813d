"""One ``python -m dynamo.sglang``-like process: Dynamo's worker modules, then SGLang's plugin loading.

Imports what ``dynamo.sglang.main`` imports before it builds the engine (``register`` and the LLM
request handlers), then calls SGLang's own ``load_plugins()``, which ``sgl.Engine.__init__`` calls
in that process and which runs kvcr's plugin from its installed entry point. Then it calls Dynamo's
real ``register.get_runtime_config`` the way ``_register_model_with_runtime_config`` does (by the
module global) and constructs Dynamo's real handlers, with stand-ins only for the SGLang engine
(no scheduler here) and for the server arguments (the fields Dynamo and kvcr read). Then it calls
Dynamo's real ``publisher.setup_prometheus_registry`` (what ``--enable-metrics`` runs) over this
process's prometheus_client multiprocess files, which hold one ``sglang:`` and one ``kvcr_`` series
as a scheduler would write them, and renders what each registered ``/metrics`` callback passes. Prints
``RESULT <json>``. Run with ``python -m tests.integration.dynamo.dynamo_sglang_host_flow [--no-plugin]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import Any, cast

# prometheus_client picks multiprocess mode when it is first imported, as in SGLang with --enable-metrics
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvcr-flow-metrics-")

from kvcr.testing.sglang import prepare_environment

prepare_environment()  # the torchvision stub SGLang's model configs import on a CPU-only machine

import dynamo.sglang.publisher as publisher  # noqa: E402
import dynamo.sglang.register as register  # noqa: E402
from dynamo._core import Context  # noqa: E402
from dynamo.sglang.args import Config, DynamoConfig  # noqa: E402
from dynamo.sglang.request_handlers import DecodeWorkerHandler, PrefillWorkerHandler  # noqa: E402
from sglang.srt.entrypoints.engine import Engine  # noqa: E402

HINT = {
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

KVCR = {
    "backend_name": "kvcr",
    "module_path": "kvcr.integrations.sglang",
    "class_name": "KvcrHiCacheStorage",
    "interface_v1": 1,
    "transport": "nixl",
    "control_host": "0.0.0.0",
    "control_advertise_host": "10.0.0.7",
    "control_port": 32100,
    "enable_remote_hint": True,
}


def server_args(**overrides: Any) -> SimpleNamespace:
    """The ServerArgs fields get_runtime_config, the handlers and kvcr's hook read."""
    fields: dict[str, Any] = {
        "context_length": 4096,
        "disaggregation_mode": "null",
        "skip_tokenizer_init": True,
        "enable_trace": False,
        "enable_return_routed_experts": False,
        "allow_auto_truncate": False,
        "dllm_algorithm": None,
        "reasoning_parser": None,
        "speculative_algorithm": None,
        "page_size": 16,
        "dcp_size": 1,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "attn_dp_size": 1,
        "attn_cp_size": 1,
        "enable_dp_attention": False,
        "nnodes": 1,
        "node_rank": 0,
        "max_running_requests": None,
        "max_prefill_tokens": None,
        "chunked_prefill_size": None,
        "served_model_name": "tiny",
        "model_path": "/models/tiny",
        "enable_lora": False,
        "lora_paths": None,
        "load_format": "auto",
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(KVCR),
        "hicache_ratio": 2.0,
        "hicache_size": 0,
        "disaggregation_bootstrap_port": 8998,
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def dynamo_args() -> DynamoConfig:
    # A stand-in for Dynamo's config: only the fields register and the handlers read.
    stand_in = SimpleNamespace(
        kv_state_endpoint=None,
        enable_multimodal=False,
        frontend_decoding=False,
        dyn_reasoning_parser=None,
        dyn_tool_call_parser=None,
        dyn_default_thinking_mode=None,
        exclude_tools_when_tool_choice_none=False,
        structural_tag=None,
        enable_local_indexer=False,
        use_kv_events=True,
        use_sglang_tokenizer=False,
        enable_rl=False,
    )
    return cast(DynamoConfig, stand_in)


class RecordingTokenizerManager:
    """Stands where SGLang's tokenizer manager would queue the request for the scheduler."""

    context_len = 4096
    num_reserved_tokens = 0
    validate_total_tokens = False

    def __init__(self) -> None:
        self.kv_hints: list[Any] = []

    async def generate_request(self, obj: Any, request: Any = None):
        obj.normalize_batch_and_arguments()  # SGLang decodes (or refuses) kv_hints here
        hints = obj.kv_hints
        self.kv_hints.append(None if hints is None else {"message_id": hints.message_id, "n": len(hints.actions)})
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
    """SGLang's real Engine class (its real async_generate) without model or scheduler processes."""

    def __init__(self) -> None:
        self.tokenizer_manager = RecordingTokenizerManager()
        self._scheduler_init_result = SimpleNamespace(scheduler_infos=[{"max_total_num_tokens": 4096}])


def capability(args: SimpleNamespace) -> dict[str, Any]:
    config = asyncio.run(register.get_runtime_config(EngineWithoutScheduler(), args, dynamo_args()))
    assert config is not None
    return {k: json.loads(v) for k, v in config.runtime_data.items() if k.startswith("router_hint")}


def served_hints(args: SimpleNamespace) -> list[Any]:
    engine = EngineWithoutScheduler()
    handler = DecodeWorkerHandler(engine, Config(args, dynamo_args()))
    request = {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 2}, "sampling_options": {}, "kv_hint": HINT}

    async def run() -> None:
        async for _ in handler.generate(request, Context("req-1")):
            pass

    asyncio.run(run())
    return engine.tokenizer_manager.kv_hints


class RecordingEndpoint:
    """Stands for Dynamo's generate endpoint: keeps the /metrics callbacks the worker registers."""

    def __init__(self) -> None:
        self.expfmt: list[Any] = []
        self.metrics = SimpleNamespace(
            register_prometheus_expfmt_callback=self.expfmt.append,
            register_prometheus_typed_callback=lambda callback: None,
        )

    def connection_id(self) -> int:
        return 0xABC


def worker_metrics(args: SimpleNamespace) -> list[str]:
    """The text each /metrics callback passes after Dynamo's setup_prometheus_registry."""
    from prometheus_client import Counter

    Counter("sglang:prompt_tokens", "as SGLang's scheduler writes it").inc(3)
    Counter("kvcr_pages_total", "as kvcr's backend writes it", ["path", "outcome"]).labels("backup", "ok").inc(5)
    endpoint = RecordingEndpoint()
    engine = SimpleNamespace(server_args=args)
    names = SimpleNamespace(namespace="ns", component="backend", endpoint="generate")
    config = cast(Config, SimpleNamespace(dynamo_args=names))
    publisher.setup_prometheus_registry(cast(Any, engine), cast(Any, endpoint), config)
    return [callback() for callback in endpoint.expfmt]


def main() -> None:
    if "--no-plugin" not in sys.argv:
        from sglang.srt.plugins import load_plugins

        load_plugins()  # what sgl.Engine.__init__ does first, in Dynamo's worker process
    off = {**KVCR, "enable_remote_hint": False}
    prefill = PrefillWorkerHandler.__init__
    result = {
        "hooked": getattr(register.get_runtime_config, "_kvcr_hint_hook", False),
        "prefill_hooked": getattr(prefill, "_kvcr_hint_hook", False),
        "capability": capability(server_args()),
        "capability_dp_attention": capability(
            server_args(tp_size=4, dp_size=2, enable_dp_attention=True, disaggregation_mode="prefill")
        ),
        "capability_hints_off": capability(server_args(hicache_storage_backend_extra_config=json.dumps(off))),
        "capability_other_backend": capability(
            server_args(hicache_storage_backend="file", hicache_storage_backend_extra_config=None)
        ),
        "capability_no_hicache": capability(server_args(enable_hierarchical_cache=False)),
        "served": served_hints(server_args()),
        "served_hints_off": served_hints(server_args(hicache_storage_backend_extra_config=json.dumps(off))),
        "metrics_hooked": getattr(publisher.setup_prometheus_registry, "_kvcr_hint_hook", False),
        "metrics": worker_metrics(server_args(hicache_storage_backend_extra_config=json.dumps(off))),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
