"""How a rank finds its place (topology refusals, the DP replica index) and how SGLang host pools are read
(layouts, page counts, strides, host indices): each refusal says exactly what to change."""

import dataclasses

import pytest
import torch

from kvcr.domain.errors import ConfigError, LayoutError
from kvcr.domain.pools import HitPolicy
from kvcr.integrations.sglang.pools import describe_host_pool, host_slots
from kvcr.integrations.sglang.startup import check_topology, dp_index, rank_layout, start
from kvcr.integrations.shared.settings import KvcrSettings
from tests.integration.sglang import sg

# ---------------------------------------------------------------------------------------------- topology


def refusal(config, settings=None):
    with pytest.raises(ConfigError) as err:
        check_topology(config, settings or KvcrSettings())
    return str(err.value)


def test_each_unsupported_topology_is_refused_saying_why():
    assert refusal(sg.storage_config(pp_size=2)) == (
        "kvcr refuses pipeline parallelism (pp_size > 1): storage keys carry no stage identity, so a peer "
        "could serve another stage's KV"
    )
    assert refusal(sg.storage_config(split_heads=True)) == (
        "kvcr refuses heterogeneous TP head splitting: a peer's shard would not match this rank's heads"
    )
    if sg.HAS_DECODE_CP:  # SGLang 0.5.23 added decode context parallelism to the storage config
        dcp = dataclasses.replace(sg.storage_config(mla=True, tp_size=2), dcp_size=2, dcp_rank=0, logical_page_size=32)
        assert refusal(dcp) == ("kvcr does not support decode context parallelism (dcp_size > 1) yet")
    assert refusal(sg.storage_config(mla=True, tp_size=2), KvcrSettings(control_port=0)) == (
        "MLA at TP > 1 needs control_port: only TP rank 0 backs up the replicated KV and the other ranks read it "
        "from rank 0's kvcr; with control_port 0 they could never hit. Set control_port (e.g. 32100)"
    )


@pytest.mark.parametrize(("mla", "cp_rank"), [(True, 0), (True, 1), (False, 0), (False, 1)])
def test_attention_context_parallelism_is_refused_naming_the_setting(mla, cp_rank):
    # SGLang's CP ranks (attention-TP rank 0 of each CP group is a storage writer under DP attention)
    # write the same rank-agnostic keys, and storage is not told whether a rank's page is whole or a slice.
    cp = dataclasses.replace(sg.storage_config(mla=mla, control_port=32100), attn_cp_rank=cp_rank, attn_cp_size=2)
    assert refusal(cp) == (
        "kvcr refuses attention context parallelism (--attn-cp-size 2): SGLang does not tell storage whether a "
        "CP rank's pages are whole or its slice, so no shard identity could keep a peer from serving another "
        "rank's bytes; use --attn-cp-size 1"
    )
    with pytest.raises(ConfigError, match="--attn-cp-size"):
        sg.backend(sg.mha_host("page_first"), cp)  # SGLang's own factory route fails at construction


def test_the_supported_topologies_pass():
    check_topology(sg.storage_config(mla=True), KvcrSettings())
    if sg.HAS_DECODE_CP:
        check_topology(dataclasses.replace(sg.storage_config(mla=True), dcp_size=1, dcp_rank=0), KvcrSettings())
    check_topology(sg.storage_config(mla=True, tp_size=2), KvcrSettings(control_port=32100))
    check_topology(sg.storage_config(tp_size=2), KvcrSettings(control_port=0))  # sharded KV needs no peer


@pytest.mark.parametrize(
    ("published", "own", "index"),
    [
        ({"dp_rank": 2, "attn_dp_size": 3}, 1, 7),
        ({"dp_rank": 2, "attn_dp_size": None}, 0, 2),
        ({"dp_rank": None, "attn_dp_size": 4}, 3, 3),
        ({"dp_rank": None, "attn_dp_size": None}, 0, 0),
    ],
)
def test_the_dp_index_combines_the_replica_and_the_attention_dp_group(monkeypatch, published, own, index):
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setenv("SGLANG_DP_RANK", "5")  # read only when the context has not published dp_rank
    with get_parallel().override(**published):  # SGLang's own scoped override of its parallel context
        assert dp_index(sg.storage_config(dp_rank=own)) == index


def test_without_a_parallel_context_the_replica_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_DP_RANK", "5")  # nothing published in this process: SGLang raises on read
    assert dp_index(sg.storage_config(dp_rank=1)) == 6
    monkeypatch.setenv("SGLANG_DP_RANK", "")
    assert dp_index(sg.storage_config()) == 0


def test_a_published_replica_without_attention_dp_is_one_group_and_ignores_the_environment(monkeypatch):
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setenv("SGLANG_DP_RANK", "5")
    with get_parallel().override(dp_rank=2):  # attn_dp_size unpublished: SGLang raises on it
        assert dp_index(sg.storage_config(dp_rank=1)) == 3
    with get_parallel().override(attn_dp_size=2):  # dp_rank unpublished: the environment's replica
        assert dp_index(sg.storage_config(dp_rank=1)) == 11


