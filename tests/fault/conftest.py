"""Fault-suite fixtures: replica processes (SGLang's real backend in each) and the per-fault figures.

Each test records, per fault, the trials it ran, the slowest return of a backend call, the wrong
bytes found and whether the target (the "worker") stayed alive; the terminal summary prints them
(and ``KVCR_FAULT_FIGURES=<file>`` writes them as JSON), which is what docs/faults.md quotes.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.fault.support import Figures

_FIGURES = Figures()


@pytest.fixture
def figures() -> Figures:
    return _FIGURES


@pytest.fixture
def cluster():
    """Start replicas with ``cluster(name, **options)``; every one is closed (or killed) afterwards."""
    from tests.fault.support import Cluster

    made = Cluster()
    try:
        yield made
    finally:
        made.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the figures once per session (other directories' conftests may call this too)."""
    if not _FIGURES.rows or _FIGURES.printed:
        return
    _FIGURES.printed = True
    terminalreporter.section("kvcr fault figures")
    for line in _FIGURES.table():
        terminalreporter.write_line(line)
    path = os.environ.get("KVCR_FAULT_FIGURES")
    if path:
        with open(path, "w") as out:
            json.dump(_FIGURES.rows, out, indent=2)
