"""Imported once by the forkserver replicas are forked from: SGLang, torch and NIXL, nothing started.

No agent, socket or thread is created here (a forked child must own all of its own); only the
modules a replica needs are imported, so each fork starts in about a second.
"""

from kvcr.testing.sglang import prepare_environment

prepare_environment()

import nixl._api  # noqa: E402,F401
import sglang.srt.mem_cache.hicache_storage  # noqa: E402
import sglang.srt.mem_cache.pool_host.mha  # noqa: E402
import sglang.srt.mem_cache.storage.backend_factory  # noqa: E402,F401
import torch  # noqa: E402,F401

import kvcr.adapters.nixl  # noqa: E402
import kvcr.adapters.zmq  # noqa: E402
import kvcr.integrations.sglang  # noqa: E402
import kvcr.soak.replica  # noqa: E402,F401
