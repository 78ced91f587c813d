"""Remote restore benchmark: kvcr's peer path vs a raw NIXL READ of the same pieces vs memcpy.

For each page size a source replica runs in another process (``kvcr.testing.replica``: a runner node
over NIXL + ZMQ holding 128 known pages). This process is the target: a runner node with a host
pool. Per page size and batch (pages 0..batch-1), interleaved repetition by repetition:

* ``raw``      a separate, bare NIXL agent of this process reads the very same pieces (the
               source's leased arena slots, K and V) into the same host slots: prepared strided
               lists made once, then ``make_prepped_xfer`` + ``transfer`` + poll + release;
* ``read``     kvcr's ``PeerClient.read`` under a lease taken beforehand (what the SGLang backend
               does at prefetch time: it leased at hit-query time);
* ``restore``  kvcr's whole ``PeerClient.restore``: LEASE round trip, READ, RELEASE;
* ``checked``  the same restore by a second target node with ``verify_bytes`` on: every page's
               digest, taken by the source at backup, is checked after the read (its cost, same run);
* ``memcpy``   a memmove of the same byte count between two buffers of this process;
* ``control``  a bare pyzmq DEALER sends the source's control server a LEASE of the same pages under
               a session it never opened, answered at its first check: a control round trip with no
               kvcr code on this side and almost none on the source's. ``raw`` + ``control`` is the
               floor of any restore with one control round trip before its read (``floor vs raw``).

Every kvcr read is checked byte for byte against the source's known page contents once per
configuration. Ratios are against ``raw`` (and ``raw`` against ``memcpy``) of the same run.

``run_remote_netns`` runs the same across two network namespaces joined by a veth pair (root only;
:class:`kvcr.testing.netns.TwoHosts`), UCX over tcp, as between two hosts without RDMA: the source
in one namespace, this measurement (target and raw baseline) in a child process in the other, so
``read vs raw`` is kvcr against a raw NIXL READ over the very same link.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from kvcr.adapters.local import MmapHostMemory
from kvcr.bench.stats import Timing, markdown_table, timing
from kvcr.domain import deadlines
from kvcr.domain.layout import RegionDescriptor
from kvcr.domain.transports import SHARES_MEMORY
from kvcr.domain.units import format_byte_size
from kvcr.runner import protocol
from kvcr.runner.peer_client import PoolRead
from kvcr.testing.ports import free_port_block
from kvcr.testing.processes import stop_process
from kvcr.testing.replica import HostPool, bench_pool, build_node, page_pattern

SOURCE_PAGES = 128


@dataclass(frozen=True, slots=True)
class RemoteResult:
    page_bytes: int
    pages: int
    reps: int
    memcpy_p50_ms: float
    raw_p50_ms: float
    read_p50_ms: float
    read_p99_ms: float
    restore_p50_ms: float
    restore_p99_ms: float
    read_vs_raw: float
    restore_vs_raw: float
    raw_vs_memcpy: float
    verified: bool
    transport: str = "nixl"
    checked_restore_p50_ms: float = 0.0  # the restore with verify_bytes on
    verify_cost: float = 0.0  # restore time with verify_bytes on / without, same run
    link: str = "loopback"  # "tcp over veth (2 namespaces)" for run_remote_netns
    control_p50_ms: float = 0.0  # a bare control round trip to the source (RawControl)
    floor_vs_raw: float = 0.0  # raw / (raw + control): the best a one-round-trip restore can do
    copy: str = ""  # shm and auto: the copy large same-host reads used here, and what it was measured against

    def gbps(self, ms: float) -> float:
        return self.pages * self.page_bytes / (ms / 1e3) / 1e9


@contextlib.contextmanager
def source_replica_process(
    module_args: list[str], *, prefix: Sequence[str] = (), env: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """Run ``[prefix] python <module_args>`` until it prints ``READY {json}``; yield the json; stop it after."""
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **(env or {})}
    proc = subprocess.Popen(
        [*prefix, sys.executable, *module_args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""))
        reader.start()
        reader.join(180)
        if not line or not line[0].startswith("READY "):
            raise RuntimeError("the source replica did not start")
        yield json.loads(line[0][len("READY ") :])
    finally:
        stop_process(proc)


@dataclass(frozen=True, slots=True)
class SourcePlace:
    """Where the source replica runs: a command prefix (``ip netns exec``), its address, token, env."""

    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    token_file: str | None = None
    env: tuple[tuple[str, str], ...] = ()


def source_replica(
    page_bytes: int, port: int, place: SourcePlace = SourcePlace(), transport: str = "nixl"
) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """A ``kvcr.testing.replica`` replica holding SOURCE_PAGES known pages of ``page_bytes``."""
    extra = ["--host", place.host] + (["--token-file", place.token_file] if place.token_file else [])
    return source_replica_process(
        [
            "-m",
            "kvcr.testing.replica",
            "--port",
            str(port),
            "--pages",
            str(SOURCE_PAGES),
            "--page-bytes",
            str(page_bytes),
            "--name",
            f"bench-source-{port}-{os.getpid()}",
            "--lease-ms",
            "60000",
            "--transport",
            transport,
            "--verify-bytes",  # digests at backup, so a verifying target can check them
            *extra,
        ],
        prefix=place.prefix,
        env=dict(place.env),
    )


def data_plane_description(
    endpoint: str, namespaces: dict[str, str], port: int, token: bytes | None = None
) -> tuple[bytes, list[int]]:
    """Ask a source for its NIXL data-plane description and its KV pool's region ids (for the raw baseline).

    A source on ``transport: auto`` describes both of its planes: its NIXL half, with the region ids
    translated to NIXL's, is what a bare NIXL agent reads."""
    import secrets

    from kvcr.adapters.zmq import ZmqControlChannel
    from kvcr.runner import protocol
    from kvcr.runner.protocol import Hello, HelloReply

    probe = ZmqControlChannel("127.0.0.1", port, token=token)
    try:
        hello = Hello(secrets.token_bytes(16), "raw", "raw", namespaces)
        reply = protocol.decode(probe.request(endpoint, protocol.encode(hello), 10))
    finally:
        probe.close()
    if not isinstance(reply, HelloReply):
        raise RuntimeError("no HELLO reply from the source")
    kv = [p for p in reply.pools if p.name == "kv"]
    if not kv:
        raise RuntimeError("the source serves no kv pool")
    regions = list(kv[0].regions)
    from kvcr.adapters.shm import fallback_description
    from kvcr.ports.errors import PeerUnavailable

    try:
        description, ids = fallback_description(reply.data_plane)
    except PeerUnavailable:
        return reply.data_plane, regions  # a plain NIXL description
    return description, [ids[r] for r in regions]


