"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


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
