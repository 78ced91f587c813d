"""Hint envelopes through SGLang 0.5.23's real backend surface (mock transport, two replicas in process).

Replica ``A`` holds six pages, replica ``D`` (127.0.0.2) other bytes under the same keys; replica
``B`` (``enable_remote_hint``, ``peer_allowlist`` 127.0.0.1)
gets ``batch_exists``, ``batch_exists_v2`` and ``batch_get_v1`` with generated hints in
``extra_info.extra_info``: right ones for ``A`` in every accepted shape and encoding, ones that
look right but name junk endpoints (nothing there, another network, B itself, bad syntax), and
junk of every JSON and non-JSON kind. For every case:

- nothing raises into the caller and nothing logs an ERROR (the backend's catch-alls stay unused);
- the hit count is within bounds, the same from both query calls, and exact for a right hint;
- a page reported read holds A's bytes; any other destination page is untouched or holds A's
  bytes for that key (B's host pages start each case filled with a sentinel);
- rejections are counted under a closed set of reasons, whatever the hint said.
"""

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcr.testing.sglang import prepare_environment

prepare_environment()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from kvcr.domain.hints import Rejection  # noqa: E402
from kvcr.domain.keys import router_id, router_id_signed  # noqa: E402
from tests.fuzz.budget import budget, count  # noqa: E402
from tests.fuzz.peer import ErrorLog  # noqa: E402
from tests.integration.sglang import sg  # noqa: E402

pytestmark = pytest.mark.sglang

N = 6
REJECTIONS = {r.value for r in Rejection}


@pytest.fixture(scope="module", autouse=True)
def _parallel_context():
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


@pytest.fixture
def replicas():
    made = []

    def make(**settings):
        port = sg.free_port()
        host = sg.mha_host("page_first")
        store = sg.backend(host, sg.storage_config(control_port=port, **settings))
        made.append(store)
        return store, host, port

    a, host_a, port_a = make()
    b, host_b, port_b = make(enable_remote_hint=True, peer_allowlist=["127.0.0.1"])
    d, host_d, port_d = make(control_host="127.0.0.2")  # a real replica, outside B's allowlist
    keys = sg.hashes(N)
    src = host_a.alloc(N * sg.P)
    sg.fill(host_a, src, seed=7)
    assert a.batch_set_v1(keys, src) == [True] * N
    other = host_d.alloc(N * sg.P)
    sg.fill(host_d, other, seed=8)  # other bytes under the same keys: what a hostile hint would point at
    assert d.batch_set_v1(keys, other) == [True] * N
    yield {
        "a": a,
        "b": b,
        "host_a": host_a,
        "host_b": host_b,
        "port_a": port_a,
        "port_b": port_b,
        "port_d": port_d,
        "keys": keys,
        "src": src,
    }
    for store in made:
        store.close()


# ------------------------------------------------------------------ hints


def _payload(endpoint, hashes, **extra):
    return {"source_control_endpoint": endpoint, "block_hashes": hashes, **extra}