class RawReader:
    """A bare NIXL agent reading the given source pieces into host slots (the baseline)."""

    def __init__(
        self,
        name: str,
        description: bytes,
        region_ids: list[int],
        regions: Sequence[RegionDescriptor],
        span: tuple[int, int],
        pool_pieces: list[int],
    ) -> None:
        import numpy as np
        from nixl._api import nixl_agent, nixl_agent_config

        from kvcr.adapters.nixl import described_peer

        self._np = np
        decoded = described_peer(description)
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {})
        self.registration = self.agent.register_memory([(span[0], span[1], 0, "")], "DRAM")
        peer = self.agent.add_remote_agent(decoded.metadata)
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        by_id = decoded.regions
        remote_rows = [[by_id[i].base, by_id[i].piece_bytes, 0, by_id[i].stride, by_id[i].count] for i in region_ids]
        local_rows = [[r.base, r.piece_bytes, 0, r.stride, r.count] for r in regions]
        if [row[1] for row in remote_rows] != pool_pieces:
            raise RuntimeError("source geometry does not match the bench pool")
        self.remote_count = remote_rows[0][4]
        self.local_count = regions[0].count
        self.remote = self.agent.prep_xfer_dlist(self.peer, np.array(remote_rows, dtype=np.uint64), "DRAM")
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(local_rows, dtype=np.uint64), "DRAM")
        self.src_idx: Any = None
        self.dst_idx: Any = None

    def target(self, source_slots: list[int], host_slots: list[int]) -> None:
        np = self._np
        components = 2
        self.src_idx = np.array(
            [c * self.remote_count + s for c in range(components) for s in source_slots], dtype=np.int64
        )
        self.dst_idx = np.array([c * self.local_count + d for c in range(components) for d in host_slots], np.int64)

    def read(self) -> None:
        xfer = self.agent.make_prepped_xfer("READ", self.local, self.dst_idx, self.remote, self.src_idx)
        state = self.agent.transfer(xfer)
        while state == "PROC":
            state = self.agent.check_xfer_state(xfer)
        xfer.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended {state}")

    def close(self) -> None:
        self.remote.release()
        self.local.release()
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.registration)


