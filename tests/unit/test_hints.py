import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcr.domain.hints import MAX_HOLDERS, Endpoint, parse_hint

H1, H2 = 8555385130606689895, 3500275532943567847


def envelope(**payload_changes):
    payload = {"source_control_endpoint": "tcp://10.0.0.1:25000", "block_hashes": [H1, H2]}
    payload.update(payload_changes)
    return {
        "protocol_version": "0.1",
        "message_id": "req-1",
        "actions": [{"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0", "payload": payload}],
    }


def test_envelope_as_dict_json_and_bytes():
    for raw in (envelope(), json.dumps(envelope()), json.dumps(envelope()).encode()):
        parsed = parse_hint(raw)
        assert parsed.usable, parsed.reason
        assert parsed.hint.source == Endpoint("10.0.0.1", 25000)
        assert parsed.hint.block_hashes == frozenset({H1, H2})
        assert parsed.hint.message_id == "req-1"
        assert parsed.hint.covers(H1) and not parsed.hint.covers(1)


def test_legacy_shapes():
    legacy = parse_hint({"source_control_endpoint": "tcp://h:1", "block_hashes": [5]})
    assert legacy.usable and legacy.hint.source == Endpoint("h", 1)
    wrapped = parse_hint({"kvcr_router_hint": {"source_control_endpoint": "h:2", "block_hashes": [6]}})
    assert wrapped.usable and wrapped.hint.source == Endpoint("h", 2) and wrapped.hint.block_hashes == {6}


def test_signed_event_hashes_name_the_same_pages_as_unsigned():
    parsed = parse_hint(envelope(block_hashes=[-1, 7]))
    assert parsed.hint.block_hashes == frozenset({(1 << 64) - 1, 7})


def test_other_actions_are_skipped_and_first_kv_fetch_used():
    env = envelope()
    env["actions"].insert(0, {"action_type": "kv.prefetch", "action_version": "9.0", "payload": {}})
    assert parse_hint(env).usable


def fetch(endpoint, hashes, version="1.0", **extra):
    payload = {"source_control_endpoint": endpoint, "block_hashes": hashes, **extra}
    return {"action_type": "kv.fetch", "action_version": version, "payload": payload}


def test_further_kv_fetch_actions_are_fallback_holders_in_order():
    env = envelope()
    env["actions"] += [fetch("tcp://10.0.0.2:25000", [H1]), fetch("tcp://10.0.0.3:25000", [H2])]
    hint = parse_hint(env).hint
    assert [str(h.source) for h in hint.holders] == [
        "tcp://10.0.0.1:25000",
        "tcp://10.0.0.2:25000",
        "tcp://10.0.0.3:25000",
    ]
    assert [h.block_hashes for h in hint.holders] == [frozenset({H1, H2}), frozenset({H1}), frozenset({H2})]
    assert hint.source == Endpoint("10.0.0.1", 25000)  # the first holder is still the hint's source


def test_a_further_holder_that_cannot_be_read_or_repeats_one_is_left_out():
    env = envelope()
    env["actions"] += [
        fetch("not an endpoint", [H1]),
        fetch("10.0.0.9:25000", [H1]),  # no tcp:// scheme, which an envelope's endpoints need
        fetch("tcp://10.0.0.2:25000", []),
        fetch("tcp://10.0.0.2:25000", [H1], version="2.0"),
        fetch("tcp://10.0.0.1:25000", [H1]),  # the first holder again
        fetch("tcp://10.0.0.2:25000", [H1], mode="move"),
        fetch("tcp://10.0.0.2:25000", [H1], no_retain=True),
        fetch("tcp://10.0.0.4:25000", [H2]),
    ]
    assert [str(h.source) for h in parse_hint(env).hint.holders] == ["tcp://10.0.0.1:25000", "tcp://10.0.0.4:25000"]


def test_holders_are_capped_and_a_bad_first_action_still_refuses_the_hint():
    env = envelope()
    env["actions"] += [fetch(f"tcp://10.0.1.{i}:25000", [H1]) for i in range(20)]
    assert len(parse_hint(env).hint.holders) == MAX_HOLDERS == 8
    bad_first = {**envelope(), "actions": [fetch("nope", [H1]), fetch("tcp://10.0.0.2:1", [H1])]}
    assert not parse_hint(bad_first).usable


