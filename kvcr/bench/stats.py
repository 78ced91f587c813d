"""Small timing and table helpers shared by the benchmarks, the demo and the CLI."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per repetition of one measured path."""

    samples: tuple[float, ...]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99(self) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]

    def gbps(self, nbytes: int) -> float:
        """Throughput at the median, in GB/s (1e9 bytes)."""
        return nbytes / self.p50 / 1e9


def timing(samples: Sequence[float]) -> Timing:
    return Timing(tuple(samples))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, numbers right-aligned: for a terminal, not for markdown."""
    cells = [[str(c) for c in header], *[[_cell(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True))

    out = [line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])]
    return "\n".join(text.rstrip() for text in out)


def pool_table(pools: Sequence[Any]) -> str:
    """A runner's pools (``RunnerStats.pools``) as a readable table, page size and DRAM in units."""
    from kvcr.domain.units import format_byte_size

    rows = [
        (
            p.pool,
            format_byte_size(p.page_bytes),
            p.slots,
            p.ready,
            p.filling,
            p.free,
            p.claimed,
            format_byte_size((p.ready + p.filling) * p.page_bytes),
        )
        for p in pools
    ]
    return text_table(("pool", "page", "slots", "ready", "filling", "free", "claimed", "DRAM used"), rows)


def counter_table(counters: Mapping[str, float]) -> str:
    """Non-zero counters of a snapshot (``RunnerStats.counters``), one series per line."""
    rows = [(name, f"{value:g}") for name, value in sorted(counters.items()) if value]
    return text_table(("series", "value"), rows) if rows else "(no counts yet)"


def _cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
