"""``kvcr doctor``: check a host before kvcr is enabled on it, one line per check, and an exit code.

Checks, in order (each can be skipped with ``--skip``):

* ``nixl``       NIXL imports; its version and the build it loaded.
* ``transport``  a READ from this process into a child process over NIXL: the transport UCX chose
                 (from UCX's own protocol report), its rate against memmove, and whether it needs
                 the source to progress. Quiet on a zero-copy path (CMA, RDMA); a warning naming
                 the cause on software emulation (``UCX_TLS=tcp``, CMA blocked).
* ``config``     the SGLang extra-config (``--sglang-config``), parsed as the backend would.
* ``sglang``     SGLang's version (kvcr supports 0.5.22 and 0.5.23), and that what kvcr's backend
                 imports from SGLang (its storage API, host pools, storage factory) imports here.
* ``memory``     ``dram_bytes`` x the ranks on this host fits in the memory the host has available,
                 and what that leaves for SGLang's own host pool.
* ``page-keys``  kvcr's page keys equal SGLang's own page hashes (chained, 64-bit token ids).
* ``ports``      the control ports of every TP rank (base + rank) and the metrics port are free.
* ``token``      the cluster token file, by the backend's own rule (``read_token_file``): what it
                 refuses is a failure here, never a warning.

Exit code: 0 when every check passed, 2 when some only warned (kvcr works, degraded), 1 when one
failed (kvcr would not work, or not safely). Nothing here raises: a check that breaks reports
FAIL with one line.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcr import compat
from kvcr.domain.errors import KvcrError
from kvcr.integrations.shared.host import available_memory_bytes

NIXL_VERSION = "1.5.1"
CHECKS = ("versions", "nixl", "transport", "config", "sglang", "memory", "page-keys", "ports", "token", "identity")
# What kvcr's SGLang backend imports at start-up (SGLang's storage API, its host pools, its factory).
SGLANG_MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.storage.backend_factory",
    "kvcr.integrations.sglang",
)


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status.value:<4}  {self.check:<9}  {self.detail}"


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What to check; ``None`` fields fall back to the SGLang config, then to kvcr's defaults."""

    sglang_config: str | None = None  # the JSON of --hicache-storage-backend-extra-config, or @file
    control_host: str | None = None
    control_port: int | None = None
    tp_size: int = 1
    metrics_port: int | None = None
    token_file: str | None = None
    read_bytes: int = 64 << 20
    skip: frozenset[str] = field(default_factory=frozenset)


def exit_code(findings: Sequence[Finding]) -> int:
    statuses = {f.status for f in findings}
    if Status.FAIL in statuses:
        return 1
    return 2 if Status.WARN in statuses else 0


def run_doctor(options: DoctorOptions, report: Callable[[Finding], None] = lambda _f: None) -> list[Finding]:
    """Run every check not skipped, calling ``report`` as each one ends (long checks show progress)."""
    findings: list[Finding] = []
    settings, config_finding = _settings(options)
    steps: list[tuple[str, Callable[[], Finding]]] = [
        ("versions", check_versions),
        ("nixl", check_nixl),
        ("transport", lambda: check_transport(options.read_bytes)),
        ("config", lambda: config_finding),
        ("sglang", check_sglang_version),
        ("memory", lambda: check_memory(_get(settings, "dram_bytes"), options.tp_size)),
        ("page-keys", check_page_keys),
        ("ports", lambda: check_ports(*_ports(options, settings))),
        (
            "token",
            lambda: check_token(
                options.token_file or _get(settings, "auth_token_file"), bool(_get(settings, "node_key_file"))
            ),
        ),
        ("identity", lambda: check_identity(options, settings)),
    ]
    for name, step in steps:
        if name in options.skip:
            finding = Finding(name, Status.SKIP, "skipped (--skip)")
        else:
            try:
                finding = step()
            except Exception as exc:  # one line per check, never a traceback
                finding = Finding(name, Status.FAIL, f"the check itself failed: {_one_line(exc)}")
        findings.append(finding)
        report(finding)
    return findings


def summary(findings: Sequence[Finding]) -> str:
    counts = {s: sum(1 for f in findings if f.status is s) for s in Status}
    verdict = {0: "ready for kvcr", 1: "not ready for kvcr", 2: "kvcr will work, degraded"}[exit_code(findings)]
    return (
        f"doctor: {counts[Status.OK]} ok, {counts[Status.WARN]} warning(s), {counts[Status.FAIL]} failure(s), "
        f"{counts[Status.SKIP]} skipped: {verdict}"
    )


# ---------------------------------------------------------------------- checks


def check_versions() -> Finding:
    """Supported SGLang, NIXL and Dynamo versions, base dependencies, and the ``kvcr`` name clash."""
    findings = compat.doctor_findings()
    problems = [f for f in findings if compat.is_problem(f)]
    if problems:
        return Finding("versions", Status.FAIL, "; ".join(f.line for f in problems))
    found = ", ".join(f.found for f in findings if f.ok and f.found)
    return Finding("versions", Status.OK, f"supported: {found}")


