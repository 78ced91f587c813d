"""``forward_kv_hints`` for Dynamo's SGLang handlers; lives in ``kvcr.integrations.shared.sglang_handler``.

kvcr's SGLang plugin installs it on every handler ``python -m dynamo.sglang`` constructs
(``kvcr.integrations.shared.dynamo_sglang``); calling it by hand is still supported and idempotent.
"""

from kvcr.integrations.shared.sglang_handler import forward_kv_hints

__all__ = ["forward_kv_hints"]
