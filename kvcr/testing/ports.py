"""Free loopback ports from the kernel (never fixed ports: they collide with ephemeral ones)."""

from __future__ import annotations

import contextlib
import socket


def free_port_block(count: int = 1) -> int:
    """The first of ``count`` consecutive loopback TCP ports that nothing listens on right now.

    Fixed ports collide with the ephemeral ports the kernel hands to outgoing connections (UCX and
    ZMQ open many), so tests, demos and benchmarks ask the kernel instead.
    """
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first + 1, first + count):
                    held = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    held.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no block of {count} free loopback ports found")
