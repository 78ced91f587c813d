"""The ``ucx`` kind of the contract suite: real ucxx workers.

``make_data_plane``: two planes in this one process talk over UCX as two processes would (their
own UCX contexts and workers; each serves reads on its own progress thread). UCX's tcp interfaces
stay on loopback.

``live_reads``: a read really in flight needs a source that does not answer, so the source is
another process (``tests.integration.ucx.source_process``) frozen with SIGSTOP. Both error modes
are live flavours: ``none`` (on one host the target pulls large pieces by CMA: no late writes) and
``peer`` (tcp only, the source pushes: late writes).
"""

import os
import signal

import numpy as np

from kvcr.adapters.ucx import UcxDataPlane
from kvcr.domain.layout import RegionDescriptor
from kvcr.testing.processes import wait_until_stopped
from tests.integration.ucx.support import LOOPBACK, PEER, SourceProcess, page

SEED = 11
LIVE_REPLY_TIMEOUT_S = 30.0  # a frozen source must look stalled, not answer-less, while a test runs


class Kind:
    def __init__(self):
        self.made = []

    def make_data_plane(self, name):
        plane = UcxDataPlane(name, backend_params=LOOPBACK)
        self.made.append(plane)
        return plane

    def close_all(self):
        for plane in self.made:
            plane.close()


class LiveRead:
    """The UCX flavour of the suite's live read (see ``tests/contract/test_dataplane.py``)."""

    def __init__(self, stack, piece, count, mode, params):
        self.flavour = f"ucx {mode}, frozen source"
        self.source = SourceProcess(pages=count, piece=piece, seed=SEED, params=params)
        stack.callback(self.source.close)
        self.target = UcxDataPlane(
            f"live-target-{mode}-{os.getpid()}", backend_params=params, reply_timeout_s=LIVE_REPLY_TIMEOUT_S
        )
        stack.callback(self.target.close)
        self.dst = np.zeros(piece * count, dtype=np.uint8)
        (self.dst_id,) = self.target.register(
            [RegionDescriptor("dst", self.dst.ctypes.data, piece, count, piece)], exposed=False
        )
        self.peer = self.target.connect(self.source.description, 10.0)
        self.src_id = self.source.regions[0]
        self.expected = np.frombuffer(b"".join(page(SEED, i, piece) for i in range(count)), dtype=np.uint8)
        stack.callback(self.resume)  # never leave it frozen, whatever the test did

    def stall(self):
        os.kill(self.source.pid, signal.SIGSTOP)
        wait_until_stopped(self.source.pid)  # a request sent before every thread stopped could be served

    def resume(self):
        if self.source.proc.poll() is None:
            os.kill(self.source.pid, signal.SIGCONT)


def live_reads(stack, piece, count):
    return [LiveRead(stack, piece, count, "none", LOOPBACK), LiveRead(stack, piece, count, "peer", PEER)]
