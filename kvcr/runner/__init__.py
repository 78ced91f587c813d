"""The application core: the kvcr runner (DRAM tier, index, peer service) over domain + ports."""

from kvcr.runner.config import RunnerConfig
from kvcr.runner.runner import KvcrRunner, PoolStats, QueryResult, RunnerStats

__all__ = ["KvcrRunner", "PoolStats", "QueryResult", "RunnerConfig", "RunnerStats"]
