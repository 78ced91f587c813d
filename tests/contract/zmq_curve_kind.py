"""The ZMQ control channel with CURVE (a shared cluster token) for the contract suite (marker ``zmq``).

Same sockets as ``zmq_kind``; every channel holds the same token, so the whole contract also holds
over authenticated, encrypted connections.
"""

from kvcr.adapters.zmq import ZmqControlChannel
from tests.contract.zmq_kind import free_port

TOKEN = b"contract-suite-cluster-token-0123"


class Kind:
    def make_control(self, port):
        del port  # see zmq_kind: fixed hints may be taken on a shared machine
        return ZmqControlChannel("127.0.0.1", free_port(), token=TOKEN)
