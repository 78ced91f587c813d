"""The source's half of a read: answer HELLOs, check each REQUEST, send the pieces it names.

Runs on the data plane's progress thread. A request is served only when every run names an
exposed region, stays in its bounds, and -- once the peer server installed one -- the read
guard says a live lease covers it; otherwise the source sends a refusal and not one byte of
memory. A request from a peer that did not say HELLO (or from an older incarnation of it) gets
no answer at all: there is no endpoint to answer on, and the target's reply timeout ends it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcr.adapters.ucx import wire
from kvcr.adapters.ucx.binding import STATUS_OK, Binding
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import ReadGuard

log = logging.getLogger(__name__)

_PROBE_BUDGET = 64  # control messages taken per round, so a flood cannot starve progress


@dataclass(slots=True)
class _Client:
    nonce: int
    endpoint: Any


class Server:
    """Serves reads of ``exposed()`` regions to the targets that said HELLO. Not thread-safe:
    only the progress thread calls ``serve``; ``close`` runs after that thread stopped."""

    def __init__(
        self,
        binding: Binding,
        worker: Any,
        name: str,
        nonce: int,
        error_handling: bool,
        exposed: Callable[[], Mapping[int, RegionDescriptor]],
        lock: threading.Lock,
    ) -> None:
        self._b = binding
        self._worker = worker
        self._name = name
        self._nonce = nonce
        self._error_handling = error_handling
        self._exposed = exposed
        self._lock = lock  # the data plane's: guards the region table we read
        self._guard: ReadGuard | None = None
        self._clients: dict[str, _Client] = {}
        self._incoming: list[tuple[int, bytearray, Any]] = []  # (kind, buffer, receive)
        self._sending: list[tuple[Any, object]] = []  # (send request, what it reads from)
        self._closing: list[Any] = []
        self.served = 0  # requests answered with data
        self.refused = 0  # requests answered with a refusal

    def guard_reads(self, allowed: ReadGuard) -> None:
        self._guard = allowed

    @property
    def sends_in_flight(self) -> int:
        return len(self._sending)

    def serve(self) -> bool:
        """Take the control messages that arrived and act on them; True if there was any."""
        worked = False
        kind_mask = self._b.mask(wire.TO_SOURCE)
        probe_tag = self._b.tag(wire.TO_SOURCE)
        for _ in range(_PROBE_BUDGET):
            probe = self._worker.tag_probe(probe_tag, kind_mask, remove=True)
            if not probe.matched:
                break
            kind = int(probe.sender_tag.value) & wire.KIND_MASK
            buffer = bytearray(max(probe.length, 1))
            receive = self._worker.tag_recv_with_handle(self._b.array(buffer), probe)
            self._incoming.append((kind, buffer, receive))
            worked = True
        if self._incoming:
            waiting = []
            for kind, buffer, receive in self._incoming:
                if not receive.completed:
                    waiting.append((kind, buffer, receive))
                elif receive.status == STATUS_OK:
                    self._dispatch(kind, bytes(buffer))
            self._incoming = waiting
        if self._sending:
            self._sending = [(r, keep) for r, keep in self._sending if not r.completed]
        if self._closing:
            self._closing = [r for r in self._closing if not r.completed]
        return worked

    def close(self) -> None:
        """Tell every target we are gone (so their reads fail now, not at their reply timeout), then
        close the endpoints.

        No progress here: it would also move sends still in flight, and a caller may free the memory
        they read from as soon as ``close`` returns (or before, in tests). A small eager GONE leaves
        inside its post.
        """
        gone = wire.ENCODER.encode(wire.Bye(self._name, self._nonce))
        for client in self._clients.values():
            self._send(client.endpoint, wire.GONE, gone)
        for client in self._clients.values():
            self._close_endpoint(client.endpoint)
        self._clients.clear()
        for _, _, receive in self._incoming:
            self._b.cancel(receive)
        self._incoming.clear()

    # ------------------------------------------------------------------ messages

    def _dispatch(self, kind: int, data: bytes) -> None:
        try:
            if kind == wire.REQUEST:
                self._on_request(wire.decode_request(data))
            elif kind == wire.HELLO:
                self._on_hello(wire.decode_hello(data))
            elif kind == wire.BYE:
                self._on_bye(wire.decode_bye(data))
        except (ValueError, TypeError) as exc:  # msgspec's errors are ValueErrors
            log.info("%s: dropped a malformed control message: %s", self._name, exc)

    def _on_hello(self, hello: wire.Hello) -> None:
        if hello.version != wire.VERSION or not hello.name:
            log.info("%s: dropped a HELLO of version %s", self._name, hello.version)
            return
        old = self._clients.pop(hello.name, None)
        if old is not None:
            self._close_endpoint(old.endpoint)
        try:
            endpoint = self._worker.create_endpoint_from_worker_address(
                self._b.address(hello.address), self._error_handling
            )
        except Exception as exc:
            log.info("%s: cannot reach %r, which said HELLO: %s", self._name, hello.name, exc)
            return
        self._clients[hello.name] = _Client(hello.nonce, endpoint)
        self._send(endpoint, wire.welcome_tag(hello.hello_id), wire.pack_welcome(self._nonce))

    def _on_bye(self, bye: wire.Bye) -> None:
        client = self._clients.get(bye.name)
        if client is not None and client.nonce == bye.nonce:
            del self._clients[bye.name]
            self._close_endpoint(client.endpoint)

    def _on_request(self, request: wire.Request) -> None:
        client = self._clients.get(request.name)
        if client is None or client.nonce != request.nonce:
            log.info("%s: read from %r, which is not connected (or restarted); not answered", self._name, request.name)
            return
        if not 0 < request.read_id <= wire.MAX_READ_ID:
            return
        code, segments = self._plan(request.runs)
        if code == wire.SENT and self._guard is not None:
            runs = [PieceRun(s, sf, d, df, n) for s, sf, d, df, n, _ in request.runs]
            try:
                allowed = self._guard(request.lease, runs)
            except Exception as exc:  # the guard is the peer server's; a fault in it refuses
                log.warning("%s: read guard failed: %s", self._name, exc)
                allowed = False
            if not allowed:
                code = wire.REFUSED_NOT_LEASED
        if code != wire.SENT:
            self.refused += 1
            self._send(client.endpoint, wire.reply_tag(request.read_id), wire.pack_reply(code, 0))
            return
        endpoint = client.endpoint
        tag = self._b.tag
        view = self._b.view
        for k, (address, nbytes) in enumerate(segments):
            try:
                sent = endpoint.tag_send(view(address, nbytes), tag(wire.data_tag(request.read_id, k)))
            except Exception as exc:
                log.info("%s: send to %r failed: %s", self._name, request.name, exc)
                code = wire.REFUSED_SEND_FAILED
                break
            if not sent.completed:
                self._sending.append((sent, None))
        self.served += code == wire.SENT
        self._send(endpoint, wire.reply_tag(request.read_id), wire.pack_reply(code, len(segments)))

    # ------------------------------------------------------------------ internals

    def _plan(self, runs: Sequence[tuple[int, int, int, int, int, bool]]) -> tuple[int, list[tuple[int, int]]]:
        """(code, [(address, nbytes)] per segment), the same segmentation the target posted."""
        with self._lock:
            exposed = dict(self._exposed())
        segments: list[tuple[int, int]] = []
        for src_id, first, _, _, count, split in runs:
            region = exposed.get(src_id)
            if region is None:
                return wire.REFUSED_UNKNOWN_REGION, []
            if (
                count <= 0
                or first < 0
                or first + count > region.count
                or (not split and count > 1 and not region.dense)
            ):
                return wire.REFUSED_OUT_OF_BOUNDS, []
            if split:
                segments.extend((region.address(first + k), region.piece_bytes) for k in range(count))
            else:
                segments.append((region.address(first), count * region.piece_bytes))
            if len(segments) > wire.MAX_SEGMENTS:
                return wire.REFUSED_MALFORMED, []
        return wire.SENT, segments

    def _send(self, endpoint: Any, tag: int, payload: bytes) -> None:
        buffer = bytearray(payload)
        try:
            sent = endpoint.tag_send(self._b.array(buffer), self._b.tag(tag))
        except Exception as exc:
            log.info("%s: control send failed: %s", self._name, exc)
            return
        if not sent.completed:
            self._sending.append((sent, buffer))

    def _close_endpoint(self, endpoint: Any) -> None:
        with contextlib.suppress(Exception):  # failed already: nothing left to stop
            closing = self._b.close(endpoint)
            if closing is not None:
                self._closing.append(closing)
