"""Where a small same-host peer restore spends its time (issue 24's 64 KiB x 32 target), profiled.

``UCX_NET_DEVICES=lo .venv/bin/python scripts/probes/profile_shm_restore.py [--pages 32] [--page-bytes 65536]``
starts a source replica in another process (``transport: shm``), then in this process times N
restores (LEASE + read + RELEASE), N reads under one lease and N LEASE+RELEASE pairs, and prints
cProfile's top functions of the restores by cumulative time. A probe, not a benchmark: the figures
the README reports come from ``kvcr bench remote``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvcr.adapters.local import MmapHostMemory  # noqa: E402
from kvcr.domain.deadlines import Timing  # noqa: E402
from kvcr.runner.peer_client import PoolRead  # noqa: E402
from kvcr.testing.replica import HostPool, bench_pool, build_node  # noqa: E402
from tests.support import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--page-bytes", type=int, default=64 << 10)
    parser.add_argument("--repeats", type=int, default=1000)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "kvcr.testing.replica", "--port", str(port), "--pages", str(args.pages)]
    command += ["--page-bytes", str(args.page_bytes), "--transport", "shm", "--name", "profiled-source"]
    source = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert source.stdout is not None and source.stdin is not None
    info = json.loads(source.stdout.readline()[len("READY ") :])
    timing = Timing(operation_s=3, abandon_s=6, control_s=1, lease_s=8, lease_margin_s=0.5, retry_after_s=0.2)
    node = build_node("profiled-target", free_port(), args.page_bytes, 8, transport="shm", timing=timing)
    host = HostPool.allocate(MmapHostMemory(), bench_pool(args.page_bytes), args.pages)
    node.register_host_pool("kv", host.regions)
    reads = [PoolRead("kv", info["keys"], list(range(args.pages)))]
    client, endpoint, n = node.client, info["endpoint"], args.repeats
    try:
        for _ in range(50):  # warm: links, side link, caches
            client.restore(endpoint, reads)
        started = time.perf_counter()
        for _ in range(n):
            client.restore(endpoint, reads)
        print(f"restore (lease + read + release): {(time.perf_counter() - started) / n * 1e3:.3f} ms mean")
        lease = client.lease(endpoint, [("kv", info["keys"])])
        assert lease is not None
        started = time.perf_counter()
        for _ in range(n):
            client.read(lease, reads)
        print(f"read under one lease: {(time.perf_counter() - started) / n * 1e3:.3f} ms mean")
        client.release(lease)
        started = time.perf_counter()
        for _ in range(n):
            leased = client.lease(endpoint, [("kv", info["keys"])])
            assert leased is not None
            client.release(leased)
        print(f"lease + release: {(time.perf_counter() - started) / n * 1e3:.3f} ms mean")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(n):
            client.restore(endpoint, reads)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        node.close()
        host.free()
        source.stdin.close()
        source.wait(20)


if __name__ == "__main__":
    main()
