"""Hosts and ports as endpoints write them: the one wildcard-host set, one ``host:port`` split, one bracket rule."""

from __future__ import annotations

from typing import NamedTuple

# What binds every interface and so names no host a peer can dial.
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})


class HostPort(NamedTuple):
    """``host:port`` split: the host without brackets, the port as written, whether it was bracketed."""

    host: str
    port: str
    bracketed: bool


def split_host_port(text: str) -> HostPort | None:
    """Split ``host:port`` or ``[v6]:port`` (no scheme); None when there is no port separator.

    Nothing is checked: an unbracketed host keeps any colons but the last (callers refuse them).
    """
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        return HostPort(host, port, True) if sep else None
    host, sep, port = text.rpartition(":")
    return HostPort(host, port, False) if sep else None


def bracketed(host: str) -> str:
    """``host`` as written before ``:port``: an IPv6 address in brackets, once."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
