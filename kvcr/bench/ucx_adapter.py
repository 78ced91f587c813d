"""The UCX data plane against a memmove and a raw NIXL READ of the same pieces, in one run.

    python -m kvcr.bench.ucx_adapter [--pieces 64K,2M] [--batches 32,128] [--reps 10]
        [--modes peer,none] [--idle-s 20] [--netns] [--json PATH]

A source process holds ``batch`` pages of random bytes, registered with one UCX data plane per
error-handling mode and with a NIXL agent; this process reads all of them into ``batch`` host
pages, in random order on both sides (so no two pieces merge). Per repetition, interleaved, in a
rotating order:

- ``memmove``: the same pieces copied inside this process (``ctypes.memmove``, same order);
- ``nixl``: one raw NIXL READ (prepared lists, ``make_prepped_xfer`` + ``transfer`` + poll);
- ``ucx-<mode>``: ``UcxDataPlane.read`` + ``poll`` to DONE + ``release``.

Reported: p50 latency and GB/s (1e9 B) of each and the ratios to NIXL and to memmove; the UCX
protocols and transports the source's UCX chose (``UCX_PROTO_INFO``), and the CPU an idle
serving source uses over ``--idle-s`` seconds. ``--netns`` (root, iproute2) puts the source and
this process in two network namespaces joined by a veth pair.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcr.domain.layout import PieceRun, RegionDescriptor, slot_runs
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_NS = ("kvcr-bench-src", "kvcr-bench-dst")
_VETH = ("kvcrb0", "kvcrb1")
_ADDR = ("10.211.0.1", "10.211.0.2")


@dataclass(slots=True)
class Row:
    piece_bytes: int
    batch: int
    us: dict[str, float] = field(default_factory=dict)  # p50 per method

    def gbps(self, method: str) -> float:
        return self.piece_bytes * self.batch / self.us[method] / 1e3

    def line(self) -> str:
        size = f"{self.piece_bytes >> 10}KiB" if self.piece_bytes < 1 << 20 else f"{self.piece_bytes >> 20}MiB"
        cells = [f"{m} {self.us[m]:9.1f}us {self.gbps(m):6.2f}GB/s" for m in self.us]
        ratios = []
        for m in self.us:
            if m.startswith("ucx"):
                if "nixl" in self.us:
                    ratios.append(f"{m}/nixl {self.gbps(m) / self.gbps('nixl'):5.2f}")
                ratios.append(f"{m}/memmove {self.gbps(m) / self.gbps('memmove'):5.2f}")
        return f"{size:>6} x {self.batch:3d} | " + " | ".join(cells) + " | " + " ".join(ratios)


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * _SUFFIX[text[-1]] if text[-1] in _SUFFIX else int(text)


def _params(mode: str, devices: str) -> dict[str, str]:
    return {"ucx_devices": devices, "ucx_error_handling_mode": mode}


# ---------------------------------------------------------------------- source process


def _source_main(spec: dict[str, Any]) -> None:
    """The source: UCX planes per mode and a NIXL agent over the same pages; JSON lines on stdio."""
    import numpy as np

    from kvcr.adapters.ucx import UcxDataPlane
    from kvcr.adapters.ucx.binding import load

    # Each UCX library reads UCX_LOG_FILE when it loads: ours (ucxx's) gets spec["log"], NIXL's own
    # UCX copy, loaded later, another file, so the two never write over each other.
    os.environ["UCX_LOG_FILE"] = spec["log"]
    load()
    os.environ["UCX_LOG_FILE"] = spec["log"] + ".nixl"
    # PROTO_INFO is a UCP context option: only our contexts print their protocol tables.
    params = {m: {**_params(m, spec["devices"]), "PROTO_INFO": "y"} for m in spec["modes"]}
    planes = {m: UcxDataPlane(f"bench-src-{m}", backend_params=params[m]) for m in spec["modes"]}
    agent = None
    if spec["nixl"]:
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("bench-src-nixl", nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", {"ucx_devices": spec["devices"]})
        # UCX wire-up and keep-alive need the source's worker to progress now and then (as
        # NixlDataPlane's 5 ms pump does); the READs themselves do not.
        threading.Thread(target=_nixl_pump, args=(agent,), daemon=True).start()
    array: Any = None
    ids: dict[str, tuple[int, ...]] = {}
    registration = None
    _say({"ready": True})
    for line in sys.stdin:
        words = line.split()
        if words[0] == "setup":
            piece, batch, seed = (int(w) for w in words[1:])
            for m, plane in planes.items():
                if m in ids:
                    plane.deregister(ids[m])
            if registration is not None and agent is not None:
                agent.deregister_memory(registration)
            array = np.random.default_rng(seed).integers(0, 256, piece * batch, dtype=np.uint8)
            region = RegionDescriptor("arena", array.ctypes.data, piece, batch, piece)
            ids = {m: plane.register([region], exposed=True) for m, plane in planes.items()}
            answer: dict[str, Any] = {"ucx": {m: p.describe().hex() for m, p in planes.items()}, "ids": ids}
            if agent is not None:
                registration = agent.register_memory([(array.ctypes.data, array.nbytes, 0, "")], "DRAM")
                answer |= {"nixl": bytes(agent.get_agent_metadata()).hex(), "base": array.ctypes.data}
            _say(answer)
        elif words[0] == "cpu":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            _say({"cpu_s": usage.ru_utime + usage.ru_stime, "wall": time.monotonic()})
        elif words[0] == "quit":
            for plane in planes.values():
                plane.close()
            _say({"ok": True})
            return


def _nixl_pump(agent: Any) -> None:
    while True:
        time.sleep(0.005)
        agent.get_new_notifs()


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Source:
    def __init__(self, spec: dict[str, Any], env: dict[str, str], netns: str | None) -> None:
        command = [sys.executable, "-m", "kvcr.bench.ucx_adapter", "--source", json.dumps(spec)]
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        self._pending = b""
        self.ask(None, 120)

    def ask(self, command: str | None, timeout_s: float = 120) -> dict[str, Any]:
        """Send ``command``; its JSON answer (lines that are not JSON are other libraries' output)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command.encode() + b"\n")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"{"):
                    answer: dict[str, Any] = json.loads(line)
                    return answer
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"the source did not answer {command!r}")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"the source ended (rc={self.proc.wait(5)})")
            self._pending += chunk

    def close(self) -> None:
        with contextlib.suppress(Exception):  # it may be gone already
            self.ask("quit", 30)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


