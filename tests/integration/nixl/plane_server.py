"""A NixlDataPlane in its own process, driven by JSON lines on stdin (for the multi-process tests).

    python -m tests.integration.nixl.plane_server <name> [<backend params as JSON>]

Prints ``{"ready": true, "pid": ...}``, then answers every request line with one JSON line
(``{"error": ...}`` when the call raised). Requests: see ``_serve``.
"""

import hashlib
import json
import os
import sys
import time

import numpy as np

from kvcr.adapters.nixl import NixlDataPlane
from kvcr.domain.layout import PieceRun, RegionDescriptor


def _serve(plane, buffers, op, req):
    if op == "region":  # a region of `count` pieces, seeded bytes (or zeros), exposed or private
        count, piece = req["count"], req["piece"]
        data = np.zeros(count * piece, dtype=np.uint8)
        if req.get("seed") is not None:
            data[:] = np.random.default_rng(req["seed"]).integers(0, 256, data.size, dtype=np.uint8)
        buffers[req["label"]] = data
        region = RegionDescriptor(req["label"], data.ctypes.data, piece, count, piece)
        (region_id,) = plane.register([region], exposed=req["exposed"])
        return {"id": region_id, "base": data.ctypes.data, "nbytes": data.nbytes}
    if op == "describe":
        return {"description": plane.describe().hex()}
    if op == "connect":
        info = plane.connect(bytes.fromhex(req["description"]), req.get("timeout", 5.0))
        return {"name": info.name, "late_writes": info.late_writes}
    if op == "read":
        handle = plane.read(req["peer"], [PieceRun(*run) for run in req["runs"]])
        return {"handle": handle, "state": plane.poll(handle).value}
    if op == "wait":
        deadline = time.monotonic() + req.get("timeout", 10.0)
        state = plane.poll(req["handle"])
        while not state.terminal and time.monotonic() < deadline:
            time.sleep(0.001)
            state = plane.poll(req["handle"])
        return {"state": state.value}
    if op in ("poll", "cancel"):
        return {"state": getattr(plane, op)(req["handle"]).value}
    if op == "release":
        plane.release(req["handle"])
        return {}
    if op == "disconnect":
        plane.disconnect(req["peer"])
        return {}
    if op == "digest":
        return {"sha1": hashlib.sha1(buffers[req["label"]].tobytes()).hexdigest()}
    if op == "fill":
        buffers[req["label"]][:] = req["byte"]
        return {}
    if op == "differ":  # bytes of a buffer that are not `byte` (a poison check)
        return {"n": int(np.count_nonzero(buffers[req["label"]] != req["byte"]))}
    raise ValueError(f"unknown op {op!r}")


def main():
    params = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {"ucx_devices": "lo"}
    plane = NixlDataPlane(sys.argv[1], backend_params=params)
    buffers = {}
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            answer = _serve(plane, buffers, req.pop("op"), req)
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    plane.close()


if __name__ == "__main__":
    main()
