"""Cost of the NIXL adapter: raw NIXL READs vs NixlDataPlane.read+poll vs memcpy, same run, same bytes.

    python -m kvcr.bench.nixl_adapter [--processes 1|2] [--pieces 64K,2M,8M] [--batches 32,128] [--idle-s 10]

For each page size x batch, a source data plane holds ``batch`` pages (random bytes) and the
target reads all of them into ``batch`` host pages, in random order on both sides (so nothing
merges). The source lives in this process (two agents, one process) or in a child process
(``--processes 2``). Three timings are interleaved, repetition by repetition:

- ``raw``: a separate NIXL agent of ours, prepared strided lists made once, index arrays made
  once; per repetition ``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state`` + ``release``.
- ``kvcr``: ``NixlDataPlane.read(peer, runs)`` + ``poll`` to DONE + ``release``, from PieceRuns
  made by ``slot_runs`` (as the runner makes them).
- ``raw-init``: the same agent, ``initialize_xfer`` from Nx3 (address, length, 0) arrays built
  once (the un-prepared alternative the adapter could have used).
- ``memcpy``: one ``numpy.copyto`` of the same byte count, in the target process.

Reported: p50 latency and GB/s (1e9 B) of each, and the ratios kvcr/raw (latency) and
raw/memcpy, kvcr/memcpy (throughput). ``--idle-s`` then measures the CPU the connected pair of
data planes uses while idle (this process, and the source process with ``--processes 2``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvcr.adapters.nixl import NixlDataPlane, described_peer
from kvcr.domain.layout import PieceRun, RegionDescriptor, slot_runs
from kvcr.ports.dataplane import TransferState

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True, slots=True)
class Row:
    processes: int
    piece_bytes: int
    batch: int
    raw_us: float
    kvcr_us: float
    memcpy_us: float
    raw_init_us: float

    @property
    def nbytes(self) -> int:
        return self.piece_bytes * self.batch

    def gbps(self, us: float) -> float:
        return self.nbytes / us / 1e3

    def line(self) -> str:
        size = f"{self.piece_bytes >> 10}KiB" if self.piece_bytes < 1 << 20 else f"{self.piece_bytes >> 20}MiB"
        return (
            f"{self.processes}p {size:>6} x {self.batch:3d}"
            f" | raw {self.raw_us:9.1f}us {self.gbps(self.raw_us):6.2f}GB/s"
            f" | raw-init {self.raw_init_us:9.1f}us"
            f" | kvcr {self.kvcr_us:9.1f}us {self.gbps(self.kvcr_us):6.2f}GB/s"
            f" | memcpy {self.memcpy_us:9.1f}us {self.gbps(self.memcpy_us):6.2f}GB/s"
            f" | kvcr/raw lat {self.kvcr_us / self.raw_us:5.3f}"
            f" | raw/memcpy {self.memcpy_us / self.raw_us:5.2f} kvcr/memcpy {self.memcpy_us / self.kvcr_us:5.2f}"
        )


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * _SUFFIX[text[-1]] if text[-1] in _SUFFIX else int(text)


# ---------------------------------------------------------------------- source side


class _Source:
    """A data plane holding one region of random pages; rebuilt per page size."""

    def __init__(self, name: str, wake_s: float | None) -> None:
        import numpy

        self._np = numpy
        self.plane = NixlDataPlane(name, progress_wake_s=wake_s)
        self.array: Any = None
        self._ids: tuple[int, ...] = ()

    def setup(self, piece: int, count: int, seed: int) -> bytes:
        np = self._np
        if self._ids:
            self.plane.deregister(self._ids)
        self.array = np.random.default_rng(seed).integers(0, 256, piece * count, dtype=np.uint8)
        region = RegionDescriptor(f"arena-{piece}-{count}", self.array.ctypes.data, piece, count, piece)
        self._ids = self.plane.register([region], exposed=True)
        return self.plane.describe()

    def close(self) -> None:
        self.plane.close()


def _source_process(conn: Any, name: str, wake_s: float | None) -> None:
    source = _Source(name, wake_s)
    try:
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            if message[0] == "cpu":
                conn.send(time.process_time())
                continue
            conn.send(source.setup(*message[1:]))
    finally:
        source.close()


# ---------------------------------------------------------------------- target side


def _spin(poll: Callable[[], str]) -> str:
    state = poll()
    while state == "PROC":
        state = poll()
    return state


def run(
    pieces: list[int],
    batches: list[int],
    reps: int,
    processes: int,
    wake_s: float | None = 0.1,
    idle_s: float = 0.0,
) -> list[Row]:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    tag = f"bench-{os.getpid()}"
    local_source: _Source | None = None
    if processes == 2:
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        child = context.Process(target=_source_process, args=(child_conn, f"{tag}-src", wake_s), daemon=True)
        child.start()

        def setup(piece: int, count: int, seed: int) -> bytes:
            conn.send(("setup", piece, count, seed))
            if not conn.poll(120):
                raise TimeoutError("the source process did not answer")
            return bytes(conn.recv())

        def source_cpu() -> float:
            conn.send(("cpu",))
            return float(conn.recv())
    else:
        local_source = _Source(f"{tag}-src", wake_s)
        setup = local_source.setup

        def source_cpu() -> float:
            return 0.0  # it is this process: counted with us

    plane = NixlDataPlane(f"{tag}-kvcr", progress_wake_s=wake_s)
    raw = nixl_agent(f"{tag}-raw", nixl_agent_config(enable_prog_thread=False, backends=[]))
    raw.create_backend("UCX", {})
    rows = []
    try:
        for piece in pieces:
            for batch in batches:
                rng = np.random.default_rng(piece + batch)
                description = setup(piece, batch, piece ^ batch)
                described = described_peer(description)
                src_id, first = next(iter(described.regions.items()))
                base = first.base
                dst = np.zeros(piece * batch, dtype=np.uint8)
                dst_region = RegionDescriptor("host", dst.ctypes.data, piece, batch, piece)
                memcpy_src = np.ones(piece * batch, dtype=np.uint8)
                (dst_id,) = plane.register([dst_region], exposed=False)
                peer = plane.connect(description, 10.0).name
                slots, places = rng.permutation(batch), rng.permutation(batch)
                pairs = [(int(s), int(d)) for s, d in zip(slots, places, strict=True)]
                runs = [PieceRun(src_id, s, dst_id, d, n) for s, d, n in slot_runs(pairs)]
                # Raw NIXL, same descriptors.
                registration = raw.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
                raw_peer = raw.add_remote_agent(described.metadata)
                raw_peer = raw_peer.decode() if isinstance(raw_peer, bytes) else str(raw_peer)
                remote = raw.prep_xfer_dlist(raw_peer, np.array([[base, piece, 0, piece, batch]], np.uint64), "DRAM")
                local = raw.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", np.array([[dst.ctypes.data, piece, 0, piece, batch]], np.uint64), "DRAM"
                )
                src_idx, dst_idx = slots.astype(np.int64), places.astype(np.int64)
                rows_src = np.stack([base + slots * piece, np.full(batch, piece), np.zeros(batch)], 1).astype(np.uint64)
                rows_dst = np.stack([dst.ctypes.data + places * piece, np.full(batch, piece), np.zeros(batch)], 1)
                rows_dst = rows_dst.astype(np.uint64)

                def raw_init_read() -> None:
                    local_descs = raw.get_xfer_descs(rows_dst, "DRAM")  # noqa: B023
                    remote_descs = raw.get_xfer_descs(rows_src, "DRAM")  # noqa: B023
                    xfer = raw.initialize_xfer("READ", local_descs, remote_descs, raw_peer)  # noqa: B023
                    state = raw.transfer(xfer)
                    state = _spin(lambda: raw.check_xfer_state(xfer)) if state == "PROC" else state
                    assert state == "DONE", state
                    xfer.release()

                def raw_read() -> None:
                    xfer = raw.make_prepped_xfer("READ", local, dst_idx, remote, src_idx)  # noqa: B023
                    state = raw.transfer(xfer)
                    state = _spin(lambda: raw.check_xfer_state(xfer)) if state == "PROC" else state
                    assert state == "DONE", state
                    xfer.release()

                def kvcr_read() -> None:
                    handle = plane.read(peer, runs)  # noqa: B023
                    state = plane.poll(handle)
                    while state is TransferState.PENDING:
                        state = plane.poll(handle)
                    assert state is TransferState.DONE, state
                    plane.release(handle)

                def memcpy() -> None:
                    np.copyto(dst, memcpy_src)  # noqa: B023

                order = [("raw", raw_read), ("kvcr", kvcr_read), ("raw_init", raw_init_read), ("memcpy", memcpy)]
                for _, warm in order * 2:
                    warm()
                timings: dict[str, list[float]] = {key: [] for key, _ in order}
                for rep in range(reps):
                    # Rotate who goes first: a later reader of the same pages may find them in cache.
                    shift = rep % 3
                    for key, call in order[shift:3] + order[:shift] + order[3:]:
                        start = time.perf_counter()
                        call()
                        timings[key].append((time.perf_counter() - start) * 1e6)
                kvcr_read()
                if local_source is not None:  # byte-check the last kvcr read
                    _check(dst, local_source.array, slots, places, piece)
                medians = (statistics.median(timings[k]) for k in ("raw", "kvcr", "memcpy", "raw_init"))
                row = Row(processes, piece, batch, *medians)
                print(row.line(), flush=True)
                rows.append(row)
                remote.release()
                local.release()
                raw.remove_remote_agent(raw_peer)
                raw.deregister_memory(registration)
                plane.disconnect(peer)
                plane.deregister([dst_id])
        if idle_s > 0:
            ours, theirs, start = time.process_time(), source_cpu(), time.monotonic()
            time.sleep(idle_s)
            elapsed = time.monotonic() - start
            idle = {"target_pct": 100 * (time.process_time() - ours) / elapsed}
            if processes == 2:
                idle["source_pct"] = 100 * (source_cpu() - theirs) / elapsed
            figures = ", ".join(f"{key} {value:.2f} %" for key, value in idle.items())
            print(f"idle CPU over {elapsed:.0f}s: {figures}", flush=True)
    finally:
        plane.close()
        if processes == 2:
            conn.send(("stop",))
            child.join(30)
        elif local_source is not None:
            local_source.close()
    return rows


def _check(dst: Any, src: Any, slots: Any, places: Any, piece: int) -> None:
    for s, d in zip(slots[:8], places[:8], strict=True):
        if not (dst[d * piece : (d + 1) * piece] == src[s * piece : (s + 1) * piece]).all():
            raise AssertionError(f"page {d} differs from slot {s}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", default="64K,2M,8M")
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1)
    parser.add_argument(
        "--wake-ms", type=float, default=100.0, help="NIXL progress thread's longest sleep (0 = no thread: no wire-up)"
    )
    parser.add_argument("--idle-s", type=float, default=0.0, help="then measure idle CPU for this long")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    pieces = [_size(p) for p in args.pieces.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    wake = args.wake_ms / 1e3 if args.wake_ms > 0 else None
    rows = run(pieces, batches, args.reps, args.processes, wake, args.idle_s)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(r) for r in rows], handle, indent=1)


if __name__ == "__main__":
    main()
