"""The ``nixl`` kind of the contract suite: real NIXL agents, two of them in this one process.

Two agents in one process read each other over UCX as two processes would (CMA on this host):
each has its own UCX worker, and each data plane's progress pump answers the other's wire-up.
UCX's sockets stay on loopback.
"""

from kvcr.adapters.nixl import NixlDataPlane

LOOPBACK = {"ucx_devices": "lo"}


class Kind:
    def __init__(self):
        self.made = []

    def make_data_plane(self, name):
        plane = NixlDataPlane(name, backend_params=LOOPBACK)
        self.made.append(plane)
        return plane

    def close_all(self):
        for plane in self.made:
            plane.close()
