"""The data planes kvcr ships, by the name the ``transport`` setting, the CLI and the metrics use."""

from __future__ import annotations

import enum


class Transport(str, enum.Enum):
    """A data plane for peer reads."""

    NIXL = "nixl"  # one-sided READ over NIXL (UCX underneath)
    UCX = "ucx"  # kvcr's own two-sided UCX plane over ucxx
    SHM = "shm"  # same-host peers only: their arenas mapped read-only, reads are memcpy
    AUTO = "auto"  # shm for a peer on this host, NIXL for the others (chosen per peer at connect)
    MOCK = "mock"  # in-process fabric, for tests and the in-process demo


TRANSPORT_NAMES = tuple(t.value for t in Transport)
"""Every name the ``transport`` setting accepts."""

CROSS_PROCESS = (Transport.NIXL.value, Transport.UCX.value, Transport.SHM.value, Transport.AUTO.value)
"""The names that reach another process (what a worker, a demo or a peer benchmark can use)."""

SHARES_MEMORY = (Transport.SHM.value, Transport.AUTO.value)
"""The names whose arenas must live in shared memory (memfds a same-host peer maps)."""
