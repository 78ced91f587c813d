"""Hosts on one machine: network namespaces joined by veth pairs (root only).

:class:`TwoHosts` creates two namespaces and the pair with addresses of its own inside them
(nothing leaves them), can cut the link (``ip link set ... down``) and always removes both.
:class:`Hosts` puts any number of namespaces on one switch: a bridge in a namespace of its own,
one veth pair from each host to it, every address in one /24 that exists nowhere else.
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


def _address(ns: str, dev: str, cidr: str) -> None:
    """Give ``dev`` in ``ns`` its address and bring it and the namespace's loopback up."""
    _ip("-n", ns, "addr", "add", cidr, "dev", dev)
    _ip("-n", ns, "link", "set", dev, "up")
    _ip("-n", ns, "link", "set", "lo", "up")


def _not_created(exc: OSError | subprocess.SubprocessError) -> OSError:
    detail = getattr(exc, "stderr", "") or exc
    return OSError(f"cannot create network namespaces (root and iproute2 needed): {detail}")


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
                _address(ns, dev, f"{addr}/30")
        except (OSError, subprocess.SubprocessError) as exc:
            self.remove()
            raise _not_created(exc) from None
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


class Hosts:
    """``count`` namespaces (``names[i]``, device ``devs[i]``, address ``addrs[i]``) on one bridge.

    The bridge lives in namespace ``hub`` (nothing else does), so the hosts reach each other and
    nothing outside; the machine's own namespace is untouched.

    Raises:
        OSError: ``ip`` is missing or refused (not root); nothing is left behind.
    """

    def __init__(self, count: int, tag: str = "", subnet: str = "10.232.0") -> None:
        if not 2 <= count <= 16:
            raise ValueError(f"count must be in [2, 16], got {count}")
        tag = tag or f"kh{os.getpid() % 100000}"
        self.hub = f"{tag}hub"
        self.names = [f"{tag}n{i}" for i in range(count)]
        self.devs = [f"{tag}v{i}" for i in range(count)]
        self._ports = [f"{tag}p{i}" for i in range(count)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(count)]

    def __enter__(self) -> Hosts:
        self.remove()
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for ns, dev, port, addr in zip(self.names, self.devs, self._ports, self.addrs, strict=True):
                _ip("netns", "add", ns)
                _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", port, "master", "br0")
                _ip("-n", self.hub, "link", "set", port, "up")
                _address(ns, dev, f"{addr}/24")
        except (OSError, subprocess.SubprocessError) as exc:
            self.remove()
            raise _not_created(exc) from None
        return self

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def remove(self) -> None:
        for ns in (*self.names, self.hub):  # a namespace's end of each pair goes with it, and so the pair
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
