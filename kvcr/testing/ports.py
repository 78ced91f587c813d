"""Free loopback ports for tests, demos and benchmarks, chosen where nothing else will take them.

A port the kernel hands out with ``bind(("127.0.0.1", 0))`` comes from its ephemeral range, and once
the probe closes it the kernel may hand the same port to any outgoing connection (UCX, ZMQ and
Dynamo's runtime open many) before the child process that was meant to listen on it starts. The
collision is rare, but a CI run spawns hundreds of listeners, so it happens. Ports are drawn instead
from outside the ephemeral range (the kernel never picks those for a connection), checked free by a
bind, and never handed out twice by one process.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from pathlib import Path

_LOWEST = 10000  # below this live the well-known and registered services operators run
_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)

_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def ephemeral_range(path: Path = _EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), Linux's default where it cannot be read."""
    try:
        first, last = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return first, last


def _candidate_starts(count: int, below: int) -> list[range]:
    first, last = ephemeral_range()
    spans = [range(_LOWEST, min(first, below) - count + 1), range(last + 1, min(65536, below) - count + 1)]
    return [span for span in spans if len(span) > 0]


def _bindable(ports: range) -> bool:
    try:
        with contextlib.ExitStack() as stack:
            for port in ports:
                probe = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                probe.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def free_port_block(count: int = 1, *, below: int = 65536) -> int:
    """The first of ``count`` consecutive free loopback TCP ports, all below ``below``.

    Outside the kernel's ephemeral range where there is room, so no outgoing connection takes one
    between this call and the listener's bind; from the kernel otherwise.
    """
    spans = _candidate_starts(count, below)
    with _lock:
        for _ in range(400 if spans else 0):
            span = _rng.choice(spans)
            start = _rng.choice(span)
            block = range(start, start + count)
            if _handed_out.isdisjoint(block) and _bindable(block):
                _handed_out.update(block)
                return start
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind(("127.0.0.1", 0))
                start = int(probe.getsockname()[1])
            block = range(start, start + count)
            if start + count <= min(65536, below) and _handed_out.isdisjoint(block) and _bindable(block):
                _handed_out.update(block)
                return start
    raise RuntimeError(f"no block of {count} free loopback ports below {below} found")
