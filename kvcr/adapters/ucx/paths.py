"""Which path UCX gives a read's bytes, and whether a given-up read can still write afterwards.

Measured with ucxx 0.52 / UCX 1.21 (``UCX_PROTO_INFO=y``; a source SIGSTOPped mid-read, see
docs/ucx.md):

- ``ucx_error_handling_mode=peer``: UCX keeps only lanes that can report a peer's failure, tcp
  here, and a rendezvous is *pushed* by the source in fragments. A receive already matched keeps
  landing whenever a stalled source resumes -- after ``cancel`` and after ``disconnect`` too.
- ``none``, both ends on one host and pid namespace, CMA allowed: eager messages up to a few KiB
  through sysv shared memory (each arrives whole), larger ones by a rendezvous the *target*
  pulls with ``process_vm_readv`` inside its own progress: a matched receive ends without the
  source's help, so nothing is left to land later.

So a peer has ``late_writes`` unless the second case holds. The host token says "same host, same
pid namespace, same user" (what CMA needs); CMA is also off when Yama restricts ptrace or the
UCX transport list leaves it out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache


@cache
def host_token() -> str:
    """Boot id, pid namespace and user of this process: equal tokens can use CMA between them."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # unknown: never claim a shared host
    return f"{boot}/{pidns}/{os.getuid()}"


def cma_allowed(options: Mapping[str, str]) -> bool:
    """Whether UCX may use CMA here, by the transport list and the kernel's ptrace policy."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as handle:
            if int(handle.read().strip() or 0) > 0:
                return False
    except (OSError, ValueError):
        pass  # no Yama: ptrace is not restricted beyond same-user
    tls = options.get("TLS", os.environ.get("UCX_TLS", "all")).replace(" ", "")
    names = set(tls.lstrip("^").split(","))
    if tls.startswith("^"):
        return not names & {"cma", "sm", "shm"}
    return bool(names & {"all", "cma", "sm", "shm"})


def late_writes(error_handling: bool, ours: str, theirs: str, options: Mapping[str, str]) -> bool:
    """Whether a read from a peer with host token ``theirs`` may write after we gave it up."""
    receiver_pulls = not error_handling and bool(ours) and ours == theirs and cma_allowed(options)
    return not receiver_pulls