def _envelope(payload, *, before=()):
    action = {"action_id": "a", "action_type": "kv.fetch", "action_version": "1.0", "payload": payload}
    return {"protocol_version": "0.1", "message_id": "m", "actions": [*before, action]}


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)
# Endpoints that look right but lead nowhere useful ("{a}", "{b}", "{d}": A's, B's and D's ports).
junk_endpoints = st.one_of(
    st.sampled_from(
        [
            "tcp://127.0.0.1:{b}",  # B itself
            "tcp://127.0.0.1:1",  # nothing there
            "tcp://127.0.0.2:{a}",  # loopback, another address
            "tcp://localhost:{a}",  # the same server under another name is not a known link here
            "tcp://10.1.2.3:{a}",  # outside the allowlist
            "tcp://127.0.0.2:{d}",  # outside the allowlist, and a replica that holds these keys (other bytes)
            "tcp://[::1]:{a}",
            "tcp://127.0.0.1:{a}0",  # out of range
            "tcp://127.0.0.1:0",
            "tcp://0.0.0.0:{a}",
            "tcp://*:{a}",
            "127.0.0.1:{a}",  # no scheme in an envelope
            "tcp://127.0.0.1:{a}/x",
            "tcp://127.0.0.1:{a}\x00",
            "tcp://127.0.0.1:\u0661\u0662",  # digits, but not ASCII ones
            "tcp://" + "h" * 300 + ":{a}",
        ]
    ),
    st.text(max_size=30),
)
hash_kinds = st.sampled_from(["all", "signed", "prefix", "other", "mixed", "junk"])
encodings = st.sampled_from(["dict", "str", "bytes"])
hints = st.one_of(
    st.tuples(
        st.just("right"),
        st.sampled_from(["envelope", "legacy", "wrapped", "extra_actions"]),
        hash_kinds,
        st.integers(1, N),
        encodings,
    ),
    st.tuples(st.just("endpoint"), junk_endpoints, hash_kinds, st.integers(1, N), encodings),
    st.tuples(st.just("endpoint"), st.just("tcp://127.0.0.2:{d}"), hash_kinds, st.integers(1, N), encodings),
    st.tuples(
        st.just("payload"),
        st.dictionaries(st.sampled_from(["mode", "no_retain", "block_hashes", "extra"]), json_values, max_size=3),
        encodings,
    ),
    st.tuples(
        st.just("junk"),
        st.one_of(
            json_values,
            st.binary(max_size=40),
            st.builds(lambda d: "[" * d + "]" * d, st.integers(1, 100_000)),
            st.just(b"\xff\xfe{"),
            st.just("\ud800"),
        ),
    ),
    st.tuples(st.just("object"), st.sampled_from(["no_extra", "none_extra", "list_extra", "struct", "legacy_key"])),
)


