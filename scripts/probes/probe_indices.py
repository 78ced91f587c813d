"""Finding 6: what ``make_prepped_xfer`` accepts as indices, what each index costs, and merging.

Two agents in this process (two UCX workers: CMA between them, as between two processes).
Measures, per form of the index arguments (list, numpy int32/int64/uint64), the time to make a
prepared request with N indices; then the time of whole READs of 32 adjacent 4 KiB pieces
given as 32 consecutive indices vs the same 32 pieces scattered, vs one 128 KiB descriptor.
Run: ``python scripts/probes/probe_indices.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

import numpy as np

logging.getLogger("nixl").setLevel(logging.WARNING)

KIB = 1024


def agent(name: str, thread_delay_us: int | None = None) -> Any:
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=thread_delay_us is not None, enable_listen_thread=False, backends=[])
    if thread_delay_us is None:
        made = nixl_agent(name, config)
    else:  # NIXL's thread, sleeping in poll() on the worker's event fd (the wrapper forces pthrDelay=0)
        raw = _bindings.nixlAgentConfig()
        raw.useProgThread, raw.useListenThread, raw.pthrDelay = True, False, thread_delay_us
        original = _bindings.nixlAgent
        _bindings.nixlAgent = lambda agent_name, _config: original(agent_name, raw)
        try:
            made = nixl_agent(name, config)
        finally:
            _bindings.nixlAgent = original
    made.create_backend("UCX", {})
    return made


def timed(fn: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def read(target: Any, lside: Any, lidx: Any, rside: Any, ridx: Any, source: Any) -> None:
    xfer = target.make_prepped_xfer("READ", lside, lidx, rside, ridx)
    state = target.transfer(xfer)
    while state == "PROC":
        source.get_new_notifs()
        state = target.check_xfer_state(xfer)
    assert state == "DONE", state
    xfer.release()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--thread-delay-us", type=int, default=None, help="NIXL progress thread on, this pthrDelay")
    args = parser.parse_args()
    source, target = agent("isrc", args.thread_delay_us), agent("itgt", args.thread_delay_us)
    piece, count = 4 * KIB, 8192
    src = np.random.default_rng(1).integers(0, 256, piece * count, dtype=np.uint8)
    dst = np.zeros_like(src)
    source.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    target.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    target.add_remote_agent(source.get_agent_metadata())
    rows = lambda base: np.array([[base, piece, 0, piece, count]], dtype=np.uint64)  # noqa: E731
    rside = target.prep_xfer_dlist("isrc", rows(src.ctypes.data), "DRAM")
    lside = target.prep_xfer_dlist("NIXL_INIT_AGENT", rows(dst.ctypes.data), "DRAM")
    # wire-up
    read(target, lside, [0], rside, [0], source)
    out: dict[str, Any] = {"thread_delay_us": args.thread_delay_us, "accepts": {}, "make_us": {}}
    rng = np.random.default_rng(2)
    for form, conv in (
        ("list", list),
        ("int32", lambda a: np.asarray(a, np.int32)),
        ("int64", lambda a: np.asarray(a, np.int64)),
        ("uint64", lambda a: np.asarray(a, np.uint64)),
    ):
        idx = conv([int(i) for i in rng.permutation(count)[:32]])
        try:
            target.make_prepped_xfer("READ", lside, idx, rside, idx).release()
            out["accepts"][form] = True
        except Exception as exc:
            out["accepts"][form] = f"{type(exc).__name__}: {exc}"
    for n in (1, 32, 128, 1024, 8192):
        scattered = rng.permutation(count)[:n]
        for form, idx in (("list", [int(i) for i in scattered]), ("int32", scattered.astype(np.int32))):

            def make(idx: Any = idx) -> None:
                target.make_prepped_xfer("READ", lside, idx, rside, idx).release()

            out["make_us"][f"{form} x{n}"] = round(1e6 * timed(make, 200 if n < 1024 else 30), 2)
    adjacent = list(range(100, 132))
    scattered = [int(i) for i in rng.permutation(count)[:32]]
    whole = np.array([[dst.ctypes.data + 100 * piece, 32 * piece, 0]], dtype=np.uint64)
    whole_src = np.array([[src.ctypes.data + 100 * piece, 32 * piece, 0]], dtype=np.uint64)
    one_l = target.prep_xfer_dlist("NIXL_INIT_AGENT", whole, "DRAM")
    one_r = target.prep_xfer_dlist("isrc", whole_src, "DRAM")
    out["read_us"] = {
        "32 adjacent indices": round(
            1e6 * timed(lambda: read(target, lside, adjacent, rside, adjacent, source), 300), 2
        ),
        "32 scattered indices": round(
            1e6 * timed(lambda: read(target, lside, scattered, rside, scattered, source), 300), 2
        ),
        "1 descriptor of 128 KiB": round(1e6 * timed(lambda: read(target, one_l, [0], one_r, [0], source), 300), 2),
    }
    read(target, lside, scattered, rside, scattered, source)
    assert all(np.array_equal(dst[i * piece : (i + 1) * piece], src[i * piece : (i + 1) * piece]) for i in scattered)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
