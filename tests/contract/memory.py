"""The contract test's shared host memory, for the kinds whose planes look up where a region lives.

``test_dataplane.py``'s autouse fixture pushes the test's memory here; a plane built by a kind asks
``CURRENT[-1]`` (the same memory the test's buffers come from) for a region's memfd.
"""

CURRENT: list = []


class CurrentMemory:
    """``SharesMemory`` over whichever memory the running test allocates from."""

    def backing(self, address, nbytes):
        return CURRENT[-1].backing(address, nbytes)
