"""A TCP relay on loopback that records both directions and can rewrite bytes in flight.

A hostile network in miniature: the tests put it between a legitimate client and a server to
record what goes over the wire (for replay), flip bits, or splice one reply in place of another.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

Tamper = Callable[[int, bytes], bytes]
"""(stream offset of the chunk, chunk) -> the bytes to forward instead."""


class Relay:
    """Listens on a free loopback port and forwards every connection to ``target_port``."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.up = bytearray()  # client -> server, as the client sent it (all connections)
        self.down = bytearray()  # server -> client, as the server sent it
        self.up_chunks: list[bytes] = []  # the client's bytes as they arrived, one recv at a time
        self.tamper_up: Tamper | None = None
        self.tamper_down: Tamper | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            server = socket.create_connection(("127.0.0.1", self._target_port))
            with self._lock:
                self._sockets += [client, server]
            for src, dst, record, up in ((client, server, self.up, True), (server, client, self.down, False)):
                thread = threading.Thread(target=self._pump, args=(src, dst, record, up), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray, up: bool) -> None:
        offset = 0
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                with self._lock:
                    record += chunk  # recorded before forwarding: once the peer has it, so do we
                    if up:
                        self.up_chunks.append(chunk)
                    tamper = self.tamper_up if up else self.tamper_down
                dst.sendall(tamper(offset, chunk) if tamper else chunk)
                offset += len(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def replay(self, port: int, pause_s: float = 0.05) -> bytes:
        """Send the recorded client bytes to ``port`` on a new connection, chunk by chunk as they came.

        The pauses keep the original pacing: libzmq refuses a message frame that arrives before
        its handshake has completed, so a replay that sent everything at once would fail for that
        reason alone. Returns whatever the server sent back.
        """
        with self._lock:
            chunks = list(self.up_chunks)
        got = b""
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
            sock.settimeout(pause_s)
            for chunk in chunks:
                sock.sendall(chunk)
                got += _drain(sock)
            sock.settimeout(0.3)
            got += _drain(sock)
        return got

    def recorded(self) -> tuple[bytes, bytes]:
        with self._lock:
            return bytes(self.up), bytes(self.down)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv (close alone does not)
            s.close()
        self._listener.close()
        for thread in self._threads:
            thread.join(2)


def flip_at(position: int) -> Tamper:
    """Flip one bit of the byte at stream ``position``."""

    def tamper(offset: int, chunk: bytes) -> bytes:
        if offset <= position < offset + len(chunk):
            i = position - offset
            return chunk[:i] + bytes([chunk[i] ^ 0x01]) + chunk[i + 1 :]
        return chunk

    return tamper


def splice_at(position: int, replacement: bytes) -> Tamper:
    """Replace the stream's bytes from ``position`` on with ``replacement`` (same length)."""

    def tamper(offset: int, chunk: bytes) -> bytes:
        out = bytearray(chunk)
        for i in range(len(chunk)):
            j = offset + i - position
            if 0 <= j < len(replacement):
                out[i] = replacement[j]
        return bytes(out)

    return tamper


def _drain(sock: socket.socket) -> bytes:
    got = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except (TimeoutError, ConnectionResetError):
            return got
        if not chunk:
            return got
        got += chunk
