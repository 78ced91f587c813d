"""Finding 3: a READ one byte past a registered region's end, alone and next to another region.

The source registers, from one buffer, region A = [0, 64 KiB) and region B = [64 KiB, 128 KiB)
(adjacent in memory, two registrations), and region C from another buffer. The peer loads the
metadata (full or partial) and asks for byte ranges around the ends.
Run: ``python scripts/probes/probe_bounds.py [--tls tcp]``.
"""

from __future__ import annotations

import argparse
import json

from harness import Worker, workers

KIB = 1024
SIZE = 64 * KIB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tls", default=None)
    args = parser.parse_args()
    env = {"UCX_TLS": args.tls} if args.tls else {}
    source, peer = Worker("source", env=env), Worker("peer", env=env)
    with workers(source, peer):
        base = source.call("alloc", label="buf", size=4 * SIZE, seed=3)["addr"]
        other = source.call("alloc", label="other", size=2 * SIZE, seed=4)["addr"]
        source.call("register", reg="A", label="buf", offset=0, length=SIZE)
        source.call("register", reg="B", label="buf", offset=SIZE, length=SIZE)
        source.call("register", reg="C", label="other", offset=0, length=SIZE)
        source.call("pump", interval=0.002)
        peer.call("alloc", label="dst", size=4 * SIZE)
        peer.call("register", reg="dst", label="dst")
        cases = {
            "A last byte": (base + SIZE - 1, 1),
            "A one byte past": (base + SIZE - 4096 + 1, 4096),
            "A..B across the seam": (base + SIZE - 2048, 4096),
            "B one byte past": (base + 2 * SIZE - 4096 + 1, 4096),
            "C one byte past": (other + SIZE - 4096 + 1, 4096),
            "C whole + 1": (other, SIZE + 1),
            "before A": (base - 1, 2),
        }
        for kind, regs in (("full", None), ("partial A,B", ["A", "B"]), ("partial A", ["A"])):
            name = peer.call("load", md=source.call("md", regs=regs)["md"])["name"]
            for case, (addr, nbytes) in cases.items():
                for mode in ("init", "prep"):
                    posted = peer.call(
                        "xfer",
                        check=False,
                        op="READ",
                        peer=name,
                        local=[["dst", 0, nbytes]],
                        remote=[[addr, nbytes]],
                        mode=mode,
                    )
                    if posted["ok"]:
                        state = peer.call("wait", id=posted["id"])["state"]
                        peer.call("release", id=posted["id"])
                    else:
                        state = "refused: " + posted["error"]
                    print(
                        json.dumps(
                            {"tls": args.tls or "default", "md": kind, "case": case, "mode": mode, "result": state}
                        )
                    )
            peer.call("remove", name=name)


if __name__ == "__main__":
    main()
