"""Helpers for the UCX tests: pools kept alive by the fixture, known pages, a source in a child process."""

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvcr.testing.processes import stop_process
from tests.integration.buffers import Pool

REPO = Path(__file__).resolve().parents[3]
LOOPBACK = {"ucx_devices": "lo"}  # the default: ucx_error_handling_mode=none (CMA on one host)
PEER = {"ucx_devices": "lo", "ucx_error_handling_mode": "peer"}  # tcp only


def pool(planes, *args, **kwargs):
    """A Pool that lives until the ``planes`` fixture closed its planes (sends may read it until then)."""
    made = Pool(*args, **kwargs)
    planes.keep(made)
    return made


def page(seed, index, nbytes):
    """The known content of page ``index`` of a source seeded with ``seed``."""
    return np.random.default_rng([seed, index]).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class SourceProcess:
    """``python -m tests.integration.ucx.source_process`` in a child: known pages, served over UCX."""

    def __init__(self, *, pages, piece, seed, params, components=1, env=None):
        args = [sys.executable, "-m", "tests.integration.ucx.source_process"]
        spec = {"pages": pages, "piece": piece, "seed": seed, "params": params, "components": components}
        self.proc = subprocess.Popen(
            [*args, json.dumps(spec)],
            cwd=REPO,
            env={**os.environ, "UCX_NET_DEVICES": "lo", **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self._pending = b""
        hello = self._line(60)
        self.description = bytes.fromhex(hello["description"])
        self.regions = hello["regions"]
        self.pid = self.proc.pid

    def command(self, *words, timeout_s=30):
        self.proc.stdin.write((" ".join(str(w) for w in words) + "\n").encode())
        return self._line(timeout_s)

    def _line(self, timeout_s):
        """The next JSON line (anything else on stdout is a library talking), within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                raise AssertionError(f"the source process said nothing within {timeout_s}s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise AssertionError(f"the source process ended (rc={self.proc.wait(5)})")
            self._pending += chunk

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        stop_process(self.proc, grace_s=10)  # reaps it and closes its pipes

    def close(self):
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError, OSError):  # it may be stopped or gone
                self.command("quit", timeout_s=15)
        self.kill()
