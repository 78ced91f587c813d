"""Does UCX give NIXL a zero-copy path on this host, or did it fall back to emulated RMA?

UCX picks its transports silently. Between processes on one host the fast path for DRAM is CMA
(``process_vm_readv``); across hosts it is RDMA. When neither is usable (``UCX_TLS`` narrowed to
``tcp``, Yama's ``ptrace_scope`` too strict, seccomp in a container), UCX emulates a READ in
software over tcp or shared-memory FIFOs: several times slower for big READs and up to 100x for
small pages, and the source must progress its worker for a read to finish at all. Nothing fails,
so nobody notices; hence two checks, both measurements rather than readings of settings (the
settings are read only to name the cause of a fallback):

* :func:`~kvcr.adapters.nixl.transport_probe.probe_transport` (``transport_probe.py``; what ``kvcr
  doctor`` runs): a READ from this process into a child process, the way a peer reads. The child
  runs with ``UCX_PROTO_INFO=y``, so UCX prints which protocol and transport it chose for
  ``ucp_get``; that table is the verdict, and the rate against memmove and whether READs finish with
  the source idle are reported beside it.
* :func:`check_zero_copy`: two throwaway agents in one process (two UCX workers, so UCX must pick
  a real transport; one agent reading itself would use UCX's ``self`` transport, a plain memcpy)
  READ from each other. Its verdict is only whether READs finish while the source sits still,
  which an emulation cannot do. UCX decides per context whether CMA is usable at all (its cma
  transport reads ``/proc/sys/kernel/yama/ptrace_scope`` and tries ``prctl(PR_SET_PTRACER_ANY)``),
  so this in-process READ sees the transport a peer would.

Speed is never the verdict: a cache-hot memmove runs 3-8x faster than a CMA READ, and a loaded
2-core host moves both figures by more than that (an earlier speed threshold warned on healthy
hosts). Not covered: CMA also needs both processes under the same uid; a cross-uid peer falls
back even when these checks pass.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_CAP_SYS_PTRACE = 19
# Transports that give UCX a zero-copy RMA path (CMA, kernel-assisted shm, RDMA, GPU IPC).
_ZERO_COPY_TLS = frozenset(
    {"all", "sm", "cma", "knem", "xpmem", "ib", "rc", "rc_v", "rc_x", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "cuda_ipc"}
)
_probe_ids = itertools.count()
_abandoned: list[object] = []  # buffers and agents of a probe READ that never finished
_ASSIST_MIN_S = 1.0  # help every probe READ gets from its source, even past the probe's bound


@dataclass(frozen=True, slots=True)
class ZeroCopyReport:
    """What the start-up probe measured and, on a fallback, why it thinks so."""

    zero_copy: bool
    nbytes: int
    read_gbps: float  # 0.0 when the probe could not run
    memcpy_gbps: float
    ptrace_scope: int | None  # None: no Yama on this kernel
    ucx_tls: str | None
    causes: tuple[str, ...] = ()

    @property
    def slowdown(self) -> float:
        """How many times slower than memmove the loopback READ was (inf if it did not run)."""
        return self.memcpy_gbps / self.read_gbps if self.read_gbps > 0 else float("inf")

    def summary(self) -> str:
        """One line for a log."""
        size = f"{self.nbytes / (1 << 20):g} MiB"
        if self.read_gbps > 0:
            speed = f"loopback READ {self.read_gbps:.2f} GB/s vs memmove {self.memcpy_gbps:.2f} GB/s ({size})"
        else:
            speed = f"no loopback READ of {size} completed on its own (memmove {self.memcpy_gbps:.2f} GB/s)"
        if self.zero_copy:
            return f"UCX zero-copy path in use: {speed}"
        return f"UCX has no zero-copy path, RMA is emulated or broken: {speed}; " + "; ".join(self.causes)


def check_zero_copy(
    *,
    backend_params: Mapping[str, str] | None = None,
    nbytes: int = 4 << 20,
    repeats: int = 5,
    solo_s: float = 0.5,
    timeout_s: float = 5.0,
    clock: ProbeClock = time,
    on_post: Callable[[int], None] | None = None,
) -> ZeroCopyReport:
    """Run loopback NIXL READs between two throwaway agents of this process; did UCX find a zero-copy path?

    The verdict rests only on what a software emulation cannot do: finish a READ while the source
    does not progress. After a wire-up READ, each timed READ is polled by the target alone for up
    to ``solo_s``; if none finishes alone, RMA is emulated. Speed is reported, never judged: a
    cache-hot memmove of a few MiB runs 3-8x faster than a CMA READ, and a loaded 2-core host
    moves both figures by more than that, so a speed threshold cried wolf on healthy hosts. For
    the transport UCX really chose between two processes, use :func:`probe_transport`.

    Args:
        backend_params: the UCX backend parameters the data plane uses (same transport choice).
        nbytes: bytes per READ; a few MiB keeps the per-call overhead out of the figure.
        repeats: timed READs (and memmoves); the best of each is reported.
        solo_s: how long a READ may take with only the target progressing (CMA: under 1 ms;
            generous so that a loaded host does not look like an emulating one).
        timeout_s: bound on the whole probe; a READ that does not finish by then is a fallback
            (each READ still gets ``_ASSIST_MIN_S`` of its source's help, so one that outlived
            the bound only because this process was stopped ends rather than being abandoned).
        clock: where the READs' deadlines and timings come from (``time``; a test stands in a
            clock that jumps, as for a process stopped mid-READ).
        on_post: called with each READ's number (0: the wire-up READ) right after it is posted.

    Returns:
        The report; it never raises for a slow or failed probe (that is what it reports).
    """
    scope = ptrace_scope()
    tls = os.environ.get("UCX_TLS") or None
    memcpy_gbps = memmove_rate_gbps(nbytes, repeats)
    causes: list[str] = []
    try:
        measured = _loopback_reads(dict(backend_params or {}), nbytes, repeats, timeout_s, solo_s, clock, on_post)
        read_gbps = nbytes / measured.best_s / 1e9 if measured.solo_reads else 0.0
        if not measured.solo_reads:
            causes.append(
                f"none of {measured.assisted_reads} loopback READs finished unless the source progressed: "
                "UCX is emulating RMA in software"
            )
    except Exception as exc:  # the probe reports; the data plane decides what a failure means
        read_gbps = 0.0
        causes.append(f"the loopback READ did not complete: {exc}")
    zero_copy = not causes
    if not zero_copy:
        causes.extend(explain_fallback(scope, tls))
    return ZeroCopyReport(zero_copy, nbytes, read_gbps, memcpy_gbps, scope, tls, tuple(causes))


# ---------------------------------------------------------------------- measurement


def memmove_rate_gbps(nbytes: int, repeats: int) -> float:
    src = ctypes.create_string_buffer(nbytes)
    dst = ctypes.create_string_buffer(nbytes)
    ctypes.memset(src, 0x5A, nbytes)
    ctypes.memmove(dst, src, nbytes)  # fault the pages in before timing
    best = float("inf")
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        ctypes.memmove(dst, src, nbytes)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


class ProbeClock(Protocol):
    """What the probe reads the time from (the ``time`` module has both)."""

    def monotonic(self) -> float: ...

    def perf_counter(self) -> float: ...


@dataclass(frozen=True, slots=True)
class _Measured:
    solo_reads: int  # READs that completed while only the target progressed
    assisted_reads: int  # READs that completed only once the source progressed too
    best_s: float  # fastest solo READ (inf when none)


def _loopback_reads(
    params: dict[str, str],
    nbytes: int,
    repeats: int,
    timeout_s: float,
    solo_s: float,
    clock: ProbeClock,
    on_post: Callable[[int], None] | None,
) -> _Measured:
    from nixl._api import nixl_agent, nixl_agent_config

    tag = probe_tag()
    deadline = clock.monotonic() + timeout_s
    agents: list[Any] = []
    handles: list[Any] = []
    try:
        for side in ("src", "dst"):
            agent = nixl_agent(f"{tag}-{side}", nixl_agent_config(enable_prog_thread=False, backends=[]))
            agent.create_backend("UCX", params)
            agents.append(agent)
        source, target = agents
        src = ctypes.create_string_buffer(nbytes)
        dst = ctypes.create_string_buffer(nbytes)
        ctypes.memset(src, 0xA5, nbytes)
        src_addr, dst_addr = ctypes.addressof(src), ctypes.addressof(dst)
        handles.append((source, source.register_memory([(src_addr, nbytes, 0, "")], "DRAM")))
        handles.append((target, target.register_memory([(dst_addr, nbytes, 0, "")], "DRAM")))
        peer = target.add_remote_agent(source.get_agent_metadata())
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        local = target.get_xfer_descs([(dst_addr, nbytes, 0)], "DRAM")
        remote = target.get_xfer_descs([(src_addr, nbytes, 0)], "DRAM")
        solo = assisted = 0
        best = float("inf")
        for attempt in range(max(repeats, 1) + 1):
            # The first READ wires the endpoint up, which needs both sides; after that a real RMA
            # path (CMA, RDMA) completes with only the target progressing, an emulated one cannot.
            alone_until = clock.monotonic() + (solo_s if attempt else 0.0)
            start = clock.perf_counter()
            xfer = target.initialize_xfer("READ", local, remote, peer)
            state = target.transfer(xfer)
            if on_post is not None:
                on_post(attempt)
            while state == "PROC" and clock.monotonic() < alone_until:
                state = target.check_xfer_state(xfer)
            elapsed = clock.perf_counter() - start
            helped = state == "PROC"
            # At least _ASSIST_MIN_S of help, whatever the bound says: both agents are ours, so a
            # READ that outlived the bound only because this process was stopped (SIGSTOP, a
            # freezer cgroup) ends as soon as the source progresses; abandoning it would keep
            # both agents alive for the life of the process.
            assist_until = max(deadline, clock.monotonic() + _ASSIST_MIN_S)
            while state == "PROC" and clock.monotonic() < assist_until:
                source.get_new_notifs()
                state = target.check_xfer_state(xfer)
            if state == "PROC":
                # Still live: releasing would only detach it (see dataplane.py), so everything it
                # touches stays alive for the life of the process.
                _abandoned.append((agents[:], handles[:], src, dst, xfer))
                handles.clear()
                raise TimeoutError(f"no completion within {timeout_s:.1f}s")
            xfer.release()
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
            if attempt and helped:
                assisted += 1
            elif attempt:
                solo += 1
                best = min(best, elapsed)
        if ctypes.string_at(dst_addr, 64) != ctypes.string_at(src_addr, 64):
            raise RuntimeError("the READ completed but the bytes differ")
        target.remove_remote_agent(peer)
        return _Measured(solo, assisted, best)
    finally:
        for agent, registration in handles:
            with contextlib.suppress(Exception):  # best effort: the throwaway agents go away next
                agent.deregister_memory(registration)
        agents.clear()


# ---------------------------------------------------------------------- causes


def explain_fallback(scope: int | None, tls: str | None) -> list[str]:
    causes = []
    if tls is not None and not _tls_allows_zero_copy(tls):
        causes.append(f"UCX_TLS={tls} leaves UCX no zero-copy transport (it needs cma, sm, knem, xpmem or an RDMA one)")
    if scope == 3:
        causes.append("kernel.yama.ptrace_scope=3 forbids process_vm_readv, so UCX disabled CMA")
    elif scope == 2 and not _has_cap_sys_ptrace():
        causes.append("kernel.yama.ptrace_scope=2 and no CAP_SYS_PTRACE, so UCX disabled CMA")
    if not causes:
        causes.append(
            "UCX found no usable zero-copy transport (CMA blocked by seccomp or the container? "
            "run with UCX_PROTO_INFO=y to see what UCX chose)"
        )
    return causes


def _tls_allows_zero_copy(tls: str) -> bool:
    spec = tls.strip().lower()
    names = {name.strip() for name in spec.lstrip("^").split(",") if name.strip()}
    if spec.startswith("^"):  # an exclusion list: fine unless it drops CMA
        return not names & {"cma", "sm", "all"}
    return any(name in _ZERO_COPY_TLS or name.startswith(("rc", "dc", "ib")) for name in names)


def ptrace_scope() -> int | None:
    try:
        with open(_PTRACE_SCOPE) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def _has_cap_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def probe_tag() -> str:
    """A name no other probe agent of this host uses."""
    return f"kvcr-probe-{os.getpid()}-{next(_probe_ids)}"
