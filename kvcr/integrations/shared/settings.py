"""Typed settings for the SGLang backend, parsed once from ``storage_config.extra_config``.

Every key is documented in ``docs/sglang.md``. SGLang's own routing keys are accepted and
ignored; any other unknown key, or a value of the wrong type or out of range, fails construction
with one line naming the key (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcr.domain.deadlines import MAX_TIMEOUT_S, Timing
from kvcr.domain.digests import PAGE_DIGEST_NAMES, PageDigest
from kvcr.domain.endpoints import WILDCARD_HOSTS, bracketed, split_host_port
from kvcr.domain.errors import ConfigError
from kvcr.domain.eviction import POLICIES
from kvcr.domain.hints import Endpoint
from kvcr.domain.transports import TRANSPORT_NAMES, Transport
from kvcr.domain.units import parse_byte_size
from kvcr.runner.peer_client import LANDINGS

PAGE_DIGEST_AUTO = "auto"  # blake3 with per-node identities, xxh3 otherwise (KvcrSettings.digest)

MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096
# A token of fewer distinct bytes than this is not random (``aaaa...``, ``0000...``, ``abababab...``):
# a recorded handshake lets anyone test guesses of it offline, so it is refused, not warned about.
MIN_TOKEN_DISTINCT_BYTES = 8
# How long a connection to the control port may take to complete its handshake: a half-open one
# (a greeting that never finishes) holds a descriptor until then. Below 100 ms a slow link fails.
MIN_HANDSHAKE_MS = 100
MAX_HANDSHAKE_MS = 60_000

# Keys SGLang itself reads from the same dict (routing of the dynamic backend and prefetch tuning).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        "file_storage_path",
    }
)


@dataclass(frozen=True, slots=True)
class KvcrSettings:
    transport: str = "auto"
    dram_bytes: int = 8 << 30
    control_host: str = "127.0.0.1"
    control_port: int = 32100
    control_advertise_host: str | None = None
    enable_remote_hint: bool = False
    operation_timeout_ms: int = 5000
    abandon_timeout_ms: int = 10000
    control_timeout_ms: int = 250
    connect_timeout_ms: int = 2000
    lease_ms: int = 10000
    peer_retry_ms: int = 1000
    read_batch_pages: int = 128
    verify_bytes: bool = True
    page_digest: str = "auto"
    same_host_shm: bool = True
    landing: str = "auto"
    auth_token_file: str | None = None
    rotation_token_files: tuple[str, ...] = ()
    node_key_file: str | None = None
    peer_directory_file: str | None = None
    allow_unauthenticated: bool = False
    peer_allowlist: tuple[str, ...] = ()
    recompute_tokens_per_s: float = 0.0
    max_peer_links: int = 64
    control_handshake_ms: int = 2000
    peer_lease_share: float = 0.5
    policy: str = "lru"
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    engine_kv_events: bool = True
    connect_ahead: tuple[str, ...] = ()

    def timing(self) -> Timing:
        """The one Timing every part of this rank's kvcr uses."""
        lease_s = self.lease_ms / 1000
        return Timing(
            operation_s=self.operation_timeout_ms / 1000,
            abandon_s=self.abandon_timeout_ms / 1000,
            control_s=self.control_timeout_ms / 1000,
            connect_s=self.connect_timeout_ms / 1000,
            lease_s=lease_s,
            lease_margin_s=min(0.5, lease_s / 4),
            retry_after_s=self.peer_retry_ms / 1000,
        )

    def token(self) -> bytes | None:
        """The cluster token's bytes (read once at start-up), or None; see :func:`read_token_file`."""
        return None if self.auth_token_file is None else read_token_file(self.auth_token_file)

    def rotation_tokens(self) -> tuple[bytes, ...]:
        """Tokens also admitted (and dialled with) while the cluster rotates to a new token."""
        return tuple(read_token_file(path, "rotation_token_files") for path in self.rotation_token_files)

    def digest(self) -> str:
        """The page digest this rank uses: ``page_digest``, where ``auto`` means ``blake3`` with per-node
        identities (their promise, that one compromised node stays one node's problem, needs a
        digest its writes cannot keep) and ``xxh3`` with a cluster token or none (where any
        holder can already answer as another node, so a forgery-proof digest buys little)."""
        if self.page_digest != PAGE_DIGEST_AUTO:
            return self.page_digest
        chosen = PageDigest.BLAKE3 if self.node_key_file is not None else PageDigest.XXH3
        return str(chosen.value)

    def node_key(self) -> bytes | None:
        """This node's own CURVE secret key (per-node identities), read once at start-up, or None."""
        return None if self.node_key_file is None else read_token_file(self.node_key_file, "node_key_file")

    def allows(self, host: str) -> bool:
        """Whether a hinted source at ``host`` is one the operator allows (any, without an allowlist)."""
        if not self.peer_allowlist:
            return True
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return host in self.peer_allowlist
        for entry in self.peer_allowlist:
            try:
                if address in ipaddress.ip_network(_unbracketed(entry), strict=False):
                    return True
            except ValueError:
                continue  # a host name: never the text of an address
        return False


