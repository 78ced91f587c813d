"""SourceLinks on its own: the link cache's bounds, down-time, and which replies it acts on.

The control channel and data plane here are scripted: the test writes each source's reply to a
HELLO and records what the links close, so each rule is seen without a peer server behind it.
"""

from __future__ import annotations

from kvcr.adapters.local import InMemoryMetrics
from kvcr.adapters.mock.clock import FakeClock
from kvcr.domain.deadlines import Timing
from kvcr.ports.dataplane import PeerInfo
from kvcr.runner import protocol
from kvcr.runner.peer_links import SourceLinks
from kvcr.runner.protocol import HelloReply, PoolWire, RefusalCode, Refused
from tests.support import kv_pool

NAMESPACE = "ns-kv"
FAR = 1e12  # a deadline that never bites (the fake clock does not move unless told)


def wire(pieces=(256, 256), namespace=NAMESPACE) -> PoolWire:
    return PoolWire(0, "kv", namespace, [1, 2], list(pieces), 16)


class ScriptedControl:
    """Answers each request with ``answer(endpoint, decoded request)``; records what it is told to forget."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.forgotten: list[str] = []
        self.incarnation = {"a": "a-1"}
        self.pieces = (256, 256)
        self.wrong_nonce = False
        self.refuse: int | None = None
        self.plane: dict[str, str] = {}  # endpoint -> the data-plane name its source claims (default: its own)

    def answer(self, endpoint: str, request: object) -> bytes:
        nonce = b"\0" * 16 if self.wrong_nonce else request.nonce  # type: ignore[attr-defined]
        if self.refuse is not None:
            return protocol.encode(Refused(nonce, self.refuse))
        incarnation = self.incarnation.get(endpoint, f"{endpoint}-1")
        plane = self.plane.get(endpoint, f"{endpoint}@{incarnation}").encode()
        return protocol.encode(HelloReply(nonce, 7, incarnation, plane, [wire(self.pieces)], 10_000))

    def request(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        self.requests.append(endpoint)
        return self.answer(endpoint, protocol.decode(payload))

    def send(self, endpoint: str, payload: bytes) -> None:
        pass

    def forget(self, endpoint: str) -> None:
        self.forgotten.append(endpoint)


class RecordingPlane:
    name = "mock"

    def __init__(self) -> None:
        self.disconnected: list[str] = []

    def peer_name(self, description: bytes) -> str:
        return description.decode().partition("|")[0]  # "name|anything else the description says"

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        return PeerInfo(self.peer_name(description), late_writes=False)

    def disconnect(self, peer: str) -> None:
        self.disconnected.append(peer)


def links(max_links: int = 8, link_idle_s: float = 300.0):
    control, plane, clock, metrics = ScriptedControl(), RecordingPlane(), FakeClock(), InMemoryMetrics(strict=True)
    made = SourceLinks(
        control,  # type: ignore[arg-type]
        plane,  # type: ignore[arg-type]
        clock,
        metrics,
        timing=Timing(),
        namespaces={"kv": NAMESPACE},
        specs={"kv": kv_pool(256)},
        landing="auto",
        max_links=max_links,
        link_idle_s=link_idle_s,
    )
    return made, control, plane, clock, metrics


def test_a_link_is_made_once_and_then_served_from_the_cache():
    source, control, _, _, _ = links()
    first = source.get("a", FAR)
    assert first is not None and first.session == 7 and set(first.pools) == {"kv"}
    assert source.get("a", FAR) is first
    assert control.requests == ["a"]


def test_beyond_max_links_the_least_recently_used_is_closed_both_halves():
    source, control, plane, _, _ = links(max_links=2)
    source.get("a", FAR)
    source.get("b", FAR)
    source.get("a", FAR)  # a is now the most recently used
    source.get("c", FAR)
    assert len(source) == 2
    assert plane.disconnected == ["b@b-1"] and control.forgotten == ["b"]
    assert source.get("a", FAR) is not None and control.requests == ["a", "b", "c"]


def test_idle_links_close_when_the_next_link_is_made():
    source, _, plane, clock, _ = links(link_idle_s=10.0)
    source.get("a", FAR)
    clock.advance(11.0)
    source.get("b", FAR)
    assert plane.disconnected == ["a@a-1"] and len(source) == 1


def test_a_reply_to_another_request_is_never_acted_on_and_the_source_is_skipped():
    source, control, _, clock, metrics = links()
    control.wrong_nonce = True
    assert source.get("a", FAR) is None
    counted = metrics.snapshot()
    assert counted["kvcr_failures_total{path=remote_restore,reason=unbound_reply}"] == 1
    control.wrong_nonce = False
    assert source.get("a", FAR) is None and control.requests == ["a"]  # skipped: not even dialled
    clock.advance(Timing().retry_after_s)
    assert source.get("a", FAR) is not None and control.requests == ["a", "a"]


def test_a_namespace_refusal_skips_the_source_but_an_unknown_session_does_not():
    source, control, _, _, _ = links()
    control.refuse = RefusalCode.UNKNOWN_SESSION
    assert source.get("a", FAR) is None
    control.refuse = None
    assert source.get("a", FAR) is not None  # dialled again at once
    control.refuse = RefusalCode.NAMESPACE
    assert source.get("b", FAR) is None
    control.refuse = None
    assert source.get("b", FAR) is None and control.requests == ["a", "a", "b"]


def test_a_source_pool_that_does_not_fit_ours_gives_no_link():
    source, control, _, _, _ = links()
    control.pieces = (128, 128)  # same names and namespace, other piece sizes
    assert source.get("a", FAR) is None and len(source) == 0
    control.pieces = (256, 256)
    assert source.get("a", FAR) is None  # skipped for retry_after_s like any failed source


def test_a_failed_read_of_a_previous_incarnation_leaves_its_successor_alone():
    source, control, plane, _, _ = links()
    old = source.get("a", FAR)
    source.forget("a")  # e.g. the next HELLO found the process restarted
    control.incarnation["a"] = "a-2"
    new = source.get("a", FAR)
    assert old is not None and new is not None and new.incarnation == "a-2"
    plane.disconnected.clear()
    source.mark_down("a", "read failed", failed=old)
    assert plane.disconnected == ["a@a-1"]  # only the old process's data-plane peer
    assert source.get("a", FAR) is new  # the new one is neither skipped nor dropped
    source.mark_down("a", "read failed", failed=new)
    assert source.get("a", FAR) is None and plane.disconnected[-1] == "a@a-2"


def test_a_source_claiming_a_data_plane_name_another_links_source_holds_is_refused_and_counted():
    """Issue 43: the name in a description is the source's choice; it stays bound to the first endpoint."""
    source, control, plane, clock, metrics = links()
    assert source.get("a", FAR) is not None
    control.plane["x"] = "a@a-1|x's own memory"  # x describes its plane under a's name
    assert source.get("x", FAR) is None
    assert metrics.snapshot()["kvcr_failures_total{path=remote_restore,reason=name_in_use}"] == 1
    assert plane.disconnected == []  # a's peer stays connected: nothing of x replaced it
    assert source.get("a", FAR) is not None and control.requests == ["a", "x"]  # a's link is the cached one
    source.forget("a")  # once a's link is gone the name is free again
    clock.advance(Timing().retry_after_s)
    assert source.get("x", FAR) is not None
    assert source.get("a", FAR) is None  # and now a is the one refused


def test_one_source_reached_at_two_endpoints_shares_its_peer_and_it_goes_with_the_last_link():
    """The same description under one name at two endpoints (two addresses of one source) changes nothing."""
    source, control, plane, _, _ = links()
    control.plane["a-by-ip"] = "a@a-1"
    assert source.get("a", FAR) is not None and source.get("a-by-ip", FAR) is not None
    source.forget("a")
    assert plane.disconnected == []  # a-by-ip still reads from it
    source.forget("a-by-ip")
    assert plane.disconnected == ["a@a-1"]


def test_a_source_at_the_same_endpoint_may_describe_the_same_name_again():
    source, control, plane, _, _ = links()
    assert source.get("a", FAR) is not None
    control.incarnation["a"] = "a-2"
    control.plane["a"] = "a@a-1"  # restarted, same plane name (a fixed name in a test, say)
    source.forget("a")
    assert source.get("a", FAR) is not None
    assert plane.disconnected == ["a@a-1"]