def test_keeping_no_holder_leaves_no_hint():
    hint = parse_hint(envelope()).hint
    assert hint.keeping(()) is None
    assert hint.keeping(hint.holders) == hint


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "no hint"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be an object"),
        ({"hello": 1}, "not a hint envelope"),
        ({**envelope(), "protocol_version": "1.0"}, "protocol_version"),
        ({**envelope(), "protocol_version": 1}, "protocol_version"),
        ({**envelope(), "actions": {}}, "actions must be a list"),
        ({**envelope(), "actions": []}, "no kv.fetch"),
        ({**envelope(), "message_id": 5}, "message_id"),
        (envelope(block_hashes=[]), "non-empty"),
        (envelope(block_hashes="12"), "non-empty list"),
        (envelope(block_hashes=[True]), "integers"),
        (envelope(block_hashes=[1.5]), "integers"),
        (envelope(block_hashes=[1 << 64]), "64-bit"),
        (envelope(block_hashes=[-(1 << 63) - 1]), "64-bit"),
        (envelope(source_control_endpoint=None), "no source_control_endpoint"),
        (envelope(source_control_endpoint="10.0.0.1:25000"), "source_control_endpoint"),
        (envelope(source_control_endpoint="tcp://0.0.0.0:25000"), "source_control_endpoint"),
        (envelope(source_control_endpoint="tcp://*:25000"), "source_control_endpoint"),
        (envelope(source_control_endpoint="tcp://h:0"), "source_control_endpoint"),
        (envelope(source_control_endpoint="tcp://h:70000"), "source_control_endpoint"),
        (envelope(source_control_endpoint="tcp://h"), "source_control_endpoint"),
        (envelope(source_control_endpoint=12), "source_control_endpoint"),
        (envelope(mode="move"), "unsupported mode"),
        (envelope(no_retain="yes"), "no_retain"),
    ],
)
def test_malformed_hints_fail_closed_with_a_reason(raw, reason):
    parsed = parse_hint(raw)
    assert not parsed.usable
    assert reason in parsed.reason
    assert parsed.code is not None  # a closed-set code, what counters use


def test_rejection_reasons_never_carry_the_hint_text():
    secret = "tcp://attacker chosen " + "x" * 200 + ":1"
    parsed = parse_hint(envelope(source_control_endpoint=secret))
    assert "attacker" not in parsed.reason and len(parsed.reason) < 64


def test_action_version_major_is_checked():
    env = envelope()
    env["actions"][0]["action_version"] = "2.0"
    assert "action_version" in parse_hint(env).reason


def test_endpoints_parse_format_and_offset():
    ep = Endpoint.parse("tcp://node-1.example:32100")
    assert str(ep) == "tcp://node-1.example:32100"
    assert str(ep.offset(3)) == "tcp://node-1.example:32103"
    v6 = Endpoint.parse("tcp://[::1]:5")
    assert v6.host == "::1" and str(v6) == "tcp://[::1]:5"
    with pytest.raises(ValueError):
        Endpoint.parse("tcp://[::]:5")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
endpoints = st.one_of(
    st.text(max_size=20),
    st.builds(
        lambda h, p: f"tcp://{h}:{p}",
        st.sampled_from(["h", "0.0.0.0", "*", "[::1]", "a.b", ""]),
        st.integers(-5, 70000),
    ),
    json_values,
)
payloads = st.fixed_dictionaries(
    {},
    optional={
        "source_control_endpoint": endpoints,
        "block_hashes": st.one_of(st.lists(st.integers(-(1 << 65), 1 << 65), max_size=6), json_values),
        "mode": st.one_of(st.sampled_from(["copy", "move"]), json_values),
        "no_retain": st.one_of(st.booleans(), json_values),
    },
)
actions = st.fixed_dictionaries(
    {},
    optional={
        "action_type": st.one_of(st.just("kv.fetch"), json_values),
        "action_version": st.one_of(st.sampled_from(["1.0", "1.7", "2.0", ""]), json_values),
        "payload": st.one_of(payloads, json_values),
        "action_id": json_values,
    },
)
envelopes = st.fixed_dictionaries(
    {},
    optional={
        "protocol_version": st.one_of(st.sampled_from(["0.1", "0.9", "1.0", "x"]), json_values),
        "message_id": json_values,
        "actions": st.one_of(st.lists(st.one_of(actions, json_values), max_size=3), json_values),
    },
)
any_hint = st.one_of(
    envelopes,
    payloads,
    st.builds(lambda p: {"kvcr_router_hint": p}, st.one_of(payloads, json_values)),
    json_values,
    envelopes.map(lambda e: json.dumps(e, default=str)),
    st.binary(max_size=64),
)


@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_hint)
def test_fuzz_no_exception_escapes_and_results_are_consistent(raw):
    parsed = parse_hint(raw)
    if parsed.usable:
        assert parsed.reason is None
        assert parsed.hint.block_hashes and all(0 <= h < 1 << 64 for h in parsed.hint.block_hashes)
        assert 0 < parsed.hint.source.port < 65536
    else:
        assert isinstance(parsed.reason, str) and parsed.reason
