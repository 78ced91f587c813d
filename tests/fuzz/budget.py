"""How many cases each fuzz target runs: a short CI budget, or the long variant (``scripts/fuzz.sh --long``).

The profile comes from ``KVCR_FUZZ_PROFILE`` (``ci`` by default, ``long``). Hypothesis settings
are applied per target (``settings(parent=...)``), never loaded globally, so the property tests
elsewhere in the suite keep their own example counts. Every case a target really executes is
counted (:func:`count`); the fuzz conftest prints the counts at the end of the run and writes
them to ``KVCR_FUZZ_REPORT`` when that is set.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings

PROFILES = ("ci", "long")
PROFILE = os.environ.get("KVCR_FUZZ_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise RuntimeError(f"KVCR_FUZZ_PROFILE must be one of {', '.join(PROFILES)}, got {PROFILE!r}")

# Examples per target. The long column adds up to well over 100,000 cases.
_EXAMPLES: dict[str, tuple[int, int]] = {
    "frames.bytes": (150, 20_000),
    "frames.msgpack": (150, 20_000),
    "frames.messages": (200, 25_000),
    "frames.mutated": (150, 15_000),
    "frames.replayed": (60, 5_000),
    "frames.zmq": (40, 3_000),
    "frames.tcp": (10, 300),
    "replies.hostile": (80, 20_000),
    "hints.sglang": (60, 20_000),
    "settings.dicts": (300, 15_000),
    "settings.backend": (40, 2_000),
    "settings.token_files": (60, 3_000),
}
TARGETS = tuple(_EXAMPLES)

_SHARED: dict[str, Any] = {
    "deadline": None,  # several jobs share two cores: wall-clock limits per case would only flake
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    "print_blob": True,  # a failure prints the @reproduce_failure line
}
# CI: derandomized (the same cases every run, so a red CI is reproducible) and no example database.
settings.register_profile("kvcr-fuzz-ci", derandomize=True, database=None, **_SHARED)
# Long: random, with Hypothesis' database under .hypothesis/ so a failure found once is replayed first.
settings.register_profile("kvcr-fuzz-long", **_SHARED)

_lock = threading.Lock()
CASES: Counter[str] = Counter()


TRACED_EXAMPLES = 1_000  # how many of a long target's cases run under tracemalloc (see phases)


def examples(target: str) -> int:
    ci, long = _EXAMPLES[target]
    return ci if PROFILE == "ci" else long


def budget(target: str, max_examples: int | None = None) -> settings:
    """The Hypothesis settings of one target under the active profile."""
    n = examples(target) if max_examples is None else max_examples
    return settings(settings.get_profile(f"kvcr-fuzz-{PROFILE}"), max_examples=n)


def phases(target: str) -> list[tuple[int, bool]]:
    """(cases, under tracemalloc) runs of a target whose memory is checked.

    Tracing every allocation makes Hypothesis itself about ten times slower, so a long target runs
    most of its cases untraced and its last ``TRACED_EXAMPLES`` traced, against a baseline taken
    between the two: a leak that grows with cases shows in that window as in any other.
    """
    n = examples(target)
    if PROFILE == "ci" or n <= 2 * TRACED_EXAMPLES:
        return [(n, True)]
    return [(n - TRACED_EXAMPLES, False), (TRACED_EXAMPLES, True)]


NOTES: dict[str, dict[str, int]] = {}


def note(target: str, name: str, value: int) -> None:
    """Record a figure about a target's run (shown with the case counts)."""
    with _lock:
        NOTES.setdefault(target, {})[name] = value


def count(target: str) -> None:
    """Record one executed case of ``target``."""
    if target not in _EXAMPLES:
        raise KeyError(target)
    with _lock:
        CASES[target] += 1
