"""Helpers of the fault suite: a cluster of replica processes, per-trial checks, per-fault figures."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from kvcr.soak.processes import Replica
from kvcr.soak.replica import ReplicaOptions
from tests.support import free_port

TCP = {"UCX_TLS": "tcp"}
SHM = {"transport": "shm"}


def flavour(tls: str) -> tuple[dict[str, str], dict[str, str]]:
    """(environment, settings) of a replica for one data-plane flavour: NIXL over CMA or tcp, or shm."""
    return (TCP if tls == "tcp" else {}), (SHM if tls == "shm" else {})


class Cluster:
    """Replicas started by one test; closed in reverse order (killed if they do not answer)."""

    def __init__(self) -> None:
        self.replicas: list[Replica] = []
        self.reports: dict[str, dict | None] = {}

    def start(self, name: str, *, port: int | None = None, **options) -> Replica:
        # These faults restore a whole prompt from one source sized for it (a peer may lease half a
        # pool): no per-peer share below the pool's lease cap.
        options["settings"] = {"peer_lease_share": 1.0, **options.get("settings", {})}
        replica = Replica(ReplicaOptions(name, port=port or free_port(), **options))
        self.replicas.append(replica)
        return replica

    def close_checked(self, replica: Replica) -> dict:
        """Close ``replica`` and require that it leaves nothing behind."""
        report = replica.close()
        self.reports[replica.options.name] = report
        assert report is not None, f"{replica.options.name} did not close (exit code {replica.exitcode})"
        assert report["error"] is None, report["error"]
        leaks = {k: report[k] for k in ("leaked_threads", "leaked_fds", "nixl_registrations", "live_transfers")}
        assert not any(leaks.values()), (
            replica.options.name,
            leaks,
            report["nixl_agents"],
            report["thread_names"],
            report["fd_targets"],
        )
        return report

    def close(self) -> None:
        for replica in reversed(self.replicas):
            with contextlib.suppress(Exception):
                replica.close(timeout_s=30)


@dataclass
class Fault:
    """Figures of one fault: every trial's slowest call, wrong bytes, pages, whether the worker lived."""

    name: str
    transport: str = "cma"
    trials: int = 0
    worst_s: float = 0.0
    wrong_bytes: int = 0
    late_bytes: int = 0
    hits: int = 0
    misses: int = 0
    worker_alive: bool = True
    notes: list[str] = field(default_factory=list)

    def call(self, reply: dict, bound_s: float, *, hits_checked: bool = True) -> dict:
        """Check one backend call's reply (a ``get``, ``exists`` or ``restore``) and count it."""
        assert reply.get("error") is None, reply["error"]
        times = [reply[k] for k in ("seconds", "exists_s", "get_s") if k in reply]
        self.worst_s = max(self.worst_s, *times)
        assert max(times) <= bound_s, f"{self.name}: a call took {max(times):.3f}s (bound {bound_s:.3f}s)"
        self.wrong_bytes += reply.get("wrong_bytes", 0)
        assert reply.get("wrong_bytes", 0) == 0, f"{self.name}: {reply['wrong_pages']} pages came back wrong"
        results = reply.get("results")
        if results is not None:
            self.hits += sum(results)
            self.misses += len(results) - sum(results)
        return reply

    def alive(self, target: Replica) -> None:
        self.worker_alive = self.worker_alive and target.alive
        assert target.alive, f"{self.name}: the target exited with code {target.exitcode}"

    def poison(self, target: Replica, first_slot: int, count: int) -> None:
        late = target.ask("poison", first_slot=first_slot, count=count)["late_bytes"]
        self.late_bytes += late
        assert late == 0, f"{self.name}: {late} bytes landed in host pages after the call returned"


class Figures:
    """Every fault's figures of this session (printed in the terminal summary)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.printed = False
        self._lock = threading.Lock()

    def record(self, fault: Fault) -> None:
        row = dict(vars(fault))
        row["notes"] = "; ".join(fault.notes)
        with self._lock:
            self.rows.append(row)

    def table(self) -> list[str]:
        lines = [
            f"{'fault':58} {'tls':4} {'trials':>6} {'worst s':>8} {'wrong B':>7} {'late B':>6} "
            f"{'hits':>5} {'misses':>6} alive  notes"
        ]
        for r in self.rows:
            lines.append(
                f"{r['name']:58} {r['transport']:4} {r['trials']:>6} {r['worst_s']:>8.3f} {r['wrong_bytes']:>7} "
                f"{r['late_bytes']:>6} {r['hits']:>5} {r['misses']:>6} {'yes' if r['worker_alive'] else 'NO':5}  "
                f"{r['notes']}"
            )
        return lines
