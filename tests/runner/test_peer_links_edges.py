"""SourceLinks at its edges: the side link a data plane may offer, RELEASE routing, forget, and rates.

The control channel and data plane are scripted fakes: the control channel answers HELLO and LEASE
and records every frame; the side plane (a data plane offering ``side_request``/``side_send``, as
the same-host plane does) answers over its side link and records what went over it.
"""

from __future__ import annotations

from kvcr.adapters.local import InMemoryMetrics
from kvcr.adapters.mock.clock import FakeClock
from kvcr.domain.deadlines import Timing
from kvcr.ports.dataplane import PeerInfo
from kvcr.ports.errors import PeerUnavailable
from kvcr.runner import protocol
from kvcr.runner.peer_links import SIDE_LEASE_PAGES, Link, SourceLinks
from kvcr.runner.protocol import Hello, HelloReply, Lease, LeaseReply, PoolWire, Release
from tests.support import kv_pool

NAMESPACE = "ns-kv"
FAR = 1e12  # a deadline that never bites (the fake clock does not move unless told)
CONTROL_SESSION = 7
SIDE_SESSION = 9


class Control:
    """Answers HELLO (session 7) and LEASE (lease 41) and records every frame, decoded."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.requests: list[tuple[str, object, float]] = []
        self.sent: list[tuple[str, object]] = []
        self.forgotten: list[str] = []
        self.incarnation = "a-1"
        self.takes_s = 0.0  # how far the clock moves while a request is answered

    def request(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        message = protocol.decode(payload)
        self.requests.append((endpoint, message, timeout_s))
        self.clock.advance(self.takes_s)
        if isinstance(message, Lease):
            return protocol.encode(LeaseReply(message.nonce, 41, 1000, [[1]], [[b""]]))
        assert isinstance(message, Hello)
        pool = PoolWire(0, "kv", NAMESPACE, [1, 2], [256, 256], 16)
        plane = f"{endpoint}@{self.incarnation}".encode()
        return protocol.encode(HelloReply(message.nonce, CONTROL_SESSION, self.incarnation, plane, [pool], 10_000))

    def send(self, endpoint: str, payload: bytes) -> None:
        self.sent.append((endpoint, protocol.decode(payload)))

    def forget(self, endpoint: str) -> None:
        self.forgotten.append(endpoint)


class Plane:
    """A data plane without a side link; records disconnects, and can fail them."""

    name = "target-plane"

    def __init__(self) -> None:
        self.disconnected: list[str] = []
        self.disconnect_fails = False

    def peer_name(self, description: bytes) -> str:
        return description.decode()

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        return PeerInfo(description.decode(), late_writes=False)

    def disconnect(self, peer: str) -> None:
        self.disconnected.append(peer)
        if self.disconnect_fails:
            raise PeerUnavailable(f"{peer} already gone")


class SidePlane(Plane):
    """A data plane whose peer link also carries control frames (a ``SideChannel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, object, float]] = []
        self.sent: list[tuple[str, object]] = []
        self.has_link = True
        self.send_ok = True
        self.wrong_nonce = False
        self.incarnation: str | None = None  # None: the same process as the control channel answered for

    def serve_side(self, handler: object) -> None:
        pass

    def side_request(self, peer: str, payload: bytes, timeout_s: float) -> bytes | None:
        if not self.has_link:
            return None
        message = protocol.decode(payload)
        self.requests.append((peer, message, timeout_s))
        nonce = b"\1" * 16 if self.wrong_nonce else message.nonce  # type: ignore[union-attr]
        if isinstance(message, Lease):
            return protocol.encode(LeaseReply(nonce, 42, 1000, [[3]], [[b""]]))
        incarnation = self.incarnation or peer.split("@")[1]
        return protocol.encode(HelloReply(nonce, SIDE_SESSION, incarnation, b"", [], 10_000))

    def side_send(self, peer: str, payload: bytes) -> bool:
        self.sent.append((peer, protocol.decode(payload)))
        return self.send_ok


def make(plane: Plane, timing: Timing | None = None):
    clock, metrics = FakeClock(), InMemoryMetrics(strict=True)
    control = Control(clock)
    links = SourceLinks(
        control,  # type: ignore[arg-type]
        plane,  # type: ignore[arg-type]
        clock,
        metrics,
        timing=timing or Timing(),
        namespaces={"kv": NAMESPACE},
        specs={"kv": kv_pool(256)},
        landing="auto",
        max_links=8,
        link_idle_s=300.0,
    )
    return links, control, clock


