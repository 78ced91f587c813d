"""kvcr's router hints on ``python -m dynamo.sglang``, installed by kvcr's SGLang plugin.

Dynamo 1.6.1's SGLang worker runs SGLang's engine in its own process, and ``sgl.Engine.__init__``
calls SGLang's ``load_plugins()`` there (``sglang/srt/entrypoints/engine.py``), so kvcr's plugin
``load()`` runs in the Dynamo worker before it registers or serves anything. When that process is
a ``dynamo.sglang`` host (the package is already imported: nothing here imports Dynamo into a
process that did not), :func:`install` adds two things in memory, never on disk:

- around ``dynamo.sglang.register.get_runtime_config(engine, server_args, dynamo_args)`` (looked
  up as a module global by ``_register_model_with_runtime_config`` when the worker registers):
  when the engine's HiCache L3 is kvcr with ``enable_remote_hint``, the returned
  ``ModelRuntimeConfig`` also carries the hint capability (``capability.publish_hint_capability``:
  the rank-0 control endpoint of every DP rank the worker registers, its role from
  ``--disaggregation-mode``, ``router_hint`` last). Nothing is added when kvcr is not the backend,
  hints are off, there is no engine (multimodal encode workers), or the config already says
  ``router_hint`` (a Dynamo that publishes it itself). A kvcr config that asks for hints but
  cannot advertise a dialable endpoint raises ``ConfigError`` at registration, like the rest of
  kvcr's start-up checks: the alternative is a worker the router silently never hints.
- after ``__init__`` of ``DecodeWorkerHandler`` and ``PrefillWorkerHandler`` (the handlers the
  LLM paths construct): ``sglang_handler.forward_kv_hints(handler)`` when the same condition
  holds for the handler's ``config.server_args``, so the router's ``kv_hint`` reaches SGLang as
  ``async_generate(kv_hints=...)``. The class is patched, not the name, so Dynamo's modules that
  imported the class before the engine was built construct the patched one.
- around ``dynamo.sglang.publisher.setup_prometheus_registry(engine, generate_endpoint, config)``
  (called by ``setup_sgl_metrics`` when the worker runs with ``--enable-metrics``): Dynamo's
  callback passes only ``sglang:`` series from SGLang's multiprocess files to the worker's
  ``/metrics`` (``DYN_SYSTEM_PORT``), and kvcr's series live in those same files, written by the
  scheduler processes. When kvcr is the engine's L3 (hints or not), one more callback on the same
  endpoint and registry passes the ``kvcr_`` series, with the labels Dynamo adds to SGLang's.

Each hook first checks that what it wraps exists with the signature it expects; if not it logs
one line and leaves that part of Dynamo as it is. Calling :func:`install` twice does nothing more.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import sys
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvcr.integrations.shared.capability import ROUTER_HINT, control_endpoints_for, publish_hint_capability
from kvcr.integrations.shared.settings import KvcrSettings, parse_settings
from kvcr.integrations.shared.sglang_handler import forward_kv_hints

log = logging.getLogger(__name__)

HOST_PACKAGE = "dynamo.sglang"
REGISTER = "dynamo.sglang.register"
PUBLISHER = "dynamo.sglang.publisher"
PROMETHEUS = "dynamo.common.utils.prometheus"
METRIC_PREFIX = "kvcr_"
HANDLERS = (
    ("dynamo.sglang.request_handlers.llm.decode_handler", "DecodeWorkerHandler"),
    ("dynamo.sglang.request_handlers.llm.prefill_handler", "PrefillWorkerHandler"),
)
KVCR_MODULE = "kvcr.integrations.sglang"
_INSTALLED = "_kvcr_hint_hook"
_ROLES = {None: "aggregated", "null": "aggregated", "prefill": "prefill", "decode": "decode"}


def is_host() -> bool:
    """Whether this process is a ``python -m dynamo.sglang`` worker (its package is imported)."""
    return HOST_PACKAGE in sys.modules


def install() -> list[str]:
    """Install the hooks when this process is a ``dynamo.sglang`` host; returns what was hooked."""
    if not is_host():
        return []
    hooked: list[str] = []
    try:
        register = importlib.import_module(REGISTER)
    except Exception as exc:  # a Dynamo without this module: leave it alone
        log.warning("kvcr: %s does not import (%s); the worker publishes no hint capability", REGISTER, exc)
    else:
        if _hook_runtime_config(register):
            hooked.append(f"{REGISTER}.get_runtime_config")
    try:
        publisher = importlib.import_module(PUBLISHER)
    except Exception as exc:
        log.warning("kvcr: %s does not import (%s); kvcr's series stay off the worker's /metrics", PUBLISHER, exc)
    else:
        if _hook_metrics_registry(publisher):
            hooked.append(f"{PUBLISHER}.setup_prometheus_registry")
    for module_name, class_name in HANDLERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name, None)
        except Exception as exc:
            log.warning("kvcr: %s does not import (%s); its requests carry no kv_hints", module_name, exc)
            continue
        if _hook_handler(cls, f"{module_name}.{class_name}"):
            hooked.append(f"{module_name}.{class_name}")
    if hooked:
        log.info(
            "kvcr: dynamo.sglang host: hint capability, kv_hints forwarding and metrics hooked on %s", ", ".join(hooked)
        )
    return hooked


# ---------------------------------------------------------------------- what kvcr is configured as


def kvcr_settings(server_args: Any) -> KvcrSettings | None:
    """kvcr's settings when the engine's HiCache L3 is kvcr, else None.

    kvcr is the backend when ``--hicache-storage-backend dynamic`` names kvcr's module (or
    ``backend_name`` ``kvcr``), or the backend itself is called ``kvcr`` (a SGLang that registers
    the name). Raises ConfigError for a kvcr extra-config kvcr would refuse.
    """
    if server_args is None or not getattr(server_args, "enable_hierarchical_cache", False):
        return None
    backend = getattr(server_args, "hicache_storage_backend", None)
    extra = extra_config(getattr(server_args, "hicache_storage_backend_extra_config", None))
    if backend == "dynamic":
        module = str(extra.get("module_path") or "")
        if not (module == KVCR_MODULE or module.startswith(KVCR_MODULE + ".") or extra.get("backend_name") == "kvcr"):
            return None
    elif backend != "kvcr":
        return None
    return parse_settings(extra)


def hint_settings(server_args: Any) -> KvcrSettings | None:
    """kvcr's settings when the engine's HiCache L3 is kvcr with ``enable_remote_hint``, else None."""
    settings = kvcr_settings(server_args)
    return settings if settings is not None and settings.enable_remote_hint else None


def extra_config(raw: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` as a dict: a dict, JSON text or ``@file`` (json/toml/yaml)."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if not isinstance(raw, str) or not raw.strip():
        return {}
    text = raw.strip()
    if text.startswith("@"):
        path = Path(text[1:])
        if path.suffix.lower() == ".toml":
            parsed: Any = tomllib.loads(path.read_text(encoding="utf-8"))
        elif path.suffix.lower() in (".yaml", ".yml"):
            import yaml  # type: ignore[import-untyped]

            parsed = yaml.safe_load(path.read_text(encoding="utf-8"))
        else:
            parsed = json.loads(path.read_text(encoding="utf-8"))
    else:
        parsed = json.loads(text)
    return dict(parsed) if isinstance(parsed, Mapping) else {}


def worker_role(server_args: Any) -> str | None:
    """The router's worker type for ``--disaggregation-mode``, or None for a mode it has no name for."""
    return _ROLES.get(getattr(server_args, "disaggregation_mode", None))


