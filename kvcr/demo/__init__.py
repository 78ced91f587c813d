"""``kvcr demo``: the Dynamo topology (``cluster``); with ``--local-only``, one runner in one process (``local``)."""

from kvcr.demo.cluster import DemoOptions, run_cluster_demo
from kvcr.demo.local import run_local_demo

__all__ = ["DemoOptions", "run_cluster_demo", "run_local_demo"]