def lease(session: int) -> tuple[Lease, bytes]:
    nonce = bytes(range(16))
    return Lease(nonce, session, 1000, [(0, ["p0"])]), nonce


# --- the side HELLO


def test_a_side_plane_link_says_hello_over_the_side_link_and_keeps_its_session():
    side = SidePlane()
    links, control, _ = make(side)
    link = links.get("a", FAR)
    assert link is not None
    assert link.session == CONTROL_SESSION and link.side_session == SIDE_SESSION
    [(peer, hello, timeout)] = side.requests
    assert peer == "a@a-1" == link.peer.name
    assert isinstance(hello, Hello)
    assert hello.sender == "target-plane" and hello.incarnation == links.incarnation
    assert hello.namespaces == {"kv": NAMESPACE} and len(hello.nonce) == protocol.NONCE_BYTES
    assert timeout == Timing().control_s
    [(_, control_hello, _)] = control.requests
    assert isinstance(control_hello, Hello) and control_hello.nonce != hello.nonce  # a fresh nonce each


def test_the_side_hello_is_bounded_by_what_is_left_of_the_deadline():
    side = SidePlane()
    links, _, clock = make(side)
    assert links.get("a", clock.now() + 0.1) is not None
    [(_, _, timeout)] = side.requests
    assert abs(timeout - 0.1) < 1e-9


def test_no_side_hello_once_the_deadline_has_passed():
    side = SidePlane()
    links, control, clock = make(side)
    control.takes_s = 0.2  # the control HELLO uses up the whole deadline
    link = links.get("a", clock.now() + 0.2)
    assert link is not None and link.side_session == 0 and side.requests == []


def test_a_side_hello_with_a_short_but_live_deadline_still_goes():
    """control_s stays below a second: a side HELLO with less than a second left is still tried."""
    side = SidePlane()
    links, _, _ = make(side, Timing(control_s=0.5))
    link = links.get("a", FAR)
    assert link is not None and link.side_session == SIDE_SESSION
    assert side.requests[0][2] == 0.5


def test_a_data_plane_without_a_side_link_gives_no_side_session():
    links, control, _ = make(Plane())
    link = links.get("a", FAR)
    assert link is not None and link.side_session == 0 and len(control.requests) == 1


def test_a_peer_without_a_side_link_gives_no_side_session():
    side = SidePlane()
    side.has_link = False
    links, _, _ = make(side)
    link = links.get("a", FAR)
    assert link is not None and link.side_session == 0


def test_a_side_reply_to_another_nonce_is_not_taken():
    side = SidePlane()
    side.wrong_nonce = True
    links, _, _ = make(side)
    link = links.get("a", FAR)
    assert link is not None and link.side_session == 0
    assert len(links) == 1  # the link itself stands: only the side session is missing


def test_a_side_reply_from_another_incarnation_is_not_taken():
    side = SidePlane()
    side.incarnation = "a-2"  # another process answers on the side link
    links, _, _ = make(side)
    link = links.get("a", FAR)
    assert link is not None and link.side_session == 0


# --- LEASE over the side link


def side_link():
    side = SidePlane()
    links, control, clock = make(side)
    link = links.get("a", FAR)
    assert link is not None and link.side_session == SIDE_SESSION
    side.requests.clear()
    control.requests.clear()
    return links, control, side, clock, link


def test_a_lease_under_the_side_session_goes_over_the_side_link():
    links, control, side, clock, link = side_link()
    request, nonce = lease(SIDE_SESSION)
    reply = links.call("a", request, nonce, clock.now() + 0.1, link)
    assert isinstance(reply, LeaseReply) and reply.lease_id == 42
    [(peer, sent, timeout)] = side.requests
    assert peer == link.peer.name and sent == request and abs(timeout - 0.1) < 1e-9
    assert control.requests == []


def test_a_lease_under_the_control_session_goes_over_the_control_channel():
    links, control, side, _, link = side_link()
    request, nonce = lease(CONTROL_SESSION)
    reply = links.call("a", request, nonce, FAR, link)
    assert isinstance(reply, LeaseReply) and reply.lease_id == 41
    assert side.requests == [] and [m for _, m, _ in control.requests] == [request]


def test_a_lease_without_its_link_goes_over_the_control_channel():
    links, control, side, _, _ = side_link()
    request, nonce = lease(SIDE_SESSION)
    reply = links.call("a", request, nonce, FAR)
    assert isinstance(reply, LeaseReply) and reply.lease_id == 41 and side.requests == []
    assert [m for _, m, _ in control.requests] == [request]


