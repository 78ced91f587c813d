"""The ``nixl`` kind of the contract suite: real NIXL agents.

``make_data_plane``: agents in this process, which read each other over UCX as two processes
would (CMA on this host: each agent has its own UCX worker). UCX's sockets stay on loopback.

``live_reads``: a READ that is really in flight needs a source that does not answer, and on CMA a
READ's bytes are all copied inside its post, whatever the source does (docs/nixl-behaviour.md).
So the source is another process, frozen with SIGSTOP, and the target's UCX is limited to tcp
(``UCX_TLS`` is read when the agent is built): then the READ is a GET request the frozen source
cannot answer, as between two hosts without RDMA. Such a peer has late writes.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from kvcr.adapters.nixl import NixlDataPlane
from kvcr.domain.layout import RegionDescriptor
from kvcr.testing.processes import stop_process, wait_until_stopped

LOOPBACK = {"ucx_devices": "lo"}
REPO = Path(__file__).resolve().parents[2]

# A source process: registers one exposed region of seeded bytes, prints its description and the
# region id, then waits for EOF on stdin.
_SOURCE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from kvcr.adapters.nixl import NixlDataPlane
    from kvcr.domain.layout import RegionDescriptor
    piece, count, seed = (int(a) for a in sys.argv[1:4])
    data = np.random.default_rng(seed).integers(0, 256, piece * count, dtype=np.uint8)
    plane = NixlDataPlane(sys.argv[4], backend_params={"ucx_devices": "lo"})
    (region,) = plane.register([RegionDescriptor("arena", data.ctypes.data, piece, count, piece)], exposed=True)
    print(json.dumps({"description": plane.describe().hex(), "region": region}), flush=True)
    sys.stdin.read()
    plane.close()
    """
)


class Kind:
    def __init__(self):
        self.made = []

    def make_data_plane(self, name):
        plane = NixlDataPlane(name, backend_params=LOOPBACK)
        self.made.append(plane)
        return plane

    def close_all(self):
        for plane in self.made:
            plane.close()


class FrozenSource:
    """A source data plane in a child process; ``freeze``/``resume`` stop and continue it."""

    def __init__(self, name, piece, count, seed, env):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SOURCE, str(piece), str(count), str(seed), name],
            cwd=REPO,
            env={**os.environ, "UCX_NET_DEVICES": "lo", **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = ""
        for line in self.proc.stdout:  # NIXL may print INFO lines first
            if line.startswith("{"):
                break
        hello = json.loads(line)
        self.description = bytes.fromhex(hello["description"])
        self.region = hello["region"]
        self.bytes = np.random.default_rng(seed).integers(0, 256, piece * count, dtype=np.uint8)

    def freeze(self):
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_until_stopped(self.proc.pid)  # a READ posted before every thread stopped could be answered

    def resume(self):
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self):
        with contextlib.suppress(ProcessLookupError):
            self.resume()
        stop_process(self.proc, grace_s=20)


@contextlib.contextmanager
def tcp_target(name):
    """A target data plane whose UCX may only use tcp (so its READs need the source to answer)."""
    before = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"
    try:
        plane = NixlDataPlane(name, backend_params=LOOPBACK)
        assert plane.transport_report is not None  # the probe must run under the same UCX_TLS as the plane's agent
    finally:
        if before is None:
            del os.environ["UCX_TLS"]
        else:
            os.environ["UCX_TLS"] = before
    try:
        yield plane
    finally:
        with contextlib.suppress(Exception):
            plane.close()


class LiveRead:
    """The NIXL flavour of the suite's live read (see ``tests/contract/test_dataplane.py``)."""

    flavour = "late (tcp, frozen source)"

    def __init__(self, stack, piece, count):
        self.source = FrozenSource(f"frozen-{os.getpid()}", piece, count, 5, {"UCX_TLS": "tcp"})
        stack.callback(self.source.close)
        self.target = stack.enter_context(tcp_target(f"tcp-target-{os.getpid()}"))
        self.dst = np.zeros(piece * count, dtype=np.uint8)
        (self.dst_id,) = self.target.register(
            [RegionDescriptor("dst", self.dst.ctypes.data, piece, count, piece)], exposed=False
        )
        self.peer = self.target.connect(self.source.description, 10.0)
        self.src_id = self.source.region
        self.expected = self.source.bytes
        stack.callback(self.source.resume)  # never leave it frozen, whatever the test did

    def stall(self):
        self.source.freeze()

    def resume(self):
        self.source.resume()


def live_reads(stack, piece, count):
    """Every live-read flavour this kind can produce: NIXL only has late-writing ones."""
    return [LiveRead(stack, piece, count)]
