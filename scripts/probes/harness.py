"""Driver side of the NIXL probes: start ``nixl_worker.py`` processes and talk to them.

Also the two-namespace fixture: two network namespaces joined by a veth pair that the probe
creates and always removes, addresses of its own (10.201.0.0/30), no route out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("nixl_worker.py")


class ProbeError(RuntimeError):
    pass


class Worker:
    """One agent process. ``call`` sends a command and waits (bounded) for its answer."""

    def __init__(
        self, name: str, *, env: dict[str, str] | None = None, prefix: list[str] | None = None, **init: Any
    ) -> None:
        self.name = name
        full_env = {**os.environ, "UCX_NET_DEVICES": "lo", **(env or {})}
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            bufsize=1,
        )
        self.stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.answers: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read_answers, daemon=True).start()
        self.pid = self.call("init", name=name, **init)["pid"]

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())

    def _read_answers(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                with self.cond:
                    self.answers.append(json.loads(line[3:]))
                    self.cond.notify_all()

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.answers:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.answers):
                    raise ProbeError(f"{self.name}: no answer (rc={self.proc.poll()}); stderr: {self.stderr[-5:]}")
                self.cond.wait(min(left, 0.2))
            return self.answers.pop(0)

    def call(self, cmd: str, timeout: float = 30.0, check: bool = True, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        answer = self.answer(timeout)
        if check and not answer.get("ok"):
            raise ProbeError(f"{self.name}.{cmd}: {answer.get('error')}")
        return answer

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                os.kill(self.pid, signal.SIGCONT)
            with contextlib.suppress(Exception):
                self.send("quit")
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        # The worker may run under `ip netns exec`: make sure the python child is gone too.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class Namespaces:
    """ns ``<tag>a`` (10.201.0.1, veth ``<tag>va``) and ``<tag>b`` (10.201.0.2, ``<tag>vb``)."""

    def __init__(self, tag: str = "kvcrp") -> None:
        self.a, self.b = f"{tag}a", f"{tag}b"
        self.va, self.vb = f"{tag}va", f"{tag}vb"

    def __enter__(self) -> Namespaces:
        self.remove()
        sh("ip", "netns", "add", self.a)
        sh("ip", "netns", "add", self.b)
        sh("ip", "link", "add", self.va, "netns", self.a, "type", "veth", "peer", "name", self.vb, "netns", self.b)
        for ns, dev, addr in ((self.a, self.va, "10.201.0.1/30"), (self.b, self.vb, "10.201.0.2/30")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def env(self, side: str) -> dict[str, str]:
        return {"UCX_NET_DEVICES": self.va if side == "a" else self.vb}

    def link(self, up: bool) -> None:
        sh("ip", "-n", self.a, "link", "set", self.va, "up" if up else "down")

    def remove(self) -> None:
        for ns in (self.a, self.b):
            sh("ip", "netns", "del", ns, check=False)

    def __exit__(self, *exc: object) -> None:
        self.remove()


@contextlib.contextmanager
def workers(*made: Worker) -> Iterator[tuple[Worker, ...]]:
    try:
        yield made
    finally:
        for worker in made:
            worker.close()
