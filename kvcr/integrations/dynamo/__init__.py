"""Dynamo integration: inventory events, hint producer, worker capability and hint forwarding.

- ``events.DynamoInventorySink``: kvcr DRAM residency as Dynamo KV events (through a ZMQ PUB).
- ``page_tokens``: the page -> token ids registry the SGLang plugin fills at backup time.
- ``hints.HintProducer`` / ``BlockingHintProducer``: Dynamo's in-process SelectionService, fed by
  those events, asked for the ``kv.fetch@1.0`` hint of a request.
- ``capability``: publish ``router_hint_*`` on a worker's ModelRuntimeConfig (or as a worker's
  ``runtime_data``: ``hint_capability``); endpoint maps.
- ``forwarding.kv_hints_from_request``: a request's router hint as SGLang's ``kv_hints``.
- ``sglang_handler.forward_kv_hints``: the router's hint for Dynamo's own SGLang worker handler.

The demo worker (a stand-in model on Dynamo's backend API) and the one-machine deployment the
demo and tests start are tooling: ``kvcr.demo.dynamo``.

Importing this package imports neither ai-dynamo-runtime nor pyzmq nor SGLang; they are imported
when an object that needs them is built.
"""

from kvcr.integrations.dynamo.capability import control_endpoints_for, hint_capability, publish_hint_capability
from kvcr.integrations.dynamo.forwarding import kv_hints_from_request
from kvcr.integrations.dynamo.hints import BlockingHintProducer, HintProducer
from kvcr.integrations.shared.kv_events import MEDIUM, DynamoInventorySink
from kvcr.integrations.shared.page_tokens import PageTokenRegistry, default_registry

__all__ = [
    "MEDIUM",
    "BlockingHintProducer",
    "DynamoInventorySink",
    "HintProducer",
    "PageTokenRegistry",
    "control_endpoints_for",
    "default_registry",
    "hint_capability",
    "kv_hints_from_request",
    "publish_hint_capability",
]
