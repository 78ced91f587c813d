"""Finding 5: what needs the source to progress, and what each progress scheme costs idle.

Schemes for the source (and target) agent: ``none`` (nobody progresses between calls),
``pump:<s>`` (a Python thread calling get_new_notifs every s seconds), ``thread:<us>`` (NIXL's
own progress thread with pthrDelay=us: it sleeps in poll() on the UCX worker's event fd and wakes
on traffic or after the delay). For each: the wire-up READ's latency (a fresh peer, source idle),
idle CPU of both processes over ``--idle-s`` seconds (connected, no traffic, keep-alive on),
then periodic READs (one every ``--period-s``) over ``--busy-s`` seconds: their latency
distribution, to see keep-alive stalls. Run: ``python scripts/probes/probe_idle.py --scheme
pump:0.005 [--tls tcp] [--idle-s 20]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from harness import Worker, cpu_seconds, workers

KIB = 1024


def start(name: str, scheme: str, env: dict[str, str]) -> Worker:
    kind, _, value = scheme.partition(":")
    if kind == "thread":
        return Worker(name, env=env, prog_thread=True, pthr_delay_us=int(value))
    worker = Worker(name, env=env)
    if kind == "pump":
        worker.call("pump", interval=float(value))
    return worker


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheme", required=True)
    parser.add_argument("--tls", default="default")
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--busy-s", type=float, default=20.0)
    parser.add_argument("--period-s", type=float, default=0.05)
    args = parser.parse_args()
    env = {} if args.tls == "default" else {"UCX_TLS": args.tls}
    source, target = start("source", args.scheme, env), start("target", args.scheme, env)
    out: dict[str, Any] = {"scheme": args.scheme, "tls": args.tls}
    with workers(source, target):
        size = 32 * 64 * KIB
        src = source.call("alloc", label="src", size=size, seed=1)["addr"]
        source.call("register", reg="src", label="src")
        target.call("alloc", label="dst", size=size)
        target.call("register", reg="dst", label="dst")
        peer = target.call("load", md=source.call("md", regs=["src"])["md"])["name"]
        t0 = time.monotonic()
        warm = target.call("xfer", op="READ", peer=peer, local=[["dst", 0, 4096]], remote=[[src, 4096]])
        state = target.call("wait", id=warm["id"], limit=5)["state"]
        out["wire_up"] = {"state": state, "s": round(time.monotonic() - t0, 4)}
        target.call("release", id=warm["id"])
        c_src, c_tgt = cpu_seconds(source.pid), cpu_seconds(target.pid)
        time.sleep(args.idle_s)
        out["idle_cpu_pct"] = {
            "source": round(100 * (cpu_seconds(source.pid) - c_src) / args.idle_s, 3),
            "target": round(100 * (cpu_seconds(target.pid) - c_tgt) / args.idle_s, 3),
        }
        pieces = [[i * 64 * KIB, 64 * KIB] for i in range(32)]
        latencies: list[float] = []
        states: dict[str, int] = {}
        t_end = time.monotonic() + args.busy_s
        while time.monotonic() < t_end:
            t1 = time.monotonic()
            posted = target.call(
                "xfer",
                op="READ",
                peer=peer,
                local=[["dst", o, n] for o, n in pieces],
                remote=[[src + o, n] for o, n in pieces],
            )
            done = target.call("wait", id=posted["id"], limit=10, sleep=0.0001)
            latencies.append(time.monotonic() - t1)
            states[done["state"]] = states.get(done["state"], 0) + 1
            target.call("release", id=posted["id"])
            time.sleep(args.period_s)
        out["reads"] = {
            "n": len(latencies),
            "states": states,
            "p50_ms": round(1e3 * percentile(latencies, 0.5), 3),
            "p99_ms": round(1e3 * percentile(latencies, 0.99), 3),
            "max_ms": round(1e3 * max(latencies), 3),
            "over_10ms": sum(1 for v in latencies if v > 0.01),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
