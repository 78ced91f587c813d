"""The same-host data plane: peers on one host map each other's arenas read-only and memcpy from them.

``ShmDataPlane`` is the plane; ``SameHostFirst`` puts it in front of another plane (NIXL) and picks,
per peer, shm when the peer is on this host and the other plane otherwise (``transport: auto``).
"""

from kvcr.adapters.shm.dataplane import ShmDataPlane
from kvcr.adapters.shm.routed import SameHostFirst, fallback_description

__all__ = ["SameHostFirst", "ShmDataPlane", "fallback_description"]
