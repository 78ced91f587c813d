"""A shm source in its own process: ``python -m tests.integration.shm.source_process PIECE COUNT SEED``.

Fills one shared arena with seeded bytes, exposes it, prints one JSON line (description, region id)
and serves until stdin closes.
"""

import ctypes
import json
import sys

import numpy as np

from kvcr.adapters.local import MmapHostMemory
from kvcr.adapters.shm import ShmDataPlane
from kvcr.domain.layout import RegionDescriptor


def main():
    piece, count, seed = (int(a) for a in sys.argv[1:4])
    memory = MmapHostMemory(shared=True)
    arena = memory.allocate(piece * count, "source-arena")
    data = np.random.default_rng(seed).integers(0, 256, piece * count, dtype=np.uint8).tobytes()
    ctypes.memmove(arena.address, data, len(data))
    plane = ShmDataPlane(f"shm-source-{seed}", memory)
    (region,) = plane.register([RegionDescriptor("arena", arena.address, piece, count, piece)], exposed=True)
    print(json.dumps({"description": plane.describe().hex(), "region": region}), flush=True)
    sys.stdin.read()
    plane.close()
    memory.close()


if __name__ == "__main__":
    main()
