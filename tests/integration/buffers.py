"""Helpers shared by the data-plane tests (NIXL, UCX): pieces in numpy buffers, a bounded wait."""

import time

import numpy as np

from kvcr.domain.layout import RegionDescriptor


class Pool:
    """``count`` pieces of ``piece`` bytes, ``stride`` apart, in one numpy buffer."""

    def __init__(self, label, count, piece, stride=None, seed=None):
        self.stride = stride or piece
        self.piece_bytes = piece
        self.array = np.zeros(self.stride * (count - 1) + piece, dtype=np.uint8)
        if seed is not None:
            self.array[:] = np.random.default_rng(seed).integers(0, 256, self.array.size, dtype=np.uint8)
        self.region = RegionDescriptor(label, self.array.ctypes.data, self.stride, count, piece)

    def piece(self, index):
        start = index * self.stride
        return self.array[start : start + self.piece_bytes].tobytes()

    def untouched(self):
        return not self.array.any()


def wait(plane, handle, timeout_s=10.0):
    """Poll to a terminal state within ``timeout_s``: a burst of polls, then short sleeps."""
    deadline = time.monotonic() + timeout_s
    spins = 0
    while time.monotonic() < deadline:
        state = plane.poll(handle)
        if state.terminal:
            return state
        spins += 1
        if spins > 100:
            time.sleep(0.0005)
    raise AssertionError(f"transfer {handle} still {plane.poll(handle).value} after {timeout_s}s")
