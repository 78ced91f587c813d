"""Rank and port arithmetic (kvcr.domain.topology), with attention context parallelism and DP replicas."""

import itertools

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.domain.keys import ShardIdentity
from kvcr.domain.topology import RankLayout

BASE = 30000


def ranks(tp, cp, dp):
    return [
        RankLayout(tp_rank=t, tp_size=tp, cp_rank=c, cp_size=cp, dp_rank=dp)
        for c, t in itertools.product(range(cp), range(tp))
    ]


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 3)])
def test_each_dp_replica_owns_one_contiguous_block_of_ports(tp, cp):
    for dp in range(3):
        ports = sorted(r.control_port(BASE) for r in ranks(tp, cp, dp))
        block = tp * cp
        assert ports == list(range(BASE + dp * block, BASE + (dp + 1) * block))


def test_a_ranks_offset_counts_tp_ranks_first_then_cp_groups():
    layout = RankLayout(tp_rank=1, tp_size=2, cp_rank=1, cp_size=2, dp_rank=1)
    assert layout.ranks_per_replica == 4
    assert layout.rank_offset == 3  # tp_rank + tp_size * cp_rank
    assert layout.control_port(BASE) == BASE + 4 + 3
    assert RankLayout(tp_rank=0, tp_size=2, cp_rank=1, cp_size=2).control_port(BASE) == BASE + 2
    assert RankLayout(tp_rank=1, tp_size=2, cp_rank=0, cp_size=2).control_port(BASE) == BASE + 1


def test_the_writer_is_tp_rank_0_of_the_ranks_own_cp_group():
    layout = RankLayout(tp_rank=1, tp_size=2, cp_rank=1, cp_size=2, dp_rank=1)
    writer = RankLayout(tp_rank=0, tp_size=2, cp_rank=1, cp_size=2, dp_rank=1)
    assert not layout.is_writer and writer.is_writer
    assert layout.writer_offset == 2
    assert layout.writer_port(BASE) == writer.control_port(BASE) == BASE + 4 + 2
    assert writer.writer_port(BASE) == writer.control_port(BASE)  # a writer reads replicated KV from itself


def test_replicated_pools_come_from_the_writer_and_sharded_ones_from_the_same_rank():
    layout = RankLayout(tp_rank=3, tp_size=4, cp_rank=1, cp_size=2)
    assert layout.source_offset(replicated=True) == 4
    assert layout.source_offset(replicated=False) == 7
    assert layout.shard(replicated=True) == ShardIdentity(replicated=True)
    assert layout.shard(replicated=False) == ShardIdentity(3, 4)
    assert layout.shard(replicated=False).digest_terms() == ["tp", 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp_rank=2, tp_size=2), "tp_rank 2 is outside tp_size 2"),
        (dict(tp_rank=-1, tp_size=2), "tp_rank -1 is outside tp_size 2"),
        (dict(tp_rank=0, tp_size=0), "tp_rank 0 is outside tp_size 0"),
        (dict(cp_rank=2, cp_size=2), "attn_cp_rank 2 is outside attn_cp_size 2"),
        (dict(cp_rank=-1, cp_size=2), "attn_cp_rank -1 is outside attn_cp_size 2"),
        (dict(cp_rank=0, cp_size=0), "attn_cp_rank 0 is outside attn_cp_size 0"),
        (dict(dp_rank=-1), "dp_rank must not be negative, got -1"),
    ],
)
def test_impossible_coordinates_are_refused_naming_them(kwargs, message):
    with pytest.raises(ConfigError) as err:
        RankLayout(**kwargs)
    assert str(err.value) == message


def test_the_last_coordinates_of_every_axis_are_accepted():
    layout = RankLayout(tp_rank=1, tp_size=2, cp_rank=1, cp_size=2, dp_rank=0)
    assert layout.rank_offset == 3
    assert RankLayout().control_port(BASE) == BASE  # 1 x 1, replica 0: the base port itself


@pytest.mark.parametrize("base", [0, -1, 65536])
def test_a_base_port_outside_the_port_range_is_refused(base):
    with pytest.raises(ConfigError) as err:
        RankLayout().control_port(base)
    assert str(err.value) == f"control_port must be in 1..65535, got {base}"
    with pytest.raises(ConfigError):
        RankLayout().writer_port(base)


def test_the_block_of_the_last_replica_must_fit_below_65536():
    assert RankLayout().control_port(1) == 1
    assert RankLayout().control_port(65535) == 65535
    two = RankLayout(tp_rank=1, tp_size=2, dp_rank=1)  # replica 1 of 2 ranks: ports base+2, base+3
    assert two.control_port(65532) == 65535
    assert two.writer_port(65532) == 65534
    with pytest.raises(ConfigError) as err:
        two.control_port(65533)
    assert str(err.value) == (
        "control_port 65533 leaves no room for DP replica 1 with 2 ranks (needs ports up to 65536); lower control_port"
    )
    # The whole block is checked, not only this rank's port: rank 0 of replica 1 is refused too.
    with pytest.raises(ConfigError):
        RankLayout(tp_rank=0, tp_size=2, dp_rank=1).control_port(65533)
    with pytest.raises(ConfigError):
        RankLayout(tp_rank=0, tp_size=2, dp_rank=1).writer_port(65533)
