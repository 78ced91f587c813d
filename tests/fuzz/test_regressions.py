"""What the fuzz suite found, pinned as plain tests (each one failed before its fix)."""

import pytest

from kvcr.runner import protocol
from kvcr.runner.protocol import Hello, Lease, RefusalCode, Refused
from tests.support import Cluster


@pytest.fixture
def source():
    cluster = Cluster()
    yield cluster.node("A")
    cluster.close()


@pytest.mark.parametrize("nonce", [b"\x00" * (1 << 20), b"short", b"", b"n" * 17])
def test_a_refusal_never_echoes_a_malformed_nonce(source, nonce):
    """A 1 MiB "nonce" came back in full in the refusal (1 MiB in, 1 MiB out): only 16-byte nonces are echoed."""
    namespaces = dict(source.runner.namespaces)
    requests = [
        (Hello(nonce, "x", "i", namespaces), RefusalCode.REPLAYED),  # a malformed nonce is never fresh
        (Hello(nonce, "x", "i", {"kv": "another"}), RefusalCode.NAMESPACE),
        (Hello(nonce, "x", "i", {f"p{i}": "" for i in range(100)}), RefusalCode.TOO_LARGE),
        (Lease(nonce, 12345, 1000, [(0, [])]), RefusalCode.UNKNOWN_SESSION),
    ]
    for request, code in requests:
        reply = source.server.handle(protocol.encode(request))
        assert len(reply) < 64
        assert protocol.decode(reply) == Refused(b"", int(code))
