"""DataPlane over NIXL 1.5.1: one agent, UCX backend, one-sided READs of a peer's exposed regions.

What each behaviour below rests on was measured and is written up in ``docs/nixl-behaviour.md``
(probes in ``scripts/probes/``).

How the port maps onto NIXL:

- ``register`` registers each region's extent (``base``, ``span``) as one DRAM descriptor, read-write
  (NIXL 1.5.1 has no access flags, and a read-only mapping lets a peer's WRITE crash the source on
  tcp). All our regions, exposed and private, form one *prepared* list, one strided row
  ``(base, piece_bytes, 0, stride, count)`` per region, so piece ``i`` of a region is index
  ``first + i``; a read turns each ``PieceRun`` into indices with no offsets in between. NIXL merges
  indices consecutive on both sides into one copy.
- ``describe`` carries NIXL *partial* metadata naming only the exposed regions (and our beacon, see
  below) with the connection info, plus the exposed region table. A peer's NIXL refuses, locally,
  any descriptor outside it. That keeps honest peers off our private regions; it is not memory
  protection: on CMA and tcp the remote key has no address range, so a peer that edits the
  metadata reaches any address of this process. Metadata must only go to authenticated peers.
- ``connect`` loads the peer's metadata (a new description of the same incarnation is loaded on
  top: NIXL adds the sections), prepares one list over its exposed regions, and reads the peer's
  *beacon* (``BEACON_BYTES`` of random bytes it exposes; their digest is in its description) into a
  scratch slot of ours: that finishes UCX's wire-up within ``timeout_s`` and proves the peer
  reachable. Then it reads the beacon twice more and looks at the slot right after ``transfer()``
  returns: on CMA the bytes are already there (UCX copies with the reader's own worker, and NIXL's
  post progresses it until idle); over tcp (emulated RMA) or RDMA they arrive later. Complete each
  time, and the peer on this host (boot id, pid namespace and uid from its description): the peer
  has no late writes. Otherwise ``PeerInfo.late_writes`` is True.

Late writes and cancellation (NIXL 1.5.1 cannot stop a READ). Over tcp a READ the source has not
answered stays in progress with no error for as long as the source is frozen or the link is cut
(60 s and 90 s measured), and every byte lands once it comes back, whatever the target did:
``release()`` of the live handle succeeds and only detaches it, ``remove_remote_agent`` succeeds
but the handle keeps the connection alive (its state then reads NOT_FOUND while the bytes still
land). Only destroying the agent stops it, and that makes a frozen source abort (a UCX fatal
error) when it resumes. Hence:

- ``cancel`` of a live READ from a peer without late writes answers CANCELLED: its bytes were all
  copied inside the post, what is left is an endpoint flush (its NIXL handle is released at once);
  from a peer with late writes it answers UNCERTAIN and keeps the handle observable.
- a handle is never released while live (``release`` refuses).
- ``disconnect`` fails a peer's live reads at once when it has no late writes; otherwise they stay
  UNCERTAIN and the peer's NIXL connection is kept, closed for new reads, until its last read has
  ended, so that those reads stay observable.

Progress. NIXL's own progress thread is used with ``pthrDelay`` = ``progress_wake_s``: it sleeps in
``poll()`` on the UCX worker's event fd and wakes on traffic (wire-up, keep-alive, tcp READs), so an
idle data plane costs no measurable CPU and a new peer's wire-up takes milliseconds. (The Python
wrapper forces ``pthrDelay=0``, which spins a core; ``agent.py`` builds the agent with the binding's
own config.) ``progress_wake_s=None`` turns progress off entirely: then this agent progresses only
inside our calls, and peers cannot wire up to it while it sits idle.

Threading: every call into the agent is made under one lock (NIXL's agent runs with thread-sync
mode NONE; the UCX worker is thread-safe when the progress thread is on). The bindings release the
GIL during a call, so other Python threads run while a large CMA copy is done inside ``transfer``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcr.adapters.nixl import wire
from kvcr.adapters.nixl.agent import build_agent, nixl_errors, transport_report, ucx_environment
from kvcr.adapters.nixl.beacon import BEACON_BYTES, SCRATCH_SLOTS, Beacon, digest
from kvcr.adapters.nixl.regions import LocalRegions
from kvcr.adapters.nixl.wire import Description, Extent
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import PeerInfo, TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError

if TYPE_CHECKING:
    from kvcr.adapters.nixl.probe import ZeroCopyReport

log = logging.getLogger(__name__)

SYNC_WINDOW_S = 50e-6  # a look at the slot later than this after the post proves nothing
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING, "ERR": TransferState.FAILED}


@dataclass(slots=True)
class _Peer:
    name: str
    description: bytes
    incarnation: bytes
    extents: dict[int, Extent]
    dlist: Any
    loaded: bool  # its metadata is loaded in our agent (False: a loopback to ourselves)
    info: PeerInfo | None = None  # None until the warm-up READ came back
    closing: bool = False  # disconnected, kept loaded until its live reads have ended


@dataclass(slots=True)
class _Transfer:
    xfer: Any  # NIXL xfer handle; None once released (or for an empty read)
    peer: str
    late_writes: bool
    state: TransferState
    slot: int | None = None  # scratch slot of an internal (connect) READ


class NixlDataPlane:
    """A DataPlane over one NIXL agent with the UCX backend. Thread-safe.

    Args:
        name: the agent's name; peers address us by it, so it must be unique on the fabric.
        backend_params: UCX backend parameters (e.g. ``{"ucx_devices": "lo"}``).
        progress_wake_s: longest sleep of NIXL's event-driven progress thread; None: no thread.

    Raises:
        TransportError: NIXL is missing or the agent or its UCX backend cannot be created.
    """

    def __init__(
        self,
        name: str,
        *,
        backend_params: Mapping[str, str] | None = None,
        progress_wake_s: float | None = 0.1,
    ) -> None:
        if not name:
            raise TransportError("a NIXL data plane needs a non-empty name")
        if progress_wake_s is not None and not 0.001 <= progress_wake_s <= 60:
            raise TransportError(f"progress_wake_s must be between 0.001 and 60 s, got {progress_wake_s}")
        self._name = name
        self._params = {str(k): str(v) for k, v in (backend_params or {}).items()}
        self._lock = threading.Lock()
        self._closed = False
        self._description: bytes | None = None
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._retired: list[Any] = []  # prepared lists replaced while transfers may use them
        self._handles = itertools.count(1)
        self._incarnation = os.urandom(8)
        self._host = wire.host_identity()
        self.metadata_loads = 0  # add_remote_agent calls, for observability and tests
        self._ucx_environment = ucx_environment()  # what the agent's UCX was built with
        self._agent, self._np, self._peer_errors = build_agent(name, self._params, progress_wake_s)
        self._regions = LocalRegions(name, self._agent, self._np, self._retire)
        self._beacon = Beacon()
        with nixl_errors(f"{name}: cannot register memory with NIXL"):
            self._beacon_registration = self._regions.register_extent(self._beacon.address, BEACON_BYTES)
            self._scratch_registration = self._regions.register_extent(*self._beacon.scratch_extent)
        # The zero-copy probe takes a moment: begin it now so the first connect (on an engine's
        # first hit query) does not wait for it.
        params = dict(self._params)
        threading.Thread(
            target=transport_report, args=(params, self._ucx_environment), name="kvcr-nixl-probe", daemon=True
        ).start()

    @property
    def name(self) -> str:
        return self._name

    @property
    def transport_report(self) -> ZeroCopyReport:
        """Whether UCX has a zero-copy path here (measured once per process and setting, on first use)."""
        report = transport_report(self._params, self._ucx_environment)
        assert report is not None  # an unbounded wait always has the report
        return report

    @property
    def live_transfers(self) -> int:
        """Handles not yet released, internal connect READs included (tests check nothing leaks)."""
        with self._lock:
            return len(self._transfers)

    @property
    def registrations(self) -> int:
        """NIXL memory registrations this plane holds (beacon and scratch included); 0 after a clean close."""
        with self._lock:
            return self._regions.registrations

    # ------------------------------------------------------------------ registration

    def register(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        with self._lock:
            self._check_open()
            try:
                return self._regions.add(regions, exposed=exposed)
            finally:
                if exposed:
                    self._description = None  # what we expose changed (or was rolled back): describe anew

    def deregister(self, ids: Sequence[int]) -> None:
        with self._lock:
            if self._closed:
                return
            exposed_changed = True  # until remove() says otherwise, also when it raised part-way
            try:
                exposed_changed = self._regions.remove(ids)
            finally:
                if exposed_changed:
                    self._description = None

    # ------------------------------------------------------------------ peers

    def describe(self) -> bytes:
        with self._lock:
            self._check_open()
            if self._description is None:
                exposed = self._regions.exposed()
                rows = [(r.base, r.span, 0, "") for _, r in exposed]
                rows.append((self._beacon.address, BEACON_BYTES, 0, ""))
                descs = self._agent.get_reg_descs(rows, "DRAM")
                metadata = bytes(self._agent.get_partial_agent_metadata(descs, inc_conn_info=True))
                table = [wire.RegionWire(i, r.base, r.stride, r.count, r.piece_bytes) for i, r in exposed]
                self._description = wire.encode(
                    Description(
                        wire.DESCRIPTION_VERSION,
                        self._name,
                        self._incarnation,
                        self._host,
                        metadata,
                        table,
                        self._beacon.address,
                        self._beacon.digest,
                    )
                )
            return self._description

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        desc, extents, rows = wire.decode(description)
        deadline = time.monotonic() + max(0.0, timeout_s)
        name = desc.name
        with self._lock:
            self._check_open()
            self._sweep()
            link = self._peers.get(name)
            if link is not None and link.incarnation != desc.incarnation:
                if self._live_from(name):
                    raise PeerUnavailable(f"{self._name}: {name!r} restarted while reads from it are still live")
                self._drop(link)
                link = None
            if link is not None and link.description == description and link.info is not None:
                link.closing = False
                return link.info
            with nixl_errors(f"{self._name}: cannot connect to {name!r}", PeerUnavailable):
                if name != self._name:
                    self._load(name, desc.metadata)
                dlist = self._prep(name, rows) if rows else None
            if link is not None:  # same incarnation, new region table: the old list may be in use
                self._retire(link.dlist)
                link.description, link.extents, link.dlist, link.closing = description, extents, dlist, False
                if link.info is not None:
                    return link.info
            else:
                loaded = name != self._name
                link = self._peers[name] = _Peer(name, description, desc.incarnation, extents, dlist, loaded)
        warm, _, _ = self._beacon_read(link, desc.beacon)
        self._settle(warm, deadline)
        if not self._finish_internal(warm, desc.beacon_digest):
            self._unreachable(link)
            raise PeerUnavailable(f"{self._name}: peer {name!r} did not answer within {timeout_s:.2f}s")
        same_host = bool(self._host) and desc.host == self._host
        # Both must agree before a peer's reads may land in engine memory: this peer's reads must
        # really end inside the post, and UCX must have its zero-copy path here (a tcp READ over a
        # fast loopback can also finish inside the post, so timing alone would misjudge it). The
        # zero-copy probe (begun at construction; seconds over tcp) is waited for only within
        # this connect's deadline: a peer it is still needed for is not connected yet (a miss).
        late_writes = not (same_host and self._reads_complete_in_post(link, desc, deadline))
        if not late_writes:
            report = transport_report(self._params, self._ucx_environment, max(0.0, deadline - time.monotonic()))
            if report is None:
                with self._lock:
                    self._finish_closing(link)  # forgotten now: the next connect starts afresh
                raise PeerUnavailable(f"{self._name}: the transport probe is still running; {name!r} not connected yet")
            late_writes = not report.zero_copy
        info = PeerInfo(name, late_writes)
        with self._lock:
            if self._peers.get(name) is link:
                link.info = info
        how = "late writes possible" if late_writes else "reads end in the post"
        log.info("%s: connected to %s (%s)", self._name, name, how)
        return info

    def disconnect(self, peer: str) -> None:
        with self._lock:
            link = self._peers.get(peer)
            if link is None:
                return
            link.closing = True
            for transfer in self._transfers.values():
                if transfer.peer == peer and not transfer.state.terminal and not transfer.late_writes:
                    self._refresh(transfer)
                    if not transfer.state.terminal:
                        self._detach(transfer)
                        transfer.state = TransferState.FAILED  # torn down; nothing of it is left to copy
            self._finish_closing(link)

    # ------------------------------------------------------------------ transfers

    def read(self, peer: str, runs: Sequence[PieceRun], *, lease: int = 0) -> int:
        del lease  # one-sided: the source takes no part in a read
        with self._lock:
            self._check_open()
            link = self._peers.get(peer)
            if link is None or link.closing or link.info is None:
                raise PeerUnavailable(f"{self._name}: peer {peer!r} is not connected")
            handle = next(self._handles)
            if not runs:
                self._transfers[handle] = _Transfer(None, peer, False, TransferState.DONE)
                return handle
            src_index, dst_index = self._indices(link, runs)
            agent = self._agent
            xfer = None
            try:
                xfer = agent.make_prepped_xfer("READ", self._regions.dlist, dst_index, link.dlist, src_index)
                status = agent.transfer(xfer)
            except Exception as exc:
                # NIXL refuses a post to a failed endpoint before anything moves (the peer died).
                if xfer is not None:
                    with contextlib.suppress(Exception):  # never posted, or its post failed
                        xfer.release()
                raise self._translate(exc, f"read from {peer!r}") from exc
            state = _STATES.get(status, TransferState.FAILED)
            self._transfers[handle] = _Transfer(xfer, peer, link.info.late_writes, state)
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
            if not transfer.late_writes:
                # Its bytes were copied inside the post; what is left is an endpoint flush.
                self._detach(transfer)
                transfer.state = TransferState.CANCELLED
            else:
                transfer.state = TransferState.UNCERTAIN  # NIXL 1.5.1 cannot stop it: keep watching
            return transfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            transfer = self._transfer(handle)
            if not transfer.state.terminal:
                raise KvcrError(f"transfer {handle} is {transfer.state.value}; releasing it could reuse live memory")
            del self._transfers[handle]
            try:
                self._detach(transfer)
            finally:
                self._after_end(transfer)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._sweep()
            for transfer in self._transfers.values():
                self._refresh(transfer)
            live = [h for h, t in self._transfers.items() if not t.state.terminal and t.slot is None]
            if live:
                raise KvcrError(f"{self._name}: {len(live)} transfers are not terminal; cannot close")
            self._closed = True
            failures: list[str] = []
            for transfer in self._transfers.values():
                # Only our own connect READs into scratch memory can be left: destroying the agent
                # below stops them (a tcp source frozen meanwhile may abort when it resumes: UCX).
                _attempt(failures, "release a transfer", self._detach, transfer)
            self._transfers.clear()
            for link in self._peers.values():
                self._retire(link.dlist)
                if link.loaded:
                    _attempt(failures, f"remove {link.name!r}", self._agent.remove_remote_agent, link.name)
            self._peers.clear()
            self._regions.retire_list()
            self._reap()
            failures += self._regions.close(own=(self._beacon_registration, self._scratch_registration))
            self._agent = None  # the last reference: NIXL stops its thread, destroys the agent and UCX worker
        if failures:
            raise TransportError(f"{self._name}: close left work undone: {'; '.join(failures)}")

    # ------------------------------------------------------------------ the read path

    def _indices(self, link: _Peer, runs: Sequence[PieceRun]) -> tuple[list[int], list[int]]:
        """Piece indices on both sides, after every check (TransportError: nothing is posted).

        The hot path of a read: region lookups only when a run's region differs from the last.
        """
        remote, local = link.extents, self._regions.extents
        src_index: list[int] = []
        dst_index: list[int] = []
        add_src, add_dst = src_index.append, dst_index.append
        src_id = dst_id = -1
        s_first = s_count = d_first = d_count = 0
        for run in runs:
            if run.src != src_id or run.dst != dst_id:
                src, dst = remote.get(run.src), local.get(run.dst)
                if src is None:
                    raise TransportError(f"run {run}: peer {link.name!r} exposes no region {run.src}")
                if dst is None:
                    raise TransportError(f"run {run}: {self._name} has no registered region {run.dst}")
                if src[2] != dst[2]:
                    raise TransportError(f"run {run}: piece sizes differ ({src[2]} vs {dst[2]})")
                src_id, dst_id = run.src, run.dst
                s_first, s_count, _ = src
                d_first, d_count, _ = dst
            count, src_first, dst_first = run.count, run.src_first, run.dst_first
            if count <= 0 or src_first < 0 or dst_first < 0 or src_first + count > s_count:
                raise TransportError(f"run {run} is out of the registered bounds")
            if dst_first + count > d_count:
                raise TransportError(f"run {run} is out of the registered bounds")
            if count == 1:
                add_src(s_first + src_first)
                add_dst(d_first + dst_first)
            else:
                src_index.extend(range(s_first + src_first, s_first + src_first + count))
                dst_index.extend(range(d_first + dst_first, d_first + dst_first + count))
        return src_index, dst_index

    def _refresh(self, transfer: _Transfer) -> None:
        if transfer.xfer is None or transfer.state.terminal:
            return
        try:
            status = self._agent.check_xfer_state(transfer.xfer)
        except Exception as exc:  # NIXL raises (rather than answering ERR) on a failed endpoint
            log.info("%s: transfer from %s failed: %s", self._name, transfer.peer, exc)
            status = "ERR"
        state = _STATES.get(status, TransferState.FAILED)
        if state is not TransferState.PENDING:
            transfer.state = state
            self._after_end(transfer)

    def _detach(self, transfer: _Transfer) -> None:
        """Release the NIXL handle (on a live one this only stops us from watching it)."""
        xfer, transfer.xfer = transfer.xfer, None
        if xfer is not None:
            with nixl_errors(f"{self._name}: NIXL refused to release a transfer"):
                xfer.release()

    def _after_end(self, transfer: _Transfer) -> None:
        """A transfer ended (or was released): free what waited on it."""
        self._reap()
        link = self._peers.get(transfer.peer)
        if link is not None and link.closing:
            self._finish_closing(link)

    # ------------------------------------------------------------------ connect helpers

    def _beacon_read(self, link: _Peer, beacon: int) -> tuple[int, bytes, float]:
        """Post a READ of the peer's beacon into a free scratch slot.

        Returns its internal handle, a copy of the slot taken right after the post returned, and
        how long after the post that copy was finished.
        """
        with self._lock:
            self._check_open()
            slot = self._beacon.take_slot()
            if slot is None:
                raise PeerUnavailable(f"{self._name}: {SCRATCH_SLOTS} connects are still waiting for their peers")
            address = self._beacon.slot_address(slot)
            agent, np = self._agent, self._np
            xfer = None
            try:
                local = agent.get_xfer_descs(np.array([[address, BEACON_BYTES, 0]], dtype=np.uint64), "DRAM")
                remote = agent.get_xfer_descs(np.array([[beacon, BEACON_BYTES, 0]], dtype=np.uint64), "DRAM")
                xfer = agent.initialize_xfer("READ", local, remote, link.name)
                status = agent.transfer(xfer)
                posted = time.perf_counter()
                seen = ctypes.string_at(address, BEACON_BYTES)
                after = time.perf_counter() - posted
            except Exception as exc:
                self._beacon.give_back(slot)
                if xfer is not None:
                    with contextlib.suppress(Exception):  # its post failed: nothing is in flight
                        xfer.release()
                raise self._translate(exc, f"first read from {link.name!r}") from exc
            handle = next(self._handles)
            state = _STATES.get(status, TransferState.FAILED)
            self._transfers[handle] = _Transfer(xfer, link.name, True, state, slot)
            return handle, seen, after

    def _settle(self, handle: int, deadline: float) -> TransferState:
        """Poll an internal READ until it ends or ``deadline`` (a burst of polls, then short sleeps)."""
        spins = 0
        while True:
            with self._lock:
                transfer = self._transfers[handle]
                self._refresh(transfer)
                state = transfer.state
            if state.terminal or time.monotonic() >= deadline:
                return state
            spins += 1
            if spins > 64:
                time.sleep(200e-6)

    def _finish_internal(self, handle: int, expected: bytes) -> bool:
        """End an internal READ: if it is over, free its slot and say whether the slot's digest is ``expected``.

        One that is still live keeps its handle and slot (swept once it ends) and answers False.
        """
        with self._lock:
            transfer = self._transfers[handle]
            if not transfer.state.terminal:
                return False
            del self._transfers[handle]
            assert transfer.slot is not None
            held = transfer.state is TransferState.DONE and digest(self._beacon.slot_bytes(transfer.slot)) == expected
            self._beacon.give_back(transfer.slot)
            with contextlib.suppress(TransportError):  # an ended READ: releasing it frees NIXL's request
                self._detach(transfer)
            self._after_end(transfer)
            return held

    def _sweep(self) -> None:
        """Free the slots of internal READs that have ended since they were given up."""
        for handle, transfer in list(self._transfers.items()):
            if transfer.slot is not None:
                self._refresh(transfer)
                if transfer.state.terminal:
                    del self._transfers[handle]
                    self._beacon.give_back(transfer.slot)
                    with contextlib.suppress(TransportError):
                        self._detach(transfer)
                    self._after_end(transfer)

    def _unreachable(self, link: _Peer) -> None:
        """A peer whose first READ did not come back: no reads from it; forget it once that READ ends."""
        with self._lock:
            if self._peers.get(link.name) is link and link.info is None:
                link.closing = True
                self._finish_closing(link)

    def _reads_complete_in_post(self, link: _Peer, desc: Description, deadline: float) -> bool:
        """Whether READs from this peer land their bytes before ``transfer()`` returns (CMA).

        The slot is looked at right after the post; a look finished later than ``SYNC_WINDOW_S``
        proves nothing and is repeated. Two complete looks, and no incomplete one, are needed.
        """
        complete = 0
        for _ in range(6):
            handle, seen, after = self._beacon_read(link, desc.beacon)
            state = self._settle(handle, deadline)
            if not self._finish_internal(handle, desc.beacon_digest) or state is not TransferState.DONE:
                return False
            if after > SYNC_WINDOW_S:
                continue
            if digest(seen) != desc.beacon_digest:
                return False
            complete += 1
            if complete == 2:
                return True
        return False

    # ------------------------------------------------------------------ NIXL plumbing

    def _prep(self, agent_name: str, rows: list[list[int]]) -> Any:
        return self._agent.prep_xfer_dlist(agent_name, self._np.array(rows, dtype=self._np.uint64), "DRAM")

    def _load(self, name: str, metadata: bytes) -> None:
        loaded = self._agent.add_remote_agent(metadata)
        self.metadata_loads += 1
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(loaded)
            raise PeerUnavailable(f"description names {name!r} but its metadata is agent {loaded!r}")

    def _live_from(self, peer: str) -> bool:
        return any(t.peer == peer and not t.state.terminal for t in self._transfers.values())

    def _finish_closing(self, link: _Peer) -> None:
        """Forget a disconnected peer once none of its reads can still write."""
        if self._peers.get(link.name) is not link or self._live_from(link.name):
            return
        self._drop(link)

    def _drop(self, link: _Peer) -> None:
        del self._peers[link.name]
        self._retire(link.dlist)
        if link.loaded:
            try:
                self._agent.remove_remote_agent(link.name)
            except Exception as exc:
                log.info("%s: removing peer %s: %s", self._name, link.name, exc)

    def _retire(self, dlist: Any) -> None:
        if dlist is not None:
            self._retired.append(dlist)
        self._reap()

    def _reap(self) -> None:
        """Release replaced prepared lists once no transfer handle is left that was made from them."""
        if not self._retired or any(t.xfer is not None for t in self._transfers.values()):
            return
        retired, self._retired = self._retired, []
        for dlist in retired:
            with contextlib.suppress(Exception):  # a list NIXL will not release is only memory
                dlist.release()

    def _transfer(self, handle: int) -> _Transfer:
        transfer = self._transfers.get(handle)
        if transfer is None or transfer.slot is not None:
            raise TransportError(f"unknown transfer handle {handle}")
        return transfer

    def _translate(self, exc: Exception, what: str) -> TransportError:
        if isinstance(exc, self._peer_errors):
            return PeerUnavailable(f"{self._name}: {what}: {type(exc).__name__}: {exc}")
        return TransportError(f"{self._name}: {what}: {type(exc).__name__}: {exc}")

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"data plane {self._name!r} is closed")


def _attempt(failures: list[str], what: str, call: Any, *args: Any) -> None:
    try:
        call(*args)
    except Exception as exc:
        failures.append(f"{what}: {exc}")


if TYPE_CHECKING:
    from kvcr.ports.dataplane import DataPlane

    _: DataPlane = NixlDataPlane("x")
