"""Finding 4b: can a *target* going away take its source down? (UCX software-emulated RMA.)

Over ``UCX_TLS=tcp`` a READ is a GET request the source's worker answers. This probe leaves a
READ pending at the source (frozen with SIGSTOP, or just busy), makes the target go away in one
of several ways, resumes the source and checks that it is still alive a few seconds later.

Run: ``python scripts/probes/probe_source_crash.py --how kill|destroy|remove+release [--running]
[--tls tcp] [--params k=v,...]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import time

from harness import Worker, workers

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tls", default="tcp")
    parser.add_argument("--how", required=True, choices=["kill", "destroy", "remove+release"])
    parser.add_argument("--running", action="store_true", help="do not freeze the source")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--params", default="")
    args = parser.parse_args()
    env = {} if args.tls == "default" else {"UCX_TLS": args.tls}
    params = dict(kv.split("=", 1) for kv in args.params.split(",") if kv)
    size = args.size_mib * MIB
    source, target = Worker("source", env=env, params=params), Worker("target", env=env, params=params)
    out: dict[str, object] = {"tls": args.tls, "how": args.how, "running": args.running, "params": params}
    with workers(source, target):
        src = source.call("alloc", label="src", size=size, seed=1)["addr"]
        source.call("register", reg="src", label="src")
        source.call("pump", interval=0.005)
        target.call("alloc", label="dst", size=size)
        target.call("register", reg="dst", label="dst")
        peer = target.call("load", md=source.call("md", regs=["src"])["md"])["name"]
        warm = target.call("xfer", op="READ", peer=peer, local=[["dst", 0, 4096]], remote=[[src, 4096]])
        target.call("wait", id=warm["id"])
        target.call("release", id=warm["id"])
        if not args.running:
            source.signal(signal.SIGSTOP)
            time.sleep(0.05)
        posted = target.call("xfer", op="READ", peer=peer, local=[["dst", 0, size]], remote=[[src, size]])
        out["post"] = posted["status"]
        time.sleep(0.005)
        out["state"] = target.call("state", check=False, id=posted["id"]).get("state")
        if args.how == "kill":
            target.signal(signal.SIGKILL)
        elif args.how == "destroy":
            target.call("destroy")
        else:
            target.call("remove", name=peer)
            target.call("release", id=posted["id"])
            target.call("progress", seconds=0.5)
        if not args.running:
            time.sleep(1.0)
            source.signal(signal.SIGCONT)
        time.sleep(3.0)
        out["source_alive"] = source.proc.poll() is None
        out["source_rc"] = source.proc.poll()
        out["source_stderr"] = [line for line in source.stderr if "atal" in line or "rror" in line][-2:]
        if out["source_alive"]:
            out["source_answers"] = source.call("digest", label="src", length=16, check=False)["ok"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
