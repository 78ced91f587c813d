"""Replica processes for soak and fault runs, forked from one process that imported SGLang once.

Importing SGLang, torch and NIXL takes 10-20 s of CPU per interpreter; a fault run that kills its
source 20 times cannot pay that each time. A multiprocessing *forkserver* imports them once
(``kvcr.soak.preload``) and forks every replica from there: a fresh process, its own NIXL agent,
UCX context and sockets (nothing of those exists before the fork), ready in about a second.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

from kvcr.soak.replica import ReplicaOptions, serve

_lock = threading.Lock()
_context: Any = None


def context() -> Any:
    """The forkserver context every replica is started from (its server preloads SGLang)."""
    global _context
    with _lock:
        if _context is None:
            made = multiprocessing.get_context("forkserver")
            made.set_forkserver_preload(["kvcr.soak.preload"])
            _context = made
        return _context


class ReplicaError(RuntimeError):
    """A replica did not start, did not answer in time, or answered with an error."""


class Replica:
    """One replica process and its command pipe.

    ``ask`` sends one command and waits at most ``timeout_s`` for the answer; a replica that does
    not answer is a hang (``ReplicaError``), never a blocked caller.
    """

    def __init__(self, options: ReplicaOptions, *, start_timeout_s: float = 180.0) -> None:
        ctx = context()
        self.options = options
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, options), name=f"kvcr-soak-{options.name}")
        self.process.start()
        child.close()
        self.lock = threading.Lock()
        ready = self._receive(start_timeout_s, "start")
        if not ready.get("ready"):
            self.kill()
            raise ReplicaError(f"replica {options.name} did not start: {ready.get('error', '')[-1500:]}")
        self.pid: int = ready["pid"]
        self.endpoint: str = ready["endpoint"]
        self.page_bytes: int = ready["page_bytes"]

    def _receive(self, timeout_s: float, what: str) -> dict[str, Any]:
        if not self.conn.poll(timeout_s):
            raise ReplicaError(f"replica {self.options.name}: no answer to {what} within {timeout_s:g}s")
        try:
            answer: dict[str, Any] = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise ReplicaError(f"replica {self.options.name} ended (exit code {self.exitcode}) during {what}") from exc
        return answer

    def ask(self, op: str, timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """Run command ``op`` in the replica; its reply (``error`` set when the command itself failed)."""
        with self.lock:
            try:
                self.conn.send({"op": op, **args})
            except (OSError, ValueError) as exc:
                raise ReplicaError(f"replica {self.options.name} is gone (exit code {self.exitcode})") from exc
            return self._receive(timeout_s, op)

    @property
    def alive(self) -> bool:
        return bool(self.process.is_alive()) and not _zombie(self.process.pid)

    @property
    def exitcode(self) -> int | None:
        code: int | None = self.process.exitcode
        return code

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)
        if sig == signal.SIGSTOP:  # asynchronous: wait until every thread has stopped
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not _stopped(self.process.pid):
                time.sleep(0.002)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            self.process.kill()
        self.process.join(10)
        self.conn.close()

    def close(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """Close the backend (its leak report), end the process; kill it if it does not end."""
        report = None
        try:
            if self.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGCONT)
                report = self.ask("close", timeout_s)
                with contextlib.suppress(OSError, ValueError):
                    self.conn.send({"op": "exit"})
                self.process.join(timeout_s)
        except ReplicaError:
            report = None
        finally:
            if self.process.is_alive():
                self.kill()
            else:
                self.process.join(1)
                self.conn.close()
        return report


def _task_states(pid: int) -> list[str]:
    states = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
    return states


def _stopped(pid: int) -> bool:
    states = _task_states(pid)
    return bool(states) and all(state in "Tt" for state in states)


def _zombie(pid: int) -> bool:
    states = _task_states(pid)
    return not states or all(state in "ZX" for state in states)
