"""DataPlane over NIXL (one-sided READ; UCX picks CMA, shm or RDMA).

Importing this package does not import nixl: the agent is built in ``NixlDataPlane.__init__``.
"""

from kvcr.adapters.nixl.dataplane import NixlDataPlane
from kvcr.adapters.nixl.probe import ZeroCopyReport, check_zero_copy

__all__ = ["NixlDataPlane", "ZeroCopyReport", "check_zero_copy"]
