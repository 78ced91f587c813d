"""What this host has: memory the kernel can hand out now (for sizing checks before any allocation)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` (what new allocations can get without swapping), or None where unknown.

    kvcr's arenas are touched page by page as backups fill them, so an arena larger than this
    starts, then fails (or the OOM killer ends the engine) under load: checks refuse it up front.
    """
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == "MemAvailable":
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