def check_nixl() -> Finding:
    try:
        from nixl import _api
    except Exception as exc:
        return Finding("nixl", Status.FAIL, f"NIXL does not import: {_one_line(exc)}; install nixl=={NIXL_VERSION}")
    version = _version("nixl")
    build = _api.__name__.split(".")[0]
    text = f"nixl {version} ({build})"
    if version != NIXL_VERSION:
        return Finding("nixl", Status.WARN, f"{text}; kvcr is tested with nixl {NIXL_VERSION}")
    return Finding("nixl", Status.OK, text)


def check_transport(read_bytes: int) -> Finding:
    from kvcr.adapters.nixl.transport_probe import probe_transport

    report = probe_transport(nbytes=read_bytes)
    if report.zero_copy:
        return Finding("transport", Status.OK, report.summary())
    if report.read_gbps <= 0:
        return Finding("transport", Status.FAIL, report.summary())
    return Finding("transport", Status.WARN, f"no zero-copy path, peer reads will be slow: {report.summary()}")


def check_sglang_version() -> Finding:
    version = _version("sglang")
    supported = compat.SUPPORTED["sglang"]
    if version is None:
        return Finding("sglang", Status.FAIL, f"sglang is not installed; kvcr's backend needs sglang{supported.spec}")
    if not compat.in_range(version, supported.minimum, supported.below):
        return Finding("sglang", Status.WARN, f"sglang {version}; kvcr supports sglang{supported.spec}'s storage API")
    for module in SGLANG_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:  # what the backend would hit at start-up, in one line
            hint = (
                " (CPU hosts: put kvcr's import-only torchvision on PYTHONPATH, docs/engine-on-cpu.md)"
                if "torchvision" in str(exc)
                else ""
            )
            return Finding(
                "sglang",
                Status.FAIL,
                f"sglang {version}: kvcr's backend cannot import {module}: {_one_line(exc)}{hint}",
            )
    from kvcr.integrations.sglang import hook_points

    moved = hook_points.problems([*hook_points.HINT_POINTS, *hook_points.TOKEN_POINTS, *hook_points.STREAM_POINTS])
    if moved:
        return Finding(
            "sglang",
            Status.FAIL,
            f"sglang {version}: kvcr's plugin would leave request hints (or KV events) off: {'; '.join(moved)}",
        )
    return Finding("sglang", Status.OK, f"sglang {version}; kvcr's backend imports and its plugin's hook points fit")


def check_memory(dram_bytes: int, ranks: int, available: Callable[[], int | None] = available_memory_bytes) -> Finding:
    """kvcr DRAM is per rank: ``ranks`` arenas of ``dram_bytes`` must fit in what the host has free."""
    have = available()
    need = dram_bytes * ranks
    wanted = f"dram_bytes {_gib(dram_bytes)} x {ranks} rank(s) = {_gib(need)}"
    if have is None:
        return Finding("memory", Status.WARN, f"{wanted}; this host does not say how much memory is available")
    if need > have:
        return Finding(
            "memory",
            Status.FAIL,
            f"{wanted}, but this host has {_gib(have)} available: lower dram_bytes to at most "
            f"{_gib(have // max(1, ranks))} per rank, less what SGLang's own host pool needs",
        )
    return Finding("memory", Status.OK, f"{wanted} of {_gib(have)} available; {_gib(have - need)} left for SGLang")


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


def check_page_keys() -> Finding:
    from kvcr.testing.sglang import prepare_environment

    prepare_environment()
    try:
        from sglang.srt.mem_cache.utils import get_hash_str
    except Exception as exc:
        return Finding("page-keys", Status.FAIL, f"SGLang's page hash does not import: {_one_line(exc)}")
    from kvcr.domain.keys import page_hashes

    started = time.perf_counter()
    cases = [
        (list(range(1000, 1000 + 16 * 4)), 16),
        ([7, 8, (1 << 31) + 3, 9], 2),
        ([7, 8, (1 << 40) + 3, 9], 2),
        (list(range(64 * 3)), 64),
    ]
    widths = "64-bit token ids"
    for tokens, page_size in cases:
        try:
            theirs = list(get_hash_str(tokens, None, page_size=page_size))
        except OverflowError:  # SGLang 0.5.22 packs token ids as uint32: no wider id reaches its storage
            widths = "32-bit token ids, the widest this SGLang hashes"
            continue
        ours = page_hashes(tokens, page_size)
        if ours != theirs:
            return Finding(
                "page-keys",
                Status.FAIL,
                f"kvcr's page keys differ from SGLang's get_hash_str (page size {page_size}): "
                "backups would never be found; this kvcr does not match this SGLang",
            )
    took = time.perf_counter() - started
    return Finding(
        "page-keys",
        Status.OK,
        f"kvcr's page keys equal SGLang's get_hash_str (page sizes 2, 16, 64; {widths}) [{took:.1f}s]",
    )


