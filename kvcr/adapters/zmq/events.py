"""KvEventPublisher over a ZMQ PUB socket, in the KV-event wire format Dynamo's router reads.

Wire format (one ZMQ multipart message per batch; SGLang and vLLM publish the same)::

    [topic (utf-8), seq (u64, 8 bytes big-endian), msgpack([ts: float, events: [map, ...], dp_rank: int | None])]

``seq`` starts at 0 for every publisher instance and grows by exactly 1 per message handed to
the socket, so the sequence a subscriber sees has no gaps of our making. A restarted publisher
starts at 0 again; a Dynamo router keeps the old watermark, so the worker must be re-registered
there (``kvcr.integrations.dynamo.hints.HintProducer.register_worker`` does that).

Threading: the constructor binds the socket in the caller's thread (a bind failure raises
there), then hands it to a daemon thread that drains a bounded queue. ``publish`` only enqueues
and never blocks or raises. When the queue is full the batch is dropped before it gets a
sequence number (the wire stays gap-free, but the router misses that change), counted in
``dropped`` and logged; size ``max_queued_batches`` so that it does not happen.

The socket is an XPUB (a PUB that also reports subscriptions), so ``wait_for_subscriber`` can
tell when a router's SUB is attached: ZMQ drops what a PUB sends before that ("slow joiner").
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcr.adapters.zmq.sockets import bind_with_retry, zmq_address
from kvcr.domain.endpoints import split_host_port
from kvcr.domain.errors import ConfigError

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)

_SLICE_S = 0.05  # longest single wait of the sender thread: how fast close() is noticed
_BIND_RETRY_S = 1.0  # a restarted publisher may find its port still held for a moment
_DROP_LOG_INTERVAL_S = 5.0


def bind_address(endpoint: str) -> tuple[str, int]:
    """Check ``tcp://host:port`` as a PUB bind address; returns (host, port).

    The host may be a wildcard (``*``, ``0.0.0.0``, ``::``): a PUB binds, routers dial it.

    Raises:
        ConfigError: not ``tcp://``, no host, or a port outside 1..65535.
    """
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ConfigError(f"kv events endpoint must be tcp://host:port, got {endpoint!r}")
    rest = endpoint[len("tcp://") :]
    split = split_host_port(rest)
    if split is None:
        if rest.startswith("["):
            raise ConfigError(f"kv events endpoint {endpoint!r} has no port")
        raise ConfigError(f"kv events endpoint {endpoint!r} is not tcp://host:port")
    host, port_text, in_brackets = split
    if in_brackets:
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ConfigError(f"kv events endpoint {endpoint!r}: {exc}") from exc
    elif not host or ":" in host:
        raise ConfigError(f"kv events endpoint {endpoint!r} is not tcp://host:port")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"kv events endpoint {endpoint!r} needs a port in 1..65535")
    return host, int(port_text)


class ZmqEventPublisher:
    """Publishes KV-event batches on a bound ZMQ (X)PUB socket. Thread-safe.

    Args:
        endpoint: the bind address, ``tcp://host:port`` (explicit; a wildcard host is allowed).
        topic: the first frame of every message.
        dp_rank: the data-parallel rank carried in every batch (None: not data parallel).
        max_queued_batches: batches waiting for the sender thread before new ones are dropped.
        send_hwm: messages ZMQ buffers per slow subscriber before it drops (the router then
            sees a sequence gap and warns).
        flush_timeout_s: how long ``close`` keeps sending what is queued.
        context: a ``zmq.Context`` to share; by default the publisher owns (and terminates) one.
        wall_clock: the timestamp of a batch (seconds since the epoch).

    Raises:
        ConfigError: a bad endpoint, dp_rank or bound.
        TransportError: the address cannot be bound.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "kv-events",
        dp_rank: int | None = 0,
        *,
        max_queued_batches: int = 65536,
        send_hwm: int = 100_000,
        flush_timeout_s: float = 2.0,
        context: zmq.Context[Any] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        host, port = bind_address(endpoint)
        if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
            raise ConfigError(f"kv events dp_rank must be a non-negative int or None, got {dp_rank!r}")
        if max_queued_batches < 1 or send_hwm < 1 or flush_timeout_s < 0:
            raise ConfigError("kv events: max_queued_batches and send_hwm must be positive, flush_timeout_s >= 0")
        import msgpack
        import zmq

        self._zmq: Any = zmq
        self._pack: Callable[[object], bytes] = msgpack.Packer(use_bin_type=True).pack
        self._endpoint = endpoint
        self._topic = topic.encode("utf-8")
        self._dp_rank = dp_rank
        self._flush_timeout_s = flush_timeout_s
        self._wall_clock = wall_clock
        self._queue: queue.Queue[tuple[float, list[dict[str, Any]]]] = queue.Queue(max_queued_batches)
        self._lock = threading.Lock()
        self._subscribed = threading.Condition(self._lock)
        self._subscribers = 0
        self._seq = 0
        self._dropped = 0
        self._last_drop_log = -_DROP_LOG_INTERVAL_S
        self._closed = False
        self._stop = threading.Event()
        self._flush_deadline = 0.0
        self._own_context = context is None
        self._context: zmq.Context[Any] = zmq.Context() if context is None else context
        sock = self._context.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, send_hwm)
            # Every (un)subscription is reported, so the count follows each router's SUB.
            sock.setsockopt(getattr(zmq, "XPUB_VERBOSER", zmq.XPUB_VERBOSE), 1)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            bind_with_retry(zmq, sock, zmq_address(host, port), _BIND_RETRY_S, "kv events endpoint")
        except BaseException:
            sock.close(linger=0)
            if self._own_context:
                self._context.term()
            raise
        # Thread.start is a full memory barrier: the socket migrates to the sender thread here.
        self._thread = threading.Thread(target=self._run, args=(sock,), name=f"kvcr-kv-events-{port}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next message sent will carry."""
        with self._lock:
            return self._seq

    @property
    def dropped(self) -> int:
        """Batches dropped before they were sent (queue full, closed, or unencodable)."""
        with self._lock:
            return self._dropped

    @property
    def subscribers(self) -> int:
        """Subscriptions currently attached (one per router SUB and topic prefix)."""
        with self._lock:
            return self._subscribers

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        if self._closed:
            self._count_drop("the publisher is closed")
            return
        try:
            self._queue.put_nowait((self._wall_clock(), events))
        except queue.Full:
            self._count_drop(f"{self._queue.maxsize} batches are already queued")

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """Wait until at least one subscriber is attached; False if none within ``timeout_s``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._subscribed:
            while self._subscribers <= 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._subscribed.wait(left)
            return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "next_seq": self._seq,
                "dropped": self._dropped,
                "queued": self._queue.qsize(),
                "subscribers": self._subscribers,
            }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._flush_deadline = time.monotonic() + self._flush_timeout_s
        self._stop.set()
        self._thread.join(self._flush_timeout_s + 2.0)
        if self._thread.is_alive():
            log.warning("kv events publisher %s: sender thread did not stop in time", self._endpoint)

    def _count_drop(self, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._dropped += 1
            dropped = self._dropped
            loud = now - self._last_drop_log >= _DROP_LOG_INTERVAL_S
            if loud:
                self._last_drop_log = now
        if loud:
            log.warning(
                "kv events publisher %s dropped a batch (%s; %d dropped so far): the router's index now "
                "misses a change; raise max_queued_batches",
                self._endpoint,
                why,
                dropped,
            )

    # ------------------------------------------------------------------ sender thread

    def _run(self, sock: zmq.Socket[bytes]) -> None:
        lib = self._zmq
        try:
            while True:
                self._read_subscriptions(sock)
                try:
                    ts, events = self._queue.get(timeout=_SLICE_S)
                except queue.Empty:
                    if self._stop.is_set():
                        break
                    continue
                self._send(sock, ts, events)
                if self._stop.is_set() and time.monotonic() > self._flush_deadline:
                    left = self._queue.qsize()
                    if left:
                        with self._lock:
                            self._dropped += left
                        log.warning("kv events publisher %s: %d batches unsent at close", self._endpoint, left)
                    break
        except lib.ZMQError as exc:
            log.error("kv events publisher %s stopped: %s", self._endpoint, exc)
        finally:
            linger_ms = max(0, round((self._flush_deadline - time.monotonic()) * 1000)) if self._stop.is_set() else 0
            sock.close(linger=linger_ms)
            if self._own_context:
                self._context.term()

    def _send(self, sock: zmq.Socket[bytes], ts: float, events: list[dict[str, Any]]) -> None:
        lib = self._zmq
        try:
            payload = self._pack([ts, events, self._dp_rank])
        except (TypeError, ValueError, OverflowError) as exc:
            log.error("kv events publisher %s: a batch could not be encoded (%s); dropped", self._endpoint, exc)
            with self._lock:
                self._dropped += 1
            return
        with self._lock:
            seq = self._seq
        try:
            sock.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], lib.NOBLOCK)
        except lib.Again:
            self._count_drop("the socket refused the message")
            return
        with self._lock:
            self._seq = seq + 1  # only a message ZMQ took consumes a number: no gap of ours

    def _read_subscriptions(self, sock: zmq.Socket[bytes]) -> None:
        lib = self._zmq
        changed = False
        while sock.poll(0, lib.POLLIN):
            frame = sock.recv(lib.NOBLOCK)
            if not frame or not self._topic.startswith(frame[1:]):
                continue  # a subscription to another topic receives nothing from us
            delta = 1 if frame[0] == 1 else -1 if frame[0] == 0 else 0
            with self._lock:
                self._subscribers = max(0, self._subscribers + delta)
            changed = True
        if changed:
            with self._subscribed:
                self._subscribed.notify_all()


if TYPE_CHECKING:
    from kvcr.ports.inventory import KvEventPublisher

    _: KvEventPublisher = ZmqEventPublisher("tcp://127.0.0.1:1")