def run_remote(
    page_bytes: int,
    batches: list[int],
    reps: int,
    port: int | None = None,
    place: SourcePlace = SourcePlace(),
    link: str = "loopback",
    transport: str = "nixl",
) -> list[RemoteResult]:
    """Measure every batch for one page size over ``transport``; ``port`` starts a block of 5 (free
    ones by default). The baseline is always a raw NIXL READ: with another transport a second source
    replica, over NIXL and holding the same pages, serves it."""
    from pathlib import Path

    port = port or free_port_block(5)
    pool = bench_pool(page_bytes)
    # The bench measures steady-state reads, not failure handling: first contact (HELLO, the data
    # plane's wire-up over tcp between namespaces, on a loaded machine) gets seconds, not the serving
    # defaults of 250 ms and 2 s, and a missed first lease is tried again (_retried).
    runner_timing = deadlines.Timing(
        operation_s=30.0,
        abandon_s=60.0,
        control_s=5.0,
        connect_s=20.0,
        lease_s=60.0,
        lease_margin_s=1.0,
        retry_after_s=0.2,
    )
    token = Path(place.token_file).read_bytes().strip() if place.token_file else None
    results = []
    with contextlib.ExitStack() as stack:
        info = stack.enter_context(source_replica(page_bytes, port, place))
        kvcr_source = info
        if transport != "nixl":
            kvcr_source = stack.enter_context(source_replica(page_bytes, port + 3, place, transport))
        target = f"bench-target-{os.getpid()}-{port}"
        node = build_node(target, port + 1, page_bytes, 4, timing=runner_timing, token=token, transport=transport)
        checking = build_node(
            f"bench-checking-{os.getpid()}-{port}",
            port + 4,
            page_bytes,
            4,
            timing=runner_timing,
            token=token,
            transport=transport,
            verify_bytes=True,
        )
        stack.callback(checking.close)
        memory = MmapHostMemory()
        host = HostPool.allocate(memory, pool, SOURCE_PAGES)
        scratch = memory.allocate(SOURCE_PAGES * page_bytes, "bench/memcpy")
        node.register_host_pool("kv", host.regions)
        checking.register_host_pool("kv", host.regions)
        keys: list[str] = info["keys"]
        endpoint: str = kvcr_source["endpoint"]
        try:
            lease = _HeldLease(node, endpoint, keys)
            description, region_ids = data_plane_description(
                info["endpoint"], dict(node.runner.namespaces), port + 2, token
            )
            raw = RawReader(
                f"bench-raw-{os.getpid()}-{port}",
                description,
                region_ids,
                host.regions,
                (host.allocation.address, host.allocation.nbytes),
                [c.piece_bytes for c in pool.components],
            )
            control = RawControl(endpoint, token)
            try:
                for batch in batches:
                    result = _measure(node, checking, raw, control, lease, host, scratch, keys[:batch], endpoint, reps)
                    copy = _copy_in_use() if transport in SHARES_MEMORY else ""
                    results.append(dataclasses.replace(result, transport=transport, link=link, copy=copy))
            finally:
                control.close()
                raw.close()
                lease.release()
        finally:
            node.close()
            host.free()
            memory.free(scratch)
    return results


