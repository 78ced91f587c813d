"""Per-node CURVE identities: each node its own keypair, its peers listed in a directory file.

Why: with a cluster token every holder derives the same keys, so any one of them can stand in for
any node (as a server its victims dial, or as a relay between two nodes). With per-node keys:

- a node serves with its own secret key, and a client dials an endpoint only expecting the public
  key the directory lists *for that endpoint*: a relay, even a listed node, cannot complete the
  handshake in another node's name, so it can neither read nor rewrite what that node replies;
- a server admits (ZAP) only the client keys the directory lists, and tells the handler which node
  each connection belongs to (so quotas are per node, whatever number of connections it opens);
- removing a node's line revokes it: the file is looked at again at most every ``RELOAD_S``, a new
  handshake with the revoked key is refused, and so is every further request over a connection it
  had already opened (no other node restarts).

Directory file, one node per line (a line starting with ``#`` is a comment; Z85 uses ``#`` too, so
a comment cannot follow a key on its line)::

    <the node's control endpoint, tcp://host:port>  <its public key, 40 characters of Z85>

Every node gets the same file; ``kvcr keygen`` writes a node's secret key file and prints its line.
A node whose ranks serve several ports (SGLang's TP ranks: the base port plus the rank) is listed
once per port, with the same key.
A file that stops parsing (or disappears) admits nobody until it parses again, and an ERROR says
why: restores become misses, nothing wrong is served. Write a new file and rename it over the old
one, so no reader sees half of it.

pyzmq is imported inside the functions: importing this module needs nothing beyond the stdlib.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcr.adapters.zmq.curve import ZAP_DOMAIN
from kvcr.domain.errors import ConfigError
from kvcr.domain.hints import Endpoint

log = logging.getLogger(__name__)

MAX_DIRECTORY_BYTES = 1 << 20
RELOAD_S = 0.05  # how stale a revocation may be: the directory's status is looked at this often
Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85
_ERROR_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class Directory:
    """One reading of the directory file: each listed endpoint's server key, and every admitted key."""

    by_endpoint: dict[str, bytes]  # "tcp://host:port" -> Z85 public key
    keys: frozenset[bytes]  # raw 32-byte public keys

    @classmethod
    def parse(cls, text: str, source: str) -> Directory:
        """Read the directory's lines.

        Raises:
            ConfigError: a line that is not a key and an endpoint, a key that is not Z85 of 32 bytes,
                an endpoint that is not ``tcp://host:port`` (or is a wildcard), an endpoint listed
                twice; the message names ``source`` and the line. One key may be listed at several
                endpoints: a replica's ranks each serve their own port with the node's one key.
        """
        from zmq.utils import z85

        by_endpoint: dict[str, bytes] = {}
        keys: set[bytes] = set()
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):  # no trailing comments: Z85 uses '#'
                continue
            where = f"peer directory {source!r} line {number}"
            if len(fields) != 2:
                raise ConfigError(f"{where}: expected '<tcp://host:port> <public key>', got {len(fields)} fields")
            endpoint_text, key_text = fields
            try:
                endpoint = Endpoint.parse(endpoint_text, require_scheme=False)
            except ValueError as exc:
                raise ConfigError(f"{where}: endpoint {endpoint_text!r}: {exc}") from exc
            raw = _z85_key(key_text, where)
            name = str(endpoint)
            if name in by_endpoint:
                raise ConfigError(f"{where}: endpoint {name} is listed twice")
            keys.add(raw)
            by_endpoint[name] = z85.encode(raw)
        return cls(by_endpoint, frozenset(keys))


NOBODY = Directory({}, frozenset())