def read_token_file(path: str, setting: str = "auth_token_file") -> bytes:
    """Read the cluster token: a regular file, not readable by others, 16..4096 bytes, no NUL.

    Opened without blocking (a FIFO or a device cannot hang start-up), then checked and read
    through the same descriptor: what was checked is what is read, whatever happens to the path.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{setting} {path!r}: cannot read it: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL byte, or a character the file system encoding cannot hold
        raise ConfigError(f"{setting} {path!r} is not a usable path") from exc
    try:
        raw = _checked_read(fd, path, setting)
    finally:
        os.close(fd)
    return _token_rules(raw.strip(), path, setting)


def _checked_read(fd: int, path: str, setting: str) -> bytes:
    """The bytes of an open token file, after checking what it is through its descriptor."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{setting} {path!r} is not a regular file")
    if info.st_uid not in (os.geteuid(), 0):
        raise ConfigError(
            f"{setting} {path!r} belongs to uid {info.st_uid}, who could change it; "
            f"chown it to uid {os.geteuid()} (or root)"
        )
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{setting} {path!r} is readable or writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); chmod 600 it"
        )
    if info.st_size > MAX_TOKEN_BYTES:
        raise ConfigError(f"{setting} {path!r} is larger than {MAX_TOKEN_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= MAX_TOKEN_BYTES:
            chunk = os.read(fd, MAX_TOKEN_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{setting} {path!r}: cannot read it: {exc.strerror}") from exc
    if size > MAX_TOKEN_BYTES:  # it grew after the check, or its size was not its length (/proc)
        raise ConfigError(f"{setting} {path!r} is larger than {MAX_TOKEN_BYTES} bytes")
    return b"".join(chunks)


def _token_rules(token: bytes, path: str, setting: str) -> bytes:
    if b"\x00" in token:
        raise ConfigError(
            f"{setting} {path!r} contains a NUL byte; write a text token: head -c 32 /dev/urandom | base64 > FILE"
        )
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{setting} {path!r}: the token must be at least {MIN_TOKEN_BYTES} bytes")
    weak = token_weakness(token)
    if weak is not None:
        raise ConfigError(f"{setting} {path!r}: {weak}")
    return token


def token_weakness(token: bytes) -> str | None:
    """Why ``token`` (stripped) is too guessable to key the control channel, or None when it is not."""
    distinct = len(set(token))
    if distinct < MIN_TOKEN_DISTINCT_BYTES:
        return (
            f"the token has only {distinct} distinct byte values (at least {MIN_TOKEN_DISTINCT_BYTES}); "
            "use random bytes, e.g. head -c 32 /dev/urandom | base64"
        )
    return None


_TYPES: dict[str, tuple[type, ...]] = {
    "transport": (str,),
    "control_host": (str,),
    "control_port": (int,),
    "control_advertise_host": (str, type(None)),
    "enable_remote_hint": (bool,),
    "operation_timeout_ms": (int,),
    "abandon_timeout_ms": (int,),
    "control_timeout_ms": (int,),
    "connect_timeout_ms": (int,),
    "lease_ms": (int,),
    "peer_retry_ms": (int,),
    "read_batch_pages": (int,),
    "verify_bytes": (bool,),
    "page_digest": (str,),
    "same_host_shm": (bool,),
    "landing": (str,),
    "auth_token_file": (str, type(None)),
    "rotation_token_files": (list,),
    "node_key_file": (str, type(None)),
    "peer_directory_file": (str, type(None)),
    "allow_unauthenticated": (bool,),
    "peer_allowlist": (list,),
    "recompute_tokens_per_s": (int, float),
    "max_peer_links": (int,),
    "control_handshake_ms": (int,),
    "peer_lease_share": (int, float),
    "policy": (str,),
    "kv_events_endpoint": (str, type(None)),
    "kv_events_topic": (str,),
    "engine_kv_events": (bool,),
    "connect_ahead": (list,),
}
_TIMES = ("operation_timeout_ms", "abandon_timeout_ms", "control_timeout_ms", "connect_timeout_ms", "lease_ms")


def parse_settings(extra_config: Mapping[str, Any] | None) -> KvcrSettings:
    """Validate and convert the extra-config dict; raise ConfigError naming the first bad key."""
    values: dict[str, Any] = {}
    for key, value in (extra_config or {}).items():
        if key in SGLANG_KEYS:
            continue
        if key == "dram_bytes":
            values[key] = parse_byte_size(value, name="dram_bytes")
            continue
        expected = _TYPES.get(key)
        if expected is None:
            known = sorted([*_TYPES, "dram_bytes"])
            raise ConfigError(f"unknown kvcr setting {_shown(key)}; known settings: {', '.join(known)}")
        # bool is an int subclass: refuse True for an int setting and 1 for a bool one.
        if isinstance(value, bool) != (bool in expected) or not isinstance(value, expected):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in expected)
            raise ConfigError(f"kvcr setting {key!r} must be {names}, got {_shown(value)}")
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
            # Also keeps every message below printable: str() refuses integers of over 4300 digits.
            raise ConfigError(f"kvcr setting {key!r} is out of range (an integer of {value.bit_length()} bits)")
        if isinstance(value, list):
            value = _strings(key, value)
        values[key] = value
    settings = KvcrSettings(**values)
    _check(settings)
    return settings


def _shown(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer of over 4300 digits (in it) has no repr
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= 60 else f"{text[:57]}..."


def _strings(key: str, entries: list[Any]) -> tuple[str, ...]:
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"{key} entries must be non-empty strings, got {_shown(entry)}")
    return tuple(entries)


def _check(s: KvcrSettings) -> None:
    if s.transport not in TRANSPORT_NAMES:
        raise ConfigError(f"transport must be one of {', '.join(TRANSPORT_NAMES)}, got {_shown(s.transport)}")
    if s.transport == Transport.SHM.value and not s.same_host_shm:
        raise ConfigError("transport shm shares arenas with same-host peers: it cannot run with same_host_shm false")
    if s.page_digest not in (PAGE_DIGEST_AUTO, *PAGE_DIGEST_NAMES):
        names = ", ".join((PAGE_DIGEST_AUTO, *PAGE_DIGEST_NAMES))
        raise ConfigError(f"page_digest must be one of {names}, got {_shown(s.page_digest)}")
    if s.dram_bytes <= 0:
        raise ConfigError("dram_bytes must be positive")
    if not 0 <= s.control_port < 65536:
        raise ConfigError(f"control_port must be in 0..65535 (0 disables the peer service), got {s.control_port}")
    for key in _TIMES:
        value = getattr(s, key)
        if not 0 < value <= MAX_TIMEOUT_S * 1000:
            raise ConfigError(f"{key} must be in 1..{int(MAX_TIMEOUT_S * 1000)}, got {value}")
    if not 0 < s.peer_retry_ms <= MAX_TIMEOUT_S * 1000:
        raise ConfigError(f"peer_retry_ms must be in 1..{int(MAX_TIMEOUT_S * 1000)}, got {s.peer_retry_ms}")
    if not MIN_HANDSHAKE_MS <= s.control_handshake_ms <= MAX_HANDSHAKE_MS:
        raise ConfigError(
            f"control_handshake_ms must be in {MIN_HANDSHAKE_MS}..{MAX_HANDSHAKE_MS}, got {s.control_handshake_ms}"
        )
    for key in ("read_batch_pages", "max_peer_links"):
        if not 0 < getattr(s, key) <= 1 << 16:
            raise ConfigError(f"{key} must be in 1..65536, got {getattr(s, key)}")
    # JSON as SGLang reads it accepts NaN and Infinity: NaN would switch the check off, Infinity every remote read.
    if not 0 < s.peer_lease_share <= 1:  # NaN fails this too
        raise ConfigError(f"peer_lease_share must be a number in (0, 1], got {s.peer_lease_share}")
    if not 0 <= s.recompute_tokens_per_s < math.inf:
        raise ConfigError(f"recompute_tokens_per_s must be a finite number >= 0, got {s.recompute_tokens_per_s}")
    if s.landing not in LANDINGS:
        raise ConfigError(f"landing must be one of {', '.join(LANDINGS)}, got {_shown(s.landing)}")
    if s.policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(sorted(POLICIES))}, got {_shown(s.policy)}")
    if s.rotation_token_files and s.auth_token_file is None:
        raise ConfigError("rotation_token_files needs auth_token_file (the token this node binds with)")
    if (s.node_key_file is None) != (s.peer_directory_file is None):
        raise ConfigError("node_key_file and peer_directory_file go together (per-node identities)")
    if s.node_key_file is not None and s.auth_token_file is not None:
        raise ConfigError("set auth_token_file (one cluster token) or node_key_file (per-node identities), not both")
    for entry in s.peer_allowlist:
        _check_allowlist_entry(entry)
    if s.enable_remote_hint and s.control_port == 0:
        raise ConfigError("enable_remote_hint needs a control_port (peers and hints name control endpoints)")
    s.timing()  # the cross-field rules (abandon >= operation, control <= operation, lease > margin)
    if s.kv_events_endpoint is not None:
        _check_events_endpoint(s.kv_events_endpoint)
    for entry in s.connect_ahead:
        try:
            peer = Endpoint.parse(entry)
        except ValueError as exc:
            raise ConfigError(f"connect_ahead entry {_shown(entry)}: {exc}") from None
        if not s.allows(peer.host):
            raise ConfigError(f"connect_ahead entry {_shown(entry)} is outside peer_allowlist")
    if s.connect_ahead and s.control_port == 0:
        raise ConfigError("connect_ahead needs a control_port (this node reads from peers)")