def attention_layout(server_args: Any) -> tuple[int, int]:
    """(attention TP size, attention CP size): the ranks behind one DP rank, as kvcr binds their ports."""
    tp_size = _positive(getattr(server_args, "tp_size", 1))
    groups = _positive(getattr(server_args, "attn_dp_size", 1))
    if groups == 1 and getattr(server_args, "enable_dp_attention", False):
        groups = _positive(getattr(server_args, "dp_size", 1))
    return max(1, tp_size // groups), _positive(getattr(server_args, "attn_cp_size", 1))


def publish_for_engine(runtime_config: Any, server_args: Any) -> bool:
    """Publish kvcr's hint capability on ``runtime_config`` when kvcr serves hints; True if it did."""
    settings = hint_settings(server_args)
    if settings is None:
        return False
    if ROUTER_HINT in (getattr(runtime_config, "runtime_data", None) or {}):
        log.info("kvcr: the worker already publishes router_hint; kvcr adds nothing")
        return False
    role = worker_role(server_args)
    if role is None:
        log.warning(
            "kvcr: --disaggregation-mode %r has no router worker type; no hint capability published",
            getattr(server_args, "disaggregation_mode", None),
        )
        return False
    tp_size, cp_size = attention_layout(server_args)
    dp_size = _positive(getattr(runtime_config, "data_parallel_size", None) or 1)
    start = int(getattr(runtime_config, "data_parallel_start_rank", None) or 0)
    endpoints = control_endpoints_for(
        settings, dp_size=dp_size, tp_size=tp_size, attn_cp_size=cp_size, dp_start_rank=start
    )
    publish_hint_capability(runtime_config, endpoints, role)
    log.info("kvcr: published the router hint capability (%s, control endpoints %s)", role, endpoints)
    return True


# ---------------------------------------------------------------------- the hooks


def _hook_runtime_config(register: Any) -> bool:
    original = getattr(register, "get_runtime_config", None)
    if getattr(original, _INSTALLED, False):
        return True
    if not (inspect.iscoroutinefunction(original) and _leading_params(original, "engine", "server_args")):
        log.warning(
            "kvcr: %s.get_runtime_config is not the async (engine, server_args, ...) it expects; "
            "the worker publishes no hint capability",
            REGISTER,
        )
        return False

    @functools.wraps(original)
    async def get_runtime_config(engine: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
        runtime_config = await original(engine, server_args, *args, **kwargs)
        if runtime_config is not None and engine is not None:
            publish_for_engine(runtime_config, server_args)
        return runtime_config

    setattr(get_runtime_config, _INSTALLED, True)
    register.get_runtime_config = get_runtime_config
    return True


def _hook_metrics_registry(publisher: Any) -> bool:
    original = getattr(publisher, "setup_prometheus_registry", None)
    if getattr(original, _INSTALLED, False):
        return True
    if original is None or not _leading_params(original, "engine", "generate_endpoint", "config"):
        log.warning(
            "kvcr: %s.setup_prometheus_registry is not the (engine, generate_endpoint, config) it expects; "
            "kvcr's series stay off the worker's /metrics",
            PUBLISHER,
        )
        return False

    @functools.wraps(original)
    def setup_prometheus_registry(engine: Any, generate_endpoint: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        registry = original(engine, generate_endpoint, config, *args, **kwargs)
        if registry is not None and kvcr_settings(getattr(engine, "server_args", None)) is not None:
            expose_kvcr_series(registry, generate_endpoint, config, engine.server_args)
        return registry

    setattr(setup_prometheus_registry, _INSTALLED, True)
    publisher.setup_prometheus_registry = setup_prometheus_registry
    return True


def expose_kvcr_series(registry: Any, endpoint: Any, config: Any, server_args: Any) -> None:
    """Pass the registry's ``kvcr_`` series to the worker's ``/metrics``, labelled like SGLang's."""
    try:
        register = importlib.import_module(PROMETHEUS).register_engine_metrics_callback
    except (ImportError, AttributeError) as exc:
        log.warning("kvcr: %s has no register_engine_metrics_callback (%s); kvcr's series stay off", PROMETHEUS, exc)
        return
    dynamo_args = getattr(config, "dynamo_args", None)
    register(
        endpoint=endpoint,
        registry=registry,
        metric_prefix_filters=[METRIC_PREFIX],
        namespace_name=getattr(dynamo_args, "namespace", None),
        component_name=getattr(dynamo_args, "component", None),
        endpoint_name=getattr(dynamo_args, "endpoint", None),
        model_name=getattr(server_args, "served_model_name", None),
    )
    log.info("kvcr: kvcr's series are on the worker's /metrics")


def _hook_handler(cls: Any, name: str) -> bool:
    init = getattr(cls, "__init__", None) if isinstance(cls, type) else None
    if getattr(init, _INSTALLED, False):
        return True
    if init is None or not callable(getattr(cls, "generate", None)) or not _leading_params(init, "self", "engine"):
        log.warning("kvcr: %s is not the handler class it expects; its requests carry no kv_hints", name)
        return False

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _forward_if_kvcr(self, name)  # idempotent: a hooked subclass calling this __init__ gets it once

    setattr(__init__, _INSTALLED, True)
    cls.__init__ = __init__
    return True


def _forward_if_kvcr(handler: Any, name: str) -> None:
    server_args = getattr(getattr(handler, "config", None), "server_args", None)
    if hint_settings(server_args) is None:
        return
    if getattr(handler, "engine", None) is None or not callable(getattr(handler.engine, "async_generate", None)):
        log.warning("kvcr: %s has no engine.async_generate; its requests carry no kv_hints", name)
        return
    forward_kv_hints(handler)


def _leading_params(function: Callable[..., Any], *names: str) -> bool:
    try:
        params = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return params[: len(names)] == list(names)


def _positive(value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return 1
    return number if number > 0 else 1
