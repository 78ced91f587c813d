"""Every refusal in the domain says what was wrong in the operator's own terms (milliseconds, bytes, names).

The boundary values next to each refusal are accepted, so a rule that is off by one either way fails here.
"""

import pytest

from kvcr.domain.boundaries import trailing_boundaries
from kvcr.domain.deadlines import MAX_TIMEOUT_S, DeadlineBudget, Timing
from kvcr.domain.errors import ConfigError, EvidenceError, InvalidKeyError, LayoutError
from kvcr.domain.hints import Endpoint
from kvcr.domain.hits import PoolPresence, evidence_pools
from kvcr.domain.keys import (
    NamespaceSpec,
    ShardIdentity,
    check_pool_name,
    i64_to_u64,
    page_hash,
    page_hashes,
    u64_to_i64,
)
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.pools import HitPolicy, check_pool_set
from kvcr.domain.residency import IllegalTransition, SlotState, check_transition
from kvcr.domain.units import format_byte_size, parse_byte_size


def message(error, call, *args, **kwargs):
    with pytest.raises(error) as caught:
        call(*args, **kwargs)
    return str(caught.value)


# ---------------------------------------------------------------------------------------------- timings


@pytest.mark.parametrize(
    ("field", "setting"),
    [
        ("operation_s", "operation_timeout_ms"),
        ("abandon_s", "abandon_timeout_ms"),
        ("control_s", "control_timeout_ms"),
        ("connect_s", "connect_timeout_ms"),
        ("lease_s", "lease_ms"),
        ("retry_after_s", "peer_retry_ms"),
    ],
)
def test_a_timing_out_of_range_names_its_setting_in_milliseconds(field, setting):
    # (values print with %g: an hour is 3.6e+06 ms)
    assert message(ConfigError, Timing, **{field: 0.0}) == f"{setting} must be in (0, 3.6e+06] ms, got 0"
    assert message(ConfigError, Timing, **{field: -0.25}) == f"{setting} must be in (0, 3.6e+06] ms, got -250"
    assert message(ConfigError, Timing, **{field: 3600.5}) == f"{setting} must be in (0, 3.6e+06] ms, got 3.6005e+06"


def test_every_timing_may_be_exactly_one_hour():
    hour = MAX_TIMEOUT_S
    timing = Timing(operation_s=hour, abandon_s=hour, control_s=hour, connect_s=hour, lease_s=hour, retry_after_s=hour)
    assert timing.budget == DeadlineBudget(hour, hour)


def test_the_cross_field_timing_rules_show_both_values():
    assert message(ConfigError, Timing, operation_s=2.0, abandon_s=1.5) == (
        "abandon_timeout_ms (1500) must not be shorter than operation_timeout_ms (2000)"
    )
    assert message(ConfigError, Timing, operation_s=5.0, control_s=6.0) == (
        "control_timeout_ms (6000) must not exceed operation_timeout_ms (5000)"
    )
    assert message(ConfigError, Timing, lease_s=2.0, lease_margin_s=2.5) == (
        "lease_ms (2000) must be larger than its margin (2500)"
    )
    assert message(ConfigError, Timing, lease_s=2.0, lease_margin_s=2.0) == (
        "lease_ms (2000) must be larger than its margin (2000)"
    )
    assert message(ConfigError, Timing, lease_margin_s=-0.001) == "lease_ms (10000) must be larger than its margin (-1)"


def test_the_cross_field_timing_rules_accept_their_boundaries():
    Timing(operation_s=5.0, abandon_s=5.0)  # abandon may equal operation
    Timing(operation_s=5.0, control_s=5.0)  # one control round trip may take the whole operation
    assert Timing(lease_margin_s=0.0).lease_margin_s == 0.0  # no margin at all is allowed


def test_a_deadline_budget_shows_the_values_in_milliseconds():
    assert message(ConfigError, DeadlineBudget, -0.5, 1.0) == "operation_timeout_ms must be positive, got -500"
    assert message(ConfigError, DeadlineBudget, 2.0, 1.5) == (
        "abandon_timeout_ms (1500) must not be shorter than operation_timeout_ms (2000)"
    )
    assert DeadlineBudget(1.0, 1.0).start(3.0).abandon.at == 4.0


# ---------------------------------------------------------------------------------------------- byte sizes


def test_byte_size_errors_name_the_setting_and_the_value():
    assert message(ConfigError, parse_byte_size, "lots").startswith("size: ")  # the default name
    assert message(ConfigError, parse_byte_size, 1.5, name="dram_bytes") == (
        "dram_bytes: expected an int or a string like '8GiB', got float"
    )
    assert message(ConfigError, parse_byte_size, -1, name="dram_bytes") == "dram_bytes: must not be negative, got -1"
    huge = 1 << 100  # its size is shown, not its digits (a huge int's text is costly to make)
    assert message(ConfigError, parse_byte_size, huge, name="d") == "d: an integer of 101 bits is far too large"
    assert message(ConfigError, parse_byte_size, "1" * 31, name="d") == f"d: {'1' * 24!r}... is far too large"


