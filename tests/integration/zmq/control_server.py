"""A control server in its own process, for the attack tests (``python -m tests.integration.zmq.control_server``).

It serves ``echo:<payload>`` on 127.0.0.1:<port> (CURVE when a token file is given), prints
``READY <endpoint>`` and then answers one command per stdin line with one JSON line:

- ``stats`` -> ``{"handled": n, "payloads": [hex, ...], "refusals": {...}, "rss_bytes": n}``
- ``quit`` (or end of input) -> closes the channel and exits.

Warnings go to stderr (the tests count them).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

from kvcr.adapters.zmq import ZmqControlChannel


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    token = Path(args.token_file).read_bytes() if args.token_file else None
    lock = threading.Lock()
    payloads: list[bytes] = []

    def handler(payload: bytes) -> bytes:
        with lock:
            payloads.append(payload[:64])
        return b"echo:" + payload

    channel = ZmqControlChannel("127.0.0.1", args.port, token=token)
    channel.serve(handler)
    print(f"READY {channel.endpoint}", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        if line.strip() == "stats":
            with lock:
                seen = [p.hex() for p in payloads]
            stats = {"handled": len(seen), "payloads": seen, "refusals": channel.refusals, "rss_bytes": _rss_bytes()}
            print(json.dumps(stats), flush=True)
    channel.close()


if __name__ == "__main__":
    main()
