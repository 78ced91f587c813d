"""Two hosts on one machine: two network namespaces joined by a veth pair (root only).

:class:`TwoHosts` creates the namespaces and the pair with addresses of its own inside them
(nothing leaves them), can cut the link (``ip link set ... down``) and always removes both.
:func:`enter_netns` moves a fresh, single-threaded process into one of them, as ``ip netns exec``
does. Namespace names carry the creating process's id, so parallel runs do not collide.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from types import TracebackType

_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Namespaces ``a`` and ``b``; ``a`` holds ``dev_a`` with ``addr_a``, ``b`` holds ``dev_b`` with ``addr_b``.

    Raises:
        OSError: ``ip`` is missing or refused (not root); nothing is left behind.
    """

    def __init__(self, tag: str = "", subnet: str = "10.231.0") -> None:
        tag = tag or f"kv{os.getpid() % 100000}"
        self.a, self.b = f"{tag}a", f"{tag}b"
        self.dev_a, self.dev_b = f"{tag}va", f"{tag}vb"
        self.addr_a, self.addr_b = f"{subnet}.1", f"{subnet}.2"

    def __enter__(self) -> TwoHosts:
        self.remove()
        try:
            _ip("netns", "add", self.a)
            _ip("netns", "add", self.b)
            _ip("link", "add", self.dev_a, "netns", self.a, "type", "veth", "peer", "name", self.dev_b, "netns", self.b)
            for ns, dev, addr in ((self.a, self.dev_a, self.addr_a), (self.b, self.dev_b, self.addr_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (OSError, subprocess.SubprocessError) as exc:
            self.remove()
            detail = getattr(exc, "stderr", "") or exc
            raise OSError(f"cannot create network namespaces (root and iproute2 needed): {detail}") from None
        return self

    def link(self, up: bool) -> None:
        """Bring the link up or cut it (``a``'s end: nothing crosses either way while it is down)."""
        _ip("-n", self.a, "link", "set", self.dev_a, "up" if up else "down")

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def remove(self) -> None:
        for ns in (self.a, self.b):  # deleting a namespace deletes its end of the pair, and so the pair
            _ip("netns", "del", ns, check=False)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.remove()


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace ``name``, as ``ip netns exec`` does.

    It also gets its own mount namespace with a fresh /sys, so what UCX reads about network
    devices there is this namespace's. Do not create or delete namespaces from such a process:
    its mount changes do not reach the rest of the machine.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare the mount namespace")
    libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None)
    libc.umount2(b"/sys", _MNT_DETACH)
    if libc.mount(name.encode(), b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mount sysfs")
