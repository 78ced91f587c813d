"""Stopping the replica processes tests and benchmarks start, leaving no process or pipe behind."""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any


def stop_process(proc: subprocess.Popen[Any], *, grace_s: float = 30.0) -> None:
    """Close its stdin (the replicas' signal to close), wait ``grace_s``, kill if needed, close every pipe."""
    try:
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                if proc.stdin is not None:
                    proc.stdin.close()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    finally:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()
