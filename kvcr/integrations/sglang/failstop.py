"""Fail-stop: the last resort when SGLang's host pages may still be written by a read kvcr gave up on.

kvcr lands reads from peers whose transport cannot fence a given-up read in its own staging
memory, so this happens only with ``landing: direct`` (or a transport that broke its promise).
HiCache has no way to quarantine host pages it will reuse, so the worker ends with a CRITICAL
line saying why rather than feed half-written KV to the GPU.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

FAIL_STOP_EXIT_CODE = 75


def terminate_worker(reason: str) -> None:
    """Log why, flush, and end the process without unwinding into SGLang."""
    log.critical("kvcr: terminating this worker: %s", reason)
    logging.shutdown()
    os._exit(FAIL_STOP_EXIT_CODE)


class FailStop(BaseException):
    """Raised after fail-stop when the process was not actually terminated (tests replace the terminator)."""
