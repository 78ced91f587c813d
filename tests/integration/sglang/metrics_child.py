"""Run by test_metrics_on_sglang.py as if it were an SGLang scheduler process.

PROMETHEUS_MULTIPROC_DIR is inherited from the parent, as SGLang's launcher hands it to its
schedulers. The backend is built the way SGLang builds it (the storage factory, ``dynamic``
route, ``enable_storage_metrics`` on), then backs up 4 pages, answers a hit query that misses
one page, restores 4 pages and misses one; it prints READY and stays alive (its gauges are live)
until stdin closes.
"""

import sys

from tests.integration.sglang import sg


def main() -> int:
    host = sg.mha_host("page_first")
    store = sg.backend(host, sg.storage_config(storage_metrics=True))
    keys = sg.hashes(4)
    src = host.alloc(4 * sg.P)
    sg.fill(host, src, seed=1)
    assert store.batch_set_v1(keys, src) == [True] * 4
    assert store.batch_exists([*keys[:3], *sg.hashes(1, start=9000)]) == 3
    assert store.batch_get_v1(keys, host.alloc(4 * sg.P)) == [True] * 4
    assert store.batch_get_v1(sg.hashes(1, start=5000), host.alloc(sg.P)) == [False]
    print("READY", flush=True)
    sys.stdin.read()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
