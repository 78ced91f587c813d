"""A control-channel relay that drops, delays and duplicates whole ZMQ messages (no netem needed).

It sits between a target and a source's control port on loopback and parses ZMTP 3 (greeting,
then frames: a flags byte, a 1- or 8-byte size, the body) in each direction, so it can act on one
*message* of the peer protocol (a HELLO, a LEASE, a LEASE reply, a RELEASE) and keep the stream
valid: a dropped message is as if the network lost it and nobody noticed, a duplicated one arrives
twice, a delayed one arrives late (and holds up what follows it on that connection, as TCP
would). Only the NULL mechanism (no token) can be tampered with like this: with CURVE, a
duplicated or reordered message fails its nonce check and the connection breaks.

``policy(direction, kind, message)`` decides per message: ``direction`` is "up" (target to
source) or "down", ``kind`` the peer-protocol message type (``Hello``, ``LeaseReply``, ...).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvcr.runner import protocol

_GREETING = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


@dataclass(frozen=True)
class Action:
    copies: int = 1  # 0 drops, 2 duplicates
    delay_s: float = 0.0


PASS = Action()
Policy = Callable[[str, str, list[bytes]], Action]


def message_kind(direction: str, frames: list[bytes]) -> str:
    """The peer-protocol type of a control message: its payload (up) or reply body (down), decoded."""
    body = frames[1] if direction == "up" and len(frames) == 2 else frames[2] if len(frames) == 3 else b""
    try:
        return type(protocol.decode(body)).__name__
    except Exception:
        return "other"


class Relay:
    """Listens on a free loopback port and forwards each connection to ``target_port``."""

    def __init__(self, target_port: int, policy: Policy | None = None) -> None:
        self.target_port = target_port
        self.policy: Policy = policy or (lambda direction, kind, frames: PASS)
        self.seen: list[tuple[float, str, str, int]] = []  # (time, direction, kind, copies forwarded)
        self.forward = True  # False: accept connections and swallow everything (a black hole)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def kinds(self, direction: str) -> list[str]:
        with self._lock:
            return [kind for _, d, kind, _ in self.seen if d == direction]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self._sockets.append(client)
            if not self.forward:
                continue  # held open, never answered
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets.append(server)
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                thread = threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True)
                thread.start()
                with self._lock:
                    self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        reader = _Reader(src)
        try:
            left = _GREETING  # passed on as it comes: libzmq sends its greeting in parts and waits in between
            while left:
                chunk = reader.upto(left)
                dst.sendall(chunk)
                left -= len(chunk)
            frames: list[bytes] = []
            raw = bytearray()
            while True:
                flags = reader.exactly(1)[0]
                head = reader.exactly(8 if flags & _LONG else 1)
                size = struct.unpack(">Q", head)[0] if flags & _LONG else head[0]
                body = reader.exactly(size)
                wire = bytes([flags]) + head + body
                if flags & _COMMAND:
                    dst.sendall(wire)  # handshake and heartbeats pass untouched
                    continue
                frames.append(body)
                raw += wire
                if flags & _MORE:
                    continue
                kind = message_kind(direction, frames)
                action = self.policy(direction, kind, frames)
                with self._lock:
                    self.seen.append((time.monotonic(), direction, kind, action.copies))
                if action.delay_s:
                    time.sleep(action.delay_s)
                for _ in range(action.copies):
                    dst.sendall(raw)
                frames, raw = [], bytearray()
        except (OSError, EOFError):
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self._listener.close()
        for thread in self._threads:
            thread.join(2)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def upto(self, n: int) -> bytes:
        if not self._buffer:
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


def once(direction: str, kind: str, action: Action, times: int = 1) -> Policy:
    """A policy that applies ``action`` to the first ``times`` messages of ``kind`` going ``direction``."""
    left = [times]
    lock = threading.Lock()

    def policy(d: str, k: str, frames: list[bytes]) -> Action:
        with lock:
            if d == direction and k == kind and left[0] > 0:
                left[0] -= 1
                return action
        return PASS

    return policy
