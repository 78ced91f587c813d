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

Where things live: this module holds the data plane itself (setup, connect, read, close) and
keeps the one lock. Its tables take no lock of their own: :mod:`.regions` (our regions, the
description, how a read's runs become segments), :mod:`.reads` (the reads by handle: posting
and settling their receives, failing and cancelling them), :mod:`.links` (a link to a source,
its HELLO/WELCOME handshake, the GONE it may send), :mod:`.leftovers` (sends, closes and stale
messages kept alive until UCX is done with them). The source's half is :mod:`.source`, the
progress thread :mod:`.progress`, the messages :mod:`.wire`, the paths :mod:`.paths`.

Threading: one lock guards our tables (the data plane holds it around every call into them);
UCX calls are made on a worker in UCX's multi-thread mode, from the caller's thread (posting,
``poll``'s progress) and from the progress thread.
Memory a source exposes must stay mapped until the data plane is closed: UCX sends cannot be
cancelled, so a send may still read it after ``deregister``.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvcr.adapters.ucx import wire
from kvcr.adapters.ucx.binding import Binding, load
from kvcr.adapters.ucx.leftovers import Leftovers, take_stale
from kvcr.adapters.ucx.links import Handshake, Link, farewells, mark_dead
from kvcr.adapters.ucx.paths import host_token, late_writes
from kvcr.adapters.ucx.progress import MODES, Pump
from kvcr.adapters.ucx.reads import Reads
from kvcr.adapters.ucx.regions import Regions
from kvcr.adapters.ucx.source import Server
from kvcr.domain.errors import ConfigError, KvcrError
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import PeerInfo, ReadGuard, TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError

log = logging.getLogger(__name__)

_ERROR_MODES = {"peer": True, "none": False}
_NO_CACHE = (
    "{name}: ucx_error_handling_mode=peer needs a UCX registration cache, and this process cannot make "
    "one any more (another UCX build, such as NIXL's, hooked memory events after ucxx's did). UCX 1.21 "
    "dereferences the missing cache when a peer dies mid-rendezvous and the process crashes "
    "(openucx/ucx#11467, fixed in 1.22). Make this data plane before the other UCX library loads "
    "(docs/ucx.md)"
)


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
        self._nonce = secrets.randbits(63)
        self._lock = threading.Lock()
        self._closed = False
        self._regions = Regions(name)
        self._peers: dict[str, Link] = {}
        self._handles = itertools.count(1)  # read ids and hello ids: 40 bits on the wire
        self.drained = 0  # stale messages taken out of the way (observability, tests)
        self._b: Binding = load()
        self._reads = Reads(self._b, name, self._nonce, reply_timeout_s)
        self._leftovers = Leftovers(self._b)
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
            return self._regions.register(regions, exposed=exposed)

    def deregister(self, ids: Sequence[int]) -> None:
        with self._lock:
            self._regions.deregister(ids)

    # ------------------------------------------------------------------ peers

    def describe(self) -> bytes:
        with self._lock:
            self._check_open()
            return self._regions.description(self._encode_description)

    def peer_name(self, description: bytes) -> str:
        try:
            return wire.decode_description(description).name
        except ValueError as exc:
            raise PeerUnavailable(str(exc)) from exc

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
            link = Link(
                desc.name,
                description,
                desc.nonce,
                desc.address,
                endpoint,
                {r.id: r for r in desc.regions},
                PeerInfo(desc.name, late_writes(self._error_handling, host_token(), desc.host, self._options)),
            )
            dead = link.dead
            endpoint.set_close_callback(mark_dead, (dead,))
            hello = wire.Hello(wire.VERSION, self._name, self._nonce, self._address, next(self._handles))
            try:
                handshake = Handshake.post(self._b, endpoint, hello)
            except Exception as exc:
                self._leftovers.close_endpoint(endpoint)
                raise PeerUnavailable(f"{self._name}: cannot say HELLO to {desc.name!r}: {exc}") from exc
        why = handshake.outcome(self._b, self._worker, timeout, dead, desc.nonce)
        with self._lock:
            if not handshake.sent.completed:  # a zero-copy send still reads its buffer
                self._leftovers.keep(handshake.sent, handshake.hello)
            if not why and self._closed:
                why = "we closed meanwhile"
            if why:
                self._leftovers.close_endpoint(endpoint)
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
            segments, wire_runs = self._regions.plan(link.name, link.regions, runs)
            handle = next(self._handles)
            if handle > wire.MAX_READ_ID:
                raise TransportError(f"{self._name}: read ids are exhausted")
            self._reads.post(link, handle, segments, wire_runs, lease)
            return handle

    def poll(self, handle: int) -> TransferState:
        self._worker.progress()
        with self._lock:
            return self._reads.poll(handle)

    def cancel(self, handle: int) -> TransferState:
        self._worker.progress()
        with self._lock:
            return self._reads.cancel(handle)

    def release(self, handle: int) -> None:
        with self._lock:
            self._reads.release(handle)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            live = self._reads.unfinished()
            if live:
                raise KvcrError(f"{self._name}: {live} transfers are not terminal; cannot close")
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
        self._leftovers.cancel_all()
        with self._lock:
            self._regions.clear()

    # ------------------------------------------------------------------ internals

    def _exposed_regions(self) -> Mapping[int, RegionDescriptor]:
        return self._regions.exposed  # the server reads it under self._lock

    def _encode_description(self, regions: list[wire.RegionWire]) -> bytes:
        return wire.ENCODER.encode(
            wire.Description(
                wire.VERSION, self._name, self._nonce, self._address, self._error_handling, host_token(), regions
            )
        )

    def _drop(self, link: Link, why: str) -> None:
        """Tear ``link`` down (under the lock): its live reads stop, then its endpoint closes."""
        self._reads.stop_link(link, why)
        if not link.dead[0]:
            self._leftovers.send(link.endpoint, wire.BYE, wire.ENCODER.encode(wire.Bye(self._name, self._nonce)))
        self._leftovers.close_endpoint(link.endpoint)

    def _progress_round(self) -> bool:
        """One turn of the progress thread: progress, serve peers, drain stale messages."""
        self._worker.progress()
        busy = self._server.serve()
        busy = farewells(self._b, self._worker, self._gone) or busy
        busy = self._drain() or busy
        return busy

    def _gone(self, gone: wire.Bye) -> None:
        """A source that closed said GONE: its link dies now, so its reads fail at once."""
        with self._lock:
            link = self._peers.get(gone.name)
            if link is not None and link.nonce == gone.nonce:
                link.dead[0] = True

    def _drain(self) -> bool:
        """Take to-target messages that found no receive (they belong to given-up reads)."""
        found = take_stale(self._b, self._worker)
        with self._lock:  # _drop adds to the same leftovers from callers' threads
            self.drained += len(found)
            self._leftovers.keep_all(found)
        return bool(found)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"data plane {self._name!r} is closed")


if TYPE_CHECKING:
    from kvcr.ports.dataplane import DataPlane, GuardedReads

    _: DataPlane = UcxDataPlane("x")
    _g: GuardedReads = UcxDataPlane("x")
