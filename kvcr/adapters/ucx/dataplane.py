"""DataPlane over UCX through ucxx 0.52: a read is a request the source answers with tagged sends.

ucxx's Python API has no RMA (no memory handles, remote keys or GET), so a read is two-sided:

1. The target posts one tagged receive per *segment* straight into its destination pieces (a
   run dense on both sides is one segment, otherwise one per piece), plus one for the reply,
   and only then sends the REQUEST (runs, lease, its name and incarnation).
2. The source's serving loop (:mod:`kvcr.adapters.ucx.source`, on its progress thread) checks the
   runs against its exposed regions and its read guard, then tag-sends each segment from its
   DRAM and sends the reply; a refused request gets the reply alone, not one byte of memory.
3. The read is DONE when every segment and an OK reply arrived.

Where the bytes go (``UCX_PROTO_INFO``, UCX 1.21): with ``ucx_error_handling_mode=none``, this
adapter's default (kvcr's ``transport: ucx`` asks for ``peer``: with ``none`` UCX aborts a target
whose source dies mid-rendezvous), two processes on one host use sysv shared memory for messages up to ~5 KB (one
bounce through UCX's FIFO, inherent to eager sends) and, above, a rendezvous the target pulls by
CMA: one ``process_vm_readv`` from the source's DRAM into the destination, no intermediate copy.
With ``peer`` (NIXL's default) UCX keeps only lanes that report a peer's failure, tcp here, and
every piece is streamed through sockets, several times slower for large pieces (docs/ucx.md).
NIXL's UCX keeps CMA for RMA in ``peer`` mode; for tag rendezvous this UCX does not.

Outcomes. FAILED: a refusal, an error on any receive, the source not answering within
``reply_timeout_s``, the source saying GONE (it closed), the endpoint failing (``peer`` mode
notices a dead process), or ``disconnect``. In each case the receives still posted are
cancelled first and the read ends only once every receive has ended, so a FAILED read writes
nothing more. CANCELLED: ``cancel`` took every receive out (``ucp_request_cancel`` confirms a
receive not yet matched at once, :mod:`.binding`). A receive already matched runs to its end;
until it does the read is UNCERTAIN and a later ``poll`` sees it end. Messages for a given-up
read that arrive afterwards find no receive and are drained into scratch memory, never into the
destination. Whether a matched receive can outlive ``disconnect`` depends on the path, hence
``PeerInfo.late_writes`` (:mod:`.paths`): True for tcp, False for CMA on one host.

Threading: one lock guards our tables; UCX calls are made on a worker in UCX's multi-thread
mode, from the caller's thread (posting, ``poll``'s progress) and from the progress thread.
Memory a source exposes must stay mapped until the data plane is closed: UCX sends cannot be
cancelled, so a send may still read it after ``deregister``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcr.adapters.ucx import wire
from kvcr.adapters.ucx.binding import STATUS_CANCELED, STATUS_OK, Binding, load
from kvcr.adapters.ucx.paths import host_token, late_writes
from kvcr.adapters.ucx.progress import MODES, Pump
from kvcr.adapters.ucx.source import Server
from kvcr.domain.errors import ConfigError, KvcrError
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import PeerInfo, ReadGuard, TransferState
from kvcr.ports.errors import PeerUnavailable, RegistrationError, TransportError

log = logging.getLogger(__name__)

_ERROR_MODES = {"peer": True, "none": False}
_NO_CACHE = (
    "{name}: ucx_error_handling_mode=peer needs a UCX registration cache, and this process cannot make "
    "one any more (another UCX build, such as NIXL's, hooked memory events after ucxx's did). UCX 1.21 "
    "dereferences the missing cache when a peer dies mid-rendezvous and the process crashes "
    "(openucx/ucx#11467, fixed in 1.22). Make this data plane before the other UCX library loads "
    "(docs/ucx.md)"
)
_DRAIN_BUDGET = 64


@dataclass(slots=True)
class _Link:
    name: str
    description: bytes
    nonce: int
    address: bytes
    endpoint: Any
    regions: dict[int, wire.RegionWire]
    info: PeerInfo
    dead: list[bool] = field(default_factory=lambda: [False])  # set by UCX's close callback


@dataclass(slots=True)
class _Read:
    link: _Link
    receives: list[Any]
    reply: Any
    reply_buffer: bytearray
    request: Any  # the REQUEST's send, with its payload kept alive
    payload: bytearray
    reply_by: float
    state: TransferState = TransferState.PENDING
    settled: int = 0  # receives [0, settled) are known to have ended
    stopping: bool = False  # every receive still posted was cancelled
    cancelled: bool = False  # cancel() asked
    failure: str = ""


def parse_backend_params(params: Mapping[str, str]) -> tuple[bool, dict[str, str]]:
    """(error handling, UCX context options) from NIXL-style backend parameters.

    ``ucx_devices`` -> UCX ``NET_DEVICES``; ``ucx_error_handling_mode`` -> ``none`` (the default
    here, unlike NIXL's: see the module doc) | ``peer``; any other key written in upper case
    (``TLS``, ``RNDV_THRESH``...) is a UCX option as is.

    Raises:
        ConfigError: an unknown key or value, named.
    """
    error_handling = False
    options: dict[str, str] = {}
    for key, value in params.items():
        key, value = str(key), str(value)
        if key == "ucx_error_handling_mode":
            if value not in _ERROR_MODES:
                raise ConfigError(f"ucx backend parameter ucx_error_handling_mode={value!r}: use 'peer' or 'none'")
            error_handling = _ERROR_MODES[value]
        elif key == "ucx_devices":
            if value:
                options["NET_DEVICES"] = value
        elif key.removeprefix("UCX_") == "RCACHE_ENABLE":
            raise ConfigError(f"ucx backend parameter {key!r}: the adapter sets it (peer mode needs the cache)")
        elif key.isupper() and key.replace("_", "").isalnum():
            options[key.removeprefix("UCX_")] = value
        else:
            raise ConfigError(
                f"unknown ucx backend parameter {key!r} (ucx_devices, ucx_error_handling_mode, or a UCX option "
                "in upper case such as TLS)"
            )
    return error_handling, options


class UcxDataPlane:
    """A DataPlane over one ucxx worker, serving its exposed regions and reading peers'. Thread-safe.

    Args:
        name: our name on the fabric; peers address us by it, so it must be unique.
        backend_params: NIXL-style UCX parameters (see :func:`parse_backend_params`), e.g.
            ``{"ucx_devices": "lo"}`` or ``{"ucx_error_handling_mode": "none"}``.
        progress_mode: ``blocking`` (epoll, no idle cost) or ``polling`` (see :mod:`.progress`).
        progress_interval_s: blocking: the longest sleep between progress rounds; polling: the
            sleep after an idle round (0 spins a core).
        connect_timeout_s: default for how long ``connect`` waits for the peer's WELCOME.
        reply_timeout_s: a read whose source sent no reply by then fails (its receives are
            cancelled first, see the module doc).

    Raises:
        TransportError: ucxx is missing or the UCX context/worker cannot be made.
        ConfigError: a bad backend parameter or progress mode.
    """

    def __init__(
        self,
        name: str,
        *,
        backend_params: Mapping[str, str] | None = None,
        progress_mode: str = "blocking",
        progress_interval_s: float = 0.25,
        connect_timeout_s: float = 2.0,
        reply_timeout_s: float = 2.0,
    ) -> None:
        if not name:
            raise TransportError("a UCX data plane needs a non-empty name")
        if progress_mode not in MODES:
            raise ConfigError(f"ucx progress_mode {progress_mode!r}: use one of {', '.join(MODES)}")
        self._name = name
        self._error_handling, self._options = parse_backend_params(backend_params or {})
        self._connect_timeout_s = connect_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._nonce = secrets.randbits(63)
        self._lock = threading.Lock()
        self._closed = False
        self._ids = itertools.count(1)
        self._exposed: dict[int, RegionDescriptor] = {}
        self._private: dict[int, RegionDescriptor] = {}
        self._description: bytes | None = None
        self._peers: dict[str, _Link] = {}
        self._reads: dict[int, _Read] = {}
        self._handles = itertools.count(1)  # read ids and hello ids: 40 bits on the wire
        self._draining: list[tuple[Any, bytearray]] = []
        self.drained = 0  # stale messages taken out of the way (observability, tests)
        self._b: Binding = load()
        try:
            self._context, self._registration_cache = self._b.context(self._options)
        except Exception as exc:
            raise TransportError(f"cannot create UCX context {name!r} with {self._options}: {exc}") from exc
        if self._error_handling and not self._registration_cache:
            raise TransportError(_NO_CACHE.format(name=name))
        try:
            self._worker = self._b.worker(self._context)
            self._address = bytes(self._worker.address.tobytes())
        except Exception as exc:
            raise TransportError(f"cannot create UCX worker {name!r} with {self._options}: {exc}") from exc
        self._server = Server(
            self._b, self._worker, name, self._nonce, self._error_handling, self._exposed_regions, self._lock
        )
        self._pump = Pump(name, self._worker, progress_mode, progress_interval_s, self._progress_round)

    @property
    def name(self) -> str:
        return self._name

    @property
    def error_handling(self) -> bool:
        return self._error_handling

    @property
    def registration_cache(self) -> bool:
        """Whether our UCX context has a registration cache (peer mode refuses to run without one)."""
        return self._registration_cache

    @property
    def server(self) -> Server:
        """The source side (counters for tests and metrics)."""
        return self._server

    @property
    def live_transfers(self) -> int:
        with self._lock:
            return len(self._reads)

    def guard_reads(self, allowed: ReadGuard) -> None:
        self._server.guard_reads(allowed)

    # ------------------------------------------------------------------ registration

    def register(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        with self._lock:
            self._check_open()
            known = [*self._exposed.values(), *self._private.values()]
            for i, region in enumerate(regions):
                for other in [*known, *regions[:i]]:
                    if region.overlaps(other):
                        raise RegistrationError(f"{self._name}: region {region.label!r} overlaps {other.label!r}")
            table = self._exposed if exposed else self._private
            ids = []
            for region in regions:
                region_id = next(self._ids)
                table[region_id] = region
                ids.append(region_id)
            if exposed:
                self._description = None
            return tuple(ids)

    def deregister(self, ids: Sequence[int]) -> None:
        with self._lock:
            for region_id in ids:
                if self._exposed.pop(region_id, None) is not None:
                    self._description = None
                self._private.pop(region_id, None)

    # ------------------------------------------------------------------ peers

    def describe(self) -> bytes:
        with self._lock:
            self._check_open()
            if self._description is None:
                regions = [wire.RegionWire(i, r.count, r.piece_bytes, r.dense) for i, r in self._exposed.items()]
                self._description = wire.ENCODER.encode(
                    wire.Description(
                        wire.VERSION,
                        self._name,
                        self._nonce,
                        self._address,
                        self._error_handling,
                        host_token(),
                        regions,
                    )
                )
            return self._description

    def connect(self, description: bytes, timeout_s: float | None = None) -> PeerInfo:
        try:
            desc = wire.decode_description(description)
        except ValueError as exc:
            raise PeerUnavailable(str(exc)) from exc
        if desc.error_handling != self._error_handling:
            mode = {True: "peer", False: "none"}
            raise PeerUnavailable(
                f"{self._name}: peer {desc.name!r} uses ucx_error_handling_mode={mode[desc.error_handling]}, "
                f"we use {mode[self._error_handling]}; both ends must agree"
            )
        timeout = self._connect_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._check_open()
            current = self._peers.get(desc.name)
            if current is not None and not current.dead[0]:
                if current.description == description:
                    return current.info
                if current.nonce == desc.nonce and current.address == desc.address:
                    # Same incarnation, new region table: keep the endpoint and the live reads.
                    current.regions = {r.id: r for r in desc.regions}
                    current.description = description
                    return current.info
            if current is not None:
                self._drop(current, "the peer was connected again")
            try:
                endpoint = self._worker.create_endpoint_from_worker_address(
                    self._b.address(desc.address), self._error_handling
                )
            except Exception as exc:
                raise PeerUnavailable(f"{self._name}: cannot reach {desc.name!r}: {exc}") from exc
            link = _Link(
                desc.name,
                description,
                desc.nonce,
                desc.address,
                endpoint,
                {r.id: r for r in desc.regions},
                PeerInfo(desc.name, late_writes(self._error_handling, host_token(), desc.host, self._options)),
            )
            dead = link.dead
            endpoint.set_close_callback(_mark_dead, (dead,))
            hello_id = next(self._handles)
            welcome = bytearray(wire.WELCOME_BYTES)
            hello = bytearray(
                wire.ENCODER.encode(wire.Hello(wire.VERSION, self._name, self._nonce, self._address, hello_id))
            )
            try:
                answer = endpoint.tag_recv(self._b.array(welcome), self._b.tag(wire.welcome_tag(hello_id)))
                sent = endpoint.tag_send(self._b.array(hello), self._b.tag(wire.HELLO))
            except Exception as exc:
                self._close_endpoint(endpoint)
                raise PeerUnavailable(f"{self._name}: cannot say HELLO to {desc.name!r}: {exc}") from exc
        deadline = time.monotonic() + timeout
        spins = 0
        while not answer.completed and time.monotonic() < deadline and not dead[0]:
            self._worker.progress()
            spins += 1
            if spins > 64:
                time.sleep(200e-6)
        why = ""
        if not answer.completed:
            self._b.cancel(answer)
            why = "its endpoint failed" if dead[0] else f"no WELCOME within {timeout:.1f}s"
        elif answer.status != STATUS_OK:
            why = f"its WELCOME failed (status {answer.status})"
        elif wire.unpack_welcome(bytes(welcome)) != desc.nonce:
            why = "it restarted since this description was made"
        with self._lock:
            if not sent.completed:  # a zero-copy send still reads its buffer
                self._draining.append((sent, hello))
            if not why and self._closed:
                why = "we closed meanwhile"
            if why:
                self._close_endpoint(endpoint)
                raise PeerUnavailable(f"{self._name}: peer {desc.name!r} is unreachable: {why}")
            replaced = self._peers.get(desc.name)
            if replaced is not None:  # a concurrent connect won: keep the newest, drop the other
                self._drop(replaced, "the peer was connected again")
            self._peers[desc.name] = link
        return link.info

    def disconnect(self, peer: str) -> None:
        with self._lock:
            link = self._peers.pop(peer, None)
            if link is not None:
                self._drop(link, "disconnected")

    # ------------------------------------------------------------------ transfers

    def read(self, peer: str, runs: Sequence[PieceRun], *, lease: int = 0) -> int:
        with self._lock:
            self._check_open()
            link = self._peers.get(peer)
            if link is None:
                raise PeerUnavailable(f"{self._name}: peer {peer!r} is not connected")
            if link.dead[0]:
                raise PeerUnavailable(f"{self._name}: peer {peer!r} went away")
            segments, wire_runs = self._plan(link, runs)
            handle = next(self._handles)
            if handle > wire.MAX_READ_ID:
                raise TransportError(f"{self._name}: read ids are exhausted")
            if not segments:  # nothing to move: no message, done at once (as a one-sided READ of nothing)
                empty = _Read(link, [], None, bytearray(), None, bytearray(), 0.0, state=TransferState.DONE)
                self._reads[handle] = empty
                return handle
            endpoint, tag, view = link.endpoint, self._b.tag, self._b.view
            receives: list[Any] = []
            reply: Any = None
            reply_buffer = bytearray(wire.REPLY_BYTES)
            payload = bytearray(wire.ENCODER.encode(wire.Request(self._name, self._nonce, handle, lease, wire_runs)))
            try:
                for k, (address, nbytes) in enumerate(segments):
                    receives.append(endpoint.tag_recv(view(address, nbytes), tag(wire.data_tag(handle, k))))
                reply = endpoint.tag_recv(self._b.array(reply_buffer), tag(wire.reply_tag(handle)))
                request = endpoint.tag_send(self._b.array(payload), tag(wire.REQUEST))
            except Exception as exc:
                # The source has seen no request, so nothing matched: every cancel is confirmed.
                for receive in [*receives, reply]:
                    if receive is not None:
                        self._b.cancel(receive)
                error = f"{self._name}: cannot post a read from {peer!r}: {exc}"
                raise (PeerUnavailable(error) if link.dead[0] else TransportError(error)) from exc
            self._reads[handle] = _Read(
                link, receives, reply, reply_buffer, request, payload, time.monotonic() + self._reply_timeout_s
            )
            return handle

    def poll(self, handle: int) -> TransferState:
        self._worker.progress()
        with self._lock:
            read = self._read(handle)
            self._settle(read)
            return read.state

    def cancel(self, handle: int) -> TransferState:
        self._worker.progress()
        with self._lock:
            read = self._read(handle)
            self._settle(read)
            if read.state.terminal:
                return read.state
            read.cancelled = True
            self._stop(read)
            self._settle(read)
            if not read.state.terminal:
                read.state = TransferState.UNCERTAIN
            return read.state

    def release(self, handle: int) -> None:
        with self._lock:
            read = self._read(handle)
            if not read.state.terminal:
                raise KvcrError(f"transfer {handle} is {read.state.value}; releasing it could reuse live memory")
            del self._reads[handle]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for read in self._reads.values():
                self._settle(read)
            live = [h for h, r in self._reads.items() if not r.state.terminal]
            if live:
                raise KvcrError(f"{self._name}: {len(live)} transfers are not terminal; cannot close")
            self._closed = True
            links = list(self._peers.values())
            self._peers.clear()
            for link in links:
                self._drop(link, "closed")
            self._reads.clear()
        if self._pump.stop():
            self._server.close()
        else:  # a read guard holds the progress thread: the server is its until that returns
            log.warning("%s: the progress thread did not stop; peers learn of our close by timeout", self._name)
        for receive, _ in self._draining:
            self._b.cancel(receive)
        self._draining.clear()
        with self._lock:
            self._exposed.clear()
            self._private.clear()

    # ------------------------------------------------------------------ internals

    def _exposed_regions(self) -> Mapping[int, RegionDescriptor]:
        return self._exposed  # the server reads it under self._lock

    def _plan(
        self, link: _Link, runs: Sequence[PieceRun]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int, int, bool]]]:
        """Destination (address, nbytes) per segment, and the runs as the source will see them."""
        segments: list[tuple[int, int]] = []
        wire_runs: list[tuple[int, int, int, int, int, bool]] = []
        for run in runs:
            src = link.regions.get(run.src)
            if src is None:
                raise TransportError(f"run {run}: peer {link.name!r} exposes no region {run.src}")
            dst = self._exposed.get(run.dst) or self._private.get(run.dst)
            if dst is None:
                raise TransportError(f"run {run}: {self._name} has no registered region {run.dst}")
            misfit = run.misfit(src, dst)
            if misfit is not None:
                raise TransportError(misfit)
            split = run.count > 1 and not (src.dense and dst.dense)
            if split:
                segments.extend((dst.address(run.dst_first + k), dst.piece_bytes) for k in range(run.count))
            else:
                segments.append((dst.address(run.dst_first), run.count * dst.piece_bytes))
            wire_runs.append((run.src, run.src_first, run.dst, run.dst_first, run.count, split))
        if len(segments) > wire.MAX_SEGMENTS:
            raise TransportError(f"a read of {len(segments)} segments is over the {wire.MAX_SEGMENTS} a read may have")
        return segments, wire_runs

    def _settle(self, read: _Read) -> None:
        """Move ``read`` on from what its receives say (under the lock)."""
        if read.state.terminal:
            return
        receives = read.receives
        i = read.settled
        while i < len(receives) and receives[i].completed:
            status = receives[i].status
            if status != STATUS_OK and not read.stopping:
                gone = status == STATUS_CANCELED or read.link.dead[0]
                self._fail(read, "the peer went away" if gone else f"a piece failed (UCX status {status})")
            i += 1
        read.settled = i
        reply = read.reply
        if not read.stopping:
            if reply.completed:
                if reply.status != STATUS_OK:
                    self._fail(read, f"its reply failed (UCX status {reply.status})")
                else:
                    code, _ = wire.unpack_reply(bytes(read.reply_buffer))
                    if code != wire.SENT:
                        self._fail(read, f"the source refused: the read {wire.REASONS.get(code, f'code {code}')}")
            elif read.link.dead[0]:
                self._fail(read, "the peer went away")
            elif time.monotonic() > read.reply_by:
                self._fail(read, f"the source did not answer within {self._reply_timeout_s:.1f}s")
        if read.stopping:  # cancelled receives end at once: look again
            while i < len(receives) and receives[i].completed:
                i += 1
            read.settled = i
        if i < len(receives) or not reply.completed:
            return
        if read.failure:
            log.info("%s: read from %s failed: %s", self._name, read.link.name, read.failure)
            read.state = TransferState.FAILED
        elif read.cancelled and not all(r.status == STATUS_OK for r in receives):
            read.state = TransferState.CANCELLED
        else:
            read.state = TransferState.DONE
        read.receives = []  # every one ended: nothing refers to the destination any more

    def _fail(self, read: _Read, why: str) -> None:
        read.failure = read.failure or why
        self._stop(read)

    def _stop(self, read: _Read) -> None:
        """Cancel every receive of ``read`` still posted (a matched one runs on regardless)."""
        read.stopping = True
        cancel = self._b.cancel
        for receive in read.receives[read.settled :]:
            if not receive.completed:
                cancel(receive)
        if not read.reply.completed:
            cancel(read.reply)

    def _drop(self, link: _Link, why: str) -> None:
        """Tear ``link`` down (under the lock): its live reads stop, then its endpoint closes."""
        for read in self._reads.values():
            if read.link is link and not read.state.terminal:
                self._fail(read, why)
                self._settle(read)
                if not read.state.terminal:
                    read.state = TransferState.UNCERTAIN
        if not link.dead[0]:
            bye = bytearray(wire.ENCODER.encode(wire.Bye(self._name, self._nonce)))
            with contextlib.suppress(Exception):  # best effort: the source also notices a dead endpoint
                sent = link.endpoint.tag_send(self._b.array(bye), self._b.tag(wire.BYE))
                if not sent.completed:
                    self._draining.append((sent, bye))
        self._close_endpoint(link.endpoint)

    def _close_endpoint(self, endpoint: Any) -> None:
        with contextlib.suppress(Exception):  # failed already: nothing left to stop
            closing = self._b.close(endpoint)
            if closing is not None:
                self._draining.append((closing, bytearray()))

    def _progress_round(self) -> bool:
        """One turn of the progress thread: progress, serve peers, drain stale messages."""
        self._worker.progress()
        busy = self._server.serve()
        busy = self._farewells() or busy
        busy = self._drain() or busy
        return busy

    def _farewells(self) -> bool:
        """Sources that closed said GONE: their links die now, so their reads fail at once."""
        found = False
        tag, mask = self._b.tag(wire.GONE), self._b.mask(wire.KIND_MASK)
        while True:
            probe = self._worker.tag_probe(tag, mask, remove=True)
            if not probe.matched:
                return found
            found = True
            buffer = bytearray(max(probe.length, 1))
            receive = self._worker.tag_recv_with_handle(self._b.array(buffer), probe)
            deadline = time.monotonic() + 0.1
            while not receive.completed and time.monotonic() < deadline:
                self._worker.progress()
            if not receive.completed or receive.status != STATUS_OK:
                self._b.cancel(receive)
                continue
            try:
                gone = wire.decode_bye(bytes(buffer))
            except (ValueError, TypeError):
                continue
            with self._lock:
                link = self._peers.get(gone.name)
                if link is not None and link.nonce == gone.nonce:
                    link.dead[0] = True

    def _drain(self) -> bool:
        """Take to-target messages that found no receive (they belong to given-up reads)."""
        found: list[tuple[Any, bytearray]] = []
        probe_tag, kind_mask = self._b.tag(wire.DATA), self._b.mask(wire.TO_TARGET)
        for _ in range(_DRAIN_BUDGET):
            probe = self._worker.tag_probe(probe_tag, kind_mask, remove=True)
            if not probe.matched:
                break
            scratch = bytearray(max(probe.length, 1))
            found.append((self._worker.tag_recv_with_handle(self._b.array(scratch), probe), scratch))
        with self._lock:  # _drop adds to the same list from callers' threads
            self.drained += len(found)
            self._draining.extend(found)
            if self._draining:
                self._draining = [(r, keep) for r, keep in self._draining if not r.completed]
        return bool(found)

    def _read(self, handle: int) -> _Read:
        read = self._reads.get(handle)
        if read is None:
            raise TransportError(f"unknown transfer handle {handle}")
        return read

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"data plane {self._name!r} is closed")


def _mark_dead(dead: list[bool]) -> None:
    """UCX's close callback (on whichever thread progressed): only flag it, take no lock."""
    dead[0] = True


if TYPE_CHECKING:
    from kvcr.ports.dataplane import DataPlane, GuardedReads

    _: DataPlane = UcxDataPlane("x")
    _g: GuardedReads = UcxDataPlane("x")
