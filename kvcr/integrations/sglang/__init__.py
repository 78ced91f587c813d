"""SGLang HiCache storage backend (``KvcrHiCacheStorage``) and the hint-forwarding plugin.

Importing this package imports SGLang (the backend subclasses its ``HiCacheStorage``).
"""

from kvcr import compat

compat.ensure_supported("sglang")  # one clear line at start-up, not a failure deep inside SGLang

from kvcr.integrations.sglang.storage import KvcrHiCacheStorage  # noqa: E402

__all__ = ["KvcrHiCacheStorage"]
