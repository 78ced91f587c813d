"""Control round trip benchmark: a LEASE-sized request/reply over loopback, plaintext vs CURVE.

    python -m kvcr.bench.zmq_adapter [--requests 5000] [--request-bytes 200] [--reply-bytes 2048]

The server is a ``ZmqControlChannel`` in another process (so the two sides do not share a GIL)
answering every request with ``reply-bytes`` bytes; there are two, one plaintext and one keyed
with a cluster token. This process asks both, interleaved in rounds so drift hits both alike:

* ``raw``        a bare pyzmq DEALER against the plaintext server (the floor: no channel code here);
* ``plaintext``  ``ZmqControlChannel.request`` without a token;
* ``curve``      ``ZmqControlChannel.request`` with the token (CURVE on every frame);
* ``... cold``   ``forget`` then ``request``: a new TCP connection and handshake each time (what a
                 peer link costs after its idle close).

Ratios are against ``plaintext`` of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_TOKEN = b"bench-cluster-token-0123456789ab"


def _serve(port: int, token_file: str | None, reply_bytes: int) -> None:
    from kvcr.adapters.zmq.control import ZmqControlChannel

    token = Path(token_file).read_bytes() if token_file else None
    reply = bytes(reply_bytes)
    channel = ZmqControlChannel("127.0.0.1", port, token=token)
    channel.serve(lambda payload: reply)
    print(f"READY {channel.endpoint}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    channel.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start_server(token_file: str | None, reply_bytes: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvcr.bench.zmq_adapter", "--serve", str(_free_port())]
    cmd += ["--reply-bytes", str(reply_bytes)]
    if token_file:
        cmd += ["--token-file", token_file]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"benchmark server did not start (got {line!r})")
    return proc, line.split()[1]


def _percentiles(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_us": cuts[49] * 1e6, "p99_us": cuts[98] * 1e6, "mean_us": statistics.fmean(samples) * 1e6}


def run(requests: int, request_bytes: int, reply_bytes: int, rounds: int = 5, cold: int = 200) -> dict[str, Any]:
    import zmq

    from kvcr.adapters.zmq.control import ZmqControlChannel

    payload = os.urandom(request_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "wb") as f:
            f.write(_TOKEN)
        os.chmod(token_file, 0o600)
        plain_proc, plain_ep = _start_server(None, reply_bytes)
        curve_proc, curve_ep = _start_server(token_file, reply_bytes)
    plain = ZmqControlChannel("127.0.0.1", _free_port())
    curve = ZmqControlChannel("127.0.0.1", _free_port(), token=_TOKEN)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(plain_ep)
    counter = iter(range(1, 1 << 62))

    def raw_request() -> bytes:
        rid = next(counter).to_bytes(8, "big")
        raw.send_multipart([rid, payload])
        frames: list[bytes] = raw.recv_multipart()
        return frames[2]

    cases: dict[str, Callable[[], bytes]] = {
        "raw": raw_request,
        "plaintext": lambda: plain.request(plain_ep, payload, 5.0),
        "curve": lambda: curve.request(curve_ep, payload, 5.0),
    }
    cold_cases: dict[str, tuple[ZmqControlChannel, str]] = {
        "plaintext cold": (plain, plain_ep),
        "curve cold": (curve, curve_ep),
    }
    samples: dict[str, list[float]] = {name: [] for name in [*cases, *cold_cases]}
    try:
        for call in cases.values():  # warm-up: connections up, caches warm
            for _ in range(200):
                assert len(call()) == reply_bytes
        per_round, cold_per_round = max(1, requests // rounds), max(1, cold // rounds)
        for _ in range(rounds):
            for name, call in cases.items():
                out = samples[name]
                for _ in range(per_round):
                    began = time.perf_counter()
                    call()
                    out.append(time.perf_counter() - began)
            for name, (channel, endpoint) in cold_cases.items():
                out = samples[name]
                for _ in range(cold_per_round):
                    channel.forget(endpoint)
                    began = time.perf_counter()
                    channel.request(endpoint, payload, 5.0)
                    out.append(time.perf_counter() - began)
    finally:
        raw.close()
        ctx.term()
        plain.close()
        curve.close()
        for proc in (plain_proc, curve_proc):
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
            proc.wait(10)
    results = {name: _percentiles(values) | {"n": len(values)} for name, values in samples.items()}
    base = results["plaintext"]["p50_us"]
    for result in results.values():
        result["p50_vs_plaintext"] = result["p50_us"] / base
    return {"request_bytes": request_bytes, "reply_bytes": reply_bytes, "results": results}


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"control round trip, {report['request_bytes']} B request / {report['reply_bytes']} B reply, loopback",
        "| case | n | p50 µs | p99 µs | mean µs | p50 vs plaintext |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['n']} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['mean_us']:.0f} | "
            f"{r['p50_vs_plaintext']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcr.bench.zmq_adapter", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="timed requests per warm case")
    parser.add_argument("--cold", type=int, default=200, help="timed requests per cold (new connection) case")
    parser.add_argument("--request-bytes", type=int, default=200)
    parser.add_argument("--reply-bytes", type=int, default=2048)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--token-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve, args.token_file, args.reply_bytes)
        return
    if min(args.requests, args.cold) < 5 or min(args.request_bytes, args.reply_bytes) < 1:
        parser.error("--requests and --cold need at least 5, the sizes at least 1 byte")
    report = run(args.requests, args.request_bytes, args.reply_bytes, cold=args.cold)
    print(json.dumps(report, indent=2) if args.json else _table(report))


if __name__ == "__main__":
    main()
