"""Finding 4d: a connected source frozen for a long time, on CMA: do READs keep working?

The target reads 32 x 64 KiB every ``--period-s`` while the source is stopped for ``--stop-s``
seconds (past UCX's 20 s keep-alive interval), then resumed. Reports, per READ that did not end
DONE within ``--limit-s``: when it was posted, whether its bytes had landed, how it ended.
Run: ``python scripts/probes/probe_frozen_cma.py [--stop-s 45] [--tls tcp]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import time

from harness import Worker, workers

KIB = 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-s", type=float, default=45.0)
    parser.add_argument("--period-s", type=float, default=0.1)
    parser.add_argument("--limit-s", type=float, default=0.2)
    parser.add_argument("--tls", default="default")
    args = parser.parse_args()
    env = {} if args.tls == "default" else {"UCX_TLS": args.tls}
    source, target = Worker("source", env=env), Worker("target", env=env)
    out: dict[str, object] = {"tls": args.tls, "stop_s": args.stop_s}
    with workers(source, target):
        size = 32 * 64 * KIB
        src = source.call("alloc", label="src", size=size, seed=1)["addr"]
        digest = source.call("digest", label="src")["sha1"]
        source.call("register", reg="src", label="src")
        source.call("pump", interval=0.005)
        target.call("alloc", label="dst", size=size)
        target.call("register", reg="dst", label="dst")
        target.call("pump", interval=0.005)
        peer = target.call("load", md=source.call("md", regs=["src"])["md"])["name"]
        pieces = [[i * 64 * KIB, 64 * KIB] for i in range(32)]
        local, remote = [["dst", o, n] for o, n in pieces], [[src + o, n] for o, n in pieces]
        warm = target.call("xfer", op="READ", peer=peer, local=local, remote=remote)
        target.call("wait", id=warm["id"])
        target.call("release", id=warm["id"])
        source.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        done, odd = 0, []
        while time.monotonic() - t0 < args.stop_s:
            target.call("fill", label="dst", byte=0)
            at = round(time.monotonic() - t0, 2)
            posted = target.call("xfer", check=False, op="READ", peer=peer, local=local, remote=remote)
            if not posted["ok"]:
                odd.append({"at": at, "post": posted["error"]})
                break
            ended = target.call("wait", check=False, id=posted["id"], limit=args.limit_s)
            if ended.get("state") == "DONE":
                done += 1
                target.call("release", id=posted["id"])
            else:
                landed = target.call("digest", label="dst")["sha1"] == digest
                odd.append({"at": at, "state": ended.get("state", ended.get("error")), "landed": landed})
                break  # a stalled READ holds the endpoint: see how it ends after the resume
            time.sleep(args.period_s)
        out["done_while_frozen"] = done
        out["stalled"] = odd
        source.signal(signal.SIGCONT)
        if odd and "state" in odd[-1]:
            later = target.call("wait", check=False, id=posted["id"], limit=10)
            out["after_resume"] = later.get("state", later.get("error"))
            out["after_resume_s"] = round(later.get("s", -1), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
