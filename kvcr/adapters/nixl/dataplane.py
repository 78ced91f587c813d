"""DataPlane over NIXL 1.5.1: one agent, UCX backend, one-sided READs of a peer's exposed regions.

What each behaviour below rests on was measured and is written up in ``docs/nixl-behaviour.md``
(probes in ``scripts/probes/``). The plane keeps its peers and the order of things; its parts:
``regions.py`` (our registrations, the prepared list, a read's piece indices), ``transfers.py``
(handles, their NIXL states, replaced lists released once unused), ``warmup.py`` (the connect-time
beacon READs) and ``agent.py`` (building the agent, mapping NIXL's errors).

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
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcr.adapters.nixl import wire
from kvcr.adapters.nixl.agent import build_agent, nixl_errors, transport_report, ucx_environment
from kvcr.adapters.nixl.beacon import BEACON_BYTES, Beacon
from kvcr.adapters.nixl.regions import LocalRegions, piece_indices
from kvcr.adapters.nixl.transfers import TransferTable
from kvcr.adapters.nixl.warmup import BeaconReads
from kvcr.adapters.nixl.wire import Description, Extent
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import PeerInfo, TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError

if TYPE_CHECKING:
    from kvcr.adapters.nixl.probe import ZeroCopyReport

log = logging.getLogger(__name__)


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
        self._transfers = TransferTable(name, self._check_state, self._peer_read_ended)
        self._incarnation = os.urandom(8)
        self._host = wire.host_identity()
        self.metadata_loads = 0  # add_remote_agent calls, for observability and tests
        self._ucx_environment = ucx_environment()  # what the agent's UCX was built with
        self._agent, self._np, self._peer_errors = build_agent(name, self._params, progress_wake_s)
        self._regions = LocalRegions(name, self._agent, self._np, self._transfers.retire)
        self._beacon = Beacon()
        self._beacons = BeaconReads(
            name, self._lock, self._beacon, self._transfers, self._agent_now, self._check_open, self._translate
        )
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

    def peer_name(self, description: bytes) -> str:
        return wire.decode(description)[0].name

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        desc, extents, rows = wire.decode(description)
        deadline = time.monotonic() + max(0.0, timeout_s)
        name = desc.name
        with self._lock:
            self._check_open()
            self._beacons.sweep()
            link = self._peers.get(name)
            if link is not None and link.incarnation != desc.incarnation:
                if self._transfers.live_from(name):
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
                self._transfers.retire(link.dlist)
                link.description, link.extents, link.dlist, link.closing = description, extents, dlist, False
                if link.info is not None:
                    return link.info
            else:
                loaded = name != self._name
                link = self._peers[name] = _Peer(name, description, desc.incarnation, extents, dlist, loaded)
        warm, _, _ = self._beacons.read(name, desc.beacon)
        self._beacons.settle(warm, deadline)
        if not self._beacons.finish(warm, desc.beacon_digest):
            self._unreachable(link)
            raise PeerUnavailable(f"{self._name}: peer {name!r} did not answer within {timeout_s:.2f}s")
        same_host = bool(self._host) and desc.host == self._host
        # Both must agree before a peer's reads may land in engine memory: this peer's reads must
        # really end inside the post, and UCX must have its zero-copy path here (a tcp READ over a
        # fast loopback can also finish inside the post, so timing alone would misjudge it). The
        # zero-copy probe (begun at construction; seconds over tcp) is waited for only within
        # this connect's deadline: a peer it is still needed for is not connected yet (a miss).
        late_writes = not (same_host and self._beacons.complete_in_post(name, desc, deadline))
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
            for transfer in self._transfers:
                if transfer.peer == peer and not transfer.state.terminal and not transfer.late_writes:
                    self._transfers.refresh(transfer)
                    if not transfer.state.terminal:
                        self._transfers.detach(transfer)
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
            if not runs:
                return self._transfers.add(None, peer, False, TransferState.DONE)
            src_index, dst_index = piece_indices(self._name, link.name, link.extents, self._regions.extents, runs)
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
            return self._transfers.add(xfer, peer, link.info.late_writes, status)

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfers.posted(handle)
            self._transfers.refresh(transfer)
            return transfer.state

    def cancel(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfers.posted(handle)
            self._transfers.refresh(transfer)
            if transfer.state.terminal:
                return transfer.state
            if not transfer.late_writes:
                # Its bytes were copied inside the post; what is left is an endpoint flush.
                self._transfers.detach(transfer)
                transfer.state = TransferState.CANCELLED
            else:
                transfer.state = TransferState.UNCERTAIN  # NIXL 1.5.1 cannot stop it: keep watching
            return transfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            transfer = self._transfers.posted(handle)
            if not transfer.state.terminal:
                raise KvcrError(f"transfer {handle} is {transfer.state.value}; releasing it could reuse live memory")
            self._transfers.pop(handle)
            try:
                self._transfers.detach(transfer)
            finally:
                self._transfers.ended(transfer)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._beacons.sweep()
            for transfer in self._transfers:
                self._transfers.refresh(transfer)
            live = [h for h, t in self._transfers.items() if not t.state.terminal and t.slot is None]
            if live:
                raise KvcrError(f"{self._name}: {len(live)} transfers are not terminal; cannot close")
            self._closed = True
            failures: list[str] = []
            for transfer in self._transfers:
                # Only our own connect READs into scratch memory can be left: destroying the agent
                # below stops them (a tcp source frozen meanwhile may abort when it resumes: UCX).
                _attempt(failures, "release a transfer", self._transfers.detach, transfer)
            self._transfers.clear()
            for link in self._peers.values():
                self._transfers.retire(link.dlist)
                if link.loaded:
                    _attempt(failures, f"remove {link.name!r}", self._agent.remove_remote_agent, link.name)
            self._peers.clear()
            self._regions.retire_list()
            self._transfers.reap()
            failures += self._regions.close(own=(self._beacon_registration, self._scratch_registration))
            self._agent = None  # the last reference: NIXL stops its thread, destroys the agent and UCX worker
        if failures:
            raise TransportError(f"{self._name}: close left work undone: {'; '.join(failures)}")

    # ------------------------------------------------------------------ connect helpers

    def _unreachable(self, link: _Peer) -> None:
        """A peer whose first READ did not come back: no reads from it; forget it once that READ ends."""
        with self._lock:
            if self._peers.get(link.name) is link and link.info is None:
                link.closing = True
                self._finish_closing(link)

    # ------------------------------------------------------------------ NIXL plumbing

    def _agent_now(self) -> tuple[Any, Any]:
        return self._agent, self._np

    def _check_state(self, xfer: Any) -> str:
        return str(self._agent.check_xfer_state(xfer))

    def _peer_read_ended(self, peer: str) -> None:
        """A read from ``peer`` ended: a disconnected peer is forgotten once its last one has."""
        link = self._peers.get(peer)
        if link is not None and link.closing:
            self._finish_closing(link)

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

    def _finish_closing(self, link: _Peer) -> None:
        """Forget a disconnected peer once none of its reads can still write."""
        if self._peers.get(link.name) is not link or self._transfers.live_from(link.name):
            return
        self._drop(link)

    def _drop(self, link: _Peer) -> None:
        del self._peers[link.name]
        self._transfers.retire(link.dlist)
        if link.loaded:
            try:
                self._agent.remove_remote_agent(link.name)
            except Exception as exc:
                log.info("%s: removing peer %s: %s", self._name, link.name, exc)

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
