"""Stopping the replica processes tests and benchmarks start, leaving no process or pipe behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
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


def wait_until_stopped(pid: int, timeout_s: float = 5.0) -> bool:
    """After SIGSTOP: whether every thread of ``pid`` has really stopped within ``timeout_s``.

    The signal is asynchronous; a request sent before the last thread stopped could still be answered.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if states and all(state in "Tt" for state in states):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
