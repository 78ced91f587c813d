"""ZMQ adapters: the peer control channel (ROUTER/DEALER request-reply).

This folder will also hold the KV-event publisher socket. pyzmq is imported only when an adapter
is constructed, so importing this package needs no pyzmq.
"""

from kvcr.adapters.zmq.control import ZmqControlChannel

__all__ = ["ZmqControlChannel"]
