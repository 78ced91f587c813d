"""The kvcr Dynamo worker: ``python -m kvcr.demo.dynamo.worker`` (also ``kvcr worker``).

Built on Dynamo's own Python backend API (``dynamo.common.backend``): Dynamo's Rust ``Worker``
registers the model, serves the ``generate`` endpoint on the tcp request plane and relays KV
events; this module is the engine behind it (see ``worker_model`` for what is real and what
stands in for the model). Per worker:

- KV events: kvcr's backend publishes its DRAM residency on a ZMQ PUB (``kv_events_endpoint``);
  the engine declares it as a ``ZmqSource`` and Dynamo relays it onto its event plane, where the
  frontend's KV router indexes it;
- hint capability: the three ``router_hint*`` keys go into ``EngineConfig.runtime_data`` (raw
  values; Dynamo serializes them), naming kvcr's control endpoint for DP rank 0;
- per request: ``request["kv_hint"]`` (put there by the router) becomes SGLang's ``kv_hints``
  envelope (``forwarding``) and is handed to SGLang's storage path with the request;
- engine control ``clear_kvcr`` (``POST /engine/control/clear_kvcr`` on the worker's system port)
  empties kvcr's DRAM through SGLang's own call;
- ``--report FILE``: one JSON line when ready and one per request (what was restored, from where,
  verified or not), which the demo and the end-to-end tests read.

Generation is a fixed token stream; the final chunk's usage reports the restored prompt tokens
as ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from dynamo._core import Context
from dynamo.common.backend import EngineConfig, GenerateChunk, GenerateRequest, LLMEngine, LlmRegistration
from dynamo.common.backend.publisher import KvEventSource, ZmqSource
from dynamo.common.backend.worker import WorkerConfig

from kvcr.demo.dynamo.worker_settings import WorkerSettings, parse_worker_args
from kvcr.domain.errors import ConfigError
from kvcr.integrations.dynamo.capability import hint_capability
from kvcr.integrations.dynamo.forwarding import kv_hints_from_request

log = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv-events"
FIRST_OUTPUT_TOKEN = 3  # the fixed stream cycles through ids 3.. (past bos/eos/unk of a small vocabulary)
CLEAR_CONTROL = "clear_kvcr"


class _Report:
    """JSON lines, appended and flushed one at a time (several workers may share one file)."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (closed in close)
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class KvcrWorker(LLMEngine):
    """Dynamo engine over SGLang's host pool and controller with kvcr as L3 (see the module doc)."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id: int | None = None
        self._model: Any = None
        self._report = _Report(settings.report)
        self._metrics_server: Any = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[KvcrWorker, WorkerConfig]:
        settings = parse_worker_args(argv)
        config = WorkerConfig(
            namespace=settings.namespace,
            component=settings.component,
            endpoint=settings.endpoint,
            model_name=settings.model,
            served_model_name=settings.model,
            discovery_backend=settings.discovery_backend,
            request_plane="tcp",
            event_plane=settings.event_plane,
        )
        return cls(settings), config

    async def start(self, worker_id: int) -> EngineConfig:
        from kvcr.demo.dynamo.worker_model import StandInModel, prepare_sglang

        s = self.settings
        capability = hint_capability(s.control_endpoint) if s.hint_capability else None
        prepare_sglang()
        self._model = await asyncio.to_thread(StandInModel, s)
        if s.metrics_port is not None:
            from kvcr.container import serve_engine_metrics

            self._metrics_server = serve_engine_metrics(s.metrics_port)
            log.info("kvcr worker %s: metrics on %s", s.name, self._metrics_server.url)
        self.worker_id = worker_id
        self._report.write(
            {
                "event": "ready",
                "worker": s.name,
                "worker_id": worker_id,
                "control_endpoint": s.control_endpoint,
                "hint_capability": s.hint_capability,
                "page_tokens": s.page_tokens,
                "page_bytes": self._model.page_bytes,
                "metrics_url": self._metrics_server.url if self._metrics_server is not None else None,
            }
        )
        log.info("kvcr worker %s ready: kvcr at %s, hint capability %s", s.name, s.control_endpoint, s.hint_capability)
        return EngineConfig(
            model=s.model,
            served_model_name=s.model,
            runtime_data=capability,
            llm=LlmRegistration(
                context_length=self._model.max_pages * s.page_tokens,
                kv_cache_block_size=s.page_tokens,
                total_kv_blocks=s.host_pages,
                max_num_seqs=64,
                max_num_batched_tokens=self._model.max_pages * s.page_tokens,
            ),
        )

    async def kv_event_sources(self) -> list[KvEventSource]:
        return [ZmqSource(endpoint=self.settings.kv_events_endpoint, topic=KV_EVENTS_TOPIC, dp_rank=0)]

    async def generate(self, request: GenerateRequest, context: Context) -> AsyncGenerator[GenerateChunk, None]:
        s = self.settings
        request_id = str(context.id())
        token_ids: Sequence[int] = request.get("token_ids") or []
        # Dynamo passes keys beyond GenerateRequest's through; the router puts its hint here.
        raw_hint = request.get("kv_hint")
        kv_hints = kv_hints_from_request(request, request_id=request_id)
        if s.queue_delay_s:
            await asyncio.sleep(s.queue_delay_s)
        served = await asyncio.to_thread(self._model.serve, request_id, token_ids, kv_hints)
        self._report.write(
            {
                "event": "request",
                "time": time.time(),
                "worker": s.name,
                "worker_id": self.worker_id,
                "request_id": request_id,
                "prompt_tokens": len(token_ids),
                "hint": raw_hint is not None,
                "hint_bytes": len(json.dumps(raw_hint, separators=(",", ":"))) if raw_hint is not None else 0,
                "hint_source": _hint_source(kv_hints),
                "hint_pages": _hint_pages(kv_hints),
                "pages": served.pages,
                "local_pages": served.local_pages,
                "peer_pages": served.peer_pages,
                "computed_pages": served.computed_pages,
                "backed_up_pages": served.backed_up_pages,
                "restore_s": served.restore_s,
                "restored_bytes": served.restored_bytes,
                "verified": served.verified,
                "mismatched_pages": served.mismatched_pages,
            }
        )
        if served.mismatched_pages:
            log.error("kvcr worker %s: %d restored pages differ from their prefix", s.name, served.mismatched_pages)
        stop = request.get("stop_conditions") or {}
        count = int(stop.get("max_tokens") or s.max_tokens)
        for i in range(count):
            if context.is_stopped():
                break
            if s.token_delay_s:
                await asyncio.sleep(s.token_delay_s)
            chunk: GenerateChunk = {"token_ids": [FIRST_OUTPUT_TOKEN + i % 64], "index": 0}
            if i == count - 1:
                chunk["finish_reason"] = "length"
                chunk["completion_usage"] = {
                    "prompt_tokens": len(token_ids),
                    "completion_tokens": count,
                    "total_tokens": len(token_ids) + count,
                    "prompt_tokens_details": {"cached_tokens": served.restored_pages * s.page_tokens},
                }
            yield chunk

    def supported_controls(self) -> set[str]:
        return {CLEAR_CONTROL}

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        if control != CLEAR_CONTROL or self._model is None:
            return {"status": "error", "message": f"unsupported engine control: {control}"}
        cleared = await asyncio.to_thread(self._model.clear)
        return {"status": "ok" if cleared else "error", "cleared": cleared}

    async def cleanup(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.close()
        model, self._model = self._model, None
        if model is not None:
            await asyncio.to_thread(model.close)
        self._report.close()


def _hint_payload(kv_hints: Mapping[str, Any] | None) -> Mapping[str, Any]:
    for action in (kv_hints or {}).get("actions") or ():
        if action.get("action_type") == "kv.fetch" and isinstance(action.get("payload"), Mapping):
            payload: Mapping[str, Any] = action["payload"]
            return payload
    return {}


def _hint_source(kv_hints: Mapping[str, Any] | None) -> str | None:
    source = _hint_payload(kv_hints).get("source_control_endpoint")
    return source if isinstance(source, str) else None


def _hint_pages(kv_hints: Mapping[str, Any] | None) -> int:
    hashes = _hint_payload(kv_hints).get("block_hashes")
    return len(hashes) if isinstance(hashes, list) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker until Dynamo's runtime shuts it down (SIGTERM / SIGINT)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        parse_worker_args(args)  # bad options: one line, before Dynamo starts anything
    except ConfigError as exc:
        print(f"kvcr worker: {exc}", file=sys.stderr)
        return 2
    from dynamo.common.backend.run import run

    run(KvcrWorker, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
