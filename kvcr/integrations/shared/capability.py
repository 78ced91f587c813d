"""Worker capability: tell Dynamo's router that this worker can serve and receive KV hints.

A worker is hint-capable only when all three runtime-data keys are published through
``ModelRuntimeConfig.set_engine_specific(key, json_text)``; ``router_hint`` goes last, so a
half-published worker never looks capable::

    router_hint_source_control_endpoints  {"<dp rank>": "tcp://host:port", ...}   rank-0 endpoint per DP replica
    router_hint_worker_type               "aggregated" | "prefill" | "decode"
    router_hint                           true

Every endpoint must be dialable by other replicas: ``tcp://`` with a concrete host (no ``*``,
``0.0.0.0`` or ``::``) and a port in 1..65535. Anything else is a ConfigError naming the entry,
raised before anything is published.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from kvcr.domain.endpoints import bracketed
from kvcr.domain.errors import ConfigError
from kvcr.domain.hints import Endpoint
from kvcr.domain.topology import RankLayout

if TYPE_CHECKING:
    from kvcr.integrations.shared.settings import KvcrSettings

ROUTER_HINT = "router_hint"
ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS = "router_hint_source_control_endpoints"
ROUTER_HINT_WORKER_TYPE = "router_hint_worker_type"
WORKER_TYPES = ("aggregated", "prefill", "decode")


class EngineSpecificConfig(Protocol):
    """The part of ``dynamo.llm.ModelRuntimeConfig`` this module uses."""

    def set_engine_specific(self, key: str, value: str) -> None: ...


def check_control_endpoints(control_endpoints: Mapping[int, str]) -> dict[int, str]:
    """Validate a ``{dp_rank: "tcp://host:port"}`` map; returns it with canonical endpoints.

    Raises:
        ConfigError: an empty map, a rank that is not a non-negative int, or an endpoint that is
            not dialable (not tcp://, wildcard host, port 0 or out of range); the message names it.
    """
    if not isinstance(control_endpoints, Mapping) or not control_endpoints:
        raise ConfigError(f"{ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS} needs at least one dp rank -> endpoint entry")
    checked: dict[int, str] = {}
    for rank, text in control_endpoints.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"{ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS}: dp rank {rank!r} is not a non-negative int")
        try:
            checked[rank] = str(Endpoint.parse(text))
        except ValueError as exc:
            raise ConfigError(
                f"{ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS}[{rank}] = {text!r} is not a dialable control endpoint: {exc}"
            ) from exc
    return checked


def check_worker_type(worker_type: str) -> str:
    """Return ``worker_type`` if the router knows it, else raise ConfigError."""
    if worker_type not in WORKER_TYPES:
        raise ConfigError(f"{ROUTER_HINT_WORKER_TYPE} must be one of {', '.join(WORKER_TYPES)}, got {worker_type!r}")
    return worker_type


def hint_capability(control_endpoint: str, worker_type: str = "aggregated") -> dict[str, Any]:
    """The three capability entries of ``EngineConfig.runtime_data``, ``router_hint`` last.

    Dynamo publishes ``runtime_data`` as one record, so the router never sees a partial set.

    Raises:
        ConfigError: the endpoint is not dialable or the worker type unknown.
    """
    endpoints = check_control_endpoints({0: control_endpoint})
    return {
        ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS: {"0": endpoints[0]},
        ROUTER_HINT_WORKER_TYPE: check_worker_type(worker_type),
        ROUTER_HINT: True,
    }


def publish_hint_capability(
    runtime_config: EngineSpecificConfig, control_endpoints: Mapping[int, str], worker_type: str
) -> None:
    """Publish the three capability keys on a ``ModelRuntimeConfig``, ``router_hint`` last.

    Raises:
        ConfigError: a bad endpoint or worker type (nothing is published then).
    """
    endpoints = check_control_endpoints(control_endpoints)
    kind = check_worker_type(worker_type)
    values: list[tuple[str, Any]] = [
        (ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS, {str(rank): endpoints[rank] for rank in sorted(endpoints)}),
        (ROUTER_HINT_WORKER_TYPE, kind),
        (ROUTER_HINT, True),  # last: the worker looks capable only once the rest is in place
    ]
    for key, value in values:
        runtime_config.set_engine_specific(key, json.dumps(value))


def control_endpoints_for(
    settings: KvcrSettings | Mapping[str, Any],
    *,
    dp_size: int = 1,
    tp_size: int = 1,
    attn_cp_size: int = 1,
    dp_start_rank: int = 0,
) -> dict[int, str]:
    """The rank-0 control endpoint of each DP replica, as kvcr's SGLang backend binds them.

    Rank ``r`` of DP replica ``d`` binds ``control_port + d * tp_size * attn_cp_size + r`` (the
    attention TP and CP sizes SGLang gives the storage backend); a hint names rank 0 and every
    target rank dials ``port + r``. Keys are the global DP ranks ``dp_start_rank + d``.

    Args:
        settings: the backend's settings, or the raw ``--hicache-storage-backend-extra-config`` dict.

    Raises:
        ConfigError: the peer service is off (``control_port`` 0), the advertised host is a
            wildcard, or a size is not positive.
    """
    if isinstance(settings, Mapping):
        from kvcr.integrations.shared.settings import parse_settings

        settings = parse_settings(settings)
    for name, value in (("dp_size", dp_size), ("tp_size", tp_size), ("attn_cp_size", attn_cp_size)):
        if value < 1:
            raise ConfigError(f"{name} must be positive, got {value}")
    if dp_start_rank < 0:
        raise ConfigError(f"dp_start_rank must not be negative, got {dp_start_rank}")
    if not settings.control_port:
        raise ConfigError("control_port is 0 (peer service off): there is no control endpoint to advertise")
    host = settings.control_advertise_host or settings.control_host
    ports = {
        dp_start_rank + d: RankLayout(tp_size=tp_size, cp_size=attn_cp_size, dp_rank=d).control_port(
            settings.control_port
        )
        for d in range(dp_size)
    }
    return check_control_endpoints({rank: f"tcp://{bracketed(host)}:{port}" for rank, port in ports.items()})
