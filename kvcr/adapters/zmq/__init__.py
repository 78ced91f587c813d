"""ZMQ adapters: the peer control channel (ROUTER/DEALER request-reply and one-way messages,
CURVE-authenticated and encrypted when given the cluster token) and the KV-event publisher (a PUB
socket in Dynamo's wire format).

pyzmq (and msgpack) are imported only when an adapter is constructed, so importing this package
needs neither.
"""

from kvcr.adapters.zmq.control import ZmqControlChannel
from kvcr.adapters.zmq.events import ZmqEventPublisher

__all__ = ["ZmqControlChannel", "ZmqEventPublisher"]
