"""Typed settings for the SGLang backend, parsed once from ``storage_config.extra_config``.

Every key is documented in ``docs/sglang.md``. SGLang's own routing keys are accepted and
ignored; any other unknown key, or a value of the wrong type, fails construction with a message
naming the key (a typo must not silently fall back to a default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcr.adapters.zmq.events import bind_address
from kvcr.domain.errors import ConfigError
from kvcr.domain.eviction import POLICIES
from kvcr.domain.units import parse_byte_size

TRANSPORTS = ("nixl", "ucx", "mock")

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
    transport: str = "nixl"
    dram_bytes: int = 8 << 30
    control_host: str = "127.0.0.1"
    control_port: int = 32100
    control_advertise_host: str | None = None
    enable_remote_hint: bool = False
    operation_timeout_ms: int = 5000
    abandon_timeout_ms: int = 10000
    lease_ms: int = 10000
    read_batch_pages: int = 128
    verify_bytes: bool = False
    auth_token_file: str | None = None
    policy: str = "lru"
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv-events"

    def token(self) -> bytes | None:
        """The cluster token's bytes (read once at start-up), or None."""
        if self.auth_token_file is None:
            return None
        try:
            token = Path(self.auth_token_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"auth_token_file: cannot read {self.auth_token_file!r}: {exc}") from exc
        if len(token) < 16:
            raise ConfigError("auth_token_file: the token must be at least 16 bytes")
        return token


_TYPES: dict[str, tuple[type, ...]] = {
    "transport": (str,),
    "control_host": (str,),
    "control_port": (int,),
    "control_advertise_host": (str, type(None)),
    "enable_remote_hint": (bool,),
    "operation_timeout_ms": (int,),
    "abandon_timeout_ms": (int,),
    "lease_ms": (int,),
    "read_batch_pages": (int,),
    "verify_bytes": (bool,),
    "auth_token_file": (str, type(None)),
    "policy": (str,),
    "kv_events_endpoint": (str, type(None)),
    "kv_events_topic": (str,),
}


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
            raise ConfigError(f"unknown kvcr setting {key!r}; known settings: {', '.join(known)}")
        # bool is an int subclass: refuse True for an int setting and 1 for a bool one.
        if isinstance(value, bool) != (bool in expected) or not isinstance(value, expected):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in expected)
            raise ConfigError(f"kvcr setting {key!r} must be {names}, got {value!r}")
        values[key] = value
    settings = KvcrSettings(**values)
    _check(settings)
    return settings


def _check(s: KvcrSettings) -> None:
    if s.transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {s.transport!r}")
    if s.dram_bytes <= 0:
        raise ConfigError("dram_bytes must be positive")
    if not 0 <= s.control_port < 65536:
        raise ConfigError(f"control_port must be in 0..65535 (0 disables the peer service), got {s.control_port}")
    for key in ("operation_timeout_ms", "abandon_timeout_ms", "lease_ms", "read_batch_pages"):
        if getattr(s, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(s, key)}")
    if s.abandon_timeout_ms < s.operation_timeout_ms:
        raise ConfigError("abandon_timeout_ms must not be shorter than operation_timeout_ms")
    if s.policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(sorted(POLICIES))}, got {s.policy!r}")
    if s.enable_remote_hint and s.control_port == 0:
        raise ConfigError("enable_remote_hint needs a control_port (peers and hints name control endpoints)")
    if s.kv_events_endpoint is not None:
        try:
            bind_address(s.kv_events_endpoint)
        except ConfigError as exc:
            raise ConfigError(f"kv_events_endpoint: {exc}") from exc
