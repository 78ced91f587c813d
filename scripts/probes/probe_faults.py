"""Finding 4: a READ into the target while its source is killed, frozen or cut off.

For each fault the target polls the READ up to a deadline (what kvcr's ``operation_timeout_ms``
would be). If it is still in progress then, the target "gives up" with one of the actions below,
poisons the destination, lets the source come back (SIGCONT, link up), progresses its own worker
for a while and counts the bytes that still landed: the late-landing question.

Give-up actions: ``keep`` (hold the handle, do nothing), ``release`` (release the live handle),
``remove`` (remove_remote_agent, handle kept), ``remove+release``, ``destroy`` (drop the agent).

Run: ``python scripts/probes/probe_faults.py --tls default|tcp --fault kill|kill-mid|stop|cut
[--giveup ...] [--size-mib N] [--deadline S] [--stop-s S]``; prints one JSON line per run.
``--fault cut`` puts the two processes into two network namespaces joined by a veth pair that
the probe creates and removes (needs root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time
from typing import Any

from harness import Namespaces, ProbeError, Worker, workers

MIB = 1 << 20
POISON = 0xAB


def run(
    tls: str,
    fault: str,
    giveup: str,
    size: int,
    deadline: float,
    stop_s: float,
    settle_s: float,
    params: dict[str, str],
) -> dict[str, Any]:
    env = {} if tls == "default" else {"UCX_TLS": tls}
    ns = Namespaces() if fault == "cut" else None
    out: dict[str, Any] = {"tls": tls, "fault": fault, "giveup": giveup, "mib": size // MIB, "params": params}
    with ns or contextlib.nullcontext():
        s_kw: dict[str, Any] = {"env": env}
        t_kw: dict[str, Any] = {"env": env}
        if ns is not None:
            s_kw = {"env": {**env, **ns.env("a")}, "prefix": ns.prefix(ns.a)}
            t_kw = {"env": {**env, **ns.env("b")}, "prefix": ns.prefix(ns.b)}
        source = Worker("source", params=params, **s_kw)
        target = Worker("target", params=params, **t_kw)
        with workers(source, target):
            src = source.call("alloc", label="src", size=size, seed=11)["addr"]
            source.call("register", reg="src", label="src")
            source.call("pump", interval=0.005)
            target.call("alloc", label="dst", size=size)
            target.call("register", reg="dst", label="dst")
            peer = target.call("load", md=source.call("md", regs=["src"])["md"])["name"]
            warm = target.call("xfer", op="READ", peer=peer, local=[["dst", 0, 4096]], remote=[[src, 4096]])
            out["warm_up"] = target.call("wait", id=warm["id"], limit=5)["state"]
            target.call("release", id=warm["id"])
            target.call("fill", label="dst", byte=0)
            target.call("pump", interval=0.005)  # kvcr's data plane progresses itself like this

            if fault in ("kill", "stop"):
                source.signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                time.sleep(0.05)
            elif fault == "cut":
                assert ns is not None
                ns.link(up=False)
            t0 = time.monotonic()
            posted = target.call(
                "xfer", check=False, op="READ", peer=peer, local=[["dst", 0, size]], remote=[[src, size]]
            )
            if not posted["ok"]:
                out["post"] = posted["error"]
                out["error_s"] = round(time.monotonic() - t0, 4)
                return out
            out["post"] = posted["status"]
            xid = posted["id"]
            if fault == "kill-mid":
                time.sleep(0.003)
                source.signal(signal.SIGKILL)
            state = posted["status"]
            errors: list[str] = []
            while state == "PROC" and time.monotonic() - t0 < deadline:
                answer = target.call("state", check=False, id=xid)
                state = answer.get("state") or "RAISED"
                if not answer["ok"]:
                    errors.append(answer["error"])
                time.sleep(0.001)
            out["state_at_deadline"] = state
            out["state_s"] = round(time.monotonic() - t0, 4)
            if errors:
                out["state_error"] = errors[0]
            out["nonzero_before_giveup"] = target.call("count", label="dst", byte=0)["differ"]
            held = True
            if state == "PROC":
                if giveup == "release":
                    out["release"] = target.call("release", check=False, id=xid)
                    held = False
                if giveup.startswith("remove"):
                    out["remove"] = target.call("remove", check=False, name=peer)
                    if giveup == "remove+release":
                        out["state_after_remove"] = target.call("state", check=False, id=xid)
                        out["release"] = target.call("release", check=False, id=xid)
                        held = False
                if giveup == "destroy":
                    out["destroy"] = target.call("destroy", check=False)
                    held = False
            else:
                with contextlib.suppress(ProbeError):
                    target.call("release", check=False, id=xid)
                held = False
            target.call("fill", label="dst", byte=POISON)
            # Let the source come back, then progress the target's worker for a while.
            if fault == "stop":
                left = stop_s - (time.monotonic() - t0)
                if left > 0:
                    time.sleep(left)
                source.signal(signal.SIGCONT)
            elif fault == "cut":
                assert ns is not None
                ns.link(up=True)
            if giveup != "destroy":
                target.call("progress", seconds=settle_s, timeout=settle_s + 30)
            else:
                time.sleep(settle_s)
            if held:
                final = target.call("state", check=False, id=xid)
                out["final_state"] = final.get("state", final.get("error"))
                out["final_s"] = round(time.monotonic() - t0, 3)
            out["late_bytes"] = target.call("count", label="dst", byte=POISON)["differ"]
            out["source_alive"] = source.proc.poll() is None
            if not out["source_alive"]:
                out["source_rc"] = source.proc.poll()
                out["source_stderr"] = source.stderr[-6:]
            out["target_alive"] = target.proc.poll() is None
            if giveup not in ("destroy",) and out["source_alive"] and fault in ("stop", "cut"):
                # Can the target read from it again (a fresh load if the peer was removed)?
                with contextlib.suppress(ProbeError):
                    if giveup.startswith("remove"):
                        target.call("load", md=source.call("md", regs=["src"])["md"])
                    again = target.call(
                        "xfer", check=False, op="READ", peer=peer, local=[["dst", 0, 4096]], remote=[[src, 4096]]
                    )
                    if again["ok"]:
                        out["read_again"] = target.call("wait", id=again["id"], limit=10)["state"]
                    else:
                        out["read_again"] = again["error"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tls", default="default")
    parser.add_argument("--fault", required=True, choices=["kill", "kill-mid", "stop", "cut"])
    parser.add_argument("--giveup", default="keep", choices=["keep", "release", "remove", "remove+release", "destroy"])
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--stop-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--params", default="", help="UCX backend parameters, k=v,k=v")
    args = parser.parse_args()
    params = dict(kv.split("=", 1) for kv in args.params.split(",") if kv)
    out = run(args.tls, args.fault, args.giveup, args.size_mib * MIB, args.deadline, args.stop_s, args.settle_s, params)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
