"""Which host and namespace this process runs in: what decides whether a peer can share memory with us.

A peer's memfds reach us over an abstract UNIX socket, and abstract sockets live in a network
namespace; the socket's credentials are checked against our uid. So a peer is *same-host* for this
plane when it runs on the same boot of the same kernel, in the same network namespace, as the same
uid. Anything else (another machine, another container's namespace) uses the other data plane.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True, slots=True)
class HostIdentity:
    boot_id: str
    net_namespace: int
    uid: int

    def differs(self, other: HostIdentity) -> str | None:
        """Why ``other`` cannot share memory with us, or None if it can."""
        if other.boot_id != self.boot_id:
            return "it runs on another host (boot id differs)"
        if other.net_namespace != self.net_namespace:
            return "it runs in another network namespace"
        if other.uid != self.uid:
            return f"it runs as uid {other.uid}, not {self.uid}"
        return None


@cache
def this_host() -> HostIdentity:
    """This process's identity (an unreadable boot id gives one no peer can match)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = f"unknown-{os.urandom(8).hex()}"
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = -1
    return HostIdentity(boot_id or f"unknown-{os.urandom(8).hex()}", namespace, os.getuid())
