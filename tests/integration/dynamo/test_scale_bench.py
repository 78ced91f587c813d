"""``kvcr bench scale`` measures what it says: the KV events kvcr sends the router, and the hints it gets."""

from __future__ import annotations

import pytest

from kvcr.demo.scale import ScaleOptions, run_scale, scale_table

pytestmark = [pytest.mark.multiprocess, pytest.mark.nixl, pytest.mark.timeout(240)]


def test_a_small_fleet_reports_the_events_the_router_receives(tmp_path):
    result = run_scale(ScaleOptions(workers=2, requests=24, concurrency=4, prefixes=4, workdir=str(tmp_path)))
    assert result.answered == 24 and result.failed == 0
    # every computed page is backed up into kvcr DRAM and announced (restored ones are announced too)
    assert result.total("stored_blocks") * 16 >= result.computed_tokens > 0
    assert result.total("messages") >= 2 and result.total("wire_bytes") > 0
    # a stored block carries its hash, its parent and its 16 tokens: tens of bytes, not a kilobyte
    assert 20 < result.bytes_per_stored_block < 1000
    assert result.bytes_per_prefill_token == result.total("wire_bytes") / result.computed_tokens
    assert len(result.hint_bytes) == result.hints and all(size > 100 for size in result.hint_bytes)
    assert "bytes per prefill token" in scale_table(result)
