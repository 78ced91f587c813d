"""The ``ucx`` kind of the contract suite: real ucxx workers, two of them in this one process.

Two data planes in one process talk over UCX as two processes would (their own UCX contexts and
workers; each serves reads on its own progress thread). UCX's tcp interfaces stay on loopback.
"""

from kvcr.adapters.ucx import UcxDataPlane

LOOPBACK = {"ucx_devices": "lo"}


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
