"""Helpers for the NIXL tests: child processes (pieces and the bounded wait: tests.integration.buffers)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvcr.testing.processes import stop_process, wait_until_stopped

LOOPBACK = {"ucx_devices": "lo"}  # keep UCX's sockets on lo
REPO = Path(__file__).resolve().parents[3]


def run_python(script, timeout=120, **env):
    """Run ``script`` in a fresh interpreter from the repository root; its last stdout line is JSON."""
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        env={**os.environ, "UCX_NET_DEVICES": "lo", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1]), completed


class Child:
    """A long-lived child interpreter (``python <args>``); JSON lines both ways over its stdio.

    ``prefix`` runs it under another command (``ip netns exec <ns>``).
    """

    def __init__(self, *args, prefix=(), **env):
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *args],
            cwd=REPO,
            env={**os.environ, "UCX_NET_DEVICES": "lo", **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def receive(self):
        for line in self.proc.stdout:  # NIXL may print INFO lines of its own
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"child ended (rc={self.proc.wait()}): {self.proc.stderr.read()[-2000:]}")

    def ask(self, op, **request):
        self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
        self.proc.stdin.flush()
        answer = self.receive()
        assert "error" not in answer or request.get("may_fail"), answer
        return answer

    def signal(self, sig):
        os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:  # the signal is asynchronous: wait until every thread is stopped
            wait_until_stopped(self.pid)

    def close(self):
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        stop_process(self.proc, grace_s=20)


def plane_server(name, *, prefix=(), params=None, **env):
    """A NixlDataPlane in a child process (``tests/integration/nixl/plane_server.py``)."""
    child = Child(
        "-m", "tests.integration.nixl.plane_server", name, json.dumps(params or LOOPBACK), prefix=prefix, **env
    )
    hello = child.receive()
    child.pid = hello["pid"]
    return child


def sh(*args, check=True):
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class Namespaces:
    """Two network namespaces joined by a veth pair (10.203.0.1/30 and .2), created and always removed."""

    def __init__(self, tag):
        self.a, self.b, self.va, self.vb = f"{tag}a", f"{tag}b", f"{tag}va", f"{tag}vb"

    def __enter__(self):
        self.remove()
        sh("ip", "netns", "add", self.a)
        sh("ip", "netns", "add", self.b)
        sh("ip", "link", "add", self.va, "netns", self.a, "type", "veth", "peer", "name", self.vb, "netns", self.b)
        for ns, dev, addr in ((self.a, self.va, "10.203.0.1/30"), (self.b, self.vb, "10.203.0.2/30")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def exec(self, ns):
        return ("ip", "netns", "exec", ns)

    def link(self, up):
        sh("ip", "-n", self.a, "link", "set", self.va, "up" if up else "down")

    def remove(self):
        for ns in (self.a, self.b):
            sh("ip", "netns", "del", ns, check=False)

    def __exit__(self, *exc):
        self.remove()