class RawControl:
    """A bare pyzmq DEALER asking the source's control server something it refuses at once.

    The request is a LEASE of the measured pages under session 0, which no HELLO ever opens, so the
    source answers UNKNOWN_SESSION before it looks at a page: the round trip of a LEASE-sized
    message with nothing of kvcr's client in it (CURVE on it when the cluster has a token).
    """

    def __init__(self, endpoint: str, token: bytes | None) -> None:
        import zmq

        from kvcr.adapters.zmq.curve import Keyring

        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.linger = 0
        if token is not None:
            Keyring(token).configure_client(self._sock, 0)
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._ids = iter(range(1, 1 << 62))
        self._payload = b""

    def target(self, keys: list[str]) -> None:
        import secrets

        self._payload = protocol.encode(protocol.Lease(secrets.token_bytes(16), 0, 1000, [(0, keys)]))

    def ask(self) -> None:
        request_id = next(self._ids).to_bytes(8, "big")
        self._sock.send_multipart([request_id, self._payload])
        while True:
            if not self._poller.poll(10_000):
                raise RuntimeError("the source's control server did not answer a bare request")
            frames = self._sock.recv_multipart()
            if frames[0] == request_id:
                break
        if len(frames) != 3 or not isinstance(protocol.decode(frames[2]), protocol.Refused):
            raise RuntimeError("the source answered a LEASE under an unknown session with something other than REFUSED")

    def close(self) -> None:
        self._sock.close()
        self._context.term()


T = TypeVar("T")


def _lease_all(node: Any, endpoint: str, keys: list[str]) -> Any:
    """A lease of every one of ``keys`` from ``endpoint``; RuntimeError (nothing held) otherwise."""
    lease = node.client.lease(endpoint, [("kv", keys)])
    if lease is not None and len(lease.slots) == len(keys) and lease.link is not None:
        return lease
    if lease is not None:
        node.client.release(lease)
    raise RuntimeError("could not lease the source's pages")


class _HeldLease:
    """The target's lease of every source page, taken again (unmeasured) before each repetition.

    One lease outlives a whole measurement on a fast link, not on a slow one: 8 MiB x 128 over
    UCX tcp/lo reads for seconds per call, past the source's 10 s lease within a few repetitions.
    A renewed lease must name the same slots (the raw reader's prepared lists point at them).
    """

    def __init__(self, node: Any, endpoint: str, keys: list[str]) -> None:
        self._node, self._endpoint, self._keys = node, endpoint, keys
        self.current = self._take()

    def _take(self) -> Any:
        return _retried(lambda: _lease_all(self._node, self._endpoint, self._keys), budget_s=30.0, pause_s=0.3)

    @property
    def slots(self) -> dict[tuple[str, str], int]:
        slots: dict[tuple[str, str], int] = self.current.slots
        return slots

    def renew(self) -> None:
        fresh = self._take()
        old, self.current = self.current, fresh
        self._node.client.release(old)
        if fresh.slots != old.slots:
            raise RuntimeError("the source moved its pages between two leases")

    def release(self) -> None:
        self._node.client.release(self.current)


def _retried(call: Callable[[], T], budget_s: float, pause_s: float) -> T:
    """``call``'s result, trying again ``pause_s`` apart for up to ``budget_s`` while it raises
    RuntimeError. A node's first contact with a peer may be a miss (over tcp its link can still be
    wiring up, slower on a loaded machine; a missed peer is skipped for ``retry_after_s``)."""
    give_up = time.monotonic() + budget_s
    while True:
        try:
            return call()
        except RuntimeError:
            if time.monotonic() >= give_up:
                raise
            time.sleep(pause_s)