_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def _check_allowlist_entry(entry: str) -> None:
    """An address, a network (``10.0.0.0/8``, ``[fd00::]/8``) or a host name; anything else matches nothing."""
    text = _unbracketed(entry)
    try:
        ipaddress.ip_network(text, strict=False)
        return
    except ValueError as exc:
        if "/" in entry or _looks_numeric(text) or not _HOST_NAME.fullmatch(text):
            raise ConfigError(
                f"peer_allowlist entry {_shown(entry)} is not an address, a network or a host name ({exc})"
            ) from None


def _unbracketed(entry: str) -> str:
    """An IPv6 entry may be written as in an endpoint, in brackets (``[fd00::1]``, ``[fd00::]/8``)."""
    return entry.replace("[", "").replace("]", "")


def _looks_numeric(text: str) -> bool:
    return ":" in text or all(part.isdigit() for part in text.split("."))


def _check_events_endpoint(endpoint: str) -> None:
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"kv_events_endpoint must be tcp://host:port, got {_shown(endpoint)}")
    split = split_host_port(endpoint[len("tcp://") :])
    host, port, in_brackets = split if split is not None else ("", "", False)
    if host in WILDCARD_HOSTS and (in_brackets or ":" not in host):
        # a wildcard bind is fine for a PUB; check the port only (an unbracketed "::" cannot be
        # followed by a port, so it is left for Endpoint.parse to refuse)
        host = "127.0.0.1"
    shown = bracketed(host) if in_brackets else host
    try:
        Endpoint.parse(f"tcp://{shown}:{port}" if split is not None else endpoint)
    except ValueError as exc:
        raise ConfigError(f"kv_events_endpoint: {exc}") from exc
