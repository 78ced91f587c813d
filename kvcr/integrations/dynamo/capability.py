"""Worker capability (``router_hint_*``); lives in ``kvcr.integrations.shared.capability``.

Shared because kvcr's SGLang plugin publishes it too, on ``python -m dynamo.sglang``
(``kvcr.integrations.shared.dynamo_sglang``), and the SGLang and Dynamo integrations never import
each other.
"""

from kvcr.integrations.shared.capability import (
    ROUTER_HINT,
    ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS,
    ROUTER_HINT_WORKER_TYPE,
    WORKER_TYPES,
    EngineSpecificConfig,
    check_control_endpoints,
    check_worker_type,
    control_endpoints_for,
    hint_capability,
    publish_hint_capability,
)

__all__ = [
    "ROUTER_HINT",
    "ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS",
    "ROUTER_HINT_WORKER_TYPE",
    "WORKER_TYPES",
    "EngineSpecificConfig",
    "check_control_endpoints",
    "check_worker_type",
    "control_endpoints_for",
    "hint_capability",
    "publish_hint_capability",
]