def _measure(
    node: Any,
    checking: Any,
    raw: RawReader,
    control: RawControl,
    lease: _HeldLease,
    host: HostPool,
    scratch: Any,
    keys: list[str],
    endpoint: str,
    reps: int,
) -> RemoteResult:
    import ctypes

    batch = len(keys)
    page_bytes = sum(r.piece_bytes for r in host.regions)
    slots = list(range(batch))
    raw.target([lease.slots[("kv", k)] for k in keys], slots)
    control.target(keys)
    request = [PoolRead("kv", keys, slots)]
    nbytes = batch * page_bytes

    def kvcr_read() -> None:
        if not all(o.restored for o in node.client.read(lease.current, request)["kv"]):
            raise RuntimeError("a leased read did not restore every page")

    def kvcr_restore() -> None:
        if not all(o.restored for o in node.client.restore(endpoint, request)["kv"]):
            raise RuntimeError("a restore did not restore every page")

    def checked_restore() -> None:
        if not all(o.restored for o in checking.client.restore(endpoint, request)["kv"]):
            raise RuntimeError("a restore with verify_bytes on did not restore every page")

    def memcpy() -> None:
        ctypes.memmove(scratch.address, host.allocation.address, nbytes)

    host.zero()
    kvcr_read()
    verified = all(host.read(i) == page_pattern(k, page_bytes) for i, k in enumerate(keys))
    if not verified:
        raise RuntimeError("restored bytes differ from the source's pages")
    calls: dict[str, Callable[[], None]] = {
        "raw": raw.read,
        "read": kvcr_read,
        "restore": kvcr_restore,
        "checked": checked_restore,
        "memcpy": memcpy,
        "control": control.ask,
    }
    for call in calls.values():
        _retried(call, budget_s=5.0, pause_s=0.2)  # unmeasured; measured calls must all succeed
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        lease.renew()  # unmeasured: a slow link outlasts one lease
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    t: dict[str, Timing] = {name: timing(s) for name, s in samples.items()}
    return RemoteResult(
        page_bytes=page_bytes,
        pages=batch,
        reps=reps,
        memcpy_p50_ms=t["memcpy"].p50 * 1e3,
        raw_p50_ms=t["raw"].p50 * 1e3,
        read_p50_ms=t["read"].p50 * 1e3,
        read_p99_ms=t["read"].p99 * 1e3,
        restore_p50_ms=t["restore"].p50 * 1e3,
        restore_p99_ms=t["restore"].p99 * 1e3,
        read_vs_raw=t["raw"].p50 / t["read"].p50,
        restore_vs_raw=t["raw"].p50 / t["restore"].p50,
        raw_vs_memcpy=t["memcpy"].p50 / t["raw"].p50,
        verified=verified,
        checked_restore_p50_ms=t["checked"].p50 * 1e3,
        verify_cost=t["checked"].p50 / t["restore"].p50,
        control_p50_ms=t["control"].p50 * 1e3,
        floor_vs_raw=t["raw"].p50 / (t["raw"].p50 + t["control"].p50),
    )


NETNS_LINK = "tcp over veth (2 namespaces)"


def run_remote_netns(sizes: list[int], batches: list[int], reps: int) -> list[RemoteResult]:
    """``run_remote`` across two network namespaces joined by a veth pair, UCX over tcp (root only).

    The namespaces, the pair and a token file (the control addresses are not loopback, so the
    control channel is authenticated) are this call's own and always removed.

    Raises:
        OSError: the namespaces cannot be made (not root), or the measuring process failed.
    """
    import secrets
    import tempfile

    from kvcr.testing.netns import TwoHosts

    with TwoHosts() as hosts, tempfile.TemporaryDirectory(prefix="kvcr-bench-netns-") as tmp:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w") as out:
            out.write(secrets.token_hex(32))
        os.chmod(token_file, 0o600)
        place = SourcePlace(
            tuple(hosts.exec_prefix(hosts.a)),
            hosts.addr_a,
            token_file,
            (("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", hosts.dev_a)),
        )
        job = {"sizes": sizes, "batches": batches, "reps": reps, "place": dataclasses.asdict(place)}
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=hosts.dev_b)
        return _measured_apart(job, prefix=hosts.exec_prefix(hosts.b), env=env, where=f" in namespace {hosts.b}")


def run_remote_apart(
    page_bytes: int, batches: list[int], reps: int, port: int | None, transport: str
) -> list[RemoteResult]:
    """``run_remote`` in a process of its own. The ucxx plane must be made before NIXL loads in a
    process (docs/ucx.md): the second page size's target, made after the first size's raw NIXL
    reader, could not make its UCX registration cache, and the run stopped there.

    Raises:
        OSError: the measuring process failed (its last lines say why).
    """
    job = {"kind": "loopback", "page_bytes": page_bytes, "batches": batches, "reps": reps, "port": port}
    return _measured_apart({**job, "transport": transport})