def check_ports(host: str, ports: Sequence[tuple[str, int]]) -> Finding:
    if not ports:
        return Finding("ports", Status.SKIP, "no ports to check (control_port 0: the peer service is off)")
    taken = []
    for what, port in ports:
        if not 0 < port < 65536:
            return Finding("ports", Status.FAIL, f"{what} {port} is out of range 1..65535")
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno in (99, -2, -3, -5):  # EADDRNOTAVAIL or a name that does not resolve
                    return Finding("ports", Status.FAIL, f"{host} is not an address of this host: set control_host")
                taken.append(f"{what} {host}:{port}")
    if taken:
        return Finding(
            "ports", Status.FAIL, f"in use: {', '.join(taken)}; pick free ones (control_port, --metrics-port)"
        )
    listed = ", ".join(f"{what} {port}" for what, port in ports)
    return Finding("ports", Status.OK, f"free on {host}: {listed}")


def check_token(path_text: str | None, node_keys: bool = False) -> Finding:
    """The token file by the rule the backend applies at start-up; anything it refuses fails here."""
    if not path_text and node_keys:
        return Finding("token", Status.SKIP, "no auth_token_file: peers authenticate with per-node keys (identity)")
    if not path_text:
        return Finding("token", Status.SKIP, "no auth_token_file: peers are not authenticated (loopback-only setups)")
    from kvcr.integrations.shared.settings import read_token_file

    path = Path(path_text)
    try:
        size = len(read_token_file(str(path)))
        info = path.stat()
    except KvcrError as exc:
        return Finding("token", Status.FAIL, f"{exc}; kvcr will not start with it")
    except OSError as exc:
        return Finding("token", Status.FAIL, f"auth_token_file {path}: {exc.strerror or exc}")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid():
        return Finding("token", Status.WARN, f"{path} belongs to uid {info.st_uid}, not to this user")
    return Finding("token", Status.OK, f"{path}: {size} bytes, mode {mode:04o}")


def check_identity(options: DoctorOptions, settings: Any) -> Finding:
    """Per-node identities as the backend builds them: the key file, the directory, and every rank's
    endpoint listed there with this node's key (peers refuse, and are refused by, a node that is not)."""
    key_file, directory_file = _get(settings, "node_key_file"), _get(settings, "peer_directory_file")
    if not key_file:
        return Finding("identity", Status.SKIP, "no node_key_file: no per-node identity (a cluster token or none)")
    from kvcr.adapters.zmq.identity import NodeIdentity, PeerDirectory
    from kvcr.domain.hints import Endpoint
    from kvcr.integrations.shared.settings import read_token_file

    host = _get(settings, "control_advertise_host") or options.control_host or _get(settings, "control_host")
    base = options.control_port if options.control_port is not None else _get(settings, "control_port")
    try:
        secret = read_token_file(key_file, "node_key_file")
        directory = PeerDirectory(directory_file)
        endpoints = [str(Endpoint(host, base + rank)) for rank in range(options.tp_size)]
        for endpoint in endpoints:
            public = NodeIdentity(secret, directory, endpoint).public_key
    except KvcrError as exc:
        return Finding("identity", Status.FAIL, f"{exc}; kvcr will not start with it")
    except ValueError as exc:  # an endpoint that cannot be dialled (e.g. a wildcard host)
        return Finding("identity", Status.FAIL, f"control endpoint: {exc}")
    nodes = len(directory.current().keys)
    return Finding(
        "identity",
        Status.OK,
        f"key {public.decode()[:8]}... listed at {', '.join(endpoints)}; {nodes} nodes in {directory_file}",
    )


# ---------------------------------------------------------------------- helpers


def _settings(options: DoctorOptions) -> tuple[Any, Finding]:
    if options.sglang_config is None:
        return None, Finding("config", Status.SKIP, "no --sglang-config given")
    text = options.sglang_config
    try:
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        data = json.loads(text)
    except OSError as exc:
        return None, Finding("config", Status.FAIL, f"--sglang-config {text[1:]}: {exc.strerror or exc}")
    except ValueError as exc:
        return None, Finding("config", Status.FAIL, f"--sglang-config is not JSON: {exc}")
    if not isinstance(data, dict):
        return None, Finding("config", Status.FAIL, "--sglang-config must be a JSON object")
    try:
        from kvcr.integrations.shared.settings import parse_settings

        settings = parse_settings(data)
    except ImportError as exc:
        return None, Finding("config", Status.FAIL, f"cannot check --sglang-config: SGLang does not import ({exc})")
    except KvcrError as exc:
        return None, Finding("config", Status.FAIL, f"--sglang-config: {exc}")
    return settings, Finding("config", Status.OK, f"extra-config parses (transport {settings.transport})")


def _get(settings: Any, name: str) -> Any:
    if settings is not None:
        return getattr(settings, name)
    from kvcr.integrations.shared.settings import KvcrSettings

    return getattr(KvcrSettings(), name)


def _ports(options: DoctorOptions, settings: Any) -> tuple[str, list[tuple[str, int]]]:
    host = options.control_host or _get(settings, "control_host")
    base = options.control_port if options.control_port is not None else _get(settings, "control_port")
    ports = [(f"rank {rank} control", base + rank) for rank in range(options.tp_size)] if base else []
    if options.metrics_port:
        ports.append(("metrics", options.metrics_port))
    return host, ports


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