# ---------------------------------------------------------------------- target side


def run(
    pieces: list[int],
    batches: list[int],
    reps: int,
    modes: list[str],
    *,
    nixl: bool = True,
    idle_s: float = 0.0,
    netns: bool = False,
) -> tuple[list[Row], dict[str, Any]]:
    import numpy as np

    from kvcr.adapters.ucx import UcxDataPlane

    notes: dict[str, Any] = {}
    log_dir = tempfile.mkdtemp(prefix="kvcr-ucx-bench-")
    with contextlib.ExitStack() as stack:
        devices = "lo"
        if netns:  # we run inside _NS[1] already (see main)
            devices = _VETH[0]
            notes["netns"] = f"source in {_NS[0]} ({_ADDR[0]}), target in {_NS[1]} ({_ADDR[1]}), veth pair"
        spec = {"modes": modes, "nixl": nixl, "devices": devices, "log": os.path.join(log_dir, "source.log")}
        source = _Source(spec, dict(os.environ), _NS[0] if netns else None)
        stack.callback(source.close)
        target_devices = _VETH[1] if netns else "lo"
        planes = {m: UcxDataPlane(f"bench-dst-{m}", backend_params=_params(m, target_devices)) for m in modes}
        for plane in planes.values():
            stack.callback(plane.close)
        raw = None
        if nixl:
            from nixl._api import nixl_agent, nixl_agent_config

            raw = nixl_agent("bench-dst-nixl", nixl_agent_config(enable_prog_thread=False, backends=[]))
            raw.create_backend("UCX", {"ucx_devices": target_devices})
        rows = []
        for piece in pieces:
            for batch in batches:
                rows.append(_measure(np, source, planes, raw, piece, batch, reps, notes))
                print(rows[-1].line(), flush=True)
        if idle_s > 0:
            first = source.ask("cpu")
            time.sleep(idle_s)
            second = source.ask("cpu")
            busy = (second["cpu_s"] - first["cpu_s"]) / (second["wall"] - first["wall"])
            notes["idle_cpu"] = f"{busy:.2%} of a core over {second['wall'] - first['wall']:.1f}s (modes {modes})"
            print(f"idle source: {notes['idle_cpu']}", flush=True)
    notes["transports"] = transports(os.path.join(log_dir, "source.log"))
    target_log = os.environ.get("UCX_LOG_FILE")  # set by main() for a run across namespaces
    if target_log:
        notes["transports"] += [f"(target) {t}" for t in transports(target_log)]
    for line in notes["transports"]:
        print(f"UCX tagged sends: {line}", flush=True)
    return rows, notes


