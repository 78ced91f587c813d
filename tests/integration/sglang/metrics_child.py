"""Run by test_metrics_on_sglang.py as if it were an SGLang scheduler process: PROMETHEUS_MULTIPROC_DIR
is inherited from the parent, the runner's metrics come from ``engine_metrics``; it backs up and
restores pages, prints READY and stays alive (its gauges are live) until stdin closes."""

import sys

from kvcr.adapters.local import MmapHostMemory, MonotonicClock, NullInventory
from kvcr.adapters.prometheus import engine_metrics
from kvcr.ports.metric_catalogue import LeaseRole, MetricName
from tests.support import HostPool, kv_pool, make_runner, sequence


def main() -> int:
    metrics = engine_metrics(True, strict=True)
    pool = kv_pool()
    memory = MmapHostMemory()
    runner = make_runner((pool,), 8, memory, MonotonicClock(), metrics, NullInventory())
    host = HostPool(pool, 32)
    runner.register_host_pool("kv", host.regions)
    pages = sequence(4)
    assert all(runner.backup("kv", pages, [0, 1, 2, 3]))
    assert all(o.restored for o in runner.restore("kv", pages, [10, 11, 12, 13]))
    metrics.set_gauge(MetricName.LEASES_HELD, 2, {"role": LeaseRole.SOURCE})
    print("READY", flush=True)
    sys.stdin.read()
    runner.close()
    memory.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
