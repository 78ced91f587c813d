"""DataPlane over NIXL 1.5.1: one agent, UCX backend, one-sided READs from a peer's registered DRAM.

How the port maps onto NIXL:

- ``register`` registers each region's extent (``base``, ``span``) as one DRAM descriptor, once.
  Our regions are then described to NIXL as one *prepared* descriptor list, one strided row
  ``(base, piece_bytes, 0, stride, count)`` per region, so piece ``i`` of a region is index
  ``first + i`` of the list. The list is rebuilt when regions come and go.
- ``describe`` = NIXL agent metadata + our region table + name, as msgspec msgpack (versioned).
- ``connect`` loads the peer's metadata (``add_remote_agent``), prepares one list over all of the
  peer's regions the same way, and does a one-byte READ from it (see Progress) so the UCX wire-up
  is done and the peer proven reachable before the first real read. A peer that restarted (same
  name, new metadata) is removed and loaded again; the same description twice loads nothing.
- ``read`` turns each run into piece indices on both sides and posts one ``make_prepped_xfer`` +
  ``transfer``. NIXL merges consecutive indices into one descriptor, so a coalesced run costs one
  copy. Runs that do not fall on piece boundaries (or pair different piece sizes) make the whole
  read fall back to ``initialize_xfer`` with raw (address, length) descriptors.

Why prepared lists (measured on this 2-core CMA box, pages in random order, p50; ``python -m
kvcr.adapters.nixl.bench``): a prepared READ was 1-3 % faster than ``initialize_xfer`` at 64 KiB
x 32/128 (252 vs 259 us, 1054 vs 1065 us) and equal within noise at 2 and 8 MiB; making the
request costs 2.2 vs 4.6 us for 32 descriptors; and 32 adjacent 4 KiB pieces took 14 us as 32
prepared indices against 88 us as 32 raw descriptors, which ``initialize_xfer`` does not merge.
The adapter itself (run translation, lock, handle table) adds about 0.2 us per run plus ~10 us
per read: 5-9 % at 64 KiB pages, within noise at 2 MiB and 8 MiB.

Cancellation (what NIXL 1.5.1 really does). ``release_xfer_handle`` on a transfer still in
progress calls ``nixlAgent::releaseXferReq``: it re-checks the state and, if still in progress,
calls the UCX backend's ``releaseReqH``, which for every outstanding UCX request calls
``ucp_request_cancel`` -- a no-op for RMA (it only cancels tag receives) -- and then
``ucp_request_free``, which does not stop the operation but detaches it: UCX completes it in the
background on a later progress call. The backend then returns success and the agent deletes the
handle. So a *successful* release of an in-progress READ does not mean it stopped; it means we
can no longer observe when it stops. Reproduced here: with ``UCX_TLS=tcp`` a 64 MiB READ was
PROC, ``release()`` returned normally with 0 bytes landed, and after progressing both workers all
64 MiB had landed in the destination. (Newer NIXL adds a bounded drain and a ``tryRelease`` that
refuses to free an active request; the 1.5.1 UCX plugin has neither.)
Hence ``cancel`` never releases a live handle: it returns the terminal state if the transfer
already ended, otherwise UNCERTAIN, and keeps the handle so later polls can still see it reach
DONE or FAILED (a late DONE is still a failure for the caller, see ``PeerClient``). There is no
confirmed-stopped path for an in-flight READ in 1.5.1, so this adapter never answers CANCELLED.

Progress. With the progress thread off (the default: NIXL's thread busy-spins a core per agent,
its wrapper hard-codes ``pthrDelay=0``), nothing progresses this agent's UCX worker while we do
not call into it. A CMA READ needs no help from the source for the bytes, but with UCX's default
``ucx_error_handling_mode=peer`` the endpoint wire-up and the keep-alive rounds do: measured here,
a target's first READ never completed (5 s) while the source process did not progress, and about
one READ in a few dozen stalled on a keep-alive until the source progressed
(``UCX_KEEPALIVE_INTERVAL=inf`` made that go away). So each data plane runs a small pump thread
that progresses its own agent every ``progress_interval_s`` (5 ms: about 1.3 % of a core here),
under the same lock as every other agent call. With ``ucx_error_handling_mode=none`` neither
stall happens (a dead peer was still reported, via the failed CMA syscall), but UCX loses its
peer-failure handling, so that stays an opt-in through ``backend_params``. ``read`` also
progresses once before posting, so a peer whose agent went away is seen (its socket closed)
before a CMA copy from memory it no longer offers: CMA itself does not care about
deregistration, a live process's mapped memory stays readable.

Threading: every call into the agent is made under one lock (the agent runs with NIXL's
thread-sync mode NONE). The bindings release the GIL during a call, so other Python threads run
while a large CMA copy is done inside ``transfer``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvcr.adapters.nixl.probe import ZeroCopyReport, check_zero_copy
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import CopyRun, RegionDescriptor
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, RegistrationError, TransportError

log = logging.getLogger(__name__)

DESCRIPTION_VERSION = 1
_INIT_AGENT = "NIXL_INIT_AGENT"  # NIXL's name for "our own side" of a prepared list
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING, "ERR": TransferState.FAILED}


class _RegionWire(msgspec.Struct, array_like=True, frozen=True):
    label: str
    base: int
    stride: int
    count: int
    piece_bytes: int


class _Description(msgspec.Struct, frozen=True):
    version: int
    name: str
    metadata: bytes
    regions: list[_RegionWire]


@dataclass(frozen=True, slots=True)
class _Extent:
    """A region as the hot path needs it: its place in a prepared list and plain-int geometry."""

    region: RegionDescriptor
    first: int  # index of piece 0 in the prepared list
    base: int
    span: int
    stride: int
    piece: int
    dense: bool


@dataclass(slots=True)
class _Peer:
    name: str
    description: bytes
    metadata: bytes
    extents: dict[str, _Extent]
    dlist: Any  # prepared list over all its regions (None when it has none)
    loaded: bool  # whether its metadata is loaded in our agent (False: a loopback to ourselves)


@dataclass(slots=True)
class _Transfer:
    xfer: Any  # NIXL xfer handle; None for an empty read
    peer: str
    state: TransferState


def _extents(regions: Sequence[RegionDescriptor]) -> tuple[dict[str, _Extent], list[list[int]]]:
    """Index the regions one after the other; also the strided rows of their prepared list."""
    extents: dict[str, _Extent] = {}
    rows: list[list[int]] = []
    first = 0
    for region in regions:
        stride = region.stride if region.count > 1 else region.piece_bytes
        extents[region.label] = _Extent(
            region, first, region.base, region.span, stride, region.piece_bytes, region.dense
        )
        rows.append([region.base, region.piece_bytes, 0, stride, region.count])
        first += region.count
    return extents, rows


class NixlDataPlane:
    """A DataPlane over one NIXL agent with the UCX backend. Thread-safe.

    Args:
        name: the agent's name; peers address us by it, so it must be unique on the fabric.
        backend_params: UCX backend parameters (e.g. ``{"ucx_error_handling_mode": "none"}``).
        progress_thread: NIXL's own progress thread (spins a core per agent; off by default).
        progress_interval_s: period of our light progress pump when NIXL's thread is off; None
            turns it off too (then a source only progresses while it reads, see the module doc).
        connect_timeout_s: how long connect() waits for the first READ (the UCX wire-up).
        check_transport: measure once per process and backend setting whether UCX uses a
            zero-copy path; the report is ``transport_report`` and a fallback is logged as a WARNING.

    Raises:
        TransportError: NIXL is missing or the agent or its UCX backend cannot be created.
    """

    def __init__(
        self,
        name: str,
        *,
        backend_params: Mapping[str, str] | None = None,
        progress_thread: bool = False,
        progress_interval_s: float | None = 0.005,
        connect_timeout_s: float = 2.0,
        check_transport: bool = True,
    ) -> None:
        if not name:
            raise TransportError("a NIXL data plane needs a non-empty name")
        self._name = name
        self._params = {str(k): str(v) for k, v in (backend_params or {}).items()}
        self._lock = threading.Lock()
        self._closed = False
        self._local: dict[str, _Extent] = {}
        self._registrations: dict[str, Any] = {}
        self._local_dlist: Any = None
        self._description: bytes | None = None
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._retired: list[Any] = []  # prepared lists replaced while transfers may use them
        self._handles = itertools.count(1)
        self.metadata_loads = 0  # add_remote_agent calls, for observability and tests
        self.transport_report: ZeroCopyReport | None = None
        self._connect_timeout_s = connect_timeout_s
        self._agent, self._np, self._peer_errors = self._build_agent(progress_thread)
        # Landing place of the one-byte warm-up READ that connect() uses to finish UCX's wire-up.
        self._scratch = ctypes.create_string_buffer(64)
        self._scratch_address = ctypes.addressof(self._scratch)
        try:
            self._scratch_registration = self._agent.register_memory([(self._scratch_address, 64, 0, "")], "DRAM")
        except Exception as exc:
            raise TransportError(f"{name}: cannot register memory with NIXL: {exc}") from exc
        if check_transport:
            self.transport_report = _probe_once(self._params)
            if self.transport_report.zero_copy:
                log.info("%s: %s", name, self.transport_report.summary())
            else:
                log.warning(
                    "%s: NIXL peer reads will be 10-100x slower than they should: %s",
                    name,
                    self.transport_report.summary(),
                )
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        if not progress_thread and progress_interval_s is not None and progress_interval_s > 0:
            self._pump = threading.Thread(
                target=_pump,
                args=(weakref.ref(self), self._stop, progress_interval_s),
                name=f"kvcr-nixl-progress-{name}",
                daemon=True,
            )
            self._pump.start()

    @property
    def name(self) -> str:
        return self._name

    # ------------------------------------------------------------------ registration

    def register(self, regions: Sequence[RegionDescriptor]) -> None:
        with self._lock:
            self._check_open()
            fresh: set[str] = set()
            for region in regions:
                if region.label in self._registrations or region.label in fresh:
                    raise RegistrationError(f"{self._name}: region {region.label!r} is already registered")
                fresh.add(region.label)
            added: list[str] = []
            try:
                for region in regions:
                    handle = self._agent.register_memory([(region.base, region.span, 0, "")], "DRAM")
                    self._registrations[region.label] = handle
                    self._local[region.label] = _Extent(region, 0, 0, 0, 0, 0, False)  # indexed below
                    added.append(region.label)
                self._rebuild_local()
            except Exception as exc:
                for label in added:
                    self._local.pop(label, None)
                    with contextlib.suppress(Exception):  # undoing our own half-done registration
                        self._agent.deregister_memory(self._registrations.pop(label))
                with contextlib.suppress(Exception):
                    self._rebuild_local()
                raise RegistrationError(f"{self._name}: cannot register {sorted(fresh)}: {exc}") from exc

    def deregister(self, labels: Sequence[str]) -> None:
        with self._lock:
            if self._closed:
                return
            failures = []
            changed = False
            for label in labels:
                handle = self._registrations.pop(label, None)
                self._local.pop(label, None)
                if handle is None:
                    continue
                changed = True
                try:
                    self._agent.deregister_memory(handle)
                except Exception as exc:
                    failures.append(f"{label!r}: {exc}")
            if changed:
                self._rebuild_local()
            if failures:
                raise RegistrationError(f"{self._name}: deregistration failed for {', '.join(failures)}")

    # ------------------------------------------------------------------ peers

    def describe(self) -> bytes:
        with self._lock:
            self._check_open()
            if self._description is None:
                regions = [
                    _RegionWire(e.region.label, e.base, e.region.stride, e.region.count, e.piece)
                    for e in self._local.values()
                ]
                metadata = bytes(self._agent.get_agent_metadata())
                self._description = msgspec.msgpack.encode(
                    _Description(DESCRIPTION_VERSION, self._name, metadata, regions)
                )
            return self._description

    def connect(self, description: bytes) -> str:
        desc, extents, rows = _decode(description)
        name = desc.name
        with self._lock:
            self._check_open()
            current = self._peers.get(name)
            if current is not None and current.description == description:
                return name
            loaded = False
            if current is not None:
                del self._peers[name]
                self._retire(current.dlist)
                if current.metadata == desc.metadata:
                    loaded = current.loaded  # same incarnation, new region table: keep the connection
                else:
                    try:  # it restarted: its old endpoint is stale
                        self._unload(current)
                    except TransportError as exc:
                        raise PeerUnavailable(str(exc)) from exc
            fresh = name != self._name and not loaded
            warm_up = None
            try:
                if fresh:
                    self._load(name, desc.metadata)
                    loaded = True
                dlist = None
                if rows:
                    dlist = self._agent.prep_xfer_dlist(name, self._np.array(rows, dtype=self._np.uint64), "DRAM")
                if fresh and extents:
                    warm_up = self._post_warm_up(name, next(iter(extents.values())).base)
            except Exception as exc:
                if loaded:
                    with contextlib.suppress(Exception):  # leave no half-connected peer behind
                        self._agent.remove_remote_agent(name)
                raise PeerUnavailable(f"{self._name}: cannot connect to {name!r}: {exc}") from exc
            link = self._peers[name] = _Peer(name, description, desc.metadata, extents, dlist, loaded)
        if warm_up is not None:
            self._await_warm_up(link, warm_up)
        return name

    def disconnect(self, peer: str) -> None:
        with self._lock:
            current = self._peers.pop(peer, None)
            if current is None:
                return
            self._retire(current.dlist)
            self._unload(current)

    # ------------------------------------------------------------------ transfers

    def read(self, peer: str, runs: Sequence[CopyRun]) -> int:
        with self._lock:
            self._check_open()
            link = self._peers.get(peer)
            if link is None:
                raise PeerUnavailable(f"{self._name}: peer {peer!r} is not connected")
            handle = next(self._handles)
            if not runs:
                self._transfers[handle] = _Transfer(None, peer, TransferState.DONE)
                return handle
            xfer = None
            try:
                plan = self._plan(link, runs)
                agent = self._agent
                # Progress first: a peer that went away since the last call is noticed now (UCX
                # sees its socket close) rather than after a CMA copy from memory it let go of.
                agent.get_new_notifs()
                if plan[0]:
                    xfer = agent.make_prepped_xfer("READ", self._local_dlist, plan[2], link.dlist, plan[1])
                else:
                    np = self._np
                    local = agent.get_xfer_descs(np.array(plan[2], dtype=np.uint64), "DRAM")
                    remote = agent.get_xfer_descs(np.array(plan[1], dtype=np.uint64), "DRAM")
                    xfer = agent.initialize_xfer("READ", local, remote, peer)
                status = agent.transfer(xfer)
            except TransportError:
                raise
            except Exception as exc:
                # NIXL refuses a post to a disconnected agent before posting anything. A UCX error
                # part-way through a post would leave the earlier pieces detached in 1.5.1 (its
                # backend releases them as in cancel), which no handle can report any more.
                if xfer is not None:
                    with contextlib.suppress(Exception):  # never posted, or its post failed
                        xfer.release()
                raise self._translate(exc, f"read from {peer!r}") from exc
            self._transfers[handle] = _Transfer(xfer, peer, _STATES.get(status, TransferState.FAILED))
            return handle

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfer(handle)
            self._refresh(transfer)
            return transfer.state

    def cancel(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfer(handle)
            self._refresh(transfer)
            if transfer.state.terminal:
                return transfer.state
            # NIXL 1.5.1 cannot stop an in-flight READ (module docstring): keep watching it.
            transfer.state = TransferState.UNCERTAIN
            return transfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            transfer = self._transfer(handle)
            if not transfer.state.terminal:
                raise KvcrError(f"transfer {handle} is {transfer.state.value}; releasing it could reuse live memory")
            del self._transfers[handle]
            try:
                if transfer.xfer is not None:
                    transfer.xfer.release()
            except Exception as exc:
                raise TransportError(f"{self._name}: NIXL refused to release transfer {handle}: {exc}") from exc
            finally:
                self._reap()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for transfer in self._transfers.values():
                self._refresh(transfer)
            live = [h for h, t in self._transfers.items() if not t.state.terminal]
            if live:
                raise KvcrError(f"{self._name}: {len(live)} transfers are not terminal; cannot close")
            self._closed = True
        self._stop.set()
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=1.0)
        failures: list[str] = []
        with self._lock:
            for transfer in self._transfers.values():
                _attempt(failures, "release a transfer", transfer.xfer.release if transfer.xfer else None)
            self._transfers.clear()
            for peer in self._peers.values():
                self._retire(peer.dlist)
                if peer.loaded:
                    _attempt(failures, f"remove {peer.name!r}", self._agent.remove_remote_agent, peer.name)
            self._peers.clear()
            self._retire(self._local_dlist)
            self._local_dlist = None
            self._reap()
            for label, registration in self._registrations.items():
                _attempt(failures, f"deregister {label!r}", self._agent.deregister_memory, registration)
            self._registrations.clear()
            self._local.clear()
            scratch = self._scratch_registration
            _attempt(failures, "deregister the scratch buffer", self._agent.deregister_memory, scratch)
            self._agent = None  # the last reference: NIXL destroys the agent and its UCX worker
        if failures:
            raise TransportError(f"{self._name}: close left work undone: {'; '.join(failures)}")

    # ------------------------------------------------------------------ internals

    def _post_warm_up(self, peer: str, address: int) -> int:
        """Start a one-byte READ from ``peer`` into our scratch buffer (see ``_await_warm_up``)."""
        agent, np = self._agent, self._np
        local = agent.get_xfer_descs(np.array([[self._scratch_address, 1, 0]], dtype=np.uint64), "DRAM")
        remote = agent.get_xfer_descs(np.array([[address, 1, 0]], dtype=np.uint64), "DRAM")
        xfer = agent.initialize_xfer("READ", local, remote, peer)
        try:
            status = agent.transfer(xfer)
        except Exception:
            with contextlib.suppress(Exception):  # its post failed: nothing is in flight
                xfer.release()
            raise
        handle = next(self._handles)
        self._transfers[handle] = _Transfer(xfer, peer, _STATES.get(status, TransferState.FAILED))
        return handle

    def _await_warm_up(self, link: _Peer, handle: int) -> None:
        """Finish the UCX wire-up now (it needs the peer to progress), so the first real read is fast.

        It also proves the peer reachable. If it does not finish in time the READ stays live, so
        its handle stays here as UNCERTAIN (close() refuses until it ends) and the peer is dropped.
        """
        deadline = time.monotonic() + self._connect_timeout_s
        spins = 0
        state = self.poll(handle)
        while not state.terminal and time.monotonic() < deadline:
            spins += 1
            if spins > 64:
                time.sleep(200e-6)  # let the peer's pump (or process) progress its worker
            state = self.poll(handle)
        if state.terminal:
            self.release(handle)
            if state is TransferState.DONE:
                return
            why = f"its first READ {state.value}"
        else:
            self.cancel(handle)
            why = f"its first READ did not finish within {self._connect_timeout_s:.1f}s"
        with self._lock:
            if self._peers.get(link.name) is link:  # unless a newer connect() replaced it meanwhile
                del self._peers[link.name]
                self._retire(link.dlist)
                if state.terminal:
                    with contextlib.suppress(TransportError):  # it is unusable either way
                        self._unload(link)
        raise PeerUnavailable(f"{self._name}: peer {link.name!r} is unreachable: {why}")

    def _plan(self, link: _Peer, runs: Sequence[CopyRun]) -> tuple[bool, Any, Any]:
        """(prepared?, source side, destination side): piece indices, or raw (addr, len, 0) rows.

        The hot path of a read: one pass over the runs, region lookups only when a label changes.
        """
        remote, local = link.extents, self._local
        src_index: list[int] = []
        dst_index: list[int] = []
        add_src, add_dst = src_index.append, dst_index.append
        s_label = d_label = None
        s_first = s_span = s_stride = s_piece = d_first = d_span = d_stride = d_piece = 0
        s_dense = d_dense = False
        for run in runs:
            if run.src_label != s_label:
                src = remote.get(run.src_label)
                if src is None:
                    raise TransportError(f"run {run}: peer {link.name!r} has no registered region {run.src_label!r}")
                s_label = run.src_label
                s_first, s_span, s_stride, s_piece, s_dense = src.first, src.span, src.stride, src.piece, src.dense
            if run.dst_label != d_label:
                dst = local.get(run.dst_label)
                if dst is None:
                    raise TransportError(f"run {run}: {self._name} has no registered region {run.dst_label!r}")
                d_label = run.dst_label
                d_first, d_span, d_stride, d_piece, d_dense = dst.first, dst.span, dst.stride, dst.piece, dst.dense
            src_off, dst_off, nbytes = run.src_offset, run.dst_offset, run.nbytes
            if nbytes <= 0 or src_off < 0 or dst_off < 0 or src_off + nbytes > s_span or dst_off + nbytes > d_span:
                raise TransportError(f"run {run} is out of the registered bounds")
            if src_off % s_stride or dst_off % d_stride or s_piece != d_piece:
                return self._raw_plan(link, runs)
            if nbytes == s_piece:
                add_src(s_first + src_off // s_stride)
                add_dst(d_first + dst_off // d_stride)
            elif nbytes % s_piece == 0 and s_dense and d_dense:
                # A coalesced run: consecutive indices, which NIXL merges back into one copy.
                first, count = s_first + src_off // s_stride, nbytes // s_piece
                src_index.extend(range(first, first + count))
                first = d_first + dst_off // d_stride
                dst_index.extend(range(first, first + count))
            else:
                return self._raw_plan(link, runs)
        return True, src_index, dst_index

    def _raw_plan(self, link: _Peer, runs: Sequence[CopyRun]) -> tuple[bool, Any, Any]:
        """Raw (address, length, 0) rows for reads that do not fall on piece boundaries."""
        src_rows: list[list[int]] = []
        dst_rows: list[list[int]] = []
        for run in runs:
            src, dst = link.extents.get(run.src_label), self._local.get(run.dst_label)
            if src is None:
                raise TransportError(f"run {run}: peer {link.name!r} has no registered region {run.src_label!r}")
            if dst is None:
                raise TransportError(f"run {run}: {self._name} has no registered region {run.dst_label!r}")
            src_off, dst_off, nbytes = run.src_offset, run.dst_offset, run.nbytes
            if nbytes <= 0 or src_off < 0 or dst_off < 0 or src_off + nbytes > src.span or dst_off + nbytes > dst.span:
                raise TransportError(f"run {run} is out of the registered bounds")
            src_rows.append([src.base + src_off, nbytes, 0])
            dst_rows.append([dst.base + dst_off, nbytes, 0])
        return False, src_rows, dst_rows

    def _refresh(self, transfer: _Transfer) -> None:
        if transfer.state is not TransferState.PENDING and transfer.state is not TransferState.UNCERTAIN:
            return
        try:
            status = self._agent.check_xfer_state(transfer.xfer)
        except Exception as exc:
            log.info("%s: transfer from %s failed: %s", self._name, transfer.peer, exc)
            status = "ERR"
        state = _STATES.get(status, TransferState.FAILED)
        if state is not TransferState.PENDING:
            transfer.state = state

    def _rebuild_local(self) -> None:
        extents, rows = _extents([e.region for e in self._local.values()])
        dlist = None
        if rows:
            dlist = self._agent.prep_xfer_dlist(_INIT_AGENT, self._np.array(rows, dtype=self._np.uint64), "DRAM")
        self._retire(self._local_dlist)
        self._local, self._local_dlist, self._description = extents, dlist, None

    def _load(self, name: str, metadata: bytes) -> None:
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception:
            # NIXL refuses new metadata for a name it still holds (left by a failed connect).
            self._agent.remove_remote_agent(name)
            loaded = self._agent.add_remote_agent(metadata)
        self.metadata_loads += 1
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise PeerUnavailable(f"description names {name!r} but its metadata is agent {loaded!r}")

    def _unload(self, peer: _Peer) -> None:
        if not peer.loaded:
            return
        try:
            self._agent.remove_remote_agent(peer.name)
        except Exception as exc:
            raise TransportError(f"{self._name}: cannot remove peer {peer.name!r}: {exc}") from exc

    def _retire(self, dlist: Any) -> None:
        if dlist is not None:
            self._retired.append(dlist)
        self._reap()

    def _reap(self) -> None:
        """Release replaced prepared lists once no transfer handle is left that was made from them."""
        if self._transfers or not self._retired:
            return
        retired, self._retired = self._retired, []
        for dlist in retired:
            with contextlib.suppress(Exception):  # a list NIXL will not release is only memory
                dlist.release()

    def _transfer(self, handle: int) -> _Transfer:
        transfer = self._transfers.get(handle)
        if transfer is None:
            raise TransportError(f"unknown transfer handle {handle}")
        return transfer

    def _translate(self, exc: Exception, what: str) -> TransportError:
        if isinstance(exc, self._peer_errors):
            return PeerUnavailable(f"{self._name}: {what}: {type(exc).__name__}: {exc}")
        return TransportError(f"{self._name}: {what}: {type(exc).__name__}: {exc}")

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"data plane {self._name!r} is closed")

    def _progress(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._agent.get_new_notifs()  # progresses the UCX worker (wire-up, keep-alive)
            except Exception as exc:
                log.debug("%s: progress failed: %s", self._name, exc)

    def _build_agent(self, progress_thread: bool) -> tuple[Any, Any, tuple[type[Exception], ...]]:
        try:
            import numpy
            from nixl import _bindings
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise TransportError(f"NIXL is not installed (pip install nixl-cu13==1.5.1 --no-deps): {exc}") from exc
        _quiet_nixl_logging()
        try:
            config = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[])
            agent = nixl_agent(self._name, config)
            if "UCX" not in agent.get_plugin_list():
                raise TransportError("NIXL has no UCX plugin")
            agent.create_backend("UCX", self._params)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"cannot create NIXL agent {self._name!r} with UCX {self._params}: {exc}") from exc
        peer_errors = (_bindings.nixlRemoteDisconnectError, _bindings.nixlNotFoundError)
        return agent, numpy, peer_errors


def _decode(description: bytes) -> tuple[_Description, dict[str, _Extent], list[list[int]]]:
    try:
        desc = msgspec.msgpack.decode(description, type=_Description)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise PeerUnavailable(f"unreadable peer description: {exc}") from exc
    if desc.version != DESCRIPTION_VERSION:
        raise PeerUnavailable(f"peer description version {desc.version}, expected {DESCRIPTION_VERSION}")
    if not desc.name:
        raise PeerUnavailable("peer description has no name")
    try:
        regions = [RegionDescriptor(w.label, w.base, w.stride, w.count, w.piece_bytes) for w in desc.regions]
    except KvcrError as exc:
        raise PeerUnavailable(f"peer {desc.name!r} describes an unusable region: {exc}") from exc
    if len({r.label for r in regions}) != len(regions):
        raise PeerUnavailable(f"peer {desc.name!r} describes a region label twice")
    extents, rows = _extents(regions)
    return desc, extents, rows


def _pump(plane_ref: weakref.ref[NixlDataPlane], stop: threading.Event, interval_s: float) -> None:
    """Progress the agent now and then; ends with close() or when the data plane is collected."""
    while not stop.wait(interval_s):
        plane = plane_ref()
        if plane is None:
            return
        plane._progress()
        del plane


def _quiet_nixl_logging() -> None:
    """NIXL's wrapper logs INFO lines to *stdout* on every agent; keep warnings, unless told otherwise.

    A process whose stdout carries a protocol (a READY line, JSON) breaks on them. NIXL_LOG_LEVEL,
    NIXL's own switch, still wins when set.
    """
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    nixl_logger = logging.getLogger("nixl")
    if nixl_logger.getEffectiveLevel() < logging.WARNING:
        nixl_logger.setLevel(logging.WARNING)


def _attempt(failures: list[str], what: str, call: Any, *args: Any) -> None:
    if call is None:
        return
    try:
        call(*args)
    except Exception as exc:
        failures.append(f"{what}: {exc}")


_probe_lock = threading.Lock()
_probe_reports: dict[tuple[object, ...], ZeroCopyReport] = {}


def _probe_once(params: dict[str, str]) -> ZeroCopyReport:
    """One probe per process and transport setting: UCX's choice does not change in between."""
    key = (tuple(sorted(params.items())), os.environ.get("UCX_TLS"), os.environ.get("UCX_NET_DEVICES"))
    with _probe_lock:
        report = _probe_reports.get(key)
        if report is None:
            report = _probe_reports[key] = check_zero_copy(backend_params=params)
        return report


if TYPE_CHECKING:
    from kvcr.ports.dataplane import DataPlane

    _: DataPlane = NixlDataPlane("x")
