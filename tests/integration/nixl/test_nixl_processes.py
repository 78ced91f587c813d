"""NIXL behaviour that needs other processes: tcp, frozen, killed and cut-off sources; nixl missing.

What each test pins down is measured in docs/nixl-behaviour.md (section 4).
"""

import contextlib
import signal
import time

import pytest

from tests.integration.nixl.support import Namespaces, plane_server, run_python

KIB = 1024
MIB = 1024 * KIB
TCP = {"UCX_TLS": "tcp"}

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]


@contextlib.contextmanager
def servers(*children):
    try:
        yield children
    finally:
        for child in children:
            child.close()


def source_and_target(env=None, pieces=32, piece=64 * KIB, **kw):
    source = plane_server("source", **{**(env or {}), **kw.get("source", {})})
    target = plane_server("target", **{**(env or {}), **kw.get("target", {})})
    src = source.ask("region", label="arena", count=pieces, piece=piece, seed=3, exposed=True)
    dst = target.ask("region", label="dst", count=pieces, piece=piece, exposed=False)
    return source, target, src["id"], dst["id"]


def test_no_warning_for_a_tcp_transport_and_peers_over_it_have_late_writes():
    report, done = run_python(
        """
        import json, logging
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
        from kvcr.adapters.nixl import NixlDataPlane
        plane = NixlDataPlane("tcp-only", backend_params={"ucx_devices": "lo"})
        report = plane.transport_report
        print(json.dumps({"zero_copy": report.zero_copy, "causes": report.causes, "tls": report.ucx_tls}))
        plane.close()
        """,
        **TCP,
    )
    assert report["zero_copy"] is False and report["tls"] == "tcp"
    assert any("UCX_TLS=tcp" in cause for cause in report["causes"])
    assert "WARNING kvcr" not in done.stderr  # the report is there on request; construction says nothing
    source, target, s, d = source_and_target(TCP)
    with servers(source, target):
        peer = target.ask("connect", description=source.ask("describe")["description"])
        assert peer["late_writes"] is True
        read = target.ask("read", peer="source", runs=[[s, 0, d, 0, 32]])
        assert target.ask("wait", handle=read["handle"])["state"] == "done"
        assert target.ask("digest", label="dst") == source.ask("digest", label="arena")


def test_a_frozen_source_fails_connect_within_its_timeout_and_connects_once_resumed():
    source, target, s, d = source_and_target()
    with servers(source, target):
        description = source.ask("describe")["description"]
        source.signal(signal.SIGSTOP)  # before any wire-up: the first READ needs it to answer
        start = time.monotonic()
        refused = target.ask("connect", description=description, timeout=1.0, may_fail=True)
        assert "did not answer" in refused["error"] and time.monotonic() - start < 2.0
        source.signal(signal.SIGCONT)
        assert target.ask("connect", description=description, timeout=5.0)["late_writes"] is False
        read = target.ask("read", peer="source", runs=[[s, 0, d, 0, 32]])
        assert target.ask("wait", handle=read["handle"])["state"] == "done"


@pytest.mark.parametrize("env", [{}, TCP], ids=["cma", "tcp"])
def test_a_killed_source_is_a_prompt_failure(env):
    source, target, s, d = source_and_target(env)
    with servers(source, target):
        target.ask("connect", description=source.ask("describe")["description"])
        source.signal(signal.SIGKILL)
        source.proc.wait(timeout=10)
        time.sleep(0.1)  # the target's progress thread sees the socket close
        start = time.monotonic()
        read = target.ask("read", peer="source", runs=[[s, 0, d, 0, 32]], may_fail=True)
        if "error" in read:
            assert "PeerUnavailable" in read["error"]
        else:
            assert target.ask("wait", handle=read["handle"], timeout=5.0)["state"] == "failed"
        assert time.monotonic() - start < 1.0


def test_a_frozen_tcp_source_leaves_the_read_uncertain_and_it_lands_after_the_resume():
    source, target, s, d = source_and_target(TCP, pieces=64)
    with servers(source, target):
        assert target.ask("connect", description=source.ask("describe")["description"])["late_writes"]
        source.signal(signal.SIGSTOP)
        read = target.ask("read", peer="source", runs=[[s, 0, d, 0, 64]])
        handle = read["handle"]
        time.sleep(1.0)
        assert target.ask("poll", handle=handle)["state"] == "pending"  # no error from a frozen peer
        assert target.ask("cancel", handle=handle)["state"] == "uncertain"
        target.ask("disconnect", peer="source")
        assert "KvcrError" in target.ask("release", handle=handle, may_fail=True)["error"]
        target.ask("fill", label="dst", byte=0xAB)
        source.signal(signal.SIGCONT)
        assert target.ask("wait", handle=handle, timeout=20.0)["state"] == "done"
        # It landed after kvcr gave up: why such peers are read into kvcr's own staging memory.
        assert target.ask("digest", label="dst") == source.ask("digest", label="arena")
        target.ask("release", handle=handle)
        assert source.proc.poll() is None and target.proc.poll() is None


@pytest.mark.parametrize("env", [{}, TCP], ids=["cma", "tcp"])
def test_a_cut_link_between_two_namespaces(env):
    """Source and target in two network namespaces; the veth link goes down during a read."""
    with Namespaces(f"kvn{len(env)}") as ns:
        source, target, s, d = source_and_target(
            env,
            pieces=64,
            source={"prefix": ns.exec(ns.a), "UCX_NET_DEVICES": ns.va},
            target={"prefix": ns.exec(ns.b), "UCX_NET_DEVICES": ns.vb},
        )
        with servers(source, target):
            peer = target.ask("connect", description=source.ask("describe")["description"])
            ns.link(up=False)
            read = target.ask("read", peer="source", runs=[[s, 0, d, 0, 64]])
            handle = read["handle"]
            if not peer["late_writes"]:
                # CMA between namespaces of one host: the bytes do not cross the link at all.
                assert target.ask("wait", handle=handle, timeout=5.0)["state"] == "done"
            else:
                time.sleep(1.0)
                assert target.ask("poll", handle=handle)["state"] == "pending"
                assert target.ask("cancel", handle=handle)["state"] == "uncertain"
                ns.link(up=True)
                assert target.ask("wait", handle=handle, timeout=30.0)["state"] == "done"
            ns.link(up=True)
            target.ask("release", handle=handle)
            again = target.ask("read", peer="source", runs=[[s, 0, d, 0, 64]])  # no reconnect needed
            assert target.ask("wait", handle=again["handle"], timeout=30.0)["state"] == "done"
            assert target.ask("digest", label="dst") == source.ask("digest", label="arena")


def test_the_package_imports_without_nixl_and_says_so_when_built():
    refused, _ = run_python(
        """
        import json, sys
        sys.modules["nixl"] = None  # as if it were not installed
        import kvcr.adapters.nixl as adapter
        from kvcr.ports.errors import TransportError
        assert "nixl._api" not in sys.modules
        try:
            adapter.NixlDataPlane("x")
        except TransportError as exc:
            print(json.dumps({"refused": str(exc)}))
        """
    )
    assert refused["refused"].startswith("NIXL is not installed")
