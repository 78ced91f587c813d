"""``kvcr doctor``'s transport check: a READ from this process into a child process, the way a peer reads.

The child runs with ``UCX_PROTO_INFO=y``, so UCX itself prints which protocol and transport it
chose for ``ucp_get``; that table is the verdict, and the rate against memmove and whether READs
finish with the source idle are reported beside it. Why a fallback matters, and the in-process
check the data plane runs, are in :mod:`kvcr.adapters.nixl.probe`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcr.adapters.nixl.probe import explain_fallback, memmove_rate_gbps, probe_tag, ptrace_scope


@dataclass(frozen=True, slots=True)
class ProtoRow:
    """One row of a UCX_PROTO_INFO table: a message-size range and how UCX moves it."""

    size_range: str  # as UCX prints it: "0..inf", "8185..65528", "0"
    description: str  # "zero-copy", "software emulation", "short", "multi-frag copy-in", ...
    config: str  # transport/device, e.g. "cma/memory", "tcp/lo", "rc_mlx5/mlx5_0:1"

    def covers(self, nbytes: int) -> bool:
        low, dots, high = self.size_range.partition("..")
        try:
            first = int(low)
            last = first if not dots else (nbytes if high == "inf" else int(high))
        except ValueError:
            return False
        return first <= nbytes <= last


@dataclass(frozen=True, slots=True)
class TransportReport:
    """What a READ between two processes on this host used, and how fast it ran against memmove."""

    zero_copy: bool
    rows: tuple[ProtoRow, ...]  # UCX's table for ucp_get between the two processes (empty: not reported)
    nbytes: int
    read_gbps: float  # best READ; 0.0 when none completed
    memmove_gbps: float
    solo_reads: int  # READs that finished while the source process did not progress at all
    verified: bool  # the bytes read equal the source's
    ptrace_scope: int | None
    ucx_tls: str | None
    causes: tuple[str, ...] = ()  # why there is no zero-copy path, or why the READ failed

    @property
    def transport(self) -> str | None:
        """The transport UCX chose for READs of ``nbytes`` (e.g. ``cma/memory``), or None if not reported."""
        row = self._row()
        return row.config if row else None

    def _row(self) -> ProtoRow | None:
        for row in self.rows:
            if row.covers(self.nbytes):
                return row
        return self.rows[-1] if self.rows else None

    def summary(self) -> str:
        """One line: the transport, how UCX moves the bytes, and the rate against memmove."""
        row = self._row()
        how = f"{row.config} ({row.description})" if row else "a transport UCX did not report"
        size = f"{self.nbytes / (1 << 20):g} MiB"
        if self.read_gbps > 0:
            rate = (
                f"{size} READ {self.read_gbps:.2f} GB/s = {self.read_gbps / self.memmove_gbps:.2f}x memmove "
                f"({self.memmove_gbps:.2f} GB/s)"
            )
        else:
            rate = f"no {size} READ completed"
        alone = "finishes without the source's help" if self.solo_reads else "needs the source to progress"
        text = f"READs between processes use {how}: {rate}, {alone}"
        return text if not self.causes else f"{text}; cause: " + "; ".join(self.causes)


_TITLE = "remote memory read by ucp_get"


def parse_proto_info(text: str) -> tuple[ProtoRow, ...]:
    """The ucp_get rows UCX_PROTO_INFO=y printed for endpoints to another process ("self" tables skipped)."""
    rows: list[ProtoRow] = []
    lines = [line.split("]", 2)[-1].strip() if line.startswith("[") else line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if _TITLE not in line or (i and " self " in lines[i - 1]):
            continue
        for table_line in lines[i + 1 : i + 24]:
            if table_line.startswith("+"):
                continue
            cells = [c.strip() for c in table_line.strip("|").split("|")]
            if not table_line.startswith("|") or len(cells) != 3:
                break  # the table ended (the next one starts with a one-cell title)
            if cells[0] != "Range":
                rows.append(ProtoRow(cells[0], cells[1], cells[2]))
    return tuple(dict.fromkeys(rows))  # the same table prints once per endpoint configuration


_SAY = "KVCR-PROBE"


def probe_transport(
    *,
    backend_params: Mapping[str, str] | None = None,
    nbytes: int = 64 << 20,
    repeats: int = 5,
    solo_s: float = 1.0,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> TransportReport:
    """READ ``nbytes`` from this process into a child process over NIXL and report what UCX used.

    This process is the source: it registers a buffer and, while the child wires up (which needs
    both sides), progresses its worker; then it stops progressing entirely while the child times
    its READs. The child runs with ``UCX_PROTO_INFO=y``, so UCX itself prints which protocol and
    transport it chose for ``ucp_get`` to another process; that table is the verdict. A zero-copy
    path (CMA, RDMA, knem, xpmem) is quiet; software emulation (``UCX_TLS=tcp``, CMA blocked) is
    reported with its likely cause. Should a READ need the source's help after all, the child
    says so and this process progresses again, so the probe always ends.

    Args:
        backend_params: UCX backend parameters, as the data plane passes them.
        nbytes: bytes per READ (64 MiB: past most caches, so memmove runs at DRAM speed too).
        repeats: timed READs and memmoves; the best of each is reported.
        solo_s: how long the child waits for a READ with the source idle before asking for help.
        timeout_s: bound on the whole probe.
        env: extra environment for the child (e.g. ``{"UCX_TLS": "tcp"}``); this process's own
            UCX settings apply to the source side.

    Returns:
        The report; it never raises for a slow, emulated or failed READ (that is what it reports).
    """
    merged_env = {**os.environ, **(env or {})}
    scope = ptrace_scope()
    tls = merged_env.get("UCX_TLS") or None
    memmove_gbps = memmove_rate_gbps(nbytes, repeats)
    causes: list[str] = []
    outcome: dict[str, Any] = {}
    rows: tuple[ProtoRow, ...] = ()
    try:
        outcome, ucx_text = _run_reader(dict(backend_params or {}), nbytes, repeats, solo_s, timeout_s, merged_env)
        rows = parse_proto_info(ucx_text)
    except Exception as exc:  # the probe reports; the caller decides what a failure means
        causes.append(f"the two-process READ did not complete: {exc}")
    times = [float(t) for t in outcome.get("solo", []) + outcome.get("assisted", [])]
    read_gbps = nbytes / min(times) / 1e9 if times else 0.0
    solo = len(outcome.get("solo", []))
    verified = bool(outcome.get("verified"))
    if outcome and not verified:
        causes.append("the READ completed but the bytes differ from the source's")
    report = TransportReport(True, rows, nbytes, read_gbps, memmove_gbps, solo, verified, scope, tls)
    row = report._row()
    # UCX's own table decides; without one, whether READs finish with the source idle does.
    zero_copy = not causes and ("zero-copy" in row.description if row is not None else solo > 0)
    if not zero_copy:
        causes.extend(explain_fallback(scope, tls))
    return TransportReport(zero_copy, rows, nbytes, read_gbps, memmove_gbps, solo, verified, scope, tls, tuple(causes))


def _run_reader(
    params: dict[str, str], nbytes: int, repeats: int, solo_s: float, timeout_s: float, env: dict[str, str]
) -> tuple[dict[str, Any], str]:
    import base64
    import hashlib
    import json
    import queue
    import subprocess
    import sys
    import threading

    from nixl._api import nixl_agent, nixl_agent_config

    _quiet_nixl()
    tag = probe_tag()
    agent = nixl_agent(f"{tag}-src", nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", params)
    src = ctypes.create_string_buffer(nbytes)
    ctypes.memmove(src, os.urandom(min(nbytes, 1 << 16)) * (nbytes // (1 << 16) + 1), nbytes)
    address = ctypes.addressof(src)
    registration = agent.register_memory([(address, nbytes, 0, "")], "DRAM")
    request = {
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "address": address,
        "nbytes": nbytes,
        "repeats": repeats,
        "solo_s": solo_s,
        "params": params,
        "name": f"{tag}-dst",
        "sha256": hashlib.sha256(ctypes.string_at(address, nbytes)).hexdigest(),
        "timeout_s": timeout_s,
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "kvcr.adapters.nixl.transport_probe", "--reader"],
        env={**env, "UCX_PROTO_INFO": "y", "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump_lines() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump_lines, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    other: list[str] = []
    result: dict[str, Any] | None = None
    try:
        assert child.stdin is not None
        child.stdin.write(json.dumps(request) + "\n")
        child.stdin.flush()
        assisting = True  # the wire-up needs both sides
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the reader process within {timeout_s:.0f}s")
            try:
                line = lines.get(timeout=0.0005 if assisting else min(left, 0.25))
            except queue.Empty:
                if assisting:
                    agent.get_new_notifs()  # drives this worker: what an emulated READ waits for
                continue
            if line is None:
                break
            if line.startswith(_SAY + " "):
                word, _, rest = line[len(_SAY) + 1 :].strip().partition(" ")
                if word == "WIRED":
                    assisting = False
                elif word == "ASSIST":
                    assisting = True
                elif word == "RESULT":
                    result = json.loads(rest)
                elif word == "ERROR":
                    raise RuntimeError(rest)
            else:
                other.append(line)
            if assisting:
                agent.get_new_notifs()
        child.wait(max(deadline - time.monotonic(), 1.0))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        reader.join(1.0)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()
        with contextlib.suppress(Exception):
            agent.deregister_memory(registration)
    if result is None:
        tail = " ".join(line.strip() for line in other[-3:] if "NIXL" not in line)
        raise RuntimeError(f"the reader process exited with {child.returncode} and no result ({tail[-300:]})")
    return result, "".join(other)


def _quiet_nixl() -> None:
    """NIXL's wrapper logs INFO lines to stdout per agent; the probe's agents are not news (NIXL_LOG_LEVEL wins)."""
    import logging

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger = logging.getLogger("nixl")
        if logger.getEffectiveLevel() < logging.WARNING:
            logger.setLevel(logging.WARNING)


def _reader_main() -> int:
    """The child of :func:`probe_transport`: READ from the parent, say how it went, exit."""
    import base64
    import hashlib
    import json
    import sys

    _quiet_nixl()

    def say(*words: str) -> None:
        print(_SAY, *words, flush=True)

    try:
        from nixl._api import nixl_agent, nixl_agent_config

        request = json.loads(sys.stdin.readline())
        nbytes = int(request["nbytes"])
        deadline = time.monotonic() + float(request["timeout_s"])
        agent = nixl_agent(request["name"], nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", request["params"])
        dst = ctypes.create_string_buffer(nbytes)
        dst_address = ctypes.addressof(dst)
        agent.register_memory([(dst_address, nbytes, 0, "")], "DRAM")
        peer = agent.add_remote_agent(base64.b64decode(request["metadata"]))
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        local = agent.get_xfer_descs([(dst_address, nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(int(request["address"]), nbytes, 0)], "DRAM")

        def read(alone_s: float | None) -> tuple[str, float]:
            """One READ; with ``alone_s`` it gives up waiting after that long (and returns PROC)."""
            start = time.perf_counter()
            xfer = agent.initialize_xfer("READ", local, remote, peer)
            state = agent.transfer(xfer)
            until = time.monotonic() + alone_s if alone_s is not None else deadline
            while state == "PROC" and time.monotonic() < min(until, deadline):
                state = agent.check_xfer_state(xfer)
            elapsed = time.perf_counter() - start
            if state == "PROC":
                say("ASSIST")
                while state == "PROC" and time.monotonic() < deadline:
                    state = agent.check_xfer_state(xfer)
                if state == "PROC":
                    raise TimeoutError("a READ did not finish even with the source progressing")
            xfer.release()
            if state != "DONE":
                raise RuntimeError(f"READ ended in state {state}")
            return ("solo" if alone_s is not None and elapsed < alone_s else "assisted"), elapsed

        read(None)  # wire-up: the parent progresses meanwhile
        say("WIRED")
        times: dict[str, list[float]] = {"solo": [], "assisted": []}
        for _ in range(max(int(request["repeats"]), 1)):
            kind, elapsed = read(float(request["solo_s"]) if not times["assisted"] else None)
            times[kind].append(elapsed)
        verified = hashlib.sha256(ctypes.string_at(dst_address, nbytes)).hexdigest() == request["sha256"]
        agent.remove_remote_agent(peer)
        say("RESULT", json.dumps({**times, "verified": verified}))
        return 0
    except Exception as exc:  # reported to the parent as one line
        say("ERROR", f"{type(exc).__name__}: {exc}".replace("\n", " "))
        return 1


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--reader"]:
        sys.exit(_reader_main())
    sys.exit("usage: python -m kvcr.adapters.nixl.transport_probe --reader (started by probe_transport)")
