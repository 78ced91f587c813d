"""Run inside the frontend's namespace: Dynamo on etcd + NATS there, one kvcr worker per other namespace.

``python -m tests.integration.dynamo.netns_flow JOB`` (JOB a JSON object: workdir, token file, and
per worker its namespace, device and address). The frontend, etcd and NATS listen on this
namespace's address; each worker runs in its own namespace (``ip netns exec``), advertises its own
address, and reaches its peers only over the veth link to the bridge, UCX over tcp as between
hosts without RDMA. It seeds a prefix on A, loads A, lets the router book B with its hint, then
starts C late and waits for the router to use it. Then the churn: NATS stopped, etcd stopped, the
frontend restarted (each followed by a hinted read across namespaces), and C SIGKILLed with a
prefix only it holds (requests for it until the router drops C, and one after). Prints one JSON
line: what each step showed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvcr.demo.dynamo.deployment import Deployment, DeploymentError, WorkerSpec
from kvcr.demo.dynamo.tiny_model import token_id

PAGE = 16
PREFIX_PAGES = 4
TOKEN_DELAY_MS = 25


def prefix(n: int) -> list[int]:
    return [token_id(100 * n + i) for i in range(PREFIX_PAGES * PAGE)]


def spec(name: str, job: dict[str, Any], where: dict[str, str], **changes: Any) -> WorkerSpec:
    return WorkerSpec(
        name,
        token_delay_ms=TOKEN_DELAY_MS,
        host=where["addr"],
        prefix=("ip", "netns", "exec", where["ns"]),
        env=(("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", where["dev"])),
        extra_args=("--auth-token-file", job["token_file"]),
        **changes,
    )


def hinted(d: Deployment, holder: Any, n: int) -> dict[str, Any]:
    """Seed prefix ``n`` on ``holder``, load it, and return the record of the next request for it."""
    import threading

    tokens = prefix(n)
    d.record_of(d.complete([*tokens, token_id(1)], nvext={"backend_instance_id": holder.worker_id}))
    time.sleep(0.5)
    busy = threading.Thread(
        target=lambda: d.complete(tokens + [token_id(1500 + i) for i in range(300)], max_tokens=120), daemon=True
    )
    busy.start()
    time.sleep(0.7)
    record = d.record_of(d.complete([*tokens, token_id(2), token_id(3)]))
    busy.join(60)
    return record


def main(job: dict[str, Any]) -> dict[str, Any]:
    hosts = job["workers"]
    out: dict[str, Any] = {}
    started = time.monotonic()
    where = {"discovery_backend": "etcd", "event_plane": "nats", "host": job["frontend_addr"]}
    with Deployment(Path(job["workdir"]), router_args=tuple(job.get("router_args", ())), **where) as d:
        d.start_frontend()
        a = d.start_worker(spec("a", job, hosts["a"]))
        b = d.start_worker(spec("b", job, hosts["b"], queue_delay_ms=1500))
        d.wait_ready([a, b], timeout_s=150)
        out["ready_s"] = time.monotonic() - started
        out["endpoints"] = {"a": a.control_endpoint, "b": b.control_endpoint}
        out["hinted"] = hinted(d, a, 5)
        # A worker joining late: registered through etcd, and the router books it.
        joined = time.monotonic()
        c = d.start_worker(spec("c", job, hosts["c"]))
        d.wait_ready([a, b, c], timeout_s=150)
        out["join_s"] = time.monotonic() - joined
        served_by_c = None
        for k in range(30):
            record = d.record_of(d.complete([token_id(700 + k)] * 40))
            if record["worker"] == "c":
                served_by_c = record
                break
        out["first_request_to_c_s"] = time.monotonic() - joined
        out["served_by_c"] = served_by_c
        out["hinted_from_c"] = hinted(d, c, 6) if served_by_c else None
        out["endpoints"]["c"] = c.control_endpoint
        out["churn"] = churn(d, a, c)
    return out


def outage(d: Deployment, server: str, holder: Any, n: int) -> dict[str, Any]:
    """Stop etcd or NATS for a few requests on a seeded prefix; then a hinted read must work again."""
    assert d.control_plane is not None
    tokens = prefix(n)
    d.record_of(d.complete([*tokens, token_id(1)], nvext={"backend_instance_id": holder.worker_id}))
    d.control_plane.stop(server)
    stopped = time.monotonic()
    try:
        during = []
        for k in range(3):
            during.append(d.record_of(d.complete([*tokens, token_id(40 + k)])))
            time.sleep(1.0)
    finally:
        down_s = time.monotonic() - stopped
        d.control_plane.restart(server)
    back = time.monotonic()
    d.wait_ready([w for w in d.workers if w.process.poll() is None], timeout_s=90)
    time.sleep(3)  # the publishers reconnect to NATS
    again = time.monotonic() - back
    return {"down_s": down_s, "routable_again_s": again, "during": during, "after": hinted(d, holder, n + 1)}


def churn(d: Deployment, a: Any, c: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"nats": outage(d, "nats", a, 7), "etcd": outage(d, "etcd", a, 9)}
    restarted = time.monotonic()
    d.restart_frontend()
    d.wait_ready([w for w in d.workers if w.process.poll() is None], timeout_s=90)
    out["frontend_routable_s"] = time.monotonic() - restarted
    out["after_frontend"] = hinted(d, a, 11)
    # C dies holding a prefix no one else has: hints naming it cost a miss until the router drops it.
    tokens = prefix(12)
    d.record_of(d.complete([*tokens, token_id(1)], nvext={"backend_instance_id": c.worker_id}))
    time.sleep(0.5)
    d.kill(c)
    killed = time.monotonic()
    while_listed: list[dict[str, Any]] = []
    while c.worker_id in d.routable_ids() and time.monotonic() - killed < 90:
        try:  # booked on C itself: without --migration-limit the frontend answers 503
            while_listed.append(d.record_of(d.complete([*tokens, token_id(60 + len(while_listed))])))
        except DeploymentError as exc:
            while_listed.append({"error": str(exc)[:200]})
        time.sleep(1.0)
    out["dead_dropped_s"] = time.monotonic() - killed
    out["while_listed"] = while_listed
    out["after_dropped"] = d.record_of(d.complete([*tokens, token_id(99)]))
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
