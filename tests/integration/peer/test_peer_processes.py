"""Peer restore between processes over real NIXL (UCX on loopback) and the ZMQ control channel.

The tests parametrized by ``transport`` also run with the UCX data plane (ucxx), the same-host
shm plane and ``auto`` on both sides.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcr.adapters.local import MmapHostMemory
from kvcr.adapters.zmq import ZmqControlChannel
from kvcr.domain.deadlines import Timing
from kvcr.domain.outcomes import Outcome
from kvcr.ports.errors import PeerUnavailable
from kvcr.runner import protocol
from kvcr.runner.peer_client import PoolRead
from kvcr.runner.protocol import Hello, HelloReply, Lease, LeaseReply, RefusalCode, Refused
from kvcr.testing.processes import stop_process
from kvcr.testing.replica import HostPool, bench_keys, bench_pool, build_node, page_pattern
from tests.support import free_port

pytestmark = [pytest.mark.nixl, pytest.mark.zmq, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[3]
PAGE = 256 * 1024
TIMING = Timing(operation_s=3.0, abandon_s=6.0, control_s=1.0, lease_s=8.0, lease_margin_s=0.5, retry_after_s=0.2)


class Source:
    """A kvcr replica in another process, holding ``pages`` known pages."""

    def __init__(
        self,
        pages: int,
        page_bytes: int = PAGE,
        token_file: str | None = None,
        port: int | None = None,
        transport: str = "nixl",
        extra: tuple[str, ...] = (),
        name: str | None = None,
    ):
        self.port = port or free_port()
        self.name = name or f"source-{self.port}-{time.monotonic_ns()}"
        cmd = [
            sys.executable,
            "-m",
            "kvcr.testing.replica",
            "--port",
            str(self.port),
            "--pages",
            str(pages),
            "--page-bytes",
            str(page_bytes),
            "--name",
            self.name,
            "--transport",
            transport,
            *extra,
        ]
        if token_file:
            cmd += ["--token-file", token_file]
        env = dict(os.environ, UCX_NET_DEVICES="lo")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = self._ready_line(60)
        self.info = json.loads(line[len("READY ") :])
        self.endpoint = self.info["endpoint"]
        self.keys = self.info["keys"]

    def _ready_line(self, timeout: float) -> str:
        result: list[str] = []
        stdout, stderr = self.proc.stdout, self.proc.stderr
        assert stdout is not None and stderr is not None  # both are pipes
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not result or not result[0].startswith("READY "):
            self.kill()
            raise AssertionError(f"source did not start: {stderr.read()[-3000:]}")
        return result[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        stop_process(self.proc, grace_s=10)

    def stop(self) -> None:
        stop_process(self.proc, grace_s=20)


@pytest.fixture
def sources():
    made: list[Source] = []

    def start(*args, **kwargs) -> Source:
        source = Source(*args, **kwargs)
        made.append(source)
        return source

    yield start
    for source in made:
        source.stop()


@pytest.fixture
def target():
    made = []

    def make(
        page_bytes: int = PAGE,
        slots: int = 8,
        token: bytes | None = None,
        pages: int = 256,
        transport: str = "nixl",
        port: int | None = None,
        **checks,  # verify_bytes, page_digest, node_secret_key, peer_directory_file
    ):
        name = f"target-{time.monotonic_ns()}"
        node = build_node(
            name, port or free_port(), page_bytes, slots, token=token, timing=TIMING, transport=transport, **checks
        )
        host = HostPool.allocate(MmapHostMemory(), bench_pool(page_bytes), pages)
        node.register_host_pool("kv", host.regions)
        made.append((node, host))
        return node, host

    yield make
    for node, host in made:
        node.close()
        host.free()


TRANSPORTS = ["nixl", pytest.param("ucx", marks=pytest.mark.ucx), "shm", "auto"]


def outcomes(result):
    return [o.outcome for o in result["kv"]]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_target_process_restores_source_pages_byte_equal(sources, target, transport):
    source = sources(64, transport=transport)
    node, host = target(transport=transport)
    keys = source.keys
    result = node.client.restore(source.endpoint, [PoolRead("kv", keys, list(range(100, 164)))])
    assert outcomes(result) == [Outcome.RESTORED] * 64
    for i, key in enumerate(keys):
        assert host.read(100 + i) == page_pattern(key, PAGE), f"page {i} differs"
    if transport == "auto":  # two processes on one host: the auto plane read over shm
        assert node.data_plane.plane_of(source.name) == "shm"
    if transport in ("shm", "auto"):
        # HELLO went over the side link, and the pages came off the source's slot board: no LEASE.
        shm = node.data_plane.shm if transport == "auto" else node.data_plane
        assert shm.side_requests == 1
        # A key the board lacks sends the batch through LEASE (over the side link), which answers it.
        again = node.client.restore(source.endpoint, [PoolRead("kv", [keys[0], "f" * 64], [0, 1])])
        assert outcomes(again) == [Outcome.RESTORED, Outcome.MISS]
        assert host.read(0) == page_pattern(keys[0], PAGE)
        assert shm.side_requests == 2


def test_kill_9_mid_restore_gives_misses_within_the_deadline_and_a_restarted_source_serves(sources, target):
    source = sources(96, page_bytes=8 << 20)
    node, host = target(page_bytes=8 << 20, pages=100)
    keys = source.keys
    lease = node.client.lease(source.endpoint, [("kv", keys)])
    assert lease is not None and len(lease.slots) == 96
    killer = threading.Timer(0.005, source.kill)
    started = time.monotonic()
    killer.start()
    result = node.client.read(lease, [PoolRead("kv", keys, list(range(96)))])
    elapsed = time.monotonic() - started
    killer.join()
    assert elapsed <= TIMING.operation_s + 1.0
    assert all(o in (Outcome.RESTORED, Outcome.FAILED, Outcome.MISS) for o in outcomes(result))
    assert node.client.quarantined == 0
    # After the kill nothing more can be had from that endpoint, quickly.
    started = time.monotonic()
    again = node.client.restore(source.endpoint, [PoolRead("kv", keys[:4], [0, 1, 2, 3])])
    assert outcomes(again) == [Outcome.MISS] * 4
    assert time.monotonic() - started <= TIMING.operation_s + 1.0
    # A restarted source on the same port serves again.
    time.sleep(TIMING.retry_after_s)
    reborn = sources(8, page_bytes=8 << 20, port=source.port)
    result = node.client.restore(reborn.endpoint, [PoolRead("kv", reborn.keys, list(range(8)))])
    assert outcomes(result) == [Outcome.RESTORED] * 8
    assert host.read(3) == page_pattern(reborn.keys[3], 8 << 20)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kill_9_between_lease_and_read(sources, target, transport):
    source = sources(8, transport=transport)
    node, _ = target(transport=transport)
    lease = node.client.lease(source.endpoint, [("kv", source.keys)])
    assert lease is not None
    source.kill()
    started = time.monotonic()
    result = node.client.read(lease, [PoolRead("kv", source.keys, list(range(8)))])
    assert time.monotonic() - started <= TIMING.operation_s + 1.0
    assert Outcome.RESTORED not in outcomes(result)


def test_stale_hint_pages_the_source_does_not_hold_are_misses(sources, target):
    source = sources(8)
    node, _ = target()
    evicted = bench_keys(4, start=10_000_000)
    result = node.client.restore(source.endpoint, [PoolRead("kv", [*source.keys[:2], *evicted], list(range(6)))])
    assert outcomes(result) == [Outcome.RESTORED] * 2 + [Outcome.MISS] * 4


def test_namespace_mismatch_is_an_incompatible_peer(sources, target):
    source = sources(4)
    node, _ = target(page_bytes=PAGE * 2)  # other geometry -> other namespace
    result = node.client.restore(source.endpoint, [PoolRead("kv", source.keys, [0, 1, 2, 3])])
    assert outcomes(result) == [Outcome.MISS] * 4


def test_without_the_token_a_peer_gets_nothing_and_another_version_is_refused(sources, target, tmp_path):
    import secrets

    token_file = tmp_path / "token"
    token_file.write_bytes(b"0123456789abcdef-cluster-secret")
    token_file.chmod(0o600)
    source = sources(4, token_file=str(token_file))
    node, _ = target()
    hello = protocol.encode(Hello(secrets.token_bytes(16), "intruder", "i", dict(node.runner.namespaces)))
    for token in (b"wrong-token-wrong-token", None):
        intruder = ZmqControlChannel("127.0.0.1", free_port(), token=token)
        try:
            started = time.monotonic()
            with pytest.raises(PeerUnavailable):  # CURVE: the server's handler never sees the frame
                intruder.request(source.endpoint, hello, 3.0)
            assert time.monotonic() - started < 2.0
        finally:
            intruder.close()
    member = ZmqControlChannel("127.0.0.1", free_port(), token=token_file.read_bytes().strip())
    try:
        assert isinstance(protocol.decode(member.request(source.endpoint, hello, 3.0)), HelloReply)
        other = protocol._encoder.encode((protocol.MAGIC, 99, protocol._encoder.encode(b"whatever")))
        refused = protocol.decode(member.request(source.endpoint, other, 3.0))
        assert isinstance(refused, Refused) and refused.code == RefusalCode.VERSION
    finally:
        member.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_remote_benchmark_command_runs_and_verifies_bytes(tmp_path, transport):
    # In a child: the command loads NIXL, and NIXL's UCX hooking memory events after ucxx's in the
    # pytest process would leave every later ucxx context there without a registration cache,
    # which peer mode refuses (issue 27, docs/ucx.md).
    out = tmp_path / "remote.json"
    port = free_port()
    args = [
        "bench",
        "remote",
        "--page-sizes",
        "64KiB,128KiB",  # two: the second ucx target used to fail (NIXL had loaded by then)
        "--batches",
        "8",
        "--reps",
        "2",
        "--port",
        str(port),
        "--json",
        str(out),
        "--transport",
        transport,
    ]
    done = subprocess.run(
        [sys.executable, "-m", "kvcr.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "raw NIXL READ" in done.stdout
    results = json.loads(out.read_text())
    assert [r["page_bytes"] for r in results] == [64 << 10, 128 << 10]
    for result in results:
        assert result["verified"] is True and result["pages"] == 8 and result["transport"] == transport
        assert result["checked_restore_p50_ms"] > 0 and result["verify_cost"] > 0  # verify_bytes on, same run
    if transport in ("shm", "auto"):  # the copy large same-host reads use, and the measurement behind it
        assert "Same-host reads of 64 MiB or more copied with" in done.stdout


def test_a_session_opened_over_a_side_link_is_bound_to_it_and_a_zmq_one_to_zmq(sources, target):
    """A LEASE under another connection's session is refused whichever way it comes (ZMQ or the shm side link)."""
    import secrets

    from kvcr.adapters.shm import ShmDataPlane

    source = sources(4, transport="shm")
    node, _ = target(transport="shm")
    namespaces = dict(node.runner.namespaces)
    channel = ZmqControlChannel("127.0.0.1", free_port())
    plane = ShmDataPlane(f"side-prober-{os.getpid()}", MmapHostMemory(shared=True))
    try:

        def ask_zmq(message):
            return protocol.decode(channel.request(source.endpoint, protocol.encode(message), 3.0))

        def ask_side(message):
            return protocol.decode(plane.side_request(peer.name, protocol.encode(message), 3.0))

        def lease(session):
            return Lease(secrets.token_bytes(16), session, 2000, [(kv.pool_id, source.keys)])

        over_zmq = ask_zmq(Hello(secrets.token_bytes(16), "prober", "p", namespaces))
        assert isinstance(over_zmq, HelloReply)
        (kv,) = [p for p in over_zmq.pools if p.name == "kv"]
        peer = plane.connect(over_zmq.data_plane, 5.0)
        over_side = ask_side(Hello(secrets.token_bytes(16), "prober", "p", namespaces))
        assert isinstance(over_side, HelloReply) and over_side.session != over_zmq.session
        for ask, foreign in ((ask_side, over_zmq.session), (ask_zmq, over_side.session)):
            refused = ask(lease(foreign))
            assert isinstance(refused, Refused) and refused.code == RefusalCode.UNKNOWN_SESSION
        for ask, own in ((ask_side, over_side.session), (ask_zmq, over_zmq.session)):
            granted = ask(lease(own))
            assert isinstance(granted, LeaseReply) and granted.lease_id
    finally:
        plane.close()
        channel.close()


