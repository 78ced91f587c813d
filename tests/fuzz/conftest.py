"""The fuzz suite: every test here carries the ``fuzz`` marker; the cases each target ran are reported."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fuzz import budget

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.fuzz)
            # Hypothesis warns when it prints a case holding a giant string; the case is what matters.
            item.add_marker(pytest.mark.filterwarnings("ignore:Generating overly large repr"))


def pytest_terminal_summary(terminalreporter):
    if not budget.CASES:
        return
    total = sum(budget.CASES.values())
    terminalreporter.section(f"kvcr fuzz ({budget.PROFILE} profile): {total} cases")
    for target in budget.TARGETS:
        if budget.CASES[target]:
            notes = "  ".join(f"{k}={v}" for k, v in budget.NOTES.get(target, {}).items())
            terminalreporter.write_line(f"{target:24} {budget.CASES[target]:>8}  {notes}".rstrip())
    report = os.environ.get("KVCR_FUZZ_REPORT")
    if report:
        summary = {"profile": budget.PROFILE, "total": total, "cases": budget.CASES, "notes": budget.NOTES}
        Path(report).write_text(json.dumps(summary) + "\n")
