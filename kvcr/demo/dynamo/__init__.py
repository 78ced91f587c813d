"""The Dynamo demo worker: tooling over the product's Dynamo integration, never imported by it.

- ``worker`` (``worker_settings``, ``worker_model``): a Dynamo worker (``python -m
  kvcr.demo.dynamo.worker``, also ``kvcr worker``) on Dynamo's backend API, over SGLang's host pool
  and controller with kvcr as L3 and a stand-in model (a fixed token stream).
- ``deployment`` (``tiny_model``): Dynamo's frontend and such workers on one machine (the demo and
  the end-to-end tests start it).

The product pieces these use (capability, hint forwarding, the hint producer, the SGLang handler)
live in ``kvcr.integrations.dynamo``.
"""