def _hashes(kind, k, keys):
    ids = [router_id(x) for x in keys[:k]]
    if kind == "signed":
        return [router_id_signed(x) for x in keys[:k]]
    if kind == "prefix":
        return ids[: max(1, k // 2)]
    if kind == "other":
        return [i ^ 1 for i in ids]
    if kind == "mixed":
        return [*ids, -1, 0, (1 << 64) - 1]
    if kind == "junk":
        return [str(i) for i in ids]
    return ids


def _encode(value, encoding):
    if encoding == "dict":
        return value
    text = json.dumps(value)
    return text if encoding == "str" else text.encode()


class _Struct:
    """Not a mapping, not JSON: what a caller's own object looks like to the backend."""

    extra_info = None


def build(spec, r):
    """(extra_info for the calls, the pages a right hint makes A serve, or None when none may be served)."""
    keys, a, b = r["keys"], str(r["port_a"]), str(r["port_b"])
    kind = spec[0]
    if kind == "right":
        shape, hashes, k, encoding = spec[1:]
        hashed = _hashes(hashes, k, keys)
        endpoint = f"tcp://127.0.0.1:{a}"
        expect = None if hashes in ("other", "junk") else (max(1, k // 2) if hashes == "prefix" else k)
        if shape == "legacy":
            raw = _payload(f"127.0.0.1:{a}", hashed)
        elif shape == "wrapped":
            return HiCacheStorageExtraInfo(extra_info={"kvcr_router_hint": _payload(endpoint, hashed)}), expect
        elif shape == "extra_actions":
            raw = _envelope(_payload(endpoint, hashed), before=[{"action_type": "kv.other", "payload": 1}])
        else:
            raw = _envelope(_payload(endpoint, hashed))
        return HiCacheStorageExtraInfo(extra_info={"kv_hints": _encode(raw, encoding)}), expect
    if kind == "endpoint":
        endpoint, hashes, k, encoding = spec[1:]
        named = endpoint.replace("{a}", a).replace("{b}", b).replace("{d}", str(r["port_d"]))
        raw = _envelope(_payload(named, _hashes(hashes, k, keys)))
        return HiCacheStorageExtraInfo(extra_info={"kv_hints": _encode(raw, encoding)}), None
    if kind == "payload":  # a right endpoint, the rest generated: may or may not be usable
        fields, encoding = spec[1:]
        raw = _envelope({"source_control_endpoint": f"tcp://127.0.0.1:{a}", **fields})
        try:
            encoded = _encode(raw, encoding)
        except (TypeError, ValueError):
            encoded = raw
        return HiCacheStorageExtraInfo(extra_info={"kv_hints": encoded}), "any"
    if kind == "junk":
        return HiCacheStorageExtraInfo(extra_info={"kv_hints": spec[1]}), None
    variant = spec[1]
    if variant == "no_extra":
        return HiCacheStorageExtraInfo(), None
    if variant == "none_extra":
        return None, None
    if variant == "list_extra":
        return HiCacheStorageExtraInfo(extra_info=[1, 2]), None
    if variant == "struct":
        return HiCacheStorageExtraInfo(extra_info={"kv_hints": _Struct()}), None
    return HiCacheStorageExtraInfo(extra_info={"kvcr_router_hint": 5}), None


# ------------------------------------------------------------------ the target


def _page(host, indices, i):
    return host.get_data_page(int(indices[i * sg.P]), flat=True)


def test_hints_through_sglangs_backend_are_a_miss_or_a_correct_hit(replicas):
    r = replicas
    b, host_a, host_b, keys, src = r["b"], r["host_a"], r["host_b"], r["keys"], r["src"]
    dst = host_b.alloc(N * sg.P)
    sentinel = torch.full_like(_page(host_b, dst, 0), 3.0)
    errors = ErrorLog()
    logging.getLogger("kvcr").addHandler(errors)
    counters_before = None

    @budget("hints.sglang")
    @given(hints)
    def case(spec):
        nonlocal counters_before
        count("hints.sglang")
        info, expect = build(spec, r)
        for i in range(N):
            host_b.set_from_flat_data_page(int(dst[i * sg.P]), sentinel)
        hits = b.batch_exists(keys, info)
        hits_v2 = b.batch_exists_v2(keys, None, info)
        got = b.batch_get_v1(keys, dst, info)
        assert not errors.records, errors.records[0].getMessage()
        assert isinstance(hits, int) and 0 <= hits <= N
        assert hits_v2.kv_hit_pages == hits, (hits, hits_v2)
        assert isinstance(got, list) and len(got) == N and all(isinstance(x, bool) for x in got)
        if expect is None:
            assert hits == 0 and not any(got), (spec, hits, got)
        elif expect != "any":
            assert hits == expect and got == [True] * expect + [False] * (N - expect), (spec, hits, got)
        for i in range(N):
            landed = _page(host_b, dst, i)
            if got[i]:
                assert torch.equal(landed, _page(host_a, src, i)), f"page {i} read with wrong bytes"
            else:
                assert torch.equal(landed, sentinel) or torch.equal(landed, _page(host_a, src, i)), (
                    f"page {i} is a miss but its host page changed"
                )
        rejected = b.kvcr_stats()["hints_rejected"]
        assert set(rejected) <= REJECTIONS, rejected
        counters = set(b.kvcr_stats()["counters"])
        counters_before = counters_before or counters
        assert len(counters - counters_before) <= 64, "counter keys keep growing with the hints"

    try:
        case()
    finally:
        logging.getLogger("kvcr").removeHandler(errors)
    # A's pages were never harmed and a right hint still works.
    info, _ = build(("right", "envelope", "all", N, "dict"), r)
    assert b.batch_exists(keys, info) == N
    assert b.batch_get_v1(keys, dst, info) == [True] * N
    assert sg.pages_equal(host_a, src, host_b, dst)