def test_byte_sizes_at_the_limits_are_read_exactly_as_ints():
    assert parse_byte_size(0) == 0
    assert parse_byte_size(1 << 99) == 1 << 99  # 100 bits: the largest int accepted
    assert parse_byte_size("1" * 30) == int("1" * 30)  # 30 digits: the longest number accepted
    for text in ("1.5KiB", "0.5KiB", "3GB"):
        assert type(parse_byte_size(text)) is int


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (3 << 30, "3GiB"),
        (1 << 30, "1GiB"),
        (5 << 20, "5MiB"),
        (1 << 20, "1MiB"),
        (2048, "2KiB"),
        (1024, "1KiB"),
        (1536, "1536B"),
        (1000, "1000B"),
        (0, "0B"),
        ((1 << 30) + 1024, "1048577KiB"),
    ],
)
def test_byte_sizes_are_shown_in_the_largest_whole_binary_unit(nbytes, text):
    assert format_byte_size(nbytes) == text


# ---------------------------------------------------------------------------------------------- keys, layouts, pools


def test_key_errors_name_the_bad_value():
    assert message(InvalidKeyError, u64_to_i64, 1 << 64) == "18446744073709551616 is not an unsigned 64-bit integer"
    assert message(InvalidKeyError, i64_to_u64, 1 << 63) == "9223372036854775808 is not a signed 64-bit integer"
    assert message(InvalidKeyError, check_pool_name, "k v") == "pool name must match ^[A-Za-z0-9_.:-]{1,64}$, got 'k v'"
    assert message(InvalidKeyError, page_hash, [1 << 64]) == "token id 18446744073709551616 is outside [0, 2**64)"
    assert message(InvalidKeyError, page_hashes, [1, 2], 0) == "page_size must be positive, got 0"
    assert message(InvalidKeyError, ShardIdentity, 2, 2) == "tp_rank 2 is outside tp_size 2"
    assert message(InvalidKeyError, ShardIdentity, 0, 0) == "tp_rank 0 is outside tp_size 0"
    assert message(InvalidKeyError, NamespaceSpec, "", 4, "bf16", "page_first") == "namespace needs a model name"
    assert message(InvalidKeyError, NamespaceSpec, "m", 0, "bf16", "page_first") == (
        "namespace page_size must be positive, got 0"
    )
    assert message(InvalidKeyError, NamespaceSpec, "m", -1, "bf16", "page_first") == (
        "namespace page_size must be positive, got -1"
    )


def test_the_smallest_legal_keys_and_shards_are_accepted():
    assert NamespaceSpec("m", 1, "bf16", "page_first").page_size == 1
    assert ShardIdentity(0, 1).digest_terms() == ["tp", 0, 1]
    assert u64_to_i64((1 << 64) - 1) == -1 and i64_to_u64(-(1 << 63)) == 1 << 63


def test_layout_errors_name_the_region_or_component():
    assert message(LayoutError, ComponentSpec, "", 8) == "component label must not be empty"
    assert message(LayoutError, RegionDescriptor, "", 0, 8, 1, 8) == "region label must not be empty"
    assert message(LayoutError, RegionDescriptor, "r", -1, 8, 1, 8) == "region 'r': base must not be negative"
    assert message(LayoutError, RegionDescriptor, "r", 0, 8, 1, 0) == "region 'r': piece_bytes must be positive, got 0"
    assert message(LayoutError, RegionDescriptor, "r", 0, 8, 0, 8) == "region 'r': count must be positive, got 0"
    assert message(LayoutError, RegionDescriptor, "r", 0, 4, 2, 8) == (
        "region 'r': stride 4 is smaller than piece_bytes 8, so its own pieces overlap"
    )
    assert message(LayoutError, check_pool_set, []) == "at least one pool is required"
    assert message(LayoutError, trailing_boundaries, [True], 0) == "trailing window must be positive, got 0"


def test_an_endpoint_needs_its_scheme_unless_told_otherwise():
    assert message(ValueError, Endpoint.parse, "h:1") == "endpoint 'h:1' must start with tcp://"


def test_the_smallest_legal_regions_are_accepted():
    assert RegionDescriptor("r", 0, 1, 4, 1).span == 4  # one-byte pieces
    assert RegionDescriptor("r", 0, 0, 1, 8).span == 8  # a single piece needs no stride


def test_state_and_evidence_errors_say_what_was_refused():
    assert message(IllegalTransition, check_transition, SlotState.FREE, SlotState.READY) == (
        "slot cannot go from free to ready"
    )
    logical = PoolPresence("kv", HitPolicy.ALL_PAGES, [], physical=False)
    assert message(EvidenceError, evidence_pools, [logical]) == (
        "query names no physical all_pages pool; a logical anchor alone is no evidence"
    )
