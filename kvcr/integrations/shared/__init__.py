"""What the SGLang and Dynamo integrations share, so neither imports the other.

- ``settings``: kvcr's backend settings, in the ``--hicache-storage-backend-extra-config`` form
  both the SGLang backend and the Dynamo worker read.
- ``hints_bridge``: carries a request's hint to the storage backend on the thread serving it.
- ``page_tokens`` / ``kv_events``: token capture for backed-up pages, and the KV-event sink that
  publishes kvcr DRAM residency in the wire format SGLang and Dynamo's router share.
"""
