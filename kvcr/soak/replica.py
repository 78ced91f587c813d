"""A replica process for soak and fault runs: SGLang's real host pool with kvcr made by SGLang's factory.

It is started by :class:`kvcr.soak.processes.Replica` (forked from a process that has imported
SGLang, torch and NIXL once) and answers commands over a pipe, one at a time:

- ``backup`` writes pages (bytes from :func:`kvcr.soak.pattern.page_words`) into host slots and
  backs them up with ``batch_set_v1``;
- ``exists`` / ``get`` / ``restore`` are SGLang's hit query and prefetch read, hinted at a peer or
  not; every page reported restored is checked against its key's bytes, and afterwards every
  destination page is poisoned, so ``poison`` can later tell whether any byte landed after the
  call returned;
- ``workload`` starts a backup thread and a prefetch thread (SGLang's two storage threads) that
  run a mixed load until ``stop``; ``stats`` reports while they run;
- ``close`` closes the backend and reports what it left behind: threads, file descriptors,
  NIXL registrations and transfers.

Nothing here raises into the pipe: a failing call is counted (``exceptions``) and reported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcr.integrations.shared import hints_bridge
from kvcr.soak.pattern import PageView, prompt_keys

LAYER_PAGE_BYTES = 256 << 10  # one layer of one page of kvcr.testing.sglang's pool (K and V)


@dataclass(frozen=True)
class ReplicaOptions:
    """How one replica is built.

    settings: extra keys for ``--hicache-storage-backend-extra-config`` (timeouts, landing, ...).
    env: environment set before anything is built (``UCX_TLS``, ``UCX_NET_DEVICES``).
    netns: a network namespace (``ip netns`` name) the process moves into first.
    """

    name: str
    layers: int = 1
    host_pages: int = 128
    dram_pages: int = 64
    port: int = 0
    host: str = "127.0.0.1"
    settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    netns: str | None = None
    log_level: str = "WARNING"  # kvcr records at this level and above are counted (the first 20 kept)


_SAMPLES = 20000  # latency samples kept per kind (a reservoir: its memory is taken once, up front)


@dataclass
class KindStats:
    """What one kind of operation did (a kind: backup, local_restore, remote_restore)."""

    ops: int = 0
    pages: int = 0  # pages asked for
    hits: int = 0  # pages the hit query answered
    restored: int = 0  # pages reported True (stored, for backups)
    wrong_pages: int = 0
    wrong_bytes: int = 0
    late_bytes: int = 0  # bytes that landed in a poisoned page after its call returned
    hangs: int = 0  # calls slower than operation_timeout_ms + 1 s
    exceptions: int = 0
    max_s: float = 0.0
    timed_calls: int = 0
    samples: array[float] = field(default_factory=lambda: array("d", bytes(8 * _SAMPLES)))

    def timed(self, seconds: float, bound_s: float) -> None:
        self.max_s = max(self.max_s, seconds)
        if seconds > bound_s:
            self.hangs += 1
        if self.timed_calls < _SAMPLES:
            self.samples[self.timed_calls] = seconds
        else:
            slot = random.randrange(self.timed_calls + 1)
            if slot < _SAMPLES:
                self.samples[slot] = seconds
        self.timed_calls += 1

    def as_dict(self) -> dict[str, Any]:
        ordered = sorted(self.samples[: min(self.timed_calls, _SAMPLES)])

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        out = {k: v for k, v in vars(self).items() if k != "samples"}
        out.update(p50_s=pct(0.5), p99_s=pct(0.99))
        return out


class _LogCounter(logging.Handler):
    """Counts kvcr's warnings and errors and keeps the first few (an expected miss logs neither)."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.counts: dict[str, int] = {}
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.levelname] = self.counts.get(record.levelname, 0) + 1
        if len(self.first) < 20:
            self.first.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:300])


