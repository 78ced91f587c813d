"""kvcr: a KV-cache reuse runner for LLM serving.

kvcr keeps the KV pages an engine (SGLang HiCache) backs up in DRAM that kvcr owns, restores
them locally, and serves them to peer replicas over a one-sided data plane (NIXL) under leases.
The package is layered: ``domain`` (pure) <- ``ports`` <- ``runner`` <- ``adapters`` /
``integrations``; ``container`` is the only composition root.
"""

__version__ = "0.1.0"
# Read by kvcr.compat: NVIDIA's KV Cache Runner (PyPI `kvcr`) installs a `kvcr/__init__.py` too.
__distribution__ = "kvcr-runner"