def test_a_side_lease_falls_back_to_the_control_channel_when_the_side_link_is_gone():
    links, control, side, _, link = side_link()
    side.has_link = False
    request, nonce = lease(SIDE_SESSION)
    reply = links.call("a", request, nonce, FAR, link)
    assert isinstance(reply, LeaseReply) and reply.lease_id == 41 and len(control.requests) == 1


def test_lease_session_picks_the_side_session_up_to_the_side_lease_size():
    peer = PeerInfo("p", late_writes=False)
    link = Link("a", CONTROL_SESSION, "a-1", peer, {}, False, 0.0, side_session=SIDE_SESSION)
    assert link.lease_session(1) == SIDE_SESSION
    assert link.lease_session(SIDE_LEASE_PAGES) == SIDE_SESSION
    assert link.lease_session(SIDE_LEASE_PAGES + 1) == CONTROL_SESSION
    plain = Link("a", CONTROL_SESSION, "a-1", peer, {}, False, 0.0)
    assert plain.lease_session(1) == CONTROL_SESSION


# --- RELEASE


def test_a_release_by_default_goes_under_the_control_session_over_the_control_channel():
    links, control, side, _, link = side_link()
    links.send_release(link, 5)
    assert control.sent == [("a", Release(CONTROL_SESSION, [5]))] and side.sent == []


def test_a_release_under_the_side_session_goes_over_the_side_link():
    links, control, side, _, link = side_link()
    links.send_release(link, 5, SIDE_SESSION)
    assert side.sent == [(link.peer.name, Release(SIDE_SESSION, [5]))] and control.sent == []


def test_a_side_release_that_cannot_go_over_the_side_link_goes_over_the_control_channel():
    links, control, side, _, link = side_link()
    side.send_ok = False
    links.send_release(link, 5, SIDE_SESSION)
    assert control.sent == [("a", Release(SIDE_SESSION, [5]))]


def test_without_a_side_plane_a_release_under_any_session_goes_over_the_control_channel():
    links, control, _ = make(Plane())
    peer = PeerInfo("a@a-1", late_writes=False)
    # side_session equal to the control session: nothing but the plane says there is no side link
    link = Link("a", CONTROL_SESSION, "a-1", peer, {}, False, 0.0, side_session=CONTROL_SESSION)
    links.send_release(link, 5)
    assert control.sent == [("a", Release(CONTROL_SESSION, [5]))]


def test_release_of_no_lease_sends_nothing():
    links, control, side, _, link = side_link()
    links.send_release(link, 0, SIDE_SESSION)
    assert control.sent == [] and side.sent == []


# --- forget, newer, mark_down


def test_forget_closes_both_halves_and_the_next_get_says_hello_again():
    plane = Plane()
    links, control, _ = make(plane)
    links.get("a", FAR)
    links.forget("a")
    assert plane.disconnected == ["a@a-1"] and control.forgotten == ["a"] and len(links) == 0
    assert links.get("a", FAR) is not None and len(control.requests) == 2


def test_forgetting_an_endpoint_without_a_link_is_harmless():
    plane = Plane()
    links, control, _ = make(plane)
    links.forget("nobody")
    assert plane.disconnected == [] and control.forgotten == [] and len(links) == 0


def test_a_relinked_source_of_the_same_incarnation_is_not_newer_and_a_failed_read_skips_it():
    links, control, _ = make(Plane())
    old = links.get("a", FAR)
    links.forget("a")
    again = links.get("a", FAR)
    assert old is not None and again is not None and again is not old
    assert links.newer(old) is None
    links.mark_down("a", "read failed", failed=old)
    assert links.get("a", FAR) is None and len(control.requests) == 2  # skipped: same process


def test_a_failed_disconnect_of_a_previous_incarnation_is_swallowed():
    plane = Plane()
    links, control, _ = make(plane)
    old = links.get("a", FAR)
    links.forget("a")
    control.incarnation = "a-2"
    new = links.get("a", FAR)
    assert old is not None and new is not None
    plane.disconnect_fails = True
    links.mark_down("a", "read failed", failed=old)
    assert plane.disconnected[-1] == "a@a-1" and links.get("a", FAR) is new


# --- rate


def test_an_empty_read_leaves_the_rate_estimate_alone():
    link = Link("a", 1, "a-1", PeerInfo("p", late_writes=False), {}, False, 0.0)
    link.learn_rate(1000, 1.0)
    link.learn_rate(0, 1.0)
    link.learn_rate(1000, 0.0)
    assert link.bytes_per_s == 1000.0
    link.learn_rate(2000, 1.0)
    assert abs(link.bytes_per_s - (0.7 * 1000 + 0.3 * 2000)) < 1e-9