@pytest.mark.parametrize(("digest", "served"), [("xxh3", True), ("blake3", False)])
def test_a_token_holder_that_rewrites_a_leased_page_over_nixl_is_served_under_xxh3_and_refused_under_blake3(
    sources, target, tmp_path, digest, served
):
    """Issue 23's compromised replica, in its own process with the cluster token: it leases a page, reads
    it over NIXL, writes back bytes with the same XXH3 digest. A target with ``verify_bytes`` restores
    those bytes under ``page_digest: xxh3`` and refuses them under ``blake3``."""
    token = b"forger-cluster-token-0123456789ab"
    token_file = tmp_path / "token"
    token_file.write_bytes(token)
    token_file.chmod(0o600)
    page_bytes = 16 << 10
    source = sources(
        4, page_bytes=page_bytes, token_file=str(token_file), extra=("--verify-bytes", "--page-digest", digest)
    )
    node, host = target(page_bytes=page_bytes, token=token, pages=8, verify_bytes=True, page_digest=digest)
    victim = source.keys[2]
    job = {
        "endpoint": source.endpoint,
        "token_file": str(token_file),
        "namespaces": node.runner.namespaces,
        "page": victim,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.nixl.forger", json.dumps(job)],
        cwd=REPO,
        env=dict(os.environ, UCX_NET_DEVICES="lo"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    forgery = json.loads(done.stdout.strip().splitlines()[-1])
    assert (forgery["read"], forgery["write"]) == ("DONE", "DONE")
    assert bytes.fromhex(forgery["original"]) == page_pattern(victim, page_bytes)  # it read the real page

    result = node.client.restore(source.endpoint, [PoolRead("kv", source.keys, [0, 1, 2, 3])])

    expected = [Outcome.RESTORED, Outcome.RESTORED, Outcome.RESTORED if served else Outcome.FAILED, Outcome.RESTORED]
    assert outcomes(result) == expected
    if served:  # what XXH3 lets through: bytes the source never backed up, accepted as its page
        assert host.read(2) == bytes.fromhex(forgery["forged"]) != page_pattern(victim, page_bytes)
    else:
        assert result["kv"][2].reason == "bytes differ from the source's digest"
    for slot in (0, 1, 3):
        assert host.read(slot) == page_pattern(source.keys[slot], page_bytes)


@pytest.mark.parametrize(
    ("transport", "digest"), [("shm", "xxh3"), ("shm", "blake3"), ("auto", "blake3"), ("nixl", "xxh3")]
)
def test_a_source_that_takes_another_sources_data_plane_name_is_refused_and_reads_stay_with_the_first(
    sources, target, transport, digest
):
    """Issue 43's name takeover: X describes its plane under Y's name and holds other bytes under Y's keys.

    Before, a target that had dialled X read X's arena (and X's board, digests included) over its
    cached link to Y: 8 of 8 pages "restored" wrong, whatever the digest. Now X is refused by name
    and Y's pages keep coming from Y."""
    checks = ("--verify-bytes", "--page-digest", digest)
    honest = sources(8, transport=transport, extra=checks, name="shared-plane-name")
    impostor = sources(8, transport=transport, extra=(*checks, "--impostor"), name="shared-plane-name")
    node, host = target(transport=transport, pages=8, verify_bytes=True, page_digest=digest)
    reads = [PoolRead("kv", honest.keys, list(range(8)))]
    assert impostor.keys == honest.keys

    assert outcomes(node.client.restore(honest.endpoint, reads)) == [Outcome.RESTORED] * 8
    host.zero()
    taken = node.client.restore(impostor.endpoint, reads)
    assert Outcome.RESTORED not in outcomes(taken)  # refused by name (counted: tests/runner/test_peer_links.py)
    again = node.client.restore(honest.endpoint, reads)

    assert outcomes(again) == [Outcome.RESTORED] * 8
    for slot, key in enumerate(honest.keys):
        assert host.read(slot) == page_pattern(key, PAGE), f"page {slot} is not the honest source's"


class Identities:
    """Per-node keys for nodes on loopback ports, one directory file listing them (rewritten by rename)."""

    def __init__(self, tmp_path: Path, *ports: int):
        from kvcr.adapters.zmq.identity import generate_secret_key

        self.path = tmp_path / "peers"
        self.keys = {port: generate_secret_key() for port in ports}
        self.files = {}
        for port, (secret, _) in self.keys.items():
            self.files[port] = tmp_path / f"node-{port}.key"
            self.files[port].write_bytes(secret)
            self.files[port].chmod(0o600)
        self.list(*ports)

    def list(self, *ports: int) -> None:
        staged = self.path.with_suffix(".new")
        staged.write_text("".join(f"tcp://127.0.0.1:{p} {self.keys[p][1].decode()}\n" for p in ports))
        os.replace(staged, self.path)

    def source_args(self, port: int) -> tuple[str, ...]:
        return ("--node-key-file", str(self.files[port]), "--directory", str(self.path))


def test_a_revoked_node_loses_its_same_host_side_link_within_half_a_second(sources, target, tmp_path):
    """Issue 43: a node refused over ZMQ in 32 ms kept leasing and reading over its old side link."""
    source_port, target_port = free_port(), free_port()
    ids = Identities(tmp_path, source_port, target_port)
    source = sources(8, transport="shm", port=source_port, extra=ids.source_args(source_port))
    node, host = target(
        transport="shm",
        pages=8,
        port=target_port,
        node_secret_key=ids.keys[target_port][0],
        peer_directory_file=str(ids.path),
    )
    reads = [PoolRead("kv", source.keys[:4], [0, 1, 2, 3])]
    assert outcomes(node.client.restore(source.endpoint, reads)) == [Outcome.RESTORED] * 4
    ids.list(source_port)  # the target's line removed
    time.sleep(0.5)
    host.zero()
    assert Outcome.RESTORED not in outcomes(node.client.restore(source.endpoint, reads))
    assert all(host.read(slot) == bytes(PAGE) for slot in range(4))


def test_one_nodes_side_links_share_its_lease_quota_with_each_other(sources, tmp_path):
    """One listed node over 4 side links pinned the whole lease cap (16/16); 4 ZMQ connections pinned 8."""
    import secrets

    from kvcr.adapters.shm import ShmDataPlane

    source_port, prober_port = free_port(), free_port()
    ids = Identities(tmp_path, source_port, prober_port)
    # 32 slots; peers may pin half (16), one peer a quarter of that (4 pages).
    source = sources(
        16, transport="shm", port=source_port, extra=(*ids.source_args(source_port), "--peer-share", "0.25")
    )
    memory = MmapHostMemory(shared=True)
    channel = ZmqControlChannel(
        "127.0.0.1", prober_port, node_secret_key=ids.keys[prober_port][0], peer_directory_file=str(ids.path)
    )
    planes = [ShmDataPlane(f"prober-{n}-{os.getpid()}", memory) for n in range(4)]
    try:
        granted = 0
        for n, plane in enumerate(planes):
            hello = Hello(secrets.token_bytes(16), plane.name, "p", source.info["namespaces"])
            over_zmq = protocol.decode(channel.request(source.endpoint, protocol.encode(hello), 3.0))
            assert isinstance(over_zmq, HelloReply)
            (kv,) = [p for p in over_zmq.pools if p.name == "kv"]
            peer = plane.connect(over_zmq.data_plane, 5.0)
            side_hello = Hello(secrets.token_bytes(16), plane.name, "p", hello.namespaces)
            over_side = protocol.decode(plane.side_request(peer.name, protocol.encode(side_hello), 3.0))
            assert isinstance(over_side, HelloReply)
            pages = source.keys[4 * n : 4 * n + 4]  # each link asks for pages of its own
            lease = Lease(secrets.token_bytes(16), over_side.session, 5000, [(kv.pool_id, pages)])
            reply = protocol.decode(plane.side_request(peer.name, protocol.encode(lease), 3.0))
            assert isinstance(reply, LeaseReply)
            granted += sum(slot >= 0 for slots in reply.slots for slot in slots)
        assert granted == 4  # the node's share, whichever link asked
    finally:
        for plane in planes:
            plane.close()
        channel.close()
        memory.close()


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_a_same_host_source_restarted_at_its_port_is_read_at_once(sources, target, transport):
    """Issue 44: over shm the first call after a restart failed on the old side link and skipped the
    new source for peer_retry_ms; over NIXL the new process already answered at once."""
    source = sources(8, transport=transport)
    node, host = target(transport=transport, pages=8)
    reads = [PoolRead("kv", source.keys, list(range(8)))]
    assert outcomes(node.client.restore(source.endpoint, reads)) == [Outcome.RESTORED] * 8
    source.kill()
    reborn = sources(8, transport=transport, port=source.port, extra=("--impostor",))  # other bytes, same keys
    host.zero()
    assert outcomes(node.client.restore(reborn.endpoint, reads)) == [Outcome.RESTORED] * 8
    for slot, key in enumerate(reborn.keys):
        assert host.read(slot) == page_pattern(key + "impostor", PAGE)  # the new process's bytes
    assert node.client.quarantined == 0