class PeerDirectory:
    """The directory file, read again whenever its status changes (looked at most every ``RELOAD_S``).

    Thread-safe: readers get an immutable :class:`Directory`; at most one reader re-reads the file.

    Raises:
        ConfigError: at construction, the file cannot be read or does not parse (later failures
            admit nobody and are logged, see the module docstring).
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp: tuple[int, ...] | None
        self._stamp, self._current = self._read()
        self._next_look = clock() + RELOAD_S
        self._next_error = 0.0

    def current(self) -> Directory:
        now = self._clock()
        if now < self._next_look or not self._lock.acquire(blocking=False):
            return self._current  # fresh enough, or another thread is looking right now
        try:
            self._next_look = now + RELOAD_S
            try:
                stamp = _stamp(os.stat(self.path))
            except OSError as exc:
                return self._fail(None, f"cannot read it: {exc.strerror}")
            if stamp != self._stamp:
                try:
                    self._stamp, self._current = self._read()
                    log.info("peer directory %s: %d nodes listed", self.path, len(self._current.keys))
                except ConfigError as exc:
                    return self._fail(stamp, str(exc))
            return self._current
        finally:
            self._lock.release()

    def _fail(self, stamp: tuple[int, ...] | None, why: str) -> Directory:
        self._stamp, self._current = stamp, NOBODY
        now = self._clock()
        if now >= self._next_error:
            self._next_error = now + _ERROR_EVERY_S
            log.error("peer directory %s: %s; admitting and dialling no peer until it is fixed", self.path, why)
        return NOBODY

    def _read(self) -> tuple[tuple[int, ...], Directory]:
        """Read the file through one descriptor opened without blocking, after checking what it is."""
        where = f"peer_directory_file {self.path!r}"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(f"{where}: cannot read it: {why}") from exc
        try:
            info = os.fstat(fd)
            problem = _unsafe(info)
            if problem:
                raise ConfigError(f"{where} {problem}")
            text = os.read(fd, MAX_DIRECTORY_BYTES + 1).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(f"{where}: cannot read it: {why}") from exc
        finally:
            os.close(fd)
        if len(text) > MAX_DIRECTORY_BYTES:
            raise ConfigError(f"{where} is larger than {MAX_DIRECTORY_BYTES} bytes")
        return _stamp(info), Directory.parse(text, self.path)


class NodeIdentity:
    """This node's own keypair and the directory of its peers: the channel's credentials.

    Args:
        secret_key: this node's Z85 secret key (40 characters), as ``kvcr keygen`` writes it.
        directory: who may connect, and which key each endpoint must prove.
        endpoint: this node's advertised control endpoint; the directory must list this node's key there.

    Raises:
        ConfigError: a secret key that is not Z85 of 32 bytes; this node not listed at its endpoint.
    """

    def __init__(self, secret_key: bytes, directory: PeerDirectory, endpoint: str) -> None:
        from zmq import curve_public

        try:
            text = secret_key.decode("ascii").strip()
        except UnicodeDecodeError:
            text = ""
        _z85_key(text, "node_key_file")
        self._secret = text.encode()
        self.public_key: bytes = curve_public(self._secret)
        self._directory = directory
        listed = directory.current().by_endpoint.get(endpoint)
        if listed != self.public_key:
            said = "lists another key there" if listed is not None else "does not list it"
            raise ConfigError(
                f"peer directory {directory.path!r} {said}: this node serves {endpoint} with public key "
                f"{self.public_key.decode()}; add the line '{endpoint} {self.public_key.decode()}' on every node"
            )

    per_node = True

    def __len__(self) -> int:
        return 1  # one key set to dial with: nothing to fall back to

    def admits(self, client_key: bytes) -> bool:
        """Whether a raw 32-byte client key is listed right now (revoked keys are not)."""
        return client_key in self._directory.current().keys

    def server_key(self, endpoint: str) -> bytes | None:
        """The public key the server at ``endpoint`` must prove (None: not listed, do not dial)."""
        return self._directory.current().by_endpoint.get(endpoint)

    def configure_server(self, sock: Any) -> None:
        import zmq

        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def configure_client(self, sock: Any, index: int, endpoint: str) -> None:
        """Dial ``endpoint`` with our keys, expecting the key listed for it.

        Raises:
            ConfigError: the endpoint is not listed (callers ask :meth:`server_key` first).
        """
        import zmq

        server = self.server_key(endpoint)
        if server is None:
            raise ConfigError(f"{endpoint} is not in the peer directory")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)


def generate_secret_key() -> tuple[bytes, bytes]:
    """A fresh node keypair (secret, public), Z85-encoded."""
    import zmq

    public, secret = zmq.curve_keypair()
    return secret, public


def write_node_key(path: str) -> bytes:
    """Write a fresh secret key to a new file ``path`` (mode 0600) and return its Z85 public key.

    Raises:
        ConfigError: the file exists (a key is never overwritten: peers list its public key) or
            cannot be created.
    """
    secret, public = generate_secret_key()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError as exc:
        raise ConfigError(f"node key file {path!r} exists: remove it first if you mean to re-key this node") from exc
    except OSError as exc:
        raise ConfigError(f"node key file {path!r}: cannot create it: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return public


def _z85_key(text: str, where: str) -> bytes:
    from zmq.utils import z85

    if len(text) != Z85_KEY_CHARS:
        raise ConfigError(f"{where}: a key is {Z85_KEY_CHARS} characters of Z85, got {len(text)} characters")
    try:
        return bytes(z85.decode(text.encode("ascii")))
    except (ValueError, KeyError, UnicodeEncodeError) as exc:
        raise ConfigError(f"{where}: {text[:8]}... is not Z85") from exc


def _unsafe(info: os.stat_result) -> str | None:
    """Why a file that says who may connect cannot be trusted: another kind of file, another owner
    (it could rewrite it), or writable by group or others (anyone could list their own key)."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {info.st_uid}, who could list any key; chown it to uid {os.geteuid()} (or root)"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(info.st_mode)
        return f"is writable by group or others (mode {mode:o}), who could list any key; chmod 644 it"
    return None


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
