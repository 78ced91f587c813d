"""The target of the kill storm: several UCX data planes in this one process, their sources killed mid-read.

``python -m tests.integration.ucx.kill_storm SPEC``; SPEC is JSON: ``rounds``, ``pages``, ``piece``,
``before`` (the modes of the planes made first), ``other_ucx`` (then make a NIXL agent, whose own
UCX build hooks memory events after ucxx's did, as in a pytest run or a worker that loads NIXL
later) and ``after`` (the modes of the planes made after it). A plane that refuses to be made
(peer mode without a registration cache) is recorded. Each round gives every plane a fresh source
process in its mode, posts one read of every page (reversed, one message per page), SIGKILLs each
source once the read's first byte landed, and waits for every read to end. Prints one JSON line
(outcomes, planes, refusals) and exits 0; a read that does not end within its bound raises, and a
crash ends the process with the signal, which is what the test looks for.
"""

import json
import os
import signal
import sys
import threading
import time

from kvcr.adapters.ucx import UcxDataPlane
from kvcr.domain.layout import PieceRun
from kvcr.ports.errors import TransportError
from tests.integration.buffers import Pool, wait
from tests.integration.ucx.support import LOOPBACK, PEER, SourceProcess

MODES = {"peer": PEER, "none": LOOPBACK}
FIRST_BYTE_S = 20.0
OUTCOME_S = 10.0


def main():
    spec = json.loads(sys.argv[1])
    pages, piece = spec["pages"], spec["piece"]
    planes, refused, kept = [], [], []
    order = [*spec["before"], *(["nixl"] if spec["other_ucx"] else []), *spec["after"]]
    nixl = None
    for i, mode in enumerate(order):
        if mode == "nixl":
            from kvcr.adapters.nixl import NixlDataPlane

            nixl = NixlDataPlane(f"storm-nixl-{os.getpid()}")
            continue
        try:
            plane = UcxDataPlane(f"storm-{i}-{mode}", backend_params=MODES[mode], reply_timeout_s=1.0)
        except TransportError as exc:
            refused.append({"mode": mode, "after_other_ucx": nixl is not None, "error": str(exc)})
            continue
        dst = Pool(f"dst-{i}", pages, piece)
        kept.append(dst)
        (dst_id,) = plane.register([dst.region], exposed=False)
        planes.append((plane, mode, dst, dst_id, nixl is not None))
    outcomes = {}
    started = time.monotonic()
    for _ in range(spec["rounds"]):
        sources = _start_sources([mode for _, mode, _, _, _ in planes], pages, piece)
        reads = []
        for (plane, _, dst, dst_id, _), source in zip(planes, sources, strict=True):
            dst.array[:] = 0
            plane.connect(source.description, 10.0)
            runs = [PieceRun(source.regions[0], k, dst_id, pages - 1 - k, 1) for k in range(pages)]
            reads.append(plane.read("source", runs))
        for (plane, _, dst, _, _), source, handle in zip(planes, sources, reads, strict=True):
            _until_first_byte(plane, handle, dst, pages - 1)
            os.kill(source.pid, signal.SIGKILL)
        for (plane, mode, _, _, _), source, handle in zip(planes, sources, reads, strict=True):
            state = wait(plane, handle, timeout_s=OUTCOME_S)  # raises if the read never ends
            plane.release(handle)
            plane.disconnect("source")
            outcomes.setdefault(mode, {}).setdefault(state.value, 0)
            outcomes[mode][state.value] += 1
            source.kill()
    for plane, *_ in planes:
        plane.close()
    if nixl is not None:
        nixl.close()
    report = {
        "kills": spec["rounds"] * len(planes),
        "seconds": round(time.monotonic() - started, 1),
        "outcomes": outcomes,
        "planes": [
            {"name": p.name, "mode": m, "registration_cache": p.registration_cache, "after_other_ucx": after}
            for p, m, _, _, after in planes
        ],
        "refused": refused,
    }
    print(json.dumps(report), flush=True)


def _start_sources(modes, pages, piece):
    """One source process per mode, started side by side (each takes a second or two to come up)."""
    made = [None] * len(modes)
    errors = []

    def start(i, mode):
        try:
            made[i] = SourceProcess(pages=pages, piece=piece, seed=i, params=MODES[mode])
        except Exception as exc:  # reported below, with every source reaped
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i, m)) for i, m in enumerate(modes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    if errors or any(s is None for s in made):
        for source in made:
            if source is not None:
                source.kill()
        raise RuntimeError(f"a source process did not start: {errors}")
    return made


def _until_first_byte(plane, handle, dst, index):
    """Poll until the read's first message landed (or the read ended), within FIRST_BYTE_S."""
    first = index * dst.stride
    deadline = time.monotonic() + FIRST_BYTE_S
    while not dst.array[first] and time.monotonic() < deadline:
        if plane.poll(handle).terminal:
            return
    if not dst.array[first]:
        raise AssertionError(f"no byte landed within {FIRST_BYTE_S} s")


if __name__ == "__main__":
    main()
