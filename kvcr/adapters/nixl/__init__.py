"""DataPlane over NIXL (one-sided READ; UCX picks CMA, shm or RDMA).

``described_peer`` reads a peer's description for a bare NIXL agent (the benchmarks' raw baseline),
so nothing outside this package decodes its wire format. Importing this package does not import
nixl: the agent is built in ``NixlDataPlane.__init__``.
"""

from kvcr.adapters.nixl.dataplane import NixlDataPlane
from kvcr.adapters.nixl.probe import ZeroCopyReport, check_zero_copy
from kvcr.adapters.nixl.wire import DescribedPeer, described_peer

__all__ = ["DescribedPeer", "NixlDataPlane", "ZeroCopyReport", "check_zero_copy", "described_peer"]
