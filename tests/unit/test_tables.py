"""Terminal tables for the demo and the CLI: aligned columns, units, no dataclass reprs."""

from kvcr.bench.stats import counter_table, pool_table, text_table
from kvcr.runner.runner import PoolStats


def test_pool_stats_read_as_a_table_with_units():
    table = pool_table([PoolStats("kv", 24, 8, 16, 0, 0, 2, 128 << 10), PoolStats("indexer", 24, 24, 0, 0, 0, 0, 4096)])
    header, rule, kv, indexer = table.splitlines()
    assert header.split() == ["pool", "page", "slots", "ready", "filling", "free", "claimed", "DRAM", "used"]
    assert kv.split() == ["kv", "128KiB", "24", "16", "0", "8", "2", "2MiB"]
    assert indexer.split()[:2] == ["indexer", "4KiB"] and "PoolStats(" not in table
    assert len({len(line) for line in (header, rule)}) == 1


def test_numbers_are_right_aligned_and_text_left_aligned():
    lines = text_table(("name", "n"), [("a", 5), ("longer", 123)]).splitlines()
    assert lines[2] == "a" + " " * 9 + "5" and lines[3] == "longer  123"


def test_counters_show_only_what_happened():
    assert counter_table({"kvcr_pages_total{outcome=ok,path=backup}": 4.0, "idle": 0.0}).splitlines()[2].split() == [
        "kvcr_pages_total{outcome=ok,path=backup}",
        "4",
    ]
    assert counter_table({}) == "(no counts yet)"