def _rss() -> tuple[int, int]:
    """(resident bytes, peak resident bytes) of this process."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, kib = line.split()[:2]
                values[name] = int(kib) * 1024
    return values.get("VmRSS:", 0), values.get("VmHWM:", 0)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _task_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return sorted(names)


def _fd_targets() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(targets)


def _beyond(now: list[str], before: list[str]) -> list[str]:
    left = list(before)
    extra = []
    for item in now:
        if item in left:
            left.remove(item)
        else:
            extra.append(item)
    return extra


class ReplicaState:
    """The live replica: SGLang host pool, kvcr backend, counters."""

    def __init__(self, options: ReplicaOptions) -> None:
        import torch

        from kvcr.testing.sglang import PAGE_TOKENS, backend, host_pool, storage_config

        self.options = options
        self.page_tokens = PAGE_TOKENS
        torch.set_num_threads(1)  # kvcr copies with memmove; torch's thread pool would only be noise
        self.host = host_pool(options.layers, options.host_pages)
        self.view = PageView(self.host, PAGE_TOKENS)
        self.page_bytes = self.view.page_bytes
        for slot in range(self.view.pages):
            self.view.poison(slot)
        level = logging.getLevelName(options.log_level.upper())
        self.logs = _LogCounter(level)
        kvcr_log = logging.getLogger("kvcr")
        kvcr_log.addHandler(self.logs)
        if kvcr_log.getEffectiveLevel() > level:
            kvcr_log.setLevel(level)
        self.baseline = {"threads": _threads(), "fds": _fds()}
        self.baseline_names = {"threads": _task_names(), "fds": _fd_targets()}
        settings = {
            "enable_remote_hint": True,
            "dram_bytes": options.dram_pages * self.page_bytes,
            "control_host": options.host,
            **options.settings,
        }
        self.timeout_s = float(settings.get("operation_timeout_ms", 5000)) / 1000
        self.store = backend(self.host, storage_config(options.port, **settings))
        self.kinds: dict[str, KindStats] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.workers: list[threading.Thread] = []
        self.rss_start = _rss()[0]

    # ------------------------------------------------------------------ helpers

    def _kind(self, kind: str) -> KindStats:
        with self.lock:
            return self.kinds.setdefault(kind, KindStats())

    def _indices(self, first_slot: int, pages: int) -> Any:
        import torch

        if first_slot < 0 or first_slot + pages > self.view.pages:
            raise ValueError(f"slots {first_slot}..{first_slot + pages} are outside the host pool")
        start = first_slot * self.page_tokens
        return torch.arange(start, start + pages * self.page_tokens, dtype=torch.int64)

    def _hint(self, endpoint: str | None, keys: list[str]) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        from kvcr.domain.keys import router_id

        if endpoint is None:
            return None
        envelope = {
            "protocol_version": "0.1",
            "message_id": f"soak-{os.getpid()}-{time.monotonic_ns()}",
            "actions": [
                {
                    "action_id": "a1",
                    "action_type": "kv.fetch",
                    "action_version": "1.0",
                    "payload": {"source_control_endpoint": endpoint, "block_hashes": [router_id(k) for k in keys]},
                }
            ],
        }
        return HiCacheStorageExtraInfo(extra_info={"kv_hints": envelope})

    def _call(self, stats: KindStats, call: Callable[[], Any]) -> tuple[Any, float, str | None]:
        started = time.perf_counter()
        try:
            result, error = call(), None
        except Exception:
            result, error = None, traceback.format_exc(limit=4)[-1500:]
        seconds = time.perf_counter() - started
        with self.lock:
            stats.timed(seconds, self.timeout_s + 1.0)
            if error is not None:
                stats.exceptions += 1
        return result, seconds, error

    # ------------------------------------------------------------------ commands

    def backup(self, keys: list[str], first_slot: int, seed: int = 0, kind: str = "backup") -> dict[str, Any]:
        stats = self._kind(kind)
        indices = self._indices(first_slot, len(keys))
        for i, key in enumerate(keys):
            self.view.write(first_slot + i, key, seed)
        stored, seconds, error = self._call(stats, lambda: self.store.batch_set_v1(keys, indices))
        stored = list(stored) if stored is not None else [False] * len(keys)
        with self.lock:
            stats.ops += 1
            stats.pages += len(keys)
            stats.restored += sum(bool(s) for s in stored)
        return {"stored": stored, "seconds": seconds, "error": error}

    def exists(self, keys: list[str], hint: str | None, kind: str = "exists") -> dict[str, Any]:
        stats = self._kind(kind)
        extra = self._hint(hint, keys)
        with hints_bridge.active(_request(keys)):  # as SGLang's prefetch thread runs it, with kvcr's plugin
            hits, seconds, error = self._call(stats, lambda: self.store.batch_exists(keys, extra))
        with self.lock:
            stats.ops += 1
            stats.pages += len(keys)
            stats.hits += int(hits or 0)
        return {"hits": int(hits or 0), "seconds": seconds, "error": error}

    def get(
        self, keys: list[str], first_slot: int, hint: str | None, seed: int = 0, kind: str = "get"
    ) -> dict[str, Any]:
        """batch_get_v1 into poisoned slots; check what came back True; poison all of them again."""
        stats = self._kind(kind)
        indices = self._indices(first_slot, len(keys))
        late = sum(self.view.unpoisoned(first_slot + i) for i in range(len(keys)))
        extra = self._hint(hint, keys)
        with hints_bridge.active(_request(keys)):
            results, seconds, error = self._call(stats, lambda: self.store.batch_get_v1(keys, indices, extra))
        hints_bridge.prefetch_finished(_request(keys))  # the plugin, when the prefetch ends: unread leases go
        results = [bool(r) for r in results] if results is not None else [False] * len(keys)
        wrong_pages = wrong_bytes = 0
        for i, (key, ok) in enumerate(zip(keys, results, strict=False)):
            if ok:
                wrong = self.view.wrong_bytes(first_slot + i, key, seed)
                wrong_pages += wrong > 0
                wrong_bytes += wrong
            self.view.poison(first_slot + i)
        with self.lock:
            stats.ops += 1
            stats.pages += len(keys)
            stats.restored += sum(results)
            stats.wrong_pages += wrong_pages
            stats.wrong_bytes += wrong_bytes
            stats.late_bytes += late
        return {
            "results": results,
            "seconds": seconds,
            "error": error,
            "wrong_pages": wrong_pages,
            "wrong_bytes": wrong_bytes,
            "late_bytes_before": late,
        }

    def restore(
        self, keys: list[str], first_slot: int, hint: str | None, seed: int = 0, kind: str = "restore"
    ) -> dict[str, Any]:
        """SGLang's flow: the hit query, then a prefetch of the pages it counted."""
        found = self.exists(keys, hint, kind=f"{kind}.exists")
        got = self.get(keys[: found["hits"]], first_slot, hint, seed, kind=f"{kind}.get")
        stats = self._kind(kind)
        with self.lock:
            stats.ops += 1
            stats.pages += len(keys)
            stats.hits += found["hits"]
            stats.restored += sum(got["results"])
            stats.wrong_pages += got["wrong_pages"]
            stats.wrong_bytes += got["wrong_bytes"]
            stats.timed(found["seconds"] + got["seconds"], 2 * (self.timeout_s + 1.0))
        return {
            "hits": found["hits"],
            "exists_s": found["seconds"],
            "get_s": got["seconds"],
            "results": got["results"],
            "wrong_pages": got["wrong_pages"],
            "wrong_bytes": got["wrong_bytes"],
            "error": found["error"] or got["error"],
        }

    def poison(self, first_slot: int, count: int) -> dict[str, Any]:
        """Bytes that changed in poisoned slots since their last call returned (must be 0)."""
        return {"late_bytes": sum(self.view.unpoisoned(first_slot + i) for i in range(count))}

    def stats(self) -> dict[str, Any]:
        rss, peak = _rss()
        node = self.store.node  # the backend started when its pools were registered
        plane = node.data_plane if node is not None else None
        stats = self.store.kvcr_stats()
        with self.lock:
            kinds = {k: v.as_dict() for k, v in self.kinds.items()}
        return {
            "pid": os.getpid(),
            "kinds": kinds,
            "rss": rss,
            "peak_rss": peak,
            "rss_start": self.rss_start,
            "threads": _threads(),
            "fds": _fds(),
            "live_transfers": getattr(plane, "live_transfers", 0),
            "quarantined": node.client.quarantined if node is not None else 0,
            "staging_quarantined": node.staging.quarantined if node is not None else 0,
            "links": node.client.links if node is not None else 0,
            "leases_held": self.store.runner.active_leases,
            "booked_pages": stats["held_remote_pages"],
            "counters": stats["counters"],
            "logs": dict(self.logs.counts),
            "first_logs": list(self.logs.first),
        }

    def close(self) -> dict[str, Any]:
        """Close the backend; report what is left: threads, fds, NIXL registrations and transfers."""
        self.halt()
        node = self.store.node
        plane = node.data_plane if node is not None else None
        error = None
        try:
            self.store.close()
        except Exception:
            error = traceback.format_exc(limit=4)[-1500:]
        import gc

        gc.collect()
        deadline = time.monotonic() + 5  # threads that were told to stop end within moments
        while time.monotonic() < deadline and _threads() > self.baseline["threads"]:
            time.sleep(0.05)
        agents = sum(1 for o in gc.get_objects() if type(o).__name__ == "nixl_agent")
        return {
            "error": error,
            "nixl_agents": agents,
            "leaked_threads": _threads() - self.baseline["threads"],
            "thread_names": _beyond(_task_names(), self.baseline_names["threads"]),
            "leaked_fds": _fds() - self.baseline["fds"],
            "fd_targets": _beyond(_fd_targets(), self.baseline_names["fds"])[:40],
            "nixl_registrations": getattr(plane, "registrations", 0),
            "live_transfers": getattr(plane, "live_transfers", 0),
            "logs": dict(self.logs.counts),
            "first_logs": list(self.logs.first),
        }

    # ------------------------------------------------------------------ the soak's mixed load

    def workload(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Start SGLang's two storage threads' worth of load (backup; hit query + prefetch)."""
        if self.workers:
            return {"error": "a workload is already running"}
        self.stop.clear()
        self.workers = [
            threading.Thread(target=self._guard(self._backup_loop, plan), name="soak-backup", daemon=True),
            threading.Thread(target=self._guard(self._restore_loop, plan), name="soak-prefetch", daemon=True),
        ]
        for worker in self.workers:
            worker.start()
        return {"started": len(self.workers)}

    def halt(self) -> dict[str, Any]:
        self.stop.set()
        for worker in self.workers:
            worker.join(2 * (self.timeout_s + 1.0) + 5)
        alive = [w.name for w in self.workers if w.is_alive()]
        self.workers = []
        return {"stuck_threads": alive}

    def _guard(self, loop: Callable[[dict[str, Any]], None], plan: dict[str, Any]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop(plan)
            except Exception:
                with self.lock:
                    self.kinds.setdefault("workload", KindStats()).exceptions += 1
                logging.getLogger("kvcr.soak").exception("soak workload thread failed")

        return run

    def _pause(self, plan: dict[str, Any]) -> None:
        self.stop.wait(float(plan.get("pause_s", 0.0)))

    def _backup_loop(self, plan: dict[str, Any]) -> None:
        rng = random.Random(plan["rng_seed"])
        own, pages = plan["own_prompts"], plan["prompt_pages"]
        half = self.view.pages // 2
        slot = 0
        while not self.stop.is_set():
            prompt = _skewed(rng, own)
            if slot + pages > half:
                slot = 0
            self.backup(prompt_keys(prompt, pages), slot, plan.get("seed", 0))
            slot += pages
            self._pause(plan)

    def _restore_loop(self, plan: dict[str, Any]) -> None:
        rng = random.Random(plan["rng_seed"] + 1)
        own, peers, pages = plan["own_prompts"], plan["peers"], plan["prompt_pages"]
        half = self.view.pages // 2
        slot = half
        while not self.stop.is_set():
            if slot + pages > self.view.pages:
                slot = half
            if peers and rng.random() < plan.get("remote_share", 0.5):
                peer = rng.choice(peers)
                keys, hint, kind = prompt_keys(_skewed(rng, peer["prompts"]), pages), peer["endpoint"], "remote_restore"
            else:
                keys, hint, kind = prompt_keys(_skewed(rng, own), pages), None, "local_restore"
            self.restore(keys, slot, hint, plan.get("seed", 0), kind=kind)
            slot += pages
            self._pause(plan)


def _skewed(rng: random.Random, prompts: list[int]) -> int:
    """A prompt, recent-heavy: half the picks from the first quarter of the list."""
    if rng.random() < 0.5:
        return prompts[rng.randrange(max(1, len(prompts) // 4))]
    return rng.choice(prompts)


def _request(keys: list[str]) -> str:
    """The request id a prompt's hit query and prefetch run under (one prompt, one request)."""
    return f"soak-{keys[0][:16]}" if keys else "soak-empty"


COMMANDS = ("backup", "exists", "get", "restore", "poison", "stats", "workload", "halt", "close")


def serve(conn: Any, options: ReplicaOptions) -> None:
    """The process body: build the replica, say READY, answer commands until ``exit`` or EOF."""
    try:
        if options.netns:
            from kvcr.testing.netns import enter_netns

            enter_netns(options.netns)
        os.environ.update(options.env)
        from kvcr.testing.sglang import prepare_environment

        prepare_environment()
        state = ReplicaState(options)
        conn.send(
            {"ready": True, "pid": os.getpid(), "endpoint": state.store.node.endpoint, "page_bytes": state.page_bytes}
        )
    except Exception:
        conn.send({"ready": False, "error": traceback.format_exc(limit=6)[-3000:]})
        return
    closed = False
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                break
            op = request.pop("op")
            if op == "exit":
                break
            if op not in COMMANDS:
                conn.send({"error": f"unknown command {op!r}"})
                continue
            try:
                reply = getattr(state, op)(**request)
            except Exception:
                reply = {"error": traceback.format_exc(limit=6)[-3000:]}
            closed |= op == "close"
            conn.send(reply)
    finally:
        if not closed:
            with contextlib.suppress(Exception):
                state.close()
