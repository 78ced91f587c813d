"""The netns tests use the fault suite's fixtures (replica processes, per-fault figures) and its summary."""

from tests.fault.conftest import cluster, figures, pytest_terminal_summary

__all__ = ["cluster", "figures", "pytest_terminal_summary"]
