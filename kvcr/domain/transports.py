"""The data planes kvcr ships, by the name the ``transport`` setting, the CLI and the metrics use."""

from __future__ import annotations

import enum


class Transport(str, enum.Enum):
    """A data plane for peer reads."""

    NIXL = "nixl"  # one-sided READ over NIXL (UCX underneath)
    UCX = "ucx"  # kvcr's own two-sided UCX plane over ucxx
    MOCK = "mock"  # in-process fabric, for tests and the in-process demo


TRANSPORT_NAMES = tuple(t.value for t in Transport)
"""Every name the ``transport`` setting accepts."""

CROSS_PROCESS = (Transport.NIXL.value, Transport.UCX.value)
"""The names that reach another process (what a worker, a demo or a peer benchmark can use)."""
