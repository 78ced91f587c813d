"""SGLang HiCache storage backend (``KvcrHiCacheStorage``) and the hint-forwarding plugin.

Importing this package imports SGLang (the backend subclasses its ``HiCacheStorage``).
"""

from kvcr.integrations.sglang.storage import KvcrHiCacheStorage

__all__ = ["KvcrHiCacheStorage"]