def _measured_apart(
    job: dict[str, Any], *, prefix: Sequence[str] = (), env: dict[str, str] | None = None, where: str = ""
) -> list[RemoteResult]:
    """The results of ``python -m kvcr.bench.remote <job>`` (behind ``prefix``), its last stdout line.

    Raises:
        OSError: the measuring process failed (its last lines say why).
    """
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "kvcr.bench.remote", json.dumps(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise OSError(f"the measuring process{where} failed: {done.stderr.strip()[-800:]}")
    return [RemoteResult(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def _child(job: dict[str, Any]) -> list[dict[str, object]]:
    """The measuring process of ``run_remote_apart`` (kind ``loopback``) or ``run_remote_netns``."""
    if job.get("kind") == "loopback":
        results = run_remote(
            job["page_bytes"], job["batches"], job["reps"], port=job["port"], transport=job["transport"]
        )
        return [as_dict(r) for r in results]
    return _netns_child(job)


def _netns_child(job: dict[str, Any]) -> list[dict[str, object]]:
    """In the target's namespace: every page size of ``run_remote_netns`` (source in the other one)."""
    place = job["place"]
    source = SourcePlace(tuple(place["prefix"]), place["host"], place["token_file"], tuple(map(tuple, place["env"])))
    return [
        as_dict(r)
        for size in job["sizes"]
        for r in run_remote(size, job["batches"], job["reps"], place=source, link=NETNS_LINK)
    ]


def _copy_in_use() -> str:
    """Which copy this process's same-host reads of 64 MiB or more use, and the measurement behind it."""
    from kvcr.adapters.shm import copies

    found = copies.measured(wait_s=30.0)
    if found is None:
        return "memmove (the streaming copy was not built)"
    ratio = found.stream_gbps / found.memmove_gbps
    return (
        f"{found.strategy} (measured here over {found.nbytes >> 20} MiB: memmove {found.memmove_gbps:.1f} GB/s, "
        f"streaming {found.stream_gbps:.1f} GB/s, {ratio:.2f}x)"
    )


def remote_table(results: list[RemoteResult]) -> str:
    rows = [
        [
            f"{format_byte_size(r.page_bytes)} x {r.pages}" + ("" if r.transport == "nixl" else f" ({r.transport})"),
            f"{r.memcpy_p50_ms:.2f} / {r.gbps(r.memcpy_p50_ms):.1f}",
            f"{r.raw_p50_ms:.2f} / {r.gbps(r.raw_p50_ms):.1f}",
            f"{r.read_p50_ms:.2f} / {r.gbps(r.read_p50_ms):.1f}",
            f"{r.restore_p50_ms:.2f} / {r.gbps(r.restore_p50_ms):.1f}",
            f"{r.read_vs_raw:.2f}x",
            f"{r.restore_vs_raw:.2f}x",
            f"{r.read_p99_ms:.2f} / {r.restore_p99_ms:.2f}",
            f"{r.checked_restore_p50_ms:.2f} ({r.verify_cost:.2f}x)" if r.verify_cost else "-",
            f"{r.control_p50_ms:.3f} / {r.floor_vs_raw:.2f}x" if r.floor_vs_raw else "-",
        ]
        for r in results
    ]
    header = [
        "pages",
        "memcpy ms / GB/s",
        "raw NIXL READ",
        "kvcr read (leased)",
        "kvcr restore (lease+read+release)",
        "read vs raw",
        "restore vs raw",
        "p99 read / restore ms",
        "restore with verify_bytes ms (x without)",
        "bare control round trip ms / one-round-trip floor vs raw",
    ]
    table = markdown_table(header, rows)
    copies = sorted({r.copy for r in results if r.copy})
    if copies:
        table += "\n\nSame-host reads of 64 MiB or more copied with " + "; ".join(copies) + "."
    return table


def as_dict(result: RemoteResult) -> dict[str, object]:
    return asdict(result)


if __name__ == "__main__":  # the measuring process of run_remote_apart or run_remote_netns (one JSON argument)
    print(json.dumps(_child(json.loads(sys.argv[1]))))
