"""Each way a hint is refused has its own counter code and its own log reason; endpoints at their limits."""

from collections.abc import Mapping

import pytest

from kvcr.domain.hints import MAX_BLOCK_HASHES, Endpoint, Rejection, parse_hint

R = Rejection


def envelope(protocol="0.1", action_version="1.0", **payload_changes):
    payload = {"source_control_endpoint": "tcp://10.0.0.1:25000", "block_hashes": [1, 2]}
    payload.update(payload_changes)
    return {
        "protocol_version": protocol,
        "message_id": "m",
        "actions": [{"action_type": "kv.fetch", "action_version": action_version, "payload": payload}],
    }


class Unreadable(Mapping):
    """A user-supplied mapping that fails when asked for a key (the parser's defensive branch)."""

    def __getitem__(self, key):
        raise TypeError("no")

    def __contains__(self, key):
        raise TypeError("no")

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0


@pytest.mark.parametrize(
    ("raw", "code", "reason"),
    [
        (None, R.NO_HINT, "no hint"),
        ("{not json", R.NOT_JSON, "hint is not valid JSON"),
        (b"\xff\xfe", R.NOT_JSON, "hint is not valid JSON"),
        ("[1]", R.NOT_OBJECT, "hint must be an object"),
        (Unreadable(), R.UNREADABLE, "hint unreadable: TypeError"),
        ({"hello": 1}, R.NOT_ENVELOPE, "not a hint envelope"),
        ({"actions": []}, R.PROTOCOL_VERSION, "unsupported protocol_version"),
        ({"protocol_version": "0.1"}, R.NOT_ENVELOPE, "actions must be a list"),
        ({"protocol_version": "0.1", "message_id": 5, "actions": []}, R.NOT_ENVELOPE, "message_id must be a string"),
        ({"protocol_version": "0.1", "actions": [{"action_type": "x"}]}, R.NO_FETCH_ACTION, "no kv.fetch action"),
        (envelope(protocol="1.0"), R.PROTOCOL_VERSION, "unsupported protocol_version"),
        (envelope(protocol="x.0"), R.PROTOCOL_VERSION, "unsupported protocol_version"),
        (envelope(action_version="2.0"), R.ACTION_VERSION, "unsupported kv.fetch action_version"),
        (envelope(action_version=""), R.ACTION_VERSION, "unsupported kv.fetch action_version"),
        (
            {
                "protocol_version": "0.1",
                "actions": [{"action_type": "kv.fetch", "action_version": "1.0", "payload": 3}],
            },
            R.BAD_PAYLOAD,
            "payload must be an object",
        ),
        (envelope(source_control_endpoint=None), R.BAD_ENDPOINT, "no source_control_endpoint"),
        (envelope(source_control_endpoint="h:1"), R.BAD_ENDPOINT, "bad source_control_endpoint"),
        (envelope(block_hashes=[]), R.BAD_HASHES, "block_hashes must be a non-empty list"),
        (envelope(block_hashes=[1.0]), R.BAD_HASHES, "block_hashes must hold integers"),
        (envelope(block_hashes=[1 << 64]), R.BAD_HASHES, "block hash outside the 64-bit range"),
        (envelope(mode="move"), R.UNSUPPORTED_MODE, "unsupported mode"),
        (envelope(no_retain=1), R.BAD_PAYLOAD, "no_retain must be a boolean"),
        ({"source_control_endpoint": "h:1"}, R.BAD_HASHES, "block_hashes must be a non-empty list"),
        ({"block_hashes": [1]}, R.BAD_ENDPOINT, "no source_control_endpoint"),
    ],
)
def test_each_refusal_has_its_code_and_reason(raw, code, reason):
    parsed = parse_hint(raw)
    assert (parsed.hint, parsed.code, parsed.reason) == (None, code, reason)


def test_a_usable_hint_has_no_code_and_no_reason():
    parsed = parse_hint(envelope())
    assert parsed.usable and (parsed.code, parsed.reason) == (None, None)


def test_minor_and_patch_versions_are_free():
    assert parse_hint(envelope(protocol="0.1.2", action_version="1.9.3")).usable
    assert parse_hint(envelope(protocol="0", action_version="1")).usable


def test_no_retain_is_false_unless_the_hint_says_true():
    assert parse_hint(envelope()).hint.no_retain is False
    assert parse_hint(envelope(no_retain=False)).hint.no_retain is False
    assert parse_hint(envelope(no_retain=True)).hint.no_retain is True


