"""The ``auto`` kind of the contract suite: shm in front of NIXL, as ``transport: auto`` builds it.

Two planes in one process are on one host, so reads go over shm; ``live_reads`` is the NIXL kind's
none: two auto planes in one process always pick shm (a read is terminal when it returns); the
fallback's own live reads are the ``nixl`` kind's.
"""

from kvcr.adapters.nixl import NixlDataPlane
from kvcr.adapters.shm import SameHostFirst, ShmDataPlane
from tests.contract.memory import CurrentMemory
from tests.contract.nixl_kind import LOOPBACK


class Kind:
    def make_data_plane(self, name):
        return SameHostFirst(ShmDataPlane(name, CurrentMemory()), NixlDataPlane(name, backend_params=LOOPBACK))


def live_reads(stack, piece, count):
    return []
