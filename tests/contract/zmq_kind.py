"""The ZMQ control-channel kind for the contract suite (marker ``zmq``): real sockets on loopback.

Servers bind ports this kind picks free on 127.0.0.1 instead of the suite's fixed hints
(41001..41007), so two test runs on one machine cannot collide. It never hands out 41999, the
port the "nobody listening" contract test dials.
"""

from kvcr.adapters.zmq import ZmqControlChannel
from tests.support import free_port as any_free_port

NOBODY_LISTENS = 41999  # dialled by test_nobody_listening_is_peer_unavailable


def free_port(avoid=(NOBODY_LISTENS,)):
    """A loopback TCP port nothing listens on right now (never the one the contract dials)."""
    while True:
        port = any_free_port()
        if port not in avoid:
            return port


class Kind:
    def make_control(self, port):
        del port  # a fixed hint may be taken on a shared machine; see the module docstring
        return ZmqControlChannel("127.0.0.1", free_port())
