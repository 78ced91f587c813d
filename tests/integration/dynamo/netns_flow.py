"""Run inside the frontend's namespace: Dynamo on etcd + NATS there, one kvcr worker per other namespace.

``python -m tests.integration.dynamo.netns_flow JOB`` (JOB a JSON object: workdir, token file, and
per worker its namespace, device and address). The frontend, etcd and NATS listen on this
namespace's address; each worker runs in its own namespace (``ip netns exec``), advertises its own
address, and reaches its peers only over the veth link to the bridge, UCX over tcp as between
hosts without RDMA. It seeds a prefix on A, loads A, lets the router book B with its hint, then
starts C late and waits for the router to use it. Prints one JSON line: what each step showed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvcr.demo.dynamo.deployment import Deployment, WorkerSpec
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
    with Deployment(Path(job["workdir"]), discovery_backend="etcd", event_plane="nats", host=job["frontend_addr"]) as d:
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
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
