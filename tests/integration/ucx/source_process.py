"""A UCX source in its own process: ``pages`` known pages per component, served until told to quit.

Prints one JSON line with its description; then answers each stdin command with one JSON line:
``guard allow|deny|stall`` (install a read guard that allows, refuses, or blocks for 60 s),
``stats`` (what the server did), ``cpu`` (this process's CPU seconds), ``quit``.
"""

import json
import resource
import sys
import time

import numpy as np

from kvcr.adapters.ucx import UcxDataPlane
from kvcr.domain.layout import RegionDescriptor
from tests.integration.ucx.support import page


def main():
    spec = json.loads(sys.argv[1])
    pages, piece, seed = spec["pages"], spec["piece"], spec["seed"]
    plane = UcxDataPlane("source", backend_params=spec["params"])
    arrays, regions = [], []
    for c in range(spec["components"]):
        array = np.empty(pages * piece, dtype=np.uint8)
        for i in range(pages):
            array[i * piece : (i + 1) * piece] = np.frombuffer(page(seed + c, i, piece), dtype=np.uint8)
        arrays.append(array)
        regions.append(RegionDescriptor(f"arena/{c}", array.ctypes.data, piece, pages, piece))
    ids = plane.register(regions, exposed=True)
    say({"description": plane.describe().hex(), "regions": list(ids)})
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "guard":
            mode = words[1]
            plane.guard_reads(lambda lease, runs, mode=mode: _guard(mode, lease, runs))
            say({"ok": True})
        elif words[0] == "stats":
            server = plane.server
            say({"served": server.served, "refused": server.refused, "sending": server.sends_in_flight})
        elif words[0] == "cpu":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            say({"cpu_s": usage.ru_utime + usage.ru_stime, "wall": time.monotonic()})
        elif words[0] == "quit":
            plane.close()
            say({"ok": True})
            return


def _guard(mode, lease, runs):
    if mode == "stall":
        time.sleep(60)
    return mode == "allow" and lease == 7


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
