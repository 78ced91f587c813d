"""Finding 4c: on CMA, can a READ that is still in progress write anything later?

The source is frozen (SIGSTOP) or simply never progresses (no pump); the target posts many small
batched READs. For every READ not DONE right after its post, the destination is checked (did the
bytes already land?), poisoned, and checked again after the source resumes and both progress.
Run: ``python scripts/probes/probe_cma_stall.py [--mode stop|noprogress] [--reads N]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import time

from harness import Worker, workers

KIB = 1024
PIECE = 64 * KIB
PIECES = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="stop", choices=["stop", "noprogress", "normal"])
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--params", default="")
    args = parser.parse_args()
    params = dict(kv.split("=", 1) for kv in args.params.split(",") if kv)
    size = PIECE * PIECES
    source, target = Worker("source", params=params), Worker("target", params=params)
    out: dict[str, object] = {"mode": args.mode, "reads": args.reads, "params": params}
    with workers(source, target):
        src = source.call("alloc", label="src", size=size, seed=1)["addr"]
        source.call("register", reg="src", label="src")
        src_digest = source.call("digest", label="src")["sha1"]
        if args.mode != "noprogress":
            source.call("pump", interval=0.005)
        target.call("alloc", label="dst", size=size)
        target.call("register", reg="dst", label="dst")
        peer = target.call("load", md=source.call("md", regs=["src"])["md"])["name"]
        # Wire-up needs the source to progress once: do it explicitly in every mode.
        warm = target.call("xfer", op="READ", peer=peer, local=[["dst", 0, 4096]], remote=[[src, 4096]])
        for _ in range(200):
            source.call("progress", n=1)
            if target.call("state", id=warm["id"])["state"] != "PROC":
                break
        out["warm_up"] = target.call("state", id=warm["id"])["state"]
        target.call("release", id=warm["id"])
        if args.mode == "stop":
            source.signal(signal.SIGSTOP)
        stalled: list[dict[str, object]] = []
        slow: list[float] = []
        not_landed = 0
        posts: dict[str, int] = {}
        t_start = time.monotonic()
        pieces = [[i * PIECE, PIECE] for i in range(PIECES)]
        for _ in range(args.reads):
            target.call("fill", label="dst", byte=0)
            posted = target.call(
                "xfer",
                op="READ",
                peer=peer,
                local=[["dst", o, n] for o, n in pieces],
                remote=[[src + o, n] for o, n in pieces],
            )
            posts[posted["status"]] = posts.get(posted["status"], 0) + 1
            state = target.call("state", id=posted["id"])["state"]
            if state == "DONE":
                target.call("release", id=posted["id"])
                continue
            landed = target.call("digest", label="dst")["sha1"] == src_digest
            not_landed += not landed
            done = target.call("wait", id=posted["id"], limit=0.5)
            if done["state"] == "DONE":
                slow.append(round(done["s"], 4))
                target.call("release", id=posted["id"])
                continue
            stalled.append({"id": posted["id"], "state": done["state"], "landed_already": landed})
            target.call("fill", label="dst", byte=0xAB)
            break  # one stalled READ holds the endpoint; examine it
        out["not_done_after_post_and_not_landed"] = not_landed
        out["done_later_s"] = slow[:20]
        out["done_later_n"] = len(slow)
        out["elapsed_s"] = round(time.monotonic() - t_start, 3)
        out["posts"] = posts
        out["stalled"] = stalled
        if args.mode == "stop":
            time.sleep(1.0)
            source.signal(signal.SIGCONT)
        if stalled:
            source.call("progress", seconds=1.0)
            target.call("progress", seconds=1.0)
            out["final_state"] = target.call("state", check=False, id=stalled[0]["id"]).get("state")
            out["late_bytes"] = target.call("count", label="dst", byte=0xAB)["differ"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