def _measure(
    np: Any, source: _Source, planes: dict[str, Any], raw: Any, piece: int, batch: int, reps: int, notes: dict[str, Any]
) -> Row:
    seed = piece ^ batch
    answer = source.ask(f"setup {piece} {batch} {seed}")
    rng = np.random.default_rng(piece + batch)
    slots, places = rng.permutation(batch), rng.permutation(batch)
    dst = np.zeros(piece * batch, dtype=np.uint8)
    local = np.random.default_rng(seed).integers(0, 256, piece * batch, dtype=np.uint8)  # = the source's bytes
    region = RegionDescriptor("host", dst.ctypes.data, piece, batch, piece)
    pairs = list(zip(slots.tolist(), places.tolist(), strict=True))
    calls: dict[str, Callable[[], None]] = {}
    cleanup: list[Callable[[], None]] = []

    def memmove() -> None:
        base_s, base_d = local.ctypes.data, dst.ctypes.data
        for s, d in pairs:
            ctypes.memmove(base_d + d * piece, base_s + s * piece, piece)

    calls["memmove"] = memmove
    if raw is not None:
        registration = raw.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        peer = raw.add_remote_agent(bytes.fromhex(answer["nixl"]))
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        remote = raw.prep_xfer_dlist(peer, np.array([[answer["base"], piece, 0, piece, batch]], np.uint64), "DRAM")
        rows = np.array([[dst.ctypes.data, piece, 0, piece, batch]], np.uint64)
        mine = raw.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
        src_idx, dst_idx = slots.astype(np.int64), places.astype(np.int64)

        def nixl_read() -> None:
            xfer = raw.make_prepped_xfer("READ", mine, dst_idx, remote, src_idx)
            state = raw.transfer(xfer)
            while state == "PROC":
                state = raw.check_xfer_state(xfer)
            assert state == "DONE", state
            xfer.release()

        calls["nixl"] = nixl_read

        def undo_nixl() -> None:
            remote.release()
            mine.release()
            raw.remove_remote_agent(peer)
            raw.deregister_memory(registration)

        cleanup.append(undo_nixl)
    for mode, plane in planes.items():
        (did,) = plane.register([region], exposed=False)
        try:
            info = plane.connect(bytes.fromhex(answer["ucx"][mode]), 10.0)
        except PeerUnavailable as exc:
            notes[f"ucx-{mode}"] = f"no column: {exc}"
            print(f"ucx-{mode}: {exc}", flush=True)
            plane.deregister([did])
            continue
        name = info.name
        notes[f"late_writes[ucx-{mode}]"] = info.late_writes
        (sid,) = answer["ids"][mode]
        runs = [PieceRun(sid, s, did, d, n) for s, d, n in slot_runs(pairs)]

        def ucx_read(plane: Any = plane, name: str = name, runs: list[PieceRun] = runs) -> None:
            handle = plane.read(name, runs)
            state = plane.poll(handle)
            while state is TransferState.PENDING:
                state = plane.poll(handle)
            assert state is TransferState.DONE, state
            plane.release(handle)

        calls[f"ucx-{mode}"] = ucx_read

        def undo_ucx(plane: Any = plane, did: int = did, name: str = name) -> None:
            plane.disconnect(name)
            plane.deregister([did])

        cleanup.append(undo_ucx)
    order = list(calls)
    for key in order * 2:
        calls[key]()
    timings: dict[str, list[float]] = {key: [] for key in order}
    for rep in range(reps):
        shift = rep % len(order)
        for key in order[shift:] + order[:shift]:
            start = time.perf_counter()
            calls[key]()
            timings[key].append((time.perf_counter() - start) * 1e6)
    for key in order:  # every method leaves the right bytes
        dst[:] = 0
        calls[key]()
        for s, d in pairs[:16]:
            if not (dst[d * piece : (d + 1) * piece] == local[s * piece : (s + 1) * piece]).all():
                raise AssertionError(f"{key}: page {d} differs from source slot {s}")
    for undo in cleanup:
        undo()
    return Row(piece, batch, {k: statistics.median(v) for k, v in timings.items()})


