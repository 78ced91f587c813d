"""A request's router hint as SGLang's ``kv_hints``; lives in ``kvcr.integrations.shared.forwarding``."""

from kvcr.integrations.shared.forwarding import PROTOCOL_VERSION, kv_hints_from_request

__all__ = ["PROTOCOL_VERSION", "kv_hints_from_request"]