def test_a_bare_legacy_payload_needs_no_scheme_and_an_envelope_does():
    legacy = parse_hint({"source_control_endpoint": "10.0.0.1:25000", "block_hashes": [9]})
    assert legacy.usable and legacy.hint.source == Endpoint("10.0.0.1", 25000) and legacy.hint.message_id is None
    assert not parse_hint(envelope(source_control_endpoint="10.0.0.1:25000")).usable


def test_the_full_64_bit_range_of_hashes_and_exactly_the_cap_are_accepted():
    edges = parse_hint(envelope(block_hashes=[-(1 << 63), (1 << 64) - 1]))
    assert edges.hint.block_hashes == frozenset({1 << 63, (1 << 64) - 1})
    assert len(parse_hint(envelope(block_hashes=list(range(MAX_BLOCK_HASHES)))).hint.block_hashes) == MAX_BLOCK_HASHES
    over = parse_hint(envelope(block_hashes=list(range(MAX_BLOCK_HASHES + 1))))
    assert (over.code, over.reason) == (R.BAD_HASHES, f"block_hashes has more than {MAX_BLOCK_HASHES} entries")


# ---------------------------------------------------------------------------------------------- endpoints


@pytest.mark.parametrize(
    ("text", "require_scheme", "message"),
    [
        (5, True, "endpoint must be a string"),
        ("h:1", True, "endpoint 'h:1' must start with tcp://"),
        ("tcp://[::1]5", True, "endpoint 'tcp://[::1]5' has no port"),
        ("tcp://h", True, "endpoint 'tcp://h' is not host:port"),
        ("tcp://-h:1", True, "endpoint 'tcp://-h:1' is not host:port"),
        ("tcp://h:x", True, "endpoint 'tcp://h:x' has no numeric port"),
        ("tcp://h:000001", True, "endpoint 'tcp://h:000001' has no numeric port"),
        ("tcp://0.0.0.0:1", True, "endpoint host '0.0.0.0' is not dialable"),
        ("tcp://h:0", True, "endpoint port 0 is outside 1..65535"),
        ("tcp://h:65536", True, "endpoint port 65536 is outside 1..65535"),
        ("tcp://[::1]:9]:7", True, "endpoint 'tcp://[::1]:9]:7' has no numeric port"),  # the first "]:" ends the host
        ("tcp://a.b:1:2", True, "endpoint 'tcp://a.b:1:2' is not host:port"),  # the last ":" starts the port
    ],
)
def test_an_undialable_endpoint_is_refused_saying_why(text, require_scheme, message):
    with pytest.raises(ValueError) as caught:
        Endpoint.parse(text, require_scheme=require_scheme)
    assert str(caught.value) == message


def test_endpoints_at_the_limits_parse():
    assert Endpoint.parse("tcp://h:65535").port == 65535
    assert Endpoint.parse("tcp://h:00001").port == 1  # five digits at most, leading zeros allowed
    assert Endpoint.parse("h:7", require_scheme=False) == Endpoint("h", 7)
    assert Endpoint.parse("tcp://[fe80::1]:9") == Endpoint("fe80::1", 9)


def test_the_allowlist_keeps_the_allowed_holders_in_order_and_refuses_a_hint_with_none():
    from types import SimpleNamespace

    from kvcr.adapters.local import InMemoryMetrics
    from kvcr.integrations.sglang.hints import HintReader
    from kvcr.integrations.shared.settings import KvcrSettings

    env = envelope()
    for host in ("10.0.0.2", "10.0.0.3"):
        payload = {"source_control_endpoint": f"tcp://{host}:25000", "block_hashes": [1]}
        env["actions"].append({"action_type": "kv.fetch", "action_version": "1.0", "payload": payload})
    reader = HintReader(KvcrSettings(peer_allowlist=("10.0.0.3", "10.0.0.2")), InMemoryMetrics(strict=True))
    hint = reader.read(SimpleNamespace(extra_info={"kv_hints": env}))
    assert [str(h.source) for h in hint.holders] == ["tcp://10.0.0.2:25000", "tcp://10.0.0.3:25000"]
    none = HintReader(KvcrSettings(peer_allowlist=("10.9.9.9",)), InMemoryMetrics(strict=True))
    assert none.read(SimpleNamespace(extra_info={"kv_hints": env})) is None
    assert none.rejected == {"source_not_allowed": 1}