_TABLE = re.compile(r"\|\s*ucp_context_\d+ (\S+) cfg#\d+ \| tagged message by ucp_tag_send\* from host memory")
_ROW = re.compile(r"\|\s*([0-9.KMGinf]+(?:\.\.[0-9KMGinf]+)?)\s*\|\s*(.+?)\s*\|\s*(\S+)\s*\|")


def transports(log_path: str) -> list[str]:
    """The protocols UCX chose for tagged sends of host memory (from the source's UCX_PROTO_INFO)."""
    try:
        with open(log_path) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ["(no UCX log)"]
    found: list[str] = []
    i = 0
    while i < len(lines):
        match = _TABLE.search(lines[i])
        if match:
            rows = []
            for line in lines[i + 2 : i + 12]:  # past the table's rule line, up to its closing one
                row = _ROW.search(line)
                if row is None:
                    break
                rows.append(f"{row.group(1)}: {row.group(2)} [{row.group(3)}]")
            summary = f"{match.group(1)}: " + "; ".join(rows)
            if summary not in found:
                found.append(summary)
        i += 1
    return found or ["(no tagged-send protocol table in the UCX log)"]


@contextlib.contextmanager
def _namespaces() -> Iterator[None]:
    """Two network namespaces joined by a veth pair (root only); removed afterwards."""

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    for ns in _NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        for ns in _NS:
            ip("netns", "add", ns)
        ip("link", "add", _VETH[0], "type", "veth", "peer", "name", _VETH[1])
        for ns, veth, addr in zip(_NS, _VETH, _ADDR, strict=True):
            ip("link", "set", veth, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in _NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pieces", default="64K,2M")
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--modes", default="peer,none", help="UCX error-handling modes to measure")
    parser.add_argument("--no-nixl", action="store_true", help="skip the raw NIXL READ column")
    parser.add_argument("--idle-s", type=float, default=0.0, help="then measure an idle source's CPU this long")
    parser.add_argument("--netns", action="store_true", help="source and target in two network namespaces")
    parser.add_argument("--json", help="also write the rows and notes here")
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.source:
        _source_main(json.loads(args.source))
        return
    if args.netns and not args.inside_netns:
        # Namespaces belong to a process's threads from their start: run the target side anew in
        # its namespace rather than moving this process (the source gets `ip netns exec` too).
        rest = sys.argv[1:] if argv is None else list(argv)
        log = os.path.join(tempfile.mkdtemp(prefix="kvcr-ucx-bench-"), "target.log")
        env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": log}
        with _namespaces():
            command = ["ip", "netns", "exec", _NS[1], sys.executable, "-m", "kvcr.bench.ucx_adapter"]
            sys.exit(subprocess.run([*command, *rest, "--inside-netns"], env=env).returncode)
    rows, notes = run(
        [_size(p) for p in args.pieces.split(",")],
        [int(b) for b in args.batches.split(",")],
        args.reps,
        [m for m in args.modes.split(",") if m],
        nixl=not args.no_nixl,
        idle_s=args.idle_s,
        netns=args.netns,
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": [asdict(r) for r in rows], "notes": notes}, handle, indent=1)


if __name__ == "__main__":
    main()