def test_a_rank_without_attention_cp_counts_as_one_cp_group():
    config = dataclasses.replace(sg.storage_config(tp_rank=1, tp_size=2), attn_cp_size=0)
    layout = rank_layout(config)
    assert (layout.tp_rank, layout.tp_size, layout.cp_rank, layout.cp_size) == (1, 2, 0, 1)
    cp = rank_layout(dataclasses.replace(sg.storage_config(tp_size=2), attn_cp_rank=1, attn_cp_size=2))
    assert (cp.cp_rank, cp.cp_size, cp.rank_offset) == (1, 2, 2)


def test_starting_without_a_kv_pool_is_refused():
    with pytest.raises(LayoutError) as err:
        start(sg.storage_config(), KvcrSettings(transport="mock"), None, (), {})
    assert str(err.value) == "no KV host pool was registered"


# ---------------------------------------------------------------------------------------------- host pools


class FakePool:
    """A host pool with SGLang's surface: page geometry and ``get_page_buffer_meta``."""

    def __init__(self, pages=4, page_size=2, pieces=(8, 4), stride=None, layout="page_first", **changes):
        self.layout, self.page_size, self.dtype = layout, page_size, "torch.bfloat16"
        self.page_num, self.size = pages, pages * page_size
        self.pieces, self.stride = pieces, stride or sum(pieces)
        self.base, self.kv_buffer = 1 << 20, object()
        self.odd_piece = self.skew = None
        self.odd_component = 0
        self.__dict__.update(changes)

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        pages = sorted({int(i) // self.page_size for i in indices})
        for c, piece in enumerate(self.pieces):
            for page in pages:
                skew = self.skew if (self.skew is not None and page > 1) else 0
                ptrs.append(self.base + c * 1000 + page * self.stride + skew)
                odd = self.odd_piece is not None and page == 1 and c == self.odd_component
                sizes.append(self.odd_piece if odd else piece)
        # SGLang lists every page's components in page order: regroup component-major into page-major
        k = len(self.pieces)
        by_page = [[(ptrs[c * len(pages) + p], sizes[c * len(pages) + p]) for c in range(k)] for p in range(len(pages))]
        flat = [item for page in by_page for item in page]
        return [p for p, _ in flat], [s for _, s in flat]


def described(pool, anchor=True, name="kv"):
    return describe_host_pool(name, pool, anchor=anchor, hit_policy=HitPolicy.ALL_PAGES)


def layout_error(pool, name="kv", anchor=True):
    with pytest.raises(LayoutError) as err:
        described(pool, anchor, name)
    return str(err.value)


def test_a_strided_pool_becomes_one_region_per_component():
    pool = FakePool(pages=4, page_size=2, pieces=(8, 4), stride=16)
    d = described(pool)
    assert (d.page_size, d.dtype, d.layout) == (2, "torch.bfloat16", "page_first")
    assert (
        d.spec.anchor
        and d.spec.hit_policy is HitPolicy.ALL_PAGES
        and [c.piece_bytes for c in d.spec.components] == [8, 4]
    )
    assert [(r.label, r.base, r.stride, r.count, r.piece_bytes) for r in d.regions] == [
        ("kv/c0", pool.base, 16, 4, 8),
        ("kv/c1", pool.base + 1000, 16, 4, 4),
    ]
    side = describe_host_pool("swa", FakePool(), anchor=False, hit_policy=HitPolicy.TRAILING_PAGES)
    assert not side.spec.anchor and side.spec.hit_policy is HitPolicy.TRAILING_PAGES


def test_the_page_count_comes_from_page_num_or_else_size():
    assert described(FakePool(pages=5)).regions[0].count == 5
    no_page_num = FakePool(pages=5, page_num=None)
    assert described(no_page_num).regions[0].count == 5  # size // page_size
    zero = FakePool(pages=5, page_num=0)
    assert described(zero).regions[0].count == 5
    assert layout_error(FakePool(pages=1)) == "host pool 'kv' has 1 pages; kvcr needs at least 2"
    assert described(FakePool(pages=2)).regions[0].count == 2
    empty = FakePool(page_num=None)
    del empty.size
    assert layout_error(empty) == "host pool 'kv' has 0 pages; kvcr needs at least 2"


def test_page_num_wins_over_size_and_a_pool_without_either_has_no_pages():
    assert described(FakePool(pages=5, size=40)).regions[0].count == 5  # size alone would say 20
    assert layout_error(FakePool(pages=1, size=40)) == "host pool 'kv' has 1 pages; kvcr needs at least 2"
    bare = FakePool(pages=5)
    del bare.page_num
    assert described(bare).regions[0].count == 5  # size // page_size
    nothing = FakePool(page_size=1)
    del nothing.page_num, nothing.size
    assert layout_error(nothing) == "host pool 'kv' has 0 pages; kvcr needs at least 2"


def test_a_pool_may_lack_a_dtype_or_a_kv_buffer_but_not_a_layout():
    untyped = FakePool()
    del untyped.dtype
    assert described(untyped).dtype == "unknown"
    unbuffered = FakePool()
    del unbuffered.kv_buffer  # only a kv_buffer of None makes a logical anchor
    d = described(unbuffered)
    assert not d.spec.logical and d.regions[0].count == 4
    unlaid = FakePool()
    del unlaid.layout
    assert layout_error(unlaid) == (
        "host pool 'kv' uses layout None; kvcr needs --hicache-mem-layout page_first or "
        "page_first_direct (layer_first scatters a page over every layer, which kvcr does not copy)"
    )


def test_a_pool_without_bytes_is_a_logical_anchor():
    d = described(FakePool(kv_buffer=None, layout="layer_first"))
    assert d.spec.logical and d.spec.anchor and d.regions == () and (d.page_size, d.layout) == (2, "layer_first")
    assert d.dtype == "torch.bfloat16"
    # only the anchor may be logical: a side pool without a kv_buffer attribute is an ordinary pool
    assert not described(FakePool(kv_buffer=None), anchor=False, name="swa").spec.logical


def test_pools_kvcr_cannot_address_are_refused_saying_why():
    assert layout_error(FakePool(page_size=0)) == "host pool 'kv' has no page_size"
    unset = FakePool()
    unset.page_size = None
    assert layout_error(unset) == "host pool 'kv' has no page_size"
    del unset.page_size
    assert layout_error(unset) == "host pool 'kv' has no page_size"
    assert layout_error(FakePool(layout="layer_first")) == (
        "host pool 'kv' uses layout 'layer_first'; kvcr needs --hicache-mem-layout page_first or "
        "page_first_direct (layer_first scatters a page over every layer, which kvcr does not copy)"
    )
    assert layout_error(FakePool(odd_piece=6)) == "host pool 'kv' component 0: pieces differ in size between pages"
    assert (
        layout_error(FakePool(odd_piece=6, odd_component=1))
        == "host pool 'kv' component 1: pieces differ in size between pages"
    )
    assert (
        layout_error(FakePool(pieces=(8,), stride=4))
        == "host pool 'kv' component 0: pages overlap (stride 4 < piece 8)"
    )
    assert layout_error(FakePool(skew=3)) == "host pool 'kv' component 0: pages are not evenly strided"


def test_a_page_meta_of_the_wrong_shape_is_refused():
    class Broken(FakePool):
        def get_page_buffer_meta(self, indices):
            ptrs, sizes = super().get_page_buffer_meta(indices)
            return self.shape(ptrs, sizes)

    for shape in (lambda p, s: ([], []), lambda p, s: (p[:3], s[:3]), lambda p, s: (p, s[:2])):
        pool = Broken(pieces=(8, 4))
        pool.shape = shape
        ptrs, _ = shape(*FakePool(pieces=(8, 4)).get_page_buffer_meta(range(4)))
        assert layout_error(pool) == f"host pool 'kv': page meta has {len(ptrs)} extents for 2 pages"


def test_the_meta_of_the_first_two_and_the_last_page_is_asked_for_with_int64_indices():
    seen = []

    class Recording(FakePool):
        def get_page_buffer_meta(self, indices):
            seen.append((indices.dtype, [int(i) for i in indices]))
            return super().get_page_buffer_meta(indices)

    described(Recording(pages=3, page_size=2))
    assert seen == [(torch.int64, [0, 1, 2, 3]), (torch.int64, [4, 5])]


def test_the_anchor_of_a_real_sglang_pool_is_described_from_its_meta():
    host = sg.mha_host("page_first")
    d = described(host)
    assert len(d.regions) == 2 and d.regions[0].count == host.page_num
    assert d.dtype == str(host.dtype) and d.layout == "page_first"


# ---------------------------------------------------------------------------------------------- host indices


def test_host_indices_become_page_slots():
    assert host_slots(torch.arange(4, 10, dtype=torch.int32), 2) == [2, 3, 4]
    assert host_slots(torch.tensor([7, 3]), 1) == [7, 3]
    slots = host_slots(torch.arange(4, 10, dtype=torch.float64), 2)
    assert slots == [2, 3, 4] and all(type(s) is int for s in slots)  # indices of any dtype give int slots


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        (torch.arange(0, 3), "3 host indices are not a whole number of 2-token pages"),
        (torch.arange(1, 5), "host indices are not aligned to pages"),
        (torch.tensor([0, 2, 4, 5]), "host indices of a page are not contiguous"),
    ],
)
def test_host_indices_that_are_not_whole_aligned_pages_are_refused(indices, message):
    with pytest.raises(LayoutError) as err:
        host_slots(indices, 2)
    assert str(err.value) == message
