"""Finding 2: can peers be given read-only access? A memfd arena mapped twice.

kvcr would write through a read-write mapping and register (and describe to peers) a second,
PROT_READ mapping of the same pages. Checks: a peer READ of the read-only view returns what was
written through the other mapping; a peer WRITE into it fails cleanly, or takes the source down.
Run: ``python scripts/probes/probe_readonly.py [--tls tcp]``.
"""

from __future__ import annotations

import argparse
import json
import time

from harness import Worker, workers

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tls", default=None)
    args = parser.parse_args()
    env = {"UCX_TLS": args.tls} if args.tls else {}
    source, peer = Worker("source", env=env), Worker("peer", env=env)
    with workers(source, peer):
        mapped = source.call("alloc", label="arena", size=MIB, seed=5, mode="memfd")
        ro = source.call("register", reg="arena", label="arena", view="ro")
        assert ro["addr"] == mapped["ro_addr"] != mapped["addr"]
        source.call("pump", interval=0.002)
        peer.call("alloc", label="dst", size=MIB)
        peer.call("register", reg="dst", label="dst")
        name = peer.call("load", md=source.call("md", regs=["arena"])["md"])["name"]
        out: dict[str, object] = {"tls": args.tls or "default", "register_ro": True}
        posted = peer.call("xfer", op="READ", peer=name, local=[["dst", 0, MIB]], remote=[[ro["addr"], MIB]])
        out["read"] = peer.call("wait", id=posted["id"])["state"]
        peer.call("release", id=posted["id"])
        out["read_equal"] = peer.call("digest", label="dst")["sha1"] == source.call("digest", label="arena")["sha1"]
        source.call("fill", label="arena", byte=0x5A, length=4096)  # through the read-write mapping
        posted = peer.call("xfer", op="READ", peer=name, local=[["dst", 0, 4096]], remote=[[ro["addr"], 4096]])
        peer.call("wait", id=posted["id"])
        peer.call("release", id=posted["id"])
        out["sees_rw_writes"] = peer.call("count", label="dst", byte=0x5A, length=4096)["differ"] == 0
        before = source.call("digest", label="arena")["sha1"]
        peer.call("fill", label="dst", byte=0xEE)
        t0 = time.monotonic()
        posted = peer.call(
            "xfer", check=False, op="WRITE", peer=name, local=[["dst", 0, 4096]], remote=[[ro["addr"], 4096]]
        )
        if posted["ok"]:
            out["write_post"] = posted["status"]
            done = peer.call("wait", check=False, id=posted["id"], limit=10)
            out["write"] = done.get("state", done.get("error"))
            out["write_error_s"] = round(time.monotonic() - t0, 4)
            peer.call("release", id=posted["id"], check=False)
        else:
            out["write"] = posted["error"]
        time.sleep(0.5)
        out["source_alive"] = source.proc.poll() is None
        out["source_rc"] = source.proc.poll()
        if out["source_alive"]:
            out["source_changed"] = source.call("digest", label="arena")["sha1"] != before
        out["source_stderr_tail"] = [line for line in source.stderr if "rror" in line or "egmentation" in line][-3:]
        if out["source_alive"]:  # is the peer's connection still usable after the refused write?
            posted = peer.call(
                "xfer", check=False, op="READ", peer=name, local=[["dst", 0, 4096]], remote=[[ro["addr"], 4096]]
            )
            out["read_after"] = posted.get("status", posted.get("error"))
        print(json.dumps(out))


if __name__ == "__main__":
    main()
