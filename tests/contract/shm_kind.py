"""The ``shm`` kind of the contract suite: two shm planes in this process, sharing through their brokers.

A plane in this process maps the other's memfds just as another process would (the grant goes over
the abstract socket, with SCM_RIGHTS). ``live_reads``: none. A shm read copies inside ``read`` and
is terminal when it returns, so no read is ever in flight to cancel, release or disconnect
(``tests/integration/shm`` freezes a source process mid-run to show a frozen source stalls nothing).
"""

from kvcr.adapters.shm import ShmDataPlane
from tests.contract.memory import CurrentMemory


class Kind:
    def make_data_plane(self, name):
        return ShmDataPlane(name, CurrentMemory())


def live_reads(stack, piece, count):
    return []
